"""Launching runs on clusters: the Slurm job script of a training run, its submission, and job queries."""

"""Launching runs: the Slurm job script of a training run, its submission and job queries (`sbatch`, `submit`), and
what torchrun tells each process (`torchrun`)."""

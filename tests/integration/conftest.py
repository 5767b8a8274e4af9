"""Fixtures of the integration tests: the local Slurm cluster (tests/slurm_cluster.py)."""

from tests.slurm_cluster import slurm_cluster

__all__ = ["slurm_cluster"]

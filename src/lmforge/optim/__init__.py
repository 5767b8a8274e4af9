"""Optimizers: parameter roles and groups (`groups`), Muon (`muon`; its sharded exchanges in `muon_sharded`, its
orthogonalizations in `polar`, NorMuon's row normalization in `normuon`), the set of optimizers that acts as one
with its gradient clipping and schedule (`optimizers`, `clipping`, `schedule`)."""

from lmforge.optim.optimizers import EXPERT_ROLES, Optimizers, OptimizerStep, build_optimizer, set_lr_multiplier
from lmforge.optim.schedule import wsd_multiplier

__all__ = ["EXPERT_ROLES", "OptimizerStep", "Optimizers", "build_optimizer", "set_lr_multiplier", "wsd_multiplier"]

"""NorMuon's per-neuron normalization of an orthogonalized update (Li et al. 2025, "NorMuon: Making Muon more
efficient and scalable", arXiv:2510.05491)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["normalize_rows"]


def normalize_rows(ortho: Tensor, second_moment: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """NorMuon's step on an orthogonalized update `ortho` [..., R, C] (whole matrices, each row an output neuron)
    with its rows' second-moment state `second_moment` [..., R, 1]; returns the normalized update (`ortho`'s dtype)
    and the new state (`second_moment`'s dtype). `second_moment` is not modified.

    Per matrix O (each [R, C] of the batch), in float32:

    - `v_r <- beta2 * v_r + (1 - beta2) * mean_j O_rj^2` for each row r;
    - `N_rj = O_rj / (sqrt(v_r) + eps)`;
    - the result is `N * ||O||_F / ||N||_F`: the rows are evened out, the update keeps O's Frobenius norm (and so
      Muon's learning-rate scaling keeps its meaning). A zero O gives a zero update.

    As in the NorMuon paper and its reference implementation, `v` has no bias correction: a correction divides
    every row of a matrix by the same factor, which the Frobenius rescaling undoes (up to `eps`).
    """
    o = ortho.float()
    v = second_moment.float().lerp(o.square().mean(dim=-1, keepdim=True), 1 - beta2)
    normalized = o / (v.sqrt() + eps)
    norm_o = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
    norm_n = torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True)
    # a zero O leaves N zero too; the clamp makes that 0 * 0 instead of 0 / 0
    normalized.mul_(norm_o / norm_n.clamp(min=torch.finfo(torch.float32).tiny))
    return normalized.to(ortho.dtype), v.to(second_moment.dtype)

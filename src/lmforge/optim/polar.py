"""Approximate orthogonalization (the polar factor U V^T of G = U S V^T) by odd quintic matrix polynomials, as Muon
uses it: `newton_schulz` repeats one quintic, `polar_express` takes a different, minimax-optimal quintic at each
iteration (Amsel, Persson, Musco, Gower 2025, "The Polar Express: Optimal Matrix Sign Methods and Their
Application to the Muon Algorithm", arXiv:2505.16932).

Both run the same chain of matmuls, `X <- a X + (b X X^T + c (X X^T)^2) X` per iteration, which maps each singular
value s of X to p(s) = a s + b s^3 + c s^5 and keeps the singular vectors; they differ in the starting scale and in
the (a, b, c) of each iteration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_DESIGN",
    "POLAR_EXPRESS_SAFETY",
    "newton_schulz",
    "polar_express",
    "polar_express_coefficients",
]

Quintic = tuple[float, float, float]

# Keller Jordan's quintic: steepest slope at zero that still keeps singular values in a band around 1 after 5 steps
DEFAULT_NS_COEFFICIENTS: Quintic = (3.4445, -4.7750, 2.0315)

POLAR_EXPRESS_DESIGN: tuple[Quintic, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
"""The published Polar Express quintics (arXiv:2505.16932, the authors' reference coefficients for Muon), before
the safety factor. They are designed for singular values in [l0, u0] = [1e-3, 1]: quintic t maps its interval
[l_t, u_t] into [l_{t+1}, u_{t+1}] with l_{t+1} = p_t(l_t) and u_{t+1} = 2 - l_{t+1} (centred on 1). From the fourth
on each is the minimax-optimal odd quintic on its interval (its error |p - 1| equioscillates: p(l) equals its inner
minimum, p(u) its inner maximum); the first three are "cushioned": their inner minimum is held at a tenth of their
maximum instead. The last is the limit of the sequence, the classical Newton–Schulz quintic
(15 x - 10 x^3 + 3 x^5) / 8."""

POLAR_EXPRESS_SAFETY = 1.01
"""Polar Express's safety factor against rounding: every quintic but the last is used as p(x / 1.01), so singular
values that rounding pushed up to 1% beyond the design interval are still mapped into it, and the input is
divided by 1.01 times its Frobenius norm."""

POLAR_EXPRESS_COEFFICIENTS: tuple[Quintic, ...] = (
    *(
        (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
        for a, b, c in POLAR_EXPRESS_DESIGN[:-1]
    ),
    POLAR_EXPRESS_DESIGN[-1],
)
"""The coefficients Polar Express iterates with: `POLAR_EXPRESS_DESIGN` with the safety factor folded in (all but
the last quintic)."""


def polar_express_coefficients(steps: int) -> list[Quintic]:
    """The (a, b, c) of each of `steps` Polar Express iterations: the published ones in order, the last repeated
    when `steps` exceeds them (it is the fixed-point quintic, which only refines an already converged matrix)."""
    table = list(POLAR_EXPRESS_COEFFICIENTS)
    return table[:steps] + [table[-1]] * max(0, steps - len(table))


def newton_schulz(
    g: Tensor,
    steps: int = 5,
    coefficients: Quintic = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    *,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Approximately orthogonalize the matrix `g` [A, B], or each matrix of a batch [..., A, B] (push its singular
    values towards 1), with a quintic iteration.

    Each matrix is divided by its own Frobenius norm (clamped below at `eps`, as torch does, so a zero matrix maps to
    zero), which bounds its spectral norm by 1; then `steps` rounds of `X <- a X + (b X X^T + c (X X^T)^2) X` follow.
    Tall matrices (A > B) are iterated transposed so the Gram matrix is the smaller square. A batch runs as one chain
    of batched matmuls and gives each matrix what a call on that matrix alone gives, up to float rounding; an empty
    batch gives an empty result. With the default coefficients the singular values end in a band around 1, not at 1
    (about 0.68–1.13 after 5 steps for random matrices), which is the intended trade of accuracy for fewer steps.

    The iteration runs in `compute_dtype`, by default bfloat16 on CUDA (fast tensor-core matmuls, as torch does) and
    float32 elsewhere (CPU bfloat16 matmuls are slow, and float32 keeps results comparable to a float tolerance).
    The norms are taken in float32 (float64 for a float64 `g`). Returns a new tensor of `g`'s shape and dtype; `g`
    is not modified.
    """
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz needs 3 coefficients (a, b, c), got {coefficients!r}")
    a, b, c = coefficients
    return _odd_quintics(g, [(a, b, c)] * steps, eps, 1.0, compute_dtype, "newton_schulz")


def polar_express(g: Tensor, steps: int = 5, eps: float = 1e-7, *, compute_dtype: torch.dtype | None = None) -> Tensor:
    """Approximately orthogonalize `g` [A, B] or each matrix of a batch [..., A, B] with Polar Express
    (arXiv:2505.16932): each matrix is divided by `POLAR_EXPRESS_SAFETY` times its Frobenius norm (clamped below at
    `eps`), then iteration t applies the quintic `polar_express_coefficients(steps)[t]`.

    For singular values in the design range [1e-3, 1] after the normalization (smaller ones grow more slowly; none
    shrink), 5 iterations leave them within about [0.84, 1.13] and 6 within about [0.993, 1.002] (random
    rectangular matrices: about 0.87–1.12 after 5), where the fixed quintic of `newton_schulz` stays in its band of
    about 0.68–1.13 however many steps it takes. Everything else (batches, tall matrices, dtypes, `compute_dtype`)
    is as for `newton_schulz`. The published reference adds 1e-7 to the scaled norm where this clamps it at `eps`;
    both map a zero matrix to zero, and they differ only for matrices of norm near `eps`.
    """
    return _odd_quintics(
        g, polar_express_coefficients(steps), eps, POLAR_EXPRESS_SAFETY, compute_dtype, "polar_express"
    )


def _odd_quintics(
    g: Tensor,
    coefficients: Sequence[Quintic],
    eps: float,
    norm_scale: float,
    compute_dtype: torch.dtype | None,
    name: str,
) -> Tensor:
    """Divide each matrix of `g` by `norm_scale` times its Frobenius norm (at least `eps`), then apply one quintic
    `X <- a X + (b X X^T + c (X X^T)^2) X` per entry of `coefficients`."""
    if g.ndim < 2:
        raise ValueError(f"{name} needs a matrix or a batch of matrices, got shape {tuple(g.shape)}")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if g.is_cuda else torch.float32
    tall = g.size(-2) > g.size(-1)
    x = g.mT if tall else g
    norm_dtype = torch.promote_types(g.dtype, torch.float32)  # float32, or float64 for a float64 g
    if g.ndim == 2:
        norm = torch.linalg.vector_norm(x, dtype=norm_dtype)
        multiply_add = torch.addmm
    else:
        # one batch dimension, so that baddbmm runs the whole stack in one call
        x = x.flatten(0, -3)
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
        multiply_add = torch.baddbmm
    if norm_scale != 1.0:
        norm = norm * norm_scale
    x = (x / norm.clamp(min=eps)).to(compute_dtype)
    for a, b, c in coefficients:
        gram = x @ x.mT
        poly = multiply_add(gram, gram, gram, beta=b, alpha=c)
        x = multiply_add(x, poly, x, beta=a)
    if g.ndim > 3:
        x = x.unflatten(0, g.shape[:-2])
    return (x.mT if tall else x).to(g.dtype)

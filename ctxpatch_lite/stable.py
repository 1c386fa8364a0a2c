"""Appendix B: the RMSNorm inversion behind the stable Gemma update.

Given the target branch output ``g`` and the post-norm scale ``m``, find ``x`` with ``RMS(x) = C0`` minimising
``|| m * x / RMS(x) - g ||^2``. Writing ``x = C0 * y`` with ``mean(y^2) = 1``, the Lagrange conditions give

    y_k = g_k m_k / (m_k^2 - mu),   F(mu) = mean_k (g_k m_k)^2 / (m_k^2 - mu)^2 - 1 = 0,

with the root ``mu`` in ``(-inf, min_k m_k^2)``, where F rises monotonically from -1 towards +inf -- *unless* every
coordinate attaining ``min m^2`` has ``g_k m_k = 0``. Then F stays finite at the end of the interval and, if it is
still below 0 there, no interior root exists (the trust-region "hard case"). We then take ``mu = min m^2``, solve
the other coordinates, and put the leftover norm into the minimum-``m^2`` coordinate(s), split evenly.

Everything here runs in float64 whatever the model's dtype; callers cast the result back (see ``algorithm.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InversionResult:
    y: torch.Tensor          # unit-RMS solution, float64
    mu: float                # Lagrange multiplier
    hard_case: bool          # no interior root: the App. B hard case was hit and handled
    iterations: int          # bisection steps
    constraint_residual: float  # |mean(y^2) - 1| before the final renormalisation (0 in the hard case by construction)


def F(mu: float | torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Secular function of the inversion: mean((g m)^2 / (m^2 - mu)^2) - 1 (float64)."""
    g64, m64 = g.to(torch.float64), m.to(torch.float64)
    mu = torch.as_tensor(mu, dtype=torch.float64)
    gm2 = (g64 * m64) ** 2
    return (gm2 / (m64 ** 2 - mu.unsqueeze(-1)) ** 2).mean(-1) - 1.0


def invert_rmsnorm_unit(g: torch.Tensor, m: torch.Tensor, max_iter: int = 2000) -> InversionResult:
    """Solve for unit-RMS ``y`` minimising ``||m * y - g||^2`` (see module docstring). 1-D inputs."""
    if g.dim() != 1 or g.shape != m.shape:
        raise ValueError(f"invert_rmsnorm expects two 1-D tensors of equal length, got {tuple(g.shape)} and {tuple(m.shape)}")
    g64, m64 = g.to(torch.float64), m.to(torch.float64)
    if not (torch.isfinite(g64).all() and torch.isfinite(m64).all()):
        raise ValueError("invert_rmsnorm got non-finite values in g or m")
    n = g64.numel()
    gm = g64 * m64
    m2 = m64 ** 2
    m2_min = float(m2.min())
    at_min = m2 == m2_min
    if not bool((gm[at_min] != 0).any()):
        # F is finite at the end of the interval: check whether a root exists inside it.
        rest = ~at_min
        f_end = float((gm[rest] ** 2 / (m2[rest] - m2_min) ** 2).sum() / n) - 1.0 if rest.any() else -1.0
        if f_end <= 0.0:
            y = torch.zeros_like(g64)
            y[rest] = gm[rest] / (m2[rest] - m2_min)
            leftover = n - float((y[rest] ** 2).sum())
            y[at_min] = (max(leftover, 0.0) / int(at_min.sum())) ** 0.5
            return InversionResult(y=y, mu=m2_min, hard_case=True, iterations=0, constraint_residual=0.0)
    # A bracket where F(lo) < 0 is guaranteed: (m_k^2 - lo)^2 >= (m2_min - lo)^2 > mean(gm^2).
    lo = m2_min - float((gm ** 2).mean().sqrt()) - 1.0
    hi = m2_min
    it = 0
    while it < max_iter:
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break  # the interval cannot shrink further in float64
        if float(F(mid, g64, m64)) < 0.0:
            lo = mid
        else:
            hi = mid
        it += 1
    mu = lo  # F(lo) < 0 <= F(hi): lo keeps every denominator strictly positive
    y = gm / (m2 - mu)
    residual = abs(float((y ** 2).mean()) - 1.0)
    y = y / (y ** 2).mean().sqrt()
    return InversionResult(y=y, mu=mu, hard_case=False, iterations=it, constraint_residual=residual)


def invert_rmsnorm(g: torch.Tensor, m: torch.Tensor, rms: float) -> tuple[torch.Tensor, InversionResult]:
    """Target pre-norm vector ``h_target = rms * y`` with RMS ``rms`` (Appendix B step 1), float64."""
    res = invert_rmsnorm_unit(g, m)
    return res.y * float(rms), res

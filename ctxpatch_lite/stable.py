"""Appendix B: the RMSNorm inversion behind the stable update, vectorised over query rows.

Given the target branch output ``g`` and the post-norm scale ``m``, find ``x`` with ``RMS(x) = C0`` minimising
``|| m * x / RMS(x) - g ||^2``. Writing ``x = C0 * y`` with ``mean(y^2) = 1``, the Lagrange conditions give

    y_k = g_k m_k / (m_k^2 - mu),   F(mu) = mean_k (g_k m_k)^2 / (m_k^2 - mu)^2 - 1 = 0,

with the root ``mu`` in ``(-inf, min_k m_k^2)``, where F rises monotonically from -1 towards +inf -- *unless* every
coordinate attaining ``min m^2`` has ``g_k m_k = 0``. Then F stays finite at the end of the interval and, if it is
still below 0 there, no interior root exists (the trust-region "hard case"). We then take ``mu = min m^2``, solve
the other coordinates, and put the leftover norm into the minimum-``m^2`` coordinate(s), split evenly.

Everything runs in float64 on the device of its inputs, as tensor operations over all rows at once: the bisection
is a fixed budget of iterations (a row whose interval can no longer shrink in float64 stops moving), and the hard
case is selected row by row with ``torch.where``. On the CPU the loop stops early once no row moves (free there);
on a GPU it runs the whole budget rather than ask the host after every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ITERATIONS = 2000
_CHUNK = 25


@dataclass
class InversionResult:
    y: torch.Tensor            # unit-RMS solution (N, d) or (d,), float64
    mu: torch.Tensor           # Lagrange multiplier per row
    hard_case: torch.Tensor    # bool per row: no interior root; the App. B hard case was hit and handled
    iterations: torch.Tensor   # bisection steps that shrank the interval, per row
    constraint_residual: torch.Tensor  # |mean(y^2) - 1| before the final renormalisation (0 in the hard case)


def F(mu, g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Secular function of the inversion: mean((g m)^2 / (m^2 - mu)^2) - 1 (float64)."""
    g64, m64 = g.to(torch.float64), m.to(torch.float64)
    mu = torch.as_tensor(mu, dtype=torch.float64, device=g64.device)
    return ((g64 * m64) ** 2 / (m64 ** 2 - mu.unsqueeze(-1)) ** 2).mean(-1) - 1.0


def invert_rows(g: torch.Tensor, m: torch.Tensor, max_iter: int = MAX_ITERATIONS) -> InversionResult:
    """Unit-RMS ``y`` minimising ``||m * y - g||^2`` for every row of ``g`` (N, d); ``m`` (d,) is shared."""
    g64, m64 = g.to(torch.float64), m.to(device=g.device, dtype=torch.float64)
    n = g64.shape[-1]
    gm, m2 = g64 * m64, m64 ** 2
    gm2 = gm ** 2
    m2_min = m2.min()
    at_min = m2 == m2_min
    rest = ~at_min
    # Hard case: every minimum-m^2 coordinate has g m = 0 and F is still <= 0 at the end of the interval.
    denom_end = torch.where(rest, m2 - m2_min, torch.ones_like(m2))
    f_end = (torch.where(rest, gm2 / denom_end ** 2, torch.zeros_like(gm2))).sum(-1) / n - 1.0
    hard = (torch.where(at_min, gm, torch.zeros_like(gm)) == 0).all(-1) & (f_end <= 0)
    # Bisection on (lo, hi): F(lo) < 0 is guaranteed since (m_k^2 - lo)^2 >= (m2_min - lo)^2 > mean(gm^2).
    lo = m2_min - gm2.mean(-1).sqrt() - 1.0
    hi = torch.full_like(lo, 0.0) + m2_min
    iters = torch.zeros_like(lo, dtype=torch.long)
    done = 0
    while done < max_iter:
        for _ in range(min(_CHUNK, max_iter - done)):
            mid = 0.5 * (lo + hi)
            moving = (mid > lo) & (mid < hi)
            neg = ((gm2 / (m2 - mid.unsqueeze(-1)) ** 2).mean(-1) - 1.0) < 0.0
            lo = torch.where(moving & neg, mid, lo)
            hi = torch.where(moving & ~neg, mid, hi)
            iters += moving
        done += _CHUNK
        if g64.device.type == "cpu" and _cpu_only_converged(moving):
            break
    mu = lo   # F(lo) < 0 <= F(hi): lo keeps every denominator strictly positive
    y = gm / (m2 - mu.unsqueeze(-1))
    ms = (y ** 2).mean(-1)
    residual = (ms - 1.0).abs()
    y = y / ms.sqrt().unsqueeze(-1)
    # The hard case, for the rows that have it.
    y_h = torch.where(rest, gm / denom_end, torch.zeros_like(gm))
    leftover = (n - (y_h ** 2).sum(-1)).clamp_min(0.0) / at_min.sum()
    y_h = torch.where(at_min, leftover.sqrt().unsqueeze(-1).expand_as(y_h), y_h)
    h = hard.unsqueeze(-1)
    return InversionResult(y=torch.where(h, y_h, y), mu=torch.where(hard, m2_min.expand_as(mu), mu), hard_case=hard,
                           iterations=torch.where(hard, torch.zeros_like(iters), iters),
                           constraint_residual=torch.where(hard, torch.zeros_like(residual), residual))


def _cpu_only_converged(moving: torch.Tensor) -> bool:
    """Early exit of the bisection, asked on the CPU only (free there; a GPU runs the whole budget instead)."""
    return not bool(moving.any())


@dataclass
class Inversion1D:
    """One row's inversion as Python numbers (notebook 04 and tests)."""

    y: torch.Tensor
    mu: float
    hard_case: bool
    iterations: int
    constraint_residual: float


def invert_rmsnorm_unit(g: torch.Tensor, m: torch.Tensor, max_iter: int = MAX_ITERATIONS) -> Inversion1D:
    """``invert_rows`` for one 1-D target, with its results as Python numbers."""
    if g.dim() != 1 or g.shape != m.shape:
        raise ValueError(f"invert_rmsnorm expects two 1-D tensors of equal length, got {tuple(g.shape)} and "
                         f"{tuple(m.shape)}")
    if not (torch.isfinite(g).all() and torch.isfinite(m).all()):
        raise ValueError("invert_rmsnorm got non-finite values in g or m")
    r = invert_rows(g.reshape(1, -1), m, max_iter)
    return Inversion1D(y=r.y[0], mu=float(r.mu[0]), hard_case=bool(r.hard_case[0]), iterations=int(r.iterations[0]),
                       constraint_residual=float(r.constraint_residual[0]))


def invert_rmsnorm(g: torch.Tensor, m: torch.Tensor, rms) -> tuple[torch.Tensor, Inversion1D]:
    """Target pre-norm vector ``h_target = rms * y`` with RMS ``rms`` (Appendix B step 1), float64, 1-D."""
    res = invert_rmsnorm_unit(g, m)
    return res.y * float(rms), res

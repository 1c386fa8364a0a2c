"""Patches as data, and the single-block update formulas (paper Theorem 1, Appendix B).

A ``Rank1`` holds ``dW = u z^T / ||z||^2`` by its factors; a ``LayerPatch`` holds one layer's rank-1 matrix patches,
its post-norm scale patch ``dm`` (and, for the ``vanilla`` control only, an additive bias on the down projection),
plus ``PatchDiagnostics``. Nothing here touches a model: ``engine.py`` applies patches.

Precision: every formula runs in the *patch dtype* (float32 for float32/bfloat16 models, float64 for float64
models, unless the caller overrides it). Inputs are cast to it on entry; the results stay in it. Where the patch is
stored into a model (materialized mode) or added to a module output (factored mode), ``engine.py`` casts it to the
model dtype, and says so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .stable import invert_rmsnorm


class PatchError(ValueError):
    """A patch cannot be built (e.g. ``z == 0``); the message names the layer and the condition."""


@dataclass
class Rank1:
    """``dW = u z^T / ||z||^2``: ``dW x = u (z . x) / ||z||^2`` and, on ``z`` itself, ``dW z = u``.

    ``u`` (out,) and ``z`` (in,) for one query; or (N, out) and (N, in) for N independent query rows, one patch
    per row (the batched teacher-forced path).
    """

    u: torch.Tensor
    z: torch.Tensor

    @property
    def z_norm2(self) -> torch.Tensor:
        return (self.z * self.z).sum(-1)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``dW`` to ``x`` (..., in) -> (..., out) in the patch dtype, without forming ``dW``.

        With N rows, ``x`` is split into N groups along its leading dimensions (row i gets patch i).
        """
        u2, z2 = self.u.reshape(-1, self.u.shape[-1]), self.z.reshape(-1, self.z.shape[-1])
        n = z2.shape[0]
        x3 = x.to(self.z.dtype).reshape(n, -1, x.shape[-1])
        coef = torch.einsum("nki,ni->nk", x3, z2) / (z2 * z2).sum(-1, keepdim=True)
        return (coef.unsqueeze(-1) * u2.unsqueeze(1)).reshape(*x.shape[:-1], u2.shape[-1])

    def dense(self) -> torch.Tensor:
        if self.u.dim() != 1:
            raise ValueError("dense() needs a single-row patch; batched patches stay factored")
        return torch.outer(self.u, self.z) / self.z_norm2

    def row(self, i: int) -> "Rank1":
        return self if self.u.dim() == 1 else Rank1(u=self.u[i], z=self.z[i])

    @property
    def frobenius(self) -> float:
        return float(self.u.norm() / self.z.norm())


@dataclass
class PatchDiagnostics:
    layer: int
    z_norm: float = float("nan")          # ||z|| of the no-context MLP input
    min_abs_h: float = float("nan")       # smallest |h_i| divided by in the scale patch
    fallbacks: int = 0                     # coordinates with h_i == 0 that divided by 1 instead (paper 4.1)
    hard_case: bool = False                # App. B: no interior root of F(mu); handled
    bisection_iterations: int = 0
    dv_norm: float = float("nan")          # ||v_C - v||: what the output patch must absorb
    gate_fro: float = 0.0
    up_fro: float = 0.0
    down_fro: float = 0.0
    dm_l2: float = 0.0
    dm_max_abs: float = 0.0
    bias_l2: float = 0.0                   # vanilla control only

    @property
    def matrix_norm(self) -> float:
        return float((self.gate_fro ** 2 + self.up_fro ** 2 + self.down_fro ** 2) ** 0.5)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["matrix_norm"] = self.matrix_norm
        return d


@dataclass
class LayerPatch:
    layer: int
    gate: Rank1 | None = None
    up: Rank1 | None = None
    down: Rank1 | None = None
    dm: torch.Tensor | None = None          # added to the post-feedforward norm scale m (Gemma: to `weight`)
    down_bias: torch.Tensor | None = None   # vanilla control: dv added to the down-projection output
    diagnostics: PatchDiagnostics = field(default_factory=lambda: PatchDiagnostics(layer=-1))

    dv: torch.Tensor | None = None          # v_C - v this patch absorbs (rows while being built)
    h_den: torch.Tensor | None = None       # what dm divided by
    rows_info: list | None = None           # stable variant: per-row InversionResult

    def summary(self) -> dict:
        return self.diagnostics.to_dict()

    def row(self, i: int) -> "LayerPatch":
        """Query row ``i`` of a patch built for N rows, as a 1-D patch with its own diagnostics."""
        sel = lambda t: None if t is None else (t[i] if t.dim() == 2 else t)  # noqa: E731
        diag = PatchDiagnostics(layer=self.layer)
        p = LayerPatch(layer=self.layer, gate=self.gate.row(i) if self.gate else None,
                       up=self.up.row(i) if self.up else None, down=self.down.row(i) if self.down else None,
                       dm=sel(self.dm), down_bias=sel(self.down_bias), diagnostics=diag, dv=sel(self.dv),
                       h_den=sel(self.h_den))
        if p.h_den is not None:
            diag.fallbacks, diag.min_abs_h = int((p.h_den == 0).sum()), float(p.h_den.abs().min())
        if self.rows_info is not None:
            diag.hard_case, diag.bisection_iterations = self.rows_info[i].hard_case, self.rows_info[i].iterations
        if p.dv is not None:
            diag.dv_norm = float(p.dv.norm())
        return fill_norms(p)


def default_patch_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """float64 models keep float64; float32 and bfloat16 models build patches in float32."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def input_patch(W: torch.Tensor, z: torch.Tensor, z_C: torch.Tensor, pdtype: torch.dtype, layer: int = -1,
                name: str = "W") -> Rank1:
    """Eqs. 2-3: ``dW = W (z_C - z) z^T / ||z||^2`` so that ``(W + dW) z = W z_C``. ``z``: (in,) or (N, in)."""
    z_p = z.to(pdtype)
    if not bool((z_p != 0).any(-1).all()):
        raise PatchError(f"layer {layer}: the MLP input z is the zero vector, so the rank-1 patch of {name} "
                         f"(dW = W (z_C - z) z^T / ||z||^2) does not exist; Theorem 1 requires z != 0")
    u = torch.nn.functional.linear(z_C.to(pdtype) - z_p, W.to(pdtype))  # = W (z_C - z), row by row
    return Rank1(u=u, z=z_p)


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """``num / den`` elementwise, dividing by 1 where ``den == 0`` exactly (the paper's NaN guard).

    Returns the quotient, the number of fallback coordinates, and min |den|.
    """
    zero = den == 0
    n_fallback = int(zero.sum())
    q = num / torch.where(zero, torch.ones_like(den), den)
    return q, n_fallback, float(den.abs().min())


def stable_down_patch(g: torch.Tensor, m: torch.Tensor, h_down: torch.Tensor, h_gated: torch.Tensor,
                      pdtype: torch.dtype, diag: PatchDiagnostics) -> tuple[Rank1, torch.Tensor, list]:
    """Appendix B steps 1-2: invert the RMSNorm for the target ``g`` and patch ``W_down`` by rank 1.

    Rows (N, d) are inverted one by one, each in float64. Returns the down-projection patch, ``h_target`` (in
    ``pdtype``) and the per-row ``InversionResult`` list.
    """
    g2, hd2 = g.reshape(-1, g.shape[-1]).to(torch.float64), h_down.reshape(-1, h_down.shape[-1]).to(torch.float64)
    m64 = m.to(torch.float64)
    targets, infos = [], []
    for gi, hdi in zip(g2, hd2):
        t, res = invert_rmsnorm(gi, m64, float(hdi.pow(2).mean().sqrt()))
        targets.append(t)
        infos.append(res)
    h_target64 = torch.stack(targets).reshape(h_down.shape)
    diag.hard_case = any(r.hard_case for r in infos)
    diag.bisection_iterations = max(r.iterations for r in infos)
    hg = h_gated.to(pdtype)
    if not bool((hg != 0).any(-1).all()):
        raise PatchError(f"layer {diag.layer}: the gated MLP hidden is the zero vector; the rank-1 W_down patch "
                         f"of Appendix B needs h_gated != 0")
    down = Rank1(u=(h_target64 - h_down.to(torch.float64)).to(pdtype), z=hg)
    return down, h_target64.to(pdtype), infos


def fill_norms(p: LayerPatch) -> LayerPatch:
    d = p.diagnostics
    d.gate_fro = p.gate.frobenius if p.gate is not None else 0.0
    d.up_fro = p.up.frobenius if p.up is not None else 0.0
    d.down_fro = p.down.frobenius if p.down is not None else 0.0
    if p.dm is not None:
        d.dm_l2 = float(p.dm.norm())
        d.dm_max_abs = float(p.dm.abs().max())
    if p.down_bias is not None:
        d.bias_l2 = float(p.down_bias.norm())
    if p.gate is not None:
        d.z_norm = float(p.gate.z.norm())
    return p

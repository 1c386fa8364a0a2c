"""Patches as data (paper Theorem 1, Section 5): rank-1 factors and vectors, one ``LayerPatch`` per layer.

A ``Rank1`` holds ``dW = u z^T / ||z||^2`` by its factors, for N query rows at once (``u`` (N, out), ``z`` (N, in));
MoE expert patches add an expert axis, (N, k, .). A ``LayerPatch`` holds one layer's patches for every family:

* ``inputs``: name -> ``Rank1`` (``gate_proj``, ``up_proj``, ``c_fc``, ``router``, ``experts.gate_up``, ...);
* ``output``: ``"scale"`` -> dm (N, d), ``"bias"`` -> db (N, d), ``"matrix"`` / ``"down"`` / ``"experts.down"`` ->
  ``Rank1``;
* ``vanilla``: the vanilla control's dv, added to the MLP output (no output patch);
* ``diag``: name -> (N,) tensor, kept on the model's device until a step fetches them all at once.

Precision: every formula runs in the *patch dtype* (float32 for float32/bfloat16 models, float64 for float64
models, unless the caller overrides it); ``hooks.WeightScope`` holds the one rule that casts patches into weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .hooks import PatchError

DIAG_KEYS = ("z_norm", "dv_norm", "min_abs_h", "fallbacks", "hard_case", "iterations", "h_norm", "S",
             "routing_match", "matrix_norm", "dm_l2", "dm_max_abs", "bias_l2", "block_error", "dm_top_l2",
             "matrix_ref", "scale_ref", "fallbacks_m0", "fallback_miss")
TOP_SHARE = 0.01   # dm_top_l2: the norm of dm restricted to its largest 1 % of coordinates (at least one)


@dataclass
class Rank1:
    """``dW = u z^T / ||z||^2``: ``dW x = u (z . x) / ||z||^2``; on ``z`` itself ``dW z = u``."""

    u: torch.Tensor
    z: torch.Tensor

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """``dW x`` in the patch dtype without forming ``dW``; ``x`` (..., in) is split into N groups of rows along
        its leading dimensions (row group i gets patch i)."""
        u2, z2 = self.u.reshape(-1, self.u.shape[-1]), self.z.reshape(-1, self.z.shape[-1])
        n = z2.shape[0]
        x3 = x.to(self.z.dtype).reshape(n, -1, x.shape[-1])
        coef = torch.einsum("nki,ni->nk", x3, z2) / (z2 * z2).sum(-1, keepdim=True)
        return (coef.unsqueeze(-1) * u2.unsqueeze(1)).reshape(*x.shape[:-1], u2.shape[-1])

    def dense(self, i: int = 0) -> torch.Tensor:
        """Row ``i``'s dense ``dW`` (out, in)."""
        u, z = self.u.reshape(-1, self.u.shape[-1])[i], self.z.reshape(-1, self.z.shape[-1])[i]
        return torch.outer(u, z) / (z * z).sum()

    def fro(self) -> torch.Tensor:
        """||dW||_F = ||u|| / ||z|| per row (summed in quadrature over an expert axis), as an (N,) tensor."""
        f2 = self.u.norm(dim=-1).pow(2) / self.z.norm(dim=-1).pow(2)
        return (f2 if f2.dim() == 1 else f2.sum(-1)).sqrt()


@dataclass
class LayerPatch:
    layer: int
    kind: str = "scale"
    inputs: dict = field(default_factory=dict)
    output: dict = field(default_factory=dict)
    vanilla: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    diag: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)   # MoE: the selected experts (N, k)

    # -- views used by notebooks and tests ------------------------------------------------------------------
    @property
    def dm(self):
        return self.output.get("scale")

    @property
    def gate(self):
        return self.inputs.get("gate_proj")

    @property
    def up(self):
        return self.inputs.get("up_proj")

    @property
    def down(self):
        return self.output.get("down")

    def n_rows(self) -> int:
        return self.dv.shape[0] if self.dv is not None else 1

    def finish(self, refs: dict | None = None) -> "LayerPatch":
        """Add the norm diagnostics (tensors; no host transfer). ``refs`` (``Adapter.reference_norms``) gives the
        norms of the unpatched parameters the patch is added to: ``matrix_ref`` (Frobenius norm of the patched
        matrices together) and ``scale_ref`` (``||m||``), so that patch sizes can be read relative to them."""
        mats = [(k, r) for k, r in list(self.inputs.items()) + list(self.output.items()) if isinstance(r, Rank1)]
        n = self.n_rows()
        if refs and mats and all(k in refs for k, _ in mats):
            self.diag["matrix_ref"] = torch.stack([refs[k] for k, _ in mats]).pow(2).sum().sqrt().expand(n)
        if refs and self.dm is not None and "scale" in refs:
            self.diag["scale_ref"] = refs["scale"].expand(n)
        if mats:
            total = torch.zeros(n, dtype=torch.float64, device=mats[0][1].u.device)
            for key, r in mats:
                f2 = r.fro().to(torch.float64).pow(2)
                if f2.shape[0] == n:
                    total = total + f2
                else:   # a MoE expert patch of one row: "expert{e}.row{i}.…"
                    i = int(key.split(".row")[1].split(".")[0])
                    total[i] = total[i] + f2[0]
            self.diag["matrix_norm"] = total.sqrt()
        if self.dm is not None:
            self.diag["dm_l2"] = self.dm.norm(dim=-1).to(torch.float64)
            self.diag["dm_max_abs"] = self.dm.abs().amax(-1).to(torch.float64)
            k = max(1, math.ceil(TOP_SHARE * self.dm.shape[-1]))
            self.diag["dm_top_l2"] = self.dm.to(torch.float64).pow(2).topk(k, dim=-1).values.sum(-1).sqrt()
        if "bias" in self.output or self.vanilla is not None:
            b = self.output.get("bias", self.vanilla)
            self.diag["bias_l2"] = b.norm(dim=-1).to(torch.float64)
        return self

    def diag_matrix(self, n: int, device) -> torch.Tensor:
        """(len(DIAG_KEYS), n) float64, NaN where a key does not apply."""
        out = torch.full((len(DIAG_KEYS), n), math.nan, dtype=torch.float64, device=device)
        for i, k in enumerate(DIAG_KEYS):
            if k in self.diag:
                out[i] = self.diag[k].to(device=device, dtype=torch.float64).reshape(-1)[:n]
        return out

    @property
    def diagnostics(self) -> "Diagnostics":
        """Row 0's diagnostics as Python numbers (one host transfer; for notebooks and tests, not hot paths)."""
        vals = self.diag_matrix(1, self.dv.device if self.dv is not None else "cpu")[:, 0].tolist()
        return Diagnostics(self.layer, dict(zip(DIAG_KEYS, vals)))


class Diagnostics:
    """Attribute access to one row's diagnostics: ``d.fallbacks``, ``d.min_abs_h``, ``d.dv_norm`` ..."""

    def __init__(self, layer: int, values: dict):
        self.layer, self._v = layer, values

    def __getattr__(self, k):
        v = self._v.get(k, math.nan)
        if k in ("fallbacks", "iterations"):
            return 0 if math.isnan(v) else int(v)
        if k in ("hard_case", "routing_match"):
            return False if math.isnan(v) else bool(v)
        return v


def default_patch_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """float64 models keep float64; float32 and bfloat16 models build patches in float32."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


_SCRATCH: dict = {}


def in_patch_dtype(W: torch.Tensor, pdtype: torch.dtype) -> torch.Tensor:
    """``W`` in the patch dtype, for one product used at once: a weight of another dtype (bfloat16) is copied into a
    scratch buffer kept per (shape, dtype, device) rather than into a fresh block. The values are those of
    ``W.to(pdtype)``; the time is not: on the CPU under ``notebook.low_memory`` a fresh multi-megabyte block is mapped
    and faulted in page by page (5 ms against 0.3 ms for a 2048 x 640 weight, every layer of every pass). The next
    call with the same shape overwrites the buffer, so never keep the result."""
    if W.dtype == pdtype or not W.is_contiguous() or torch.is_grad_enabled():   # (a strided view keeps its layout;
        return W.to(pdtype)                                                        #  a graph needs its own tensor)
    key = (tuple(W.shape), pdtype, W.device)
    buf = _SCRATCH.get(key)
    if buf is None:
        with torch.inference_mode(False):          # a normal tensor, usable in and out of inference mode
            buf = _SCRATCH[key] = torch.empty(W.shape, dtype=pdtype, device=W.device)
    return buf.copy_(W.detach())


def free_scratch() -> None:
    """Drop the cast buffers (``in_patch_dtype``), e.g. before loading another model."""
    _SCRATCH.clear()


def input_patch(W: torch.Tensor, z: torch.Tensor, z_C: torch.Tensor, pdtype: torch.dtype) -> Rank1:
    """Eqs. 2-3: ``dW = W (z_C - z) z^T / ||z||^2`` so that ``(W + dW) z = W z_C``; ``z`` (N, in) rows, ``W``
    (out, in). Needs ``z != 0`` (checked by ``zero_rows``)."""
    z_p = z.to(pdtype)
    u = torch.nn.functional.linear(z_C.to(pdtype) - z_p, in_patch_dtype(W, pdtype))   # = W (z_C - z), row by row
    return Rank1(u=u, z=z_p)


def zero_rows(t: torch.Tensor) -> torch.Tensor:
    """True where a row is the zero vector (a 0-d bool tensor: any row), for the deferred condition checks."""
    return (t == 0).all(-1).any()


def check_input_patch(z: torch.Tensor, layer: int, name: str = "W") -> None:
    """The immediate (host-synchronising) form of the ``z != 0`` condition, for callers outside a pass."""
    if bool(zero_rows(z)):
        raise PatchError(z_zero_message(layer, name))


def z_zero_message(layer: int, name: str) -> str:
    return (f"layer {layer}: the MLP input z is the zero vector, so the rank-1 patch of {name} "
            f"(dW = W (z_C - z) z^T / ||z||^2) does not exist; Theorem 1 requires z != 0")


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num / den`` elementwise, dividing by 1 where ``den == 0`` exactly (the paper's NaN guard).

    Returns the quotient, the number of fallback coordinates per row and min |den| per row (tensors).
    """
    zero = den == 0
    q = num / torch.where(zero, torch.ones_like(den), den)
    return q, zero.sum(-1).to(torch.float64), den.abs().amin(-1).to(torch.float64)

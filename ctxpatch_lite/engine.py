"""The one mechanism that applies patches to a transformers model: forward hooks around the MLP of each layer.

For one forward of the query token, ``PatchHooks`` installs hooks on the decoder layers it is given a
``LayerSpec`` for. A spec either carries a ready ``LayerPatch`` (apply it) or the recorded full-context targets
(compute the patch *inside this pass*, from the values this very pass produces, then apply it). On exit every hook
is removed and every parameter it wrote is restored from a saved copy, bit for bit.

Application modes:
* ``materialized``: the patched matrices ``W + dW`` and the patched scale ``w + dm`` are computed in the patch dtype
  and **cast to the model dtype** when written into the parameters -- what a real patched checkpoint would hold.
* ``factored``: no dense copy; ``dW x = u (z.x)/||z||^2`` is computed in the patch dtype and **cast to the model
  dtype** when added to the Linear output; the post-norm output ``N(y) * (1 + w + dm)`` is computed in the norm's
  dtype (float32, or float64 for float64 models) and cast to the model dtype, exactly where Gemma casts.

Gemma's RMSNorm upcasts to float32 even for float64 models; ``float64_norms`` (used automatically for float64
models) recomputes every RMSNorm in float64 so that float64 checks are float64 end to end.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .patches import (LayerPatch, PatchDiagnostics, default_patch_dtype, input_patch,
                      safe_divide, stable_down_patch)

VARIANTS = ("naive", "stable")
H_SOURCES = ("actual", "recorded")
APPLY_MODES = ("materialized", "factored")


class UnsupportedArchitectureError(ValueError):
    """The model has no adapter in this engine; the message names the missing property."""


@dataclass
class GemmaLayerParts:
    layer: torch.nn.Module
    pre_ff: torch.nn.Module
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    post_ff: torch.nn.Module


class GemmaAdapter:
    """The Gemma 2/3 instance of the controllability framework, for this fast engine.

    The parts are located by ``controllability.BlockAdapter`` from the ``gemma2``/``gemma3`` family entries: v is the
    input of ``pre_feedforward_layernorm``, the input controllers are ``gate_proj``/``up_proj``, and the output
    controller is the post-feedforward RMSNorm scale ``m = 1 + weight``. Other families run through
    ``architectures.run_algorithm1`` (the same patches, materialized by the generic ``ControlledPass``).
    """

    supported = ("gemma3_text", "gemma3", "gemma2")

    def __init__(self, model):
        from .controllability import BlockAdapter

        self.model = model
        mtype = getattr(model.config, "model_type", None)
        if mtype not in self.supported:
            raise UnsupportedArchitectureError(
                f"model_type {mtype!r} ({type(model).__name__}) has no adapter in ctxpatch_lite's Gemma engine: it "
                f"needs Gemma 2/3 decoder layers with an MLP (gate_proj, up_proj, down_proj) followed by a "
                f"post_feedforward_layernorm whose trainable scale is the output-controllable parameter. "
                f"Supported model types: {', '.join(self.supported)}. Other families (Llama, Mistral, Qwen, MoE, "
                f"GPT-2, Falcon, GPT-J, OLMo 2) run through ctxpatch_lite.architectures.run_algorithm1")
        blocks = BlockAdapter(model)
        self.family = blocks.family
        self.scale_offset = blocks.family.scale_offset
        self.layers = [P.layer for P in blocks.parts]
        self.parts = [GemmaLayerParts(P.layer, P.v_site, dict(P.inputs)["gate_proj"], dict(P.inputs)["up_proj"],
                                      P.mlp.down_proj, P.output) for P in blocks.parts]
        self.dtype = next(model.parameters()).dtype
        self.norm_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.eps = float(self.parts[0].post_ff.eps)

    @property
    def n_layers(self) -> int:
        return len(self.parts)

    def normalize(self, y: torch.Tensor) -> torch.Tensor:
        """Unit-scale RMS normalisation N(y) in the norm's compute dtype, as Gemma's RMSNorm does it."""
        return unit_rms(y.to(self.norm_dtype), self.eps)

    def scale(self, l: int) -> torch.Tensor:
        """The post-feedforward scale m = 1 + weight of layer l, in the norm dtype."""
        return self.scale_offset + self.parts[l].post_ff.weight.to(self.norm_dtype)


def unit_rms(y: torch.Tensor, eps: float) -> torch.Tensor:
    """N(y) = y / sqrt(mean(y^2) + eps), in y's dtype: the unit-scale RMS normalisation every RMSNorm applies."""
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)


def last_row(t: torch.Tensor) -> torch.Tensor:
    """The query position's vector: the last row of a (..., T, d) activation, as a 1-D tensor."""
    return t.reshape(-1, t.shape[-1])[-1]


def rmsnorm_eps(mod) -> float | None:
    """The epsilon of an RMSNorm module (``eps`` in Gemma, ``variance_epsilon`` in Llama-style classes)."""
    eps = getattr(mod, "eps", None)
    return getattr(mod, "variance_epsilon", None) if eps is None else eps


def rmsnorm_offset(mod) -> float:
    """Gemma's RMSNorm scales by ``1 + weight``; Llama-style ones (Llama, Qwen, Mixtral, OLMo 2) by ``weight``."""
    return 1.0 if type(mod).__name__.startswith("Gemma") else 0.0


def _rmsnorm_norm_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and rmsnorm_eps(m) is not None]


@contextlib.contextmanager
def float64_norms(model):
    """Recompute every RMSNorm in float64 when the model is float64 (transformers' classes upcast to float32 only).

    Gemma-style norms scale by ``1 + weight``, the others by ``weight`` (``rmsnorm_offset``); a norm without a
    trainable weight scales by 1.
    """
    handles = []

    def hook(mod, args, out):
        n = unit_rms(args[0].to(torch.float64), rmsnorm_eps(mod))
        w = getattr(mod, "weight", None)
        if w is not None:
            n = n * (rmsnorm_offset(mod) + w.to(torch.float64))
        return n.to(args[0].dtype)

    if next(model.parameters()).dtype == torch.float64:
        handles = [m.register_forward_hook(hook) for m in _rmsnorm_norm_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class LayerTargets:
    """What the full-context pass recorded at the query position for one layer (1-D, model dtype)."""

    x_in: torch.Tensor      # layer input (residual stream)
    v: torch.Tensor         # v_C: after attention + residual
    z: torch.Tensor         # z_C: MLP input (pre-feedforward norm output)
    h_gated: torch.Tensor   # gated hidden act(W_gate z_C) * (W_up z_C)
    h_down: torch.Tensor    # W_down h_gated
    out: torch.Tensor       # layer output


@dataclass
class LayerSpec:
    """How one layer behaves in a patched pass.

    parts: subset of {"input", "output", "vanilla"}: rank-1 gate/up patches, the output patch of the variant
    (naive: dm; stable: W_down + dm), or the vanilla control (dv added to the down-projection output).
    """

    patch: LayerPatch | None = None
    targets: LayerTargets | None = None
    parts: frozenset = frozenset({"input", "output"})
    variant: str = "naive"
    h_source: str = "actual"
    ideal_input: torch.Tensor | None = None


@dataclass
class PassRecord:
    """What one patched pass produced. With N query rows (batched), ``rows[i]`` holds row i's patches."""

    patches: dict = field(default_factory=dict)        # layer -> LayerPatch of row 0 (the only row when N = 1)
    rows: list = field(default_factory=list)           # per query row: layer -> LayerPatch
    outputs: dict = field(default_factory=dict)        # layer -> (N, d) output rows of the (patched) layer


def query_rows(t: torch.Tensor) -> torch.Tensor:
    """(N, d) query rows of a (N, 1, d) activation (N independent one-token sequences; N = 1 step by step)."""
    return t.reshape(-1, t.shape[-1])


class HookScope:
    """Base of the hook context managers: hooks registered into ``self._handles`` are all removed on exit."""

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


class WeightScope(HookScope):
    """A ``HookScope`` that also writes patches into parameters (``_add``) and restores them bit for bit on exit,
    also when the pass fails midway. Subclasses set ``pdtype`` and ``_saved = {}``."""

    def _add(self, param: torch.nn.Parameter, delta: torch.Tensor, index=None) -> None:
        """Materialize ``param[index] += delta``: computed in the patch dtype, stored in the model dtype (the cast)."""
        if id(param) not in self._saved:
            self._saved[id(param)] = (param, param.detach().clone())
        with torch.no_grad():
            view = param if index is None else param[index]
            view.copy_((view.to(self.pdtype) + delta.to(self.pdtype)).to(param.dtype))

    def __exit__(self, *exc):
        super().__exit__(*exc)
        with torch.no_grad():
            for param, orig in self._saved.values():
                param.copy_(orig)
        self._saved.clear()
        return False


class PatchHooks(WeightScope):
    """Context manager: apply (and, where asked, compute) layer patches during one forward; restore on exit.

    The forward it wraps runs N independent one-token sequences (input shape (N, 1)); targets in the specs are
    (N, d) (or (d,) for N = 1). Each row gets its own patch, computed from that row's values in this very pass.
    """

    def __init__(self, adapter: GemmaAdapter, specs: dict, apply: str = "factored", pdtype: torch.dtype | None = None):
        if apply not in APPLY_MODES:
            raise ValueError(f"unknown apply mode {apply!r}; choose one of: {', '.join(APPLY_MODES)}")
        self.ad = adapter
        self.specs = specs
        self.apply = apply
        self.pdtype = pdtype or default_patch_dtype(adapter.dtype)
        self.record = PassRecord()
        self._handles = []
        self._saved = {}          # id(param) -> (param, original clone)
        self._built = {}          # layer -> LayerPatch being built (rows)

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _write_rank1(self, lin: torch.nn.Linear, r1) -> None:
        """Materialize ``W + dW`` for one (single-row) rank-1 patch."""
        self._add(lin.weight, r1.row(0).dense())

    def _write_scale(self, norm: torch.nn.Module, dm: torch.Tensor) -> None:
        """Materialize ``w + dm`` for the post-feedforward norm scale."""
        self._add(norm.weight, dm.reshape(-1))

    def __enter__(self):
        for l, spec in self.specs.items():
            self._install(l, spec)
        return self.record

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:
            self._split_rows()
        return False

    def _split_rows(self):
        if not self.specs:
            return
        n = max(t.shape[0] for t in self.record.outputs.values())
        self.record.rows = [{} for _ in range(n)]
        for l in self.specs:
            built = self._built.get(l)
            for i in range(n):
                self.record.rows[i][l] = built.row(i) if built is not None else self.specs[l].patch
        self.record.patches = dict(self.record.rows[0]) if self.record.rows else {}

    # -- per layer -----------------------------------------------------------------------------------------
    def _install(self, l: int, spec: LayerSpec):
        P = self.ad.parts[l]
        st = {}
        if spec.patch is None and spec.targets is not None:
            patch = self._built[l] = LayerPatch(layer=l, diagnostics=PatchDiagnostics(layer=l))
            self._install_compute(l, spec, patch, st)
        else:
            patch = spec.patch
            if self.apply == "materialized":
                self._materialize_fixed(l, patch)

        def layer_pre(mod, args, kwargs):
            x = args[0]
            return (spec.ideal_input.to(x.dtype).reshape(x.shape).contiguous(),) + args[1:], kwargs

        def layer_post(mod, args, out):
            self.record.outputs[l] = query_rows(out[0] if isinstance(out, tuple) else out).detach().clone()

        if spec.ideal_input is not None:  # the ideal mode feeds the recorded full-context input
            self._handles.append(P.layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
        self._handles.append(P.layer.register_forward_hook(layer_post))
        self._handles.append(P.pre_ff.register_forward_pre_hook(lambda mod, args: st.__setitem__("v", query_rows(args[0]))))
        self._install_factored(l, patch)

    def _install_compute(self, l, spec, patch, st):
        P, ad, pd, T = self.ad.parts[l], self.ad, self.pdtype, spec.targets
        diag = patch.diagnostics
        if self.apply == "materialized" and T.v.dim() == 2 and T.v.shape[0] > 1:
            raise ValueError("materialized patches need one query per pass; the batched path applies patches factored")

        def at_mlp_input(mod, args):
            z = query_rows(args[0])
            patch.dv = T.v.to(pd) - st["v"].to(pd)
            if "input" in spec.parts:
                patch.gate = input_patch(P.gate.weight, z, T.z, pd, l, "W_gate")
                patch.up = input_patch(P.up.weight, z, T.z, pd, l, "W_up")
                if self.apply == "materialized":
                    self._write_rank1(P.gate, patch.gate)
                    self._write_rank1(P.up, patch.up)
            if "vanilla" in spec.parts:
                patch.down_bias = patch.dv

        self._handles.append(P.gate.register_forward_pre_hook(at_mlp_input))

        if "output" in spec.parts and spec.variant == "stable":
            def at_down_input(mod, args):
                hg = query_rows(args[0])
                if spec.h_source == "actual":
                    h_gated = hg.to(pd)
                    h_down = torch.nn.functional.linear(h_gated, P.down.weight.to(pd))
                else:
                    h_gated = T.h_gated.to(pd).reshape(hg.shape)
                    h_down = T.h_down.to(pd).reshape(hg.shape[0], -1)
                m = ad.scale(l).to(pd)
                st["g"] = patch.dv + m * ad.normalize(h_down).to(pd)
                patch.down, st["h_target"], patch.rows_info = stable_down_patch(st["g"], m, h_down, h_gated, pd, diag)
                if self.apply == "materialized":
                    self._write_rank1(P.down, patch.down)

            self._handles.append(P.down.register_forward_pre_hook(at_down_input))

        if "output" in spec.parts:
            def at_post_norm_input(mod, args):
                y = query_rows(args[0])
                m = ad.scale(l).to(pd)
                if spec.variant == "naive":
                    h = ad.normalize(y) if spec.h_source == "actual" else ad.normalize(T.h_down).reshape(y.shape)
                    patch.h_den = h.to(pd)
                    patch.dm = safe_divide(patch.dv, patch.h_den)[0]
                else:
                    h = ad.normalize(y) if spec.h_source == "actual" else ad.normalize(st["h_target"])
                    patch.h_den = h.to(pd)
                    patch.dm = safe_divide(st["g"] - m * patch.h_den, patch.h_den)[0]
                if self.apply == "materialized":
                    self._write_scale(P.post_ff, patch.dm)

            self._handles.append(P.post_ff.register_forward_pre_hook(at_post_norm_input))

    def _materialize_fixed(self, l, patch: LayerPatch):
        P = self.ad.parts[l]
        for r1, lin in ((patch.gate, P.gate), (patch.up, P.up), (patch.down, P.down)):
            if r1 is not None:
                self._write_rank1(lin, r1)
        if patch.dm is not None:
            self._write_scale(P.post_ff, patch.dm)

    def _install_factored(self, l, patch: LayerPatch):
        """Hooks that add rank-1 actions / the scale patch at run time (factored) and the vanilla bias (both)."""
        P, ad = self.ad.parts[l], self.ad
        factored = self.apply == "factored"

        def lin_hook(name):
            def fn(mod, args, out):
                r1 = getattr(patch, name)
                if factored and r1 is not None:
                    out = out + r1.act(args[0]).to(out.dtype)
                if name == "down" and patch.down_bias is not None:
                    out = out + patch.down_bias.reshape(-1, 1, out.shape[-1]).to(out.dtype) \
                        if patch.down_bias.dim() == 2 else out + patch.down_bias.to(out.dtype)
                return out
            return fn

        for name, lin in (("gate", P.gate), ("up", P.up), ("down", P.down)):
            self._handles.append(lin.register_forward_hook(lin_hook(name)))

        if factored:
            def post_norm(mod, args, out):
                if patch.dm is None:
                    return out
                y = args[0]
                dm = patch.dm.to(ad.norm_dtype)
                dm = dm.reshape(-1, 1, dm.shape[-1]) if dm.dim() == 2 else dm
                scale = ad.scale_offset + mod.weight.to(ad.norm_dtype) + dm
                return (ad.normalize(y) * scale).to(y.dtype)

            self._handles.append(P.post_ff.register_forward_hook(post_norm))


class TargetRecorder(HookScope):
    """Hooks that record ``LayerTargets`` in a full-context forward of one sequence.

    ``positions=None``: the last position, as 1-D vectors. A list of positions: (N, d) rows at those positions
    (the batched teacher-forced path, one row per query).
    """

    def __init__(self, adapter: GemmaAdapter, positions=None):
        self.ad = adapter
        self.positions = None if positions is None else torch.as_tensor(list(positions), dtype=torch.long)
        self.store = {}
        self._handles = []

    def __enter__(self):
        self.store = {l: {} for l in range(self.ad.n_layers)}
        if self.positions is None:
            last = lambda t: last_row(t).detach().clone()  # noqa: E731
        else:
            pos = self.positions
            last = lambda t: t.reshape(-1, t.shape[-1])[pos.to(t.device)].detach().clone()  # noqa: E731
        for l, P in enumerate(self.ad.parts):
            s = self.store[l]
            reg = self._handles.append
            reg(P.layer.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("x_in", last(a[0]))))
            reg(P.layer.register_forward_hook(
                lambda m, a, o, s=s: s.__setitem__("out", last(o[0] if isinstance(o, tuple) else o))))
            reg(P.pre_ff.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("v", last(a[0]))))
            reg(P.pre_ff.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("z", last(o))))
            reg(P.down.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("h_gated", last(a[0]))))
            reg(P.down.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("h_down", last(o))))
        return self

    def targets(self) -> list[LayerTargets]:
        return [LayerTargets(**self.store[l]) for l in range(self.ad.n_layers)]

"""The one engine: record the full-context targets, and run the query token alone through one patched pass.

``Recorder`` hooks a full-context forward and keeps, at the query position(s), each layer's ``Targets``. ``PatchedPass``
hooks a no-context forward of N independent one-token sequences (N = 1 step by step; N > 1 batched, one patch per
row). For every layer it is given a ``LayerSpec`` for, it either computes that layer's patch *inside this pass*, from
the values this very pass produces (the layer's own ``v`` and ``z``, after the patched layers below it), or applies a
supplied ``LayerPatch``. The family's controllers (``controllers.py``) do the per-kind work; this module owns the
hook sites every family shares:

* the decoder layer's input (recorded; the ``oracle`` schedule replaces it by the recorded full-context input);
* v: the input of the family's ``v_site``, or ``x + attn`` in a parallel block;
* the MLP module's input z: one pre-hook, where every input controller builds its patch and dv = v_C - v is known;
* the MLP module's output (the ``vanilla`` control adds dv there);
* the decoder layer's output (recorded: the Theorem 1 check).

Application: ``materialized`` writes ``W + dW`` / ``w + dm`` into the parameters by the one cast rule of
``hooks.WeightScope`` (restored bit for bit on exit); ``factored`` adds rank-1 actions to module outputs and computes
the patched post-norm in the norm's dtype, touching no weight. Conditions (z = 0, h = 0, S = 0) are kept as tensors
and raised, naming the layer, when the pass ends -- after every weight is restored.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .controllers import add_rows, controllers
from .families import Adapter
from .hooks import HookScope, PatchError, WeightScope, hidden_arg, replace_hidden, rows
from .patches import DIAG_KEYS, LayerPatch, Rank1, default_patch_dtype

VARIANTS = ("naive", "stable")
H_SOURCES = ("actual", "recorded")
APPLY_MODES = ("materialized", "factored")
WRITE_MODES = ("materialized", "peft")   # "peft": write rank-1 patches into LoRA factors and scales into saved copies


@dataclass
class Targets:
    """What the full-context pass recorded for one layer at the query position(s): (N, d) rows, model dtype
    (``v`` in float64 for parallel blocks, where it is ``x + attn``)."""

    x: torch.Tensor                       # layer input (residual stream)
    v: torch.Tensor                       # v_C
    z: torch.Tensor                       # z_C: the MLP input
    out: torch.Tensor                     # the layer output
    hidden: torch.Tensor | None = None    # the input of the MLP's last matrix (Gemma: act(W_gate z) * W_up z)
    mlp_out: torch.Tensor | None = None   # the MLP output (Gemma: W_down h_gated, the post-norm input)

    def select(self, i) -> "Targets":
        return Targets(**{k: None if v is None else v[i] for k, v in self.__dict__.items()})


def _site_hooks(P, st: dict, reg, take) -> None:
    """Hooks that put this layer's input into ``st["x"]`` and its v into ``st["v"]`` (sequential: the input of
    ``v_site``; parallel: x + attn, in float64), each passed through ``take``."""
    reg(P.layer.register_forward_pre_hook(lambda m, a, k: st.__setitem__("x", take(hidden_arg(a, k))),
                                          with_kwargs=True))
    if P.v_site is not None:
        reg(P.v_site.register_forward_pre_hook(lambda m, a: st.__setitem__("v", take(a[0]))))
    else:
        reg(P.attn.register_forward_hook(
            lambda m, a, o: st.__setitem__("v", st["x"].to(torch.float64) + take(o).to(torch.float64))))


class Recorder(HookScope):
    """Hooks that record ``Targets`` for every layer in a full-context forward of one sequence.

    ``positions=None``: the last position (one row). A tensor of positions: one row per position (the batched
    teacher-forced path)."""

    def __init__(self, adapter: Adapter, positions: torch.Tensor | None = None):
        super().__init__()
        self.ad, self.positions, self.store = adapter, positions, {}

    def _take(self, t):
        r = rows(t)
        return (r[-1:] if self.positions is None else r[self.positions.to(r.device)]).detach().clone()

    def __enter__(self):
        take = self._take
        for l, P in enumerate(self.ad.parts):
            s = self.store[l] = {}
            _site_hooks(P, s, self.reg, take)
            self.reg(P.mlp.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("z", take(a[0]))))
            self.reg(P.mlp.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("mlp_out", take(o))))
            if P.down is not None:
                self.reg(P.down.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("hidden", take(a[0]))))
            self.reg(P.layer.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("out", take(o))))
        return self

    def targets(self) -> list[Targets]:
        return [Targets(**self.store[l]) for l in range(self.ad.n_layers)]


@dataclass
class LayerSpec:
    """How one layer behaves in a patched pass: compute its patch from ``targets`` (with ``parts`` of {"input",
    "output", "vanilla"}, the ``variant`` and ``h_source``), or apply the supplied ``patch``. ``oracle``: feed the
    layer the recorded full-context input instead of the output of the layer below."""

    targets: Targets | None = None
    patch: LayerPatch | None = None
    parts: frozenset = frozenset({"input", "output"})
    variant: str = "naive"
    h_source: str = "actual"
    oracle: bool = False


@dataclass
class Site:
    """One layer inside one pass: what a controller needs (see ``controllers.py``)."""

    l: int
    P: object
    pas: "PatchedPass"
    spec: LayerSpec
    patch: LayerPatch
    st: dict = field(default_factory=dict)

    @property
    def ad(self):
        return self.pas.ad

    @property
    def T(self):
        return self.spec.targets

    @property
    def pdtype(self):
        return self.pas.pdtype

    @property
    def materialized(self):
        """Patches are written (into the weights, or into a peft adapter) rather than added at run time."""
        return self.pas.apply in WRITE_MODES

    @property
    def computing(self):
        return self.spec.patch is None

    @property
    def dv(self):
        return self.patch.dv

    def reg(self, handle):
        self.pas.reg(handle)

    def add(self, param, delta, index=None):
        self.pas.add(param, delta, index)

    def write_rank1(self, module, r1: Rank1):
        if self.pas.apply == "peft":      # a LoRA of rank 1: B = u, A = z^T / ||z||^2, scaling 1
            z = r1.z.reshape(-1, r1.z.shape[-1])[0]
            with torch.no_grad():
                A, B = module.lora_A[module.active_adapters[0]].weight, module.lora_B[module.active_adapters[0]].weight
                A.copy_((z / (z * z).sum()).reshape(1, -1).to(A.dtype))
                B.copy_(r1.u.reshape(-1, r1.u.shape[-1])[0].reshape(-1, 1).to(B.dtype))
            return
        dense = r1.dense()
        self.pas.add(module.weight, dense.t() if self.ad.family.conv1d else dense)

    def check(self, flag: torch.Tensor, message: str):
        self.pas.checks.append((flag, message))


class PatchedPass(WeightScope):
    """Context manager around one no-context forward of N one-token sequences (input shape (N, 1)).

    ``with PatchedPass(adapter, {layer: LayerSpec}, apply) as pp: model(...)``; then ``pp.patches`` (layer ->
    ``LayerPatch`` with N rows) and ``pp.outputs`` (layer -> (N, d) output rows)."""

    def __init__(self, adapter: Adapter, specs: dict, apply: str = "factored", pdtype: torch.dtype | None = None):
        if apply not in APPLY_MODES + ("peft",):
            raise ValueError(f"unknown apply mode {apply!r}; choose one of: {', '.join(APPLY_MODES)}")
        super().__init__(pdtype or default_patch_dtype(adapter.dtype))
        self.ad, self.specs, self.apply = adapter, specs, apply
        self.patches: dict[int, LayerPatch] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.checks: list = []
        self.keep = apply == "peft"       # peft: the writes go into the adapter's own copies and stay

    def __enter__(self):
        self.refs = {l: self.ad.reference_norms(l) for l in self.specs}   # before anything is written
        for l, spec in self.specs.items():
            self._install(l, spec)
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:
            for l, p in self.patches.items():
                p.finish(self.refs.get(l))
            if self.checks:
                failed = torch.stack([f.reshape(()) for f, _ in self.checks]).tolist()
                for bad, (_, msg) in zip(failed, self.checks):
                    if bad:
                        raise PatchError(msg)
        return False

    def _install(self, l: int, spec: LayerSpec):
        P = self.ad.parts[l]
        if spec.patch is None and spec.targets is None:
            raise ValueError(f"layer {l}: a LayerSpec needs targets (compute) or a patch (apply)")
        if spec.patch is None and spec.variant == "stable" and P.kind not in ("scale", "moe") and "output" in spec.parts:
            raise ValueError(f"variant 'stable' needs a trainable post-norm scale after the MLP (Appendix B); layer {l} "
                             f"of this {self.ad.family.key} model has a {P.kind} output. Use variant='naive'")
        patch = spec.patch or LayerPatch(layer=l, kind=P.kind)
        n_rows = patch.n_rows() if spec.patch is not None else spec.targets.v.shape[0]
        if self.apply in WRITE_MODES and n_rows != 1:
            raise ValueError("materialized patches need one query per pass; the batched path applies patches factored")
        s = Site(l, P, self, spec, patch)
        self.patches[l] = patch
        ctrl = (_supplied_controllers(P.kind, patch) if spec.patch is not None
                else controllers(P.kind, spec.variant, spec.parts))
        if spec.oracle:
            self.reg(P.layer.register_forward_pre_hook(
                lambda m, a, k: replace_hidden(a, k, spec.targets.x.to(hidden_arg(a, k).dtype)
                                               .reshape(hidden_arg(a, k).shape).contiguous()), with_kwargs=True))
        _site_hooks(P, s.st, self.reg, rows)
        if spec.patch is None:
            def at_mlp_input(mod, args):
                z = rows(args[0])
                pd = self.pdtype
                patch.dv = spec.targets.v.to(pd) - s.st["v"].to(pd)
                patch.diag.update(z_norm=z.to(pd).norm(dim=-1).to(torch.float64),
                                  dv_norm=patch.dv.norm(dim=-1).to(torch.float64))
                if "vanilla" in spec.parts:
                    patch.vanilla = patch.dv
                for c in ctrl:
                    c.at_mlp_input(s, z)
            self.reg(P.mlp.register_forward_pre_hook(at_mlp_input))
        elif self.apply in WRITE_MODES:
            for c in ctrl:
                c.materialize(s)
        for c in ctrl:
            c.install(s)
        self.reg(P.mlp.register_forward_hook(
            lambda m, a, o: o if patch.vanilla is None else add_rows(o, patch.vanilla)))

        def at_output(mod, args, out):
            o = self.outputs[l] = rows(out).detach().clone()
            if spec.targets is not None:   # the Theorem 1 check of this layer, as a tensor
                ref = spec.targets.out.to(torch.float64)
                patch.diag["block_error"] = ((o.to(torch.float64) - ref).abs().amax(-1)
                                             / ref.abs().amax(-1).clamp_min(1e-300))
        self.reg(P.layer.register_forward_hook(at_output))
        if self.apply in WRITE_MODES and not self.keep:
            # a one-token pass uses each layer once: put its weights back as soon as its forward is done, so the
            # pass holds one layer's saved copies at a time (the restore on exit covers an interrupted pass)
            self.reg(P.layer.register_forward_hook(lambda m, a, o: self.restore_params(m.parameters())))


def _supplied_controllers(kind: str, patch: LayerPatch) -> list:
    """The controllers that apply a supplied patch: whatever parts it holds."""
    parts = set()
    if patch.inputs:
        parts.add("input")
    if patch.output:
        parts.add("output")
    variant = "stable" if "down" in patch.output else "naive"
    if kind == "moe" and not parts:
        return []
    return controllers(kind, variant, frozenset(parts | ({"input"} if kind == "moe" and parts else set())))


def diag_rows(patches: dict, n: int) -> list:
    """[n rows][layers][len(DIAG_KEYS)] float64 diagnostics of a pass, on the host: one transfer for all."""
    if not patches:
        return [[] for _ in range(n)]
    dev = next(iter(patches.values())).dv
    dev = dev.device if dev is not None else "cpu"
    m = torch.stack([patches[l].diag_matrix(n, dev) for l in sorted(patches)])   # (L, K, n)
    return m.permute(2, 0, 1).tolist()


def write_patches(adapter: Adapter, patches: dict, pdtype: torch.dtype) -> WeightScope:
    """Write supplied one-row patches into the weights by the one cast rule, with no hook; the returned scope's
    ``restore()`` puts every written parameter back bit for bit (``PatchSet.merge_into``)."""
    scope = PatchedPass(adapter, {}, apply="materialized", pdtype=pdtype)
    for l, patch in patches.items():
        if patch.vanilla is not None:
            raise ValueError("the vanilla control adds dv to the MLP output at run time; it has no weight form to merge")
        if patch.n_rows() != 1:
            raise ValueError("only one-row patches can be merged into weights")
        s = Site(l, adapter.parts[l], scope, LayerSpec(patch=patch), patch)
        for c in _supplied_controllers(adapter.parts[l].kind, patch):
            c.materialize(s)
    return scope

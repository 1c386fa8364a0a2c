"""Theorem 1 on one real Gemma decoder layer, with every intermediate quantity exposed for teaching and tests.

Setting: the full-context pass gives the layer's input rows for all positions. With the context, the layer's
output at the query position is ``T(C, x)``. Without it (the query row alone, attending only to itself) the same
layer gives ``v``, ``z``. The rank-1 gate/up patches and the scale patch ``dm`` then make the layer, fed the query
row alone, return ``T(C, x)`` exactly (up to rounding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .algorithm import Algorithm1, PatchConfig
from .engine import LayerSpec, PatchedPass
from .families import Adapter
from .hooks import float64_norms
from .metrics import relative_error
from .patches import Rank1


@dataclass
class SingleBlockResult:
    layer: int
    v: torch.Tensor
    v_C: torch.Tensor
    z: torch.Tensor
    z_C: torch.Tensor
    h: torch.Tensor               # what the patched layer normalises: N(W_down h_g), or N((W_down + dW_down) h_g) if stable
    h_recorded: torch.Tensor      # N(h_down,C), the full-context pass's: what dm divides by with h_source="recorded"
    gate: Rank1                   # dW_gate by its factors (dense on demand: .dW_gate)
    up: Rank1
    dm: torch.Tensor
    out_target: torch.Tensor      # T(C, x): full-context output at the query position
    out_patched: torch.Tensor     # patched layer, no context
    out_unpatched: torch.Tensor   # unpatched layer, no context
    rel_error: float              # max|patched - target| / max|target|
    unpatched_rel_error: float
    fallbacks: int
    min_abs_h: float
    hard_case: bool = False       # the stable variant only: Appendix B's secular function had no root (the hard case)
    down: Rank1 | None = None     # stable only: Appendix B's rank-1 dW_down, u = h_target - W_down h_g, z = h_g (one row each)

    @property
    def singular_values(self) -> dict:
        """name -> the four leading singular values of the dense input patches (rank 1: one nonzero value)."""
        return {name: torch.linalg.svdvals(r1.dense().to(torch.float64)).cpu()[:4].tolist()
                for name, r1 in (("gate", self.gate), ("up", self.up))}

    @property
    def dW_gate(self) -> torch.Tensor:
        return self.gate.dense()

    @property
    def dW_up(self) -> torch.Tensor:
        return self.up.dense()



class _PassDone(Exception):
    """Raised by the forward hook that ends a one-layer pass after the patched layer (caught in the same call)."""


def _stop_pass(module, args, out):
    raise _PassDone


@torch.no_grad()
def single_block_patch(model, input_ids, layer: int, apply: str = "factored",
                       parts=("input", "output"), variant: str = "naive", targets=None,
                       h_source: str = "actual") -> SingleBlockResult:
    """Theorem 1 at ``layer`` for the last token of ``input_ids`` (its context: the tokens before it).

    ``parts=("input", "vanilla")`` builds the predecessor's vanilla-block recipe instead (dv added before the
    post-norm); then ``dm`` is None and ``rel_error`` shows how far it misses. ``variant="stable"``: Appendix B's
    update (a rank-1 patch of W_down and a small remainder in dm). ``h_source``: what the scale patch divides by,
    the ``h`` the patched layer computes (``"actual"``) or the one recorded with the context (``"recorded"``). ``targets``: the full-context targets of
    ``input_ids`` when they are already recorded (``Algorithm1.full_context``), shared by the calls for every layer.
    """
    alg = Algorithm1(model, PatchConfig(schedule="oracle", apply=apply, variant=variant, h_source=h_source))
    ad = alg.adapter
    if not 0 <= layer < ad.n_layers:
        raise ValueError(f"layer {layer} out of range 0..{ad.n_layers - 1}")
    ids = list(torch.as_tensor(input_ids).reshape(-1).tolist())
    if len(ids) < 2:
        raise ValueError("input_ids needs a context before the query token (at least 2 tokens)")
    if targets is None:
        _, targets, _ = alg.full_context(ids)
    T = targets[layer].select(0)
    q = torch.tensor([[ids[-1]]], device=alg.device)
    pos = torch.tensor([[len(ids) - 1]], device=alg.device)
    P = ad.parts[layer]

    def run(parts):
        spec = LayerSpec(targets=targets[layer], parts=frozenset(parts), oracle=True, variant=variant,
                         h_source=h_source)
        pp, got = PatchedPass(ad, {layer: spec}, apply=apply), {}
        with alg.norms(), pp:   # capture hooks go last, so they see the float64 norm outputs
            extra = [P.v_site.register_forward_pre_hook(lambda m, a: got.__setitem__("v", a[0][0, -1].clone())),
                     P.mlp.register_forward_pre_hook(lambda m, a: got.__setitem__("z", a[0][0, -1].clone())),
                     P.output.register_forward_pre_hook(
                         lambda m, a: got.__setitem__("h", ad.normalize(a[0][0, -1], P.output).clone()))]
            # the layers above this one cannot change what it computes: stop the pass once its output is recorded
            extra.append(P.layer.register_forward_hook(_stop_pass))
            try:
                model.base_model(input_ids=q, position_ids=pos, use_cache=False)   # the head is not needed
            except _PassDone:
                pass
            finally:
                for h in extra:
                    h.remove()
        return pp, got

    rec0, cap0 = run(())
    rec1, cap1 = run(tuple(parts))
    p = rec1.patches[layer]
    out_t, out_p, out_u = T.out, rec1.outputs[layer][0], rec0.outputs[layer][0]
    d = p.diagnostics
    return SingleBlockResult(
        layer=layer, v=cap0["v"], v_C=T.v, z=cap0["z"], z_C=T.z, h=cap1["h"],
        h_recorded=ad.normalize(T.mlp_out, P.output), gate=p.gate, up=p.up,
        dm=None if p.dm is None else p.dm[0], out_target=out_t, out_patched=out_p, out_unpatched=out_u,
        rel_error=relative_error(out_p, out_t), unpatched_rel_error=relative_error(out_u, out_t),
        fallbacks=d.fallbacks, min_abs_h=d.min_abs_h, hard_case=d.hard_case,
        down=p.down)


@torch.no_grad()
def single_block_patches(model, input_ids, layers=None, **kwargs) -> list[SingleBlockResult]:
    """``single_block_patch`` on each of ``layers`` (default: all), sharing one full-context pass."""
    ids = list(torch.as_tensor(input_ids).reshape(-1).tolist())
    alg = Algorithm1(model, PatchConfig(schedule="oracle", apply=kwargs.get("apply", "factored")))
    _, targets, _ = alg.full_context(ids)
    layers = range(alg.adapter.n_layers) if layers is None else layers
    return [single_block_patch(model, ids, l, targets=targets, **kwargs) for l in layers]


@torch.no_grad()
def normalized_mlp_outputs(model, input_ids) -> torch.Tensor:
    """|h| = |N(W_down h_g)| for every layer and every position of a full-context forward: (L, T, d), float64.

    In exact arithmetic these are the values the scale patch divides by (the patched layer reproduces them).
    """
    ad = Adapter(model)
    got = []
    hooks = [P.output.register_forward_pre_hook(
        lambda m, a, P=P: got.append(ad.normalize(a[0][0], P.output).abs().double())) for P in ad.parts]
    try:
        ids = torch.as_tensor(input_ids, device=next(model.parameters()).device).reshape(1, -1)
        with float64_norms(model, ad.family.scale_offset):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got)

"""Theorem 1 on one real Gemma decoder layer, with every intermediate quantity exposed for teaching and tests.

Setting: the full-context pass gives the layer's input rows for all positions. With the context, the layer's
output at the query position is ``T(C, x)``. Without it (the query row alone, attending only to itself) the same
layer gives ``v``, ``z``. The rank-1 gate/up patches and the scale patch ``dm`` then make the layer, fed the query
row alone, return ``T(C, x)`` exactly (up to rounding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import GemmaAdapter, LayerSpec, PatchHooks, TargetRecorder, float64_norms
from .metrics import relative_error
from .patches import Rank1


@dataclass
class SingleBlockResult:
    layer: int
    v: torch.Tensor
    v_C: torch.Tensor
    z: torch.Tensor
    z_C: torch.Tensor
    h: torch.Tensor               # N(W_down h_g) after the input patches: what dm divides by
    gate: Rank1                   # dW_gate by its factors (dense on demand: .dW_gate)
    up: Rank1
    dm: torch.Tensor
    out_target: torch.Tensor      # T(C, x): full-context output at the query position
    out_patched: torch.Tensor     # patched layer, no context
    out_unpatched: torch.Tensor   # unpatched layer, no context
    rel_error: float              # max|patched - target| / max|target|
    unpatched_rel_error: float
    singular_values: dict         # name -> leading singular values of the dense patch (rank 1: one nonzero)
    fallbacks: int
    min_abs_h: float

    @property
    def dW_gate(self) -> torch.Tensor:
        return self.gate.dense()

    @property
    def dW_up(self) -> torch.Tensor:
        return self.up.dense()



@torch.no_grad()
def single_block_patch(model, input_ids, layer: int, apply: str = "factored",
                       parts=("input", "output")) -> SingleBlockResult:
    """Theorem 1 at ``layer`` for the last token of ``input_ids`` (its context: the tokens before it).

    ``parts=("input", "vanilla")`` builds the predecessor's vanilla-block recipe instead (dv added before the
    post-norm); then ``dm`` is None and ``rel_error`` shows how far it misses.
    """
    ad = GemmaAdapter(model)
    if not 0 <= layer < ad.n_layers:
        raise ValueError(f"layer {layer} out of range 0..{ad.n_layers - 1}")
    dev = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, device=dev).reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError("input_ids needs a context before the query token (at least 2 tokens)")
    with float64_norms(model), TargetRecorder(ad) as rec:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    T = rec.targets()[layer]
    q = ids[:, -1:]
    pos = torch.tensor([[ids.shape[1] - 1]], device=dev)

    def run(parts):
        spec = LayerSpec(targets=T, parts=frozenset(parts), ideal_input=T.x_in)
        hooks = PatchHooks(ad, {layer: spec}, apply=apply)
        captured = {}
        with float64_norms(model), hooks as record:  # capture hooks go last, so they see the float64 norm outputs
            P = ad.parts[layer]
            extra = [P.pre_ff.register_forward_pre_hook(lambda m, a: captured.__setitem__("v", a[0][0, -1].clone())),
                     P.pre_ff.register_forward_hook(lambda m, a, o: captured.__setitem__("z", o[0, -1].clone())),
                     P.post_ff.register_forward_pre_hook(
                         lambda m, a: captured.__setitem__("h", ad.normalize(a[0][0, -1]).clone()))]
            try:
                model(input_ids=q, position_ids=pos, use_cache=False, logits_to_keep=1)
            finally:
                for h in extra:
                    h.remove()
        return record, captured

    rec0, cap0 = run(())
    rec1, cap1 = run(tuple(parts))
    p = rec1.patches[layer]
    sv = {}
    for name, r1 in (("gate", p.gate), ("up", p.up)):
        sv[name] = torch.linalg.svdvals(r1.dense().to(torch.float64))[:4].tolist()
    out_t, out_p, out_u = T.out, rec1.outputs[layer], rec0.outputs[layer]
    return SingleBlockResult(
        layer=layer, v=cap0["v"], v_C=T.v, z=cap0["z"], z_C=T.z, h=cap1["h"], gate=p.gate, up=p.up, dm=p.dm, out_target=out_t, out_patched=out_p, out_unpatched=out_u,
        rel_error=relative_error(out_p, out_t), unpatched_rel_error=relative_error(out_u, out_t),
        singular_values=sv,
        fallbacks=p.diagnostics.fallbacks, min_abs_h=p.diagnostics.min_abs_h)



@torch.no_grad()
def normalized_mlp_outputs(model, input_ids) -> torch.Tensor:
    """|h| = |N(W_down h_g)| for every layer and every position of a full-context forward: (L, T, d), float64.

    In exact arithmetic these are the values the scale patch divides by (the patched layer reproduces them).
    """
    ad = GemmaAdapter(model)
    got = []
    hooks = [P.post_ff.register_forward_pre_hook(lambda m, a: got.append(ad.normalize(a[0][0]).abs().double()))
             for P in ad.parts]
    try:
        ids = torch.as_tensor(input_ids, device=next(model.parameters()).device).reshape(1, -1)
        with float64_norms(model):
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(got)

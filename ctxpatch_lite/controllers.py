"""Input and output controllers (paper Section 5, MATH.md section 4) as small strategy objects.

Each controller has three duties inside one patched pass (``engine.PatchedPass``), for one layer ``s`` (a
``engine.Site``: its parts, targets, patch, spec, and the pass that owns hooks and weight writes):

* ``at_mlp_input(s, z)``: called from the one hook at the MLP module's input, with the pass's own ``z`` rows
  (input controllers build their patches here; the bias controller knows dv here);
* ``install(s)``: hooks at later sites (compute where the needed value appears) and, in ``factored`` mode, the hooks
  that add the patch at run time without touching a weight;
* ``materialize(s)``: write a supplied patch into the weights before the pass (``materialized`` mode).

Conditions the math needs (z != 0, h != 0, S != 0) are recorded as tensors by ``s.check`` and raised, naming the
layer, once the pass is over: no host transfer in the middle of a pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .hooks import rows
from .patches import Rank1, in_patch_dtype, input_patch, safe_divide, z_zero_message, zero_rows
from .stable import invert_rows


def add_rows(out: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """``out`` plus one vector per query row (``vec`` (N, d); ``out`` (N, T, d) or (N*T, d))."""
    n = vec.shape[0]
    return (out.reshape(n, -1, out.shape[-1]) + vec.to(out.dtype).unsqueeze(1)).reshape(out.shape)


class DenseInputs:
    """Rank-1 patches of every matrix on the MLP input (gate/up, fc): ``dW = W (z_C - z) z^T / ||z||^2``."""

    def at_mlp_input(self, s, z):
        for name, lin in s.P.inputs:
            self.compute_one(s, name, lin, z)

    @staticmethod
    def compute_one(s, name, lin, z):
        s.check(zero_rows(z), z_zero_message(s.l, name))
        r1 = s.patch.inputs[name] = input_patch(s.ad.weight_oi(lin), z, s.T.z, s.pdtype)
        if s.materialized:
            s.write_rank1(lin, r1)

    @staticmethod
    def install(s, modules=None):
        if s.materialized:
            return
        for name, lin in modules or s.P.inputs:
            def hook(mod, args, out, name=name):
                r1 = s.patch.inputs.get(name)
                return out if r1 is None else out + r1.act(args[0]).to(out.dtype)
            s.reg(lin.register_forward_hook(hook))

    @staticmethod
    def materialize(s, modules=None):
        for name, lin in modules or s.P.inputs:
            if name in s.patch.inputs:
                s.write_rank1(lin, s.patch.inputs[name])


class BiasOutput:
    """Output bias (GPT-2, GPT-J): ``db = dv``."""

    def at_mlp_input(self, s, z):
        s.patch.output["bias"] = s.dv
        if s.materialized:
            s.add(s.P.output.bias, s.dv[0])

    def install(self, s):
        if not s.materialized:
            s.reg(s.P.output.register_forward_hook(
                lambda mod, args, out: out if "bias" not in s.patch.output else add_rows(out, s.patch.output["bias"])))

    def materialize(self, s):
        s.add(s.P.output.bias, s.patch.output["bias"][0])


class MatrixOutput:
    """Output matrix W' on the MLP hidden h (Llama-style ``down_proj``, Falcon ``dense_4h_to_h``):
    ``dW' = dv h^T / ||h||^2``."""

    def at_mlp_input(self, s, z):
        pass

    def install(self, s):
        if s.computing:
            def compute(mod, args):
                h = (rows(args[0]) if s.spec.h_source == "actual" else s.T.hidden).to(s.pdtype)
                s.check(zero_rows(h), f"layer {s.l}: the MLP hidden h is the zero vector, so the output-matrix "
                                      f"patch dW = dv h^T / ||h||^2 does not exist")
                r1 = s.patch.output["matrix"] = Rank1(u=s.dv, z=h)
                s.patch.diag["h_norm"] = h.norm(dim=-1).to(torch.float64)
                if s.materialized:
                    s.write_rank1(mod, r1)
            s.reg(s.P.output.register_forward_pre_hook(compute))
        if not s.materialized:
            s.reg(s.P.output.register_forward_hook(
                lambda mod, args, out: out if "matrix" not in s.patch.output
                else out + s.patch.output["matrix"].act(args[0]).to(out.dtype)))

    def materialize(self, s):
        s.write_rank1(s.P.output, s.patch.output["matrix"])


class ScaleOutput:
    """Post-norm scale m (Gemma 2/3: ``1 + w``; OLMo 2: ``w``). ``naive``: ``dm = dv / h`` with ``h`` the normalised
    MLP output. ``stable`` (Appendix B): most of the correction goes into a rank-1 patch of the MLP's output matrix
    (the RMSNorm inverted for the target ``g = dv + m N(h_down)``), the small remainder into ``dm``."""

    def __init__(self, stable: bool):
        self.stable = stable

    def at_mlp_input(self, s, z):
        pass

    def install(self, s):
        P, ad = s.P, s.ad
        if s.computing and self.stable:
            s.reg(P.down.register_forward_pre_hook(lambda mod, args: self._stable_down(s, rows(args[0]))))
        if not s.materialized and self.stable:
            s.reg(P.down.register_forward_hook(
                lambda mod, args, out: out if "down" not in s.patch.output
                else out + s.patch.output["down"].act(args[0]).to(out.dtype)))
        if s.computing:
            s.reg(P.output.register_forward_pre_hook(lambda mod, args: self._scale(s, rows(args[0]))))
        if not s.materialized:
            def post_norm(mod, args, out):
                dm = s.patch.output.get("scale")
                if dm is None:
                    return out
                y = args[0]
                scale = ad.scale(mod) + dm.to(ad.norm_dtype).reshape(dm.shape[0], *([1] * (y.dim() - 2)), -1)
                return (ad.normalize(y, mod) * scale).to(y.dtype)
            s.reg(P.output.register_forward_hook(post_norm))

    def _stable_down(self, s, hg):
        pd, P, ad = s.pdtype, s.P, s.ad
        if s.spec.h_source == "actual":
            h_gated = hg.to(pd)
            bias = getattr(P.down, "bias", None)
            h_down = F.linear(h_gated, in_patch_dtype(ad.weight_oi(P.down), pd), None if bias is None else bias.to(pd))
        else:
            h_gated, h_down = s.T.hidden.to(pd), s.T.mlp_out.to(pd)
        m = ad.scale(P.output).to(pd)
        g = s.st["g"] = s.dv + m * ad.normalize(h_down, P.output).to(pd)
        inv = invert_rows(g, m)
        h_down64 = h_down.to(torch.float64)
        h_target64 = inv.y * h_down64.pow(2).mean(-1, keepdim=True).sqrt()
        s.st["h_target"] = h_target64.to(pd)
        s.patch.diag.update(hard_case=inv.hard_case.to(torch.float64), iterations=inv.iterations.to(torch.float64))
        s.check(zero_rows(h_gated), f"layer {s.l}: the gated MLP hidden is the zero vector; the rank-1 W_down patch "
                                    f"of Appendix B needs h_gated != 0")
        r1 = s.patch.output["down"] = Rank1(u=(h_target64 - h_down64).to(pd), z=h_gated)
        if s.materialized:
            s.write_rank1(P.down, r1)

    def _scale(self, s, y):
        pd, ad, norm = s.pdtype, s.ad, s.P.output
        m = ad.scale(norm).to(pd)
        if not self.stable:
            h = ad.normalize(y if s.spec.h_source == "actual" else s.T.mlp_out, norm).to(pd)
            num = s.dv
        else:
            h = ad.normalize(y if s.spec.h_source == "actual" else s.st["h_target"], norm).to(pd)
            num = s.st["g"] - m * h
        dm, fb, min_h = safe_divide(num, h)
        # A fallback (h_i == 0 exactly) leaves the output's coordinate i short of its target by |num_i|: no scale acts
        # on a zero. Counted apart: the fallbacks on coordinates whose scale m_i is itself 0 (the stable variant's
        # target is exactly 0 there), and the size of what the fallbacks leave out.
        zero = h == 0
        s.patch.output["scale"] = dm
        s.patch.diag.update(fallbacks=fb, min_abs_h=min_h,
                            fallbacks_m0=(zero & (m == 0)).sum(-1).to(torch.float64),
                            fallback_miss=torch.where(zero, num, torch.zeros_like(num)).norm(dim=-1).to(torch.float64))
        if s.materialized:
            s.add(norm.weight, dm[0])

    def materialize(self, s):
        if "down" in s.patch.output:
            s.write_rank1(s.P.down, s.patch.output["down"])
        s.add(s.P.output.weight, s.patch.output["scale"][0])


def _gate(gate, weight, x):
    """The router's own forward with ``weight`` in place of its parameter, bypassing its hooks (no write)."""
    orig = gate._parameters["weight"]
    gate._parameters["weight"] = weight
    try:
        return gate.forward(x)
    finally:
        gate._parameters["weight"] = orig


class MoE:
    """Mixture of experts: the router is patched like any input matrix (same experts, same gates as with the
    context); every selected expert's input matrix too, and its output matrix adds ``dv / S``, with ``S`` the sum of
    the selected gates read from the router itself. A shared expert (Qwen2-MoE) and its gate are input-patched.
    Without the ``output`` part (input-only, vanilla) the experts' output patches are left out.

    Factored mode recomputes the router and the selected experts row by row with the patches added as rank-1
    actions (fused expert weights have no per-expert module to hook); materialized mode writes the slices."""

    def __init__(self, output: bool = True):
        self.output = output

    def shared(self, s):
        sh = getattr(s.P.mlp, "shared_expert", None)
        if sh is None:
            return []
        return [("shared.gate_proj", sh.gate_proj), ("shared.up_proj", sh.up_proj),
                ("shared_gate", s.P.mlp.shared_expert_gate)]

    def at_mlp_input(self, s, z):
        gate = s.P.mlp.gate
        s.st["idx_C"] = _gate(gate, gate.weight, s.T.z.to(gate.weight.dtype))[2]
        for name, lin in [("router", gate)] + self.shared(s):
            DenseInputs.compute_one(s, name, lin, z)
        if s.materialized:
            self._route(s, z, gate.weight)
            for e in s.patch.extra["experts"][0].tolist():
                self._expert(s, s.P.mlp.experts, z, 0, e, write=True)

    def _route(self, s, z, weight=None):
        """Route the pass's rows ``z`` through the patched router; record S and the routing; return (scores, idx)."""
        gate, r1 = s.P.mlp.gate, s.patch.inputs["router"]
        outs = [_gate(gate, weight if weight is not None else
                      (gate.weight.to(s.pdtype) + r1.dense(i)).to(gate.weight.dtype), z[i:i + 1])
                for i in range(z.shape[0])]
        scores, idx = torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs])
        if s.computing:
            S = s.st["S"] = scores.to(s.pdtype).sum(-1)
            s.check((S == 0).any(), f"layer {s.l}: the selected experts' gates sum to S = 0, so no expert output "
                                    f"patch dv / S exists")
            s.patch.extra["experts"] = idx
            match = (idx.sort(-1).values == s.st["idx_C"].sort(-1).values).all(-1)
            s.patch.diag.update(S=S.to(torch.float64), routing_match=match.to(torch.float64))
        return scores, idx

    def _expert(self, s, ex, z, i, e, write=False):
        """Expert ``e`` on row ``i``: compute its patches (when computing), return its patched output (1, d)."""
        key, zi = f"expert{e}.row{i}", z[i:i + 1]
        if s.computing:
            r_in = s.patch.inputs[key + ".gate_up"] = input_patch(ex.gate_up_proj[e], zi, s.T.z[i:i + 1], s.pdtype)
            if write:
                s.add(ex.gate_up_proj, r_in.dense(), e)
        gu = F.linear(zi, ex.gate_up_proj[e])
        r_in = s.patch.inputs.get(key + ".gate_up")
        if not s.materialized and r_in is not None:   # a supplied (fixed) patch may lack a newly routed expert
            gu = gu + r_in.act(zi).to(gu.dtype)
        g, up = gu.chunk(2, dim=-1)
        h = ex.act_fn(g) * up
        if s.computing:
            s.check(zero_rows(h), f"layer {s.l}: expert {e}'s hidden is the zero vector; its output patch needs h != 0")
            u = s.dv[i:i + 1] / s.st["S"][i] if self.output else torch.zeros_like(s.dv[i:i + 1])
            r_out = s.patch.output[key + ".down"] = Rank1(u=u, z=h.to(s.pdtype))
            if write:
                s.add(ex.down_proj, r_out.dense(), e)
        o = F.linear(h, ex.down_proj[e])
        r_out = s.patch.output.get(key + ".down")
        return o if s.materialized or r_out is None else o + r_out.act(h).to(o.dtype)

    def install(self, s):
        if s.materialized:
            return
        DenseInputs.install(s, self.shared(s))
        moe = s.P.mlp

        def route(mod, args, out):
            scores, idx = self._route(s, rows(args[0]))
            return out[0], scores.to(out[1].dtype), idx

        def experts(mod, args, out):
            z, idx, w = args[0], args[1], args[2]
            res = torch.zeros_like(out)
            for i, sel in enumerate(idx.tolist()):
                for k, e in enumerate(sel):
                    res[i] += (self._expert(s, mod, z, i, e)[0] * w[i, k]).to(res.dtype)
            return res

        s.reg(moe.gate.register_forward_hook(route))
        s.reg(moe.experts.register_forward_hook(experts))

    def materialize(self, s):
        for name, lin in [("router", s.P.mlp.gate)] + self.shared(s):
            s.write_rank1(lin, s.patch.inputs[name])
        ex = s.P.mlp.experts
        for key, r1 in list(s.patch.inputs.items()) + list(s.patch.output.items()):
            if key.startswith("expert"):
                e = int(key[len("expert"):].split(".")[0])
                s.add(ex.gate_up_proj if key.endswith("gate_up") else ex.down_proj, r1.dense(), e)


def controllers(kind: str, variant: str, parts) -> list:
    """The controllers of one layer: its input controller, then its output controller (``parts`` decides which)."""
    if kind == "moe":
        return [MoE(output="output" in parts)] if "input" in parts else []
    out = []
    if "input" in parts:
        out.append(DenseInputs())
    if "output" in parts:
        out.append({"bias": BiasOutput(), "matrix": MatrixOutput(),
                    "scale": ScaleOutput(stable=variant == "stable")}[kind])
    return out

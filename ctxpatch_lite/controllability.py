"""Input- and output-controllable components, and the per-family adapters that compose them (paper Section 5).

A residual MLP block ``out = v + g(f(v))`` absorbs its context exactly when the inner function is
*input-controllable* (a parameter patch makes ``f(v) = f(v_C)``) and the outer one *output-controllable* (a patch adds
any ``dv = v_C - v``). The components (MATH.md section 4):

* input: a matrix ``W`` on the MLP input ``z`` (gate, up, fc, a MoE router, an expert's fused gate/up):
  ``dW = W (z_C - z) z^T / ||z||^2``;
* output ``bias`` (GPT-2, GPT-J): ``db = dv``;
* output ``matrix`` ``W'`` on the MLP hidden ``h`` (``down_proj``, ``dense_4h_to_h``): ``dW' = dv h^T / ||h||^2``;
* output ``scale`` of a post-norm (Gemma 2/3: ``1 + w``; OLMo 2: ``w``): ``dm = dv / N(y)``;
* ``moe``: the router is patched as an input matrix (same experts, same gates); every selected expert's down
  projection adds ``dv / S`` with ``S`` the sum of its gates (``S = 1`` when top-k gates are renormalised);
* parallel blocks (Falcon-7B, GPT-J) have ``dv = (x_C + attn_C) - (x + attn)``: the MLP input never sees attention.

A ``Family`` says, in a few names, where each piece lives in one transformers family; ``BlockAdapter`` finds them
in a model (or says which property is missing); ``ControlledPass`` computes every layer's patch inside the no-context
pass that applies it, from that pass's own values, writes it into the parameters (materialized, in the patch dtype,
cast to the model dtype) and restores every written parameter bit for bit on exit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .engine import HookScope, UnsupportedArchitectureError, WeightScope, rmsnorm_eps, unit_rms
from .patches import PatchError, Rank1, default_patch_dtype, input_patch, safe_divide

OUTPUT_KINDS = ("matrix", "bias", "scale")


@dataclass(frozen=True)
class Family:
    """Where v, z, the MLP and its output-controllable parameter live in one transformers family's decoder layer."""

    key: str
    hf_class: str
    layout: str                      # "sequential" | "parallel"
    norms: str                       # "pre" | "pre+post" | "post"
    output: str                      # "matrix" | "bias" | "scale" (dense MLPs; MoE layers use "moe")
    output_module: str               # under the MLP (matrix, bias) or under the layer (scale)
    inputs: tuple = ("gate_proj", "up_proj")
    v_site: str | None = None        # sequential: the layer's submodule whose input is v
    attn: str | None = None          # parallel: the attention submodule (its output[0] is attn)
    mlp: str = "mlp"
    scale_offset: float = 0.0        # post-norm scale m = offset + weight

    def describe(self) -> str:
        return f"{self.layout}, {self.norms}-norm"


def _seq(key, hf_class, **kw):
    return Family(key, hf_class, "sequential", kw.pop("norms", "pre"), kw.pop("output", "matrix"),
                  kw.pop("output_module", "down_proj"), v_site=kw.pop("v_site", "post_attention_layernorm"), **kw)


FAMILIES = {f.key: f for f in (
    _seq("gemma", "GemmaForCausalLM"),
    _seq("gemma2", "Gemma2ForCausalLM", norms="pre+post", output="scale", output_module="post_feedforward_layernorm",
         v_site="pre_feedforward_layernorm", scale_offset=1.0),
    _seq("gemma3", "Gemma3ForCausalLM", norms="pre+post", output="scale", output_module="post_feedforward_layernorm",
         v_site="pre_feedforward_layernorm", scale_offset=1.0),
    _seq("llama", "LlamaForCausalLM"),
    _seq("mistral", "MistralForCausalLM"),
    _seq("qwen2", "Qwen2ForCausalLM"),
    _seq("qwen3", "Qwen3ForCausalLM"),
    _seq("mixtral", "MixtralForCausalLM"),
    _seq("qwen2_moe", "Qwen2MoeForCausalLM"),
    _seq("qwen3_moe", "Qwen3MoeForCausalLM"),
    _seq("olmo2", "Olmo2ForCausalLM", norms="post", output="scale", output_module="post_feedforward_layernorm",
         v_site="mlp"),
    _seq("gpt2", "GPT2LMHeadModel", output="bias", output_module="c_proj", inputs=("c_fc",), v_site="ln_2"),
    _seq("falcon-sequential", "FalconForCausalLM", output_module="dense_4h_to_h", inputs=("dense_h_to_4h",)),
    Family("falcon-parallel", "FalconForCausalLM", "parallel", "pre", "matrix", "dense_4h_to_h",
           inputs=("dense_h_to_4h",), attn="self_attention"),
    Family("gptj", "GPTJForCausalLM", "parallel", "pre", "bias", "fc_out", inputs=("fc_in",), attn="attn"),
)}

MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama",
               "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
               "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmo2": "olmo2", "gpt2": "gpt2", "gptj": "gptj"}


def family_of(config) -> Family:
    """The ``Family`` of a transformers config, or an error that names what is missing."""
    mtype = getattr(config, "model_type", None)
    if mtype == "falcon":
        return FAMILIES["falcon-parallel" if config.parallel_attn or config.new_decoder_architecture
                        else "falcon-sequential"]
    if mtype not in MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {mtype!r} has no adapter: ctxpatch_lite needs to know where the MLP input z, the residual v "
            f"and an output-controllable parameter (output bias, output matrix or post-norm scale) live. Known "
            f"families: {', '.join(sorted(set(MODEL_TYPES) | {'falcon'}))}. Adding one is a Family(...) entry in "
            f"ctxpatch_lite/controllability.py")
    return FAMILIES[MODEL_TYPES[mtype]]


def find_layers(model):
    for path in ("model.layers", "transformer.h", "model.language_model.layers", "gpt_neox.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return obj
    raise UnsupportedArchitectureError(f"{type(model).__name__}: no decoder layer list found (looked for "
                                       f"model.layers and transformer.h)")


def is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj")


def is_conv1d(module) -> bool:
    """transformers' ``Conv1D`` (GPT-2) stores a linear map's weight transposed, as (in, out)."""
    return type(module).__name__ == "Conv1D"


def weight_oi(module) -> torch.Tensor:
    """A linear map's weight as (out, in), whatever layout the module stores."""
    return module.weight.t() if is_conv1d(module) else module.weight


@dataclass
class LayerParts:
    layer: torch.nn.Module
    mlp: torch.nn.Module
    v_site: torch.nn.Module | None
    attn: torch.nn.Module | None
    inputs: list                      # (name, module) input matrices of a dense MLP
    output_kind: str                  # matrix | bias | scale | moe
    output: torch.nn.Module | None


class BlockAdapter:
    """Locates one family's controllable parts in every decoder layer of a transformers causal LM."""

    def __init__(self, model):
        self.model = model
        self.family = family_of(model.config)
        fam = self.family
        self.parts = []
        for i, layer in enumerate(find_layers(model)):
            def get(owner, name, role, where="layer"):
                mod = getattr(owner, name, None) if name else None
                if mod is None:
                    raise UnsupportedArchitectureError(
                        f"layer {i} of {type(model).__name__} ({fam.key}) has no {where}.{name}: it is the {role} "
                        f"this family's adapter expects")
                return mod
            mlp = get(layer, fam.mlp, "MLP (input-controllable part)")
            v_site = get(layer, fam.v_site, "module whose input is v") if fam.layout == "sequential" else None
            attn = get(layer, fam.attn, "attention of the parallel block") if fam.layout == "parallel" else None
            if is_moe(mlp):
                impl = getattr(model.config, "_experts_implementation", None)
                if next(model.parameters()).dtype == torch.float64 and impl not in (None, "eager"):
                    raise UnsupportedArchitectureError(
                        f"{type(model).__name__} runs its experts with {impl!r}, which has no float64 kernel; call "
                        f"model.set_experts_implementation('eager') (or load with experts_implementation='eager')")
                self.parts.append(LayerParts(layer, mlp, v_site, attn, [], "moe", None))
                continue
            inputs = [(n, get(mlp, n, "input-controllable matrix", "mlp")) for n in fam.inputs]
            owner, where = (layer, "layer") if fam.output == "scale" else (mlp, "mlp")
            out = get(owner, fam.output_module, f"output-controllable parameter ({fam.output})", where)
            if fam.output == "scale" and getattr(out, "weight", None) is None:
                raise UnsupportedArchitectureError(
                    f"layer {i}: {fam.output_module} has no trainable scale, so nothing after the MLP is "
                    f"output-controllable (paper Appendix D: no upstream patch can absorb a large dv)")
            if fam.output == "bias" and getattr(out, "bias", None) is None:
                raise UnsupportedArchitectureError(f"layer {i}: mlp.{fam.output_module} has no bias to patch")
            self.parts.append(LayerParts(layer, mlp, v_site, attn, inputs, fam.output, out))
        self.dtype = next(model.parameters()).dtype
        self.norm_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def n_layers(self) -> int:
        return len(self.parts)

    def normalize(self, y: torch.Tensor, norm) -> torch.Tensor:
        return unit_rms(y.to(self.norm_dtype), rmsnorm_eps(norm))


def _last(t) -> torch.Tensor:
    t = t[0] if isinstance(t, tuple) else t
    return t.reshape(-1, t.shape[-1])[-1].detach().clone()


def _hidden_arg(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


@dataclass
class BlockTargets:
    """Recorded at the query position in the full-context pass (1-D, model dtype)."""

    v: torch.Tensor        # v_C (parallel blocks: x_C + attn_C)
    z: torch.Tensor        # z_C, the MLP input
    out: torch.Tensor      # the layer's output
    x: torch.Tensor | None = None   # the layer's input (for the single-block check)


@dataclass
class BlockPatch:
    """One layer's patch, as data: rank-1 input patches and the output patch of its kind."""

    layer: int
    kind: str
    inputs: dict = field(default_factory=dict)       # name -> Rank1 (MoE: "router", "expert3.gate_up", ...)
    output: dict = field(default_factory=dict)       # matrix/moe: name -> Rank1; bias/scale: name -> vector
    diagnostics: dict = field(default_factory=dict)  # z_norm, dv_norm, min_abs_h, fallbacks, S, routing_match


class BlockRecorder(HookScope):
    """Hooks that record ``BlockTargets`` at the last position of a full-context forward."""

    def __init__(self, adapter: BlockAdapter):
        self.ad, self.store, self._handles = adapter, {}, []

    def __enter__(self):
        for l, P in enumerate(self.ad.parts):
            s = self.store[l] = {}
            _install_site_hooks(P, s, self._handles.append)
            self._handles.append(P.mlp.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("z", _last(a[0]))))
            self._handles.append(P.layer.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("out", _last(o))))
        return self

    def targets(self) -> list[BlockTargets]:
        return [BlockTargets(v=self.store[l]["v"], z=self.store[l]["z"], out=self.store[l]["out"],
                             x=self.store[l]["x"]) for l in range(self.ad.n_layers)]


def _install_site_hooks(P: LayerParts, st: dict, reg):
    """Hooks that put this layer's input x into ``st["x"]`` and its v into ``st["v"]`` (sequential: the input of
    ``v_site``; parallel: x + attn, in float64)."""
    reg(P.layer.register_forward_pre_hook(lambda m, a, k: st.__setitem__("x", _last(_hidden_arg(a, k))),
                                          with_kwargs=True))
    if P.v_site is not None:
        reg(P.v_site.register_forward_pre_hook(lambda m, a: st.__setitem__("v", _last(a[0]))))
        return
    reg(P.attn.register_forward_hook(
        lambda m, a, o: st.__setitem__("v", st["x"].to(torch.float64) + _last(o).to(torch.float64))))


class ControlledPass(WeightScope):
    """Context manager around one no-context forward of the query token: patch layers ``targets`` covers."""

    def __init__(self, adapter: BlockAdapter, targets: dict, pdtype: torch.dtype | None = None,
                 single_block: bool = False):
        """``single_block=True``: every patched layer is fed the recorded full-context input ``x_C`` at the query
        (Theorem 1 for that block alone: same block input, context removed), instead of the layer below's output."""
        self.ad, self.targets, self.single_block = adapter, targets, single_block
        self.pdtype = pdtype or default_patch_dtype(adapter.dtype)
        self.patches: dict[int, BlockPatch] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles, self._saved = [], {}

    def _add_rank1(self, module, r1: Rank1):
        dense = r1.dense()
        self._add(module.weight, dense.t() if is_conv1d(module) else dense)

    def __enter__(self):
        for l, T in self.targets.items():
            self._install(l, T)
        return self

    # -- one layer -------------------------------------------------------------------------------------------
    def _install(self, l: int, T: BlockTargets):
        P, pd, reg = self.ad.parts[l], self.pdtype, self._handles.append
        st = {}
        patch = self.patches[l] = BlockPatch(layer=l, kind=P.output_kind)
        if self.single_block:
            def feed_recorded_input(mod, args, kwargs):
                x = _hidden_arg(args, kwargs)
                x_C = T.x.to(x.dtype).reshape(x.shape).contiguous()
                if args:
                    return (x_C,) + tuple(args[1:]), kwargs
                return args, {**kwargs, "hidden_states": x_C}
            reg(P.layer.register_forward_pre_hook(feed_recorded_input, with_kwargs=True))
        _install_site_hooks(P, st, reg)

        def at_mlp_input(mod, args):
            z = _last(args[0])
            st["dv"] = dv = T.v.to(pd) - st["v"].to(pd)
            patch.diagnostics.update(z_norm=float(z.to(pd).norm()), dv_norm=float(dv.norm()))
            if P.output_kind == "moe":
                return self._moe(l, P.mlp, z, T.z, dv, patch)
            for name, lin in P.inputs:
                r1 = patch.inputs[name] = input_patch(weight_oi(lin), z, T.z, pd, l, name)
                self._add_rank1(lin, r1)
            if P.output_kind == "bias":
                patch.output["bias"] = dv
                self._add(P.output.bias, dv)

        reg(P.mlp.register_forward_pre_hook(at_mlp_input))

        if P.output_kind == "matrix":
            def at_output_matrix(mod, args):
                h = _last(args[0]).to(pd)
                if not bool((h != 0).any()):
                    raise PatchError(f"layer {l}: the MLP hidden h is the zero vector, so the output-matrix patch "
                                     f"dW = dv h^T / ||h||^2 does not exist")
                r1 = patch.output["matrix"] = Rank1(u=st["dv"], z=h)
                patch.diagnostics["h_norm"] = float(h.norm())
                self._add_rank1(mod, r1)
            reg(P.output.register_forward_pre_hook(at_output_matrix))
        elif P.output_kind == "scale":
            def at_post_norm(mod, args):
                h = self.ad.normalize(_last(args[0]), mod).to(pd)
                dm, fallbacks, min_h = safe_divide(st["dv"], h)
                patch.output["scale"] = dm
                patch.diagnostics.update(fallbacks=fallbacks, min_abs_h=min_h)
                self._add(mod.weight, dm)
            reg(P.output.register_forward_pre_hook(at_post_norm))

        reg(P.layer.register_forward_hook(lambda m, a, o: self.outputs.__setitem__(l, _last(o))))

    def _moe(self, l, moe, z, z_C, dv, patch: BlockPatch):
        """Router and selected experts (input), and every selected expert's down projection adds ``dv / S``."""
        pd, experts = self.pdtype, moe.experts
        _, _, idx_C = moe.gate(z_C.reshape(1, -1))                      # routing with the context (unpatched)
        r1 = patch.inputs["router"] = input_patch(moe.gate.weight, z, z_C, pd, l, "router")
        self._add(moe.gate.weight, r1.dense())
        _, scores, idx = moe.gate(z.reshape(1, -1))                     # routing the patched router will use
        chosen = [int(e) for e in idx[0]]
        S = scores[0].to(pd).sum()
        patch.diagnostics.update(S=float(S), experts=chosen,
                                 routing_match=sorted(chosen) == sorted(int(e) for e in idx_C[0]))
        if float(S) == 0.0:
            raise PatchError(f"layer {l}: the selected experts' gates sum to S = 0, so no expert output patch "
                             f"dv / S exists")
        for e in chosen:
            r_in = patch.inputs[f"expert{e}.gate_up"] = input_patch(experts.gate_up_proj[e], z, z_C, pd, l,
                                                                    f"expert {e} gate_up")
            self._add(experts.gate_up_proj, r_in.dense(), e)
            gate, up = F.linear(z.reshape(1, -1), experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = (experts.act_fn(gate) * up)[0].to(pd)                   # the expert's hidden after its input patch
            if not bool((h != 0).any()):
                raise PatchError(f"layer {l}: expert {e}'s hidden is the zero vector; its output patch needs h != 0")
            r_out = patch.output[f"expert{e}.down"] = Rank1(u=dv / S, z=h)
            self._add(experts.down_proj, r_out.dense(), e)
        shared = getattr(moe, "shared_expert", None)
        if shared is not None:                                          # Qwen2-MoE: same output; input-patch it
            for name in ("gate_proj", "up_proj"):
                lin = getattr(shared, name)
                r = patch.inputs[f"shared.{name}"] = input_patch(lin.weight, z, z_C, pd, l, f"shared {name}")
                self._add(lin.weight, r.dense())
            gate_lin = moe.shared_expert_gate
            r = patch.inputs["shared_gate"] = input_patch(gate_lin.weight, z, z_C, pd, l, "shared_expert_gate")
            self._add(gate_lin.weight, r.dense())

"""The family registry (paper Section 5, Table 1): where v, z, the MLP and its output-controllable parameter live in
each transformers family's decoder layer, and the ``Adapter`` that finds those parts in a model.

A residual MLP block ``out = v + g(f(v))`` absorbs its context exactly when the inner function is
*input-controllable* (a parameter patch makes ``f(v) = f(v_C)``) and the outer one *output-controllable* (a patch adds
any ``dv = v_C - v``). A ``Family`` says, in a few names, which modules play those roles; nothing else in the package
guesses from class names. Adding a family is one entry here (and, for its tiny test model, one config in
``fixtures.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hooks import UnsupportedArchitectureError, norm_eps, unit_rms


@dataclass(frozen=True)
class Family:
    key: str
    hf_class: str
    layout: str                      # "sequential" | "parallel"
    norms: str                       # "pre" | "pre+post" | "post"
    output: str                      # "matrix" | "bias" | "scale" (dense MLPs; MoE layers are "moe")
    output_module: str               # under the MLP (matrix, bias) or under the layer (scale)
    inputs: tuple = ("gate_proj", "up_proj")
    v_site: str | None = None        # sequential: the layer's submodule whose input is v
    attn: str | None = None          # parallel: the attention submodule (its output[0] is attn)
    mlp: str = "mlp"
    mlp_out: str = "down_proj"       # the MLP's last matrix (scale outputs: what the stable variant patches)
    scale_offset: float = 0.0        # RMSNorm scale m = offset + weight, for every RMSNorm of the family
    conv1d: bool = False             # linear maps stored transposed, (in, out) (GPT-2's Conv1D)

    def describe(self) -> str:
        return f"{self.layout}, {self.norms}-norm"


def _seq(key, hf_class, **kw):
    return Family(key, hf_class, "sequential", kw.pop("norms", "pre"), kw.pop("output", "matrix"),
                  kw.pop("output_module", "down_proj"), v_site=kw.pop("v_site", "post_attention_layernorm"), **kw)


_POST_FF = dict(output="scale", output_module="post_feedforward_layernorm")
FAMILIES = {f.key: f for f in (
    _seq("gemma", "GemmaForCausalLM", scale_offset=1.0),
    _seq("gemma2", "Gemma2ForCausalLM", norms="pre+post", v_site="pre_feedforward_layernorm", scale_offset=1.0,
         **_POST_FF),
    _seq("gemma3", "Gemma3ForCausalLM", norms="pre+post", v_site="pre_feedforward_layernorm", scale_offset=1.0,
         **_POST_FF),
    _seq("llama", "LlamaForCausalLM"),
    _seq("mistral", "MistralForCausalLM"),
    _seq("qwen2", "Qwen2ForCausalLM"),
    _seq("qwen3", "Qwen3ForCausalLM"),
    _seq("mixtral", "MixtralForCausalLM"),
    _seq("qwen2_moe", "Qwen2MoeForCausalLM"),
    _seq("qwen3_moe", "Qwen3MoeForCausalLM"),
    _seq("olmo2", "Olmo2ForCausalLM", norms="post", v_site="mlp", **_POST_FF),
    _seq("gpt2", "GPT2LMHeadModel", output="bias", output_module="c_proj", inputs=("c_fc",), v_site="ln_2",
         mlp_out="c_proj", conv1d=True),
    _seq("falcon-sequential", "FalconForCausalLM", output_module="dense_4h_to_h", inputs=("dense_h_to_4h",),
         mlp_out="dense_4h_to_h"),
    Family("falcon-parallel", "FalconForCausalLM", "parallel", "pre", "matrix", "dense_4h_to_h",
           inputs=("dense_h_to_4h",), attn="self_attention", mlp_out="dense_4h_to_h"),
    Family("gptj", "GPTJForCausalLM", "parallel", "pre", "bias", "fc_out", inputs=("fc_in",), attn="attn",
           mlp_out="fc_out"),
)}

MODEL_TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "llama": "llama",
               "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
               "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "olmo2": "olmo2", "gpt2": "gpt2", "gptj": "gptj"}
LAYER_PATHS = ("model.layers", "transformer.h", "model.language_model.layers")


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
            f"ctxpatch_lite/families.py")
    return FAMILIES[MODEL_TYPES[mtype]]


def find_layers(model):
    for path in LAYER_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return obj
    raise UnsupportedArchitectureError(f"{type(model).__name__}: no decoder layer list found (looked for "
                                       f"{', '.join(LAYER_PATHS)})")


def is_moe(mlp) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj")


@dataclass
class LayerParts:
    index: int
    layer: torch.nn.Module
    mlp: torch.nn.Module
    v_site: torch.nn.Module | None
    attn: torch.nn.Module | None
    inputs: list                      # (name, module) input matrices of a dense MLP
    kind: str                         # matrix | bias | scale | moe
    output: torch.nn.Module | None    # output-controllable module (matrix/bias: a linear map; scale: the post-norm)
    down: torch.nn.Module | None      # the MLP's last matrix


class Adapter:
    """Locates one family's controllable parts in every decoder layer of a transformers causal LM."""

    def __init__(self, model):
        self.model = model
        self.family = fam = family_of(model.config)
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
                self.parts.append(LayerParts(i, layer, mlp, v_site, attn, [], "moe", None, None))
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
            down = get(mlp, fam.mlp_out, "MLP output matrix", "mlp")
            self.parts.append(LayerParts(i, layer, mlp, v_site, attn, inputs, fam.output, out, down))
        self.dtype = next(model.parameters()).dtype
        self.norm_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        self._refuse_offloaded()

    def _refuse_offloaded(self):
        """Patches are written into (or computed from) the MLP and norm weights of each layer: weights that a
        ``device_map`` offloaded to the CPU or disk live on the 'meta' device between uses, so refuse them."""
        bad = []
        for P in self.parts:
            mods = [m for m in (P.mlp, P.output, P.v_site, P.attn) if m is not None]
            subs = [sub for m in mods for sub in m.modules()]
            offloaded = any(getattr(getattr(sub, "_hf_hook", None), "offload", False) for sub in subs)
            if offloaded or any(p.device.type == "meta" for m in mods for p in m.parameters()):
                bad.append(P.index)
        if bad:
            raise UnsupportedArchitectureError(
                f"layers {', '.join(map(str, bad))} of this model are offloaded (device_map put their weights on the "
                f"CPU or disk, so they sit on the 'meta' device between uses): patches cannot be written into or "
                f"computed from them. Load the model fully onto GPU memory (a GPU with more memory, several GPUs, "
                f"bfloat16) or use a smaller model")

    def reference_norms(self, l: int) -> dict:
        """Norms of layer ``l``'s patchable parameters as first seen (float64 0-d tensors on their device; cached,
        so call it before a pass writes into the weights): each input matrix by name, ``down`` / ``matrix`` (the
        MLP output matrix), ``scale`` (``||m||`` of a post-norm scale) and ``bias``. The ledger reads patch sizes
        relative to these."""
        cache = self.__dict__.setdefault("_ref_norms", {})
        if l not in cache:
            P, out = self.parts[l], {}
            with torch.no_grad():
                fro = lambda w: w.detach().to(torch.float64).norm()  # noqa: E731
                for name, lin in P.inputs:
                    out[name] = fro(lin.weight)
                if P.down is not None:
                    out["down"] = fro(P.down.weight)
                if P.kind == "matrix":
                    out["matrix"] = fro(P.output.weight)
                elif P.kind == "scale":
                    out["scale"] = self.scale(P.output).to(torch.float64).norm()
                elif P.kind == "bias":
                    out["bias"] = fro(P.output.bias)
            cache[l] = out
        return cache[l]

    @property
    def n_layers(self) -> int:
        return len(self.parts)

    @property
    def stable_ok(self) -> bool:
        """The stable variant (Appendix B) needs a trainable post-norm scale after the MLP's output matrix."""
        return all(P.kind == "scale" for P in self.parts)

    def weight_oi(self, module) -> torch.Tensor:
        """A linear map's weight as (out, in), whatever layout the family stores."""
        return module.weight.t() if self.family.conv1d else module.weight

    def normalize(self, y: torch.Tensor, norm) -> torch.Tensor:
        """N(y) in the norm's compute dtype (float32; float64 for float64 models), with ``norm``'s epsilon."""
        return unit_rms(y.to(self.norm_dtype), norm_eps(norm))

    def scale(self, norm) -> torch.Tensor:
        """A post-norm's scale ``m = offset + weight`` in the norm dtype."""
        return self.family.scale_offset + norm.weight.to(self.norm_dtype)

    def describe_parts(self) -> tuple[str, str, str]:
        """(block kind, input patch, output patch) in words, from the layers found."""
        fam, kinds = self.family, {p.kind for p in self.parts}
        block = fam.describe() + (", MoE" if "moe" in kinds else "")
        dense = next((p for p in self.parts if p.kind != "moe"), None)
        ins, outs = [], []
        if "moe" in kinds:
            moe_part = next(p for p in self.parts if p.kind == "moe")
            ins.append("router + experts' gate_up" + (" + shared expert" if hasattr(moe_part.mlp, "shared_expert")
                                                      else ""))
            outs.append("experts' down_proj += dv/S")
        if dense is not None:
            ins.append(", ".join(n for n, _ in dense.inputs))
            offset = f"{fam.scale_offset:g} + w" if fam.scale_offset else "w"
            outs.append({"matrix": f"{fam.output_module} (matrix)", "bias": f"{fam.output_module}.bias",
                         "scale": f"{fam.output_module} scale m = {offset}"}[fam.output])
        return block, "; ".join(ins), "; ".join(outs)

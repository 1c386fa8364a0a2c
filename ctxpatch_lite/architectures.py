"""Algorithm 1 on every family of ``controllability.FAMILIES``: seeded tiny models of transformers' own classes, the
generation protocol on them, and the rows of the verification table (``verify_architectures``).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .controllability import FAMILIES, BlockAdapter, BlockRecorder, ControlledPass
from .engine import float64_norms, rmsnorm_offset
from .metrics import relative_error
from .models import resolve_dtype

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, HEAD_DIM = 128, 64, 96, 3, 4, 2, 16


def _llama_like(cls_name, **extra):
    def make():
        import transformers
        cfg = getattr(transformers, cls_name)(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
        return cfg
    return make


def _config_makers():
    import transformers as tf
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
    return {
        "gemma": _llama_like("GemmaConfig"),
        "gemma2": _llama_like("Gemma2Config", query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
        "gemma3": _llama_like("Gemma3TextConfig", query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
        "llama": _llama_like("LlamaConfig"),
        "mistral": _llama_like("MistralConfig", sliding_window=8),
        "qwen2": _llama_like("Qwen2Config"),
        "qwen3": _llama_like("Qwen3Config"),
        "mixtral": _llama_like("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": _llama_like("Qwen2MoeConfig", num_experts=4, shared_expert_intermediate_size=64,
                                 norm_topk_prob=False, **moe),
        "qwen3_moe": _llama_like("Qwen3MoeConfig", num_experts=4, norm_topk_prob=False, **moe),
        "olmo2": _llama_like("Olmo2Config"),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256,
                                      n_inner=INTER, bos_token_id=1, eos_token_id=2),
        "falcon-parallel": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                                   num_attention_heads=HEADS, parallel_attn=True, alibi=False,
                                                   new_decoder_architecture=False, bias=False),
        "falcon-sequential": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                                     num_attention_heads=HEADS, parallel_attn=False, alibi=False,
                                                     new_decoder_architecture=False, bias=True),
        "gptj": lambda: tf.GPTJConfig(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=8,
                                      n_positions=256, n_inner=INTER, bos_token_id=1, eos_token_id=2),
    }


def tiny_model(family: str, seed: int = 0, dtype="float64"):
    """A seeded random-weight causal LM of ``family``'s own transformers class (3 layers, width 64, vocab 128).

    Matrices get std ``fan_in**-0.5``, embeddings std 0.5, biases std 0.1 and every norm scale a random
    ``1 + 0.3 * noise`` (Gemma's ``1 + weight`` stores the noise), so that no patch is trivially zero.
    """
    import transformers

    makers = _config_makers()
    if family not in makers:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(makers)}")
    cfg = makers[family]()
    cls = getattr(transformers, FAMILIES[family].hf_class)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = cls(cfg)
    if hasattr(model, "set_experts_implementation") and getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # the grouped_mm kernel has no float64; eager loops over experts
    with torch.no_grad():
        for mname, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=gen)
                if p.dim() >= 2:
                    emb = any(k in mname for k in ("embed", "wte", "wpe", "word_embeddings"))
                    p.copy_(noise * (0.5 if emb else p.shape[-1] ** -0.5))
                elif pname == "bias":
                    p.copy_(0.1 * noise)
                else:  # a norm scale
                    p.copy_(0.3 * noise + (1.0 - rmsnorm_offset(mod)))
    model.to(resolve_dtype(dtype)).eval().requires_grad_(False)
    model.ctxpatch_source = f"tiny-{family}(seed={seed})"
    return model



def _full_context(model, adapter: BlockAdapter, seq: list):
    """One full-context forward of ``seq`` with the targets recorded at its last token.

    Returns (last logits, [BlockTargets per layer], the query token (1, 1), its position (1, 1)).
    """
    dev = next(model.parameters()).device
    ids = torch.tensor([list(seq)], device=dev)
    with float64_norms(model), BlockRecorder(adapter) as rec:
        base = model(input_ids=ids, use_cache=False).logits[0, -1]
    return base, rec.targets(), ids[:, -1:], torch.tensor([[len(seq) - 1]], device=dev)


@torch.no_grad()
def algorithm1_step(model, adapter: BlockAdapter, seq: list, start_layer: int = 0, pdtype=None):
    """Full-context pass over ``seq``, then its last token alone with patches from ``start_layer`` on.

    Returns (baseline logits, patched logits, unpatched logits, per-layer relative errors, {layer: BlockPatch}).
    """
    base, targets, q, pos = _full_context(model, adapter, seq)
    layers = {l: targets[l] for l in range(start_layer, adapter.n_layers)}
    with float64_norms(model), ControlledPass(adapter, layers, pdtype) as cp:
        patched = model(input_ids=q, position_ids=pos, use_cache=False).logits[0, -1]
    with float64_norms(model):
        unpatched = model(input_ids=q, position_ids=pos, use_cache=False).logits[0, -1]
    errors = [relative_error(cp.outputs[l], targets[l].out) for l in sorted(cp.outputs)]
    return base, patched, unpatched, errors, cp.patches


@torch.no_grad()
def single_block_errors(model, seq: list, pdtype=None) -> list[float]:
    """Theorem 1 block by block: layer l alone is patched and fed the full-context input ``x_C`` at the query;
    returns, per layer, max |patched output - full-context output| / max |full-context output|."""
    adapter = BlockAdapter(model)
    _, targets, q, pos = _full_context(model, adapter, seq)
    errors = []
    for l in range(adapter.n_layers):
        with float64_norms(model), ControlledPass(adapter, {l: targets[l]}, pdtype, single_block=True) as cp:
            model(input_ids=q, position_ids=pos, use_cache=False)
        errors.append(relative_error(cp.outputs[l], targets[l].out))
    return errors


@torch.no_grad()
def run_algorithm1(model, prompt_ids, n_tokens: int = 8, start_layer: int = 0, pdtype=None, progress=False) -> dict:
    """The paper's protocol on any supported family: greedy baseline with context; the patched model sees only the
    current token; both continue on the baseline's token. Returns per-step records and their summary."""
    adapter = BlockAdapter(model)
    if not 0 <= start_layer < adapter.n_layers:
        raise ValueError(f"start_layer {start_layer} out of range 0..{adapter.n_layers - 1}")
    seq, steps = [int(t) for t in prompt_ids], []
    if len(seq) < 2:
        raise ValueError("prompt_ids needs a context before the query token (at least 2 tokens)")
    for _ in tqdm(range(n_tokens), desc=f"Algorithm 1 ({adapter.family.key})", disable=not progress, leave=False):
        base, patched, unpatched, errors, patches = algorithm1_step(model, adapter, seq, start_layer, pdtype)
        diags = [p.diagnostics for p in patches.values()]
        steps.append(dict(
            match=int(patched.argmax()) == int(base.argmax()), linf=float((patched - base).abs().max()),
            none_match=int(unpatched.argmax()) == int(base.argmax()),
            none_linf=float((unpatched - base).abs().max()), layer_errors=errors,
            fallbacks=sum(d.get("fallbacks", 0) for d in diags),
            routing_match=all(d.get("routing_match", True) for d in diags),
            min_S=min((d["S"] for d in diags if "S" in d), default=None)))
        seq.append(int(base.argmax()))
    linf = [s["linf"] for s in steps]
    return dict(family=adapter.family.key, steps=steps, tokens=len(steps),
                matches=sum(s["match"] for s in steps), none_matches=sum(s["none_match"] for s in steps),
                max_block_error=max(max(s["layer_errors"]) for s in steps),
                linf_median=statistics.median(linf), linf_max=max(linf), linf_last=linf[-1],
                none_linf_median=statistics.median(s["none_linf"] for s in steps),
                fallbacks=sum(s["fallbacks"] for s in steps),
                routing_matches=sum(s["routing_match"] for s in steps),
                min_S=min((s["min_S"] for s in steps if s["min_S"] is not None), default=None))


@dataclass
class FamilyRow:
    family: str
    hf_class: str
    block: str
    input_patch: str
    output_patch: str
    dtype: str
    single_block_rel_error: float
    max_block_rel_error: float
    token_match: str
    linf_median: float
    linf_last: float
    fallbacks: int
    none_token_match: str
    none_linf_median: float
    routing: str
    weights: str = "random (seeded)"

    def to_dict(self):
        return asdict(self)


FLOAT64_TOLERANCE = 1e-10


def meets_target(row: dict) -> bool:
    """A family row (``FamilyRow.to_dict()`` or its JSON) meets the target: every token matches, and in float64
    every block, alone and inside Algorithm 1, is within ``FLOAT64_TOLERANCE`` of its full-context output."""
    done, total = (int(x) for x in row["token_match"].split("/"))
    ok = done == total
    if row["dtype"] == "float64":
        ok = ok and max(row["max_block_rel_error"], row["single_block_rel_error"]) <= FLOAT64_TOLERANCE
    return ok


def describe_parts(adapter: BlockAdapter) -> tuple[str, str, str]:
    """(block kind, input patch, output patch) in words, from the layers the adapter found."""
    fam, kinds = adapter.family, {p.output_kind for p in adapter.parts}
    moe = "moe" in kinds
    block = fam.describe() + (", MoE" if moe else "")
    dense = next((p for p in adapter.parts if p.output_kind != "moe"), None)
    ins, outs = [], []
    if moe:
        moe_part = next(p for p in adapter.parts if p.output_kind == "moe")
        ins.append("router + experts' gate_up" + (" + shared expert" if hasattr(moe_part.mlp, "shared_expert") else ""))
        outs.append("experts' down_proj += dv/S")
    if dense is not None:
        ins.append(", ".join(n for n, _ in dense.inputs))
        offset = f"{fam.scale_offset:g} + w" if fam.scale_offset else "w"
        outs.append({"matrix": f"{fam.output_module} (matrix)", "bias": f"{fam.output_module}.bias",
                     "scale": f"{fam.output_module} scale m = {offset}"}[fam.output])
    return block, "; ".join(ins), "; ".join(outs)


def _row(model, family_key: str, res: dict, dtype: str, weights: str, prompt) -> FamilyRow:
    block, ins, outs = describe_parts(BlockAdapter(model))
    moe = res["min_S"] is not None          # a gate sum was recorded: the model has MoE layers
    routing = f"{res['routing_matches']}/{res['tokens']}, min S {res['min_S']:.3f}" if moe else "-"
    single = max(single_block_errors(model, prompt))
    return FamilyRow(family_key, type(model).__name__, block, ins, outs, dtype, single, res["max_block_error"],
                     f"{res['matches']}/{res['tokens']}", res["linf_median"], res["linf_last"], res["fallbacks"],
                     f"{res['none_matches']}/{res['tokens']}", res["none_linf_median"], routing, weights)


def verify_family(family: str, dtype="float64", n_tokens: int = 8, seed: int = 0, prompt_len: int = 6,
                  progress: bool = False) -> FamilyRow:
    """Algorithm 1 (all layers, self-correcting) on the seeded tiny model of ``family``: one table row."""
    model = tiny_model(family, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist()
    res = run_algorithm1(model, prompt, n_tokens=n_tokens, progress=progress)
    return _row(model, family, res, dtype, "random (seeded)", prompt)


def verify_embedded(dtype="float32", n_tokens: int = 4, prompt: str = "The capital of France is",
                    progress: bool = False) -> FamilyRow:
    """The same generic path on the real embedded Gemma 3 270M (the one real checkpoint available offline)."""
    from .models import load_model
    from .protocol import encode_prompt

    model, tokenizer = load_model(dtype=dtype, device="cpu")
    ids = encode_prompt(tokenizer, prompt)
    res = run_algorithm1(model, ids, n_tokens=n_tokens, progress=progress)
    return _row(model, "gemma3", res, dtype, "real: embedded Gemma 3 270M", ids)

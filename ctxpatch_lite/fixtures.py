"""Tiny seeded random-weight models of transformers' own classes, for fast exactness tests and demos."""
from __future__ import annotations

import torch

from .models import resolve_dtype


VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, HEAD_DIM = 128, 64, 96, 3, 4, 2, 16


def _llama_like(cls_name, **extra):
    def make(layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, intermediate=INTER, **over):
        import transformers
        kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
        kw.update(over)
        return getattr(transformers, cls_name)(**kw)
    return make


def _gpt(cls_name, **extra):
    def make(layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, intermediate=INTER, **over):
        import transformers
        kw = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=HEADS, n_positions=256, n_inner=intermediate,
                  bos_token_id=1, eos_token_id=2, **extra)
        kw.update(over)
        return getattr(transformers, cls_name)(**kw)
    return make


def _falcon(parallel: bool):
    def make(layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, intermediate=None, **over):
        import transformers
        kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
                  parallel_attn=parallel, alibi=False, new_decoder_architecture=False, bias=not parallel)
        kw.update(over)
        return transformers.FalconConfig(**kw)
    return make


_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)
CONFIGS = {
    "gemma": _llama_like("GemmaConfig"),
    "gemma2": _llama_like("Gemma2Config", query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
    "gemma3": _llama_like("Gemma3TextConfig", query_pre_attn_scalar=HEAD_DIM, sliding_window=8),
    "llama": _llama_like("LlamaConfig"),
    "mistral": _llama_like("MistralConfig", sliding_window=8),
    "qwen2": _llama_like("Qwen2Config"),
    "qwen3": _llama_like("Qwen3Config"),
    "mixtral": _llama_like("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": _llama_like("Qwen2MoeConfig", num_experts=4, shared_expert_intermediate_size=64,
                             norm_topk_prob=False, **_MOE),
    "qwen3_moe": _llama_like("Qwen3MoeConfig", num_experts=4, norm_topk_prob=False, **_MOE),
    "olmo2": _llama_like("Olmo2Config"),
    "gpt2": _gpt("GPT2Config"),
    "falcon-parallel": _falcon(True),
    "falcon-sequential": _falcon(False),
    "gptj": _gpt("GPTJConfig", rotary_dim=8),
}


def tiny_model(family: str, seed: int = 0, dtype="float64", **config):
    """A seeded random-weight causal LM of ``family``'s own transformers class (3 layers, width 64, vocab 128 unless
    ``config`` overrides ``layers``, ``vocab``, ``hidden``, ``intermediate`` or any config field).

    Matrices get std ``fan_in**-0.5``, embeddings std 0.5, biases std 0.1 and every norm scale a random
    ``1 + 0.3 * noise`` (a family whose norms scale by ``1 + weight`` stores the noise), so that no patch is
    trivially zero.
    """
    import transformers

    from .families import FAMILIES

    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(CONFIGS)}")
    cfg = CONFIGS[family](**config)
    cls = getattr(transformers, FAMILIES[family].hf_class)
    offset = FAMILIES[family].scale_offset
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
                else:  # a norm scale (LayerNorms scale by weight; the family's RMSNorms by offset + weight)
                    p.copy_(0.3 * noise + (1.0 - (0.0 if isinstance(mod, torch.nn.LayerNorm) else offset)))
    model.to(resolve_dtype(dtype)).eval().requires_grad_(False)
    model.ctxpatch_source = f"tiny-{family}(seed={seed})"
    return model


def tiny_gemma3(seed: int = 0, dtype="float32", num_layers: int = 4, vocab: int = 96, **config):
    """A seeded random ``Gemma3ForCausalLM`` (4 layers, vocab 96: the ``tiny_tokenizer``'s), via ``tiny_model``."""
    config.setdefault("layer_types", ["sliding_attention" if (i + 1) % 3 else "full_attention"
                                      for i in range(num_layers)])
    model = tiny_model("gemma3", seed=seed, dtype=dtype, layers=num_layers, vocab=vocab, intermediate=128,
                       bos_token_id=2, eos_token_id=1, **config)
    model.ctxpatch_source = f"tiny-gemma3(seed={seed})"
    return model


# google/gemma-3-1b-it's published configuration (config.json of the checkpoint).
GEMMA3_1B = dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                 query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                 layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
                 pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)


def gemma3_1b_shaped(seed: int = 0, progress: bool = True):
    """A local folder with a random-weight ``Gemma3ForCausalLM`` of google/gemma-3-1b-it's shape (26 layers,
    hidden 1152, intermediate 6912, 4 heads / 1 KV head, head_dim 256, sliding window 512 on 5 of every 6 layers,
    vocab 262,144), in bfloat16 (2 GB), with the embedded Gemma 3 tokenizer saved beside it: the full-size
    rehearsal of the GPU run, on any machine. Built once (about a minute) and cached like the embedded model.

    Weights: transformers' own initialisation, except the RMSNorm scales, drawn from normal(0, 0.5) (Gemma scales
    by ``1 + w``; the default of 0 would make every scale patch degenerate). Seeded."""
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from .models import _atomic_folder, _ensure, cache_root, ensure_embedded

    folder = cache_root() / f"gemma-3-1b-shaped-random-seed{seed}-transformers-{transformers.__version__}"

    def build():
        from transformers import AutoTokenizer

        if progress:
            print(f"[ctxpatch_lite] building the Gemma-3-1B-shaped rehearsal model once into {folder}", flush=True)
        with _atomic_folder(folder, "bfloat16") as tmp:
            torch.manual_seed(seed)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)       # initialise in bfloat16: 2 GB, not 4 GB, of memory
            try:
                model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3_1B))
            finally:
                torch.set_default_dtype(old)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            model.config.dtype = torch.bfloat16
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(ensure_embedded(progress=progress)).save_pretrained(tmp)
            del model

    _ensure(folder, build, "Gemma-3-1B-shaped rehearsal model", progress)
    return folder


def tiny_tokenizer():
    """A character-level fast tokenizer (printable ASCII) with Gemma's special ids: <pad>=0, <eos>=1, <bos>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for ch in chars:
        if len(vocab) >= 96:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")

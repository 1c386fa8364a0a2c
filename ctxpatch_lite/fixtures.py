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
    _seed_weights(model, gen, offset)
    model.to(resolve_dtype(dtype)).eval().requires_grad_(False)
    model.ctxpatch_source = f"tiny-{family}(seed={seed})"
    return model


@torch.no_grad()
def _seed_weights(model, gen: torch.Generator, offset: float) -> None:
    """Matrices std ``fan_in**-0.5``, embeddings std 0.5, biases std 0.1, norm scales ``1 + 0.3 * noise`` (stored
    as the noise where the norm scales by ``offset + weight``), so that no patch is trivially zero."""
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                emb = any(k in mname for k in ("embed", "wte", "wpe", "word_embeddings"))
                fan_in = p[0].numel() if p.dim() == 4 else p.shape[-1]       # a conv kernel (SigLIP patches): in × k × k
                p.copy_(noise * (0.5 if emb else fan_in ** -0.5))
            elif pname == "bias":
                p.copy_(0.1 * noise)
            else:  # a norm scale (LayerNorms scale by weight; the family's RMSNorms by offset + weight)
                p.copy_(0.3 * noise + (1.0 - (0.0 if isinstance(mod, torch.nn.LayerNorm) else offset)))


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


def gemma3_1b_shaped(seed: int = 0, progress: bool = True, tokenizer: str = "embedded"):
    """A local folder with a random-weight ``Gemma3ForCausalLM`` of google/gemma-3-1b-it's shape (26 layers,
    hidden 1152, intermediate 6912, 4 heads / 1 KV head, head_dim 256, sliding window 512 on 5 of every 6 layers,
    vocab 262,144), in bfloat16 (2 GB), with the embedded Gemma 3 tokenizer saved beside it: the full-size
    rehearsal of the GPU run, on any machine. Built once (about a minute) and cached like the embedded model.

    Weights: transformers' own initialisation, except the RMSNorm scales, drawn from normal(0, 0.5) (Gemma scales
    by ``1 + w``; the default of 0 would make every scale patch degenerate). Seeded. ``tokenizer="char"`` saves
    the character-level ``tiny_tokenizer`` instead (a machine without the embedded model, e.g. a GPU box with no
    network: text becomes one token per character, ids far below the vocabulary)."""
    if tokenizer not in ("embedded", "char"):
        raise ValueError(f"tokenizer {tokenizer!r}: choose embedded or char")
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from .models import _atomic_folder, _ensure, cache_root, ensure_embedded

    folder = cache_root() / (f"gemma-3-1b-shaped-random-seed{seed}-transformers-{transformers.__version__}"
                             + ("-char" if tokenizer == "char" else ""))

    def build():
        from transformers import AutoTokenizer

        if progress:
            print(f"[ctxpatch_lite] building the Gemma-3-1B-shaped rehearsal model once into {folder}", flush=True)
        source = f"random weights, seed {seed}" if tokenizer == "char" else None   # needs no embedded package
        with _atomic_folder(folder, "bfloat16", source=source) as tmp:
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
            if tokenizer == "char":
                tiny_tokenizer().save_pretrained(tmp)
            else:
                AutoTokenizer.from_pretrained(ensure_embedded(progress=progress)).save_pretrained(tmp)
            del model

    _ensure(folder, build, "Gemma-3-1B-shaped rehearsal model", progress)
    return folder


def _char_tokenizer(specials: list, size: int | None, **extra):
    """A character-level fast tokenizer: ``specials`` get ids 0.. in order (<pad>, <eos>, <bos>, <unk> first), then
    printable ASCII until ``size`` entries (all of it when ``size`` is None); BOS prepended like Gemma's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in (chr(c) for c in range(32, 127)):
        if size is not None and len(vocab) >= size:
            break
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", **extra)


def tiny_tokenizer():
    """A character-level fast tokenizer (printable ASCII) with Gemma's special ids: <pad>=0, <eos>=1, <bos>=2."""
    return _char_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], 96)


# The tiny multimodal Gemma 3 (issue: images are context too): transformers' own Gemma3ForConditionalGeneration with
# a 2-layer SigLIP (32 × 32 images, 8 × 8 patches: 16 patches pooled to 4 soft tokens per image) and a 4-layer language
# model over the character tokenizer below, extended by Gemma's three image tokens.
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
VISION_SOFT_TOKENS = 4
VISION_VOCAB = 104          # the tokenizer's 103 entries, padded


def tiny_vision_tokenizer():
    """A character-level tokenizer like ``tiny_tokenizer`` (all of printable ASCII) plus "\\n" and Gemma 3's image
    tokens (<start_of_image>=4, <end_of_image>=5, <image_soft_token>=6) as named special tokens, which
    ``Gemma3Processor`` reads (``boi_token`` ...)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", IMAGE_TOKENS["boi_token"], IMAGE_TOKENS["eoi_token"],
                IMAGE_TOKENS["image_token"], "\n"]
    return _char_tokenizer(specials, None, extra_special_tokens=dict(IMAGE_TOKENS))


def tiny_vision_processor():
    """``Gemma3Processor`` for the tiny multimodal model: 32 × 32 images (PIL backend), 4 soft tokens per image."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Gemma3Processor(image_processor=images, tokenizer=tiny_vision_tokenizer(),
                           image_seq_length=VISION_SOFT_TOKENS)


def tiny_gemma3_vision(seed: int = 0, dtype="float64", num_layers: int = 4):
    """A seeded random ``Gemma3ForConditionalGeneration`` (SigLIP 2 layers, width 32; language model ``num_layers``
    layers, width 64, sliding window 32 on 2 of every 3 layers; vocabulary 104), built in well under a second."""
    import transformers

    text = dict(vocab_size=VISION_VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=num_layers,
                num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                sliding_window=32, max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(num_layers)])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=VISION_SOFT_TOKENS,
                                    boi_token_index=4, eoi_token_index=5, image_token_index=6)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    _seed_weights(model, torch.Generator().manual_seed(seed), offset=1.0)
    model.to(resolve_dtype(dtype)).eval().requires_grad_(False)
    model.ctxpatch_source = f"tiny-gemma3-vision(seed={seed})"
    return model


def tiny_gemma3_vision_folder(seed: int = 0, dtype: str = "float32"):
    """A local folder holding the tiny multimodal model and its processor (``save_pretrained`` of both), built once
    and cached: what ``load_model(folder)`` and ``ctxpatch-compare --model FOLDER --image ...`` read, exactly as
    they read ``google/gemma-3-4b-it``."""
    import os
    import shutil

    import transformers

    from .models import cache_root

    folder = cache_root() / f"tiny-gemma3-vision-seed{seed}-{dtype}-transformers-{transformers.__version__}"
    if not (folder / "config.json").exists():                 # built in a private folder, renamed when complete
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tiny_gemma3_vision(seed=seed, dtype=dtype).save_pretrained(tmp)
            tiny_vision_processor().save_pretrained(tmp)
            if not (folder / "config.json").exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder

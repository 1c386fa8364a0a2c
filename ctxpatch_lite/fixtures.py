"""Tiny seeded random-weight models of transformers' own classes, for fast exactness tests and demos."""
from __future__ import annotations

import torch

from .models import resolve_dtype


def tiny_gemma3_config(num_layers: int = 4, hidden: int = 64, intermediate: int = 128, heads: int = 4,
                       kv_heads: int = 2, head_dim: int = 16, vocab: int = 96, sliding_window: int = 8):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=head_dim,
        sliding_window=sliding_window, max_position_embeddings=256, rms_norm_eps=1e-6,
        layer_types=["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(num_layers)],
        pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
    )


def tiny_gemma3(seed: int = 0, dtype="float32", **config_kwargs):
    """A seeded random ``Gemma3ForCausalLM``; norm scales are randomised too (the default init is all zeros)."""
    from transformers import Gemma3ForCausalLM

    cfg = tiny_gemma3_config(**config_kwargs)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
    model.to(resolve_dtype(dtype)).eval().requires_grad_(False)
    model.ctxpatch_source = f"tiny-gemma3(seed={seed})"
    return model


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

"""A Gemma 3 decoder block written from scratch in plain torch, for teaching (notebook 01).

It reads the weights of one transformers ``Gemma3DecoderLayer`` and recomputes, for a whole sequence,

    v   = x + post_attention_norm(attention(input_norm(x)))       # grouped-query attention, RoPE, q/k norms
    z   = pre_feedforward_norm(v)
    h_g = gelu_tanh(W_gate z) * (W_up z)
    out = v + post_feedforward_norm(W_down h_g)

with every intermediate returned, so a learner can see where the patches of Theorem 1 act (W_gate, W_up on z;
the post-feedforward scale m = 1 + w). The learner writes the forward pass and the RMSNorm in notebook 01; the
solutions are ``ctxpatch_lite.solutions.gemma_block`` and ``rms_norm``, which this class runs.
``tests/test_block.py`` checks it against the real layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


from .solutions import gemma_block, rms_norm


def unit_rms(y: torch.Tensor, eps: float) -> torch.Tensor:
    """N(y) = y / sqrt(mean(y^2) + eps), computed as Gemma's RMSNorm computes it: in float32 for the low
    precisions, in float64 for float64."""
    from .hooks import unit_rms as n
    return n(y.to(torch.float64 if y.dtype == torch.float64 else torch.float32), eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, factor: float = 1.0) -> torch.Tensor:
    """Rotary position embedding on (..., T, head_dim), halves layout (as in transformers' rotate_half)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = (positions.to(device=x.device, dtype=torch.float32)[:, None] / factor) * inv_freq[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@dataclass
class BlockTrace:
    v: torch.Tensor
    z: torch.Tensor
    h_gated: torch.Tensor
    h_down: torch.Tensor
    out: torch.Tensor


class GemmaBlock:
    """One Gemma 3 decoder layer in plain torch, holding references to the real layer's weights."""

    def __init__(self, layer, config, layer_idx: int):
        a, mlp = layer.self_attn, layer.mlp
        self.Wq, self.Wk, self.Wv, self.Wo = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight
        self.q_norm, self.k_norm = a.q_norm.weight, a.k_norm.weight
        self.W_gate, self.W_up, self.W_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        self.norms = {n: getattr(layer, n).weight for n in ("input_layernorm", "post_attention_layernorm",
                                                             "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        self.eps = config.rms_norm_eps
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5
        layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        rp = (getattr(config, "rope_parameters", None) or {}).get(layer_type, {})
        self.theta = rp.get("rope_theta", 10000.0 if self.sliding_window else 1e6)
        self.rope_factor = rp.get("factor", 1.0) if rp.get("rope_type", "default") == "linear" else 1.0
        if rp.get("rope_type", "default") not in ("default", "linear"):
            raise NotImplementedError(f"rope type {rp.get('rope_type')!r} is not covered by the teaching block")

    def norm(self, name, x):
        return rms_norm(x, self.norms[name], self.eps)

    def attention(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Grouped-query attention of the normed rows ``h`` (T, d) of one sequence over each other (causal, sliding
        window where the layer has one), at ``positions`` (default 0..T-1): the output before the post-attention
        norm."""
        T = h.shape[0]
        positions = torch.arange(T, device=h.device) if positions is None else positions.to(h.device)
        q = (h @ self.Wq.T).view(T, self.n_heads, self.head_dim).transpose(0, 1)   # (H, T, hd)
        k = (h @ self.Wk.T).view(T, self.n_kv, self.head_dim).transpose(0, 1)      # (KV, T, hd)
        v = (h @ self.Wv.T).view(T, self.n_kv, self.head_dim).transpose(0, 1)
        q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = rope(q, positions, self.theta, self.rope_factor), rope(k, positions, self.theta, self.rope_factor)
        rep = self.n_heads // self.n_kv                                            # grouped-query attention
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = (q @ k.transpose(-1, -2)) * self.scaling
        i, j = positions[:, None], positions[None, :]
        allowed = j <= i
        if self.sliding_window is not None:
            allowed = allowed & (i - j < self.sliding_window)
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores.float(), -1).to(q.dtype)
        out = (probs @ v).transpose(0, 1).reshape(T, self.n_heads * self.head_dim)
        return out @ self.Wo.T

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> BlockTrace:
        """x: (T, d) residual stream rows of one sequence; positions: (T,) absolute positions (default 0..T-1)."""
        v, z, h_gated, out = gemma_block(self, x, positions)
        return BlockTrace(v=v, z=z, h_gated=h_gated, h_down=h_gated @ self.W_down.T, out=out)

    __call__ = forward


@torch.no_grad()
def layer_io(model, input_ids, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and output rows (T, d) of transformers' decoder layer ``layer`` in a normal forward of ``input_ids``."""
    from .families import Adapter

    ad = Adapter(model)
    got = {}
    h1 = ad.parts[layer].layer.register_forward_pre_hook(lambda m, a: got.__setitem__("x", a[0][0].clone()))
    h2 = ad.parts[layer].layer.register_forward_hook(
        lambda m, a, o: got.__setitem__("out", (o[0] if isinstance(o, tuple) else o)[0].clone()))
    try:
        ids = torch.as_tensor(input_ids, device=next(model.parameters()).device).reshape(1, -1)
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        h1.remove()
        h2.remove()
    return got["x"], got["out"]

"""Per-step comparison of baseline (full context) and patched (no context) next-token distributions.

All metrics are computed in float64 from the two logit vectors over the full vocabulary:
* ``match``: argmax equal.
* ``linf``: max_i |logit_p,i - logit_q,i|.
* ``tvd``: 0.5 * sum_i |p_i - q_i| of the softmax distributions.
* ``rank_corr``: Spearman's rank correlation of the two logit vectors over the full vocabulary, i.e. the Pearson
  correlation of their average ranks (ties share the mean rank). Logits and probabilities give the same ranks.
  1 = identical ordering. (The paper's "rank distance" is a Pearson correlation of unstated inputs; this is ours.)
* ``top1_diff``: p[argmax p] - q[argmax p], the probability the patched model loses on the baseline's top token.
"""
from __future__ import annotations

import math
import statistics

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64: how far ``a`` is from the reference ``b`` (the Theorem 1 check)."""
    a, b = a.to(torch.float64), b.to(torch.float64).reshape(a.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of a 1-D tensor, tied values sharing their mean rank (float64)."""
    sorted_vals, order = torch.sort(x)
    _, counts = torch.unique_consecutive(sorted_vals, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    starts = ends - counts.to(torch.float64)
    mean_rank = (starts + ends - 1.0) / 2.0
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.repeat_interleave(mean_rank, counts)
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra @ rb) / den) if den > 0 else float("nan")


def compare_logits(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """Metrics between baseline logits ``p_logits`` and patched logits ``q_logits`` (1-D, any dtype)."""
    p64, q64 = p_logits.detach().to(torch.float64).flatten().cpu(), q_logits.detach().to(torch.float64).flatten().cpu()
    if p64.shape != q64.shape:
        raise ValueError(f"logit vectors differ in size: {p64.numel()} vs {q64.numel()}")
    p, q = torch.softmax(p64, -1), torch.softmax(q64, -1)
    bt, pt = int(p64.argmax()), int(q64.argmax())
    return {
        "baseline_token": bt,
        "patched_token": pt,
        "match": bt == pt,
        "linf": float((p64 - q64).abs().max()),
        "tvd": float(0.5 * (p - q).abs().sum()),
        "rank_corr": spearman(p64, q64),
        "top1_diff": float(p[bt] - q[bt]),
    }


def aggregate(steps: list[dict]) -> dict:
    """Token match with its count, and median/max of the distances, over a list of per-step records."""
    n = len(steps)
    if n == 0:
        return {"n_tokens": 0, "n_match": 0, "token_match": float("nan")}
    out = {"n_tokens": n, "n_match": sum(bool(s["match"]) for s in steps)}
    out["token_match"] = out["n_match"] / n
    for key in ("linf", "tvd", "rank_corr", "top1_diff"):
        vals = [s[key] for s in steps if key in s and not math.isnan(s[key])]
        if vals:
            out[f"{key}_median"] = statistics.median(vals)
            out[f"{key}_max"] = max(vals)
            out[f"{key}_min"] = min(vals)
    return out


def format_fraction(n_match: int, n: int) -> str:
    return f"{100.0 * n_match / n:.1f}% ({n_match}/{n})" if n else "n/a (0 tokens)"

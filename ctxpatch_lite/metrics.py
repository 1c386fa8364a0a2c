"""Per-step comparison of baseline (full context) and patched (no context) next-token distributions.

All metrics are computed in float64 from the two logit vectors over the full vocabulary:
* ``match``: argmax equal.
* ``linf``: max_i |logit_p,i - logit_q,i|.
* ``tvd``: 0.5 * sum_i |p_i - q_i| of the softmax distributions.
* ``rank_corr``: Spearman's rank correlation of the two logit vectors over the full vocabulary, i.e. the Pearson
  correlation of their average ranks (ties share the mean rank). Logits and probabilities give the same ranks.
  1 = identical ordering. (The paper's "rank distance" is a Pearson correlation of unstated inputs; this is ours.)
* ``top1_diff``: p[argmax p] - q[argmax p], the probability the patched model loses on the baseline's top token.
* ``margin``: the baseline's top-1 minus top-2 logit; a mismatch at a small margin is a near tie, which rounding
  (bfloat16, a different kernel) can flip.
* ``logit_scale``: the baseline's largest |logit|, which sets the size of one ulp of the logits (the noise a
  different CPU's rounding adds, ``arithmetic``).
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
    """Ranks 0..n-1 along the last axis, tied values sharing their mean rank (float64); fixed-size tensor
    operations only, so it runs on the logits' device without asking the host anything.

    A 16-bit float (bfloat16, float16: the logits of a low-precision model) has at most 65,536 values, so over a
    vocabulary at least that large its ranks come from counting instead of sorting (``_counted_ranks``: the same
    float64 ranks, ~10x faster over a 262k vocabulary); anything else is sorted."""
    if x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] >= 1 << 16:   # counting needs 65,536 bins a row
        return _counted_ranks(x)
    n = x.shape[-1]
    sorted_vals, order = torch.sort(x, dim=-1)
    idx = torch.arange(n, device=x.device).expand_as(sorted_vals)
    new_run = torch.ones_like(sorted_vals, dtype=torch.bool)
    new_run[..., 1:] = sorted_vals[..., 1:] != sorted_vals[..., :-1]
    start = torch.where(new_run, idx, torch.zeros_like(idx)).cummax(-1).values           # first index of the run
    ends = torch.ones_like(new_run)
    ends[..., :-1] = new_run[..., 1:]
    end = torch.where(ends, idx, torch.full_like(idx, n)).flip(-1).cummin(-1).values.flip(-1)  # last index
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks.scatter_(-1, order, (start + end).to(torch.float64) / 2.0)
    return ranks


def _order_keys16(x: torch.Tensor) -> torch.Tensor:
    """0..65535 keys of a 16-bit float tensor, in the order of its values: equal values (+0 and -0 too) share a
    key. A NaN (magnitude bits above infinity's) gets the top key, above +inf: NaNs tie with each other, where the
    sort gives them distinct ranks at the top (no finite logit is affected)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    mag = bits & 0x7FFF
    inf = 0x7F80 if x.dtype == torch.bfloat16 else 0x7C00
    key = torch.where(bits < 0, -mag, mag) + 0x7FFF                      # -max..+max -> 0..65534; both zeros tie
    return torch.where(mag > inf, torch.full_like(key, 0xFFFF), key).to(torch.int64)


def _counted_ranks(x: torch.Tensor) -> torch.Tensor:
    """``average_ranks`` of a 16-bit float tensor by counting: a value with ``less`` smaller entries and ``count``
    equal ones has the 0-based ranks less .. less + count - 1, whose mean is (2 less + count - 1) / 2 -- the same
    float64 number the sort path computes as (start + end) / 2."""
    key = _order_keys16(x.reshape(-1, x.shape[-1]))
    counts = torch.zeros(key.shape[0], 1 << 16, dtype=torch.int64, device=x.device)
    counts.scatter_add_(1, key, torch.ones_like(key))
    less = counts.cumsum(1) - counts
    ranks = (2 * less.gather(1, key) + counts.gather(1, key) - 1).to(torch.float64) / 2.0
    return ranks.reshape(x.shape)


def _spearman_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = ra.norm(dim=-1) * rb.norm(dim=-1)
    return torch.where(den > 0, (ra * rb).sum(-1) / den.clamp_min(1e-300), torch.full_like(den, float("nan")))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two vectors (ranks in their own dtype: the same as in float64)."""
    return float(_spearman_rows(a, b))


METRIC_KEYS = ("baseline_token", "patched_token", "linf", "tvd", "rank_corr", "top1_diff", "margin", "logit_scale")


CHUNK_ELEMENTS = 1 << 18   # rows per metric chunk x vocabulary: bounds the float64/int64 temporaries (~25 MB)


def _metric_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """(n, len(METRIC_KEYS)) float64 metrics of n rows, on the logits' device."""
    p64, q64 = p_logits.to(torch.float64), q_logits.to(torch.float64)
    p, q = torch.softmax(p64, -1), torch.softmax(q64, -1)
    bt, pt = p64.argmax(-1), q64.argmax(-1)
    top = bt.unsqueeze(-1)
    two = p64.topk(min(2, p64.shape[-1]), dim=-1).values
    return torch.stack([bt.to(torch.float64), pt.to(torch.float64), (p64 - q64).abs().amax(-1),
                        0.5 * (p - q).abs().sum(-1), _spearman_rows(p_logits, q_logits),
                        (p.gather(-1, top) - q.gather(-1, top)).squeeze(-1), two[:, 0] - two[:, -1],
                        p64.abs().amax(-1)], -1)


def compare_rows(p_logits: torch.Tensor, q_logits: torch.Tensor) -> list[dict]:
    """Metrics between baseline logits and patched logits, row by row ((N, V) each): computed in float64 on the
    logits' device in chunks of rows (the rank correlation's sort temporaries over a 262k vocabulary would
    otherwise take ~50 MB per row at once), fetched to the host in one transfer."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"logit tensors differ in shape: {tuple(p_logits.shape)} vs {tuple(q_logits.shape)}")
    p2, q2 = p_logits.detach().reshape(-1, p_logits.shape[-1]), q_logits.detach().reshape(-1, q_logits.shape[-1])
    rows = max(1, CHUNK_ELEMENTS // p2.shape[-1])
    m = torch.cat([_metric_rows(p2[i:i + rows], q2[i:i + rows]) for i in range(0, p2.shape[0], rows)])
    return _to_records(m)


def _to_records(m: torch.Tensor) -> list[dict]:
    """Metric rows -> dicts, in one host transfer."""
    out = []
    for row in m.tolist():
        d = dict(zip(METRIC_KEYS, row))
        d["baseline_token"], d["patched_token"] = int(d["baseline_token"]), int(d["patched_token"])
        d["match"] = d["baseline_token"] == d["patched_token"]
        out.append({k: d[k] for k in ("baseline_token", "patched_token", "match", "linf", "tvd", "rank_corr",
                                      "top1_diff", "margin", "logit_scale")})
    return out


def compare_logits(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """Metrics between baseline logits ``p_logits`` and patched logits ``q_logits`` (1-D, any dtype)."""
    p, q = p_logits.reshape(-1), q_logits.reshape(-1)
    if p.shape != q.shape:
        raise ValueError(f"logit vectors differ in size: {p.numel()} vs {q.numel()}")
    return compare_rows(p, q)[0]


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

"""Course helpers: engine runs gathered into the rows of one lesson's tables (no arithmetic of their own).

``variant_runs`` is lesson 04's comparison of the four output-patch configurations (naive | stable, dividing by
the ``h`` the patched pass computes | the one recorded with the context) on the paper's prompts, under lesson
03's protocol. Its rows feed ``plots.summary`` and ``plots.update_norms``.
"""
from __future__ import annotations

import math
from collections import Counter

from tqdm.auto import tqdm

from .algorithm import PatchConfig
from .arithmetic import ulp
from .protocol import run_protocol

CONFIGURATIONS = tuple((v, h) for v in ("naive", "stable") for h in ("actual", "recorded"))


def margin_in_ulps(step: dict, dtype: str = "bfloat16") -> float:
    """The baseline's top-2 logit margin at one protocol step, in ``dtype`` steps at the size of its largest logit."""
    return step["margin"] / ulp(step["logit_scale"], dtype)


def variant_runs(model, tokenizer, prompts: list[dict], tokens: int, zero_scales: dict[int, int] | None = None,
                 progress: bool = False, configurations=CONFIGURATIONS) -> list[dict]:
    """One row per configuration (``(variant, h_source)`` pairs of ``CONFIGURATIONS``, all of them unless
    ``configurations`` names fewer, in that order): the protocol on every prompt, all judged on the same greedy
    baseline tokens and baseline logits (the default configuration's run supplies them and its full-context pass,
    which the other configurations share; it gives its row only if it is asked for).

    A row holds the token count (``n_match`` of ``n_tokens``), the lost tokens (``lost``: prompt id, step, and the
    baseline's top-2 margin in steps of the model's dtype), ``lost_wide`` (those whose margin was above 2 steps, so
    not a tie that rounding decides), the per-step TVDs, the fallbacks (all,
    and those on coordinates whose scale ``m_k`` is 0), the Appendix B hard cases, the largest norm one token's
    fallbacks left out (``miss``), the hard cases per layer (``hard_layers``: layer -> count), the zero-scale coordinates inside hard cases (``m0_hard``, from
    ``zero_scales``: layer -> count of ``m_k == 0``), and the median over steps of the patches' norms
    (``dm_norm``, ``matrix_norm``, and their root-sum-square ``total_norm``), each norm taken over all layers; and
    ``steps``, one record per prompt and step in that order (its token match, L_inf, the baseline's margin in steps
    as in ``lost``, each layer's ``block_error``, the norm its fallbacks left out, ``miss`` (and per layer,
    ``miss_by_layer``), each layer's ``||dm||`` and largest ``|dm_k|`` (``dm_by_layer``, ``dm_max_by_layer``), and
    ``dv_norm``, the norm of v_C - v over all layers: what the context did to that token, the scale of its
    ``miss``), so that a lesson can take one step apart without running it again.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1 (got {tokens})")
    if not prompts:
        raise ValueError("variant_runs needs at least one prompt")
    configurations = [tuple(c) for c in configurations]
    unknown = [c for c in configurations if c not in CONFIGURATIONS]
    if unknown or not configurations:
        raise ValueError(f"configurations must be (variant, h_source) pairs among {list(CONFIGURATIONS)}; "
                         f"got {unknown or 'none'}")
    zero_scales = zero_scales or {}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    dtype = dtype if dtype in ("float32", "float64", "bfloat16") else "bfloat16"
    run = lambda p, cfg, **kw: run_protocol(model, tokenizer, p["text"], tokens, cfg, progress=False,  # noqa: E731
                                            batched=True, **kw)
    extra = [c for c in configurations if c != ("naive", "actual")]
    bar = tqdm(total=(1 + len(extra)) * len(prompts), desc="configurations x prompts", disable=not progress)
    greedy, full = [], [{} for _ in prompts]     # per prompt: the default run, and its full-context pass to share
    for p, fc in zip(prompts, full):
        greedy.append(run(p, PatchConfig(), full_context=fc))
        bar.update()
    rows = []
    for var, hs in configurations:
        if (var, hs) == ("naive", "actual"):
            rs = greedy
        else:
            rs = []
            for p, g, fc in zip(prompts, greedy, full):
                rs.append(run(p, PatchConfig(variant=var, h_source=hs), greedy=g["generated_ids"], full_context=fc))
                bar.update()
        steps = [s for r in rs for s in r["steps"]]
        d = [s["diagnostics"] for s in steps]
        hard_layers = Counter(l for x in d for l, hc in zip(x["per_layer"]["layer"], x["per_layer"]["hard_case"]) if hc)
        lost = [{"prompt": p["id"], "step": st["step"], "ulps": margin_in_ulps(st, dtype)}
                for p, r in zip(prompts, rs) for st in r["steps"] if not st["match"]]
        med = lambda xs: sorted(xs)[(len(xs) - 1) // 2]  # noqa: E731  (the lower median, as torch.median)
        rows.append({
            "label": f"{dtype}-{var}/{hs}", "n_match": sum(s["match"] for s in steps), "n_tokens": len(steps),
            "lost_wide": sum(x["ulps"] > 2 for x in lost), "lost": lost, "tvd": [s["tvd"] for s in steps],
            "fallbacks": sum(x["fallbacks"] for x in d), "fallbacks_m0": sum(x["fallbacks_m0"] for x in d),
            "hard_cases": sum(x["hard_cases"] for x in d), "miss": max(x["fallback_miss"] for x in d),
            "m0_hard": sum(zero_scales.get(l, 0) * c for l, c in hard_layers.items()),
            "hard_layers": dict(sorted(hard_layers.items())),
            "dm_norm": med([x["dm_norm"] for x in d]), "matrix_norm": med([x["matrix_norm"] for x in d]),
            "total_norm": med([math.hypot(x["matrix_norm"], x["dm_norm"]) for x in d]),
            "steps": [{"prompt": p["id"], "step": st["step"], "match": st["match"], "linf": st["linf"],
                       "ulps": margin_in_ulps(st, dtype),
                       "block_error": list(st["diagnostics"]["per_layer"]["block_error"]),
                       "miss": st["diagnostics"]["fallback_miss"],
                       "miss_by_layer": list(st["diagnostics"]["per_layer"]["fallback_miss"]),
                       "dm_by_layer": list(st["diagnostics"]["per_layer"]["dm_l2"]),
                       "dm_max_by_layer": list(st["diagnostics"]["per_layer"]["dm_max_abs"]),
                       "dv_norm": math.sqrt(sum(x * x for x in st["diagnostics"]["per_layer"]["dv_norm"]
                                                if not math.isnan(x)))}
                      for p, r in zip(prompts, rs) for st in r["steps"]]})
    bar.close()
    return rows


def layer_misses(res, m, divide_by: str) -> tuple:
    """Lesson 04b, Part 1: for one layer patched alone with the naive patch (``res``, a ``single_block_patch``
    result), the miss per coordinate that lesson 04's ``naive_miss`` predicts from m, res.dm and dh = res.h -
    res.h_recorded, and the miss the layer made, res.out_patched - res.out_target: ``(predicted, measured)``, both
    float32, each tensor converted before it is subtracted (a difference taken in bfloat16 is rounded again)."""
    from .solutions import naive_miss                 # it rejects a divide_by other than "recorded" or "actual"
    predicted = naive_miss(m.float(), res.dm.float(), res.h.float() - res.h_recorded.float(), divide_by)
    return predicted, res.out_patched.float() - res.out_target.float()


def error_formula_row(layer: int, act, rec, m, misses_actual: tuple, misses_recorded: tuple, bf16_step) -> dict:
    """Lesson 04b, Part 1: one layer's record for the error-formula tables, from the naive patch of that layer alone
    with each divisor (``act``, ``rec``: ``single_block_patch`` results), its scale ``m`` (float32), the
    ``(predicted, measured)`` misses per coordinate that ``layer_misses`` returned for each, and the
    learner's ``bf16_step``. The coordinate ``k`` is where the predicted ``recorded`` miss is largest; the record
    holds the ingredients there, both misses for both divisors, and the ruler of the first table (one bfloat16 step of
    the layer's largest target output, over that output)."""
    import torch

    pred_a, meas_a = misses_actual
    predicted, measured = misses_recorded
    k = int(predicted.abs().argmax())
    dh = rec.h.float() - rec.h_recorded.float()                          # h_hat - h_C, taken in float32
    t_max = rec.out_target.float().abs().max()
    return {"layer": layer, "unpatched": rec.unpatched_rel_error, "actual": act.rel_error, "recorded": rec.rel_error,
            "k": k, "dm_argmax": int(rec.dm.abs().argmax()), "dm_k": float(rec.dm[k]), "dh_k": float(dh[k]),
            "predicted_k": float(predicted[k]), "measured_k": float(measured[k]), "dh_max": float(dh.abs().max()),
            "hC_k": float(rec.h_recorded[k]), "m_k": float(m[k]),
            "predicted_actual_k": float(pred_a[k]), "measured_actual_k": float(meas_a[k]),
            "step": float(bf16_step(t_max[None])[0] / t_max),
            "max_target": float(t_max),
            "same_h": bool(torch.equal(rec.h, act.h))}


def sign_test(d, alpha: float = 0.01) -> dict:
    """Lesson 04, Part B: the paired sign test, one-sided each way at level ``alpha``. ``d``: the
    per-token differences (a sequence of floats). Ties (d == 0) are dropped; n counts the rest. k* is the smallest k
    with P(X >= k) <= alpha for X ~ Bin(n, 1/2) (n + 1 when no k qualifies). Returns n, the counts ``pos`` (d > 0) and
    ``neg`` (d < 0), ``k_star``, and ``verdict``: +1 if pos >= k*, -1 if neg >= k*, else 0."""
    from math import comb

    pos = sum(1 for x in d if x > 0)
    neg = sum(1 for x in d if x < 0)
    n = pos + neg
    tail = lambda k: sum(comb(n, j) for j in range(k, n + 1)) / 2 ** n
    k_star = next((k for k in range(n + 1) if tail(k) <= alpha), n + 1)
    return {"n": n, "pos": pos, "neg": neg, "k_star": k_star,
            "verdict": 1 if pos >= k_star else -1 if neg >= k_star else 0}

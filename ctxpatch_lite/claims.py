"""The claims ledger: one row per quantitative claim of the paper and its reviews, judged on our runs' JSON.

Nothing here is typed by hand except the claims, their rules and the settings they are read over. Each
``Claim`` names

* ``select``: the settings its runs share (a run's ``spec``, written by ``scripts/reference_runs.py``),
* ``over``: the settings the outcome may depend on; every combination present in the data is one **reading**,
* ``roles``: for claims that compare runs (naive vs stable, all layers vs last layer only), which run plays which
  part within a reading,
* ``measure``: the figure(s) a reading gives, and ``rules``: the threshold(s), in words as well as in code.

The verdict is **reproduced** when every reading passes, **contradicted** when none does, and **depends on the
setting** otherwise, naming the setting and which values pass: a reading is never chosen because it matches the
paper. A claim whose runs are absent, or that needs a model, data or a construction we do not have, is **not
runnable here**. ``ledger(reference_dir)`` returns the rows; ``to_markdown`` / ``to_html`` render them and
``plots.claims_figure`` draws every reading against its threshold.
"""
from __future__ import annotations

import html
import itertools
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .architectures import meets_target

REPRODUCED, CONTRADICTED, DEPENDS, NOT_RUNNABLE = ("reproduced", "contradicted", "depends on the setting",
                                                     "not runnable here")
VERDICTS = (REPRODUCED, DEPENDS, CONTRADICTED, NOT_RUNNABLE)


# -- rules ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """``value[key] op threshold``. ``op``: ``>=``, ``>``, ``<=``, ``<`` or ``between`` (``threshold`` = (lo, hi),
    inclusive). ``words`` is what the ledger prints."""

    key: str
    op: str
    threshold: float | tuple
    words: str
    log: bool = False       # plot on a log axis

    def passes(self, values: dict) -> bool:
        x = values[self.key]
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return False
        t = self.threshold
        return {">=": lambda: x >= t, ">": lambda: x > t, "<=": lambda: x <= t, "<": lambda: x < t,
                "between": lambda: t[0] <= x <= t[1]}[self.op]()


def at_least(key, t, words, log=False):
    return Rule(key, ">=", t, words, log)


def above(key, t, words, log=False):
    return Rule(key, ">", t, words, log)


def at_most(key, t, words, log=False):
    return Rule(key, "<=", t, words, log)


def below(key, t, words, log=False):
    return Rule(key, "<", t, words, log)


def between(key, lo, hi, words, log=False):
    return Rule(key, "between", (lo, hi), words, log)


# -- figures from run records ----------------------------------------------------------------------------------

def steps_of(rec) -> list:
    return [s for r in rec.get("runs", [rec]) for s in r["steps"]]


def n_match(rec) -> tuple[int, int]:
    s = rec["summary"]
    return s["n_match"], s["n_tokens"]


def pct(rec) -> float:
    n, t = n_match(rec)
    return 100.0 * n / t


def frac(rec) -> str:
    n, t = n_match(rec)
    return f"{n}/{t}"


def med_diag(rec, key) -> float:
    vals = [s["diagnostics"].get(key, math.nan) for s in steps_of(rec)]
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def total_norm(rec) -> float:
    """Median over tokens of the total update norm sqrt(||dW||_F^2 + ||dm||^2) (all patched layers)."""
    return statistics.median((s["diagnostics"].get("matrix_norm", 0.0) ** 2 + s["diagnostics"].get("dm_norm", 0.0) ** 2)
                             ** 0.5 for s in steps_of(rec))


def patched_layers(rec) -> int:
    c = rec["config"]
    return c["n_layers"] - int(c.get("start_layer") or 0)


@dataclass
class Figure:
    values: dict          # rule key -> number
    text: str             # what the ledger prints for this reading


# -- claims --------------------------------------------------------------------------------------------------------

@dataclass
class Claim:
    id: str
    source: str
    statement: str
    rules: tuple = ()
    select: dict = field(default_factory=dict)
    over: tuple = ()
    roles: dict | None = None        # role -> spec overrides; None: the measure gets every run of the reading
    measure: Callable | None = None  # (runs by role, or a list) -> Figure
    why_not: str = ""                # not runnable here: why
    note: str = ""                   # how to read the figure (printed under the rule)
    special: Callable | None = None  # (reference_dir) -> list of (label, Figure, meta) for claims not on run JSON


BASE = {"forcing": "baseline", "start": "first", "schedule": "selfcorrect", "parts": "full"}
STEP = {**BASE, "path": "step"}


def _match_pct(rec) -> Figure:
    return Figure({"token_match": pct(rec)}, f"{pct(rec):.0f}% ({frac(rec)})")


def _median_linf(rec) -> Figure:
    s = rec["summary"]
    return Figure({"linf_median": s["linf_median"]}, f"median L∞ {s['linf_median']:.1e} (max {s['linf_max']:.1e})")


def _stable_minus_naive(r) -> Figure:
    return Figure({"gain": pct(r["stable"]) - pct(r["naive"])},
                  f"naive {frac(r['naive'])} → stable {frac(r['stable'])}")


def _both(r) -> Figure:
    return Figure({"lowest": min(pct(r["naive"]), pct(r["stable"]))},
                  f"naive {frac(r['naive'])}, stable {frac(r['stable'])}")


def _norm_ratio(num, den):
    def measure(r) -> Figure:
        a, b = total_norm(r[num]), total_norm(r[den])
        return Figure({"ratio": a / b}, f"{num} {a:.3g} / {den} {b:.3g} = {a / b:.3g}×")
    return measure


def _spread(r) -> Figure:
    a, b = total_norm(r["float32"]), total_norm(r["bfloat16"])
    return Figure({"ratio": max(a, b) / min(a, b)},
                  f"stable float32 {a:.3g}, bfloat16 {b:.3g}: {max(a, b) / min(a, b):.3g}× apart")


def _last_layer(r) -> Figure:
    first, last = r["first"], r["last"]
    loss = pct(first) - pct(last)
    return Figure({"loss": loss}, f"all layers {frac(first)} (median L∞ {first['summary']['linf_median']:.2g}); "
                                  f"last only {frac(last)} (median L∞ {last['summary']['linf_median']:.2g})")


def _by_depth(recs) -> list:
    return sorted(recs, key=patched_layers, reverse=True)


def _few_layers(recs) -> Figure:
    recs = _by_depth(recs)
    n = recs[0]["config"]["n_layers"]
    full = pct(recs[0])
    ok = [patched_layers(r) for r in recs if pct(r) >= full - 1.0]
    fewest = min(ok) if ok else n + 1
    text = ", ".join(f"{patched_layers(r)}: {pct(r):.0f}%" for r in recs)
    return Figure({"fewest_share": fewest / n}, f"fewest layers within 1 point of all {n} layers' {full:.0f}%: "
                                                 f"{fewest if ok else 'none'} (layers patched: match — {text})")


def _norms_vs_depth(recs) -> Figure:
    recs = _by_depth(recs)
    first, last = recs[0], recs[-1]
    dm = med_diag(last, "dm_norm") / med_diag(first, "dm_norm")
    mat = med_diag(last, "matrix_norm") / med_diag(first, "matrix_norm")
    return Figure({"dm_growth": dm, "matrix_ratio": mat},
                  f"{patched_layers(first)} → {patched_layers(last)} layers: median ‖Δm‖ ×{dm:.3g}, "
                  f"matrix-patch norm ×{mat:.3g}")


def _smallest_total(recs) -> Figure:
    recs = _by_depth(recs)
    totals = [total_norm(r) for r in recs]
    rank = sorted(totals).index(totals[0])
    return Figure({"rank_of_all_layers": rank},
                  "median total norm by layers patched: " + ", ".join(f"{patched_layers(r)}: {t:.3g}"
                                                                       for r, t in zip(recs, totals)))


def _sparsity(rec) -> Figure:
    share = med_diag(rec, "dm_top_share")
    return Figure({"top_share": share}, f"median share of ‖Δm‖² in the top 1% of coordinates: {100 * share:.0f}%")


def _magnitude(rec) -> Figure:
    m, d = med_diag(rec, "matrix_rel"), med_diag(rec, "dm_rel")
    return Figure({"matrix_rel": m, "dm_rel": d}, f"median ‖ΔW‖_F/‖W‖_F {m:.2g}; ‖Δm‖/‖m‖ {d:.2g}")


def _distances(rec) -> Figure:
    s = rec["summary"]
    return Figure({"rank_corr": s["rank_corr_median"], "top1": abs(s["top1_diff_median"])},
                  f"median rank correlation {s['rank_corr_median']:.4f} (min {s['rank_corr_min']:.3f}); "
                  f"median top-1 difference {s['top1_diff_median']:.1e}")


def _fixed(rec) -> Figure:
    reused = rec["summary"].get("reused")
    if not reused:
        return Figure({"reused_match": math.nan}, "no reused steps recorded")
    first = [r["steps"][0] for r in rec.get("runs", [rec])]
    return Figure({"reused_match": 100.0 * reused["token_match"]},
                  f"reused steps {reused['n_match']}/{reused['n_tokens']} (median TVD {reused['tvd_median']:.2f}); "
                  f"freshly patched step 0: {sum(s['match'] for s in first)}/{len(first)}")


def _block_error(rec) -> Figure:
    errs = [e for s in steps_of(rec) for e in s["diagnostics"].get("per_layer", {}).get("block_error", [])]
    worst = max(errs) if errs else math.nan
    return Figure({"block_error": worst}, f"{worst:.1e} over {len(errs)} layer outputs; {frac(rec)} tokens")


def _control(rec) -> Figure:
    s = rec["summary"]
    return Figure({"linf_median": s["linf_median"]}, f"{frac(rec)} tokens; median L∞ {s['linf_median']:.3g}")


def _selfcorrect(r) -> Figure:
    a, b = r["selfcorrect"], r["ideal"]
    return Figure({"gain": pct(a) - pct(b)}, f"actual outputs {frac(a)} (median L∞ {a['summary']['linf_median']:.2g}); "
                                             f"ideal {frac(b)} (median L∞ {b['summary']['linf_median']:.2g})")


def _hard_cases(rec) -> Figure:
    s = rec["summary"]
    return Figure({"count": s["hard_cases_total"]}, f"{s['hard_cases_total']} hard cases in {s['n_tokens']} tokens "
                                                    f"× {rec['config']['n_layers']} layers")


def _fallbacks(rec) -> Figure:
    s = rec["summary"]
    return Figure({"count": s["fallbacks_total"]}, f"{s['fallbacks_total']} divide-by-1 coordinates in "
                                                   f"{s['n_tokens']} tokens")


def _free(rec) -> Figure:
    runs = rec.get("runs", [rec])
    pre = [r["free"]["identical_prefix"] for r in runs]
    n = [r["free"]["n_tokens"] for r in runs]
    after = [r["free"]["after_divergence"] for r in runs if r["free"]["after_divergence"]]
    am, at = sum(a["n_match"] for a in after), sum(a["n_tokens"] for a in after)
    div = ", ".join("—" if p == k else str(p) for p, k in zip(pre, n))
    text = f"first divergence per prompt (step; — none in {n[0]}): {div}"
    if at:
        text += f"; after it, on its own text: {am}/{at}"
    return Figure({"identical_share": min(p / k for p, k in zip(pre, n))}, text)


def _same_tokens(a_role, b_role):
    def measure(r) -> Figure:
        a, b = steps_of(r[a_role]), steps_of(r[b_role])
        same = sum(x["patched_token"] == y["patched_token"] and x["baseline_token"] == y["baseline_token"]
                   for x, y in zip(a, b))
        dl = max(abs(x["linf"] - y["linf"]) for x, y in zip(a, b))
        return Figure({"agree": 100.0 * same / len(a)},
                      f"{same}/{len(a)} steps with the same tokens ({a_role} {frac(r[a_role])}, {b_role} "
                      f"{frac(r[b_role])}); max |ΔL∞| {dl:.2g}")
    return measure


def _appendix_d(ref_dir):
    d = _read(ref_dir, "appendix.json")["appendix_d"]
    gap = d["best_residual"] - d["lower_bound_on_residual"]
    return [("seeded block, d = %d" % d["d"], Figure(
        {"gap": gap, "trainable": d["trainable_scale_residual"]},
        f"‖Δv‖ {d['dv_norm']:.1f} vs bound 2√d‖m‖∞ {d['bound']:.1f}: best residual {d['best_residual']:.2f} ≥ "
        f"{d['lower_bound_on_residual']:.2f} after {d['steps']} Adam steps; trainable scale: "
        f"{d['trainable_scale_residual']:.1e}"), {"dtype": "float64", "tokens": 0})]


def _appendix_e(ref_dir):
    a = _read(ref_dir, "appendix.json")
    e1, e2 = a["appendix_e_outer"], a["appendix_e_stable"]
    worst = max(e1["gate_telescoping_error"], e1["down_telescoping_error"], e2["down_telescoping_error"],
                e2["dm_fixed_error"])
    return [("seeded Llama (case 1) and Gemma 3 (case 2) blocks", Figure(
        {"error": worst}, f"case 1: W_gate {e1['gate_telescoping_error']:.1e}, W_down "
                          f"{e1['down_telescoping_error']:.1e}; case 2: W_down {e2['down_telescoping_error']:.1e}, "
                          f"Δm fixed preconditioner {e2['dm_fixed_error']:.1e} (a moving one, for contrast: "
                          f"{e2['dm_moving_error']:.1e})"), {"dtype": "float64", "tokens": 0})]


def _architectures(ref_dir):
    folder = Path(ref_dir).parent / "architectures"
    files = {dt: folder / f"{dt}.json" for dt in ("float64", "float32")}
    if not all(f.is_file() for f in files.values()):
        return []
    rows = {dt: json.loads(f.read_text())["rows"] for dt, f in files.items()}
    n = len(rows["float64"])
    exact, f32 = (sum(meets_target(r) for r in rows[dt]) for dt in ("float64", "float32"))
    worst = max(r["max_block_rel_error"] for r in rows["float64"])
    tokens = sum(int(r["token_match"].split("/")[1]) for dt in rows for r in rows[dt])
    return [("15 families, random weights", Figure(
        {"families": 100.0 * min(exact, f32) / n},
        f"{exact}/{n} families exact in float64 (max block error {worst:.1e}), {f32}/{n} with every token matching "
        f"in float32; 3-layer seeded models of transformers' classes"), {"dtype": "float64, float32", "tokens": tokens,
                                                                         "hardware": "CPU"})]


def gaussian_top_share(d: int = 640, share: float = 0.01, trials: int = 200, seed: int = 0) -> float:
    """The control for P11: the mean share of ||x||^2 in the top 1 % of coordinates of a dense Gaussian x."""
    import torch
    x = torch.randn(trials, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).pow(2)
    k = max(1, math.ceil(share * d))
    return float((x.topk(k, dim=-1).values.sum(-1) / x.sum(-1)).mean())


def _read(ref_dir, name):
    return json.loads((Path(ref_dir) / name).read_text())


F32, BF16 = {"dtype": "float32"}, {"dtype": "bfloat16"}
TOKENS_ALL = at_least("token_match", 100.0, "token match = 100 % (every compared token)")
CLAIMS = [
    Claim("P1", "paper §4.2, Figs. 3–4", "float32: the patched model without context picks the baseline's token at "
          "every step", (TOKENS_ALL,), {**BASE, **F32}, ("path", "variant", "apply", "h_source"), None, _match_pct),
    Claim("P2", "paper §4.2 (review S000's rerun: median L∞ ≈ 4e-5)", "float32: logit differences at rounding level",
          (at_most("linf_median", 1e-4, "median L∞ ≤ 1e-4: about 50 float32 steps of a logit between 16 and 32 "
                   "(one step: 1.9e-6), accumulated over the layers", log=True),),
          {**BASE, **F32}, ("path", "variant", "apply", "h_source"), None, _median_linf),
    Claim("P3", "paper v3 §4.2 (87.5 %)", "bfloat16, naive update: tokens are lost (87.5 % token match)",
          (at_most("token_match", 93.75, "token match ≤ 93.75 %: at least half of the paper's 12.5-point loss; an exact "
                   "87.5 % is not asked for (87.5 % = 7/8 and the paper's token count is not given)"),),
          {**BASE, **BF16, "variant": "naive"}, ("path", "apply", "h_source"), None, _match_pct),
    Claim("P4", "paper v3 (100 %), v2 HTML (98 %)", "bfloat16, stable update: 98–100 % token match",
          (at_least("token_match", 98.0, "token match ≥ 98 %"),), {**BASE, **BF16, "variant": "stable"},
          ("path", "apply", "h_source"), None, _match_pct),
    Claim("P5", "paper §4.2 narrative", "bfloat16: the stable update recovers tokens the naive update loses",
          (above("gain", 0.0, "stable matches more tokens than naive in the same setting (difference > 0 points)"),),
          {**BASE, **BF16}, ("path", "apply", "h_source"), {"naive": {"variant": "naive"},
                                                           "stable": {"variant": "stable"}}, _stable_minus_naive),
    Claim("R1", "review S000 (Gemma-3-1B-IT, 5 × 20 tokens)", "bfloat16: naive 100 % and stable 99 % token match",
          (at_least("lowest", 98.0, "naive and stable both ≥ 98 %"),), {**BASE, **BF16}, ("path", "apply", "h_source"),
          {"naive": {"variant": "naive"}, "stable": {"variant": "stable"}}, _both),
    Claim("P6", "paper App. C.2 / Fig. 8b; review S000 (≈ 49×)", "bfloat16: the stable update's total norm is much "
          "smaller than the naive one's", (at_least("ratio", 10.0, "naive / stable median total norm ≥ 10", log=True),),
          {**STEP, **BF16}, ("apply", "h_source"), {"naive": {"variant": "naive"}, "stable": {"variant": "stable"}},
          _norm_ratio("naive", "stable")),
    Claim("R2", "review S000 (≈ 4.6×)", "float32: the stable update's total norm is larger than the naive one's",
          (above("ratio", 1.0, "stable / naive median total norm > 1", log=True),), {**STEP, **F32},
          ("apply", "h_source"), {"stable": {"variant": "stable"}, "naive": {"variant": "naive"}},
          _norm_ratio("stable", "naive")),
    Claim("R4", "review S000 (≈ 240×)", "the two stable conditions (float32, bfloat16) differ in total update norm "
          "by ≈ 240×", (between("ratio", 24.0, 2400.0, "ratio within 10× of 240 (24–2400)", log=True),),
          {**STEP, "variant": "stable"}, ("apply", "h_source"), {"float32": F32, "bfloat16": BF16}, _spread,
          note="'the two stable conditions' read as stable float32 vs stable bfloat16 (the review's context); the "
               "review does not say which norms or medians it compared"),
    Claim("P7", "paper App. C.4", "patching only the last layer is numerically problematic",
          (above("loss", 0.0, "the last-layer-only run loses tokens the all-layer run keeps (> 0 points)"),),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": "full", "apply": "materialized"},
          ("dtype", "variant", "h_source"), {"first": {"start": "first"}, "last": {"start": "last"}}, _last_layer),
    Claim("P8", "paper App. C.4; review S000 (down to two layers)", "a few patched layers already keep the tokens",
          (at_most("fewest_share", 1 / 3, "the fewest patched layers (from the top) that keep the all-layer run's "
                   "token match (within 1 point) are a third of the model or fewer"),),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": "full", "apply": "materialized"},
          ("dtype", "variant", "h_source"), None, _few_layers),
    Claim("P9", "paper App. C.4", "fewer patched layers: the matrix-patch norm goes down, the stable Δm norm up by "
          "orders of magnitude",
          (at_least("dm_growth", 100.0, "stable ‖Δm‖ (median) grows ≥ 100× from all layers to the last only", log=True),
           below("matrix_ratio", 1.0, "and the matrix-patch norm shrinks (ratio < 1)", log=True)),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": "full", "apply": "materialized",
           "variant": "stable"}, ("dtype", "h_source"), None, _norms_vs_depth),
    Claim("P10", "paper App. C.4", "the smallest total update comes from starting at the earliest layer",
          (at_most("rank_of_all_layers", 0, "all layers patched has the smallest median total norm of the sweep"),),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": "full", "apply": "materialized"},
          ("dtype", "variant", "h_source"), None, _smallest_total),
    Claim("P11", "paper App. C.2 / Fig. 8b", "the patches are sparse (read on Δm, the scale patch)",
          (at_least("top_share", 0.5, "the top 1 % of Δm's coordinates hold ≥ 50 % of ‖Δm‖² (median over tokens; "
                    f"control: a dense Gaussian vector of 640 coordinates puts {100 * gaussian_top_share():.0f} % "
                    "there)"),),
          {**STEP, "apply": "materialized"}, ("dtype", "variant", "h_source"), None, _sparsity,
          note="the paper does not define 'sparse'; the rule is ours. Matrix patches are rank 1, dense by construction"),
    Claim("P12", "paper App. C.2 / Fig. 8b", "the patches are low-magnitude",
          (at_most("matrix_rel", 0.1, "median ‖ΔW‖_F ≤ 10 % of ‖W‖_F of the patched matrices", log=True),
           at_most("dm_rel", 1.0, "and median ‖Δm‖ ≤ ‖m‖", log=True)),
          {**STEP, "apply": "materialized"}, ("dtype", "variant", "h_source"), None, _magnitude,
          note="the paper gives no scale for 'low'; the thresholds are ours"),
    Claim("P13", "paper App. C.2 / Fig. 8a", "the distance metrics show aligned distributions (rank correlation, "
          "top-1 difference)",
          (at_least("rank_corr", 0.99, "median rank correlation ≥ 0.99"),
           at_most("top1", 0.01, "and median |top-1 difference| ≤ 0.01", log=True)),
          {**STEP, "apply": "materialized"}, ("dtype", "variant", "h_source"), None, _distances,
          note="rank correlation: Spearman over the full vocabulary (the paper's 'rank distance' is a Pearson "
               "correlation of unstated inputs)"),
    Claim("P14", "paper §3.3", "Algorithm 1 on the patched layers' actual outputs self-corrects: it keeps tokens that "
          "patches built from the full-context layer inputs (the ideal schedule) lose",
          (above("gain", 0.0, "actual-output (self-correcting) token match above the ideal schedule's"),),
          {"path": "step", "forcing": "baseline", "start": "first", "parts": "full", "variant": "naive",
           "apply": "factored", "h_source": "actual"}, ("dtype",),
          {"selfcorrect": {"schedule": "selfcorrect"}, "ideal": {"schedule": "ideal"}}, _selfcorrect),
    Claim("R3", "review S000 / paper §6.1 (≈ 5 %)", "a patch computed once and reused for later tokens collapses",
          (at_most("reused_match", 20.0, "token match over the reused steps (1 … 19) ≤ 20 %"),),
          {"schedule": "fixed", "variant": "naive", "apply": "factored", "h_source": "actual"}, ("dtype",), None,
          _fixed),
    Claim("C1", "MATH.md §5 (controls)", "no patch, input patches only, and the vanilla bias port all fail",
          (above("linf_median", 1.0, "median L∞ > 1 (the full patch: ~1e-5 in float32, ≤ 0.45 in bfloat16)", log=True),),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": ("none", "input-only", "vanilla"),
           "variant": "naive", "apply": "factored", "h_source": "actual"},
          ("dtype", "parts"), None, _control,
          note="controls: each drops a part of the construction, so that the checks above can fail"),
    Claim("A1", "audit [MLN]", "the Appendix B hard case (no interior root) occurs on real activations",
          (above("count", 0, "at least one hard case"),), {**STEP, "variant": "stable"},
          ("dtype", "apply", "h_source"), None, _hard_cases),
    Claim("P15", "paper §4.1", "exact zeros of the divisor h occur, so the divide-by-1 guard is needed",
          (above("count", 0, "at least one divide-by-1 coordinate"),), {**STEP}, ("dtype", "variant", "apply",
                                                                                   "h_source"), None, _fallbacks),
    Claim("F1", "paper §4.1 / §6.1 (the equivalence is per history)", "free-running, the patched model writes the "
          "baseline's text",
          (at_least("identical_share", 1.0, "every prompt's free-running text equals the baseline's greedy text over "
                    "all generated tokens"),),
          {"forcing": "patched"}, ("dtype", "variant", "h_source"), None, _free),
    Claim("M1", "this toolkit (the cast rule)", "factored patches give the materialized checkpoint's tokens",
          (at_least("agree", 100.0, "the same baseline and patched token at every step"),), {**STEP},
          ("dtype", "variant", "h_source"), {"materialized": {"apply": "materialized"}, "factored": {"apply": "factored"}},
          _same_tokens("materialized", "factored"),
          note="factored adds the rank-1 action in the patch dtype to the model-dtype product; materialized rounds "
               "W + ΔW once into the model dtype: equal in float32 up to rounding, not bit for bit in bfloat16"),
    Claim("M2", "this toolkit (batched path)", "the batched teacher-forced path gives the step-by-step tokens",
          (at_least("agree", 100.0, "the same baseline and patched token at every step"),),
          {**BASE, "apply": "factored"}, ("dtype", "variant", "h_source"),
          {"step": {"path": "step"}, "batched": {"path": "batched"}}, _same_tokens("step", "batched")),
    Claim("D1", "paper App. D", "a post-norm block without a trainable scale cannot absorb a Δv beyond 2√d‖m‖∞",
          (at_least("gap", 0.0, "no upstream search gets below ‖Δv‖ − 2√d‖m‖∞"),
           at_most("trainable", 1e-10, "while a trainable scale (Δm = Δv ⊘ h) reaches it (≤ 1e-10)", log=True)),
          special=_appendix_d),
    Claim("E1", "paper App. E", "increments with a fixed preconditioner telescope to the one-shot patch",
          (at_most("error", 1e-10, "relative error of the summed steps vs the one-shot patch ≤ 1e-10 (float64)",
                   log=True),), special=_appendix_e),
    Claim("S5", "paper §5, Table 1 (the paper ran Gemma and Falcon)", "the construction is exact for Gemma, Llama, "
          "Falcon, Mistral/Mixtral, Qwen, GPT-2 and GPT-J blocks",
          (at_least("families", 100.0, "every family exact in float64 and every token matching in float32"),),
          special=_architectures),
    Claim("P16", "paper §4.2, Fig. 5", "image context (Gemma-3-4B): 100 % float32 token match",
          why_not="needs Gemma-3-4B and the paper's image; neither is available offline (the same code runs it: "
                  "ctxpatch-compare --model google/gemma-3-4b-it --image PATH on a GPU). I1–I3 check the construction "
                  "with an image on a tiny random Gemma3ForConditionalGeneration"),
    Claim("I1", "paper §4.2, Fig. 5 (the construction); tiny random Gemma3ForConditionalGeneration", "with images in the context, "
          "every patched layer reproduces its full-context output at the query (float64)",
          (at_most("block_error", 1e-10, "largest relative block error over layers and tokens ≤ 1e-10", log=True),),
          {**BASE, "dtype": "float64", "context": "image"}, ("path", "images"), None, _block_error,
          note="exactness only: the model's weights are random, so nothing here is about what Gemma sees"),
    Claim("I2", "paper Fig. 5; review S000 (40/40 in float32 on the 4B model)", "with images in the context, the patched model "
          "without context picks the baseline's token at every step (float32, tiny random model)", (TOKENS_ALL,),
          {**BASE, **F32, "context": "image"}, ("path", "images"), None, _match_pct),
    Claim("I3", "MATH.md §5 (control)", "with an image in the context, the query alone without patches misses what the "
          "context did (control)",
          (above("linf_median", 0.1, "median L∞ > 0.1 (the patched runs: below 1e-5)", log=True),),
          {"path": "step", "forcing": "baseline", "schedule": "selfcorrect", "parts": "none", "context": "image"},
          ("dtype", "images"), None, _control),
    Claim("P17", "paper App. C.3, Fig. 9", "Falcon-7B: 100 % token match in bfloat16 and float32",
          why_not="needs Falcon-7B weights (no package registry ships them); Falcon's parallel and sequential blocks "
                  "are exact on random weights (S5)"),
    Claim("P18", "paper App. C.5", "the scaling variant keeps Δm free of extreme values",
          why_not="the scaling variant's construction is not described in any source we could read; not implemented"),
]


# -- the ledger ----------------------------------------------------------------------------------------------------

def spec_of(config: dict) -> dict:
    """The settings a reading selects by, read from a run's ``config`` (what ``compare --json`` and
    ``scripts/reference_runs.py`` both record): dtype, variant, apply, h_source, schedule, parts, path (step or
    batched), forcing, and the start layer as ``first`` / ``last`` / ``layer<N>``."""
    start, n = int(config.get("start_layer") or 0), config.get("n_layers")
    return {"dtype": config["dtype"], "variant": config["variant"], "apply": config["apply"],
            "h_source": config["h_source"], "schedule": config.get("schedule", "selfcorrect"),
            "parts": config.get("parts", "full"),
            "path": "batched" if str(config.get("path", "")).startswith("batched") else "step",
            "forcing": config.get("forcing", "baseline"),
            "start": "first" if start == 0 else "last" if n is not None and start == n - 1 else f"layer{start}",
            "context": "image" if config.get("images") else "text", "images": len(config.get("images") or [])}


def load_reference(reference_dir: str | Path) -> dict:
    """name -> run record (with its ``spec``) for every run JSON in ``reference_dir``: the files
    ``scripts/reference_runs.py`` writes, or ``compare --json`` outputs (summary and appendix files skipped), or
    the finished compare jobs of a sweep's output folder (``python -m ctxpatch_lite.sweep``, e.g. of
    ``data/grids/gemma-3-1b-gpu.yaml``)."""
    out = {}
    if (Path(reference_dir) / "sweep.json").is_file():
        from .sweep import job_records
        for r in job_records(reference_dir):
            rec = r["result"]
            if r["job"]["kind"] == "compare" and rec and "config" in rec and "summary" in rec:
                out[r["job"]["name"]] = {**rec, "name": r["job"]["name"], "spec": spec_of(rec["config"])}
        return out
    for f in sorted(Path(reference_dir).glob("*.json")):
        if f.name in ("summary.json", "appendix.json"):
            continue
        rec = json.loads(f.read_text())
        if "config" in rec and "summary" in rec:
            out[rec.get("name", f.stem)] = {**rec, "spec": spec_of(rec["config"])}
    return out


def _matches(rec, want: dict) -> bool:
    spec = rec["spec"]
    return all(spec.get(k) in v if isinstance(v, tuple) else spec.get(k) == v for k, v in want.items())


def readings(claim: Claim, recs: dict) -> list:
    """[(label, Figure, runs used)] for every combination of ``claim.over`` present in the data."""
    pool = [r for r in recs.values() if _matches(r, {"context": "text", **claim.select})]   # text unless asked
    if claim.roles:
        pool_roles = {role: [r for r in pool if _matches(r, o)] for role, o in claim.roles.items()}
        values = {k: sorted({r["spec"][k] for rs in pool_roles.values() for r in rs}) for k in claim.over}
    else:
        values = {k: sorted({r["spec"][k] for r in pool}) for k in claim.over}
    out = []
    for combo in itertools.product(*(values[k] for k in claim.over)):
        setting = dict(zip(claim.over, combo))
        label = ", ".join(f"{k}={v}" for k, v in setting.items()) or "—"
        if claim.roles:
            used = {}
            for role, o in claim.roles.items():
                found = [r for r in pool if _matches(r, {**setting, **o})]
                if len(found) != 1:
                    break
                used[role] = found[0]
            else:
                out.append((setting, label, claim.measure(used), list(used.values())))
        else:
            found = [r for r in pool if _matches(r, setting)]
            if claim.id in SWEEPS and len({r["spec"]["start"] for r in found}) < 2:
                continue     # a depth sweep needs at least two start layers
            if found:
                out.append((setting, label, claim.measure(found[0] if len(found) == 1 and claim.id not in SWEEPS
                                                          else found), found))
    return out


SWEEPS = ("P8", "P9", "P10")   # claims whose measure reads every start layer of a reading


def judge(claim: Claim, figures: list) -> tuple[str, str]:
    """(verdict, why) from the readings' pass/fail: every reading passing → reproduced, none → contradicted,
    else 'depends on the setting', naming the setting(s) whose values decide it when one does."""
    passed = [(s, all(rule.passes(f.values) for rule in claim.rules)) for s, f in figures]
    if not passed:
        return NOT_RUNNABLE, ""
    if all(p for _, p in passed):
        return REPRODUCED, "every reading passes" if len(passed) > 1 else ""
    if not any(p for _, p in passed):
        return CONTRADICTED, "no reading passes" if len(passed) > 1 else ""
    keys = list(passed[0][0])
    for k in keys:   # one setting that decides it on its own
        by = {}
        for s, p in passed:
            by.setdefault(s[k], set()).add(p)
        if all(len(v) == 1 for v in by.values()):
            yes = [str(v) for v, p in by.items() if p == {True}]
            no = [str(v) for v, p in by.items() if p == {False}]
            return DEPENDS, f"depends on {k}: reproduced with {', '.join(yes)}, not with {', '.join(no)}"
    yes = [", ".join(f"{k}={v}" for k, v in s.items()) for s, p in passed if p]
    no = [", ".join(f"{k}={v}" for k, v in s.items()) for s, p in passed if not p]
    listing = ("; ".join(yes) if len(yes) <= len(no) else "all but " + "; ".join(no))
    informative = [k for k in keys if len({s[k] for s, _ in passed}) > 1]
    shared = {}
    for k in informative:   # settings every passing reading shares: necessary, though not sufficient
        vals = {s[k] for s, p in passed if p}
        if len(vals) == 1:
            shared[k] = vals.pop()
    if shared:
        n = sum(all(s[k] == v for k, v in shared.items()) for s, _ in passed)
        what = ", ".join(f"{k}={v}" for k, v in shared.items())
        if n == len(yes):
            return DEPENDS, f"reproduced in {len(yes)} of {len(passed)} readings, those with {what}"
        return DEPENDS, f"reproduced only with {what}, in {len(yes)} of its {n} readings: {listing}"
    return DEPENDS, f"reproduced in {len(yes)} of {len(passed)} readings: {listing}"


def _hardware(used: list) -> str:
    envs = {(e.get("cuda") or f"CPU {e.get('machine', '?')}", e.get("torch_threads"))
            for e in (r["config"].get("environment", {}) for r in used)}
    return "; ".join(f"{hw}, {t} thread(s)" if t else hw for hw, t in sorted(envs, key=str))


def ledger(reference_dir: str | Path) -> list[dict]:
    """One row per claim: claim, source, rule in words, every reading's figure, tokens, model, dtype, hardware,
    verdict (and why). Reads ``reference_dir`` (run JSON with ``spec``, ``appendix.json``) and the family check's
    JSON in ``architectures/`` next to it."""
    recs = load_reference(reference_dir)
    rows = []
    for c in CLAIMS:
        fixed = ", ".join(f"{k}={v}" for k, v in c.select.items() if k in SETTINGS and not isinstance(v, tuple))
        row = {"id": c.id, "source": c.source, "claim": c.statement, "rule": "; ".join(r.words for r in c.rules),
               "fixed": fixed,
               "rules": [{"key": r.key, "op": r.op, "threshold": r.threshold, "log": r.log} for r in c.rules],
               "note": c.note, "readings": [], "tokens": 0, "model": "—", "dtype": "—", "hardware": "—"}
        if c.why_not:
            rows.append({**row, "verdict": NOT_RUNNABLE, "why": c.why_not})
            continue
        if c.special is not None:
            try:
                found = c.special(reference_dir)
            except FileNotFoundError as e:
                found, err = [], str(e)
            else:
                err = "no data"
            if not found:
                rows.append({**row, "verdict": NOT_RUNNABLE, "why": f"its data is missing ({err})"})
                continue
            figs = [({"setting": label}, f) for label, f, _ in found]
            verdict, why = judge(c, figs)
            meta = found[0][2]
            rows.append({**row, "readings": [_reading(c, label, f) for label, f, _ in found], "verdict": verdict,
                         "why": why, "tokens": meta.get("tokens", 0), "model": "seeded tiny models",
                         "dtype": meta["dtype"], "hardware": meta.get("hardware", "CPU")})
            continue
        got = readings(c, recs)
        if not got:
            rows.append({**row, "verdict": NOT_RUNNABLE, "why": "its runs are missing from " + str(reference_dir)})
            continue
        verdict, why = judge(c, [(s, f) for s, _, f, _ in got])
        used = {id(r): r for _, _, _, rs in got for r in rs}.values()
        tokens = sum(r["summary"]["n_tokens"] for r in used)
        rows.append({**row, "readings": [_reading(c, label, f) for _, label, f, _ in got], "verdict": verdict,
                     "why": why, "tokens": tokens,
                     "model": ", ".join(sorted({r["config"].get("model", "?") for r in used})),
                     "dtype": ", ".join(sorted({r["config"]["dtype"] for r in used})),
                     "hardware": _hardware(list(used))})
    return rows


SETTINGS = ("dtype", "variant", "apply", "h_source", "path", "schedule")   # shown when a claim fixes them


def _reading(c: Claim, label: str, f: Figure) -> dict:
    each = [rule.passes(f.values) for rule in c.rules]
    return {"setting": label, "text": f.text, "values": f.values, "rule_passes": each, "passes": all(each)}


def counts(rows: list[dict]) -> dict:
    """Claims per verdict (one per claim)."""
    return {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}


# -- rendering -------------------------------------------------------------------------------------------------

def _readings_lines(r) -> list[str]:
    if not r["readings"]:
        return [r.get("why", "")]
    return [f"{'✓' if x['passes'] else '✗'} {x['setting']}: {x['text']}" if x["setting"] != "—"
            else f"{'✓' if x['passes'] else '✗'} {x['text']}" for x in r["readings"]]


def to_markdown(rows: list[dict]) -> str:
    """A Markdown table: one row per claim, every reading on its own line (✓ passes the rule, ✗ does not)."""
    lines = ["| id | claim (source) | rule | readings | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = f"**{r['verdict']}**" + (f"<br>{r['why']}" if r.get("why") and r["readings"] else "")
        lines.append(f"| {r['id']} | {r['claim']} ({r['source']}) | {r['rule'] or '—'} | "
                     f"{'<br>'.join(_readings_lines(r))} | {verdict} |")
    return "\n".join(lines)


VERDICT_COLOURS = {REPRODUCED: "#1b7837", CONTRADICTED: "#b2182b", DEPENDS: "#b35806", NOT_RUNNABLE: "#666666"}


def to_html(rows: list[dict]) -> str:
    """An HTML table that wraps (no long lines), for JupyterLab and Voilà: claim, rule, readings, verdict, and
    the tokens, model, dtype and hardware behind them."""
    e = html.escape
    out = ['<table style="border-collapse:collapse;font-size:90%;table-layout:fixed;width:100%">',
           "<colgroup><col style='width:4%'><col style='width:22%'><col style='width:18%'><col style='width:40%'>"
           "<col style='width:16%'></colgroup>",
           "<tr>" + "".join(f"<th style='text-align:left;border-bottom:1px solid #999'>{h}</th>"
                            for h in ("id", "claim", "rule", "readings (✓ passes the rule)", "verdict")) + "</tr>"]
    for r in rows:
        cell = "style='vertical-align:top;text-align:left;padding:4px;border-bottom:1px solid #ddd;" \
               "white-space:normal;word-wrap:break-word'"
        readings = "<br>".join(e(x) for x in _readings_lines(r))
        fixed = f" · fixed: {e(r['fixed'])}" if r.get("fixed") else ""
        basis = (f"<br><small>{r['tokens']} tokens · {e(r['model'])} · {e(r['dtype'])} · {e(r['hardware'])}{fixed}"
                 f"</small>" if r["readings"] else "")
        note = f"<br><small><i>{e(r['note'])}</i></small>" if r.get("note") else ""
        colour = VERDICT_COLOURS[r["verdict"]]
        why = f"<br><small>{e(r['why'])}</small>" if r.get("why") and r["readings"] else ""
        out.append(f"<tr><td {cell}><b>{e(r['id'])}</b></td><td {cell}>{e(r['claim'])}<br><small>{e(r['source'])}"
                   f"</small></td><td {cell}>{e(r['rule'] or '—')}{note}</td><td {cell}>{readings}{basis}</td>"
                   f"<td {cell}><b style='color:{colour}'>{e(r['verdict'])}</b>{why}</td></tr>")
    out.append("</table>")
    return "\n".join(out)

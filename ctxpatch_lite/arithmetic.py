"""What rounding can promise from one machine to the next, and the one set of rules that judges it.

The same code on two x86-64 CPUs does not give the same last bits. torch's CPU libraries choose their kernels by
the vector width the CPU offers, and each width sums in another order (``scripts/arith_paths.py`` measures which
variable moves which result; ``benchmarks/results/arith_paths.json``):

* ATen's own kernels (softmax, norms, reductions, ``torch.randn``) follow ``ATEN_CPU_CAPABILITY``;
* MKL's float32/float64 matrix products follow ``MKL_CBWR``;
* oneDNN's bfloat16 matrix products follow ``ONEDNN_MAX_CPU_ISA``.

A float32 logit of the embedded model then moves by about 2e-5 (a few float32 ulps at |logit| ~ 30), a bfloat16 one
by one or two bfloat16 ulps (0.125 each between 16 and 32). Everything downstream is judged against that noise:

* **tokens**: a greedy token is promised only where the baseline's own top-2 margin exceeds the logit noise; a match
  of the patched model only where the margin also exceeds twice its distance from the baseline. Elsewhere a
  difference is a flagged tie, not a failure, and a tie of the baseline's own token ends the comparison of that
  prompt (the two histories differ from there on);
* **distances** (L-infinity, TVD): per run, the median and the maximum over the compared steps, within a band
  stated per noise class (``BANDS``); a single step of bfloat16 can move by much more than its run's median;
* **notebook metrics**: each metric has a named rule (``RULES``) in ``notebooks/expected_metrics.json``.

``arithmetic_path()`` records where a run ran (every record's environment carries it); ``SECOND_PATH`` is the
setting under which ``make test`` runs the notebooks and the reference check a second time, to show that nothing
it checks depends on this machine's path.
"""
from __future__ import annotations

import fnmatch
import math
import os
import statistics
from dataclasses import dataclass

# The variables that choose an arithmetic path (read when a process starts), and the thread counts, which change
# the order of parallel reductions too.
PATH_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                  "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CTXPATCH_THREADS")
# The plainest path of an x86-64 CPU: ATen without vector extensions, MKL's compatible code path, oneDNN on SSE4.1.
# On an AVX-512 machine it moves every kind of result scripts/arith_paths.py probes.
SECOND_PATH = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
MANTISSA_BITS = {"float64": 52, "float32": 23, "bfloat16": 7}


def arithmetic_path() -> dict:
    """Where this process computes: the CPU's vector capability as torch uses it (AVX512, AVX2, DEFAULT ...), the
    path variables that are set, and torch's thread count."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else None
    return {"cpu_capability": cap, "torch_threads": torch.get_num_threads(),
            "variables": {k: os.environ[k] for k in PATH_VARIABLES if k in os.environ}}


def ulp(magnitude: float, dtype: str) -> float:
    """The spacing of ``dtype`` numbers at ``|magnitude|``: 2^(floor(log2 |x|) - mantissa bits)."""
    x = abs(float(magnitude))
    if x == 0 or not math.isfinite(x):
        return float("nan")
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA_BITS[dtype])


def ulps(values, dtype: str):
    """``ulp`` of every element of a tensor, as a float32 tensor of its shape (0 where the value is 0)."""
    import torch
    x = values.float()
    step = torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 1 - MANTISSA_BITS[dtype])
    return torch.where(x == 0, torch.zeros_like(step), step)


# --- distances of whole runs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Band:
    """``|new - old| <= abs + rel * |old|``; with ``factor``, also (for positive values) within that factor of
    each other. ``why`` is the reason, in a sentence."""

    abs: float
    rel: float = 0.0
    factor: float | None = None
    why: str = ""

    def allows(self, new: float, old: float) -> bool:
        if math.isnan(new) or math.isnan(old):
            return math.isnan(new) and math.isnan(old)
        if abs(new - old) <= self.abs + self.rel * abs(old):
            return True
        return bool(self.factor) and new > 0 and old > 0 and max(new / old, old / new) <= self.factor

    def text(self) -> str:
        parts = [f"{self.abs:g}"] + ([f"{self.rel:g} x old"] if self.rel else [])
        return " + ".join(parts) + (f", or within {self.factor:g}x" if self.factor else "")


# Logit noise between two arithmetic paths, in ulps of the run's largest logit (|logit| ~ 20-40 on the embedded
# model). It decides which tokens are promised (margin above the noise) and sets the L-infinity bands.
LOGIT_NOISE_ULPS = {"float64": 64, "float32": 16, "bfloat16": 2}

# Noise classes of a run: its dtype, and "amplified" when rounding is multiplied before it reaches the logits
# (h_source="recorded": dm ~ 1e6-1e8 multiplies the difference between the recorded h and the computed one; the
# ideal and fixed schedules: patches built on other inputs than the ones they meet).
BANDS: dict[str, dict[str, Band]] = {}   # filled below: {class: {"linf": Band, "tvd": Band}}


def bands_with(overrides: dict | None) -> dict:
    """``BANDS`` with a grid's ``tolerance:`` applied: ``{class: {linf: [abs, rel(, factor)], tvd: [...]}}``, class
    one of ``BANDS``' keys. Raises ``ValueError`` with what a valid entry looks like."""
    out = {k: dict(v) for k, v in BANDS.items()}
    if not overrides:
        return out
    if not isinstance(overrides, dict):
        raise ValueError(f"'tolerance' maps a noise class ({', '.join(BANDS)}) to {{linf: [abs, rel], tvd: [abs, rel]}}"
                         f", got {overrides!r}")
    for klass, tol in overrides.items():
        if klass not in out:
            raise ValueError(f"tolerance.{klass}: not a noise class; choose one of {', '.join(BANDS)}")
        if (not isinstance(tol, dict) or not tol or set(tol) - {"linf", "tvd"}
                or not all(isinstance(v, (list, tuple)) and len(v) in (2, 3) and all(isinstance(x, (int, float))
                                                                                      for x in v) for v in tol.values())):
            raise ValueError(f"tolerance.{klass} maps linf and/or tvd to [abs, rel] or [abs, rel, factor] (a run's "
                             f"median and max may move by abs + rel x reference), got {tol!r}")
        for key, v in tol.items():
            out[klass][key] = Band(float(v[0]), float(v[1]), float(v[2]) if len(v) == 3 else None,
                                   why="the grid's own tolerance")
    return out


def bands_as_json(bands: dict) -> dict:
    return {k: {m: [b.abs, b.rel] + ([b.factor] if b.factor else []) for m, b in v.items()} for k, v in bands.items()}


def noise_class(config: dict) -> str:
    """``float64`` | ``float32`` | ``bfloat16``, with ``-amplified`` for the runs whose rounding is amplified."""
    dtype = str(config.get("dtype", "float32"))
    amplified = (config.get("h_source") == "recorded" or config.get("schedule") in ("ideal", "fixed"))
    return dtype + ("-amplified" if amplified else "")


def dtype_of(klass: str) -> str:
    return klass.split("-")[0]


@dataclass
class RunComparison:
    """What ``compare_runs`` found: ``problems`` (regressions), ``ties`` (flagged, not judged), how many steps were
    compared, and the largest measured differences."""

    problems: list
    ties: list
    compared: int
    worst: dict

    @property
    def ok(self) -> bool:
        return not self.problems


def _aggregates(steps: list, key: str) -> tuple[float, float]:
    vals = [s[key] for s in steps if isinstance(s.get(key), (int, float)) and math.isfinite(s[key])]
    return (statistics.median(vals), max(vals)) if vals else (float("nan"), float("nan"))


def compare_runs(new: list, ref: list, config: dict, name: str = "run", bands: dict | None = None) -> RunComparison:
    """Compare two runs of one configuration, prompt by prompt: ``new`` and ``ref`` are lists of run records (each
    with ``steps`` and optionally ``prompt_id``), ``config`` the run's config (dtype, h_source, schedule).

    Per prompt, step by step: the baseline's greedy token must agree where its top-2 margin exceeds the logit noise
    (else: a flagged tie, and the rest of that prompt is not compared: its history differs); a step is *promised*
    when the margin exceeds twice (its L-infinity distance + the L-infinity band + the noise), and there the
    patched model must still match. Over all compared steps: median and max of L-infinity and TVD within the
    class's bands."""
    klass = noise_class(config)
    bands = bands or BANDS
    band = bands.get(klass) or bands[dtype_of(klass)]
    problems, ties = [], []
    new_steps, ref_steps = [], []
    ref_by = {r.get("prompt_id", i): r for i, r in enumerate(ref)}
    free = config.get("forcing") == "patched"      # free-running: the history follows the patched model's tokens
    for i, run in enumerate(new):
        pid = run.get("prompt_id", i)
        old = ref_by.get(pid)
        if old is None:
            problems.append(f"{name} [{pid}]: no run of this prompt in the reference")
            continue
        if len(run["steps"]) != len(old["steps"]):
            problems.append(f"{name} [{pid}]: {len(run['steps'])} steps, reference {len(old['steps'])}")
        prev = None
        for g, r in zip(run["steps"], old["steps"]):
            where = f"{name} [{pid}] step {r['step']}"
            noise = _logit_noise(r, klass)
            if g["query_token"] != r["query_token"]:
                # the history took another token after the previous step: allowed where that token was a tie
                why = _diverged_at_tie(prev, klass, band, free)
                if why:
                    ties.append(f"{where}: the history took another token after a {why}; later steps not compared")
                else:
                    problems.append(f"{where}: query token {g['query_token']} != reference {r['query_token']}")
                break
            if g["baseline_token"] != r["baseline_token"]:
                margin = r.get("margin")
                if margin is not None and margin <= noise:
                    ties.append(f"{where}: the baseline's token changed at a tie (top-2 margin {margin:.3g} <= "
                                f"noise {noise:.3g}); later steps not compared")
                else:
                    problems.append(f"{where}: baseline token {g['baseline_token']} != reference {r['baseline_token']}"
                                    f" (top-2 margin {margin if margin is None else format(margin, '.3g')})")
                break
            new_steps.append(g)
            ref_steps.append(r)
            prev = r
            if g["match"] != r["match"]:
                margin = r.get("margin")
                text = (f"{where}: the patched token {'now matches' if g['match'] else 'no longer matches'} "
                        f"(top-2 margin {margin if margin is None else format(margin, '.3g')}, L-inf {r['linf']:.3g})")
                if _promised(r, klass, band):
                    problems.append(text)
                else:
                    ties.append(text + ": not promised")
    worst = {}
    for key in ("linf", "tvd"):
        (nm, nx), (om, ox) = _aggregates(new_steps, key), _aggregates(ref_steps, key)
        worst[key] = {"median": abs(nm - om), "max": abs(nx - ox),
                      "step": max((abs(a[key] - b[key]) for a, b in zip(new_steps, ref_steps)), default=0.0)}
        for what, n_, o_ in (("median", nm, om), ("max", nx, ox)):
            if not band[key].allows(n_, o_):
                problems.append(f"{name}: {what} {key} {n_:.4g}, reference {o_:.4g} (band for {klass}: "
                                f"{band[key].text()})")
    return RunComparison(problems, ties, len(new_steps), worst)


def _promised(step: dict, klass: str, band: dict) -> bool:
    """Whether the arithmetic promises this step's match on any CPU. If each of the two logit vectors moves by at
    most the noise e, the baseline's margin m shrinks by at most 2e and their L-inf distance d grows by at most 2e;
    the argmaxes must agree while d + 2e < (m - 2e) / 2, i.e. m > 2d + 6e. Amplified runs promise no step (their
    patched logits carry rounding multiplied by dm; only their medians and maxima are judged)."""
    margin = step.get("margin")
    if margin is None or klass.endswith("amplified"):
        return False
    return margin > 2 * step["linf"] + 6 * _logit_noise(step, klass)


def _diverged_at_tie(prev: dict | None, klass: str, band: dict, free: bool) -> str | None:
    """Why a history may have taken another token after ``prev`` (the reference's previous step), or None: the
    baseline's greedy token sat at a tie there (its margin within the logit noise), or, free-running, the patched
    model's token was not promised."""
    if prev is None:
        return None
    if prev.get("margin") is not None and prev["margin"] <= _logit_noise(prev, klass):
        return f"tie of the baseline at step {prev['step']} (top-2 margin {prev['margin']:.3g})"
    if free and not (prev["match"] and _promised(prev, klass, band)):
        return f"patched token at step {prev['step']} that the arithmetic does not promise"
    return None


def _logit_noise(step: dict, klass: str) -> float:
    """The cross-path noise of one step's logits: ``LOGIT_NOISE_ULPS`` ulps of its largest logit (taken as 32, the
    top of the embedded model's range, when the record does not say)."""
    dtype = dtype_of(klass)
    top = step.get("logit_scale") or 32.0
    return LOGIT_NOISE_ULPS[dtype] * ulp(top, dtype)


# --- notebook metrics -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """How one notebook metric may move between machines: ``exact``; ``abs`` (|new - old| <= value);
    ``rel`` (<= value x |old|); ``factor`` (positive, within that factor); ``below`` (new <= value: a quantity
    that is rounding itself, promised to stay at rounding level); ``any`` (recorded, not compared: say why).
    ``value`` is a number, or one number per dtype (the run's dtype picks it)."""

    kind: str
    value: float | dict = 0.0
    why: str = ""

    def at(self, dtype: str) -> float:
        if isinstance(self.value, dict):
            if dtype not in self.value:
                raise ValueError(f"this rule has no value for {dtype!r} (it has {', '.join(self.value)})")
            return float(self.value[dtype])
        return float(self.value)

    def allows(self, new, old, dtype: str = "float32") -> bool:
        if self.kind == "any":
            return True
        if isinstance(new, (bool, str)) or isinstance(old, (bool, str)) or new is None or old is None:
            return new == old
        new, old, v = float(new), float(old), self.at(dtype) if self.kind != "exact" else 0.0
        if math.isnan(new) or math.isnan(old):
            return math.isnan(new) and math.isnan(old)
        if self.kind == "exact":
            return new == old
        if self.kind == "abs":
            return abs(new - old) <= v
        if self.kind == "rel":
            return abs(new - old) <= v * abs(old)
        if self.kind == "factor":
            return (new == old == 0) or (new > 0 and old > 0 and max(new / old, old / new) <= v)
        if self.kind == "below":
            return new <= v
        raise ValueError(f"unknown rule kind {self.kind!r}")

    def text(self, dtype: str = "float32") -> str:
        if self.kind in ("exact", "any"):
            return {"exact": "exact", "any": "not compared"}[self.kind]
        v = self.at(dtype)
        return {"abs": f"within {v:g}", "rel": f"within {v:g} x reference", "factor": f"within a factor {v:g}",
                "below": f"at most {v:g}"}[self.kind] + (f" ({dtype})" if isinstance(self.value, dict) else "")


RULE_KINDS = ("exact", "abs", "rel", "factor", "below", "any")
RULES: dict[str, Rule] = {}              # filled below; notebooks/expected_metrics.json names them


def rule_of(spec) -> tuple[Rule, str | None]:
    """``(rule, dtype)`` from a rule's name in ``RULES`` (``"name"``, or ``"name:bfloat16"`` to fix the dtype its
    value is taken at) or an inline ``{"kind", "value", "why"}``."""
    if isinstance(spec, str):
        name, _, dtype = spec.partition(":")
        if name not in RULES:
            raise ValueError(f"unknown metric rule {spec!r}; named rules: {', '.join(RULES)} (or give "
                             f"{{'kind': one of {', '.join(RULE_KINDS)}, 'value': ..., 'why': ...}})")
        if dtype and dtype not in MANTISSA_BITS:
            raise ValueError(f"metric rule {spec!r}: {dtype!r} is not a dtype ({', '.join(MANTISSA_BITS)})")
        return RULES[name], dtype or None
    if not isinstance(spec, dict) or spec.get("kind") not in RULE_KINDS or not spec.get("why"):
        raise ValueError(f"a metric rule is a name or {{'kind', 'value', 'why'}} with kind one of "
                         f"{', '.join(RULE_KINDS)} and a reason; got {spec!r}")
    return Rule(spec["kind"], spec.get("value", 0.0), spec["why"]), None


def flatten(d, prefix: str = "") -> dict:
    """Nested metrics as ``{"a.b": value}`` (lists by index: ``a.0``); numbers, bools, strings and None kept."""
    out = {}
    items = d.items() if isinstance(d, dict) else enumerate(d)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[key] = v
    return out


def rule_for(key: str, value, rules: dict):
    """``(pattern, rule, dtype)`` of one metric: the most specific pattern of ``rules`` that matches ``key``
    (fnmatch; the one with the most literal characters, so ``a.1.b`` wins over ``a.*.b``).
    Without one, integers, booleans and strings are exact; a float has no rule (every float needs a stated one)."""
    hits = [p for p in rules if fnmatch.fnmatchcase(key, p)]
    if hits:
        pattern = max(hits, key=lambda p: (len(p.replace("*", "").replace("?", "")), len(p)))
        return (pattern, *rule_of(rules[pattern]))
    if isinstance(value, (bool, int, str)) or value is None:
        return "(integers, flags and strings)", RULES["exact"], None
    return None


def compare_metrics(new: dict, expected: dict, rules: dict, label: str = "expected") -> list[str]:
    """Every way the metrics ``new`` differ from ``expected`` under ``rules`` (both nested or flat): a metric
    missing or new, a float with no rule, a value outside its rule (named, with its reason). A rule's per-dtype
    value is taken at the metrics' own ``dtype`` (float32 when they have none) unless the rule names one."""
    new, expected = flatten(new), flatten(expected)
    run_dtype = str(expected.get("dtype") or "float32")
    problems = []
    for key, old in expected.items():
        if key not in new:
            problems.append(f"metric {key} missing ({label}: {old!r})")
            continue
        found = rule_for(key, old, rules)
        if found is None:
            problems.append(f"metric {key} = {new[key]!r} has no rule: a float needs a stated tolerance (add a pattern "
                            f"to this notebook's rules)")
            continue
        pattern, rule, dtype = found
        dtype = dtype or run_dtype
        if not rule.allows(new[key], old, dtype):
            problems.append(f"{key} = {new[key]!r}, {label} {old!r} (rule {pattern!r}: {rule.text(dtype)}; {rule.why})")
    problems += [f"metric {key} = {new[key]!r} is new ({label} has no such metric)" for key in new if key not in expected]
    return problems


def _init():
    # Bands for a run's median and max. Measured between the committed reference runs (an AVX2 machine) and the
    # same 76 configurations + 9 image runs rerun under SECOND_PATH on an AVX-512 one (largest differences, in the
    # issue note and README "On another CPU"); each band is about twice the largest difference measured.
    f32, f64, bf = (lambda n: n * ulp(32.0, "float32")), (lambda n: n * ulp(32.0, "float64")), \
        (lambda n: n * ulp(32.0, "bfloat16"))
    BANDS.update({
        "float64": {"linf": Band(f64(2 * LOGIT_NOISE_ULPS["float64"]), why="twice the float64 logit noise "
                                                                           "(measured: 4e-16)"),
                    "tvd": Band(1e-15, why="float64 rounding of the softmax (measured: 1.2e-16)")},
        "float32": {"linf": Band(f32(2 * LOGIT_NOISE_ULPS["float32"]), why="both logit vectors move by up to the "
                                                                           "logit noise (measured: 5.6e-5)"),
                    "tvd": Band(1e-6, 0.5, why="the TVD of logits that agree to rounding, itself ~1e-6 "
                                               "(measured: 4.7e-7)")},
        "float32-amplified": {"linf": Band(0.0, factor=8.0, why="rounding multiplied by dm ~ 1e6-1e8: the same "
                                                                "order of magnitude (measured: a factor 2.9)"),
                              "tvd": Band(1e-6, factor=8.0, why="as L-inf (measured: a factor 3.7)")},
        "float64-amplified": {"linf": Band(f64(2 * LOGIT_NOISE_ULPS["float64"]), factor=8.0,
                                           why="as float32-amplified, at float64 rounding"),
                              "tvd": Band(1e-15, factor=8.0, why="as float32-amplified, at float64 rounding")},
        "bfloat16": {"linf": Band(bf(8), why="8 bfloat16 ulps of a logit of 32 (2.0): a run's largest difference "
                                             "moves with its worst step (measured: 0.94 for the max, 0.25 the "
                                             "median)"),
                     "tvd": Band(0.01, 0.5, why="bfloat16 TVD per run, ~0.01: the same order (measured: 0.0066)")},
        "bfloat16-amplified": {"linf": Band(bf(8), factor=8.0, why="amplified bfloat16 rounding: the same order of "
                                                                   "magnitude (measured: a factor 4.3)"),
                               "tvd": Band(0.05, factor=8.0, why="as L-inf (measured: a factor 2.8)")},
    })
    # Named rules for notebook metrics. The values were set against the largest difference measured between this
    # machine's default path and SECOND_PATH (make run on both, compared key by key; see the issue note and
    # benchmarks/results/arith_paths.json), with headroom, and each states why the arithmetic allows it.
    RULES.update({
        "exact": Rule("exact", why="an integer, a token, a string or a fact of the model"),
        "rounding": Rule("below", {"float64": 1e-12, "float32": 1e-5, "bfloat16": 0.05},
                         why="a relative error or difference that is rounding itself: promised to stay at its dtype's "
                             "rounding level, not to the digit (measured: float32 1e-8 .. 7e-7 moved by up to 12x)"),
        "logit-distance": Rule("below", {"float64": 1e-11, "float32": 1e-4, "bfloat16": 0.5},
                               why="the distance of two logit vectors that agree to rounding: below a few tens of "
                                   "ulps of |logit| ~ 30 (float32 ulp 3.8e-6; bfloat16 0.125-0.25); measured float32 "
                                   "L-inf 5e-6 .. 2e-5"),
        "prob-distance": Rule("below", {"float64": 1e-12, "float32": 1e-5, "bfloat16": 0.05},
                              why="the TVD of two distributions whose logits agree to rounding: rounding level "
                                  "(measured float32 4e-7 .. 1.7e-6, bfloat16 medians 0.005 .. 0.01)"),
        "value": Rule("rel", {"float64": 1e-5, "float32": 1e-5, "bfloat16": 0.05},
                      why="a quantity of order one or more (a norm, a cosine, a root): a few float32 ulps of itself; "
                          "also in float64 on the tiny models, whose seeded weights come from torch.randn, which "
                          "rounds in ATen's vectorised kernel (measured: 4e-6 relative). bfloat16: 8 significant "
                          "bits, a few of its ulps (measured 2 %)"),
        "near-zero": Rule("abs", {"float64": 1e-12, "float32": 5e-6, "bfloat16": 0.05},
                          why="a value near 0 computed from values of order one (min |h_i|): rounding moves it by "
                              "about their ulp, not by its own (measured float32: 1.7e-6)"),
        "divided-by-near-zero": Rule("factor", 8.0,
                                     why="a size that divides by the smallest |h_i| (||dm|| = ||dv / h||), which is "
                                         "itself at rounding level: promised to a factor 8 (measured 1.56 between two "
                                         "paths of one machine, 3.7 between an AVX-512 and an AVX2 machine)"),
        "chaotic": Rule("factor", 100.0,
                        why="rounding amplified without correction (the ideal and fixed schedules: dm ~ 1e6 times a "
                            "rounding difference, layer after layer; which coordinates carry the largest products is "
                            "decided by last bits): promised to two orders of magnitude (measured: a factor 26 "
                            "between an AVX-512 and an AVX2 machine, 7.4 between two paths of one machine)"),
        "timing": Rule("any", why="seconds depend on the machine and its load"),
    })


_init()

"""Regenerate, or check, data/reference/: the regression grid the claims ledger (notebook 06) stands on.

    .venv/bin/python scripts/reference_runs.py [--tokens 20] [--out data/reference] [--sets main sweep ...]
    .venv/bin/python scripts/reference_runs.py --check          # today's code still produces the committed numbers

The embedded Gemma 3 270M, 5 prompts x N tokens per configuration, one thread. One JSON per configuration (the
record of ``python -m ctxpatch_lite.compare --json`` per prompt, per-layer diagnostics dropped to keep files small,
with the full ``config`` the ledger selects readings by), ``appendix.json``
(Appendix D and E on seeded models), and summary.json / summary.md with token counts. These are findings, not
targets. Sets:

* ``main``: dtype x variant x apply x h_source, step by step (16)
* ``sweep``: start layer (a third, two thirds, second-to-last, last; relative to the depth) x dtype x variant x
  h_source (32); start 0 is ``main``
* ``controls``: schedules ideal / oracle / fixed and parts none / input-only / vanilla, per dtype (12)
* ``batched``: the batched teacher-forced path (factored) x dtype x variant x h_source (8)
* ``free``: free-running generation (the patched model picks its own token) x dtype x variant x h_source (8)
* ``appendix``: Appendix D's bound and Appendix E's telescoping (float64, seeded tiny models, seconds)
* ``image``: an image in the context (paper §4.3) on the tiny seeded ``Gemma3ForConditionalGeneration``
  (``fixtures.tiny_gemma3_vision``): one image and two images x float64/float32 x step/batched, 8 tokens, per-layer
  block errors kept, plus the unpatched control; the package's own pictures (``ctxpatch_lite/data/images``)

``--check`` recomputes a fixed subset (prompt 0, the first ``CHECK_TOKENS`` steps of each dtype x variant x
h_source, materialized, step by step) and compares it with the committed JSON: token ids exactly, L-infinity
and TVD within ``TOLERANCE`` (stated below); exit status 1, naming every difference, when anything moved.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from ctxpatch_lite import load_model
from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.claims import spec_of
from ctxpatch_lite.metrics import format_fraction
from ctxpatch_lite.protocol import run_protocol, summarize
from ctxpatch_lite.views import load_prompts

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16")
VARIANTS = ("naive", "stable")
H_SOURCES = ("actual", "recorded")
SWEEP = (("third", 1 / 3), ("two-thirds", 2 / 3), ("second-to-last", -2), ("last", "last"))
SETS = ("main", "sweep", "controls", "batched", "free", "appendix", "image")
IMAGE_CONTEXTS = {"1img": ("Look at this: <start_of_image> The sky on Mars is", ("mars_sunset",)),
                  "2img": ("<start_of_image> and <start_of_image>: which one is", ("mars_sunset", "robot"))}
IMAGE_TOKENS = 8
CHECK_TOKENS = 5
# |measured - committed| <= abs + rel * |committed|, per step. float32: rounding of a different but equally valid
# kernel choice stays far inside; bfloat16: one ulp of a logit of 16-32 is 0.125, so two ulps plus 5 %.
TOLERANCE = {"float32": {"linf": (1e-4, 1e-3), "tvd": (1e-6, 1e-2)},
             "bfloat16": {"linf": (0.25, 0.05), "tvd": (1e-3, 0.1)}}


def job(dtype, config: PatchConfig, *, batched=False, forcing="baseline", start_tag="first") -> dict:
    return {"dtype": dtype, "config": config, "batched": batched, "forcing": forcing, "start": start_tag}


def grid(sets=SETS):
    """Every configuration of the chosen sets, as jobs (dtype-major, so each model is loaded once)."""
    for dtype in DTYPES:
        if "main" in sets:
            for variant, apply, h in itertools.product(VARIANTS, ("materialized", "factored"), H_SOURCES):
                yield job(dtype, PatchConfig(variant=variant, apply=apply, h_source=h))
        if "sweep" in sets:   # Appendix C.4: lower layers context-free and unpatched, down to the last layer only
            for (tag, start), variant, h in itertools.product(SWEEP, VARIANTS, H_SOURCES):
                yield job(dtype, PatchConfig(variant=variant, start_layer=start, h_source=h, apply="materialized"),
                          start_tag=tag)
        if "controls" in sets:
            for schedule in ("ideal", "oracle", "fixed"):
                yield job(dtype, PatchConfig(schedule=schedule))
            for parts in ("none", "input-only", "vanilla"):
                yield job(dtype, PatchConfig(parts=parts))
        if "batched" in sets:
            for variant, h in itertools.product(VARIANTS, H_SOURCES):
                yield job(dtype, PatchConfig(variant=variant, h_source=h, apply="factored"), batched=True)
        if "free" in sets:
            for variant, h in itertools.product(VARIANTS, H_SOURCES):
                yield job(dtype, PatchConfig(variant=variant, h_source=h, apply="materialized"), forcing="patched")


def name_of(j: dict) -> str:
    c, dtype = j["config"], j["dtype"]
    if c.schedule != "selfcorrect" or c.parts != "full":
        return f"{dtype}-{c.label}"
    if j["start"] != "first":
        return f"{dtype}-{c.variant}-start-{j['start']}-{c.h_source}"
    if j["batched"]:
        return f"{dtype}-{c.variant}-batched-{c.h_source}"
    if j["forcing"] == "patched":
        return f"{dtype}-{c.variant}-free-{c.h_source}"
    return f"{dtype}-{c.variant}-{c.apply}-{c.h_source}"


def run_job(model, tok, j: dict, prompts: list, n_tokens: int, keep_per_layer=False) -> dict:
    t0 = time.time()
    runs = []
    for p in prompts:
        r = run_protocol(model, tok, p["text"], n_tokens, j["config"], progress=False, batched=j["batched"],
                         forcing=j["forcing"])
        r["prompt_id"] = p["id"]
        if not keep_per_layer:
            for s in r["steps"]:
                s["diagnostics"].pop("per_layer", None)
        runs.append(r)
    steps = [s for r in runs for s in r["steps"]]
    pooled = summarize(steps)
    return {"name": name_of(j), "n_tokens": pooled["n_tokens"],
            "token_match": pooled["token_match"], "linf": [s["linf"] for s in steps], "tvd": [s["tvd"] for s in steps],
            "summary": pooled, "per_prompt": {r["prompt_id"]: r["summary"] for r in runs}, "config": runs[0]["config"],
            "runs": runs, "seconds": round(time.time() - t0, 1)}


def appendix_record(seed: int = 0) -> dict:
    """Appendix D (a scale-free post-norm block cannot absorb a large dv) and E (increments with a fixed
    preconditioner telescope), with notebook 07's seeded settings, in float64."""
    from ctxpatch_lite.appendix import appendix_d, appendix_e_outer, appendix_e_stable
    from ctxpatch_lite.fixtures import tiny_model
    prompt = torch.randint(3, 128, (6,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    d = appendix_d(seed=seed)
    d.pop("history")
    e1 = appendix_e_outer(tiny_model("llama", seed=seed), prompt + [7], layer=1)
    e2 = appendix_e_stable(tiny_model("gemma3", seed=seed), prompt + [7], layer=0)
    return {"name": "appendix", "seed": seed, "dtype": "float64", "appendix_d": d, "appendix_e_outer": e1,
            "appendix_e_stable": e2, "config": {"dtype": "float64", "model": "seeded tiny models (fixtures)",
                                                "environment": _env()}}


def image_records(n_tokens: int = IMAGE_TOKENS):
    """The ``image`` set: (name, record) per configuration, on the tiny multimodal Gemma 3 (seconds in all)."""
    from ctxpatch_lite.fixtures import tiny_gemma3_vision, tiny_vision_processor
    from ctxpatch_lite.vision import packaged_image
    proc = tiny_vision_processor()
    jobs = [(dt, ctx, batched, "full") for dt in ("float64", "float32") for ctx in IMAGE_CONTEXTS
            for batched in (False, True)] + [("float32", "1img", False, "none")]
    models = {}
    for dtype, ctx, batched, parts in jobs:
        model = models.setdefault(dtype, tiny_gemma3_vision(seed=0, dtype=dtype))
        text, names = IMAGE_CONTEXTS[ctx]
        r = run_protocol(model, proc, text, n_tokens, PatchConfig(parts=parts), progress=False, batched=batched,
                         images=[packaged_image(n) for n in names])
        r["prompt_id"] = ctx
        name = f"image-{dtype}-{ctx}-" + ("batched" if batched else "step") + ("" if parts == "full" else f"-{parts}")
        yield name, {"name": name, "n_tokens": r["n_tokens"], "token_match": r["token_match"], "linf": r["linf"],
                     "tvd": r["tvd"], "summary": r["summary"], "per_prompt": {ctx: r["summary"]},
                     "config": r["config"], "runs": [r], "seconds": r["seconds"]}


def _env():
    from ctxpatch_lite.protocol import environment
    return environment()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "data" / "reference"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sets", nargs="*", default=list(SETS), choices=SETS)
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--check", action="store_true", help="recompute a fixed subset and compare with the JSON in --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.check:
        return check(out)
    out.mkdir(parents=True, exist_ok=True)
    if "appendix" in args.sets:
        (out / "appendix.json").write_text(json.dumps(appendix_record(), indent=1))
        print("appendix.json written", flush=True)
    if "image" in args.sets:
        for name, rec in image_records():
            (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
            print(f"{name:<40} {format_fraction(rec['summary']['n_match'], rec['n_tokens'])}  "
                  f"Linf max {rec['summary']['linf_max']:.2e}", flush=True)
    prompts = load_prompts()
    loaded = {}
    for j in grid(args.sets):
        if j["dtype"] not in args.dtypes:
            continue
        if j["dtype"] not in loaded:
            loaded.clear()
            loaded[j["dtype"]] = load_model(dtype=j["dtype"], device="cpu", progress=False)
        rec = run_job(*loaded[j["dtype"]], j, prompts, args.tokens)
        (out / f"{rec['name']}.json").write_text(json.dumps(rec, indent=1))
        s = rec["summary"]
        print(f"{rec['name']:<40} {format_fraction(s['n_match'], s['n_tokens']):<18} Linf med {s['linf_median']:.2e} "
              f"max {s['linf_max']:.2e}  TVD med {s['tvd_median']:.2e}  fallbacks {s['fallbacks_total']}  "
              f"hard {s['hard_cases_total']}  ({rec['seconds']} s)", flush=True)
    write_summary(out)
    print(f"wrote {out}")
    return 0


def check_jobs():
    for dtype, variant, h in itertools.product(DTYPES, VARIANTS, H_SOURCES):
        yield job(dtype, PatchConfig(variant=variant, h_source=h, apply="materialized"))


def within(measured: float, committed: float, tol: tuple) -> bool:
    a, r = tol
    return abs(measured - committed) <= a + r * abs(committed)


def compare_steps(name: str, dtype: str, got: list, ref: list) -> list[str]:
    """Differences between recomputed and committed steps (empty when they agree within ``TOLERANCE``)."""
    problems = []
    for g, r in zip(got, ref):
        for key in ("query_token", "baseline_token", "patched_token"):
            if g[key] != r[key]:
                problems.append(f"{name} step {g['step']}: {key} {g[key]} != committed {r[key]}")
        for key in ("linf", "tvd"):
            if not within(g[key], r[key], TOLERANCE[dtype][key]):
                problems.append(f"{name} step {g['step']}: {key} {g[key]:.6g} vs committed {r[key]:.6g} (tolerance "
                                f"{TOLERANCE[dtype][key][0]:g} + {TOLERANCE[dtype][key][1]:g} x committed)")
    if len(got) != len(ref):
        problems.append(f"{name}: {len(got)} steps recomputed, {len(ref)} committed")
    return problems


def check(out: Path) -> int:
    """Recompute prompt 0 x CHECK_TOKENS for each dtype x variant x h_source; compare with the committed runs."""
    prompt = load_prompts()[0]
    problems, n = [], 0
    loaded, worst = {}, {dt: {"linf": 0.0, "tvd": 0.0} for dt in DTYPES}
    torch.set_num_threads(1)   # the committed runs used one thread
    for j in check_jobs():
        name = name_of(j)
        path = out / f"{name}.json"
        if not path.is_file():
            problems.append(f"{name}: no committed run at {path}")
            continue
        committed = json.loads(path.read_text())
        ref_run = next(r for r in committed["runs"] if r["prompt_id"] == prompt["id"])
        if j["dtype"] not in loaded:
            loaded.clear()
            loaded[j["dtype"]] = load_model(dtype=j["dtype"], device="cpu", progress=False)
        model, tok = loaded[j["dtype"]]
        r = run_protocol(model, tok, prompt["text"], CHECK_TOKENS, j["config"], progress=False)
        found = compare_steps(name, j["dtype"], r["steps"], ref_run["steps"][:CHECK_TOKENS])
        for g, c in zip(r["steps"], ref_run["steps"]):
            for key in ("linf", "tvd"):
                worst[j["dtype"]][key] = max(worst[j["dtype"]][key], abs(g[key] - c[key]))
        n += len(r["steps"])
        problems += found
        print(f"{name:<40} {'ok' if not found else f'{len(found)} difference(s)'}", flush=True)
    n_image = 0
    for name, rec in image_records():              # the image set: cheap, so every configuration in full
        n_image += 1
        path = out / f"{name}.json"
        if not path.is_file():
            problems.append(f"{name}: no committed run at {path}")
            continue
        ref = json.loads(path.read_text())["runs"][0]["steps"]
        found = compare_steps(name, "float32", rec["runs"][0]["steps"], ref)
        n += len(ref)
        problems += found
        print(f"{name:<40} {'ok' if not found else f'{len(found)} difference(s)'}", flush=True)
    if problems:
        print("\n".join(["data/reference no longer matches today's code:"] + problems))
        return 1
    print(f"check passed: {n} steps of {len(list(check_jobs())) + n_image} configurations match the committed runs "
          f"(token ids exactly; L-inf/TVD within abs + rel x committed: {TOLERANCE}); largest differences "
          + ", ".join(f"{dt} L-inf {w['linf']:.2g}, TVD {w['tvd']:.2g}" for dt, w in worst.items()))
    return 0


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def write_summary(out: Path):
    """summary.json / summary.md over every configuration file in ``out`` (token counts included)."""
    rows = []
    for f in sorted(out.glob("*.json")):
        if f.name in ("summary.json", "appendix.json"):
            continue
        rec = json.loads(f.read_text())
        c = rec["config"]
        steps = [s for r in rec["runs"] for s in r["steps"]]
        norms = {k: median([s["diagnostics"].get(k, 0.0) for s in steps]) for k in ("matrix_norm", "dm_norm",
                                                                                   "dm_max_abs")}
        rows.append({"name": rec["name"], **spec_of(c),
                     **{k: c[k] for k in ("start_layer", "patch_dtype")}, **rec["summary"],
                     **{f"median_{k}": v for k, v in norms.items()}, "seconds": rec["seconds"]})
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    lines = ["| configuration | token match (count) | median L∞ | max L∞ | median TVD | max TVD | fallbacks | hard cases |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {format_fraction(r['n_match'], r['n_tokens'])} | {r['linf_median']:.2e} | "
                     f"{r['linf_max']:.2e} | {r['tvd_median']:.2e} | {r['tvd_max']:.2e} | {r['fallbacks_total']} | "
                     f"{r['hard_cases_total']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

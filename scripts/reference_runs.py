"""Regenerate data/reference/: the engine's regression grid on the embedded model (5 prompts x N tokens).

    .venv/bin/python scripts/reference_runs.py [--tokens 20] [--out data/reference] [--threads 1]

One JSON per configuration (the same record as `python -m ctxpatch_lite.compare --json`, per-layer diagnostics
dropped to keep files small) plus summary.json / summary.md with token counts. These are findings, not targets.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from ctxpatch_lite import load_model
from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.metrics import format_fraction
from ctxpatch_lite.protocol import run_protocol, summarize
from ctxpatch_lite.views import load_prompts

ROOT = Path(__file__).resolve().parent.parent


def grid(sets=("main", "sweep")):
    if "sweep" in sets:  # Appendix C.4: start-layer sweep, relative to the model's depth, down to the last layer only
        for dtype in ("float32", "bfloat16"):
            for variant in ("naive", "stable"):
                for _, start in SWEEP:
                    yield dtype, PatchConfig(variant=variant, start_layer=start, apply="materialized")
    if "main" not in sets:
        return
    for dtype, variant, apply, h_source in itertools.product(("float32", "bfloat16"), ("naive", "stable"),
                                                              ("materialized", "factored"), ("actual", "recorded")):
        yield dtype, PatchConfig(variant=variant, apply=apply, h_source=h_source)
    for dtype in ("float32", "bfloat16"):
        for schedule in ("ideal", "oracle", "fixed"):
            yield dtype, PatchConfig(schedule=schedule)
        for parts in ("none", "input-only", "vanilla"):
            yield dtype, PatchConfig(parts=parts)


SWEEP = (("third", 1 / 3), ("two-thirds", 2 / 3), ("second-to-last", -2), ("last", "last"))


def name_of(dtype, c: PatchConfig) -> str:
    if c.schedule != "selfcorrect" or c.parts != "full":
        return f"{dtype}-{c.label}"
    if c.start_layer:
        tag = next(t for t, spec in SWEEP if spec == c.start_layer)
        return f"{dtype}-{c.variant}-start-{tag}"
    return f"{dtype}-{c.variant}-{c.apply}-{c.h_source}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "data" / "reference"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sets", nargs="*", default=["main", "sweep"], help="main (the engine grid) and/or sweep")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {}
    for dtype, cfg in grid(args.sets):
        if dtype not in models:
            models.clear()
            models[dtype] = load_model(dtype=dtype, device="cpu", progress=False)
        model, tok = models[dtype]
        t0 = time.time()
        runs = []
        for p in prompts:
            r = run_protocol(model, tok, p["text"], args.tokens, cfg, progress=False)
            r["prompt_id"] = p["id"]
            for s in r["steps"]:
                s["diagnostics"].pop("per_layer", None)
            runs.append(r)
        steps = [s for r in runs for s in r["steps"]]
        pooled = summarize(steps)
        name = name_of(dtype, cfg)
        rec = {"name": name, "n_tokens": pooled["n_tokens"], "token_match": pooled["token_match"],
               "linf": [s["linf"] for s in steps], "tvd": [s["tvd"] for s in steps], "summary": pooled,
               "per_prompt": {r["prompt_id"]: r["summary"] for r in runs}, "config": runs[0]["config"],
               "runs": runs, "seconds": round(time.time() - t0, 1)}
        (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
        print(f"{name:<40} {format_fraction(pooled['n_match'], pooled['n_tokens']):<18} "
              f"Linf med {pooled['linf_median']:.2e} max {pooled['linf_max']:.2e}  TVD med {pooled['tvd_median']:.2e} "
              f"max {pooled['tvd_max']:.2e}  fallbacks {pooled['fallbacks_total']}  hard {pooled['hard_cases_total']}  "
              f"({rec['seconds']} s)", flush=True)
    write_summary(out)
    print(f"wrote {out}")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def write_summary(out: Path):
    """summary.json / summary.md over every configuration file in ``out`` (token counts included)."""
    rows = []
    for f in sorted(out.glob("*.json")):
        if f.name == "summary.json":
            continue
        rec = json.loads(f.read_text())
        c = rec["config"]
        steps = [s for r in rec["runs"] for s in r["steps"]]
        norms = {k: median([s["diagnostics"].get(k, 0.0) for s in steps]) for k in ("matrix_norm", "dm_norm",
                                                                                   "dm_max_abs")}
        rows.append({"name": rec["name"], "dtype": c["dtype"], **{k: c[k] for k in ("variant", "start_layer",
                     "h_source", "apply", "schedule", "parts", "patch_dtype")}, **rec["summary"],
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
    main()

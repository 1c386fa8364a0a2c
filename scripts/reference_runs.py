"""Regenerate, or check, data/reference/: the regression grid the claims ledger (notebook 06) stands on.

    .venv/bin/python scripts/reference_runs.py [--workers 2] [--sets main sweep ...] [--dtypes float32]
    .venv/bin/python scripts/reference_runs.py --from runs/sweep-paper-reference   # export a finished sweep
    .venv/bin/python scripts/reference_runs.py --check          # today's code still produces the committed numbers

The paper's protocol on the embedded Gemma 3 270M is the grid ``data/grids/paper.yaml`` (76 compare jobs, 5 prompts
x 20 tokens each), run by the sweep (``python -m ctxpatch_lite.sweep``, local executor, ``--workers`` processes of
``cores / workers`` threads each; the committed files were made with 2 workers x 1 thread) into ``--sweep-out``
(a rerun resumes there), then exported: one JSON per job named as the job (the record of ``ctxpatch-compare
--json`` with every prompt under ``runs``, per-layer diagnostics dropped, plus ``name``, ``per_prompt`` and
``seconds``), with the full ``config`` the ledger selects readings by. Besides the grid, two sets are not runs of
the compare CLI and are written here: ``appendix.json`` (Appendix D's bound and E's telescoping, float64, seeded tiny
models, seconds) and ``image``: an image in the context (paper §4.3) on the tiny seeded
``Gemma3ForConditionalGeneration`` (``fixtures.tiny_gemma3_vision``): one image and two images x float64/float32 x
step/batched, 8 tokens, per-layer block errors kept, plus the unpatched control; the package's own pictures. Then
summary.json / summary.md with token counts. These are findings, not targets. ``--sets`` picks groups of the grid
(``main``, ``sweep``, ``controls`` = its groups ``schedules`` and ``parts``, ``batched``, ``free``) and the two
extra sets.

``--check`` recomputes a fixed subset (prompt 0, the first ``CHECK_TOKENS`` steps of each dtype x variant x
h_source of the grid's ``main`` group, materialized, through the sweep's own job runner) and compares it with the
committed JSON under the rules of ``ctxpatch_lite.arithmetic`` (the sweep report's too): token ids exactly where
the arithmetic promises them, ties flagged apart, each run's median and max L-infinity and TVD within the band of
its noise class; exit status 1, naming every difference, when anything moved. ``make test`` runs it on this
machine's arithmetic path and once more under ``arithmetic.SECOND_PATH``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.claims import spec_of
from ctxpatch_lite.metrics import format_fraction
from ctxpatch_lite.protocol import run_protocol
from ctxpatch_lite.sweep import job_records, load_grid, run_job, run_sweep
from ctxpatch_lite.views import load_prompts

ROOT = Path(__file__).resolve().parent.parent
GRID = ROOT / "data" / "grids" / "paper.yaml"
DTYPES = ("float32", "bfloat16")
GROUPS = {"main": ("main",), "sweep": ("sweep",), "controls": ("schedules", "parts"), "batched": ("batched",),
          "free": ("free",)}
SETS = tuple(GROUPS) + ("appendix", "image")
IMAGE_CONTEXTS = {"1img": ("Look at this: <start_of_image> The sky on Mars is", ("mars_sunset",)),
                  "2img": ("<start_of_image> and <start_of_image>: which one is", ("mars_sunset", "robot"))}
IMAGE_TOKENS = 8
CHECK_TOKENS = 5


def reference_record(job: dict, status: dict, rec: dict) -> dict:
    """A sweep job's compare record as a data/reference file (the pooled ``steps`` copy dropped: ``runs`` has them)."""
    runs = rec.get("runs") or [rec]
    return {"name": job["name"], "n_tokens": rec["n_tokens"], "token_match": rec["token_match"], "linf": rec["linf"],
            "tvd": rec["tvd"], "summary": rec["summary"], "per_prompt": {r["prompt_id"]: r["summary"] for r in runs},
            "config": rec["config"], "runs": runs, "seconds": status["seconds"]}


def export(sweep_dir: Path, out: Path) -> list[str]:
    """Write every finished job of a sweep of the paper grid into ``out``; returns the jobs that did not finish."""
    missing = []
    for r in job_records(sweep_dir):
        if r["status"]["status"] != "ok":
            missing.append(f"{r['job']['name']}: {r['status']['status']} {r['status'].get('error') or ''}".strip())
            continue
        rec = reference_record(r["job"], r["status"], r["result"])
        (out / f"{rec['name']}.json").write_text(json.dumps(rec, indent=1))
        s = rec["summary"]
        print(f"{rec['name']:<40} {format_fraction(s['n_match'], s['n_tokens']):<18} Linf med {s['linf_median']:.2e} "
              f"max {s['linf_max']:.2e}  TVD med {s['tvd_median']:.2e}  fallbacks {s['fallbacks_total']}  "
              f"hard {s['hard_cases_total']}  ({rec['seconds']} s)", flush=True)
    return missing


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
    ap.add_argument("--out", default=str(ROOT / "data" / "reference"))
    ap.add_argument("--workers", type=int, default=2, help="sweep processes (threads each: cores / workers)")
    ap.add_argument("--sweep-out", default=str(ROOT / "runs" / "sweep-paper-reference"),
                    help="the sweep's folder (a rerun resumes there)")
    ap.add_argument("--from", dest="from_sweep", default=None, help="export this finished sweep; run nothing")
    ap.add_argument("--sets", nargs="*", default=list(SETS), choices=SETS)
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--check", action="store_true", help="recompute a fixed subset and compare with the JSON in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.check:
        return check(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.from_sweep:                  # export only
        args.sets = []
    if "appendix" in args.sets:
        (out / "appendix.json").write_text(json.dumps(appendix_record(), indent=1))
        print("appendix.json written", flush=True)
    if "image" in args.sets:
        for name, rec in image_records():
            (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
            print(f"{name:<40} {format_fraction(rec['summary']['n_match'], rec['n_tokens'])}  "
                  f"Linf max {rec['summary']['linf_max']:.2e}", flush=True)
    sweep_dir = Path(args.from_sweep or args.sweep_out)
    if not args.from_sweep:
        groups = {g for s_ in args.sets for g in GROUPS.get(s_, ())}
        grid = load_grid(GRID)
        grid["jobs"] = [j for j in grid["jobs"] if j.group in groups and j.dtype in args.dtypes]
        if grid["jobs"]:
            t0 = time.time()
            res = run_sweep(grid, sweep_dir, workers=args.workers)
            print(f"sweep: {res['ran']} jobs ran, {res['skipped']} had finished, {len(res['failed'])} failed; "
                  f"{time.time() - t0:.0f} s wall with {args.workers} worker(s)", flush=True)
    missing = export(sweep_dir, out) if (sweep_dir / "sweep.json").is_file() else []
    write_summary(out)
    print(f"wrote {out}")
    if missing:
        print("\n".join(["jobs that did not finish (rerun the same command to resume):"] + missing), file=sys.stderr)
        return 1
    return 0


def check_jobs():
    """The grid's ``main`` group, materialized: each dtype x variant x h_source once."""
    return [j for j in load_grid(GRID)["jobs"] if j.group == "main" and j.params["apply"] == "materialized"]


def check(out: Path) -> int:
    """Recompute prompt 0 x CHECK_TOKENS for each dtype x variant x h_source, and the image set in full; judge each
    against the committed run by ``arithmetic.compare_runs`` (tokens where the arithmetic promises them, ties
    flagged; each run's median and max L-inf/TVD within its noise class's band)."""
    from ctxpatch_lite.arithmetic import arithmetic_path, compare_runs, noise_class
    prompt = load_prompts()[0]
    problems, ties, n = [], [], 0
    worst = {}
    jobs = check_jobs()

    def judge(name, new_run, ref_run, config):
        nonlocal n
        cmp = compare_runs([new_run], [ref_run], config, name)
        w = worst.setdefault(noise_class(config), {})
        for key, d in cmp.worst.items():
            for agg, v in d.items():
                w[f"{key}_{agg}"] = max(w.get(f"{key}_{agg}", 0.0), v)
        n += cmp.compared
        problems.extend(cmp.problems)
        ties.extend(cmp.ties)
        print(f"{name:<40} {'ok' if cmp.ok else f'{len(cmp.problems)} difference(s)'}"
              + (f", {len(cmp.ties)} tie(s) flagged" if cmp.ties else ""), flush=True)

    for j in jobs:
        name = j.name
        path = out / f"{name}.json"
        if not path.is_file():
            problems.append(f"{name}: no committed run at {path}")
            continue
        committed = json.loads(path.read_text())
        ref_run = next(r for r in committed["runs"] if r["prompt_id"] == prompt["id"])
        small = {**j.to_dict(), "params": {**j.params, "tokens": CHECK_TOKENS, "paper_prompt": prompt["id"]}}
        outcome = run_job(small, str(out / "no-such-sweep"), threads=1)   # the committed runs used one thread
        if outcome["status"]["status"] != "ok":
            problems.append(f"{name}: {outcome['status']['error']}")
            continue
        judge(name, {"prompt_id": prompt["id"], "steps": outcome["result"]["steps"]},
              {"prompt_id": prompt["id"], "steps": ref_run["steps"][:CHECK_TOKENS]}, committed["config"])
    n_image = 0
    for name, rec in image_records():              # the image set: cheap, so every configuration in full
        n_image += 1
        path = out / f"{name}.json"
        if not path.is_file():
            problems.append(f"{name}: no committed run at {path}")
            continue
        committed = json.loads(path.read_text())
        judge(name, rec["runs"][0], committed["runs"][0], committed["config"])
    path = arithmetic_path()
    where = f"on {path['cpu_capability']}" + (f" with {path['variables']}" if path["variables"] else "")
    if ties:
        print("\n".join(["ties flagged (the arithmetic does not promise these; not failures):"] + ties))
    if problems:
        print("\n".join([f"data/reference no longer matches today's code ({where}):"] + problems))
        return 1
    print(f"check passed {where}: {n} steps of {len(jobs) + n_image} configurations match the committed runs "
          f"(arithmetic.compare_runs); {len(ties)} tie(s) flagged; largest differences per noise class: "
          + json.dumps({k: {m: float(f"{v:.3g}") for m, v in w.items()} for k, w in worst.items()}))
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

"""A GPU rehearsal of data/grids/gemma-3-1b-gpu.yaml where google/gemma-3-1b-it cannot be downloaded: the grid's
compare jobs (those whose name contains ``--only``) on a random-weight model of Gemma-3-1B's shape
(``fixtures.gemma3_1b_shaped(tokenizer="char")``: bfloat16 weights, a character tokenizer, so the prompts are one
token per character), through the sweep's local executor (one GPU per job), then the sweep report. Random weights:
the timings and the machinery are what this measures, not the paper's numbers.

    python scripts/gpu_sweep.py [--only 1b-bfloat16-naive] [--out runs/gpu-sweep-<stamp>] [--workers 1]

Writes OUT/grid.yaml (the grid as run), OUT/sweep/ (the sweep folder, report.md included) and OUT/gpu_sweep.json
(per-job seconds and ms per generated token, the GPU, versions, wall time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="1b-bfloat16-naive", help="jobs whose name contains this text")
    ap.add_argument("--out", default=f"runs/gpu-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    import transformers

    from ctxpatch_lite.fixtures import gemma3_1b_shaped
    from ctxpatch_lite.sweep import load_grid, run_sweep
    from ctxpatch_lite.sweep_report import build

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    folder = gemma3_1b_shaped(tokenizer="char")
    built = time.time() - t0
    print(f"rehearsal model at {folder} ({built:.0f} s)", flush=True)
    grid = yaml.safe_load((ROOT / "data" / "grids" / "gemma-3-1b-gpu.yaml").read_text())
    grid["name"] = "gemma-3-1b-shaped-gpu-rehearsal"
    grid["defaults"]["compare"]["model"] = str(folder)
    grid["jobs"] = [g for g in grid["jobs"] if g["kind"] == "compare"]   # notebooks: papermill may be absent here
    (out / "grid.yaml").write_text(yaml.safe_dump(grid, sort_keys=False))
    loaded = load_grid(out / "grid.yaml", notebooks=ROOT / "notebooks")
    res = run_sweep(loaded, out / "sweep", workers=args.workers, only=args.only, progress=False)
    rep = build(out / "sweep", figures=False)
    (out / "sweep" / "report.md").write_text(rep["markdown"])
    print(rep["markdown"], flush=True)
    jobs = []
    for r in rep["rows"]["compare"]:
        if r["status"] == "not run":
            continue
        jobs.append({k: r.get(k) for k in ("name", "status", "seconds", "n_tokens", "n_match", "linf_median",
                                           "linf_max", "error")})
        if r.get("n_tokens"):
            jobs[-1]["ms_per_token_incl_load"] = round(1000 * r["seconds"] / r["n_tokens"], 1)
    record = {"what": "the compare jobs of data/grids/gemma-3-1b-gpu.yaml whose name contains " + repr(args.only)
              + " on a random-weight Gemma-3-1B-shaped model (char tokenizer), local executor",
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "transformers": transformers.__version__, "workers": args.workers,
              "model_build_s": round(built, 1), "sweep_wall_s": res["seconds"], "ran": res["ran"],
              "failed": len(res["failed"]), "jobs": jobs}
    (out / "gpu_sweep.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "jobs"}, indent=1))
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""Execute the notebook series headless with papermill and collect one metrics JSON per notebook.

    python -m ctxpatch_lite.run_notebooks [--notebooks notebooks] [--out runs] [-p name value ...]
                                          [--model NAME] [--only 00 03] [--compare runs/<old>/summary.json]

Writes ``runs/<stamp>/<notebook>.ipynb`` (executed), ``<notebook>.metrics.json``, PNG figures under
``<notebook>_figures/`` and ``summary.json``; prints a table; exits 1 naming the failing notebook and cell.
``--compare`` checks every numeric metric against a previous run's summary within ``--rtol``/``--atol``.

Each notebook's peak memory is the kernel process's own peak resident set size (``VmHWM``, written by the
kernel when it exits; GB = 10^9 bytes), in ``summary.json`` (``peak_rss_gb``) and the table; ``--max-rss-gb X``
fails the run naming every notebook that went over (Binder gives a visitor about 2 GB, the server included).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path


def _parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, bool):
            out[key] = float(v)
    return out


def compare_metrics(new: dict, old: dict, rtol: float, atol: float, label: str = "previous") -> list[str]:
    """Differences between two summaries' numeric metrics beyond tolerance: a metric missing, moved by more than
    ``atol + rtol * |old|``, or finite on one side and NaN on the other (NaN equals NaN). ``label`` names the old
    run in the messages."""
    problems = []
    for nb, old_m in old.items():
        if nb not in new:
            problems.append(f"{nb}: missing in this run")
            continue
        a, b = _flatten(new[nb].get("metrics")), _flatten(old_m.get("metrics"))
        for k, ref in b.items():
            if k not in a:
                problems.append(f"{nb}: metric {k} missing")
            elif math.isnan(a[k]) != math.isnan(ref) or (
                    not math.isnan(ref) and abs(a[k] - ref) > atol + rtol * abs(ref)):
                problems.append(f"{nb}: {k} = {a[k]:.6g}, {label} {ref:.6g}")
    return problems


def _read_rss(path: Path):
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _failing_cell(nb_path: Path) -> str:
    import nbformat
    try:
        nb = nbformat.read(nb_path, as_version=4)
    except Exception:  # noqa: BLE001
        return "?"
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {i} ({out.get('ename')}: {out.get('evalue')})"
    return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxpatch_lite.run_notebooks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--notebooks", default="notebooks")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--only", nargs="*", default=None, help="notebook name prefixes, e.g. 00 03")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="papermill parameter override for every notebook (VALUE parsed as JSON if it can be)")
    ap.add_argument("--model", default=None, help="model for every notebook (hub id or folder; default embedded)")
    ap.add_argument("--threads", default="auto", help="torch threads in the kernels: auto (1 on <=2 cores, else "
                                                      "torch's default) or a number")
    ap.add_argument("--compare", default=None, help="a previous run's summary.json to compare metrics against")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    ap.add_argument("--max-rss-gb", type=float, default=None, help="fail if a notebook's kernel peaks above this "
                                                                    "resident memory (GB = 1e9 bytes), e.g. 1.9")
    args = ap.parse_args(argv)

    from ._optional import require
    pm = require("papermill", "notebooks", "running the notebook series")

    nb_dir = Path(args.notebooks)
    notebooks = sorted(p for p in nb_dir.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [p for p in notebooks if any(p.name.startswith(o) for o in args.only)]
    if not notebooks:
        print(f"error: no notebooks (NN_name.ipynb) found in {nb_dir.resolve()}; run from a clone of the repository "
              f"or pass --notebooks DIR (the notebooks are not part of the installed package)", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.threads == "auto":
        if (os.cpu_count() or 1) <= 2:
            os.environ["CTXPATCH_THREADS"] = "1"
    else:
        os.environ["CTXPATCH_THREADS"] = str(int(args.threads))
    params = {k: _parse_value(v) for k, v in args.parameter}
    if args.model:
        params["model_name"] = args.model
    summary, failed = {}, None
    t_all = time.time()
    for nb in notebooks:
        stem = nb.stem
        target = out_dir / nb.name
        nb_params = dict(params, metrics_out=str((out_dir / f"{stem}.metrics.json").resolve()),
                         figures_dir=str((out_dir / f"{stem}_figures").resolve()))
        t0 = time.time()
        rss_file = out_dir / f"{stem}.peak_rss"
        os.environ["CTXPATCH_RSS_OUT"] = str(rss_file.resolve())
        print(f"[run_notebooks] {nb.name} ...", flush=True)
        try:
            pm.execute_notebook(str(nb), str(target), parameters=nb_params, kernel_name="python3",
                                progress_bar=False, cwd=str(nb_dir), execution_timeout=args.timeout)
        except Exception as exc:  # noqa: BLE001 - papermill raises PapermillExecutionError and friends
            failed = (nb.name, _failing_cell(target), type(exc).__name__)
            summary[stem] = {"status": "failed", "seconds": round(time.time() - t0, 1),
                             "peak_rss_gb": _read_rss(rss_file)}
            break
        mpath = out_dir / f"{stem}.metrics.json"
        metrics = json.loads(mpath.read_text()) if mpath.is_file() else {}
        summary[stem] = {"status": "ok", "seconds": round(time.time() - t0, 1), "peak_rss_gb": _read_rss(rss_file),
                         "metrics": metrics}
    os.environ.pop("CTXPATCH_RSS_OUT", None)
    total = round(time.time() - t_all, 1)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{'notebook':<28}{'status':<9}{'seconds':>8}{'peak RSS GB':>13}  metrics")
    for stem, s in summary.items():
        flat = _flatten(s.get("metrics"))
        shown = ", ".join(f"{k}={v:.4g}" for k, v in list(flat.items())[:3])
        rss = "?" if s.get("peak_rss_gb") is None else f"{s['peak_rss_gb']:.2f}"
        print(f"{stem:<28}{s['status']:<9}{s['seconds']:>8}{rss:>13}  {shown}")
    print(f"total {total} s; executed notebooks, metrics and figures in {out_dir}")
    if failed:
        print(f"error: notebook {failed[0]} failed at {failed[1]} ({failed[2]}); see {out_dir / failed[0]}",
              file=sys.stderr)
        return 1
    if args.max_rss_gb is not None:
        over = [f"{stem} peaked at {s['peak_rss_gb']:.2f} GB" if s.get("peak_rss_gb") is not None
                else f"{stem}: peak memory not reported" for stem, s in summary.items()
                if s.get("peak_rss_gb") is None or s["peak_rss_gb"] > args.max_rss_gb]
        if over:
            print(f"error: over the {args.max_rss_gb} GB memory limit: " + "; ".join(over), file=sys.stderr)
            return 1
        print(f"every notebook's peak RSS is under {args.max_rss_gb} GB")
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        problems = compare_metrics(summary, old, args.rtol, args.atol)
        for p in problems:
            print(f"regression: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"metrics agree with {args.compare} (rtol {args.rtol}, atol {args.atol})")
    return 0


def cli() -> None:
    """Console-script entry point (``pyproject.toml`` [project.scripts])."""
    from ._optional import run_cli
    run_cli(main)


if __name__ == "__main__":
    cli()

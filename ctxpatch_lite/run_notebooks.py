"""Execute the notebook series headless with papermill and collect one metrics JSON per notebook.

    python -m ctxpatch_lite.run_notebooks [--notebooks notebooks] [--out runs] [-p name value ...]
                                          [--model NAME] [--only 00 03] [--compare runs/<old>/summary.json]

Writes ``runs/<stamp>/<notebook>.ipynb`` (executed), ``<notebook>.metrics.json``, PNG figures under
``<notebook>_figures/`` and ``summary.json``; prints a table; exits 1 naming the failing notebook and cell.
``--compare`` checks every metric against a previous run's summary, and ``--check`` against the expected metrics
(``notebooks/expected_metrics.json``), each metric under its stated rule (``ctxpatch_lite.arithmetic``); ``--store``
writes this run's outputs into the notebooks themselves (what nbval compares), makes its metrics the expected ones
and its seconds the measured times (``notebooks/times.json``): outputs, metrics and times from one execution.

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


EXPECTED = "expected_metrics.json"   # beside the notebooks: expected values and the rule of every metric
TIMES = "times.json"                  # beside the notebooks: measured seconds per notebook (their headers quote them)


def _numbers(metrics) -> dict:
    """The numeric metrics, flat (for the summary table)."""
    from .arithmetic import flatten
    return {k: v for k, v in flatten(metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def load_expected(nb_dir) -> dict:
    """``notebooks/expected_metrics.json``: ``{"notebooks": {stem: {"rules": {...}, "values": {...}}}, ...}``."""
    path = Path(nb_dir) / EXPECTED
    return json.loads(path.read_text()) if path.is_file() else {"notebooks": {}}


def check_metrics(stem: str, metrics: dict, expected: dict, label: str = "expected") -> list[str]:
    """How one notebook's metrics differ from the expected ones under the notebook's rules
    (``arithmetic.compare_metrics``); a notebook with no expected values is one problem."""
    from .arithmetic import compare_metrics
    entry = expected.get("notebooks", {}).get(stem)
    if entry is None:
        return [f"no expected metrics for {stem} in {EXPECTED}: run `make run ARGS=--store` and write its rules"]
    return compare_metrics(metrics, entry.get("values", {}), entry.get("rules", {}), label=label)


def compare_metrics(new: dict, old: dict, rules_from: dict, label: str = "previous") -> list[str]:
    """Differences between two summaries' metrics (``{stem: {"metrics": ...}}``), each notebook's metrics judged
    under its own rules from ``rules_from`` (the expected-metrics file)."""
    problems = []
    for nb, old_m in old.items():
        if nb not in new:
            problems.append(f"{nb}: missing in this run")
            continue
        rules = rules_from.get("notebooks", {}).get(nb, {}).get("rules", {})
        from .arithmetic import compare_metrics as compare
        problems += [f"{nb}: {p}" for p in compare(new[nb].get("metrics") or {}, old_m.get("metrics") or {}, rules,
                                                   label=label)]
    return problems


def stored_outputs(executed: Path, original: Path) -> None:
    """Write the outputs of a papermill execution back into the notebook itself, as if executed in place: the
    injected-parameters cell and papermill's metadata are dropped (the parameters the runner injects, metrics_out
    and figures_dir, print nothing) and the cells numbered 1, 2, ... as one clean run."""
    import nbformat
    nb = nbformat.read(executed, as_version=4)
    nb.cells = [c for c in nb.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    count = 0
    for c in nb.cells:
        c.metadata.pop("papermill", None)
        c.metadata.pop("execution", None)
        if "tags" in c.metadata and not c.metadata["tags"]:
            del c.metadata["tags"]
        if c.cell_type == "code":              # numbered as one run of these cells (the injected one is gone)
            count += 1
            c.execution_count = count
            for out in c.get("outputs", []):
                if "execution_count" in out:
                    out["execution_count"] = count
    nb.metadata.pop("papermill", None)
    nbformat.write(nb, original)


# the series: NN_name.ipynb, and NNb_name.ipynb for an optional companion of lesson NN (run right after it)
NOTEBOOK_GLOB = "[0-9][0-9]*_*.ipynb"
TIME_ROW = "| **Time** |"


def said_time(seconds: float) -> str:
    """How a header says a measured time: "about 12 s", or "about 1.6 min" from 90 s up."""
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.1f} min"


def write_times(nb_dir: Path, seconds: dict) -> None:
    """Put measured times into the notebooks' prose: each header's Time row, and the course map (a markdown cell
    tagged ``course-map``, one table row per lesson linking its notebook, the time in the last column)."""
    import re

    import nbformat
    for path in sorted(Path(nb_dir).glob(NOTEBOOK_GLOB)):
        nb, changed = nbformat.read(path, as_version=4), False
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            src = cell.source
            if path.stem in seconds and TIME_ROW in src:
                src = re.sub(r"(?m)^\| \*\*Time\*\* \|.*$", f"{TIME_ROW} {said_time(seconds[path.stem])} to execute on 2 "
                             f"CPU cores (measured with `make run`), plus reading |", src)
            if "course-map" in cell.metadata.get("tags", []):
                def row(m):
                    stem = m.group(2)
                    return m.group(1) + (said_time(seconds[stem]) if stem in seconds else m.group(3)) + " |"
                src = re.sub(r"(?m)^(\| \[[^\]]*\]\((\d\d[a-z]?_\w+)\.ipynb\).*\| )([^|]*) \|$", row, src)
            if src != cell.source:
                cell.source, changed = src, True
        if changed:
            nbformat.write(nb, path)


def store(summary: dict, nb_dir: Path, out_dir: Path) -> list[str]:
    """Write this run's metrics into ``expected_metrics.json`` (the rules kept as written) and its seconds into
    ``times.json``; returns the problems that stop it (a failed notebook, a float metric without a rule)."""
    from .arithmetic import arithmetic_path, flatten, rule_for
    failed = [stem for stem, s in summary.items() if s["status"] != "ok"]
    if failed:
        return [f"{stem} failed: nothing stored" for stem in failed]
    expected = load_expected(nb_dir)
    problems = []
    for stem, s in summary.items():
        entry = expected["notebooks"].setdefault(stem, {"rules": {}, "values": {}})
        values = flatten(s.get("metrics") or {})
        problems += [f"{stem}: metric {k} = {v!r} has no rule in {EXPECTED}" for k, v in values.items()
                     if rule_for(k, v, entry["rules"]) is None]
        entry["values"] = values
    if problems:
        return problems
    for stem in summary:     # the stored outputs and the expected metrics come from this one execution
        stored_outputs(out_dir / f"{stem}.ipynb", nb_dir / f"{stem}.ipynb")
    stamp = time.strftime("%Y-%m-%d")
    provenance = {"command": "make run ARGS=--store", "date": stamp, "run": str(out_dir),
                  "arithmetic_path": arithmetic_path()}
    for stem in summary:     # each notebook names the run it was stored from (a store with --only keeps the others')
        expected["notebooks"][stem]["stored"] = provenance
    expected.pop("stored", None)
    expected["about"] = ("Expected notebook metrics: per notebook, the values of the run that stored it (`make run "
                         "ARGS=--store`, named in its 'stored') and the rule each metric is compared under (written by "
                         "hand; named rules are ctxpatch_lite.arithmetic.RULES). nbval compares the words of the stored "
                         "outputs; the tests compare every run's metrics with these (notebooks/conftest.py).")
    (nb_dir / EXPECTED).write_text(json.dumps(expected, indent=1, sort_keys=False) + "\n")
    times = json.loads((nb_dir / TIMES).read_text()) if (nb_dir / TIMES).is_file() else {"seconds": {}}
    times["seconds"].update({stem: s["seconds"] for stem, s in summary.items()})
    times.setdefault("runs", {}).update({stem: f"{out_dir.name}/summary.json" for stem in summary})   # which run timed it
    times.setdefault("threads", {}).update({stem: os.environ.get("CTXPATCH_THREADS", "default") for stem in summary})
    times["measured"] = (f"make run (ctxpatch_lite.run_notebooks, default parameters, one kernel at a time, with the "
                         f"torch threads named in 'threads', {os.cpu_count()} CPU cores): seconds per notebook, each "
                         f"from the run named in 'runs' (the last run that stored it; this one {stamp}); "
                         f"{sum(times['seconds'].values()):.0f} s for all {len(times['seconds'])}")
    (nb_dir / TIMES).write_text(json.dumps(times, indent=1) + "\n")
    write_times(nb_dir, times["seconds"])
    return []


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
    ap.add_argument("--threads", default="auto", help="torch threads in each kernel (the notebooks run one at a "
                                                      "time): auto ($CTXPATCH_THREADS if set, else every core) or a "
                                                      "number")
    ap.add_argument("--compare", default=None, help="a previous run's summary.json to compare metrics against, each "
                                                    "metric under its rule (expected_metrics.json)")
    ap.add_argument("--check", action="store_true", help="compare every notebook's metrics with the expected ones "
                                                         "(expected_metrics.json beside the notebooks) under their rules")
    ap.add_argument("--store", action="store_true", help="write this run's outputs into the notebooks, its metrics "
                                                         "as the expected ones and its seconds into times.json "
                                                         "(default parameters; with --only, just those notebooks)")
    ap.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    ap.add_argument("--max-rss-gb", type=float, default=None, help="fail if a notebook's kernel peaks above this "
                                                                    "resident memory (GB = 1e9 bytes), e.g. 1.9")
    args = ap.parse_args(argv)
    if args.store and (args.parameter or args.model):
        ap.error("--store keeps the metrics and times of the default parameters: drop -p and --model (--only stores "
                 "just the notebooks it names)")

    from ._optional import require
    pm = require("papermill", "notebooks", "running the notebook series")

    nb_dir = Path(args.notebooks)
    notebooks = sorted(p for p in nb_dir.glob(NOTEBOOK_GLOB))
    if args.only:
        notebooks = [p for p in notebooks if any(p.name.startswith(o) for o in args.only)]
    if not notebooks:
        print(f"error: no notebooks (NN_name.ipynb, or NNb_name.ipynb for a lesson's companion) found in {nb_dir.resolve()}; run from a clone of the repository "
              f"or pass --notebooks DIR (the notebooks are not part of the installed package)", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out) / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    # The kernels run one at a time, so each may use every core ("auto"); a rerun with another thread count moves
    # results by rounding only, which the expected metrics' rules allow (measured on 03, 04 and 04b: 1 against 2).
    if args.threads != "auto":
        os.environ["CTXPATCH_THREADS"] = str(int(args.threads))
    elif not os.environ.get("CTXPATCH_THREADS"):      # a count the caller set (the tests pin 1) is kept
        os.environ["CTXPATCH_THREADS"] = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                             else os.cpu_count() or 1)     # the cores this process may use
    from .notebook import kernel_environment
    kernel_environment()                              # malloc settings a kernel needs before it starts
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
        flat = _numbers(s.get("metrics"))
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
    expected = load_expected(nb_dir)
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        problems = compare_metrics(summary, old, expected)
        for p in problems:
            print(f"regression: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"metrics agree with {args.compare} (each under its rule in {nb_dir / EXPECTED})")
    if args.check:
        problems = [f"{stem}: {p}" for stem, s in summary.items() for p in check_metrics(stem, s["metrics"], expected)]
        for p in problems:
            print(f"differs: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"metrics agree with {nb_dir / EXPECTED} (each under its rule)")
    if args.store:
        problems = store(summary, nb_dir, out_dir)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"stored the expected metrics in {nb_dir / EXPECTED} and the times in {nb_dir / TIMES}")
    return 0


def cli() -> None:
    """Console-script entry point (``pyproject.toml`` [project.scripts])."""
    from ._optional import run_cli
    run_cli(main)


if __name__ == "__main__":
    cli()

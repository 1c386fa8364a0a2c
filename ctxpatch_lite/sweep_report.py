"""The report of a sweep, and what moved against a baseline sweep.

    python -m ctxpatch_lite.sweep report runs/sweep-A [--baseline runs/sweep-B] [--out DIR] [--no-figures]

Writes ``report.md`` and ``report.html`` (figures inline) into the sweep folder (or ``--out``) and prints the
Markdown. One table per kind of job. With a baseline, jobs are matched by id (the same parameters), and every job
that changed is listed first: a **regression** when its token match dropped, its greedy (baseline) tokens changed,
its L-infinity or TVD grew beyond the tolerance (median or max; ``|new - old| <= abs + rel x |old|`` per dtype,
from the sweep's grid, stated in the report), its notebook metrics moved beyond rtol/atol, or it finished before
and failed or is missing now; a **change** when a job failed before and finishes now, or is new. Exit status 1
when anything regressed, else 0 (2: not a sweep folder).
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from pathlib import Path

from .sweep import GridError, job_records, read_json


NAN = float("nan")


def _base_row(rec: dict) -> dict:
    j, st = rec["job"], rec["status"]
    return {"id": j["id"], "key": j.get("key") or j["id"].rsplit("-", 1)[-1], "name": j["name"], "group": j["group"],
            "status": st["status"], "seconds": st.get("seconds"), "attempt": st.get("attempt"),
            "error": st.get("error"), "versions": st.get("versions")}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def compare_row(rec: dict) -> dict:
    row = {**_base_row(rec), "dtype": str(rec["job"]["params"].get("dtype", "float32"))}
    res = rec["result"]
    if res:
        s = res.get("summary", {})
        runs = res.get("runs") or [res]
        steps = [st_ for r in runs for st_ in r.get("steps", [])]
        row.update(n_match=s.get("n_match", 0), n_tokens=s.get("n_tokens", 0),
                   **{k: s.get(k, NAN) for k in ("linf_median", "linf_max", "tvd_median", "tvd_max")},
                   fallbacks=s.get("fallbacks_total", 0), hard_cases=s.get("hard_cases_total", 0),
                   nonfinite=sum(not (_finite(x.get("linf")) and _finite(x.get("tvd"))) for x in steps),
                   runs=runs, config={**rec["job"]["params"], **(res.get("config") or {})})
    return row


def notebook_row(rec: dict) -> dict:
    from .arithmetic import flatten
    row, res = _base_row(rec), rec["result"]
    row["notebook"] = rec["job"].get("notebook")
    if res:
        row.update(peak_rss_gb=res.get("peak_rss_gb"), metrics=flatten(res.get("metrics") or {}))
    return row


def rows_of(folder) -> dict:
    recs = job_records(folder)
    return {"compare": [compare_row(r) for r in recs if r["job"]["kind"] == "compare"],
            "notebook": [notebook_row(r) for r in recs if r["job"]["kind"] == "notebook"]}


def changes(rows: dict, base: dict, bands: dict | None = None) -> list[dict]:
    """What moved between this sweep's rows and the baseline's: ``[{"name", "kind", "regression": bool, "what"}]``,
    regressions first. Compare jobs are judged by ``arithmetic.compare_runs`` (tokens where the arithmetic promises
    them, flagged ties apart; each run's median and max L-inf/TVD within its noise class's band), notebook jobs
    by each metric's rule in the notebook's ``expected_metrics.json``."""
    from .arithmetic import BANDS, compare_metrics, compare_runs
    from .run_notebooks import load_expected
    bands = bands or BANDS
    found = []
    for kind in ("compare", "notebook"):
        now = {r["key"]: r for r in rows[kind]}        # matched by parameters, whatever the job is called
        before = {r["key"]: r for r in base[kind]}
        for jid, old in before.items():
            new = now.get(jid)
            if new is None:
                found.append({"name": old["name"], "kind": kind, "regression": old["status"] == "ok",
                              "what": "in the baseline, not in this sweep"})
                continue
            if old["status"] != new["status"]:
                found.append({"name": new["name"], "kind": kind, "regression": old["status"] == "ok",
                              "what": f"status {old['status']} -> {new['status']}"
                                      + (f" ({new['error']})" if new.get("error") else "")})
                continue
            if new["status"] != "ok":
                continue
            what, ties = [], []
            if kind == "compare":
                if new["n_tokens"] != old["n_tokens"]:
                    what.append(f"{new['n_tokens']} tokens, baseline {old['n_tokens']}")
                if new["nonfinite"] > old["nonfinite"]:
                    what.append(f"{new['nonfinite']} steps with a non-finite L∞ or TVD, baseline {old['nonfinite']}")
                cmp = compare_runs(new["runs"], old["runs"], new["config"], new["name"], bands)
                what += [p.removeprefix(new["name"] + " ").removeprefix(new["name"] + ": ") for p in cmp.problems]
                ties = cmp.ties
            else:
                stem = Path(new.get("notebook") or "").stem
                rules = load_expected(Path(new["notebook"]).parent if new.get("notebook") else ".")
                rules = rules.get("notebooks", {}).get(stem, {}).get("rules", {})
                what += compare_metrics(new.get("metrics") or {}, old.get("metrics") or {}, rules, label="baseline")
            if what:
                found.append({"name": new["name"], "kind": kind, "regression": True, "what": "; ".join(what)})
            elif ties:
                found.append({"name": new["name"], "kind": kind, "regression": False, "tie": True,
                              "what": f"{len(ties)} tie(s) flagged, not judged: " + "; ".join(
                                  t.removeprefix(new["name"] + " ") for t in ties)})
        for jid, new in now.items():
            if jid not in before:
                found.append({"name": new["name"], "kind": kind, "regression": False, "what": "new in this sweep"})
    return sorted(found, key=lambda c: not c["regression"])


def _fmt(v, spec=".2e"):
    if v is None:
        return "–"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def tables(rows: dict) -> dict:
    """Header and body rows per kind (strings), shared by the Markdown and the HTML; jobs not run (``--only``, or
    a sweep still going) are counted in the lead, not listed."""
    rows = {k: [r for r in v if r["status"] != "not run"] for k, v in rows.items()}
    out = {}
    if rows["compare"]:
        head = ["job", "status", "token match", "median L∞", "max L∞", "median TVD", "max TVD", "fallbacks",
                "hard cases", "seconds", "attempt"]
        body = [[r["name"], r["status"] + (f": {r['error']}" if r.get("error") else ""),
                 f"{r['n_match']}/{r['n_tokens']}" if "n_match" in r else "–",
                 _fmt(r.get("linf_median")), _fmt(r.get("linf_max")), _fmt(r.get("tvd_median")),
                 _fmt(r.get("tvd_max")), _fmt(r.get("fallbacks")), _fmt(r.get("hard_cases")),
                 _fmt(r.get("seconds"), ".1f"), _fmt(r.get("attempt"))] for r in rows["compare"]]
        out["compare"] = (head, body)
    if rows["notebook"]:
        head = ["job", "status", "seconds", "peak RSS (GB)", "metrics (first four)", "attempt"]
        body = [[r["name"], r["status"] + (f": {r['error']}" if r.get("error") else ""), _fmt(r.get("seconds"), ".1f"),
                 _fmt(r.get("peak_rss_gb"), ".2f"),
                 ", ".join(f"{k} = {v:.4g}" for k, v in [(k, v) for k, v in (r.get("metrics") or {}).items()
                                                         if isinstance(v, (int, float)) and not isinstance(v, bool)][:4])
                 or "–",
                 _fmt(r.get("attempt"))] for r in rows["notebook"]]
        out["notebook"] = (head, body)
    return out


def _md_table(head, body) -> list[str]:
    esc = (lambda s: " ".join(str(s).replace("|", "\\|").split()))   # one line per row
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(esc(c) for c in row) + " |" for row in body]


def _html_table(head, body) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def _how(m: dict) -> str:
    if m.get("executor") == "ray":
        res = m.get("ray_cluster") or {}
        return (f"Executor ray (cluster {res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs, driver on "
                f"{m.get('host')}), {m.get('threads')} thread(s) per job")
    return (f"Executor local with {m.get('workers')} worker(s) x {m.get('threads')} thread(s) on {m.get('host')} "
            f"({m.get('cores')} cores)")


def build(folder, baseline=None, figures: bool = True) -> dict:
    """Everything the report shows: ``{"rows", "changes", "regressions", "markdown", "html", "figures"}``."""
    folder = Path(folder)
    manifest = read_json(folder / "sweep.json")
    rows = rows_of(folder)
    grid = (manifest or {}).get("grid", {})
    from .arithmetic import bands_with
    bands = bands_with(grid.get("tolerance"))
    base_rows = rows_of(baseline) if baseline else None
    found = changes(rows, base_rows, bands) if base_rows else []
    regressions = [c for c in found if c["regression"]]
    ties = [c for c in found if c.get("tie")]
    moved = [c for c in found if not c.get("tie")]
    n = {k: len(v) for k, v in rows.items()}
    status = {}
    for r in rows["compare"] + rows["notebook"]:
        status[r["status"]] = status.get(r["status"], 0) + 1
    title = f"Sweep {grid.get('name', folder.name)}: {folder}"
    lead = (f"{sum(n.values())} jobs ({n['compare']} compare, {n['notebook']} notebook): "
            + ", ".join(f"{v} {k}" for k, v in sorted(status.items()))
            + ". " + _how(manifest) + f", {manifest.get('seconds')} s wall.")
    env = manifest.get("environment") or {}
    lead_env = (f"torch {env.get('torch')}, transformers {env.get('transformers')}, ctxpatch-lite "
                f"{env.get('ctxpatch_lite')}, CUDA: {env.get('cuda')}.")
    mixed = sorted({json.dumps(r["versions"], sort_keys=True) for k in rows for r in rows[k] if r.get("versions")})
    if len(mixed) > 1:
        lead_env += (" Warning: the jobs ran under " + str(len(mixed)) + " different sets of versions (a resumed sweep "
                     "after an update): " + "; ".join(mixed) + ".")
    md = [f"# {title}", "", lead, lead_env, ""]
    if base_rows is not None:
        tol_text = "; ".join(f"{k}: L∞ {b['linf'].text()}, TVD {b['tvd'].text()}" for k, b in bands.items())
        md += [f"## Against the baseline {baseline}", "",
               f"{len(regressions)} regression(s), {len(moved) - len(regressions)} other change(s), {len(ties)} "
               f"job(s) with ties flagged (not judged). Tokens are "
               f"compared where the arithmetic promises them (the baseline's top-2 margin above the logit noise), "
               f"ties flagged apart; each run's median and max L∞ and TVD within its noise class's band "
               f"(|new − baseline| ≤ abs + rel × |baseline|): {tol_text}. Notebook metrics: each under its rule "
               f"in expected_metrics.json.", ""]
        if not moved:
            md += ["Nothing moved" + (f" ({len(ties)} job(s) with ties the arithmetic does not promise, flagged "
                                      f"below)." if ties else "."), ""]
        if found:
            md += _md_table(["job", "kind", "", "what moved"],
                            [[c["name"], c["kind"], "REGRESSION" if c["regression"] else "tie" if c.get("tie")
                              else "change", c["what"]] for c in found]) + [""]
    tabs = tables(rows)
    for kind, (head, body) in tabs.items():
        md += [f"## {kind} jobs", ""] + _md_table(head, body) + [""]
    figs = {}
    shown = [r for r in rows["compare"] if r["status"] != "not run"]
    if figures and shown:
        from . import plots
        figs["token_match"] = plots.sweep_token_match(shown, base_rows and base_rows["compare"])
        figs["linf"] = plots.sweep_linf(shown, base_rows and base_rows["compare"])
        md += [f"![{name}](report_{name}.png)" for name in figs] + [""]
    page = ["<!doctype html><html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:110em}table{border-collapse:collapse;"
            "margin:1em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%;text-align:left}"
            "tr.reg td{background:#fdd}tr.chg td{background:#ffd}img{max-width:100%}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>", f"<p>{html.escape(lead)} {html.escape(lead_env)}</p>"]
    if base_rows is not None:
        page.append(f"<h2>Against the baseline {html.escape(str(baseline))}</h2><p>{len(regressions)} regression(s), "
                    f"{len(moved) - len(regressions)} other change(s), {len(ties)} job(s) with ties flagged; rules as "
                    f"in report.md.</p>")
        if not moved:
            page.append("<p>Nothing moved.</p>")
        if found:
            page.append("<table><thead><tr><th>job</th><th>kind</th><th></th><th>what moved</th></tr></thead><tbody>"
                        + "".join(f"<tr class='{'reg' if c['regression'] else 'chg'}'><td>{html.escape(c['name'])}"
                                  f"</td><td>{c['kind']}</td><td>{'REGRESSION' if c['regression'] else 'tie' if c.get('tie') else 'change'}</td>"
                                  f"<td>{html.escape(c['what'])}</td></tr>" for c in found) + "</tbody></table>")
    for name, fig in figs.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        page.append(f"<img alt='{name}' src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'>")
    for kind, (head, body) in tabs.items():
        page.append(f"<h2>{kind} jobs</h2>" + _html_table(head, body))
    page.append("</body></html>")
    return {"rows": rows, "changes": found, "regressions": regressions, "markdown": "\n".join(md) + "\n",
            "html": "\n".join(page), "figures": figs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxpatch_lite.sweep report", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="a sweep's output folder")
    ap.add_argument("--baseline", default=None, help="an earlier sweep's folder (the last good run)")
    ap.add_argument("--out", default=None, help="where report.md / report.html go (default: the sweep folder)")
    ap.add_argument("--no-figures", action="store_true", help="tables only (no matplotlib needed)")
    args = ap.parse_args(argv)
    try:
        for f in [args.sweep] + ([args.baseline] if args.baseline else []):
            if not (Path(f) / "sweep.json").is_file():
                raise GridError(f"{f} is not a sweep folder (no sweep.json)")
        rep = build(args.sweep, args.baseline, figures=not args.no_figures)
    except GridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or args.sweep)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(rep["markdown"])
    (out / "report.html").write_text(rep["html"])
    for name, fig in rep["figures"].items():
        fig.savefig(out / f"report_{name}.png", dpi=110, bbox_inches="tight")
    print(rep["markdown"])
    print(f"wrote {out / 'report.md'} and {out / 'report.html'}")
    if rep["regressions"]:
        print(f"{len(rep['regressions'])} job(s) regressed against {args.baseline}", file=sys.stderr)
        return 1
    return 0

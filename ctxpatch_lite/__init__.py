"""ctxpatch_lite: context as weight patches in modern transformer blocks (Goldwaser et al., ICML 2026)."""
from .models import DTYPES, ModelLoadError, describe_model, load_model, resolve_device, resolve_dtype

__version__ = "0.2.0"


def _report_peak_rss_at_exit():
    """Under the notebook runner (``CTXPATCH_RSS_OUT`` set), write this process's peak resident memory (the
    kernel's ``VmHWM``, see ``notebook.peak_rss_gb``) to that file when it exits: the runner reports it per notebook."""
    import atexit
    import os

    path = os.environ.get("CTXPATCH_RSS_OUT")
    if not path:
        return

    def write():
        from .notebook import peak_rss_gb
        with open(path, "w") as f:
            f.write(f"{peak_rss_gb():.4f}\n")
    atexit.register(write)


_report_peak_rss_at_exit()
__all__ = ["DTYPES", "ModelLoadError", "describe_model", "load_model", "resolve_device", "resolve_dtype", "absorb",
           "PatchSet", "PatchConfig", "PatchSetMismatch", "run_protocol"]


def __getattr__(name):   # the engine is imported on first use, so `import ctxpatch_lite` stays light
    if name in ("absorb", "PatchSet", "PatchSetMismatch"):
        from . import patchset
        return getattr(patchset, name)
    if name == "PatchConfig":
        from .algorithm import PatchConfig
        return PatchConfig
    if name == "run_protocol":
        from .protocol import run_protocol
        return run_protocol
    raise AttributeError(f"module 'ctxpatch_lite' has no attribute {name!r}")

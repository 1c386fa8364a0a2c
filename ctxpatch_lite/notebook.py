"""Small helpers the notebooks share: metrics JSON for the runner, figure saving, and a quiet, steady setup."""
from __future__ import annotations

import json
import os
from pathlib import Path


MMAP_THRESHOLD = 256 << 10   # bytes: blocks from here up are mmapped, so freeing them returns the memory at once
TRIM_THRESHOLD = 64 << 20   # bytes of free heap top kept before it is given back


# Set in a kernel's environment before it starts (the runner, the nbval run and Binder's start script do): glibc
# fixes its arena limit when a second thread first allocates, and a Jupyter kernel's own threads do that before
# any cell runs, so ``low_memory``'s M_ARENA_MAX comes too late there. One arena kept lesson 02's kernel at 1.78 GB
# against 1.91 GB with the default (8 arenas per core; both measured with an 8 MB mmap threshold), and at 1.78 GB
# against 1.88 GB with the 256 kB one.
KERNEL_ENV = {"MALLOC_ARENA_MAX": "1"}


def kernel_environment() -> dict:
    """Put ``KERNEL_ENV`` into this process's environment (values the caller set are kept), for the kernels it
    starts; returns what the kernels will see."""
    for key, value in KERNEL_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in KERNEL_ENV}


def low_memory() -> bool:
    """Make freed memory go back to the operating system (Linux with glibc; elsewhere a no-op, returns False).

    glibc raises its mmap threshold as large blocks are freed, after which the many multi-megabyte temporaries
    of a forward pass over a 262k vocabulary come from the heap and stay resident after they are freed: a
    20-token batched run of the embedded model then peaks at 2.3 GB resident where its live data is 1.8 GB.
    Three settings keep the peak near live memory (Binder gives about 2 GB):

    * a fixed mmap threshold (``MMAP_THRESHOLD``, 256 kB): blocks from there up are mapped and unmapped, so freeing
      them returns them at once. It costs page faults: a patched 2048 x 640 float32 weight (5.2 MB) is a fresh mapping
      each time, and 8 MB made lesson 03 about 8 s faster, but then lesson 05 (which writes patches into the weights
      and restores them) peaked anywhere from 1.77 to 2.45 GB between two runs of the same code, so it stays here;
    * one malloc arena (``M_ARENA_MAX`` = 1): torch's worker threads otherwise grow arenas of their own whose
      freed blocks stay resident (lesson 02 peaked 0.1 GB higher with them);
    * a trim threshold (``TRIM_THRESHOLD``): free memory above it at the heap's top is given back.

    ``benchmarks/bench_memory.py`` measures peaks and times with and without these settings."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return all(bool(libc.mallopt(option, value)) for option, value in
               ((m_mmap_threshold, MMAP_THRESHOLD), (m_trim_threshold, TRIM_THRESHOLD), (m_arena_max, 1)))


def peak_rss_gb() -> float:
    """This process's peak resident memory in GB (10^9 bytes): ``VmHWM`` on Linux (the high-water mark of this
    address space, reset at ``exec``, so a kernel forked from a large process reports its own peak), else
    ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    import resource
    import sys
    k = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
    return k / 1e9 if sys.platform == "darwin" else k * 1024 / 1e9


def free_memory() -> None:
    """Collect garbage and give freed heap memory back to the operating system (glibc ``malloc_trim``), e.g.
    after dropping one model before loading another."""
    import ctypes
    import gc
    import sys

    from .patches import free_scratch
    free_scratch()                                   # the engine's cast buffers, sized for the model just dropped
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def setup(threads: int | None = None, quiet: bool = True, memory: bool = True) -> None:
    """Quiet transformers' progress bars/warnings; optionally pin torch threads (the runner passes its choice);
    ``memory``: return freed memory to the system at once (``low_memory``), so notebooks fit Binder's 2 GB."""
    import torch
    from transformers.utils import logging as hf_logging

    if memory:
        low_memory()

    if threads is None and os.environ.get("CTXPATCH_THREADS"):
        threads = int(os.environ["CTXPATCH_THREADS"])
    if threads:
        torch.set_num_threads(threads)
    if quiet:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def save_metrics(path: str | None, metrics: dict) -> None:
    """Write a notebook's metrics JSON where the runner asked for it (the ``metrics_out`` parameter), else where the
    test session asked for it (``CTXPATCH_METRICS_OUT``, set per notebook by notebooks/conftest.py); else nothing.
    Every number a notebook prints is one of its metrics: the tests compare them with
    ``notebooks/expected_metrics.json`` under each metric's stated rule (nbval compares the words)."""
    path = path or os.environ.get("CTXPATCH_METRICS_OUT")
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(metrics, indent=1, default=float))


def save_figure(fig, name: str, figures_dir: str | None) -> None:
    """Save ``fig`` as ``<figures_dir>/<name>.png`` when the runner gave a folder; no-op otherwise."""
    if figures_dir:
        Path(figures_dir).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(figures_dir) / f"{name}.png", dpi=110, bbox_inches="tight")

"""Count host transfers: every ``item``, ``tolist``, ``numpy``, ``cpu``, ``float``, ``int``, ``bool`` (and
``__index__``) of a tensor waits for the device on a GPU. ``count_host_syncs()`` wraps those ``torch.Tensor``
methods for the duration of a block and attributes each call to the source file that made it, so a CPU run
measures what a GPU run would stall on. Used by ``benchmarks/bench_algorithm1.py`` and the tests.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch

METHODS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")
PACKAGE = str(Path(__file__).resolve().parent)


@contextlib.contextmanager
def count_host_syncs():
    """``with count_host_syncs() as c: ...``; then ``c["package"]`` (calls made by ctxpatch_lite's own code),
    ``c["total"]`` and ``c["by_file"]``. Calls made inside another wrapped call count once."""
    counts = {"package": 0, "total": 0, "by_file": collections.Counter()}
    saved = {name: getattr(torch.Tensor, name) for name in METHODS}
    depth = [0]

    def wrap(name, fn):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if depth[0] == 0 and not caller.co_name.startswith("_cpu_only"):   # never runs on a GPU
                f = caller.co_filename
                counts["total"] += 1
                counts["by_file"][f] += 1
                if f.startswith(PACKAGE) and not f.endswith("hostsync.py"):
                    counts["package"] += 1
            depth[0] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)

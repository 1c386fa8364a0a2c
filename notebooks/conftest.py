"""The Binder memory ceiling, checked on the nbval run itself (no second execution): after a notebook's last cell
its kernel reports its own peak resident memory (``ru_maxrss``); above ``CTXPATCH_MAX_RSS_GB`` (default 1.9 GB,
GB = 10^9 bytes: Binder gives about 2 GB, the notebook server included) the notebook's teardown fails, naming it.
nbval runs each notebook with its stored default parameters, which is what a Binder visitor runs. The peaks are
written to ``test-artifacts/notebook_memory.json``."""
import json
import os
import tempfile
from pathlib import Path

import pytest

LIMIT_GB = float(os.environ.get("CTXPATCH_MAX_RSS_GB", "1.9"))
ARTIFACT = Path(__file__).parent.parent / "test-artifacts" / "notebook_memory.json"
PROBE = ("import resource as _r, sys as _s\n"
         "_k = _r.getrusage(_r.RUSAGE_SELF).ru_maxrss\n"
         "open({path!r}, 'w').write(str(_k / 1e9 if _s.platform == 'darwin' else _k * 1024 / 1e9))\n")


def _kernel_peak_gb(kernel) -> float | None:
    fd, path = tempfile.mkstemp(suffix=".rss")
    os.close(fd)
    try:
        msg_id = kernel.execute_cell_input(PROBE.format(path=path), allow_stdin=False)
        kernel.await_reply(msg_id, timeout=60)
        text = Path(path).read_text().strip()
        return float(text) if text else None
    except Exception:  # noqa: BLE001 - a dead kernel has no peak to report; the cell failure says why
        return None
    finally:
        os.unlink(path)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    parent = getattr(item, "parent", None)
    kernel = getattr(parent, "kernel", None)
    if kernel is None or (nextitem is not None and nextitem.parent is parent) or not kernel.is_alive():
        return
    peak = _kernel_peak_gb(kernel)
    name = Path(str(parent.fspath)).name
    ARTIFACT.parent.mkdir(exist_ok=True)
    data = json.loads(ARTIFACT.read_text()) if ARTIFACT.is_file() else {}
    data[name] = {"peak_rss_gb": peak, "limit_gb": LIMIT_GB}
    ARTIFACT.write_text(json.dumps(data, indent=1, sort_keys=True))
    if peak is not None and peak > LIMIT_GB:
        raise AssertionError(f"{name}: the kernel peaked at {peak:.2f} GB resident memory, over the Binder limit of "
                             f"{LIMIT_GB} GB (CTXPATCH_MAX_RSS_GB)")

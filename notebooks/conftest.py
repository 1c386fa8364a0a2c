"""Two checks on the nbval run itself, beside nbval's comparison of the words (notebooks/nbval_sanitize.cfg masks
every number in the stored outputs, since their last digits depend on the CPU's arithmetic):

* **the metrics**: every notebook saves the numbers it prints as metrics (``save_metrics``); under the tests they
  go to ``test-artifacts/metrics/<notebook>.json`` (``CTXPATCH_METRICS_OUT``, set here before its kernel starts),
  and one more test item per notebook, ``<notebook>::metrics``, compares them with
  ``notebooks/expected_metrics.json``, each metric under its stated rule (``ctxpatch_lite.arithmetic``);
* **the Binder memory ceiling**, below.

The Binder memory ceiling, checked on the nbval run itself (no second execution): after a notebook's last cell
its kernel reports its own peak resident memory (``VmHWM``: the high-water mark of its address space, which starts
afresh at ``exec``; ``ru_maxrss`` would carry over the RSS of the pytest process the kernel was forked from).
Above ``CTXPATCH_MAX_RSS_GB`` (default 1.9 GB, GB = 10^9 bytes: Binder gives about 2 GB, the notebook server
included) the test session fails, naming the notebook. nbval runs each notebook with its stored default
parameters, which is what a Binder visitor runs. The peaks are written to ``test-artifacts/notebook_memory.json``."""
import json
import os
import tempfile
from pathlib import Path

import pytest

LIMIT_GB = float(os.environ.get("CTXPATCH_MAX_RSS_GB", "1.9"))
ARTIFACT = Path(__file__).parent.parent / "test-artifacts" / "notebook_memory.json"
METRICS = Path(__file__).parent.parent / "test-artifacts" / "metrics"
PROBE = ("from ctxpatch_lite.notebook import peak_rss_gb as _p\n"
         "open({path!r}, 'w').write(str(_p()))\n")
OVER: list = []


def _kernel_peak_gb(kernel) -> float | None:
    fd, path = tempfile.mkstemp(suffix=".rss")
    os.close(fd)
    try:
        msg_id = kernel.execute_cell_input(PROBE.format(path=path), allow_stdin=False)
        kernel.await_reply(msg_id, timeout=60)
        text = Path(path).read_text().strip()
        return float(text) if text else None
    except Exception:  # noqa: BLE001 - a dead kernel has no peak to report; the cell failures say why
        return None
    finally:
        os.unlink(path)


def _notebook_of(item):
    """The nbval notebook collector an item belongs to, or None."""
    parent = getattr(item, "parent", None)
    return parent if parent is not None and str(getattr(parent, "fspath", "")).endswith(".ipynb") else None


class NotebookMetrics(pytest.Item):
    """``<notebook>::metrics``: the metrics this session's run of the notebook saved, against the expected ones."""

    def __init__(self, *, stem, nb_dir, **kw):
        super().__init__(**kw)
        self.stem, self.nb_dir = stem, nb_dir

    def runtest(self):
        from ctxpatch_lite.run_notebooks import check_metrics, load_expected
        path = METRICS / f"{self.stem}.json"
        if not path.is_file():
            raise AssertionError(f"{self.stem} saved no metrics in this session (did a cell fail before its "
                                 f"save_metrics cell?)")
        problems = check_metrics(self.stem, json.loads(path.read_text()), load_expected(self.nb_dir))
        if problems:
            raise AssertionError(f"{self.stem}: {len(problems)} metric(s) outside their rules:\n  "
                                 + "\n  ".join(problems))

    def repr_failure(self, excinfo):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, 0, f"{self.stem}::metrics"


def pytest_collection_modifyitems(session, config, items):
    """After the last cell of each notebook, its metrics item (nbval only)."""
    if not config.getoption("nbval", default=False):
        return
    out, last = [], None
    for item in items:
        nb = _notebook_of(item)
        if last is not None and nb is not last:
            out.append(_metrics_item(last))
        out.append(item)
        last = nb
    if last is not None:
        out.append(_metrics_item(last))
    items[:] = out


def _metrics_item(nb):
    stem = Path(str(nb.fspath)).stem
    return NotebookMetrics.from_parent(nb.parent, name=f"{stem}.ipynb::metrics", stem=stem,
                                       nb_dir=Path(str(nb.fspath)).parent)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a notebook's kernel starts (its collector's setup, at its first cell): where its metrics go."""
    nb = _notebook_of(item)
    if nb is not None and getattr(nb, "kernel", None) is None:
        METRICS.mkdir(parents=True, exist_ok=True)
        target = METRICS / f"{Path(str(nb.fspath)).stem}.json"
        target.unlink(missing_ok=True)
        os.environ["CTXPATCH_METRICS_OUT"] = str(target)
        from ctxpatch_lite.notebook import kernel_environment
        kernel_environment()                   # malloc settings a kernel needs before it starts (the ceiling below)


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
        OVER.append(f"{name}: the kernel peaked at {peak:.2f} GB resident memory, over the Binder limit of "
                    f"{LIMIT_GB} GB (CTXPATCH_MAX_RSS_GB)")


def pytest_terminal_summary(terminalreporter):
    if ARTIFACT.is_file():
        data = json.loads(ARTIFACT.read_text())
        terminalreporter.write_line("notebook kernels' peak resident memory (GB): " + ", ".join(
            f"{k.split('_')[0]} {v['peak_rss_gb']:.2f}" for k, v in sorted(data.items()) if v["peak_rss_gb"]))
    for line in OVER:
        terminalreporter.write_line(f"MEMORY CEILING: {line}", red=True)


def pytest_sessionfinish(session, exitstatus):
    if OVER and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_sessionstart(session):
    if ARTIFACT.is_file():   # this session's peaks only
        ARTIFACT.unlink()

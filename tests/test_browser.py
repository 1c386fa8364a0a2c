"""Real-browser test of notebook 03's widgets: JupyterLab on localhost, driven by Debian's Chromium via Playwright.

What a learner does: open 03_algorithm1, run all cells, wait for the kernel, change the precision dropdown and the
start-layer slider, and read the redrawn plot and the printed metrics. Screenshots and the browser console go to
test-artifacts/browser/ (git-ignored). Every process this test starts is stopped by its id, also on failure.
Skipped (with the reason) only where Chromium or Playwright is missing; .ci/run installs both.
"""
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _small_copy(workdir: Path) -> Path:
    """Notebook 03 with smaller parameters (6 tokens) so the test stays short."""
    import nbformat
    nb = nbformat.read(ROOT / "notebooks" / "03_algorithm1.ipynb", as_version=4)
    for cell in nb.cells:
        if "parameters" in cell.metadata.get("tags", []):
            src = cell.source
            src = re.sub(r"(?m)^tokens = \d+", "tokens = 6", src)
            src = re.sub(r"(?m)^interactive = \w+", "interactive = True", src)
            cell.source = src
        cell.outputs = [] if cell.cell_type == "code" else None
        if cell.cell_type == "code":
            cell.execution_count = None
    for cell in nb.cells:
        if cell.cell_type != "code":
            cell.pop("outputs", None)
    path = workdir / "03_algorithm1.ipynb"
    nbformat.write(nb, path)
    return path


def _browser_prereqs():
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra) is missing")


@contextlib.contextmanager
def _serve(cmd, work: Path, tmp_path: Path, ready: str, name: str):
    """Start a server in its own process group, wait until ``ready`` answers, yield; stop the group on exit."""
    # JupyterLab renders only the cells near the viewport ("windowing"); the checks read outputs of the whole
    # notebook, so the test's own user settings turn windowing off.
    settings = tmp_path / "lab-settings"
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True, exist_ok=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTERLAB_SETTINGS_DIR=str(settings), CTXPATCH_THREADS="1", PYTHONPATH=str(ROOT))
    log_path = tmp_path / f"{name}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(ready, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{name} did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.5)
        yield log_path
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(log_path, ARTIFACTS / f"{name}.log")


@pytest.fixture
def jupyterlab(tmp_path):
    _browser_prereqs()
    work = tmp_path / "lab"
    work.mkdir()
    _small_copy(work)
    port, token = _free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--ServerApp.port={port}",
           "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
           "--ServerApp.port_retries=0", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
           "jupyterlab.NeverCheckForUpdate"]
    with _serve(cmd, work, tmp_path, f"{url}/api/status?token={token}", "jupyterlab") as log:
        yield {"url": url, "token": token, "log": log}


@pytest.fixture
def voila_app(tmp_path):
    _browser_prereqs()
    pytest.importorskip("voila", reason="pip install voila (the test extra) is missing")
    work = tmp_path / "voila"
    work.mkdir()
    nb = _small_copy(work)
    port, token = _free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "voila", str(nb), "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1",
           f"--token={token}", "--VoilaConfiguration.show_tracebacks=True", "--Voila.port_retries=0"]
    with _serve(cmd, work, tmp_path, f"{url}/voila/static/voila.js", "voila") as log:
        yield {"url": url, "token": token, "log": log}


def _panel_state(page):
    """Text and image of the widget panel's output area (the last widget output in the notebook)."""
    return page.evaluate("""() => {
        const outs = document.querySelectorAll('.widget-output');
        const o = outs[outs.length - 1];
        if (!o) return {text: '', img: ''};
        const img = o.querySelector('img');
        return {text: o.textContent, img: img ? img.src.slice(-200) : ''};
    }""")


def _dismiss_dialogs(page):
    """Accept JupyterLab's kernel dialog (keep Python 3) and decline the news toast, if they appear."""
    for _ in range(3):
        dialog = page.locator(".jp-Dialog")
        if dialog.count() and dialog.first.is_visible():
            page.locator(".jp-Dialog button:has-text('Select')").first.click()
            time.sleep(0.5)
    news = page.locator(".jp-toast-button:has-text('No')")
    if news.count() and news.first.is_visible():
        news.first.click()


def _wait_idle(page, timeout_s):
    """Wait until no cell shows [*] and the kernel status reads Idle."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        busy = page.evaluate("""() => [...document.querySelectorAll('.jp-InputPrompt')]
                                  .some(p => p.innerText.includes('*'))""")
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0 or \
            "Idle" in page.locator(".jp-StatusBar-Widget").all_inner_texts().__str__()
        if not busy and idle:
            return
        time.sleep(1)
    raise AssertionError(f"kernel still busy after {timeout_s} s")


def _drive_widgets(page, prefix: str):
    """Set precision to bfloat16, then the start-layer slider to 17, then h_source to recorded; assert the plot and
    the metrics follow. (Text is read with textContent: JupyterLab skips rendering cells outside the viewport, and the
    panel is not the notebook's last cell.)"""
    page.locator(".widget-dropdown:has(label:text-is('precision'))").scroll_into_view_if_needed()
    before = _panel_state(page)
    precision = page.locator(".widget-dropdown:has(label:text-is('precision')) select")
    precision.select_option("bfloat16")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-html')]"
                           ".some(e => e.textContent.includes('done: bfloat16'))", timeout=300_000)
    after_precision = _panel_state(page)
    page.locator(".widget-dropdown:has(label:text-is('precision'))").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / f"{prefix}02_after_precision_bfloat16.png"))
    assert after_precision["img"] and after_precision["img"] != before["img"], "the plot was not redrawn"
    assert "token match" in after_precision["text"] and after_precision["text"] != before["text"]
    linf = [float(x) for x in re.findall(r"median L_inf ([0-9.e+-]+)", after_precision["text"])]
    assert linf and linf[0] > 1e-3, "bfloat16 distances should be far above float32 rounding"

    readout = page.locator(".widget-slider:has(label:text-is('start layer')) .widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("17")
    page.keyboard.press("Enter")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-html')]"
                           ".some(e => e.textContent.includes('start layer 17'))", timeout=300_000)
    after_slider = _panel_state(page)
    page.screenshot(path=str(ARTIFACTS / f"{prefix}03_after_start_layer_17.png"))
    assert after_slider["img"] != after_precision["img"], "the plot was not redrawn after the slider"
    assert after_slider["text"] != after_precision["text"]

    page.locator(".widget-toggle-buttons:has(label:text-is('h_source')) button:has-text('recorded')").click()
    page.wait_for_function("() => [...document.querySelectorAll('.widget-html')]"
                           ".some(e => e.textContent.includes('h_source recorded, start layer 17'))", timeout=300_000)
    after_h = _panel_state(page)
    page.screenshot(path=str(ARTIFACTS / f"{prefix}04_after_h_source_recorded.png"))
    assert after_h["text"] != after_slider["text"], "the h_source toggle did not rerun Algorithm 1"
    assert page.locator("[data-mime-type='application/vnd.jupyter.error']").count() == 0


@contextlib.contextmanager
def _browser_page(prefix: str):
    """A Chromium page with its console captured; on failure a full-page screenshot; on exit the console is saved
    and checked for errors from our widgets."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    console = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: console.append({"type": m.type, "text": m.text}))
        page.on("pageerror", lambda e: console.append({"type": "pageerror", "text": str(e)}))
        try:
            yield page
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"{prefix}failure.png"), full_page=True)
            raise
        finally:
            (ARTIFACTS / f"{prefix}console.json").write_text(json.dumps(console, indent=1))
            browser.close()
    ours = [m for m in console if m["type"] in ("error", "pageerror") and
            re.search(r"widget|ctxpatch|jupyter-widgets|Could not create|Failed to load model", m["text"], re.I)]
    assert not ours, f"browser console errors from our widgets: {ours}"


def test_widgets_in_real_browser(jupyterlab):
    with _browser_page("") as page:
        page.goto(f"{jupyterlab['url']}/lab/tree/03_algorithm1.ipynb?token={jupyterlab['token']}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator, .jp-StatusBar-Widget", timeout=60_000)
        time.sleep(3)
        _dismiss_dialogs(page)
        _wait_idle(page, 120)
        page.click("li.lm-MenuBar-item:has-text('Run')")
        page.click("li.lm-Menu-item:has-text('Run All Cells')")
        time.sleep(2)
        _dismiss_dialogs(page)
        page.wait_for_selector(".widget-dropdown select",
                               timeout=int(os.environ.get("CTXPATCH_BROWSER_TIMEOUT", "300")) * 1000)
        _wait_idle(page, 300)
        page.screenshot(path=str(ARTIFACTS / "01_after_run_all.png"), full_page=False)

        static = page.evaluate("() => document.body.textContent")   # textContent: cells outside the viewport too
        (ARTIFACTS / "01_static_text.txt").write_text(static)
        (ARTIFACTS / "01_errors.txt").write_text("\n---\n".join(
            page.locator("[data-mime-type='application/vnd.jupyter.error']").all_inner_texts()))
        assert "token match" in static and "largest L_inf" in static, "the static render printed its metrics"
        errors = page.locator("[data-mime-type='application/vnd.jupyter.error']").count()
        assert errors == 0, "a cell raised an error"
        _drive_widgets(page, "")


def test_voila_app_in_real_browser(voila_app):
    """The README's Voila command: 03_algorithm1 as an app (code hidden); the same widget interaction."""
    with _browser_page("voila_") as page:
        page.goto(f"{voila_app['url']}/?token={voila_app['token']}", timeout=300_000)
        page.wait_for_selector(".widget-dropdown select", timeout=300_000)
        page.wait_for_function("() => [...document.querySelectorAll('.widget-html')]"
                               ".some(e => e.innerText.includes('change a control'))", timeout=300_000)
        page.screenshot(path=str(ARTIFACTS / "voila_01_loaded.png"))
        text = page.evaluate("() => document.body.innerText")
        assert "token match" in text and "Traceback" not in text
        assert page.locator("pre:has-text('import torch')").count() == 0, "Voila shows outputs, not code"
        _drive_widgets(page, "voila_")

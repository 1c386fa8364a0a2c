"""The notebook series as a course: every notebook opens with what it teaches, needs and takes, a Colab badge and
the notation link, and closes with takeaways and questions; the Colab cell does nothing outside Colab; no parameter
is dead; plumbing and solutions are hidden; every number in the prose is either printed by the notebook's own run or
listed with its source in notebooks/quoted_numbers.json."""
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from ctxpatch_lite.run_notebooks import NOTEBOOK_GLOB

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))
NUMBER = re.compile(r"(?<![\w.^{_\\$§-])(\d+(?:\.\d+)?\s?%|\d+\.\d+|\d+(?:\.\d+)?\s?×|\d{2,}(?:,\d{3})*)(?![\w}^])")


def load(path):
    return nbformat.read(path, as_version=4)


def test_notation_file_exists_and_defines_h_once():
    text = (ROOT / "notebooks" / "NOTATION.md").read_text()
    assert "**always** $N(W_\\text{down} h_g)$" in text and "| $h_g$ |" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_opens_and_closes_like_a_course(path):
    nb = load(path)
    head = nb.cells[0].source
    assert head.startswith("# ") and f"notebooks/{path.stem}.ipynb" in head and "colab-badge.svg" in head
    assert "(NOTATION.md)" in head
    for row in ("**You will learn**", "**You need**", "**Time**"):
        assert row in head, row
    from ctxpatch_lite.run_notebooks import said_time
    times = json.loads((ROOT / "notebooks" / "times.json").read_text())
    said = said_time(times["seconds"][path.stem])      # make run ARGS=--store writes both
    assert f"| **Time** | {said} to execute on 2 CPU cores" in head, (said, times["measured"])
    closing = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## Takeaways")]
    assert len(closing) == 1 and "## Questions to try" in nb.cells[closing[0]].source
    after = [c.metadata.get("tags", []) for c in nb.cells[closing[0] + 1:]]   # an optional part is its own notebook (04b)
    assert all("plumbing" in t or "answers" in t for t in after)              # answers rendered from the run may follow
    assert sum("answers" in t for t in after) <= 1


def _colab_cells():
    return [next(c for c in load(p).cells if "colab" in c.metadata.get("tags", [])) for p in NOTEBOOKS]


def test_colab_cell_is_the_same_everywhere_and_first():
    cells = _colab_cells()
    assert len({c.source for c in cells}) == 1
    for p in NOTEBOOKS:
        nb = load(p)
        assert "colab" in nb.cells[1].metadata.get("tags", []) and "parameters" in nb.cells[2].metadata.get("tags", [])


def test_colab_cell_does_nothing_elsewhere(monkeypatch):
    src = _colab_cells()[0].source
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)

    def refuse(*a, **k):
        raise AssertionError("the Colab cell ran a subprocess outside Colab")
    monkeypatch.setattr(subprocess, "run", refuse)
    namespace = {}
    exec(compile(src, "colab-cell", "exec"), namespace)
    assert "output" not in namespace and "subprocess" not in namespace


def test_colab_cell_installs_and_enables_widgets_inside_colab(monkeypatch):
    src = _colab_cells()[0].source
    calls, enabled = [], []
    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: enabled.append(True))
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
    exec(compile(src, "colab-cell", "exec"), {})
    assert calls and calls[0][1:4] == ["-m", "pip", "install"]
    assert any(a.startswith("ctxpatch-lite[notebooks,embedded] @ git+https://github.com/") for a in calls[0])
    assert enabled == [True]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_dead_parameters(path):
    nb = load(path)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = re.findall(r"(?m)^(\w+)\s*=", params.source)
    rest = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and c is not params)
    dead = [n for n in names if not re.search(rf"\b{n}\b", rest)]
    assert not dead, f"parameters nothing uses: {dead}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_plumbing_is_hidden_and_no_solution_is_in_a_notebook(path):
    nb = load(path)
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        tags = c.metadata.get("tags", [])
        assert "solution" not in tags, "solutions live in ctxpatch_lite/solutions.py, not in a notebook"
        if "save_metrics(" in c.source:
            assert c.source.lstrip().startswith("save_metrics(") and "plumbing" in tags, c.source[:80]
        if "plumbing" in tags:
            assert c.metadata.get("jupyter", {}).get("source_hidden") is True, c.source[:80]


STUB = "raise NotImplementedError  # your code here"
EXERCISES = {"rms_norm": "01_gemma_block", "gemma_block": "01_gemma_block", "input_patch": "02_single_block_patch",
             "scale_patch": "02_single_block_patch", "theorem1_block": "03_algorithm1", "algorithm1": "03_algorithm1",
             "patched_layer": "03_algorithm1", "run_schedule": "03_algorithm1",
             "secular_root": "04_numerical_stability", "stable_patch": "04_numerical_stability",
             "naive_miss": "04_numerical_stability", "bf16_step": "04b_bfloat16_up_close",
             "hard_case_y": "04b_bfloat16_up_close", "cause2_candidates": "04b_bfloat16_up_close",
             "sum_condition": "04b_bfloat16_up_close", "exact_zeros": "04b_bfloat16_up_close"}


def test_every_exercise_is_a_stub_followed_by_its_check():
    """The ARENA way: the learner's cell is a stub that raises until written, the next cell checks it (and runs the
    package's solution while the stub is unwritten); the solution is in ctxpatch_lite.solutions, not in the notebook."""
    from ctxpatch_lite import solutions
    found = {}
    for p in NOTEBOOKS:
        cells = load(p).cells
        for i, c in enumerate(cells):
            if c.cell_type == "code" and STUB in c.source:
                name = re.search(r"^def (\w+)", c.source, re.M).group(1)
                body = c.source.split('"""')[-1]        # hints as comments are fine; code is not
                code = [ln for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
                assert [ln.strip() for ln in code] == [STUB], f"{p.stem}: the stub of {name} holds more than the stub"
                assert re.search(rf"^{name} = ex\.check_{name}\({name}\b", cells[i + 1].source, re.M), (p.stem, name)
                assert hasattr(solutions, name)
                found[name] = p.stem
    assert found == EXERCISES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_links_point_to_files_in_the_repository(path):
    for c in load(path).cells:
        if c.cell_type != "markdown":
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", c.source):
            if target.startswith(("http://", "https://", "#")):
                continue
            assert (ROOT / "notebooks" / target.split("#")[0]).exists(), f"{path.stem} links to {target}, not in the repo"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_clean_top_to_bottom_run(path):
    """Every code cell ran, in order, once; no two cells hold the same text."""
    cells = load(path).cells
    counts = [c.get("execution_count") for c in cells if c.cell_type == "code"]
    assert all(isinstance(n, int) for n in counts), f"{path.stem}: unexecuted code cells"
    assert counts == list(range(1, len(counts) + 1)), f"{path.stem}: cells ran out of order: {counts}"
    sources = [c.source.strip() for c in cells if c.source.strip()]
    dup = {x[:60] for x in sources if sources.count(x) > 1}
    assert not dup, f"{path.stem}: duplicated cells {dup}"


def test_the_course_map_gives_every_lessons_measured_time():
    from ctxpatch_lite.run_notebooks import said_time
    times = json.loads((ROOT / "notebooks" / "times.json").read_text())["seconds"]
    cell = next(c for c in load(ROOT / "notebooks" / "00_quickstart.ipynb").cells
                if "course-map" in c.metadata.get("tags", []))
    rows = dict(re.findall(r"(?m)^\| \[[^\]]*\]\((\d\d[a-z]?_\w+)\.ipynb\).*\| ([^|]*) \|$", cell.source))
    assert set(rows) == {p.stem for p in NOTEBOOKS}
    for stem, said in rows.items():
        assert said == said_time(times[stem]), (stem, said, times[stem])


def test_times_are_measured_not_copied():
    """times.json holds one run's seconds for every notebook, written by the runner (make run ARGS=--store)."""
    times = json.loads((ROOT / "notebooks" / "times.json").read_text())
    assert set(times["seconds"]) == {p.stem for p in NOTEBOOKS}
    assert "make run" in times["measured"]
    assert set(times["runs"]) == set(times["seconds"]) and all(r.endswith("/summary.json") for r in times["runs"].values())


def _output_text(nb) -> str:
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"]))
            for key in ("text/plain", "text/markdown", "text/html"):
                v = o.get("data", {}).get(key)
                if v:
                    out.append(v if isinstance(v, str) else "".join(v))
    return "\n".join(out)


def _prose_numbers(nb) -> set:
    nums = set()
    for c in nb.cells:
        if c.cell_type != "markdown" or "course-map" in c.metadata.get("tags", []):   # times: checked above
            continue
        s = re.sub(r"\$\$.*?\$\$", "", c.source, flags=re.S)           # display math: formulas, not measurements
        s = re.sub(r"\(https?://[^)]*\)|`[^`]*`", "", s)                 # links and code
        s = re.sub(r"(?m)^\| \*\*Time\*\* \|.*$", "", s)                # checked against times.json above
        for n in NUMBER.findall(s):
            n = n.replace(" ", "")
            if re.fullmatch(r"0\d", n) or re.fullmatch(r"(19|20)\d\d", n):  # notebook numbers, years
                continue
            nums.add(n)
    return nums


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_numbers_in_prose_come_from_the_run_or_a_named_source(path):
    quoted = json.loads((ROOT / "notebooks" / "quoted_numbers.json").read_text()).get(path.stem, {})
    nb = load(path)
    text = _output_text(nb)
    outputs = [text, text.replace(" ", "")]          # as printed, and with the spaces of aligned columns dropped
    printed = lambda n: any(re.search(rf"(?<![\w.]){re.escape(n.rstrip('%×'))}(?![\d])", t) for t in outputs)
    missing = sorted(n for n in _prose_numbers(nb) if not printed(n) and n not in quoted)
    assert not missing, (f"{path.stem}: numbers in the prose that the run does not print and quoted_numbers.json "
                         f"does not source: {missing}")
    for n, source in quoted.items():
        if source.startswith("json:"):                # a measurement kept in a committed JSON: the prose must match it
            _, file, key = source.split(":", 2)
            value = json.loads((ROOT / file).read_text())
            for part in key.split("."):
                value = value[part]
            decimals = len(n.split(".")[1]) if "." in n else 0
            assert round(float(value), decimals) == float(n), (n, source, value)
    stale = sorted(n for n in quoted if n not in _prose_numbers(nb))
    assert not stale, f"{path.stem}: quoted_numbers.json lists numbers the prose no longer has: {stale}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_has_a_caption(path):
    cells = load(path).cells
    for i, c in enumerate(cells):
        if c.cell_type == "code":
            for name in re.findall(r"save_figure\([^,]+, \"(\w+)\"", c.source):
                caps = [x for x in cells[i + 1:i + 4] if "caption" in x.metadata.get("tags", [])]
                assert any(x.source.startswith(f"*Figure ({name.replace('_', ' ')}).") for x in caps), name


def test_each_notebooks_expected_metrics_name_the_run_that_timed_it():
    """A store writes a notebook's expected metrics and its time from one run; each notebook names that run
    (a store of some notebooks leaves the others' provenance as it was)."""
    expected = json.loads((ROOT / "notebooks" / "expected_metrics.json").read_text())
    times = json.loads((ROOT / "notebooks" / "times.json").read_text())
    for stem, run in times["runs"].items():
        stored = expected["notebooks"][stem]["stored"]
        assert Path(stored["run"]).name == run.split("/")[0], (stem, stored["run"], run)
        assert stored["arithmetic_path"]["torch_threads"] == int(times["threads"][stem]), stem

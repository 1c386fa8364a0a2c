"""nbval compares the words of the stored outputs with every number masked (notebooks/nbval_sanitize.cfg); the
numbers are checked as metrics (notebooks/conftest.py, notebooks/expected_metrics.json). So every number a stored
output shows must be one of its notebook's expected metrics, or a literal of its code (a parameter, a threshold);
and the masking must leave the words alone."""
import json
import math
import re
from pathlib import Path

import nbformat
import pytest

from ctxpatch_lite.arithmetic import flatten
from ctxpatch_lite.run_notebooks import NOTEBOOK_GLOB

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))
CFG = (ROOT / "notebooks" / "nbval_sanitize.cfg").read_text()
NUMBER = re.compile(re.search(r"\[numbers[^\n]*\]\nregex: (.*)\n", CFG).group(1))


def _outputs(nb) -> list[str]:
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                out.append(o["text"] if isinstance(o["text"], str) else "".join(o["text"]))
            for key in ("text/plain", "text/markdown", "text/html"):
                v = o.get("data", {}).get(key)
                if v and "image/png" not in o.get("data", {}):
                    out.append(v if isinstance(v, str) else "".join(v))
    return out


def _value(text: str):
    """(value, half a unit of its last printed digit) of a printed number."""
    t = text.replace("−", "-").replace(",", "")
    mant, _, exp = t.lower().partition("e")
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    half = 0.5 * 10.0 ** (-decimals) * (10.0 ** int(exp) if exp else 1.0)
    return float(t), half


def _literals(nb) -> set:
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return {float(m.group(0).replace(",", "").replace("−", "-")) for m in NUMBER.finditer(code)}


def unexplained_numbers(path: Path, expected: dict) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    flat = flatten(expected.get("notebooks", {}).get(path.stem, {}).get("values", {}))
    values = flat.values()
    metrics = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    literals = _literals(nb)
    for v in values:                 # a string metric is compared exactly: the numbers inside it are checked too
        if isinstance(v, str):
            literals |= {float(m.group(0).replace(",", "").replace("−", "-")) for m in NUMBER.finditer(v)}
    for key in flat:                 # and so are indices (a layer, a step): the metrics' keys hold them
        literals |= {float(part) for part in key.split(".") if part.isdigit()}
    missing = []
    for text in _outputs(nb):
        for m in NUMBER.finditer(text):
            s = m.group(0)
            if text[max(0, m.start() - 1):m.start()] == "#":      # an HTML colour (#999), not a number
                continue
            x, half = _value(s)
            pct = text[m.end():m.end() + 2].strip().startswith("%")
            ok = x in literals or any(abs(v - x) <= half * (1 + 1e-9) or (pct and abs(100 * v - x) <= half * (1 + 1e-9))
                                      for v in metrics)
            if not ok:
                missing.append(s)
    return missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_printed_number_is_a_metric_or_a_literal(path):
    expected = json.loads((ROOT / "notebooks" / "expected_metrics.json").read_text())
    missing = unexplained_numbers(path, expected)
    assert not missing, (f"{path.stem}: numbers in the stored outputs that are neither an expected metric nor a "
                         f"literal of the code (save them as metrics): {sorted(set(missing))[:40]}")


def test_masking_keeps_names_and_words():
    from nbval.plugin import get_sanitize_patterns
    pats = get_sanitize_patterns(CFG)
    s = "float32 h_g x86_64 Gemma3ForCausalLM layer 12: 3.1e-07, 1,647,360 values (−2.5 %), 20/20   tokens"
    for regex, rep in pats:
        s = re.sub(regex, rep, s)
    assert s == "float32 h_g x86_64 Gemma3ForCausalLM layer N: N, N values (N %), N/N tokens"
    ends = []
    for s in ("the ratio is 999.", "the ratio is 1.03e+03.", "the ratio is 0.5."):   # one value, on two CPUs
        for regex, rep in pats:
            s = re.sub(regex, rep, s)
        ends.append(s)
    assert ends == ["the ratio is N."] * 3
    ends = []
    for s in ("largest = 119, then", "largest = 62.3, then", "largest = 1,234, then"):   # a comma after a number stays
        for regex, rep in pats:
            s = re.sub(regex, rep, s)
        ends.append(s)
    assert ends == ["largest = N, then"] * 3

"""The claims ledger is computed from run JSON: verdicts follow the data, missing runs are 'not runnable here'."""
import copy
import json
from pathlib import Path

from ctxpatch_lite.claims import CLAIMS, CONTRADICTED, NOT_RUNNABLE, REPRODUCED, ledger, to_markdown

REF = Path(__file__).parent.parent / "data" / "reference"


def _write(folder, name, rec):
    rec = dict(rec, name=name)
    (folder / f"{name}.json").write_text(json.dumps(rec))


def test_ledger_on_committed_reference():
    rows = ledger(REF)
    assert len(rows) == len(CLAIMS)
    by = {r["id"]: r for r in rows}
    assert by["P1"]["verdict"] in (REPRODUCED, CONTRADICTED) and by["P1"]["tokens"] == 100
    assert by["P9"]["verdict"] == NOT_RUNNABLE
    assert "| P1 |" in to_markdown(rows)


def test_verdict_follows_the_data(tmp_path):
    base = json.loads((REF / "float32-naive-materialized-actual.json").read_text())
    _write(tmp_path, "float32-naive-materialized-actual", base)
    assert {r["id"]: r for r in ledger(tmp_path)}["P1"]["verdict"] == REPRODUCED
    bad = copy.deepcopy(base)
    bad["summary"]["n_match"] = bad["summary"]["n_tokens"] - 3
    _write(tmp_path, "float32-naive-materialized-actual", bad)
    row = {r["id"]: r for r in ledger(tmp_path)}["P1"]
    assert row["verdict"] == CONTRADICTED and f"({bad['summary']['n_tokens'] - 3}/" in row["measured"]
    assert {r["id"]: r for r in ledger(tmp_path)}["P3"]["verdict"] == NOT_RUNNABLE  # its run is absent

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
    assert len(rows) == len(CLAIMS) + 1          # + S5, judged on data/architectures
    by = {r["id"]: r for r in rows}
    assert by["S5"]["verdict"] == REPRODUCED and by["S5"]["measured"].startswith("15/15 families exact")
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


def test_architecture_claim_follows_the_data(tmp_path):
    src = REF.parent / "architectures"
    for dt in ("float64", "float32"):
        (tmp_path / f"{dt}.json").write_text((src / f"{dt}.json").read_text())
    assert {r["id"]: r for r in ledger(REF, tmp_path)}["S5"]["verdict"] == REPRODUCED
    data = json.loads((tmp_path / "float64.json").read_text())
    data["rows"][3]["max_block_rel_error"] = 1e-6
    (tmp_path / "float64.json").write_text(json.dumps(data))
    row = {r["id"]: r for r in ledger(REF, tmp_path)}["S5"]
    assert row["verdict"] == CONTRADICTED and row["measured"].startswith("14/15")
    (tmp_path / "float32.json").unlink()
    assert {r["id"]: r for r in ledger(REF, tmp_path)}["S5"]["verdict"] == NOT_RUNNABLE

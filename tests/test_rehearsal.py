"""The full-size rehearsal of the GPU run, on the CPU: a random-weight Gemma3ForCausalLM of google/gemma-3-1b-it's
shape (26 layers), saved as a local folder with the embedded tokenizer, through the compare CLI and notebooks 03 and
05 (papermill) exactly as a user with the real checkpoint would run them. Marked slow (several minutes)."""
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def folder():
    from ctxpatch_lite.fixtures import gemma3_1b_shaped
    return str(gemma3_1b_shaped(progress=False))


def _peak_children_gb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20


@pytest.mark.slow
def test_compare_cli_on_the_1b_shaped_model(folder, tmp_path):
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 26
    runs = {"float32 naive": ["--dtype", "float32"], "bfloat16 stable": ["--dtype", "bfloat16", "--variant", "stable"],
            "float32 last layer only": ["--dtype", "float32", "--start-layer", "last"],
            "float32 batched": ["--dtype", "float32", "--batched"]}
    report = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name.replace(' ', '_')}.json"
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "ctxpatch_lite.compare", "--model", folder, "--prompt",
                            "The capital of France is", "--tokens", "4", "--threads", "1", "--quiet", "--json",
                            str(out), *extra], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr[-2000:]
        rec = json.loads(out.read_text())
        assert rec["config"]["n_layers"] == 26 and rec["n_tokens"] == 4
        report[name] = {"token_match": f"{rec['summary']['n_match']}/4", "linf_median": rec["summary"]["linf_median"],
                        "seconds_per_token": rec["seconds"] / 4, "wall_seconds": round(time.time() - t0, 1),
                        "start_layer": rec["config"]["start_layer"], "peak_rss_gb_so_far": _peak_children_gb()}
    assert report["float32 naive"]["token_match"] == "4/4" and report["float32 batched"]["token_match"] == "4/4"
    assert report["float32 last layer only"]["start_layer"] == 25
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "rehearsal_compare.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


@pytest.mark.slow
def test_notebooks_03_and_05_on_the_1b_shaped_model(folder, tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "ctxpatch_lite.run_notebooks", "--only", "03", "05", "--model", folder,
                        "--out", str(tmp_path), "-p", "tokens", "2", "-p", "interactive", "false"],
                       capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["03_algorithm1"]["status"] == summary["05_ablations"]["status"] == "ok"
    assert summary["03_algorithm1"]["metrics"]["engine"]["n_match"] == 2
    report = {k: v["seconds"] for k, v in summary.items()}
    report.update(wall_seconds=round(time.time() - t0, 1), peak_rss_gb=_peak_children_gb())
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "rehearsal_notebooks.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))

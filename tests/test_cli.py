"""The compare CLI: a real run on a local model folder, JSON contents, and one-line errors for bad input."""
import json
import subprocess
import sys

import pytest

from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    gemma = root / "gemma"
    tiny_gemma3(seed=5).save_pretrained(gemma, safe_serialization=True)
    tiny_tokenizer().save_pretrained(gemma)
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = root / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(llama)
    tiny_tokenizer().save_pretrained(llama)
    return {"gemma": str(gemma), "llama": str(llama), "root": root}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "ctxpatch_lite.compare", "--quiet", "--threads", "1", *args],
                          capture_output=True, text=True, timeout=300)


def test_run_writes_json(folders):
    out = folders["root"] / "run.json"
    r = cli("--model", folders["gemma"], "--prompt", "hello world", "--tokens", "4", "--dtype", "float64",
            "--variant", "stable", "--apply", "materialized", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "token match" in r.stdout and "100.0% (4/4)" in r.stdout
    d = json.loads(out.read_text())
    assert d["n_tokens"] == 4 and d["token_match"] == 1.0 and len(d["linf"]) == len(d["tvd"]) == 4
    assert max(d["linf"]) <= 1e-10
    s = d["steps"][0]
    assert {"baseline_token", "patched_token", "match", "linf", "tvd"} <= set(s)
    assert isinstance(s["baseline_token"], int)
    c = d["config"]
    assert d["schema_version"] == 2
    for key in ("variant", "start_layer", "apply", "h_source", "schedule", "parts", "family", "dtype", "patch_dtype", "model", "casts",
                "chat_template", "environment"):
        assert key in c
    assert c["variant"] == "stable" and c["dtype"] == "float64" and c["chat_template"] is False
    assert d["prompt_encoding"].startswith("plain")


def test_batched_flag_and_its_limits(folders, tmp_path):
    out = tmp_path / "b.json"
    r = cli("--model", folders["gemma"], "--prompt", "hello world", "--tokens", "3", "--batched", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["config"]["path"].startswith("batched")
    r = cli("--model", folders["gemma"], "--prompt", "hello", "--batched", "--apply", "materialized")
    assert r.returncode == 2 and "factored" in r.stderr and "Traceback" not in r.stderr


def test_prompt_file_pools_prompts(folders, tmp_path):
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps([{"id": "a", "text": "hello"}, {"id": "b", "text": "world!"}]))
    out = tmp_path / "o.json"
    r = cli("--model", folders["gemma"], "--prompt-file", str(pf), "--tokens", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["n_tokens"] == 6 and len(d["runs"]) == 2 and "ALL" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--dtype", "float16"], "unknown dtype 'float16'"),
    (["--variant", "fancy"], "unknown variant 'fancy'"),
    (["--mode", "nope"], "unknown mode 'nope'"),
    (["--schedule", "nope"], "unknown schedule 'nope'"),
    (["--parts", "half"], "unknown parts 'half'"),
    (["--mode", "none", "--parts", "none"], "give one or the other"),
    (["--start-layer", "4"], "start_layer 4 is out of range"),
    (["--start-layer", "middle"], "start_layer 'middle' is not a layer"),
    (["--tokens", "0"], "--tokens must be at least 1"),
])
def test_bad_arguments_one_line(folders, args, needle):
    r = cli("--model", folders["gemma"], "--prompt", "hello", *args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_empty_prompt_and_unsupported_architecture(folders):
    r = cli("--model", folders["gemma"], "--prompt", "   ")
    assert r.returncode == 2 and "prompt is empty" in r.stderr and "Traceback" not in r.stderr
    r = cli("--model", folders["llama"], "--prompt", "hello", "--variant", "stable")
    assert r.returncode == 2 and "needs a trainable post-norm scale" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("--model", folders["llama"], "--prompt", "hello", "--tokens", "2")   # every registered family runs
    assert r.returncode == 0, r.stderr
    r = cli("--model", folders["gemma"], "--prompt", "hi", "--chat-template")
    assert r.returncode == 2 and "chat template" in r.stderr


def test_legacy_mode_maps_with_a_note(folders, tmp_path):
    out = tmp_path / "m.json"
    r = cli("--model", folders["gemma"], "--prompt", "hello world", "--tokens", "2", "--mode", "ideal", "--json",
            str(out))
    assert r.returncode == 0, r.stderr
    assert "runs as --schedule oracle --parts full" in r.stderr
    c = json.loads(out.read_text())["config"]
    assert (c["schedule"], c["parts"]) == ("oracle", "full")


def test_start_layer_last(folders, tmp_path):
    out = tmp_path / "last.json"
    r = cli("--model", folders["gemma"], "--prompt", "hello world", "--tokens", "2", "--start-layer", "last",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    c = json.loads(out.read_text())["config"]
    assert c["start_layer"] == 3 and c["start_layer_spec"] == "last"
    assert json.loads(out.read_text())["steps"][0]["diagnostics"]["per_layer"]["layer"] == [3]

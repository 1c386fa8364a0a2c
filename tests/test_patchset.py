"""absorb and PatchSet: every form exact in its own arithmetic, save/load bit for bit, merge/restore, peft, refusals."""
import pytest
import torch

import ctxpatch_lite as cp
import ctxpatch_lite.patchset
from helpers import CONTEXT_IDS, assert_bit_identical, snapshot
from ctxpatch_lite.algorithm import Algorithm1, PatchConfig
from ctxpatch_lite.families import FAMILIES
from ctxpatch_lite.fixtures import tiny_gemma3, tiny_model

PROMPT = [5, 17, 33, 8, 90, 41, 12]


@torch.no_grad()
def query_logits(model, ids):
    return model(torch.tensor([[ids[-1]]]), position_ids=torch.tensor([[len(ids) - 1]])).logits[0, -1]


@torch.no_grad()
def baseline(model, ids):
    alg = Algorithm1(model)
    return alg.full_context(ids)[0]


@torch.no_grad()
def peft_logits(model, path, ids):
    from peft import PeftModel
    pm = PeftModel.from_pretrained(model, str(path))
    try:
        return pm(torch.tensor([[ids[-1]]]), position_ids=torch.tensor([[len(ids) - 1]])).logits[0, -1]
    finally:
        cp.patchset.unload_peft(pm)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_absorb_every_family_float64(family):
    model = tiny_model(family, dtype="float64")
    ps = cp.absorb(model, PROMPT)
    base = baseline(model, PROMPT)
    alg = Algorithm1(model)
    with ps.applied(model), alg.norms():
        got = query_logits(model, PROMPT)
    assert float((got - base).abs().max()) <= 1e-10
    assert ps.baseline_token == int(base.argmax())


@pytest.mark.parametrize("variant", ["naive", "stable"])
def test_every_form_reproduces_the_full_context_float32(tmp_path, variant):
    model = tiny_gemma3(seed=0, dtype="float32")
    snap = snapshot(model)
    ps = cp.absorb(model, CONTEXT_IDS, config=PatchConfig(variant=variant))
    base = baseline(model, CONTEXT_IDS)
    assert float((query_logits(model, CONTEXT_IDS) - base).abs().max()) > 0.1   # the context matters
    with ps.applied(model):
        applied = query_logits(model, CONTEXT_IDS)
    restore = ps.merge_into(model)
    merged = query_logits(model, CONTEXT_IDS)
    restore()
    assert_bit_identical(model, snap)
    ps.to_peft(tmp_path / "lora", model)
    assert_bit_identical(model, snap)                                          # to_peft leaves the model as it was
    lora = peft_logits(model, tmp_path / "lora", CONTEXT_IDS)
    for name, got in (("applied", applied), ("merged", merged), ("peft", lora)):
        assert float((got - base).abs().max()) <= 1e-4, name
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    assert_bit_identical(model, snap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_then_restore_is_bit_identical(dtype):
    model = tiny_gemma3(seed=1, dtype=dtype)
    snap = snapshot(model)
    ps = cp.absorb(model, CONTEXT_IDS, config=PatchConfig(variant="stable"))
    restore = ps.merge_into(model)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, snap[k])]
    assert any("gate_proj" in k for k in changed) and any("post_feedforward_layernorm" in k for k in changed)
    restore()
    assert_bit_identical(model, snap)


def test_save_load_is_bit_identical(tmp_path):
    model = tiny_gemma3(seed=0, dtype="float32")
    ps = cp.absorb(model, CONTEXT_IDS, config=PatchConfig(variant="stable"))
    restore = ps.merge_into(model)          # builds the materialized form too
    merged = query_logits(model, CONTEXT_IDS)
    restore()
    with ps.applied(model):
        applied = query_logits(model, CONTEXT_IDS)
    ps.save(tmp_path / "p.patch")
    assert not any(p.suffix == ".bin" for p in (tmp_path / "p.patch").iterdir())
    ps2 = cp.PatchSet.load(tmp_path / "p.patch", model=model)
    assert set(ps2.forms) == {"factored", "materialized"} and ps2.query_id == CONTEXT_IDS[-1]
    with ps2.applied(model):
        assert torch.equal(query_logits(model, CONTEXT_IDS), applied)
    restore = ps2.merge_into(model)
    assert torch.equal(query_logits(model, CONTEXT_IDS), merged)
    restore()
    # factors and vectors only: no tensor in the file is a dense (out, in) matrix
    from safetensors.torch import load_file
    t = load_file(str(tmp_path / "p.patch" / "patches.safetensors"))
    assert all(v.dim() <= 2 and v.shape[0] == 1 for k, v in t.items() if not k.startswith("targets/"))


def test_mismatched_model_is_refused(tmp_path):
    model = tiny_gemma3(seed=0, dtype="float32")
    ps = cp.absorb(model, CONTEXT_IDS)
    ps.save(tmp_path / "p")
    with pytest.raises(cp.PatchSetMismatch, match="other weights"):
        cp.PatchSet.load(tmp_path / "p", model=tiny_gemma3(seed=9, dtype="float32"))
    with pytest.raises(cp.PatchSetMismatch, match="dtype = 'float32'.*'bfloat16'"):
        cp.PatchSet.load(tmp_path / "p", model=tiny_gemma3(seed=0, dtype="bfloat16"))
    with pytest.raises(cp.PatchSetMismatch, match="class"):
        ps.merge_into(tiny_model("llama", dtype="float32"))
    with pytest.raises(FileNotFoundError, match="not a saved PatchSet"):
        cp.PatchSet.load(tmp_path)


def test_table_and_metadata():
    model = tiny_gemma3(seed=0, dtype="float32")
    ps = cp.absorb(model, CONTEXT_IDS, config=PatchConfig(variant="stable", start_layer=1))
    df = ps.table()
    assert list(df.index) == [1, 2, 3]
    for col in ("||dW_gate_proj||", "||dW_up_proj||", "||dW_down||", "||dm||", "rank", "min|h|", "fallbacks",
                "hard case"):
        assert col in df.columns, col
    assert (df["rank"] == 1).all() and (df["||dW_gate_proj||"] > 0).all()
    meta = ps._meta()
    assert meta["context_ids"] == CONTEXT_IDS and meta["position"] == len(CONTEXT_IDS) - 1
    assert "one query token" in meta["valid_for"] and meta["model"]["family"] == "gemma3"


def test_absorb_refusals_and_peft_limits(tmp_path):
    model = tiny_gemma3(seed=0, dtype="float32")
    with pytest.raises(ValueError, match="no tokenizer"):
        cp.absorb(model, "hello")
    with pytest.raises(ValueError, match="context before the query"):
        cp.absorb(model, [5])
    with pytest.raises(ValueError, match="schedule 'selfcorrect' or 'ideal'"):
        cp.absorb(model, CONTEXT_IDS, config=PatchConfig(schedule="oracle"))
    gpt2 = tiny_model("gpt2", dtype="float32")
    with pytest.raises(ValueError, match="peft cannot express this patch set: gpt2's output patch is a bias"):
        cp.absorb(gpt2, PROMPT).to_peft(tmp_path / "x", gpt2)


def test_ideal_schedule_patch_set_applies_its_patches_on_actual_outputs():
    model = tiny_model("gemma3", dtype="float64")
    ps = cp.absorb(model, PROMPT, config=PatchConfig(schedule="ideal"))
    with ps.applied(model), Algorithm1(model).norms():
        got = query_logits(model, PROMPT)
    assert float((got - baseline(model, PROMPT)).abs().max()) <= 1e-9    # exact arithmetic: ideal = actual


@pytest.mark.real
def test_embedded_every_form_on_the_five_prompts(embedded, prompts, tmp_path):
    model, tok = embedded
    snap = snapshot(model)
    for p in prompts:
        ps = cp.absorb(model, p["text"], tokenizer=tok)
        ids = ps.context_ids
        base = baseline(model, ids)
        with ps.applied(model):
            applied = query_logits(model, ids)
        restore = ps.merge_into(model)
        merged = query_logits(model, ids)
        restore()
        ps.to_peft(tmp_path / p["id"], model)
        lora = peft_logits(model, tmp_path / p["id"], ids)
        ps.save(tmp_path / f"{p['id']}.patch")      # a reload is bit-identical on the real model too (alignment)
        with cp.PatchSet.load(tmp_path / f"{p['id']}.patch", model=model).applied(model):
            assert torch.equal(query_logits(model, ids), applied), p["id"]
        for name, got in (("applied", applied), ("merged", merged), ("peft", lora)):
            err = float((got - base).abs().max())
            assert err <= 1e-4, (p["id"], name, err)
        assert_bit_identical(model, snap)

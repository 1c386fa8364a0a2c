"""Algorithm 1 over all layers: exactness, controls that must fail, start layer, modes, bit-exact restore."""
import pytest
import torch

from helpers import CONTEXT_IDS, assert_bit_identical, snapshot
from ctxpatch_lite.algorithm import PARTS, SCHEDULES, Algorithm1, PatchConfig
from ctxpatch_lite.hooks import UnsupportedArchitectureError
from ctxpatch_lite.metrics import compare_logits
from ctxpatch_lite.patches import PatchError
from ctxpatch_lite.protocol import run_protocol


def one_step(model, **cfg):
    alg = Algorithm1(model, PatchConfig(**cfg))
    logits, T, _ = alg.full_context(CONTEXT_IDS)
    q, rec = alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)
    return compare_logits(logits, q), rec


@pytest.mark.parametrize("variant", ["naive", "stable"])
@pytest.mark.parametrize("apply", ["factored", "materialized"])
@pytest.mark.parametrize("h_source", ["actual", "recorded"])
def test_algorithm1_exact_float64(tiny64, variant, apply, h_source):
    m, rec = one_step(tiny64, variant=variant, apply=apply, h_source=h_source)
    assert m["match"] and m["linf"] <= 1e-10, m
    assert len(rec.patches) == 4


@pytest.mark.parametrize("cfg,exact", [({"schedule": "ideal"}, True), ({"schedule": "oracle"}, True),
                                        ({"parts": "none"}, False), ({"parts": "input-only"}, False),
                                        ({"parts": "vanilla"}, False)])
def test_controls_float64(tiny64, cfg, exact):
    m, _ = one_step(tiny64, **cfg)
    if exact:
        assert m["linf"] <= 1e-10
    else:
        assert m["linf"] > 0.1, m  # the control must fail visibly: that shows the check can fail


@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_start_layer_exact_in_float64(tiny64, start):
    m, rec = one_step(tiny64, start_layer=start)
    assert sorted(rec.patches) == list(range(start, 4))
    assert m["linf"] <= 1e-10
    if start > 0:  # the first patched layer absorbs the accumulated context effect
        assert rec.patches[start].diagnostics.dv_norm > 0


def test_start_layer_out_of_range(tiny64):
    with pytest.raises(ValueError, match=r"start_layer 4 is out of range: this model has 4 decoder layers"):
        Algorithm1(tiny64, PatchConfig(start_layer=4))
    with pytest.raises(ValueError, match="out of range"):
        Algorithm1(tiny64, PatchConfig(start_layer=-5))
    with pytest.raises(ValueError, match="fraction of depth must lie in"):
        Algorithm1(tiny64, PatchConfig(start_layer=1.5))
    with pytest.raises(ValueError, match="is not a layer"):
        Algorithm1(tiny64, PatchConfig(start_layer="middle"))


@pytest.mark.parametrize("spec,layer", [("last", 3), (-1, 3), (-4, 0), ("first", 0), (0.5, 2), (1.0, 3), ("0.25", 1),
                                        ("-2", 2), (2, 2)])
def test_start_layer_relative_to_the_model(tiny64, spec, layer):
    alg = Algorithm1(tiny64, PatchConfig(start_layer=spec))
    assert alg.config.start_layer == layer and alg.config.to_dict()["start_layer_spec"] == spec
    m, rec = one_step(tiny64, start_layer=spec)
    assert sorted(rec.patches) == list(range(layer, 4)) and m["linf"] <= 1e-10


@pytest.mark.parametrize("field,value", [("variant", "fancy"), ("mode", "oops"), ("apply", "dense"),
                                         ("h_source", "guess"), ("patch_dtype", "float16"), ("schedule", "lazy"),
                                         ("parts", "half")])
def test_bad_config_names(tiny64, field, value):
    with pytest.raises(ValueError, match=f"unknown {field}"):
        Algorithm1(tiny64, PatchConfig(**{field: value}))


def test_legacy_modes_map_onto_schedule_and_parts():
    assert (PatchConfig(mode="none").schedule, PatchConfig(mode="none").parts) == ("selfcorrect", "none")
    with pytest.warns(UserWarning, match="now runs as schedule='oracle'"):
        c = PatchConfig(mode="ideal")
    assert (c.schedule, c.parts) == ("oracle", "full")
    assert PatchConfig.from_dict({"mode": "ideal", "variant": "stable"}).schedule == "oracle"
    from ctxpatch_lite.protocol import upgrade_record
    old = upgrade_record({"config": {"mode": "vanilla"}})
    assert (old["config"]["schedule"], old["config"]["parts"], old["schema_version"]) == ("selfcorrect", "vanilla", 1)


def test_restore_bit_identical_after_every_schedule_and_parts(tiny32):
    snap = snapshot(tiny32)
    runs = [{"schedule": s} for s in SCHEDULES] + [{"parts": p} for p in PARTS]
    for cfg in runs:
        for apply in ("factored", "materialized"):
            for variant in ("naive", "stable"):
                run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=3, progress=False,
                             config=PatchConfig(apply=apply, variant=variant, **cfg))
                assert_bit_identical(tiny32, snap)


def test_restore_after_error_mid_pass():
    from ctxpatch_lite.fixtures import tiny_gemma3
    model = tiny_gemma3(seed=2, dtype="float32")
    with torch.no_grad():
        model.model.layers[2].pre_feedforward_layernorm.weight.fill_(-1.0)  # z == 0 at layer 2
    snap = snapshot(model)
    alg = Algorithm1(model, PatchConfig(apply="materialized"))
    _, T, _ = alg.full_context(CONTEXT_IDS)
    with pytest.raises(PatchError):
        alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)  # layers 0, 1 were already written
    assert_bit_identical(model, snap)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_fixed_mode_reuses_first_patches(tiny32):
    out = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=4, progress=False, config=PatchConfig(schedule="fixed"))
    sel = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=4, progress=False)
    assert out["steps"][0]["linf"] == pytest.approx(sel["steps"][0]["linf"], abs=1e-5)
    # step 0 is freshly patched; the summary counts the reused steps on their own
    assert [bool(s.get("reused")) for s in out["steps"]] == [False, True, True, True]
    reused = out["summary"]["reused"]
    assert reused["n_tokens"] == 3 and reused["n_match"] == sum(s["match"] for s in out["steps"][1:])
    # later steps reuse stale patches: the same dm at every step, and the distributions drift
    dms = [s["diagnostics"]["dm_norm"] for s in out["steps"]]
    assert len(set(dms)) == 1
    assert max(s["linf"] for s in out["steps"][1:]) > 100 * max(s["linf"] for s in sel["steps"][1:])


def test_protocol_records(tiny32):
    r = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=5, progress=False)
    assert r["n_tokens"] == 5 and len(r["steps"]) == 5 and len(r["linf"]) == 5
    for i, s in enumerate(r["steps"]):
        assert s["position"] == len(CONTEXT_IDS) - 1 + i
        for key in ("baseline_token", "patched_token", "match", "linf", "tvd", "rank_corr", "top1_diff"):
            assert key in s
        assert s["diagnostics"]["patched_layers"] == 4
    assert r["generated_ids"] == [s["baseline_token"] for s in r["steps"]]  # forced onto the baseline's tokens
    assert r["summary"]["n_tokens"] == 5 and r["config"]["environment"]["torch"]


def test_baseline_matches_plain_greedy_generation(tiny32):
    r = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=6, progress=False)
    ids = torch.tensor([CONTEXT_IDS])
    gen = tiny32.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    assert r["generated_ids"] == gen[0, len(CONTEXT_IDS):].tolist()


def test_unsupported_architecture_names_missing_property():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    llama = LlamaForCausalLM(cfg)
    Algorithm1(llama)  # the one engine runs every registered family
    with pytest.raises(ValueError, match="variant 'stable' needs a trainable post-norm scale"):
        Algorithm1(llama, PatchConfig(variant="stable"))
    cfg.model_type = "bert"
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'bert' has no adapter"):
        Algorithm1(llama)


@pytest.mark.real
def test_embedded_float32_all_prompts(embedded, prompts):
    model, tok = embedded
    snap = snapshot(model)
    linfs, n_match, n = [], 0, 0
    for p in prompts:
        r = run_protocol(model, tok, p["text"], 20, PatchConfig(), progress=False)
        n_match += r["summary"]["n_match"]
        n += r["n_tokens"]
        linfs += r["linf"]
    assert n == 100 and n_match == 100
    assert sorted(linfs)[len(linfs) // 2] <= 1e-4
    neg = run_protocol(model, tok, prompts[0]["text"], 20, PatchConfig(parts="none"), progress=False)
    assert neg["summary"]["token_match"] <= 0.2 and min(neg["linf"]) > 1.0
    assert_bit_identical(model, snap)


@pytest.mark.parametrize("variant", ["naive", "stable"])
@pytest.mark.parametrize("mode", [{"schedule": "selfcorrect"}, {"schedule": "ideal"}, {"schedule": "oracle"},
                                  {"parts": "input-only"}, {"parts": "vanilla"}, {"parts": "none"}])
def test_batched_agrees_with_loop(tiny32, variant, mode):
    cfg = PatchConfig(variant=variant, **mode)
    loop = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=6, progress=False, config=cfg)
    bat = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=6, progress=False, config=cfg, batched=True)
    assert bat["generated_ids"] == loop["generated_ids"]
    assert [s["patched_token"] for s in bat["steps"]] == [s["patched_token"] for s in loop["steps"]]
    for a, b in zip(bat["steps"], loop["steps"]):
        assert a["position"] == b["position"]
        if mode.get("schedule") in ("selfcorrect", "oracle"):   # ideal has no self-correction (notebook 05)
            assert a["linf"] <= 1e-4 and b["linf"] <= 1e-4
        assert a["diagnostics"].get("patched_layers") == b["diagnostics"].get("patched_layers")


def test_batched_exact_float64_and_per_row_patches(tiny64):
    r = run_protocol(tiny64, prompt_ids=CONTEXT_IDS, n_tokens=5, progress=False, batched=True,
                     config=PatchConfig(variant="stable"))
    assert max(r["linf"]) <= 1e-10 and r["config"]["path"].startswith("batched")
    dms = [s["diagnostics"]["dm_norm"] for s in r["steps"]]
    assert len(set(dms)) == 5  # one patch per row, not one shared patch


def test_batched_rejects_sequential_modes(tiny32):
    with pytest.raises(ValueError, match="step by step"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=2, progress=False, batched=True,
                     config=PatchConfig(schedule="fixed"))
    with pytest.raises(ValueError, match="factored"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=2, progress=False, batched=True,
                     config=PatchConfig(apply="materialized"))


def test_ideal_schedule_builds_from_recorded_inputs_and_runs_on_actual_outputs(tiny64):
    """In exact arithmetic the three schedules agree; the record says which pass built the patches."""
    alg = Algorithm1(tiny64, PatchConfig(schedule="ideal"))
    logits, T, _ = alg.full_context(CONTEXT_IDS)
    q, rec = alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)
    assert float((q - logits).abs().max()) <= 1e-10
    assert sorted(rec.patches) == [0, 1, 2, 3] and all(rec.patches[l].diagnostics.block_error <= 1e-12 for l in range(4))


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_three_schedules_on_the_embedded_model(prompts, dtype):
    """Findings, not targets: each schedule runs and records a per-layer error for every step; selfcorrect and
    oracle (fed the recorded inputs) keep every token in float32."""
    from ctxpatch_lite import load_model
    model, tok = load_model(dtype=dtype, device="cpu")
    got = {}
    for schedule in ("selfcorrect", "ideal", "oracle"):
        r = run_protocol(model, tok, prompts[0]["text"], 4, PatchConfig(schedule=schedule), progress=False,
                         batched=True)
        assert r["config"]["schedule"] == schedule and r["n_tokens"] == 4
        for s in r["steps"]:
            errs = s["diagnostics"]["per_layer"]["block_error"]
            assert len(errs) == model.config.num_hidden_layers and all(e == e for e in errs)
        got[schedule] = r["summary"]["n_match"]
    if dtype == "float32":
        assert got["selfcorrect"] == got["oracle"] == 4


def test_run_record_is_typed_and_round_trips(tiny32):
    import json
    from ctxpatch_lite.records import SCHEMA_VERSION, RunRecord
    r = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=3, progress=False, config=PatchConfig(schedule="fixed"))
    assert r["schema_version"] == SCHEMA_VERSION
    typed = RunRecord.from_dict(json.loads(json.dumps(r)))
    assert typed.steps[1].reused and typed.steps[0].reused is None and typed.config["schedule"] == "fixed"
    assert typed.to_dict() == json.loads(json.dumps(r))
    old = {"config": {"mode": "ideal"}, "steps": [], "summary": {"token_match": 1.0}}
    assert RunRecord.from_dict(old).config["schedule"] == "oracle" and RunRecord.from_dict(old).schema_version == 1


@pytest.mark.real
def test_bfloat16_stable_recorded_on_the_embedded_model_materialized_and_factored(prompts):
    """bfloat16 on the real model, the reading the paper's bfloat16 story turns on (stable, recorded h): both
    apply modes keep the patched logits within a few bfloat16 ulps of the baseline (unpatched: L∞ ≈ 24), and the
    materialized passes leave every bfloat16 weight bit for bit as it was."""
    from helpers import assert_bit_identical, snapshot
    from ctxpatch_lite import load_model
    model, tok = load_model(dtype="bfloat16", device="cpu")
    snap = snapshot(model)
    for apply in ("materialized", "factored"):
        r = run_protocol(model, tok, prompts[0]["text"], 3, PatchConfig(variant="stable", h_source="recorded",
                                                                        apply=apply), progress=False)
        assert r["config"]["dtype"] == "bfloat16" and r["config"]["patch_dtype"] == "float32"
        assert r["summary"]["linf_max"] <= 1.0, (apply, r["summary"])
        assert_bit_identical(model, snap)
    none = run_protocol(model, tok, prompts[0]["text"], 1, PatchConfig(parts="none"), progress=False)
    assert none["summary"]["linf_max"] > 5.0          # the control: without patches the logits are far off


def test_free_running_follows_the_patched_models_own_tokens(tiny32):
    """forcing='patched': the history grows by the patched model's token; the record says how long its text stays
    the baseline's greedy text. With the output patch dropped the two texts part at the first mismatch."""
    r = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=4, progress=False, forcing="patched")
    assert r["config"]["forcing"] == "patched" and r["free"]["identical_prefix"] == 4
    assert [s["next_token"] for s in r["steps"]] == [s["patched_token"] for s in r["steps"]]
    assert r["free"]["baseline_greedy_ids"] == r["generated_ids"]
    bad = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=4, progress=False, forcing="patched",
                       config=PatchConfig(parts="input-only"))
    first = bad["summary"]["first_mismatch"]
    assert first is not None and bad["free"]["identical_prefix"] == first
    assert [s["next_token"] for s in bad["steps"]] == [s["patched_token"] for s in bad["steps"]]
    with pytest.raises(ValueError, match="forcing"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=2, progress=False, forcing="teacher")
    with pytest.raises(ValueError, match="step by step"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=2, progress=False, forcing="patched", batched=True)


def test_patch_anatomy_diagnostics(tiny32):
    """dm_top_share, matrix_rel and dm_rel (the ledger's sparsity and magnitude figures) from their definitions."""
    import math
    from ctxpatch_lite.algorithm import Algorithm1
    alg = Algorithm1(tiny32, PatchConfig())
    logits, T, _ = alg.full_context(CONTEXT_IDS)
    _, rec = alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)
    top = tot = mat = mref = dm = sref = 0.0
    for l, p in rec.patches.items():
        d = p.dm.double().reshape(-1)
        k = max(1, math.ceil(0.01 * d.numel()))
        top += float(d.pow(2).topk(k).values.sum()); tot += float(d.pow(2).sum())
        layer = tiny32.model.layers[l]
        mat += sum(float(r.fro()[0]) ** 2 for r in p.inputs.values())
        mref += float(layer.mlp.gate_proj.weight.double().norm()) ** 2 + float(layer.mlp.up_proj.weight.double().norm()) ** 2
        dm += float(d.norm()) ** 2
        sref += float((1.0 + layer.post_feedforward_layernorm.weight.double()).norm()) ** 2
    r = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=1, progress=False)
    diag = r["steps"][0]["diagnostics"]
    assert diag["dm_top_share"] == pytest.approx(top / tot, rel=1e-6)
    assert diag["matrix_rel"] == pytest.approx(math.sqrt(mat / mref), rel=1e-5)
    assert diag["dm_rel"] == pytest.approx(math.sqrt(dm / sref), rel=1e-5)


def test_batched_with_known_greedy_tokens_gives_the_same_record(tiny32):
    """``greedy``: a batched run told the baseline's tokens (another run's generated_ids) skips the decode and
    records the same steps; it is refused where it cannot apply."""
    first = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=5, progress=False, batched=True)
    again = run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=4, progress=False, batched=True,
                         greedy=first["generated_ids"])
    assert again["generated_ids"] == first["generated_ids"][:4]
    for a, b in zip(again["steps"], first["steps"]):
        assert a["patched_token"] == b["patched_token"] and a["linf"] == pytest.approx(b["linf"], abs=1e-6)
    with pytest.raises(ValueError, match="batched=True"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=2, progress=False, greedy=first["generated_ids"])
    with pytest.raises(ValueError, match="at least n_tokens"):
        run_protocol(tiny32, prompt_ids=CONTEXT_IDS, n_tokens=9, progress=False, batched=True,
                     greedy=first["generated_ids"])

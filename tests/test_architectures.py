"""The one engine on every family (paper Section 5, Table 1): exactness on every path, error paths, Appendix D/E."""
import json

import pytest
import torch

from ctxpatch_lite.algorithm import Algorithm1, PatchConfig
from ctxpatch_lite.architectures import algorithm1_step, single_block_errors, tiny_model, verify_family
from ctxpatch_lite.engine import LayerSpec, PatchedPass
from ctxpatch_lite.families import FAMILIES, Adapter, family_of
from ctxpatch_lite.hooks import UnsupportedArchitectureError
from ctxpatch_lite.patches import PatchError
from ctxpatch_lite.protocol import run_protocol

from helpers import assert_bit_identical, snapshot

PROMPT = [5, 17, 33, 8, 90, 41, 12]


def run(model, n_tokens, batched=False, **cfg):
    r = run_protocol(model, prompt_ids=PROMPT, n_tokens=n_tokens, config=PatchConfig(**cfg), progress=False,
                     batched=batched)
    r["max_block_error"] = max(s["diagnostics"].get("max_block_error", 0.0) for s in r["steps"])
    return r


def paths(model):
    """Every way the engine can run Algorithm 1 on this model's family."""
    out = {"factored": {}, "materialized": {"apply": "materialized"}, "batched": {"batched": True}}
    if Adapter(model).stable_ok:
        out["stable"] = {"variant": "stable"}
        out["stable-batched"] = {"variant": "stable", "batched": True}
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_algorithm1_is_exact_on_every_path_and_restores_weights(family):
    model = tiny_model(family, dtype="float64")
    snap = snapshot(model)
    for name, kw in paths(model).items():
        res = run(model, 4, **kw)
        assert res["summary"]["n_match"] == res["n_tokens"] == 4, name
        assert res["max_block_error"] <= 1e-10, (name, res["max_block_error"])
        assert res["summary"]["linf_max"] <= 1e-10, name
        assert res["summary"]["fallbacks_total"] == 0
    none = run(model, 4, parts="none")
    assert none["summary"]["linf_median"] > 1e-3          # the context matters: the unpatched control is far off
    single = single_block_errors(model, PROMPT)
    assert len(single) == model.config.num_hidden_layers and max(single) <= 1e-10
    assert_bit_identical(model, snap)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_token_match_on_every_path(family):
    model = tiny_model(family, dtype="float32")
    loop = run(model, 3)
    for name, kw in paths(model).items():
        res = run(model, 3, **kw)
        assert res["summary"]["n_match"] == 3 and res["summary"]["linf_max"] < 1e-4, name
        assert [s["patched_token"] for s in res["steps"]] == [s["patched_token"] for s in loop["steps"]], name


def test_patches_are_rank1_with_conv1d_layout_handled():
    model = tiny_model("gpt2")
    *_, patches = algorithm1_step(model, PROMPT)
    r1 = patches[0].inputs["c_fc"]
    s = torch.linalg.svdvals(r1.dense())
    assert s[1] <= 1e-12 * s[0]
    assert patches[0].output["bias"].shape == (1, model.config.n_embd)


def test_moe_routing_and_gate_sums():
    for family, renormalised in (("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", False)):
        model = tiny_model(family)
        *_, patches = algorithm1_step(model, PROMPT)
        for p in patches.values():
            d, experts = p.diagnostics, p.extra["experts"][0].tolist()
            assert d.routing_match and len(experts) == model.config.num_experts_per_tok
            assert (abs(d.S - 1) < 1e-6) == renormalised, (family, d.S)
            assert set(p.output) == {f"expert{e}.row0.down" for e in experts}
    qwen = tiny_model("qwen2_moe")
    *_, patches = algorithm1_step(qwen, PROMPT)
    assert {"shared.gate_proj", "shared.up_proj", "shared_gate", "router"} <= set(patches[0].inputs)


def test_start_layer_patches_only_upper_layers():
    model = tiny_model("llama")
    res = run(model, 2, start_layer=2)
    assert res["summary"]["n_match"] == 2 and res["steps"][0]["diagnostics"]["per_layer"]["layer"] == [2]
    with pytest.raises(ValueError, match="start_layer 3 is out of range"):
        run(model, 1, start_layer=3)


# -- conditions as errors or counts -----------------------------------------------------------------------------
def test_unknown_architecture_names_what_is_missing():
    from transformers import BertConfig
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'bert' has no adapter.*output-controllable"):
        family_of(BertConfig())


def test_post_norm_without_trainable_scale_is_refused():
    model = tiny_model("olmo2")
    for layer in model.model.layers:
        layer.post_feedforward_layernorm = torch.nn.RMSNorm(model.config.hidden_size, eps=1e-6,
                                                            elementwise_affine=False).double()
    with pytest.raises(UnsupportedArchitectureError, match="no trainable scale.*Appendix D"):
        Adapter(model)


def test_missing_module_is_named():
    model = tiny_model("llama")
    del model.model.layers[1].mlp.down_proj
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1 .* no mlp.down_proj"):
        Adapter(model)


def test_zero_mlp_input_raises_naming_the_layer():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.zero_()
    snap = snapshot(model)
    with pytest.raises(PatchError, match="layer 1: the MLP input z is the zero vector"):
        run(model, 1, apply="materialized")
    assert_bit_identical(model, snap)          # layer 0's patch was written before the error; it is restored


def test_zero_hidden_raises_for_the_output_matrix():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.zero_()   # silu(0) * up = 0
    with pytest.raises(PatchError, match="layer 0: the MLP hidden h is the zero vector"):
        run(model, 1, apply="materialized")


def test_zero_normalised_output_coordinates_are_counted():
    model = tiny_model("olmo2")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[3].zero_()   # y_3 = 0, so h_3 = N(y)_3 = 0
    res = run(model, 2)
    assert res["summary"]["fallbacks_total"] == 2             # one coordinate, two steps, counted
    step = algorithm1_step(model, PROMPT)
    assert step[4][0].diagnostics.fallbacks == 1 and step[4][0].diagnostics.min_abs_h == 0.0


def test_zero_gate_sum_raises(monkeypatch):
    model = tiny_model("qwen2_moe")
    router = model.model.layers[0].mlp.gate
    orig = router.forward

    def zero_scores(h):
        logits, scores, idx = orig(h)
        return logits, torch.zeros_like(scores), idx
    monkeypatch.setattr(router, "forward", zero_scores)
    alg = Algorithm1(model)
    _, targets, _ = alg.full_context(PROMPT)
    for apply in ("factored", "materialized"):
        with pytest.raises(PatchError, match="layer 0: the selected experts' gates sum to S = 0"):
            with PatchedPass(alg.adapter, {0: LayerSpec(targets=targets[0])}, apply=apply):
                model(input_ids=torch.tensor([[PROMPT[-1]]]), position_ids=torch.tensor([[len(PROMPT) - 1]]))


def test_saved_folder_round_trip(tmp_path):
    """A family loaded from a local folder (as a hub checkpoint would be) runs the same path."""
    from transformers import AutoModelForCausalLM
    tiny_model("mistral", dtype="float32").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    res = run(model, 2)
    assert res["summary"]["n_match"] == 2 and res["max_block_error"] <= 1e-10


# -- CLI ---------------------------------------------------------------------------------------------------------
def test_verify_architectures_cli(tmp_path, capsys):
    from ctxpatch_lite.verify_architectures import main
    out = tmp_path / "va.json"
    assert main(["--families", "llama", "gpt2", "mixtral", "--tokens", "2", "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "GPT2LMHeadModel" in text and "3/3 families meet the target" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["family"] for r in rows] == ["llama", "gpt2", "mixtral"]
    assert all(r["token_match"] == r["materialized_token_match"] == r["batched_token_match"] == "2/2"
               and r["max_block_rel_error"] <= 1e-10 for r in rows)


@pytest.mark.parametrize("argv,msg", [(["--dtype", "float16"], "unknown dtype 'float16'"),
                                      (["--families", "bert"], "unknown family 'bert'"),
                                      (["--tokens", "0"], "--tokens must be at least 1")])
def test_verify_architectures_bad_arguments(argv, msg, capsys):
    from ctxpatch_lite.verify_architectures import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_verify_family_row_in_float32():
    row = verify_family("falcon-parallel", dtype="float32", n_tokens=2)
    assert row.block.startswith("parallel") and row.token_match == "2/2" and row.max_block_rel_error < 1e-5


# -- Appendix D and E --------------------------------------------------------------------------------------------
def test_appendix_d_no_upstream_patch_reaches_the_target():
    from ctxpatch_lite.appendix import appendix_d
    r = appendix_d(steps=150)
    assert r["dv_norm"] > r["bound"] > 0
    assert r["best_residual"] >= r["lower_bound_on_residual"] > 0   # the theorem: the search cannot cross it
    assert r["best_residual"] < r["initial_residual"]                # the search did make progress
    assert r["trainable_scale_residual"] < 1e-12                     # a trainable scale reaches it exactly


def test_appendix_e_outer_matrix_increments_telescope():
    from ctxpatch_lite.appendix import appendix_e_outer, unit_trace_step
    W, D = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    assert torch.allclose(unit_trace_step(W, D), W + D, atol=0, rtol=1e-15)
    r = appendix_e_outer(tiny_model("llama"), PROMPT, layer=1)
    assert r["n_context"] == len(PROMPT) - 1 and len(r["steps"]) == r["n_context"]
    assert r["gate_telescoping_error"] < 1e-12 and r["down_telescoping_error"] < 1e-12 and r["block_error"] < 1e-12
    with pytest.raises(ValueError, match="outer-matrix block"):
        appendix_e_outer(tiny_model("gpt2"), PROMPT)


def test_appendix_e_stable_needs_the_fixed_preconditioner():
    from ctxpatch_lite.appendix import appendix_e_stable
    r = appendix_e_stable(tiny_model("gemma3"), PROMPT, layer=0)
    assert r["down_telescoping_error"] < 1e-12 and r["dm_fixed_error"] < 1e-12 and r["block_error"] < 1e-12
    assert r["dm_moving_error"] > 1e-3                                # element-wise division does not telescope
    assert 0 < r["r0_norm"] < 1e-4                                   # eps in the norm: r_0 is tiny, not zero


def test_falcon_40b_layout_with_two_layernorms():
    """Falcon's new_decoder_architecture (ln_attn and ln_mlp, Falcon-40B/180B) is a parallel block too."""
    import transformers as tf
    cfg = tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                          parallel_attn=True, alibi=False, new_decoder_architecture=True, bias=False)
    torch.manual_seed(0)
    model = tf.FalconForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "word_emb" in name else p.shape[-1] ** -0.5) if p.dim() >= 2
                    else 1 + 0.3 * torch.randn_like(p))
    model = model.double().eval()
    assert Adapter(model).family.key == "falcon-parallel"
    res = run(model, 2)
    assert res["summary"]["n_match"] == 2 and res["max_block_error"] <= 1e-10
    assert max(single_block_errors(model, PROMPT)) <= 1e-10


def test_offloaded_layers_are_refused(tmp_path):
    """device_map sends layer 1 to disk: its weights are 'meta' between uses, so patching it is refused, naming it."""
    from transformers import AutoModelForCausalLM
    from ctxpatch_lite.fixtures import tiny_gemma3
    tiny_gemma3(seed=0, dtype="float32").save_pretrained(tmp_path / "m")
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
          "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=dm, offload_folder=str(tmp_path / "off"))
    with pytest.raises(UnsupportedArchitectureError, match=r"layers 1 of this model are offloaded.*GPU memory"):
        Algorithm1(model)

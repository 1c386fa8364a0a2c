"""Course helpers and the single-block divisor choice that lesson 04 measures."""
import math

import pytest
import torch

from ctxpatch_lite.arithmetic import ulp
from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer
from ctxpatch_lite.lessons import CONFIGURATIONS, margin_in_ulps, variant_runs
from ctxpatch_lite.single_block import single_block_patch

from helpers import CONTEXT_IDS


@pytest.mark.parametrize("layer", range(4))
def test_both_divisors_are_exact_in_float64(tiny64, layer):
    act = single_block_patch(tiny64, CONTEXT_IDS, layer)
    rec = single_block_patch(tiny64, CONTEXT_IDS, layer, h_source="recorded")
    assert act.rel_error <= 1e-12 and rec.rel_error <= 1e-12, (act.rel_error, rec.rel_error)
    assert (rec.h - rec.h_recorded).abs().max() <= 1e-12       # exact arithmetic: the patched h is the recorded one
    assert rec.unpatched_rel_error > 1e-3


def test_recorded_divisor_error_is_m_plus_dm_times_the_h_difference():
    """Lesson 04b, Part 1: dividing by the recorded h_C, the patched layer misses T(C, x) by (m + dm) * (h_hat - h_C),
    up to the bfloat16 rounding of the output; dividing by the actual h_hat, by m * (h_hat - h_C)."""
    model = tiny_gemma3(seed=1, dtype="bfloat16")
    checked = 0
    for layer in range(4):
        for hs in ("recorded", "actual"):
            r = single_block_patch(model, CONTEXT_IDS, layer, h_source=hs)
            m = 1.0 + model.model.layers[layer].post_feedforward_layernorm.weight.float()
            dh = r.h - r.h_recorded
            predicted = ((m + r.dm) if hs == "recorded" else m) * dh
            measured = r.out_patched.float() - r.out_target.float()
            # two bfloat16 roundings stand between the formula and the output: the scaled norm and the residual sum
            tol = 2 * ulp(float(torch.maximum(r.out_target.float().abs().max(),
                                              ((m + r.dm) * r.h).abs().max())), "bfloat16")
            assert (measured - predicted).abs().max() <= tol, (layer, hs, float((measured - predicted).abs().max()), tol)
            checked += int(dh.abs().max() > 0)
    assert checked > 0       # bfloat16 really moved h: the formula was tested on nonzero differences


def test_single_block_rejects_an_unknown_divisor(tiny32):
    with pytest.raises(ValueError, match="h_source"):
        single_block_patch(tiny32, CONTEXT_IDS, 0, h_source="ideal")


def test_margin_in_ulps():
    step = {"margin": 0.25, "logit_scale": 20.0}            # bfloat16 step at |20|: 0.125
    assert margin_in_ulps(step) == 2.0
    assert margin_in_ulps(step, "float32") == 0.25 / ulp(20.0, "float32")


def test_variant_runs_rows_on_a_tiny_model(tiny32):
    tok = tiny_tokenizer()
    prompts = [{"id": "a", "text": "The cat sat on"}, {"id": "b", "text": "One two three"}]
    rows = variant_runs(tiny32, tok, prompts, 3)
    assert [r["label"] for r in rows] == [f"float32-{v}/{h}" for v, h in CONFIGURATIONS]
    for r in rows:
        assert r["n_tokens"] == 6 and 0 <= r["n_match"] <= 6 and len(r["tvd"]) == 6
        assert r["dm_norm"] > 0 and r["matrix_norm"] > 0 and r["total_norm"] >= r["dm_norm"]
        assert len(r["lost"]) == r["n_tokens"] - r["n_match"] and r["lost_wide"] <= len(r["lost"])
        assert all(x["prompt"] in ("a", "b") and 0 <= x["step"] < 3 and x["ulps"] >= 0 for x in r["lost"])
    for r in rows:                                            # one record per prompt and step, in the tvd's order
        assert [(x["prompt"], x["step"]) for x in r["steps"]] == [(p, i) for p in ("a", "b") for i in range(3)]
        assert sum(x["match"] for x in r["steps"]) == r["n_match"]
        assert all(len(x["block_error"]) == tiny32.config.num_hidden_layers for x in r["steps"])
        assert max(x["miss"] for x in r["steps"]) == r["miss"]          # the row's miss is its worst step's
        assert all(x["dv_norm"] > 0 and x["miss"] >= 0 for x in r["steps"])
        assert all(abs(math.hypot(*x["miss_by_layer"]) - x["miss"]) <= 1e-9 * (1 + x["miss"]) for x in r["steps"])
        assert sum(r["hard_layers"].values()) == r["hard_cases"]     # the hard cases, by layer
        assert all(0 <= l < tiny32.config.num_hidden_layers and c > 0 for l, c in r["hard_layers"].items())
    assert rows[0]["n_match"] == 6                            # float32 naive/actual keeps its own greedy tokens
    assert all(r["hard_cases"] == 0 for r in rows[:2])        # the naive variant never solves Appendix B


def test_layer_misses_predicts_and_measures_in_float32():
    """``layer_misses``: the naive miss lesson 04 derived, from m, dm and h_hat - h_C with both bfloat16 tensors
    converted before the subtraction, and the measured output minus target, converted likewise (a bfloat16
    difference would round to 8 bits: the stand-in's outputs sit far from their targets, where it does)."""
    from types import SimpleNamespace

    from ctxpatch_lite.lessons import layer_misses
    g = torch.Generator().manual_seed(3)
    h_rec = torch.randn(32, generator=g).to(torch.bfloat16)
    h = (h_rec.float() + 1e-2 * torch.randn(32, generator=g)).to(torch.bfloat16)
    target = (1e-2 * torch.randn(32, generator=g)).to(torch.bfloat16)
    out = (300 + 10 * torch.rand(32, generator=g)).to(torch.bfloat16)
    dm, m = 1e3 * torch.randn(32, generator=g), 1 + torch.rand(32, generator=g)
    res = SimpleNamespace(h=h, h_recorded=h_rec, dm=dm, out_patched=out, out_target=target)
    dh = h.float() - h_rec.float()
    for div, want in (("recorded", (m + dm) * dh), ("actual", m * dh)):
        pred, meas = layer_misses(res, m, div)
        assert pred.dtype == meas.dtype == torch.float32
        assert torch.equal(pred, want) and torch.equal(meas, out.float() - target.float())
    assert not torch.equal(meas, (out - target).float())           # the bfloat16 difference would have rounded
    with pytest.raises(ValueError, match="divide_by"):
        layer_misses(res, m, "h_C")


def test_variant_runs_counts_hard_cases_by_layer():
    """A layer whose scales are all 0 but one large one meets its target on that one coordinate with norm to spare:
    an Appendix B hard case at every token, on that layer only, and none of its zero scales falls back."""
    model = tiny_gemma3(seed=0, dtype="float32")
    w = model.model.layers[1].post_feedforward_layernorm.weight
    with torch.no_grad():
        w.fill_(-1.0)                                          # m = 1 + w = 0 ...
        w[0] = 20.0                                            # ... except one scale of 21
    prompts = [{"id": "a", "text": "The cat sat on"}, {"id": "b", "text": "One two three"}]
    rows = variant_runs(model, tiny_tokenizer(), prompts, 3, zero_scales={1: w.numel() - 1},
                        configurations=[("stable", "actual"), ("stable", "recorded")])
    for r in rows:
        assert r["hard_cases"] == 6 and r["hard_layers"] == {1: 6}
        assert r["m0_hard"] == 6 * (w.numel() - 1) and r["fallbacks_m0"] == 0


def test_variant_runs_a_subset_of_configurations(tiny32):
    """Asking for fewer configurations gives their rows only, equal to the full run's (same baseline tokens)."""
    tok = tiny_tokenizer()
    prompts = [{"id": "a", "text": "The cat sat on"}]
    full = {r["label"]: r for r in variant_runs(tiny32, tok, prompts, 2)}
    some = variant_runs(tiny32, tok, prompts, 2, configurations=[("stable", "recorded"), ("stable", "actual")])
    assert [r["label"] for r in some] == ["float32-stable/recorded", "float32-stable/actual"]
    for r in some:
        assert r == full[r["label"]]


@pytest.mark.parametrize("bad, match", [({"tokens": 0}, "tokens must be at least 1"),
                                        ({"prompts": []}, "at least one prompt"),
                                        ({"configurations": [("stable", "ideal")]}, "pairs among"),
                                        ({"configurations": []}, "got none")])
def test_variant_runs_bad_input(tiny32, bad, match):
    kw = {"prompts": [{"id": "a", "text": "The cat"}], "tokens": 2} | bad
    with pytest.raises(ValueError, match=match):
        variant_runs(tiny32, tiny_tokenizer(), kw["prompts"], kw["tokens"],
                     **({"configurations": kw["configurations"]} if "configurations" in kw else {}))


def test_single_block_reports_the_hard_case():
    """The result carries the engine's hard-case flag: always False for the naive variant (it solves no secular
    equation), a bool for the stable one, whose patched layer is exact in float64 either way."""
    model = tiny_gemma3(seed=0, dtype="float64")
    assert not single_block_patch(model, CONTEXT_IDS, 1).hard_case
    st = single_block_patch(model, CONTEXT_IDS, 1, variant="stable")
    assert isinstance(st.hard_case, bool) and st.rel_error <= 1e-10


@pytest.mark.parametrize("variant", ["naive", "stable"])
def test_single_block_pass_stops_at_its_layer_bit_for_bit(monkeypatch, variant):
    """``single_block_patch`` ends its two query passes after the patched layer (the layers above cannot change it):
    every tensor it returns equals what the full pass gives, bit for bit, in bfloat16; the stable variant also returns
    its rank-1 W_down patch, with u = h_target - W_down h_g."""
    import ctxpatch_lite.single_block as sb
    model = tiny_gemma3(seed=1, dtype="bfloat16")
    for layer in (0, 2):
        short = single_block_patch(model, CONTEXT_IDS, layer, variant=variant)
        with monkeypatch.context() as mp:
            mp.setattr(sb, "_stop_pass", lambda *a: None)          # the old behaviour: all layers run
            full = single_block_patch(model, CONTEXT_IDS, layer, variant=variant)
        for name in ("v", "z", "h", "h_recorded", "dm", "out_target", "out_patched", "out_unpatched"):
            assert torch.equal(getattr(short, name), getattr(full, name)), (layer, name)
        assert (short.rel_error, short.fallbacks, short.hard_case) == (full.rel_error, full.fallbacks, full.hard_case)
        if variant == "stable":
            assert torch.equal(short.down.u, full.down.u) and torch.equal(short.down.z, full.down.z)
            assert short.down.u.shape[-1] == model.config.hidden_size
        else:
            assert short.down is None


def test_variant_runs_share_the_full_context_pass(tiny64):
    """The configurations after the first reuse its full-context pass (baseline logits and targets): each row is
    what a run of its own gives, to float64 rounding (the output head then multiplies N rows instead of 2N)."""
    import ctxpatch_lite as cp
    from ctxpatch_lite.algorithm import PatchConfig
    tok = tiny_tokenizer()
    prompts = [{"id": "a", "text": "The cat sat on"}]
    rows = {r["label"]: r for r in variant_runs(tiny64, tok, prompts, 3)}
    greedy = cp.run_protocol(tiny64, tok, prompts[0]["text"], 3, PatchConfig(), progress=False, batched=True)
    for var, hs in CONFIGURATIONS[1:]:
        own = cp.run_protocol(tiny64, tok, prompts[0]["text"], 3, PatchConfig(variant=var, h_source=hs),
                              progress=False, batched=True, greedy=greedy["generated_ids"])
        row = rows[f"float64-{var}/{hs}"]
        assert row["n_match"] == own["summary"]["n_match"]
        assert row["tvd"] == pytest.approx([s["tvd"] for s in own["steps"]], rel=1e-6, abs=1e-13)
        assert [x["linf"] for x in row["steps"]] == pytest.approx([s["linf"] for s in own["steps"]], rel=1e-6,
                                                                   abs=1e-12)


def test_full_context_is_shared_only_where_it_belongs(tiny32):
    import ctxpatch_lite as cp
    from ctxpatch_lite.algorithm import PatchConfig
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="pass batched=True"):
        cp.run_protocol(tiny32, tok, "The cat sat on", 2, PatchConfig(), progress=False, full_context={})
    fc = {}
    cp.run_protocol(tiny32, tok, "The cat sat on", 2, PatchConfig(), progress=False, batched=True, full_context=fc)
    assert set(fc) == {"key", "base", "targets"}
    with pytest.raises(ValueError, match="another sequence or other positions"):
        cp.run_protocol(tiny32, tok, "One two three", 2, PatchConfig(), progress=False, batched=True,
                        full_context=fc)


def test_sign_test_drops_ties_and_reads_each_direction_at_alpha():
    from math import comb
    from ctxpatch_lite.lessons import sign_test
    d = [1e-3] * 27 + [0.0] * 9 + [-1e-3] * 4                  # ties dropped: n = 31, not 40
    r = sign_test(d, 0.01)
    assert (r["n"], r["pos"], r["neg"]) == (31, 27, 4) and r["verdict"] == 1
    k = r["k_star"]                                            # the smallest k with P(X >= k) <= 1 %, exactly
    tail = lambda k: sum(comb(31, j) for j in range(k, 32)) / 2 ** 31
    assert tail(k) <= 0.01 < tail(k - 1)
    assert sign_test([-x for x in d], 0.01)["verdict"] == -1    # the other direction, at the same level
    assert sign_test([1e-3] * 21 + [-1e-3] * 19, 0.01)["verdict"] == 0
    assert sign_test([1e-3] * 5, 0.01) == {"n": 5, "pos": 5, "neg": 0, "k_star": 6, "verdict": 0}   # no k reaches 1 %
    assert sign_test([1e-3] * 28 + [-1e-3] * 12, 0.01)["k_star"] == 28      # n = 40, as lesson 04 reads it

"""Theorem 1 on single Gemma 3 layers: exactness, rank 1, and the conditions (h_i == 0, z == 0)."""
import pytest
import torch

from helpers import CONTEXT_IDS
from ctxpatch_lite.algorithm import Algorithm1, PatchConfig, layer_errors
from ctxpatch_lite.fixtures import tiny_gemma3
from ctxpatch_lite.patches import PatchError, check_input_patch
from ctxpatch_lite.single_block import single_block_patch


@pytest.mark.parametrize("layer", range(4))
def test_theorem1_every_layer_float64(tiny64, layer):
    res = single_block_patch(tiny64, CONTEXT_IDS, layer)
    assert res.rel_error <= 1e-12, res.rel_error
    assert res.unpatched_rel_error > 1e-3  # the context really changes this layer's output
    W = tiny64.model.layers[layer].mlp.gate_proj.weight
    assert ((W + res.dW_gate) @ res.z - W @ res.z_C).abs().max() <= 1e-12 * (W @ res.z_C).abs().max()
    for name in ("gate", "up"):
        s = res.singular_values[name]
        assert s[0] > 0 and s[1] / s[0] <= 1e-12, (name, s[:3])


def test_ideal_inputs_match_theorem1_per_layer(tiny64):
    alg = Algorithm1(tiny64, PatchConfig(schedule="oracle"))
    _, T, _ = alg.full_context(CONTEXT_IDS)
    _, rec = alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)
    assert max(layer_errors(rec, T)) <= 1e-12


def test_zero_h_coordinate_is_counted_not_hidden():
    model = tiny_gemma3(seed=1, dtype="float64")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[5].zero_()  # h_5 == 0 exactly in layer 2, for every input
    alg = Algorithm1(model, PatchConfig())
    _, T, _ = alg.full_context(CONTEXT_IDS)
    _, rec = alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)
    d = rec.patches[2].diagnostics
    assert d.fallbacks == 1 and d.min_abs_h == 0.0
    assert all(rec.patches[l].diagnostics.fallbacks == 0 for l in (0, 1, 3))
    # Where h_5 = 0 no scale patch can add dv_5: the layer output misses there, and the error is visible.
    assert layer_errors(rec, T)[2] > 1e-6


def test_zero_z_raises_clear_error():
    with pytest.raises(PatchError, match=r"layer 3: the MLP input z is the zero vector"):
        check_input_patch(torch.zeros(1, 4), layer=3, name="W_gate")
    model = tiny_gemma3(seed=2, dtype="float64")
    with torch.no_grad():
        model.model.layers[1].pre_feedforward_layernorm.weight.fill_(-1.0)  # scale 1 + w = 0  =>  z == 0
    alg = Algorithm1(model, PatchConfig())
    _, T, _ = alg.full_context(CONTEXT_IDS)
    with pytest.raises(PatchError, match="layer 1: the MLP input z is the zero vector"):
        alg.patched(CONTEXT_IDS[-1], len(CONTEXT_IDS) - 1, T)

"""The from-scratch teaching block matches transformers' Gemma3DecoderLayer on real activations."""
import pytest

from ctxpatch_lite.block import GemmaBlock, layer_io
from ctxpatch_lite.fixtures import tiny_gemma3

IDS = list(range(2, 22))  # 20 tokens: longer than the tiny sliding window (8), so the window mask matters


@pytest.mark.parametrize("layer", range(4))
def test_block_matches_transformers_tiny(layer):
    model = tiny_gemma3(seed=6, dtype="float64")
    x, out = layer_io(model, IDS, layer)
    tr = GemmaBlock(model.model.layers[layer], model.config, layer)(x)
    assert (tr.out - out).abs().max() / out.abs().max() <= 1e-5  # transformers' norms run in float32 here


@pytest.mark.real
@pytest.mark.parametrize("layer", [0, 5, 17])
def test_block_matches_transformers_embedded(embedded, layer):
    model, tok = embedded
    ids = tok("Write a single-sentence weather forecast for Mars:")["input_ids"]
    x, out = layer_io(model, ids, layer)
    tr = GemmaBlock(model.model.layers[layer], model.config, layer)(x)
    assert (tr.out - out).abs().max() / out.abs().max() <= 1e-5

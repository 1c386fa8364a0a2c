"""Images as context (the paper's image experiment): Algorithm 1 with a Gemma3ForConditionalGeneration whose
context holds text and images; the tiny seeded model of fixtures, transformers' own classes."""
import json
import subprocess
import sys
import types

import pytest
import torch

from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.fixtures import tiny_gemma3, tiny_gemma3_vision, tiny_gemma3_vision_folder, tiny_vision_processor
from ctxpatch_lite.hooks import UnsupportedArchitectureError
from ctxpatch_lite.protocol import run_protocol
from ctxpatch_lite.vision import ImageContextError, attention_mask, check_vision_model, encode_context, packaged_image

TEXT = "Look at this: <start_of_image> The sky on Mars is"


@pytest.fixture(scope="module")
def proc():
    return tiny_vision_processor()


@pytest.fixture(scope="module")
def images():
    return [packaged_image("mars_sunset"), packaged_image("robot")]


@pytest.fixture(scope="module")
def f64():
    return tiny_gemma3_vision(seed=0, dtype="float64")


def _run(model, proc, text, imgs, n=8, **kw):
    return run_protocol(model, proc, text, n, PatchConfig(**{k: v for k, v in kw.items() if k != "batched"}),
                        images=imgs, progress=False, batched=kw.get("batched", False))


def _worst_block_error(r):
    return max(e for s in r["steps"] for e in s["diagnostics"]["per_layer"]["block_error"])


@pytest.mark.parametrize("batched", [False, True])
def test_float64_exact_at_every_layer_with_an_image(f64, proc, images, batched):
    r = _run(f64, proc, TEXT, images[:1], batched=batched)
    assert r["summary"]["n_match"] == 8 and _worst_block_error(r) <= 1e-10
    assert r["config"]["images"][0]["name"] == "mars_sunset.png" and r["config"]["images"][0]["soft_tokens"] == 4


def test_float32_every_token_and_the_control_fails(proc, images):
    m = tiny_gemma3_vision(seed=0, dtype="float32")
    r = _run(m, proc, TEXT, images[:1])
    assert r["summary"]["n_match"] == r["n_tokens"] == 8 and max(r["linf"]) < 1e-4
    none = _run(m, proc, TEXT, images[:1], parts="none")
    assert none["summary"]["linf_median"] > 0.1 > 1e3 * max(r["linf"])


def test_the_image_matters(f64, proc, images):
    """Swapping the picture changes the full-context logits and the patches; the patched model follows each."""
    a, b = (_run(f64, proc, TEXT, [im], n=2) for im in images)
    assert a["steps"][0]["diagnostics"]["dm_norm"] != pytest.approx(b["steps"][0]["diagnostics"]["dm_norm"], rel=1e-6)
    ids_a, media_a = encode_context(proc, TEXT, images[:1], f64)
    ids_b, media_b = encode_context(proc, TEXT, images[1:], f64)
    assert ids_a == ids_b and not torch.equal(media_a.pixel_values, media_b.pixel_values)
    with torch.no_grad():
        la = f64(input_ids=torch.tensor([ids_a]), **media_a.kwargs(len(ids_a), "cpu", torch.float64)).logits[0, -1]
        lb = f64(input_ids=torch.tensor([ids_b]), **media_b.kwargs(len(ids_b), "cpu", torch.float64)).logits[0, -1]
    assert (la - lb).abs().max() > 1e-3
    assert _worst_block_error(a) <= 1e-10 and _worst_block_error(b) <= 1e-10


def test_image_only_context(f64, proc, images):
    r = _run(f64, proc, "<start_of_image>:", images[:1])
    assert r["summary"]["n_match"] == 8 and _worst_block_error(r) <= 1e-10
    assert r["config"]["image_token_positions"] == [4, 5, 6, 7]


def test_two_images_blocks_are_per_image(f64, proc, images):
    text = "<start_of_image> and <start_of_image>: which one is"
    r = _run(f64, proc, text, images)
    assert r["summary"]["n_match"] == 8 and _worst_block_error(r) <= 1e-10
    ids, media = encode_context(proc, text, images, f64)
    mask = attention_mask(f64, ids, media)
    first, second = r["config"]["image_token_positions"][:4], r["config"]["image_token_positions"][4:]
    assert mask[first[0], first[-1]] and mask[second[0], second[-1]]          # bidirectional within an image
    assert not mask[first[0], second[0]] and mask[second[0], first[0]]        # causal between images
    assert not mask[0, 1] and mask[len(ids) - 1].all()                        # text causal; the query sees all


def test_clear_errors(f64, proc, images):
    with pytest.raises(ImageContextError, match="2 image\\(s\\) were given"):
        encode_context(proc, TEXT, images, f64)
    with pytest.raises(ImageContextError, match="no vision tower"):
        run_protocol(tiny_gemma3(), proc, TEXT, 2, images=images[:1], progress=False)
    with pytest.raises(ImageContextError, match="processor"):
        encode_context(proc.tokenizer, TEXT, images[:1], f64)
    with pytest.raises(ImageContextError, match="does not exist"):
        encode_context(proc, TEXT, ["/no/such/picture.png"], f64)
    fake = type("LlavaForConditionalGeneration", (), {})()
    fake.config = types.SimpleNamespace(vision_config={})
    with pytest.raises(UnsupportedArchitectureError, match="Gemma3ForConditionalGeneration"):
        check_vision_model(fake)


def test_load_model_folder_and_compare_cli_record_the_images(tmp_path):
    from ctxpatch_lite.models import load_model
    folder = tiny_gemma3_vision_folder()
    model, proc = load_model(str(folder), progress=False)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration" and type(proc).__name__ == "Gemma3Processor"
    from importlib.resources import files
    img = files("ctxpatch_lite") / "data" / "images" / "robot.png"
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "ctxpatch_lite.compare", "--model", str(folder), "--image", str(img),
                        "--prompt", "what is this", "--tokens", "3", "--dtype", "float64", "--quiet", "--json",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["summary"]["n_match"] == 3 and rec["config"]["images"][0]["name"] == "robot.png"
    assert len(rec["config"]["images"][0]["sha256"]) == 64 and rec["config"]["images"][0]["processed_size"] == [32, 32]
    bad = subprocess.run([sys.executable, "-m", "ctxpatch_lite.compare", "--model", str(folder), "--image",
                          str(tmp_path / "none.png"), "--prompt", "x", "--quiet"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr

"""load_model: dtype/device resolution, local folders, hub ids offline, the embedded model and its cache."""
import json
import time

import pytest
import torch

import ctxpatch_lite.models as models
from ctxpatch_lite import ModelLoadError, load_model, resolve_dtype
from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer


def test_bad_dtype_lists_choices():
    with pytest.raises(ValueError, match="unsupported dtype 'float16'; choose one of: float32, bfloat16, float64"):
        load_model(dtype="float16")
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype(torch.float64) is torch.float64


def test_bad_device():
    with pytest.raises(ValueError, match="device"):
        models.resolve_device("tpu:9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            models.resolve_device("cuda")
        assert models.resolve_device("auto").type == "cpu"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_model")
    model = tiny_gemma3(seed=3)
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_local_folder(tiny_folder, dtype):
    folder, ref = tiny_folder
    model, tok = load_model(str(folder), dtype=dtype, device="cpu")
    assert next(model.parameters()).dtype == resolve_dtype(dtype) and not model.training
    ids = torch.tensor([tok("hello")["input_ids"]])
    ref_logits = ref(ids).logits.double()
    got = model(ids).logits.double()
    tol = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 0.5}[dtype]
    assert (got - ref_logits).abs().max() <= tol


def test_local_folder_errors(tmp_path, tiny_folder):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    folder, model = tiny_folder
    bin_folder = tmp_path / "bin"
    model.save_pretrained(bin_folder, safe_serialization=False)
    if not any(bin_folder.glob("*.safetensors")):
        with pytest.raises(ModelLoadError, match="safetensors only"):
            load_model(str(bin_folder))


def test_missing_hub_id_offline(monkeypatch):
    import huggingface_hub.constants as hc
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    t = time.time()
    with pytest.raises(ModelLoadError, match=r"could not load 'ctxpatch-lite-tests/no-such-model'.*hf download"):
        load_model("ctxpatch-lite-tests/no-such-model")
    assert time.time() - t < 60


def _fake_cache(folder):
    folder.mkdir(parents=True, exist_ok=True)
    tiny_gemma3(seed=4).save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    models._write_manifest(folder, "deadbeef")


def test_cache_check_detects_partial_and_corrupt(tmp_path):
    folder = tmp_path / "c"
    _fake_cache(folder)
    assert models.check_cache(folder) is None and models.check_cache(folder, full=True) is None
    st = folder / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(bytes(data))
    assert "differs" in models.check_cache(folder)
    st.write_bytes(bytes(data[:-100]))
    assert "size" in models.check_cache(folder)
    (folder / models._MANIFEST).unlink()
    assert "no manifest" in models.check_cache(folder)


def test_ensure_embedded_rebuilds_bad_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CTXPATCH_CACHE", str(tmp_path))
    calls = []

    def fake_convert(target, progress=True):
        calls.append(target)
        _fake_cache(target)

    monkeypatch.setattr(models, "_convert_embedded", fake_convert)
    folder = models.ensure_embedded(progress=False)
    assert calls == [folder] and folder.parent == tmp_path
    models.ensure_embedded(progress=False)
    assert len(calls) == 1  # warm: no conversion
    (folder / "config.json").write_text("{}")  # damaged
    models.ensure_embedded(progress=False)
    assert len(calls) == 2
    manifest = json.loads((folder / models._MANIFEST).read_text())
    assert "transformers" in manifest and folder.name.endswith(manifest["transformers"])


@pytest.mark.real
def test_embedded_warm_from_cache(embedded, monkeypatch):
    model, tok = embedded  # fills the cache if this machine never converted it
    monkeypatch.setattr(models, "_convert_embedded", lambda *a, **k: pytest.fail("warm load must not convert"))
    m2, t2 = load_model(device="cpu", progress=False)
    assert type(m2).__name__ == "Gemma3ForCausalLM" and m2.config.num_hidden_layers == 18
    assert m2.config.hidden_size == 640 and m2.config.intermediate_size == 2048
    ids = tok("The weather on Mars is", return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tok.bos_token_id
    out = m2.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3

# The real cold path (dequantise into an empty cache) runs in tests/test_binder.py, through binder/postBuild.


@pytest.mark.real
def test_embedded_tokenizer_is_slim_and_cached(embedded, monkeypatch):
    """The embedded tokenizer drops its Python vocabulary and merges (the Rust tokenizer keeps its own) and comes back
    from a pickle that is rebuilt, not trusted, when it or tokenizer.json no longer match what it recorded."""
    from transformers import AutoTokenizer
    _, tok = embedded
    folder = models.ensure_embedded(progress=False)
    assert "_vocab" not in vars(tok) and "_merges" not in vars(tok)
    ref = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "Context becomes weights: ü, 12345, <b>tags</b>,\n  spaces."
    assert tok(text)["input_ids"] == ref(text)["input_ids"] and len(tok) == len(ref)
    assert tok.decode(ref(text)["input_ids"]) == ref.decode(ref(text)["input_ids"])
    assert tok.convert_ids_to_tokens(list(range(300))) == ref.convert_ids_to_tokens(list(range(300)))
    pkl = models._tokenizer_pickle(folder)
    assert pkl.is_file()
    pkl.write_bytes(b"not a pickle")                       # damaged: rebuilt from tokenizer.json, then read back
    built = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: built.append(1) or real(*a, **k))
    again = models._embedded_tokenizer(folder)
    assert built == [1] and again(text)["input_ids"] == ref(text)["input_ids"]
    assert models._embedded_tokenizer(folder)(text)["input_ids"] == ref(text)["input_ids"] and built == [1]


def test_slim_tokenizer_keeps_encoding(tmp_path):
    """A GemmaTokenizer built from a small vocabulary keeps its Python copies until slimmed; after, it encodes,
    decodes and saves the same."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "a", "b", "ab", "\u2581", "\u2581ab"])}
    tok = GemmaTokenizer(vocab=dict(vocab), merges=[("a", "b"), ("\u2581", "ab")])
    assert "_vocab" in vars(tok) and "_merges" in vars(tok)
    before = tok("ab ab ba")["input_ids"]
    assert models.slim_tokenizer(tok) is tok
    assert "_vocab" not in vars(tok) and "_merges" not in vars(tok)
    assert tok("ab ab ba")["input_ids"] == before and tok.decode(before) == "ab ab ba"
    tok.save_pretrained(tmp_path)
    assert GemmaTokenizer.from_pretrained(tmp_path)("ab ab ba")["input_ids"] == before

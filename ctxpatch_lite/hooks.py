"""Generic pieces every other module shares: errors, RMS normalisation, query rows, and the scopes that own hooks
and parameter writes (removed and restored bit for bit on exit, also after an error mid-pass).

Nothing here knows a model family; nothing here imports another module of the package.
"""
from __future__ import annotations

import contextlib

import torch


class PatchError(ValueError):
    """A patch cannot be built (e.g. ``z == 0``); the message names the layer and the condition."""


class UnsupportedArchitectureError(ValueError):
    """The model has no adapter; the message names the missing property."""


def unit_rms(y: torch.Tensor, eps: float) -> torch.Tensor:
    """N(y) = y / sqrt(mean(y^2) + eps), in y's dtype: the unit-scale RMS normalisation every RMSNorm applies."""
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)


def norm_eps(mod) -> float | None:
    """The epsilon of a norm module (``eps`` in Gemma and torch's LayerNorm, ``variance_epsilon`` in Llama-style)."""
    eps = getattr(mod, "eps", None)
    return getattr(mod, "variance_epsilon", None) if eps is None else eps


def rows(t) -> torch.Tensor:
    """(N, d) rows of an activation: every position of every sequence (tuples: their first element)."""
    t = t[0] if isinstance(t, tuple) else t
    return t.reshape(-1, t.shape[-1])


def hidden_arg(args, kwargs) -> torch.Tensor:
    """The hidden states a decoder layer was called with (positionally or as ``hidden_states=``)."""
    return args[0] if args else kwargs["hidden_states"]


def replace_hidden(args, kwargs, x):
    """(args, kwargs) with the hidden states replaced by ``x``, for a forward pre-hook registered with kwargs."""
    if args:
        return (x,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


class HookScope:
    """Context manager base: hooks registered through ``reg`` are all removed on exit."""

    def __init__(self):
        self._handles = []

    def reg(self, handle) -> None:
        self._handles.append(handle)

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False


class WeightScope(HookScope):
    """A ``HookScope`` that also writes patches into parameters and restores them bit for bit on exit.

    The one cast rule of the package: ``param[index] = (param[index].to(pdtype) + delta.to(pdtype)).to(param.dtype)``
    -- the patch is added in the patch dtype and stored in the model dtype, as a patched checkpoint would hold it.
    ``keep = True`` writes without keeping a copy to restore (a peft adapter's own LoRA factors and saved modules).
    """

    def __init__(self, pdtype: torch.dtype):
        super().__init__()
        self.pdtype = pdtype
        self.keep = False
        self._saved = {}          # id(param) -> (param, original clone)

    def add(self, param: torch.nn.Parameter, delta: torch.Tensor, index=None) -> None:
        if param.device.type == "meta":
            raise PatchError("a patched parameter lives on the 'meta' device (offloaded); load the model fully onto "
                             "one device, or give it more GPU memory")
        if not self.keep and id(param) not in self._saved:
            self._saved[id(param)] = (param, param.detach().clone())
        with torch.no_grad():
            view = param if index is None else param[index]
            view.copy_((view.to(self.pdtype) + delta.to(device=param.device, dtype=self.pdtype)).to(param.dtype))

    def restore(self) -> None:
        with torch.no_grad():
            for param, orig in self._saved.values():
                param.copy_(orig)
        self._saved.clear()

    def restore_params(self, params) -> None:
        """Restore (bit for bit) and forget the saved copies of these parameters only, e.g. one layer's once its
        forward is done: a pass then holds one layer's copies at a time, not every layer's."""
        with torch.no_grad():
            for p in params:
                saved = self._saved.pop(id(p), None)
                if saved is not None:
                    saved[0].copy_(saved[1])

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.restore()
        return False


def rmsnorm_modules(model):
    """Every RMS normalisation of a model: a module with an epsilon that is not a LayerNorm (which centres too)."""
    return [m for m in model.modules()
            if norm_eps(m) is not None and not isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm))
            and not list(m.children())]


@contextlib.contextmanager
def float64_norms(model, offset: float = 0.0):
    """Recompute every RMSNorm in float64 when the model is float64 (transformers' classes upcast to float32 only).

    ``offset`` is the family's scale offset (Gemma: ``1 + weight``; others: ``weight``); a norm without a trainable
    weight scales by 1.
    """
    handles = []

    def hook(mod, args, out):
        n = unit_rms(args[0].to(torch.float64), norm_eps(mod))
        w = getattr(mod, "weight", None)
        if w is not None:
            n = n * (offset + w.to(torch.float64))
        return n.to(args[0].dtype)

    mods = []
    if next(model.parameters()).dtype == torch.float64:   # nested scopes do not stack (a later hook would
        mods = [m for m in rmsnorm_modules(model) if not getattr(m, "_ctxpatch_f64", False)]  # undo a patch)
        handles = [m.register_forward_hook(hook) for m in mods]
        for m in mods:
            m._ctxpatch_f64 = True
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in mods:
            m._ctxpatch_f64 = False


# torch >= 2.9 holds float32 precision per backend (``torch.backends.cuda.matmul.fp32_precision`` ...) beside the
# legacy global (``torch.set_float32_matmul_precision``, ``allow_tf32``). Reading a legacy flag raises when the two
# disagree, and on CUDA so does every float32 cuBLAS call. So: read the per-backend values (they never raise), set
# through the legacy setters (which keep both in step), restore the saved values exactly.
_FP32_NODES = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _node(path: str):
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if hasattr(obj, "fp32_precision") else None


def _readable(fn):
    """A legacy flag's value, or the string 'mixed' when torch refuses to read it (legacy and per-backend settings
    disagree, see above)."""
    try:
        return fn()
    except RuntimeError:
        return "mixed"


def fp32_precision_state() -> dict:
    """Every per-backend float32 precision setting present in this torch ({} before torch 2.9)."""
    return {path: _node(path).fp32_precision for path in _FP32_NODES if _node(path) is not None}


def precision_flags() -> dict:
    """The torch settings that decide float32/bfloat16 matmul arithmetic on a GPU, as they are now. Never raises: a
    legacy flag torch refuses to read reads 'mixed'; the per-backend values (torch >= 2.9) are under fp32_precision.
    """
    cuda = torch.backends.cuda.matmul
    state = fp32_precision_state()
    tf32 = (lambda: cuda.allow_tf32) if "cuda.matmul" not in state else (lambda: state["cuda.matmul"] == "tf32")
    return {"float32_matmul_precision": _readable(torch.get_float32_matmul_precision),
            "cuda_matmul_allow_tf32": _readable(lambda: bool(tf32())),
            "cudnn_allow_tf32": _readable(lambda: bool(torch.backends.cudnn.allow_tf32)),
            "allow_bf16_reduced_precision_reduction": bool(cuda.allow_bf16_reduced_precision_reduction),
            "allow_fp16_reduced_precision_reduction": bool(cuda.allow_fp16_reduced_precision_reduction),
            "fp32_precision": state}


@contextlib.contextmanager
def exact_float32(enabled: bool = True):
    """TF32 off (and float32 matmuls at 'highest' precision) for the block, the user's settings restored after:
    on Ampere and later GPUs TF32 rounds float32 matmul inputs to 10 mantissa bits, which the scale patches of
    1e6 turn into visible errors. A no-op when ``enabled`` is False (bfloat16 runs keep the user's settings).

    Works across torch's two precision APIs (legacy global flags and, from torch 2.9, per-backend
    ``fp32_precision``): inside the block both say IEEE float32, so neither torch's flag reads nor its cuBLAS
    consistency check can raise; on exit every setting is back to its saved value, also a user's mixed state."""
    if not enabled:
        yield
        return
    legacy = (_readable(torch.get_float32_matmul_precision), _readable(lambda: torch.backends.cuda.matmul.allow_tf32),
              _readable(lambda: torch.backends.cudnn.allow_tf32))
    nodes = fp32_precision_state()
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for path in nodes:                        # every backend to IEEE, whatever the legacy setters left
        _node(path).fp32_precision = "ieee"
    try:
        yield
    finally:
        # the legacy setters first, each flag that could be read (they rewrite the per-backend values) ...
        if legacy[0] != "mixed":
            torch.set_float32_matmul_precision(legacy[0])
        if legacy[1] != "mixed":
            torch.backends.cuda.matmul.allow_tf32 = legacy[1]
        if legacy[2] != "mixed":
            torch.backends.cudnn.allow_tf32 = legacy[2]
        for path, value in nodes.items():     # ... then each per-backend value exactly as it was
            _node(path).fp32_precision = value

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


def precision_flags() -> dict:
    """The torch settings that decide float32/bfloat16 matmul arithmetic on a GPU, as they are now."""
    cuda = torch.backends.cuda.matmul
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": bool(cuda.allow_tf32), "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "allow_bf16_reduced_precision_reduction": bool(cuda.allow_bf16_reduced_precision_reduction),
            "allow_fp16_reduced_precision_reduction": bool(cuda.allow_fp16_reduced_precision_reduction)}


@contextlib.contextmanager
def exact_float32(enabled: bool = True):
    """TF32 off (and float32 matmuls at 'highest' precision) for the block, the user's settings restored after:
    on Ampere and later GPUs TF32 rounds float32 matmul inputs to 10 mantissa bits, which the scale patches of
    1e6 turn into visible errors. A no-op when ``enabled`` is False (bfloat16 runs keep the user's settings)."""
    if not enabled:
        yield
        return
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]

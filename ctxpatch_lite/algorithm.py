"""Algorithm 1 (paper Section 3.3): absorb the context into per-layer patches for one query token.

1. Full-context pass: record, at the query position, each layer's targets (``LayerTargets``).
2. Query token alone: layers below ``start_layer`` run unpatched on the query alone; from ``start_layer`` on, each
   layer's patch is computed from the *actual* output of the (patched) layer below, inside this very pass, and
   applied before the pass moves on (self-correcting). Final norm and LM head are untouched.

Modes (``mode``):
* ``selfcorrect`` -- Algorithm 1 as stated.
* ``ideal``       -- each patched layer is fed the recorded full-context input instead of the patched output of
                     the layer below (no self-correction).
* ``fixed``       -- patches computed once, at the first generated token, and reused at every later step.
* ``none``        -- no patches: the query alone (negative control).
* ``input-only``  -- rank-1 gate/up patches, no output patch.
* ``vanilla``     -- the predecessor's vanilla-block recipe ported naively: rank-1 gate/up patches plus ``dv`` added
                     as a bias on the down-projection output (before Gemma's post-norm).
``variant`` (``naive`` | ``stable``) and ``h_source`` (``actual`` | ``recorded``) choose how the output patch is
built; they have no effect in the ``none``, ``input-only`` and ``vanilla`` modes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .engine import (APPLY_MODES, H_SOURCES, VARIANTS, GemmaAdapter, LayerSpec, PatchHooks, TargetRecorder,
                     float64_norms)
from .metrics import relative_error
from .models import DTYPES, dtype_name

MODES = ("selfcorrect", "ideal", "fixed", "none", "input-only", "vanilla")


@dataclass
class PatchConfig:
    variant: str = "naive"
    start_layer: int = 0
    h_source: str = "actual"
    apply: str = "factored"
    mode: str = "selfcorrect"
    patch_dtype: str | None = None   # None: float32 for float32/bfloat16 models, float64 for float64 models

    def validate(self, n_layers: int) -> "PatchConfig":
        for name, value, choices in (("variant", self.variant, VARIANTS), ("h_source", self.h_source, H_SOURCES),
                                     ("apply", self.apply, APPLY_MODES), ("mode", self.mode, MODES)):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
        if not isinstance(self.start_layer, int) or not 0 <= self.start_layer < n_layers:
            raise ValueError(f"start_layer {self.start_layer!r} is out of range: this model has {n_layers} decoder "
                             f"layers, so start_layer must be an integer in 0..{n_layers - 1} "
                             f"({n_layers - 1} = last layer only)")
        if self.patch_dtype is not None and self.patch_dtype not in DTYPES:
            raise ValueError(f"unknown patch_dtype {self.patch_dtype!r}; choose one of: {', '.join(DTYPES)}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


class Algorithm1:
    """Algorithm 1 on a transformers Gemma 2/3 causal LM; one instance per (model, config)."""

    def __init__(self, model, config: PatchConfig | None = None):
        self.model = model
        self.adapter = GemmaAdapter(model)
        self.config = (config or PatchConfig()).validate(self.adapter.n_layers)
        self.pdtype = DTYPES[self.config.patch_dtype] if self.config.patch_dtype else None
        self.device = next(model.parameters()).device
        self._fixed = None

    @property
    def patch_dtype_name(self) -> str:
        from .patches import default_patch_dtype
        return dtype_name(self.pdtype or default_patch_dtype(self.adapter.dtype))

    def reset(self):
        """Forget the patches kept by the ``fixed`` mode (start of a new generation)."""
        self._fixed = None

    # -- passes ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_context(self, input_ids, cache=None):
        """Forward ``input_ids`` (1, T) with the full context; return (last logits, targets, cache)."""
        ids = torch.as_tensor(input_ids, device=self.device).reshape(1, -1)
        with float64_norms(self.model), TargetRecorder(self.adapter) as rec:
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], rec.targets(), getattr(out, "cache", None) or out.past_key_values

    def specs(self, targets) -> dict:
        c, s = self.config, self.config.start_layer
        layers = range(s, self.adapter.n_layers)
        if c.mode == "none":
            return {}
        if c.mode == "fixed" and self._fixed is not None:
            return {l: LayerSpec(patch=self._fixed[l]) for l in layers}
        parts = {"selfcorrect": {"input", "output"}, "ideal": {"input", "output"}, "fixed": {"input", "output"},
                 "input-only": {"input"}, "vanilla": {"input", "vanilla"}}[c.mode]
        return {l: LayerSpec(targets=targets[l], parts=frozenset(parts), variant=c.variant, h_source=c.h_source,
                             ideal_input=targets[l].x_in if c.mode == "ideal" else None) for l in layers}

    @torch.no_grad()
    def patched(self, query_id: int, position: int, targets):
        """One no-context forward of the query token with this config's patches; returns (logits, PassRecord)."""
        ids = torch.tensor([[int(query_id)]], device=self.device)
        pos = torch.tensor([[int(position)]], device=self.device)
        hooks = PatchHooks(self.adapter, self.specs(targets), apply=self.config.apply, pdtype=self.pdtype)
        with float64_norms(self.model), hooks as record:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        if self.config.mode == "fixed" and self._fixed is None:
            self._fixed = dict(record.patches)
        return out.logits[0, -1], record


    @torch.no_grad()
    def batched(self, seq_ids, positions):
        """Teacher-forced Algorithm 1 for many queries at once (the paper's protocol with the history known).

        One full-context forward over ``seq_ids`` records the targets and the baseline logits at ``positions``;
        one query-alone pass runs the N query tokens ``seq_ids[positions]`` as N independent one-token sequences,
        each row patched with its own patches, computed inside this same pass (factored). Returns
        (baseline logits (N, V), patched logits (N, V), PassRecord, targets).
        """
        if self.config.mode == "fixed":
            raise ValueError("the fixed mode reuses the first token's patches step after step; run it step by step")
        if self.config.apply != "factored":
            raise ValueError("the batched path applies patches factored (one patch per row); use apply='factored' "
                             "or the step-by-step path for materialized patches")
        ids = torch.as_tensor(seq_ids, device=self.device).reshape(1, -1)
        pos = torch.as_tensor(list(positions), device=self.device, dtype=torch.long)
        if pos.numel() == 0 or int(pos.min()) < 0 or int(pos.max()) >= ids.shape[1]:
            raise ValueError(f"positions must lie in 0..{ids.shape[1] - 1}")
        with float64_norms(self.model), TargetRecorder(self.adapter, pos.tolist()) as rec:
            base = self.model(input_ids=ids, use_cache=False, logits_to_keep=pos).logits[0]
        targets = rec.targets()
        hooks = PatchHooks(self.adapter, self.specs(targets), apply="factored", pdtype=self.pdtype)
        with float64_norms(self.model), hooks as record:
            out = self.model(input_ids=ids[0, pos].reshape(-1, 1), position_ids=pos.reshape(-1, 1), use_cache=False,
                             logits_to_keep=1)
        return base, out.logits[:, -1], record, targets


def layer_errors(record, targets) -> list[float]:
    """Per layer: max |patched output - full-context output| / max |full-context output| (the Theorem 1 check)."""
    return [relative_error(out, targets[l].out) for l, out in sorted(record.outputs.items())]

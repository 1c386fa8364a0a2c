"""Algorithm 1 (paper Section 3.3) on every family of the registry: absorb the context, layer by layer, for one
query token.

1. Full-context pass: record, at the query position, each layer's ``Targets``.
2. Query token alone: layers below ``start_layer`` run unpatched; from ``start_layer`` on, each layer's patch is
   computed inside the pass from the values that pass produces, and applied before the pass moves on.

Two settings say what a run does:

``schedule`` -- where each patch's inputs come from:
* ``selfcorrect`` Algorithm 1 as stated: each layer's patch is computed from the *actual* output of the patched
  layer below (errors of the layers below are corrected);
* ``ideal``       the paper's contrast: every layer's patch is computed from the *ideal* input (the recorded
  full-context residual at that layer), then all patches are applied in a second pass that runs on the actual
  outputs, so errors propagate and nothing corrects them;
* ``oracle``      every patched layer is *fed* the recorded full-context input (a per-layer error floor, not a
  runnable procedure; what the first edition called ``ideal``);
* ``fixed``       the patches of the first generated token are reused at every later step.

``parts`` -- what each patch holds: ``full`` (input and output patches), ``none`` (no patch: the query alone, a
negative control), ``input-only`` (rank-1 input patches, no output patch), ``vanilla`` (input patches plus dv added
to the MLP output, the predecessor's recipe ported naively).

``variant`` (``naive`` | ``stable``) and ``h_source`` (``actual`` | ``recorded``) choose how the output patch is built;
``stable`` needs a trainable post-norm scale after the MLP (Gemma 2/3, OLMo 2). The old single ``mode`` maps onto
the pair (``LEGACY_MODES``; its ``ideal`` meant ``schedule="oracle"``).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass

import torch

from .engine import APPLY_MODES, H_SOURCES, VARIANTS, LayerSpec, PatchedPass, Recorder
from .families import Adapter
from .hooks import exact_float32, float64_norms
from .metrics import relative_error
from .models import DTYPES, dtype_name
from .patches import default_patch_dtype

SCHEDULES = ("selfcorrect", "ideal", "oracle", "fixed")
PARTS = {"full": frozenset({"input", "output"}), "none": frozenset(), "input-only": frozenset({"input"}),
         "vanilla": frozenset({"input", "vanilla"})}
LEGACY_MODES = {"selfcorrect": ("selfcorrect", "full"), "ideal": ("oracle", "full"), "fixed": ("fixed", "full"),
                "none": ("selfcorrect", "none"), "input-only": ("selfcorrect", "input-only"),
                "vanilla": ("selfcorrect", "vanilla")}
MODES = tuple(LEGACY_MODES)


def resolve_layer(spec, n_layers: int) -> int:
    """A layer named relative to the model: an index (negative counts from the end: -1 is the last layer),
    ``"first"``/``"last"``, or a fraction of depth in [0, 1] written with a point (layer ``round(f * n_layers)``,
    capped at the last): ``0.5`` is the middle layer of any model. Strings of these work too (the CLI)."""
    orig = spec
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in ("first", "last"):
            return 0 if s == "first" else n_layers - 1
        try:
            spec = float(s) if any(c in s for c in ".e") else int(s)
        except ValueError:
            spec = None
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ValueError(f"start_layer {orig!r} is not a layer: give an index (0..{n_layers - 1}, or negative from the "
                         f"end), 'first', 'last', or a fraction of depth such as 0.5")
    if isinstance(spec, float):
        if not 0.0 <= spec <= 1.0:
            raise ValueError(f"start_layer {orig!r}: a fraction of depth must lie in [0, 1]")
        return min(int(round(spec * n_layers)), n_layers - 1)
    idx = spec + n_layers if spec < 0 else spec
    if not 0 <= idx < n_layers:
        raise ValueError(f"start_layer {orig} is out of range: this model has {n_layers} decoder layers, so "
                         f"start_layer must be in 0..{n_layers - 1} or -{n_layers}..-1 ({n_layers - 1}, -1 or "
                         f"'last' = last layer only)")
    return idx


def from_legacy_mode(mode: str) -> tuple[str, str]:
    """(schedule, parts) of a first-edition ``mode``; its ``ideal`` fed recorded inputs, i.e. ``oracle``."""
    if mode not in LEGACY_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(LEGACY_MODES)} (or set schedule= and "
                         f"parts= directly)")
    return LEGACY_MODES[mode]


@dataclass
class PatchConfig:
    variant: str = "naive"
    start_layer: int | str | float = 0   # index, negative from the end, "last", or a fraction of depth
    h_source: str = "actual"
    apply: str = "factored"
    schedule: str = "selfcorrect"
    parts: str = "full"
    patch_dtype: str | None = None   # None: float32 for float32/bfloat16 models, float64 for float64 models
    mode: str | None = None          # first-edition name; mapped onto (schedule, parts) with a note

    def __post_init__(self):
        if self.mode is not None:
            schedule, parts = from_legacy_mode(self.mode)
            if self.mode == "ideal":
                warnings.warn("mode='ideal' of the first edition fed each layer the recorded input: it now runs as "
                              "schedule='oracle'; schedule='ideal' is the paper's contrast", stacklevel=3)
            self.schedule, self.parts, self.mode = schedule, parts, None

    def validate(self, n_layers: int) -> "PatchConfig":
        for name, value, choices in (("variant", self.variant, VARIANTS), ("h_source", self.h_source, H_SOURCES),
                                     ("apply", self.apply, APPLY_MODES), ("schedule", self.schedule, SCHEDULES),
                                     ("parts", self.parts, tuple(PARTS))):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")
        resolve_layer(self.start_layer, n_layers)
        if self.patch_dtype is not None and self.patch_dtype not in DTYPES:
            raise ValueError(f"unknown patch_dtype {self.patch_dtype!r}; choose one of: {', '.join(DTYPES)}")
        return self

    def resolved(self, n_layers: int) -> "PatchConfig":
        """A validated copy whose ``start_layer`` is this model's index; the spec as given is kept in
        ``start_layer_spec`` (the run record shows both)."""
        spec = getattr(self, "start_layer_spec", self.start_layer)
        self.validate(n_layers)
        out = PatchConfig.from_dict(self.to_dict())
        out.start_layer = resolve_layer(spec, n_layers)
        out.start_layer_spec = spec
        return out

    @property
    def label(self) -> str:
        """A short name: the schedule, or the parts when they are not ``full``."""
        return self.schedule if self.parts == "full" else self.parts

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("mode")
        if hasattr(self, "start_layer_spec"):
            d["start_layer_spec"] = self.start_layer_spec
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PatchConfig":
        """Read a config from a record, old (``mode``) or new (``schedule``, ``parts``)."""
        keys = ("variant", "start_layer", "h_source", "apply", "schedule", "parts", "patch_dtype")
        d = {**d, "start_layer": d.get("start_layer_spec", d.get("start_layer", 0))}
        kw = {k: d[k] for k in keys if k in d}
        if "schedule" not in d and "mode" in d:
            kw["schedule"], kw["parts"] = from_legacy_mode(d["mode"])
        return cls(**kw)


class Algorithm1:
    """Algorithm 1 on a transformers causal LM of any registered family; one instance per (model, config)."""

    def __init__(self, model, config: PatchConfig | None = None):
        self.model = model
        self.adapter = Adapter(model)
        self.config = (config or PatchConfig()).resolved(self.adapter.n_layers)
        if self.config.variant == "stable" and not self.adapter.stable_ok and self.config.parts == "full":
            raise ValueError(f"variant 'stable' needs a trainable post-norm scale after the MLP (Appendix B: Gemma 2/3, "
                             f"OLMo 2); this {self.adapter.family.key} model's output patch is a "
                             f"{self.adapter.parts[0].kind}. Use variant='naive'")
        self.pdtype = (DTYPES[self.config.patch_dtype] if self.config.patch_dtype
                       else default_patch_dtype(self.adapter.dtype))
        self.device = next(model.parameters()).device
        self._fixed = None
        self.media = None     # vision.Media: the images of the context (Gemma3ForConditionalGeneration), else None

    def _media(self, n_tokens: int) -> dict:
        """Extra inputs of a full-context forward over the first ``n_tokens`` tokens: the images, if any."""
        if self.media is None:
            return {}
        return self.media.kwargs(n_tokens, self.device, self.adapter.dtype)

    @property
    def patch_dtype_name(self) -> str:
        return dtype_name(self.pdtype)

    def reset(self):
        """Forget the patches kept by the ``fixed`` schedule (start of a new generation)."""
        self._fixed = None

    @contextlib.contextmanager
    def norms(self):
        """The arithmetic every pass runs in: float64 norms for float64 models, TF32 off unless bfloat16."""
        with float64_norms(self.model, self.adapter.family.scale_offset), \
                exact_float32(self.adapter.dtype != torch.bfloat16):
            yield

    # -- passes ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def full_context(self, input_ids, cache=None, positions=None):
        """Forward ``input_ids`` (1, T) with the full context; return (logits, targets, cache). ``positions``
        (a tensor): targets and logits at those positions (rows), else at the last one."""
        ids = torch.as_tensor(input_ids, device=self.device).reshape(1, -1)
        keep = 1 if positions is None else positions
        extra = self._media(ids.shape[1]) if cache is None else {}      # the images enter with the prompt
        with self.norms(), Recorder(self.adapter, positions) as rec:
            out = self.model(input_ids=ids, cache=cache, use_cache=positions is None, logits_to_keep=keep, **extra)
        logits = out.logits[0, -1] if positions is None else out.logits[0]
        cache = None if positions is not None else (out.get("cache") or out.get("past_key_values"))
        return logits, rec.targets(), cache

    def specs(self, targets, oracle: bool = False, layers=None) -> dict:
        c = self.config
        parts = PARTS[c.parts]
        if not parts:
            return {}
        layers = range(c.start_layer, self.adapter.n_layers) if layers is None else layers
        return {l: LayerSpec(targets=targets[l], parts=parts, variant=c.variant, h_source=c.h_source,
                             oracle=oracle or c.schedule == "oracle") for l in layers}

    def run_pass(self, ids, pos, specs, apply=None, hidden=False) -> tuple[torch.Tensor, PatchedPass]:
        """One no-context forward of the query rows ``ids`` (N, 1) at positions ``pos`` (N, 1) with ``specs``;
        returns (logits (N, V), the pass), or with ``hidden=True`` the final hidden rows (N, d) instead of logits."""
        pp = PatchedPass(self.adapter, specs, apply=apply or self.config.apply, pdtype=self.pdtype)
        with self.norms(), pp:
            if hidden:
                out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
                return out[:, -1], pp
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1], pp

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The model's own output head on final hidden rows (with Gemma 2's final logit soft-capping)."""
        logits = self.model.get_output_embeddings()(h)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def _schedule(self, ids, pos, targets, hidden=False):
        c = self.config
        if c.schedule == "fixed" and self._fixed is not None:
            logits, pp = self.run_pass(ids, pos, {l: LayerSpec(patch=p, targets=targets[l])
                                                  for l, p in self._fixed.items()}, hidden=hidden)
            pp.reused = True
            return logits, pp
        if c.schedule == "ideal":
            _, built = self.run_pass(ids, pos, self.specs(targets, oracle=True), hidden=True)
            logits, pp = self.run_pass(ids, pos, {l: LayerSpec(patch=p, targets=targets[l])
                                                  for l, p in built.patches.items()}, hidden=hidden)
            pp.patches = built.patches
            return logits, pp
        logits, pp = self.run_pass(ids, pos, self.specs(targets), hidden=hidden)
        if c.schedule == "fixed":
            self._fixed = dict(pp.patches)
        return logits, pp

    @torch.no_grad()
    def patched(self, query_id, position, targets):
        """One no-context forward of the query token under this config; returns (logits (V,), PatchedPass)."""
        ids = torch.as_tensor(query_id, device=self.device).reshape(1, 1)
        pos = torch.as_tensor(position, device=self.device).reshape(1, 1)
        logits, pp = self._schedule(ids, pos, targets)
        return logits[0], pp

    @torch.no_grad()
    def batched(self, seq_ids, positions, full: dict | None = None):
        """Teacher-forced Algorithm 1 for many queries at once (the paper's protocol with the history known).

        One full-context forward over ``seq_ids`` records the targets and the baseline logits at ``positions``;
        the query-alone pass runs the N query tokens ``seq_ids[positions]`` as N independent one-token sequences,
        each row patched with its own patches, computed inside that same pass (factored). Returns (baseline logits
        (N, V), patched logits (N, V), PatchedPass, targets).

        ``full``: a dict shared by batched runs of the same model on the same ``seq_ids`` and ``positions`` (e.g. the
        configurations of one comparison, which differ only in the query-alone pass). Empty, it receives this run's
        full-context pass (the baseline logits and the targets); filled, that pass is taken from it instead of run
        again, and the output head multiplies the N patched rows alone (the same numbers as a run of its own up to
        the rounding a product over N instead of 2N rows may pick). Not for a context with images.
        """
        if self.config.schedule == "fixed":
            raise ValueError("the fixed schedule reuses the first token's patches step after step; run it step by step")
        if self.config.apply != "factored":
            raise ValueError("the batched path applies patches factored (one patch per row); use apply='factored' "
                             "or the step-by-step path for materialized patches")
        ids = torch.as_tensor(seq_ids, device=self.device).reshape(1, -1)
        pos = torch.as_tensor(positions, device=self.device, dtype=torch.long).reshape(-1)
        n = ids.shape[1]
        if pos.numel() == 0 or not all(0 <= int(p) < n for p in positions):
            raise ValueError(f"positions must lie in 0..{n - 1}")
        if full is not None and self.media is not None:
            raise ValueError("full shares a text context's full-context pass; a context with images runs its own "
                             "(images of the same placeholders would share silently): drop full_context")
        key = (id(self.model), self.adapter.dtype, str(self.device), tuple(int(i) for i in seq_ids),
               tuple(int(p) for p in positions))
        if full and full.get("key") != key:
            raise ValueError("full holds the full-context pass of another sequence or other positions: share it only "
                             "between runs of the same model, prompt, baseline tokens and number of steps")
        # Both passes stop at the final hidden rows; one output-head product over all 2N rows then gives the
        # baseline and the patched logits (one large matrix product streams the head's weights once).
        if full:
            targets = full["targets"]
        else:
            with self.norms(), Recorder(self.adapter, pos) as rec:
                h_full = self.model.base_model(input_ids=ids, use_cache=False,
                                               **self._media(ids.shape[1])).last_hidden_state[0, pos]
            targets = rec.targets()
        h_query, pp = self._schedule(ids[0, pos].reshape(-1, 1), pos.reshape(-1, 1), targets, hidden=True)
        with self.norms():
            if full:
                return full["base"], self.head(h_query), pp, targets
            logits = self.head(torch.cat([h_full, h_query]))
        if full is not None:
            full.update(key=key, base=logits[: len(pos)].clone(), targets=targets)   # (not a view of all 2N rows)
        return logits[: len(pos)], logits[len(pos):], pp, targets


def layer_errors(record, targets) -> list[float]:
    """Per layer: max |patched output - full-context output| / max |full-context output| (the Theorem 1 check)."""
    return [relative_error(out, targets[l].out) for l, out in sorted(record.outputs.items())]

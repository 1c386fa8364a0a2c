"""``absorb`` a context into weight patches, and hold them: ``PatchSet`` (look at, apply, merge, save, load, export).

    import ctxpatch_lite as cp
    model, tok = cp.load_model()
    ps = cp.absorb(model, "The capital of France is", tokenizer=tok)
    ps.table()                        # one row per layer
    with ps.applied(model):           # the query token alone now gives the full-context logits
        ...
    restore = ps.merge_into(model)    # W + dW in the model's dtype; restore() undoes it bit for bit
    ps.save("france.patch"); ps2 = cp.PatchSet.load("france.patch", model=model)
    ps.to_peft("france-lora")         # a peft LoRA (r = 1) for the matrix patches, the norm scale as a saved module

**A patch set is per query token**: it makes *one* token (``query_id``, the last token of the context) at *one*
position give, alone, what it gives after this exact context, for this exact model. Another token, position,
context or model needs its own patch set.

**Each form is exact in its own arithmetic.** Scale patches reach 1e5-1e8 where the normalised MLP output is tiny,
so one rounding step of difference in what they divide by becomes a visible logit error. A PatchSet therefore keeps
the recorded targets and builds each form's patches in a pass that computes exactly what that form will compute:
``factored`` (``applied``) in the factored pass, ``materialized`` (``merge_into``) in the materialized pass (each layer's
patch computed over the written layers below it), ``peft`` in a pass through the peft-wrapped model itself. ``save``
keeps every form that was built, so a reload reproduces it bit for bit.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .algorithm import Algorithm1, PatchConfig
from .engine import LayerSpec, PatchedPass, Targets, write_patches
from .families import Adapter
from .models import dtype_name
from .patches import LayerPatch, Rank1

FORMAT_VERSION = 1
_TENSORS, _META = "patches.safetensors", "patchset.json"


class PatchSetMismatch(ValueError):
    """A patch set was applied to, or loaded onto, a model (or context) it was not built for."""


def _context_hash(ids) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def _config_hash(model) -> str:
    d = {k: v for k, v in model.config.to_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "torch_dtype", "dtype", "architectures")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _params_hash(adapter: Adapter, layers) -> str:
    """sha256 over the parameters a patch touches (each patched layer's MLP and output module), in the model's
    own bytes."""
    h = hashlib.sha256()
    for l in layers:
        P = adapter.parts[l]
        mods = [P.mlp] + ([P.output] if P.output is not None and P.output not in list(P.mlp.modules()) else [])
        for mod in mods:
            for name, p in sorted(mod.named_parameters()):
                if "lora_" in name or "modules_to_save" in name:
                    continue
                t = p.detach().cpu().contiguous()
                h.update(name.encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bfloat16
                         else t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def model_info(model, adapter: Adapter, layers) -> dict:
    import transformers
    return {"name": getattr(model, "ctxpatch_source", getattr(model.config, "_name_or_path", "") or
                            type(model).__name__),
            "class": type(model).__name__, "family": adapter.family.key, "n_layers": adapter.n_layers,
            "dtype": dtype_name(adapter.dtype), "config_sha": _config_hash(model),
            "params_sha": _params_hash(adapter, layers), "transformers": transformers.__version__,
            "torch": torch.__version__}


@dataclass
class PatchSet:
    """Per-layer patches that absorb one context for one query token, with what they are valid for."""

    query_id: int
    position: int
    context_ids: list
    config: PatchConfig
    targets: dict                          # layer -> Targets (one row) recorded with the full context
    forms: dict = field(default_factory=dict)   # "factored" | "materialized" | "peft" -> {layer: LayerPatch}
    model: dict = field(default_factory=dict)   # model_info of the model it was built on
    baseline_token: int | None = None      # the full-context argmax at the query
    images: list = field(default_factory=list)  # the context's images (vision.encode_context records), if any

    @property
    def layers(self) -> list[int]:
        return sorted(self.targets)

    @property
    def patches(self) -> dict:
        """The factored form (the one ``absorb`` builds)."""
        return self.forms["factored"]

    def describe(self) -> str:
        return (f"PatchSet: query token {self.query_id} at position {self.position} after {len(self.context_ids) - 1} "
                f"context tokens; {len(self.layers)} layers ({self.layers[0]}..{self.layers[-1]}) of "
                f"{self.model.get('name')} ({self.model.get('family')}, {self.model.get('dtype')}); variant "
                f"{self.config.variant}, schedule {self.config.schedule}, h_source {self.config.h_source}; forms built: "
                f"{', '.join(self.forms)}")

    __repr__ = describe

    # -- checks ----------------------------------------------------------------------------------------------
    def check_model(self, model, adapter: Adapter | None = None, weights: bool = True) -> Adapter:
        """The adapter of ``model``, or ``PatchSetMismatch`` naming the first property that differs (``weights``:
        also hash the parameters the patches touch)."""
        ad = adapter or Adapter(model)
        now = {"class": type(model).__name__, "family": ad.family.key, "n_layers": ad.n_layers,
               "dtype": dtype_name(ad.dtype), "config_sha": _config_hash(model)}
        for k, v in now.items():
            if self.model.get(k) != v:
                raise PatchSetMismatch(f"this patch set was built for a model with {k} = {self.model.get(k)!r}, but "
                                       f"the model given has {k} = {v!r}: rebuild it with cp.absorb on this model")
        if weights and _params_hash(ad, self.layers) != self.model.get("params_sha"):
            raise PatchSetMismatch("this patch set was built for other weights (same architecture, different "
                                   "parameters in the patched layers): rebuild it with cp.absorb on this model")
        return ad

    # -- forms -----------------------------------------------------------------------------------------------
    def _alg(self, model, apply="factored") -> Algorithm1:
        cfg = PatchConfig.from_dict({**self.config.to_dict(), "apply": apply})
        return Algorithm1(model, cfg)

    def _ids(self, alg):
        return (torch.tensor([[self.query_id]], device=alg.device), torch.tensor([[self.position]], device=alg.device))

    def _targets(self, alg):
        return [self.targets.get(l) for l in range(alg.adapter.n_layers)]

    def _build(self, alg, apply) -> dict:
        """Patches computed in a pass of the ``apply`` kind, on the query alone."""
        ids, pos = self._ids(alg)
        # ideal: the patches are computed from the recorded inputs, then applied as supplied patches
        specs = alg.specs(self._targets(alg), oracle=alg.config.schedule == "ideal", layers=self.layers)
        _, pp = alg.run_pass(ids, pos, specs, apply=apply)
        return pp.patches

    @contextlib.contextmanager
    def applied(self, model):
        """Apply the factored patches to ``model`` for the duration of the block (hooks; no weight is written)."""
        alg = self._alg(model)
        self.check_model(model, alg.adapter, weights=False)
        pp = PatchedPass(alg.adapter, {l: LayerSpec(patch=p) for l, p in self.forms["factored"].items()},
                         apply="factored", pdtype=alg.pdtype)
        with alg.norms(), pp:
            yield pp

    @torch.no_grad()
    def merge_into(self, model):
        """Write ``W + dW`` (and ``w + dm``) into ``model`` in its dtype by the engine's one cast rule; returns
        ``restore()``, which puts every written parameter back bit for bit. The merged patches are built layer by
        layer over the merged weights (the materialized form), on first use."""
        alg = self._alg(model, "materialized")
        self.check_model(model, alg.adapter)
        if "materialized" not in self.forms:
            self.forms["materialized"] = self._build(alg, "materialized")
        scope = write_patches(alg.adapter, self.forms["materialized"], alg.pdtype)
        return scope.restore

    @torch.no_grad()
    def to_peft(self, path, model):
        """Save a peft LoRA adapter (r = 1: ``B = u``, ``A = z^T / ||z||^2``, scaling 1) that reproduces this patch
        set on ``model``: the rank-1 matrix patches as LoRA factors, a post-norm scale patch as a saved copy of the
        norm (``modules_to_save``). The LoRA weights are set layer by layer inside a pass through the peft-wrapped
        model itself, so the adapter is exact in peft's own arithmetic. ``model`` is left as it was.

        Load it with ``peft.PeftModel.from_pretrained(model, path)`` and feed the query token alone."""
        from peft import LoraConfig, get_peft_model

        ad = self.check_model(model)
        fam = ad.family
        kinds = {ad.parts[l].kind for l in self.layers}
        if kinds & {"bias", "moe"} or self.config.parts not in ("full", "input-only"):
            raise ValueError(f"peft cannot express this patch set: {fam.key}'s output patch is a "
                             f"{'/'.join(sorted(kinds))} (LoRA holds low-rank matrix updates, and a saved module "
                             f"copy for a norm scale); parts {self.config.parts!r}. Use merge_into or applied instead")
        targets = list(fam.inputs)
        if "matrix" in kinds:
            targets.append(fam.output_module)
        if self.config.variant == "stable":
            targets.append(fam.mlp_out)
        save = [fam.output_module] if "scale" in kinds and self.config.parts == "full" else None
        cfg = LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, bias="none", target_modules=sorted(set(targets)),
                         modules_to_save=save, layers_to_transform=self.layers, init_lora_weights=False)
        peft_model = get_peft_model(model, cfg)
        try:
            alg = self._alg(model)
            self.forms["peft"] = self._build(alg, "peft")
            peft_model.save_pretrained(str(path))
        finally:
            unload_peft(peft_model)
        Path(path, "ctxpatch_patchset.json").write_text(json.dumps(self._meta(), indent=1))
        return Path(path)

    # -- inspection --------------------------------------------------------------------------------------------
    def table(self, form: str = "factored"):
        """A pandas DataFrame, one row per layer: norms of every matrix patch (``||dW_name||_F``), of the scale or
        bias patch, the numerical rank of the matrix patches (1 when both factors are non-zero), min |h|,
        fallbacks and hard cases."""
        from ._optional import require
        pd = require("pandas", "notebooks", "PatchSet.table()")

        patches = self.forms[form]
        mats = sorted({k for p in patches.values() for k, v in {**p.inputs, **p.output}.items()
                       if isinstance(v, Rank1)})
        vals = {}
        for l, p in sorted(patches.items()):   # one host transfer per layer (inspection, not a hot path)
            entries = [{**p.inputs, **p.output}.get(k) for k in mats]
            nums = [float(e.fro()[0]) if e is not None else math.nan for e in entries]
            d = p.diagnostics
            ranks = [int(bool(e.u.norm() > 0) and bool(e.z.norm() > 0)) for e in entries if e is not None]
            vals[l] = {"kind": p.kind, "||dv||": d.dv_norm, "||z||": d.z_norm,
                       **{f"||dW_{k}||": v for k, v in zip(mats, nums)},
                       "||dm||": d.dm_l2, "max|dm|": d.dm_max_abs, "||db||": d.bias_l2,
                       "rank": max(ranks, default=0), "min|h|": d.min_abs_h, "fallbacks": d.fallbacks,
                       "hard case": d.hard_case, "block error": d.block_error}
        df = pd.DataFrame.from_dict(vals, orient="index")
        df.index.name = "layer"
        return df.dropna(axis=1, how="all")

    # -- save / load -------------------------------------------------------------------------------------------
    def _meta(self) -> dict:
        import ctxpatch_lite
        return {"format": "ctxpatch-lite PatchSet", "format_version": FORMAT_VERSION,
                "valid_for": "one query token (query_id) at one position, after exactly context_ids (and the images "
                             "under 'images', by sha256, where the context held any), on the model described under "
                             "'model'",
                "query_id": self.query_id, "position": self.position, "context_ids": self.context_ids,
                "context_sha": _context_hash(self.context_ids), "baseline_token": self.baseline_token,
                **({"images": self.images} if self.images else {}),
                "config": self.config.to_dict(), "layers": self.layers, "forms": list(self.forms),
                "model": self.model, "ctxpatch_lite": ctxpatch_lite.__version__}

    def save(self, path) -> Path:
        """A folder: ``patches.safetensors`` (rank-1 factors and vectors of every built form, and the targets; never
        a dense matrix) and ``patchset.json`` (what the patches are valid for)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for form, patches in self.forms.items():
            for l, p in patches.items():
                for key, t in _flatten(p).items():
                    tensors[f"{form}/{l}/{key}"] = t.detach().cpu().clone()   # shared factors stored apart
        for l, T in self.targets.items():
            for k, v in T.__dict__.items():
                if v is not None:
                    tensors[f"targets/{l}/{k}"] = v.detach().cpu().clone()
        save_file(tensors, str(path / _TENSORS))
        meta = self._meta()
        meta["kinds"] = {form: {str(l): p.kind for l, p in ps.items()} for form, ps in self.forms.items()}
        (path / _META).write_text(json.dumps(meta, indent=1))
        return path

    @classmethod
    def load(cls, path, model=None, device=None) -> "PatchSet":
        """Read a saved patch set; with ``model``, check it matches (else ``PatchSetMismatch``) and put the tensors
        on the model's device."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / _META).is_file():
            raise FileNotFoundError(f"{path} is not a saved PatchSet (no {_META}); save one with PatchSet.save")
        meta = json.loads((path / _META).read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise PatchSetMismatch(f"{path}: format version {meta.get('format_version')}, this library reads "
                                   f"{FORMAT_VERSION}")
        if device is None and model is not None:
            device = next(model.parameters()).device
        # clone(): tensors read by safetensors may sit at file offsets with other memory alignment than fresh ones,
        # and a CPU kernel may then round a reduction differently -- which a scale patch of 1e6 turns into O(1)
        tensors = {k: (v.to(device) if device is not None else v).clone()
                   for k, v in load_file(str(path / _TENSORS)).items()}
        groups: dict = {}
        for k, v in tensors.items():
            form, l, rest = k.split("/", 2)
            groups.setdefault(form, {}).setdefault(int(l), {})[rest] = v
        targets = {l: Targets(**d) for l, d in groups.pop("targets", {}).items()}
        forms = {form: {l: _unflatten(l, meta["kinds"][form][str(l)], d) for l, d in sorted(ps.items())}
                 for form, ps in groups.items()}
        ps = cls(meta["query_id"], meta["position"], meta["context_ids"], PatchConfig.from_dict(meta["config"]),
                 targets, forms, meta["model"], meta.get("baseline_token"), meta.get("images", []))
        if model is not None:
            ps.check_model(model)
        return ps


def unload_peft(peft_model):
    """``peft_model.unload()`` that gives the base model back exactly as it was: peft's unload keeps the
    ``modules_to_save`` *copies* (here: the patched norm scales) in place of the originals, so the original module
    objects are put back."""
    from peft.utils.other import ModulesToSaveWrapper

    inner = peft_model.base_model.model      # the user's model object, wrapped in place
    originals = {name: m.original_module for name, m in inner.named_modules() if isinstance(m, ModulesToSaveWrapper)}
    base = peft_model.unload()
    for name, mod in originals.items():
        owner_name, _, attr = name.rpartition(".")
        setattr(base.get_submodule(owner_name) if owner_name else base, attr, mod)
    return base


def _flatten(p: LayerPatch) -> dict:
    out = {}
    for sec in ("inputs", "output"):
        for name, v in getattr(p, sec).items():
            if isinstance(v, Rank1):
                out[f"{sec}/{name}/u"], out[f"{sec}/{name}/z"] = v.u, v.z
            else:
                out[f"{sec}/{name}"] = v
    for name in ("vanilla", "dv"):
        if getattr(p, name) is not None:
            out[name] = getattr(p, name)
    out.update({f"diag/{k}": v for k, v in p.diag.items()})
    out.update({f"extra/{k}": v for k, v in p.extra.items()})
    return out


def _unflatten(layer: int, kind: str, d: dict) -> LayerPatch:
    p = LayerPatch(layer=layer, kind=kind)
    for key, v in d.items():
        parts = key.split("/")
        if parts[0] in ("inputs", "output"):
            sec = getattr(p, parts[0])
            if len(parts) == 3:
                r = sec.setdefault(parts[1], Rank1(None, None))
                setattr(r, parts[2], v)
            else:
                sec[parts[1]] = v
        elif parts[0] in ("diag", "extra"):
            getattr(p, parts[0])[parts[1]] = v
        else:
            setattr(p, parts[0], v)
    return p


@torch.no_grad()
def absorb(model, context, tokenizer=None, config: PatchConfig | None = None, images: list | None = None) -> PatchSet:
    """Absorb ``context`` into per-layer weight patches for its last token (the query).

    ``context``: text (with ``tokenizer``; encoded as ``tokenizer(text)`` does, with BOS) or token ids. Returns a
    ``PatchSet`` holding the factored patches (``applied``), the recorded targets (to build the other forms exactly)
    and what it is valid for. ``config``: as for Algorithm 1 (variant, start_layer, h_source, schedule ``selfcorrect``
    or ``ideal``, parts). ``images``: PIL images or paths in a text ``context`` with one image placeholder each, for
    a ``Gemma3ForConditionalGeneration`` with its processor as ``tokenizer`` (``vision.encode_context``); the
    patches then hold what the images did too."""
    media = None
    if images is not None:
        from .vision import encode_context
        if not isinstance(context, str):
            raise ValueError("absorb with images needs the context as text with one image placeholder per image")
        ids, media = encode_context(tokenizer, context, images, model)
    elif isinstance(context, str):
        if tokenizer is None:
            raise ValueError("absorb got text but no tokenizer: pass tokenizer=..., or token ids")
        from .protocol import encode_prompt
        ids = encode_prompt(tokenizer, context)
    else:
        ids = [int(i) for i in torch.as_tensor(context).reshape(-1).tolist()]
    if len(ids) < 2:
        raise ValueError(f"absorb needs a context before the query token: got {len(ids)} token(s)")
    config = config or PatchConfig()
    if config.schedule not in ("selfcorrect", "ideal") or config.parts == "none":
        raise ValueError(f"absorb builds patches a model can hold: schedule 'selfcorrect' or 'ideal' with some parts "
                         f"(got schedule {config.schedule!r}, parts {config.parts!r}; 'oracle' feeds recorded inputs "
                         f"and 'fixed' is a generation protocol)")
    alg = Algorithm1(model, PatchConfig.from_dict({**config.to_dict(), "apply": "factored"}))
    alg.media = media
    logits, T, _ = alg.full_context(ids)
    layers = list(range(alg.config.start_layer, alg.adapter.n_layers))
    ps = PatchSet(ids[-1], len(ids) - 1, ids, alg.config, {l: T[l] for l in layers},
                  model=model_info(model, alg.adapter, layers), baseline_token=int(logits.argmax()))
    ps.images = media.images if media is not None else []
    ps.forms["factored"] = ps._build(alg, "factored")
    return ps

"""The paper's generation protocol (Section 4.1) and its per-step records.

A greedy baseline runs with the full context (KV-cached: one decode step per token). At every step the patched
model sees only the current token, with all layer patches recomputed against the baseline's targets for this
history. Whether or not the two argmaxes agree, both continue on the *baseline's* token, so every step compares
next-token distributions on the same history (token match is a per-step, conditional measure).
"""
from __future__ import annotations

import math
import platform
import time

import torch
from tqdm.auto import tqdm

from .algorithm import Algorithm1, PatchConfig
from .engine import diag_rows
from .metrics import aggregate, compare_rows
from .models import dtype_name
from .arithmetic import arithmetic_path
from .hooks import exact_float32, precision_flags
from .patches import DIAG_KEYS
from .records import SCHEMA_VERSION, RunRecord, StepRecord, upgrade_record  # noqa: F401



class PromptError(ValueError):
    """The prompt is empty or cannot be tokenised into at least one token."""


def encode_prompt(tokenizer, prompt: str, chat_template: bool = False) -> list[int]:
    """Token ids of ``prompt``: as ``tokenizer(prompt)`` does (with BOS), or wrapped in the chat template first."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptError("the prompt is empty; pass some text (the context to absorb) via --prompt or --prompt-file")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError("this tokenizer has no chat template (the embedded Gemma 3 270M is a base model); "
                              "drop --chat-template to tokenise the prompt as plain text")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt)["input_ids"]
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise PromptError(f"the prompt {prompt!r} tokenises to {len(ids)} token(s); Algorithm 1 needs a context "
                          f"before the query token, i.e. at least 2 tokens")
    return ids


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def step_diagnostics(layers: list[int], diag: list[list[float]]) -> dict:
    """Aggregate one query's per-layer diagnostics (``layers`` and their rows of ``DIAG_KEYS`` values, already on
    the host), plus per-layer lists. NaN marks a quantity a layer's patch does not have."""
    if not layers:
        return {"patched_layers": 0}
    col = {k: [row[i] for row in diag] for i, k in enumerate(DIAG_KEYS)}
    finite = lambda xs: [x for x in xs if not math.isnan(x)]  # noqa: E731
    zero_nan = lambda xs: [0.0 if math.isnan(x) else x for x in xs]  # noqa: E731
    out = {
        "patched_layers": len(layers),
        "min_abs_h": min(finite(col["min_abs_h"]), default=float("nan")),
        "fallbacks": int(sum(zero_nan(col["fallbacks"]))),
        "fallbacks_m0": int(sum(zero_nan(col["fallbacks_m0"]))),     # of them, on coordinates with m_i = 0
        "fallback_miss": math.sqrt(sum(x * x for x in zero_nan(col["fallback_miss"]))),   # what they leave out
        "hard_cases": int(sum(zero_nan(col["hard_case"]))),
        "min_z_norm": min(finite(col["z_norm"]), default=float("nan")),
        "matrix_norm": math.sqrt(sum(x * x for x in zero_nan(col["matrix_norm"]))),
        "dm_norm": math.sqrt(sum(x * x for x in zero_nan(col["dm_l2"]))),
        "dm_max_abs": max(zero_nan(col["dm_max_abs"])),
        "max_block_error": max(finite(col["block_error"]), default=float("nan")),
        # patch anatomy (App. C.2): the share of ||dm||^2 (all patched layers) held by each layer's top 1 % of
        # coordinates, and the patch norms relative to the norms of the parameters they are added to
        "dm_top_share": _ratio(sum(x * x for x in zero_nan(col["dm_top_l2"])), sum(x * x for x in zero_nan(col["dm_l2"]))),
        "matrix_rel": _ratio(math.sqrt(sum(x * x for x in zero_nan(col["matrix_norm"]))),
                             math.sqrt(sum(x * x for x in zero_nan(col["matrix_ref"])))),
        "dm_rel": _ratio(math.sqrt(sum(x * x for x in zero_nan(col["dm_l2"]))),
                         math.sqrt(sum(x * x for x in zero_nan(col["scale_ref"])))),
        "per_layer": {
            "layer": list(layers),
            "dv_norm": col["dv_norm"],
            "matrix_norm": zero_nan(col["matrix_norm"]),
            "dm_l2": zero_nan(col["dm_l2"]),
            "dm_max_abs": zero_nan(col["dm_max_abs"]),
            "min_abs_h": col["min_abs_h"],
            "fallbacks": [int(x) for x in zero_nan(col["fallbacks"])],
            "fallbacks_m0": [int(x) for x in zero_nan(col["fallbacks_m0"])],
            "fallback_miss": zero_nan(col["fallback_miss"]),          # what each layer's fallbacks left out
            "hard_case": [bool(x) for x in zero_nan(col["hard_case"])],
            "block_error": col["block_error"],
        },
    }
    if finite(col["S"]):
        out["min_S"] = min(finite(col["S"]))
        out["routing_match"] = all(bool(x) for x in finite(col["routing_match"]))
    return out


def environment(model=None) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
           "torch_threads": torch.get_num_threads(), "precision_flags": precision_flags(),
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "arithmetic_path": arithmetic_path()}
    from ._optional import warn_old_versions
    if warnings := warn_old_versions():
        env["version_warnings"] = warnings
    try:
        from . import __version__
        env["ctxpatch_lite"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return env


CASTS = ("patches are built in the patch dtype; the RMSNorm inversion (stable) runs in float64 and its target is "
         "cast to the patch dtype; materialized: W+dW and w+dm are cast to the model dtype when stored; factored: "
         "rank-1 actions are cast to the model dtype when added to Linear outputs, the patched post-norm is computed "
         "in the norm dtype (float32; float64 for float64 models) and cast to the model dtype, as Gemma does; "
         "metrics are computed in float64 from the logits")


def greedy_baseline(model, prompt_ids: list[int], n_tokens: int, media=None) -> list[int]:
    """The baseline's greedy tokens with the full context (KV-cached decode steps, no hooks). ``media``
    (``vision.Media``): the context's images, given with the prompt's forward."""
    dev = next(model.parameters()).device
    cache, out = None, []
    extra = media.kwargs(len(prompt_ids), dev, model.dtype) if media is not None else {}   # the prompt's forward only
    with torch.no_grad():   # the next input is the argmax tensor itself: no host transfer until the end
        step = torch.tensor([list(prompt_ids)], device=dev)
        for _ in range(n_tokens):
            res = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1, **extra)
            extra = {}
            cache = res.get("cache") or res.get("past_key_values")
            step = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(step)
    return torch.cat(out, 1)[0].tolist()


def summarize(steps: list[dict]) -> dict:
    """``aggregate`` of the metrics plus the patch-condition totals, over any list of step records."""
    summary = aggregate(steps)
    summary["first_mismatch"] = next((i for i, s in enumerate(steps) if not s["match"]), None)
    reused = [s for s in steps if s.get("reused")]
    if reused:  # the fixed schedule: step 0 is freshly patched, later steps reuse its patches
        summary["reused"] = aggregate(reused)
    diag = [s["diagnostics"] for s in steps]
    summary.update({
        "fallbacks_total": sum(d.get("fallbacks", 0) for d in diag),
        "fallbacks_m0_total": sum(d.get("fallbacks_m0", 0) for d in diag),
        "hard_cases_total": sum(d.get("hard_cases", 0) for d in diag),
        "min_abs_h": min((d["min_abs_h"] for d in diag if "min_abs_h" in d and not math.isnan(d["min_abs_h"])),
                         default=float("nan")),
    })
    return summary


def run_protocol(model, tokenizer=None, prompt: str | None = None, n_tokens: int = 20,
                 config: PatchConfig | None = None, prompt_ids: list[int] | None = None, chat_template: bool = False,
                 progress: bool = True, desc: str | None = None, batched: bool = False,
                 forcing: str = "baseline", images: list | None = None, greedy: list[int] | None = None,
                 full_context: dict | None = None) -> dict:
    """Run the paper's per-token protocol; return a JSON-ready record with per-step metrics and diagnostics.

    ``batched=True`` (teacher-forced): generate the baseline's greedy tokens first (KV-cached), then compute every
    step's targets in one full-context forward and every step's patched logits in one batched query-alone pass.
    The baseline logits then come from that full-sequence forward (compare like with like).

    ``forcing``: whose token extends the history. ``"baseline"`` (the paper's protocol, above). ``"patched"``
    (free-running): the patched model picks its own next token and both continue on it, so the patched model
    writes its own text; each step still compares it with the full-context model on that same history, and the
    record's ``free`` block gives the baseline's own greedy text and the number of leading tokens the two texts
    share (``identical_prefix``).

    ``images`` (a ``Gemma3ForConditionalGeneration`` and its processor as ``tokenizer``): PIL images or paths, one
    per image placeholder (``<start_of_image>``) in ``prompt``; the full-context passes see them, the query-alone
    pass never does. The record's ``config.images`` names each (file name, sha256, sizes, soft tokens).

    ``greedy`` (batched path only): the baseline's greedy continuation, when it is already known, e.g. the
    ``generated_ids`` of another run of the same model, prompt and dtype; its first ``n_tokens`` tokens are used and
    the decode that would find them is skipped.

    ``full_context`` (batched path only): a dict shared by runs of the same model, prompt, ``greedy`` tokens and
    ``n_tokens`` under different configurations; the first run stores its full-context pass there (baseline logits
    and targets), the others reuse it (``Algorithm1.batched``; text contexts only).
    """
    if forcing not in FORCING:
        raise ValueError(f"unknown forcing {forcing!r}; choose one of: {', '.join(FORCING)}")
    if batched and forcing != "baseline":
        raise ValueError("the batched path is teacher-forced on the baseline's greedy tokens; free-running "
                         "generation (forcing='patched') runs step by step: drop batched=True")
    media = None
    if images is not None:
        from .vision import encode_context
        if prompt is None or prompt_ids is not None:
            raise PromptError("a context with images is a text prompt with one image placeholder per image (and the "
                              "processor as tokenizer); prompt_ids cannot carry images")
        prompt_ids, media = encode_context(tokenizer, prompt, images, model)
    elif prompt_ids is None:
        if tokenizer is None:
            raise PromptError("pass a tokenizer with a text prompt, or prompt_ids")
        prompt_ids = encode_prompt(tokenizer, prompt, chat_template)
    prompt_ids = [int(i) for i in prompt_ids]
    if len(prompt_ids) < 2:
        raise PromptError("prompt_ids needs at least 2 tokens (a context and a query)")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    if full_context is not None and not batched:
        raise ValueError("full_context shares the batched path's full-context pass between runs: pass batched=True")
    if greedy is not None and (not batched or len(greedy) < n_tokens):
        raise ValueError("greedy gives the baseline's known greedy tokens to the batched path: pass batched=True and at "
                         f"least n_tokens = {n_tokens} tokens (got {len(greedy)})")
    alg = Algorithm1(model, config or PatchConfig())
    alg.reset()
    alg.media = media
    ids = list(prompt_ids)
    t0 = time.perf_counter()
    with exact_float32(alg.adapter.dtype != torch.bfloat16):   # TF32 off for float32/float64 runs, then restored
        flags = precision_flags()
        if batched:
            steps = _batched_steps(alg, ids, n_tokens, tokenizer, progress, desc, greedy, full_context)
        else:
            steps = _loop_steps(alg, ids, n_tokens, tokenizer, progress, desc, free=forcing == "patched")
        free = None
        if forcing == "patched":
            greedy = greedy_baseline(model, prompt_ids, n_tokens, media)
            own = [s.next_token for s in steps]
            k = next((i for i, (a, b) in enumerate(zip(own, greedy)) if a != b), len(own))
            free = {"baseline_greedy_ids": greedy, "identical_prefix": k, "n_tokens": len(own),
                    "after_divergence": aggregate([s.to_dict() for s in steps[k:]]) if k < len(own) else None}
    seconds = time.perf_counter() - t0
    ids += [s.next_token for s in steps]  # both continued on the forced token
    dicts = [s.to_dict() for s in steps]
    return RunRecord(
        prompt=prompt, prompt_ids=prompt_ids,
        prompt_encoding="chat_template" if chat_template else "plain (tokenizer(prompt), with BOS)",
        generated_ids=ids[len(prompt_ids):],
        generated_text=tokenizer.decode(ids[len(prompt_ids):]) if tokenizer is not None else None,
        steps=steps, summary=summarize(dicts), seconds=seconds,
        config={
            **alg.config.to_dict(),
            "patch_dtype": alg.patch_dtype_name,
            "model": getattr(model, "ctxpatch_source", type(model).__name__),
            "model_class": type(model).__name__,
            "family": alg.adapter.family.key,
            "dtype": dtype_name(alg.adapter.dtype),
            "device": str(alg.device),
            "n_layers": alg.adapter.n_layers,
            "hidden_size": getattr(model.config.get_text_config(), "hidden_size", None),
            "casts": CASTS,
            "path": "batched teacher-forced" if batched else "step by step (KV-cached targets)",
            "forcing": forcing,
            "precision_flags": flags,
            "environment": environment(model),
            **({"images": media.images, "image_token_positions": [i for i, t in enumerate(
                media.token_type_ids[0].tolist()) if t == 1]} if media is not None else {}),
        },
        extra={"free": free} if free is not None else {},
    ).to_dict()


FORCING = ("baseline", "patched")


def _step_record(step, position, query, metrics, layers, diag, tokenizer, **extra) -> StepRecord:
    return StepRecord(step=step, position=position, query_token=query, **metrics,
                      diagnostics=step_diagnostics(layers, diag), next_token=extra.pop("next_token"),
                      baseline_text=tokenizer.decode([metrics["baseline_token"]]) if tokenizer is not None else None,
                      patched_text=tokenizer.decode([metrics["patched_token"]]) if tokenizer is not None else None,
                      **extra)


def _loop_steps(alg: Algorithm1, prompt_ids, n_tokens, tokenizer, progress, desc, free=False) -> list[StepRecord]:
    """Step by step: one KV-cached full-context decode step (targets) and one patched pass per token; the
    history grows by the baseline's token, or by the patched model's own token when ``free``."""
    ids, steps = list(prompt_ids), []
    logits, targets, cache = alg.full_context(ids)
    for step in tqdm(range(n_tokens), desc=desc or f"{alg.config.label}/{alg.config.variant}", disable=not progress,
                     leave=False):
        q_logits, record = alg.patched(ids[-1], len(ids) - 1, targets)
        layers = sorted(record.patches)
        metrics = compare_rows(logits, q_logits)[0]
        nxt = metrics["patched_token" if free else "baseline_token"]
        rec = _step_record(step, len(ids) - 1, ids[-1], metrics, layers, diag_rows(record.patches, 1)[0], tokenizer,
                           next_token=nxt, reused=True if getattr(record, "reused", False) else None)
        steps.append(rec)
        ids.append(nxt)  # both continue on the same token
        if step < n_tokens - 1:
            logits, targets, cache = alg.full_context([nxt], cache)
    return steps


def _batched_steps(alg: Algorithm1, prompt_ids, n_tokens, tokenizer, progress, desc, greedy=None,
                   full=None) -> list[StepRecord]:
    """Teacher-forced: baseline tokens first, then all targets and all patched passes in one batch each.

    The history follows the KV-cached greedy tokens (``next_token``). The compared baseline logits come from
    the full-sequence forward; in low precision their argmax can differ from the cached greedy token at a near
    tie, which the record flags as ``baseline_argmax_differs``.
    """
    gen = [int(t) for t in greedy[:n_tokens]] if greedy is not None else greedy_baseline(alg.model, prompt_ids,
                                                                                          n_tokens, alg.media)
    seq = list(prompt_ids) + gen[:-1]
    positions = list(range(len(prompt_ids) - 1, len(seq)))
    base, patched, record, _ = alg.batched(seq, positions, full)
    layers = sorted(record.patches)
    diag = diag_rows(record.patches, len(positions))
    metrics = compare_rows(base, patched)          # every row's metrics in one host transfer
    steps = []
    for i, p in enumerate(tqdm(positions, desc=desc or "batched", disable=not progress, leave=False)):
        steps.append(_step_record(i, p, seq[p], metrics[i], layers, diag[i], tokenizer, next_token=gen[i],
                                  baseline_argmax_differs=metrics[i]["baseline_token"] != gen[i]))
    return steps

"""Algorithm 1 on every family of the registry, through the one engine: the rows of the verification table
(``verify_architectures``) on seeded tiny models of transformers' own classes, and on the embedded Gemma 3 270M.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from .algorithm import Algorithm1, PatchConfig
from .families import Adapter
from .fixtures import VOCAB, tiny_model
from .protocol import run_protocol

__all__ = ["tiny_model", "algorithm1_step", "single_block_errors", "verify_family", "verify_embedded", "FamilyRow",
           "meets_target", "FLOAT64_TOLERANCE"]


@torch.no_grad()
def algorithm1_step(model, seq: list, start_layer: int = 0, config: PatchConfig | None = None):
    """Full-context pass over ``seq``, then its last token alone with patches from ``start_layer`` on.

    Returns (baseline logits, patched logits, unpatched logits, per-layer relative errors, {layer: LayerPatch}).
    """
    cfg = config or PatchConfig(start_layer=start_layer)
    alg = Algorithm1(model, cfg)
    base, T, _ = alg.full_context(list(seq))
    patched, pp = alg.patched(seq[-1], len(seq) - 1, T)
    unpatched, _ = Algorithm1(model, PatchConfig(parts="none")).patched(seq[-1], len(seq) - 1, T)
    errors = [pp.patches[l].diagnostics.block_error for l in sorted(pp.patches)]
    return base, patched, unpatched, errors, pp.patches


@torch.no_grad()
def single_block_errors(model, seq: list) -> list[float]:
    """Theorem 1 block by block: layer l alone is patched and fed the full-context input ``x_C`` at the query;
    returns, per layer, max |patched output - full-context output| / max |full-context output|."""
    alg = Algorithm1(model, PatchConfig(schedule="oracle"))
    _, T, _ = alg.full_context(list(seq))
    ids = torch.tensor([[seq[-1]]], device=alg.device)
    pos = torch.tensor([[len(seq) - 1]], device=alg.device)
    errs = []
    for l in range(alg.adapter.n_layers):
        _, pp = alg.run_pass(ids, pos, alg.specs(T, layers=[l]))
        errs.append(pp.patches[l].diag["block_error"])
    return torch.cat(errs).tolist()


@dataclass
class FamilyRow:
    family: str
    hf_class: str
    block: str
    input_patch: str
    output_patch: str
    dtype: str
    single_block_rel_error: float
    max_block_rel_error: float
    token_match: str                 # factored, step by step (KV-cached targets)
    linf_median: float
    linf_last: float
    fallbacks: int
    none_token_match: str
    none_linf_median: float
    routing: str
    materialized_token_match: str = "-"
    materialized_linf_median: float = float("nan")
    batched_token_match: str = "-"
    batched_linf_median: float = float("nan")
    batched_same_tokens: bool = True  # the batched path's patched tokens equal the loop's
    stable_token_match: str = "-"    # only for a trainable post-norm scale (Appendix B)
    stable_linf_median: float = float("nan")
    weights: str = "random (seeded)"

    def to_dict(self):
        return asdict(self)


FLOAT64_TOLERANCE = 1e-10


def _all(match: str) -> bool:
    if match == "-":
        return True
    done, total = (int(x) for x in match.split("/"))
    return done == total


def meets_target(row: dict) -> bool:
    """A family row (``FamilyRow.to_dict()`` or its JSON) meets the target: every token matches on every path that
    ran (factored, materialized, batched, stable), and in float64 every block, alone and inside Algorithm 1, is
    within ``FLOAT64_TOLERANCE`` of its full-context output."""
    ok = all(_all(row.get(k, "-")) for k in ("token_match", "materialized_token_match", "batched_token_match",
                                            "stable_token_match"))
    ok = ok and row.get("batched_same_tokens", True)
    if row["dtype"] == "float64":
        ok = ok and max(row["max_block_rel_error"], row["single_block_rel_error"]) <= FLOAT64_TOLERANCE
    return ok


def _frac(run) -> str:
    return f"{run['summary']['n_match']}/{run['n_tokens']}"


def family_row(model, family_key: str, prompt: list, n_tokens: int, dtype: str, weights: str,
               progress: bool = False) -> FamilyRow:
    """One table row: Algorithm 1 factored (step by step), materialized, batched, stable where it applies, and the
    unpatched control, on ``model`` with ``prompt`` (token ids)."""
    ad = Adapter(model)
    run = lambda batched=False, **cfg: run_protocol(model, prompt_ids=prompt, n_tokens=n_tokens,  # noqa: E731
                                                    config=PatchConfig(**cfg), progress=progress, batched=batched,
                                                    desc=family_key)
    res, mat, bat, none = run(), run(apply="materialized"), run(batched=True), run(parts="none")
    stable = run(variant="stable") if ad.stable_ok else None
    steps = res["steps"]
    diags = [s["diagnostics"] for s in steps]
    moe = any("min_S" in d for d in diags)
    routing = "-"
    if moe:
        routing = (f"{sum(d['routing_match'] for d in diags)}/{len(diags)}, "
                   f"min S {min(d['min_S'] for d in diags):.3f}")
    block, ins, outs = ad.describe_parts()
    med = lambda r: statistics.median(r["linf"])  # noqa: E731
    return FamilyRow(
        family_key, type(model).__name__, block, ins, outs, dtype, max(single_block_errors(model, prompt)),
        max(d["max_block_error"] for d in diags), _frac(res), med(res), res["linf"][-1],
        sum(d["fallbacks"] for d in diags), _frac(none), med(none), routing,
        materialized_token_match=_frac(mat), materialized_linf_median=med(mat),
        batched_token_match=_frac(bat), batched_linf_median=med(bat),
        batched_same_tokens=[s["patched_token"] for s in bat["steps"]] == [s["patched_token"] for s in steps],
        stable_token_match=_frac(stable) if stable else "-",
        stable_linf_median=med(stable) if stable else float("nan"), weights=weights)


def verify_family(family: str, dtype="float64", n_tokens: int = 8, seed: int = 0, prompt_len: int = 6,
                  progress: bool = False) -> FamilyRow:
    """Algorithm 1 on the seeded tiny model of ``family``: one table row."""
    model = tiny_model(family, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist()
    return family_row(model, family, prompt, n_tokens, dtype, "random (seeded)", progress)


def verify_embedded(dtype="float32", n_tokens: int = 4, prompt: str = "The capital of France is",
                    progress: bool = False) -> FamilyRow:
    """The same row on the real embedded Gemma 3 270M (the one real checkpoint available offline)."""
    from .models import load_model
    from .protocol import encode_prompt

    model, tokenizer = load_model(dtype=dtype, device="cpu")
    ids = encode_prompt(tokenizer, prompt)
    return family_row(model, "gemma3", ids, n_tokens, dtype, "real: embedded Gemma 3 270M", progress)

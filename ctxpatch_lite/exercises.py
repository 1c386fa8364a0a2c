"""Exercises for the course: the learner writes the core of the paper in a notebook cell, a check here runs it on
cases of our choosing and answers with a specific hint when it is wrong.

Four exercises, each with its reference solution (the notebooks keep the solutions in collapsed cells, so papermill
and nbval run them as written here):

=====================  ============================================  ==========================================
exercise               the learner writes                            checked by
=====================  ============================================  ==========================================
1 input patch (02)     ``input_patch(W, z, z_C) -> dW``              ``check_input_patch``
2 scale patch (02)     ``scale_patch(v, v_C, h, m) -> dm``           ``check_scale_patch``
3 bisection (04)       ``bisection_step(lo, hi, g, m) -> (lo, hi)``  ``check_bisection_step``
4 Algorithm 1 (03)     ``algorithm1(model, ids, tools) -> logits``   ``check_algorithm1``
=====================  ============================================  ==========================================

A check prints one line starting with ✓ when every case passes, and otherwise raises ``ExerciseError`` (an
``AssertionError``) whose message says what was wrong and what to do. Typical wrong answers are recognised by
running their known forms on the same cases (``_diagnose``); anything else gets the first failing case's numbers.

Exercise 4 runs on a from-scratch Gemma 3 (``ctxpatch_lite.block.GemmaBlock``, notebook 01): ``TOOLS`` holds the
pieces (the full-context targets, one patched block built from exercises 1 and 2, the output head) and the learner
writes the loop over layers, the part that makes Algorithm 1 self-correcting.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch


class ExerciseError(AssertionError):
    """A learner's answer failed a check; the message is the hint."""


# ---------------------------------------------------------------------------------------------- reference solutions
def input_patch(W: torch.Tensor, z: torch.Tensor, z_C: torch.Tensor) -> torch.Tensor:
    """Eq. 2-3: dW = W (z_C - z) z^T / ||z||^2, so that (W + dW) z = W z_C. W (out, in); z, z_C (in,)."""
    return torch.outer(W @ (z_C - z), z) / z.dot(z)


def scale_patch(v: torch.Tensor, v_C: torch.Tensor, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """dm = (v_C - v) / h, dividing by 1 where h_i == 0 exactly (the paper's guard), so that
    v + (m + dm) * h = v_C + m * h wherever h_i != 0. ``m`` is not needed: dm is a change of the scale, the same
    whether the model stores m or w = m - 1 (it is in the signature because forgetting that is a typical error)."""
    return (v_C - v) / torch.where(h == 0, torch.ones_like(h), h)


def secular(mu: float, g: torch.Tensor, m: torch.Tensor) -> float:
    """F(mu) = mean_k (g_k m_k)^2 / (m_k^2 - mu)^2 - 1, increasing on (-inf, min m^2) (Appendix B)."""
    return float(((g * m) ** 2 / (m ** 2 - mu) ** 2).mean() - 1)


def bisection_step(lo: float, hi: float, g: torch.Tensor, m: torch.Tensor) -> tuple[float, float]:
    """One step of bisection for the root of F on [lo, hi] (F(lo) < 0 < F(hi)): halve the interval, keep the half
    where F changes sign. F increases, so F(mid) < 0 means the root lies to the right of mid."""
    mid = 0.5 * (lo + hi)
    return (mid, hi) if secular(mid, g, m) < 0 else (lo, mid)


def algorithm1(model, ids: list, tools=None) -> torch.Tensor:
    """Algorithm 1 for the last token of ``ids``: every layer patched from the actual output of the patched layer
    below, on the query alone; returns the next-token logits."""
    tools = tools or TOOLS
    targets = tools.full_context_targets(model, ids)      # one record per layer: v_C, z_C at the query
    x = tools.query_embedding(model, ids)                  # the query token alone
    position = len(ids) - 1
    for layer, block in enumerate(tools.blocks(model)):
        x = tools.theorem1_block(block, x, position, targets[layer])
    return tools.logits(model, x)


# ------------------------------------------------------------------------------- the from-scratch pieces (exercise 4)
def blocks(model) -> list:
    """One ``GemmaBlock`` per decoder layer of a Gemma 3 model (they share the model's weights)."""
    from .block import GemmaBlock

    layers = model.model.layers
    return [GemmaBlock(layer, model.config, i) for i, layer in enumerate(layers)]


@torch.no_grad()
def embed(model, ids: list) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model.model.embed_tokens(torch.as_tensor(ids, device=dev))      # Gemma scales by sqrt(d) inside


@torch.no_grad()
def full_context_targets(model, ids: list) -> list:
    """The full-context pass through the from-scratch blocks; per layer, at the query (last) position: the input
    ``x_C``, ``v_C``, ``z_C`` and the output ``out_C``."""
    x, out = embed(model, ids), []
    for block in blocks(model):
        tr = block(x)
        out.append(SimpleNamespace(x_C=x[-1], v_C=tr.v[-1], z_C=tr.z[-1], out_C=tr.out[-1]))
        x = tr.out
    return out


@torch.no_grad()
def query_embedding(model, ids: list) -> torch.Tensor:
    """The query token's embedding, the input of layer 0 when the query runs alone."""
    return embed(model, ids[-1:])[0]


def unit_rms(y: torch.Tensor, eps: float) -> torch.Tensor:
    """N(y) = y / sqrt(mean(y^2) + eps), computed like Gemma's RMSNorm (float32 for low precisions)."""
    cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
    yf = y.to(cdt)
    return yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def theorem1_block(block, x: torch.Tensor, position: int, target) -> torch.Tensor:
    """One block run on the query row ``x`` alone (at absolute ``position``), patched by Theorem 1 against the
    full-context ``target`` (``v_C``, ``z_C``): the input patches of exercise 1, then the scale patch of exercise 2
    on the h the patched MLP computes. Returns the block's output row."""
    tr = block(x[None], positions=torch.tensor([position]))
    v, z = tr.v[0], tr.z[0]
    W_gate = block.W_gate + input_patch(block.W_gate, z, target.z_C)
    W_up = block.W_up + input_patch(block.W_up, z, target.z_C)
    h_gated = torch.nn.functional.gelu(W_gate @ z, approximate="tanh") * (W_up @ z)
    h = unit_rms(block.W_down @ h_gated, block.eps)
    cdt = h.dtype
    m = 1.0 + block.norms["post_feedforward_layernorm"].to(cdt)
    dm = scale_patch(v.to(cdt), target.v_C.to(cdt), h, m)
    return (v.to(cdt) + (m + dm) * h).to(x.dtype)


@torch.no_grad()
def logits(model, x: torch.Tensor) -> torch.Tensor:
    """The output head on one residual row: final RMSNorm, unembedding, Gemma's logit soft-capping if configured."""
    out = model.lm_head(model.model.norm(x[None]))[0]
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(out / cap) * cap if cap else out


TOOLS = SimpleNamespace(blocks=blocks, full_context_targets=full_context_targets, query_embedding=query_embedding,
                        theorem1_block=theorem1_block, logits=logits)


# ------------------------------------------------------------------------------------------------ check machinery
def _run(fn: Callable, cases: list, name: str) -> list:
    outs = []
    for args in cases:
        try:
            outs.append(fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        except ExerciseError:
            raise
        except Exception as exc:                                   # the learner's own error, named, not hidden
            raise ExerciseError(f"{name} raised {type(exc).__name__}: {exc}") from exc
    return outs


def _same(a, b, tol: float = 1e-9) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        a, b = a.double(), b.double()
        if not (torch.isfinite(a) == torch.isfinite(b)).all():
            return False
        fin = torch.isfinite(b)
        scale = max(1.0, float(b[fin].abs().max())) if fin.any() else 1.0
        return bool(((a[fin] - b[fin]).abs() <= tol * scale).all())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, tol) for x, y in zip(a, b))
    try:
        return math.isclose(float(a), float(b), rel_tol=tol, abs_tol=tol)
    except (TypeError, ValueError):
        return False


def _diagnose(outs: list, cases: list, wrong: dict) -> str | None:
    """The hint of the first known wrong answer that reproduces the learner's outputs on every case."""
    for hint, fn in wrong.items():
        try:
            if all(_same(o, fn(*args)) for o, args in zip(outs, cases)):
                return hint
        except Exception:                                          # a wrong form that cannot run on a case
            continue
    return None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- 1: input patch
def _input_cases() -> list:
    out = []
    for seed, (n_out, n_in) in enumerate([(5, 4), (7, 3), (12, 8)]):
        g = _gen(100 + seed)
        W = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
        z = torch.randn(n_in, generator=g, dtype=torch.float64)
        out.append((W, z, z + 0.5 * torch.randn(n_in, generator=g, dtype=torch.float64)))
    return out


_INPUT_WRONG = {
    "ΔW moves W z towards W z_C: the left factor is W(z_C − z), not W(z − z_C) (check the sign).":
        lambda W, z, zc: -input_patch(W, z, zc),
    "Divide by ‖z‖² (z·z), not by ‖z‖: only then is ΔW z = W(z_C − z)(z·z)/‖z‖² = W(z_C − z) exactly.":
        lambda W, z, zc: input_patch(W, z, zc) * z.norm(),
    "The outer product needs the normalisation 1/‖z‖²: without it ΔW z = W(z_C − z)·‖z‖².":
        lambda W, z, zc: input_patch(W, z, zc) * z.dot(z),
    "The right factor must be z, the input the patched matrix will actually see (query alone), not z_C.":
        lambda W, z, zc: torch.outer(W @ (zc - z), zc) / zc.dot(zc),
    "The right factor is z but the normalisation must be ‖z‖², the same vector's: you divided by ‖z_C‖².":
        lambda W, z, zc: torch.outer(W @ (zc - z), z) / zc.dot(zc),
}


def check_input_patch(fn: Callable) -> dict:
    """Exercise 1: ``fn(W, z, z_C)`` must return the rank-1 ``dW`` with ``(W + dW) z = W z_C``."""
    cases = _input_cases()
    outs = _run(fn, cases, "input_patch")
    for out, (W, z, zc) in zip(outs, cases):
        if not isinstance(out, torch.Tensor):
            raise ExerciseError(f"input_patch must return a tensor (ΔW), got {type(out).__name__}")
        if out.shape == W.T.shape and out.shape != W.shape:
            raise ExerciseError(f"ΔW has shape {tuple(out.shape)}, the transpose of W's {tuple(W.shape)}: it is "
                                "torch.outer(W @ (z_C - z), z), output side first (W is out × in)")
        if out.shape == (zc.numel(), zc.numel()) and out.shape != W.shape:
            raise ExerciseError(f"ΔW has shape {tuple(out.shape)} (in × in): the left factor is W(z_C − z), a vector "
                                f"of W's {W.shape[0]} outputs, not z_C − z")
        if out.shape != W.shape:
            raise ExerciseError(f"ΔW must have W's shape {tuple(W.shape)}; got {tuple(out.shape)}")
    if all(_same(o, input_patch(*c)) for o, c in zip(outs, cases)):
        ranks = {int(torch.linalg.matrix_rank(o)) for o in outs}
        rank = ranks.pop() if len(ranks) == 1 else sorted(ranks)
        print(f"✓ input_patch: (W + ΔW) z = W z_C on {len(cases)} cases, ΔW has rank {rank}")
        return {"cases": len(cases), "rank": rank}
    hint = _diagnose(outs, cases, _INPUT_WRONG)
    if hint:
        raise ExerciseError(hint)
    W, z, zc = cases[0]
    err = float(((W + outs[0]) @ z - W @ zc).abs().max())
    raise ExerciseError(f"(W + ΔW) z should equal W z_C; on a {tuple(W.shape)} case they differ by up to {err:.3g}. "
                        "Write ΔW as the outer product of W(z_C − z) and z, divided by z·z.")


# ---------------------------------------------------------------------------------------------- 2: scale patch
def _scale_cases() -> list:
    out = []
    for seed, n in enumerate([4, 6, 9]):
        g = _gen(200 + seed)
        v = torch.randn(n, generator=g, dtype=torch.float64)
        v_C = v + torch.randn(n, generator=g, dtype=torch.float64)
        h = torch.randn(n, generator=g, dtype=torch.float64)
        if seed:                                                   # an exact zero: the guard's case
            h[seed] = 0.0
        m = 1.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        out.append((v, v_C, h, m))
    return out


_SCALE_WRONG = {
    "Δm adds v_C − v to the block output: use (v_C − v), not (v − v_C) (check the sign).":
        lambda v, vc, h, m: -scale_patch(v, vc, h, m),
    "The block adds (m + Δm) ⊙ h, so Δm ⊙ h alone must equal v_C − v: divide by h, not by m ⊙ h.":
        lambda v, vc, h, m: scale_patch(v, vc, h * m, m),
    "You returned the new scale m + Δm; return the patch Δm itself (it is added to the stored weight).":
        lambda v, vc, h, m: m + scale_patch(v, vc, h, m),
    "Off by the 1 + w offset: Gemma stores w with m = 1 + w, but Δm is a change of the scale, the same for m and "
    "w. Return (v_C − v) / h with no ±1.":
        lambda v, vc, h, m: scale_patch(v, vc, h, m) - 1,
    "Off by the 1 + w offset (the other way): Δm is a change of the scale, no +1.":
        lambda v, vc, h, m: scale_patch(v, vc, h, m) + 1,
    "Where h_i = 0 exactly the paper divides by 1 (Δm_i = (v_C − v)_i): no scale can act there, and the guard "
    "keeps the patch finite. You set Δm_i = 0 instead.":
        lambda v, vc, h, m: torch.where(h == 0, torch.zeros_like(h), scale_patch(v, vc, h, m)),
}


def check_scale_patch(fn: Callable) -> dict:
    """Exercise 2: ``fn(v, v_C, h, m)`` must return ``dm = (v_C - v) / h`` with the divide-by-1 guard."""
    cases = _scale_cases()
    outs = _run(fn, cases, "scale_patch")
    for out, (v, vc, h, m) in zip(outs, cases):
        if not isinstance(out, torch.Tensor) or out.shape != v.shape:
            raise ExerciseError(f"scale_patch must return a tensor of v's shape {tuple(v.shape)} (one Δm_i per "
                                f"coordinate); got {getattr(out, 'shape', type(out).__name__)}")
        if not torch.isfinite(out).all():
            k = int((~torch.isfinite(out)).nonzero()[0])
            raise ExerciseError(f"Δm is not finite at coordinate {k}, where h_{k} = {float(h[k])}: where h_i = 0 "
                                "exactly, divide by 1 instead (torch.where(h == 0, 1, h)), as the paper does; the "
                                "engine counts such coordinates as fallbacks")
    if all(_same(o, scale_patch(*c)) for o, c in zip(outs, cases)):
        worst = max(float((v + (m + o) * h - (vc + m * h))[h != 0].abs().max()) for o, (v, vc, h, m) in zip(outs, cases))
        zeros = sum(int((c[2] == 0).sum()) for c in cases)
        print(f"✓ scale_patch: v + (m + Δm) ⊙ h = v_C + m ⊙ h on {len(cases)} cases (max error {worst:.1e}), "
              f"{zeros} exact zeros of h divided by 1")
        return {"cases": len(cases), "max_error": worst, "zeros": zeros}
    hint = _diagnose(outs, cases, _SCALE_WRONG)
    if hint:
        raise ExerciseError(hint)
    v, vc, h, m = cases[0]
    err = float((v + (m + outs[0]) * h - (vc + m * h)).abs().max())
    raise ExerciseError(f"v + (m + Δm) ⊙ h should equal v_C + m ⊙ h; on the first case they differ by up to {err:.3g}")


# ---------------------------------------------------------------------------------------------- 3: bisection step
def _bisection_cases() -> list:
    """The intervals the right bisection visits in its first 30 steps on three problems: both branches, far from
    and close to the root, where the typical wrong forms of F take other decisions."""
    out = []
    for seed, n in enumerate([5, 8, 16]):
        g = _gen(300 + seed)
        m = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
        gv = torch.randn(n, generator=g, dtype=torch.float64)
        m2 = float((m ** 2).min())
        lo, hi = m2 - float((gv * m).abs().max()) - 1.0, m2 - 1e-9
        for _ in range(30):
            out.append((lo, hi, gv, m))
            lo, hi = bisection_step(lo, hi, gv, m)
    return out


def _step_with(F):
    def step(lo, hi, g, m):
        mid = 0.5 * (lo + hi)
        return (mid, hi) if F(mid, g, m) < 0 else (lo, mid)
    return step


_BISECTION_WRONG = {
    "F increases on (−∞, min m²): F(mid) < 0 means the root is to the right of mid, so lo moves up to mid "
    "(your branches are swapped).":
        lambda lo, hi, g, m: ((lo, 0.5 * (lo + hi)) if secular(0.5 * (lo + hi), g, m) < 0 else (0.5 * (lo + hi), hi)),
    "F is a mean over the n coordinates, (1/n) Σ_k (g_k m_k)² / (m_k² − μ)² − 1: you summed without 1/n.":
        _step_with(lambda mu, g, m: float(((g * m) ** 2 / (m ** 2 - mu) ** 2).sum() - 1)),
    "The denominator is squared: (m_k² − μ)², because y_k = g_k m_k / (m_k² − μ) and F is mean(y²) − 1.":
        _step_with(lambda mu, g, m: float(((g * m) ** 2 / (m ** 2 - mu)).mean() - 1)),
    "F needs the − 1: the constraint is mean(y²) = 1, so the root is where mean(y²) − 1 = 0.":
        _step_with(lambda mu, g, m: float(((g * m) ** 2 / (m ** 2 - mu) ** 2).mean())),
    "Bisection returns the new interval (lo, hi), one end moved to the midpoint, not the midpoint twice.":
        lambda lo, hi, g, m: (0.5 * (lo + hi), 0.5 * (lo + hi)),
}


def check_bisection_step(fn: Callable) -> dict:
    """Exercise 3: ``fn(lo, hi, g, m)`` must return the half of [lo, hi] that holds the root of F; then 200 of the
    learner's steps must find the root the package's inversion finds."""
    from .stable import invert_rmsnorm_unit

    cases = _bisection_cases()
    outs = _run(fn, cases, "bisection_step")
    for out in outs:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ExerciseError(f"bisection_step must return the new interval as a pair (lo, hi); got {out!r}")
    if all(_same(tuple(map(float, o)), bisection_step(*c)) for o, c in zip(outs, cases)):
        lo, hi, g, m = cases[0]
        for _ in range(200):
            lo, hi = map(float, fn(lo, hi, g, m))
        mu = invert_rmsnorm_unit(g, m).mu
        if not math.isclose(0.5 * (lo + hi), mu, rel_tol=1e-9, abs_tol=1e-12):
            raise ExerciseError(f"one step is right, but 200 of them end at {0.5 * (lo + hi):.12g}, not at the root "
                                f"{mu:.12g}: does your step keep lo < hi and F(lo) < 0 < F(hi)?")
        f_mu = secular(0.5 * (lo + hi), g, m)
        print(f"✓ bisection_step: {len(cases)} single steps right; 200 steps find μ* = {mu:.10g} "
              f"(F(μ*) = {f_mu:.1e}), as invert_rmsnorm_unit does")
        return {"cases": len(cases), "steps": 200, "mu": mu, "F_mu": f_mu}
    hint = _diagnose([tuple(map(float, o)) for o in outs], cases, _BISECTION_WRONG)
    if hint:
        raise ExerciseError(hint)
    lo, hi, g, m = cases[0]
    raise ExerciseError(f"on [lo, hi] = [{lo:.6g}, {hi:.6g}] the step should give {bisection_step(lo, hi, g, m)}, "
                        f"got {tuple(outs[0])}: halve the interval and keep the half where F changes sign")


# ---------------------------------------------------------------------------------------------- 4: Algorithm 1
def _algorithm1_cases() -> list:
    from .fixtures import tiny_gemma3

    model = tiny_gemma3(seed=3, dtype="float64")
    return [(model, [2, 10, 20, 30, 40, 50, 11, 12, 13, 33]), (model, [2, 7, 7, 61, 5, 90, 44, 3, 19, 28, 71, 6])]


def _spy_tools(calls: list):
    def theorem1(block, x, position, target):
        out = theorem1_block(block, x, position, target)
        calls.append(SimpleNamespace(block=block, x=x, position=position, target=target, out=out))
        return out
    return SimpleNamespace(**{**vars(TOOLS), "theorem1_block": theorem1})


def check_algorithm1(fn: Callable, cases: list | None = None) -> dict:
    """Exercise 4: ``fn(model, ids, tools)`` must return the logits Algorithm 1 gives for the last token of ``ids``
    run alone, which equal the full-context logits of the same from-scratch model (float64, a tiny seeded Gemma 3 by
    default). (transformers' Gemma 3 computes its RMSNorms in float32 even for a float64 model, so its own logits
    differ from the from-scratch float64 ones at about 1e-7; the check compares like with like.)"""
    cases = cases or _algorithm1_cases()
    for model, ids in cases:
        calls = []
        tools = _spy_tools(calls)
        try:
            out = fn(model, list(ids), tools)
        except Exception as exc:
            raise ExerciseError(f"algorithm1 raised {type(exc).__name__}: {exc}") from exc
        L, p = len(model.model.layers), len(ids) - 1
        targets = full_context_targets(model, ids)
        want = logits(model, targets[-1].out_C)      # the same from-scratch model, with the whole context
        if not calls:
            raise ExerciseError("tools.theorem1_block was never called: patch every layer with it "
                                "(x = tools.theorem1_block(block, x, position, targets[layer]))")
        if len(calls) != L:
            raise ExerciseError(f"{len(calls)} patched layers, but the model has {L}: Algorithm 1 patches every layer, "
                                "in order (for layer, block in enumerate(tools.blocks(model)))")
        x0 = query_embedding(model, ids)
        for k, c in enumerate(calls):
            if c.position != p:
                raise ExerciseError(f"layer {k} ran at position {c.position}: the query keeps its absolute position "
                                    f"in the prompt, len(ids) - 1 = {p} (RoPE depends on it)")
            if not _same(c.target.v_C, targets[k].v_C):
                raise ExerciseError(f"layer {k} was patched against another layer's targets: pass targets[{k}]")
            if k == 0:
                if not _same(c.x, x0):
                    raise ExerciseError("layer 0 must get the query token's embedding alone "
                                        "(tools.query_embedding(model, ids))")
                continue
            if torch.equal(c.x, calls[k - 1].out):                  # bit for bit: what the layer below returned
                continue
            if torch.equal(c.x, targets[k].x_C):
                raise ExerciseError(f"layer {k} was fed the recorded full-context input x_C: that is the oracle "
                                    "schedule of notebook 05 (exact in real arithmetic, but not a procedure the "
                                    "query alone can run). Feed it the actual output of the patched layer below "
                                    "(x = tools.theorem1_block(...) each time round the loop)")
            if torch.equal(c.x, x0):
                raise ExerciseError(f"layer {k} was fed the query embedding again: pass each patched layer's output on "
                                    "to the next layer (x = tools.theorem1_block(block, x, ...))")
            raise ExerciseError(f"layer {k}'s input is not the output of the patched layer {k - 1}: "
                                "x = tools.theorem1_block(block, x, position, targets[layer])")
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            raise ExerciseError(f"return the logits (a tensor of shape {tuple(want.shape)}, tools.logits(model, x)); "
                                f"got {getattr(out, 'shape', type(out).__name__)}")
        if _same(out, logits(model, x0)):
            raise ExerciseError("these are the logits of the unpatched query embedding: apply tools.logits to the "
                                "last patched layer's output")
        rel = float((out - want).abs().max() / want.abs().max())
        block_rel = max(float((c.out - t.out_C).abs().max() / t.out_C.abs().max()) for c, t in zip(calls, targets))
        if rel > 1e-10:
            raise ExerciseError(f"the logits differ from the full-context logits by {rel:.2e} (relative): return "
                                "tools.logits(model, x) with x the output of the last patched layer")
    print(f"✓ algorithm1: {len(cases)} prompts on a {L}-layer Gemma 3 (float64): every layer patched from the actual "
          f"output of the patched layer below; each block's output within {block_rel:.1e} of its full-context output "
          f"and the logits within {rel:.1e} of the full-context logits (relative)")
    return {"prompts": len(cases), "layers": L, "block_error": block_rel, "logit_error": rel}

"""The course's exercise checks, the ARENA way: the learner writes the key construction in a notebook cell (a stub
that raises ``NotImplementedError`` until written), and a check here tests the *property* the exercise states, so
that every correct answer passes and a wrong one gets a hint that names the mistake.

Each ``check_*`` returns a ``Checked``: it calls like the function the rest of the notebook should use (the learner's
once it passes, else the package's solution from ``ctxpatch_lite.solutions``), and carries ``own`` (whose it is)
and ``report`` (the numbers the check printed, for the notebook's metrics). While the stub still raises, the check
says so and verifies the solution instead, so a headless run (papermill, nbval, ``make run``) goes on
deterministically to the end.

=====================  ===============================================  =================================================
check                  the property                                     typical mistakes it names
=====================  ===============================================  =================================================
``check_rms_norm``     equals transformers' ``Gemma3RMSNorm``            w for 1 + w, no epsilon, sum for mean, centring,
                       (float32, bfloat16, float64)                     bfloat16 arithmetic, the wrong axis or dtype
``check_gemma_block``  v, z, h_g, out equal ``Gemma3DecoderLayer``'s     a missing residual or norm, exact GELU, gate and
                       on every layer of the model given                up swapped, residual from x instead of v
``check_input_patch``  shape, rank <= 1, (W + dW) z = W z_C; says        sign, ||z|| for ||z||^2, z_C on the right, the
                       whether it is the minimum-norm one               transpose, a rank-2 patch
``check_scale_patch``  v + (m + dm) h = v_C + m h where h_i != 0;       sign, dividing by m h, m + dm, the 1 + w offset,
                       any finite dm_i where h_i = 0                    a non-finite dm_i at h_i = 0
``check_theorem1_``    the patched layer on the query alone gives the   unpatched, no scale patch, dm on the unpatched
``block``              full-context output (every layer, tiny model)    h, swapped input_patch arguments, exact GELU
``check_algorithm1``   every layer patched, in order, from the patched  the oracle input, the embedding fed twice, a
                       layer below (any position: one token alone)      missing layer, wrong targets, no patches
``check_secular_root`` mu < min m^2 and mean(y(mu)^2) = 1               the branch above min m^2, sum for mean, an
                                                                        unsquared denominator, m for m^2
``check_stable_patch`` dW_down rank 1, the new post-norm input           the naive patch (dW = 0), ||h_g|| for ||h_g||^2,
                       normalises to Appendix B's y, (m + dm) N = g;    y without m, g for y, the remainder r for dm,
                       any scale of h_target (says the paper's)         dividing by m
``check_naive_miss``   the naive patch's miss from m, dm, h_hat - h_C    the sign, the divisors' formulas swapped, the
                       alone, equal to output minus target              m term dropped
``check_patched_``     03: given patches on any input: the full-        m = w, the unpatched MLP, no dm, the residual
``layer``              context output on the input they were built for  from x, exact GELU, no epsilon
``check_bf16_step``    04b: the bfloat16 spacing at |x|, exactly        log2 in float32 below a power of two, 8 bits,
                       (powers of two and their neighbours included)    half a step, the sign, 0
``check_hard_case_y``  04b: mu = min m^2, the formula away from it,     the leftover dropped, spread over every
                       mean(y^2) = 1 (any split of the leftover)        coordinate, split without a square root
``check_sum_``         04b: kappa_k = sum_j |W_kj x_j| / |(W x)_k| to    abs of the sum, 1 / kappa, no abs below, float32,
``condition``          1e-9, inf where the sum is 0                     the vector's RMS below, product of sums
=====================  ===============================================  =================================================
"""
from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Callable

import torch

from . import solutions
from .hooks import unit_rms


class ExerciseError(AssertionError):
    """A learner's answer failed a check; the message is the hint."""


class Checked:
    """What a check returns: the function the notebook goes on with (call it as before), whose it is, and the
    numbers the check printed."""

    def __init__(self, name: str, fn: Callable, own: bool, report: dict):
        self.name, self.fn, self.own, self.report = name, fn, own, {**report, "own": own}

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self):
        return f"<{self.name}: {'yours, checked' if self.own else 'the package solution (yours is not written yet)'}>"


def _is_stub(fn: Callable, args: tuple) -> bool:
    """True when ``fn`` itself still raises NotImplementedError; one raised inside a function it calls (a helper
    of an earlier exercise, still a stub) is named instead, since ``fn`` is written."""
    try:
        fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except NotImplementedError as exc:
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        code = getattr(inspect.unwrap(fn), "__code__", None)
        frame = tb.tb_frame
        if code is not None and frame.f_code is not code:
            if frame.f_globals.get("__name__") != "__main__":
                return False                          # raised in a library: the check names the learner's error
            raise ExerciseError(f"your function is written, but the {frame.f_code.co_name} it calls is not yet (it "
                                f"raises NotImplementedError): run the cell that defines it, with your code, "
                                f"then this check again") from None
        return True
    except Exception:  # noqa: BLE001 - the learner's own error: the check names it
        return False
    return False


def _begin(name: str, fn: Callable, first_case: tuple) -> tuple[Callable, bool]:
    """The function to verify, and whether it is the learner's: the stub's solution while it still raises. A check
    cell run twice gets its own result back (a ``Checked``): it keeps saying whose function that is, and the
    package's solution, however it arrives, is never called the learner's."""
    if isinstance(fn, Checked):
        fn = fn.fn
    if fn is getattr(solutions, name, None):
        print(f"… {name} here is the package's solution (ctxpatch_lite.solutions.{name}), not yours: run the cell "
              f"that defines yours, then this check again.")
        return fn, False
    if fn is None or _is_stub(fn, first_case):
        print(f"… {name} is not written yet (it raises NotImplementedError): this notebook goes on with the package's "
              f"solution, ctxpatch_lite.solutions.{name}. Write yours in the cell above and run both cells again.")
        return getattr(solutions, name), False
    return fn, True


def _whose(own: bool) -> str:
    return "yours" if own else "the solution"


def _call(fn: Callable, args: tuple, name: str):
    try:
        return fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except ExerciseError:
        raise
    except Exception as exc:                                       # the learner's own error, named, not hidden
        raise ExerciseError(f"{name} raised {type(exc).__name__}: {exc}") from exc


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _close(a, b, tol: float) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and bool(torch.isfinite(a).all()) and _rel(a, b) <= tol)


def _hint(out, wrong: dict, tol: float) -> str | None:
    """The hint of the first known wrong answer whose result ``out`` reproduces (``wrong``: hint -> its result)."""
    for hint, expected in wrong.items():
        try:
            if _close(out, expected, tol):
                return hint
        except Exception:  # noqa: BLE001 - a wrong form that cannot be computed on this case
            continue
    return None


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- 01: RMSNorm
def _rms_cases() -> list:
    out = []
    for seed, (dtype, scale) in enumerate([("float32", 3.0), ("float32", 1e-3), ("bfloat16", 40.0),
                                          ("float64", 1.0)]):
        g = _gen(50 + seed)
        x = (scale * torch.randn(5, 24, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
        w = (0.4 * torch.randn(24, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
        out.append((x, w, 1e-6))
    g = _gen(60)                                  # another eps, where it matters (small x): the argument is used
    out.append(((0.01 * torch.randn(5, 24, generator=g, dtype=torch.float64)).float(),
                (0.4 * torch.randn(24, generator=g, dtype=torch.float64)).float(), 1e-3))
    g = _gen(61)                                  # a batch of sequences (2, 5, 24): the mean is over the last axis only
    out.append(((2.0 * torch.randn(2, 5, 24, generator=g, dtype=torch.float64)).float(),
                (0.4 * torch.randn(24, generator=g, dtype=torch.float64)).float(), 1e-6))
    return out


def _gemma3_rmsnorm(x, w, eps, float64_arithmetic: bool = False):
    """transformers' own Gemma3RMSNorm with weight ``w``. The class computes in float32 whatever the input, float64
    included; ``float64_arithmetic``: the same formula in float64 instead (the course's exact float64 toys)."""
    if float64_arithmetic:
        return solutions.rms_norm(x, w, eps)
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    norm = Gemma3RMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm(x)


def check_rms_norm(fn: Callable | None) -> Checked:
    """01: ``fn(x, w, eps)`` must equal transformers' ``Gemma3RMSNorm`` with weight ``w``: normalise each row to unit
    RMS in float32, scale by ``1 + w``, cast back to ``x``'s dtype. A float64 input may be computed in float64 (the
    course's solution, for the exact toys) or in float32 as the class does: both pass, the second with a note."""
    cases = _rms_cases()
    fn, own = _begin("rms_norm", fn, cases[0])
    worst, float32_inside = 0.0, False
    for x, w, eps in cases:
        out = _call(fn, (x, w, eps), "rms_norm")
        want = _gemma3_rmsnorm(x, w, eps)
        if x.dtype == torch.float64 and isinstance(out, torch.Tensor) and out.shape == x.shape:
            exact = _gemma3_rmsnorm(x, w, eps, float64_arithmetic=True)     # float64 kept: what the toys need
            if _rel(out, exact) <= 1e-12:
                want = exact
            elif _rel(out, want) <= 1e-6:
                float32_inside = True
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise ExerciseError(f"rms_norm must return a tensor of x's shape {tuple(x.shape)}; got "
                                f"{getattr(out, 'shape', type(out).__name__)}")
        if out.dtype != x.dtype:
            raise ExerciseError(f"rms_norm returned {out.dtype} for a {x.dtype} input: compute in float32, then cast "
                                f"back to x's dtype (.to(x.dtype)), as Gemma's RMSNorm does")
        tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 0.0}[x.dtype]
        if x.dtype == torch.float64 and want is not exact:
            tol = 1e-6                                   # transformers' arithmetic: float32 inside
        if _rel(out, want) > tol:
            xf = x.double()
            unit = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            wf = w.double()
            wrong = {
                "Gemma's RMSNorm scales by 1 + w (it stores w, the offset from 1), not by w.": unit * wf,
                "The RMS is over the last axis, one row at a time: mean(x², dim=-1, keepdim=True).":
                    xf / torch.sqrt(xf.pow(2).mean(0, keepdim=True) + eps) * (1 + wf),
                "Divide by the root of the *mean* of x² (the RMS), not of the sum: the sum is d times larger.":
                    xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps) * (1 + wf),
                "The epsilon goes inside the root: sqrt(mean(x²) + eps); it matters when x is small.":
                    xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True)) * (1 + wf),
                "An RMSNorm does not centre: no mean subtraction (that is LayerNorm).":
                    (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
                    * (1 + wf),
            }
            if eps != 1e-6:
                wrong[f"eps is an argument: use the one you are given (this case passes eps={eps:g}), not a fixed "
                      f"1e-6."] = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + wf)
            if x.dtype == torch.bfloat16:
                wrong["Normalise in float32 and cast back at the end: Gemma computes its RMSNorms in float32 even for "
                      "a bfloat16 model (x.float(), then .to(x.dtype))."] = (
                    x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)).double()
                xf32 = x.float()
                wrong["Compute the scale 1 + w in float32 too (1.0 + w.float()): 1 + w rounded to bfloat16 loses the "
                      "low bits of w before the product, and Gemma3RMSNorm does not round it."] = (
                    (xf32 * torch.rsqrt(xf32.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)).to(x.dtype)).double()
                wrong["Multiply by 1 + w before casting back: Gemma3RMSNorm scales in float32 and rounds to bfloat16 once, "
                      "at the end; casting the normalised x first and then scaling in bfloat16 (as Llama's RMSNorm "
                      "does) rounds twice."] = (
                    (xf32 * torch.rsqrt(xf32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * (1 + w)).double()
            hint = _hint(out.double(), wrong, 1e-3 if x.dtype != torch.float64 else 1e-9)
            raise ExerciseError(hint or f"on a {x.dtype} case rms_norm differs from Gemma3RMSNorm by {_rel(out, want):.2e}"
                                        f" (relative): y = x / sqrt(mean(x², last axis) + eps) * (1 + w), in float32")
        worst = max(worst, _rel(out, want))
    print(f"✓ rms_norm ({_whose(own)}) equals Gemma's RMSNorm on {len(cases)} cases (transformers' Gemma3RMSNorm in "
          f"float32, with a small x where eps matters and a batch of sequences, and bfloat16 bit for bit; the same "
          f"formula in float64 on a float64 case); largest relative difference {worst:.1e}")
    if float32_inside:
        print("  note: on the float64 case yours computes in float32, as transformers' class does (x.float()); the "
              "course's solution keeps a float64 input in float64. Both are accepted.")
    return Checked("rms_norm", fn, own, {"cases": len(cases), "max_rel_difference": worst})


# ---------------------------------------------------------------------------------------------- 01: the block
@torch.no_grad()
def _layer_values(model, ids) -> list:
    """Per decoder layer of a real Gemma 3 forward: its input rows x and what Gemma3DecoderLayer computes for
    v (the pre-feed-forward norm's input), z (its output), h_g (the down projection's input) and out."""
    from .families import Adapter
    ad, store, hooks = Adapter(model), [], []
    for P in ad.parts:
        s = {}
        store.append(s)
        hooks += [P.layer.register_forward_pre_hook(lambda m, a, k, s=s: s.__setitem__("x", (a[0] if a else
                                                   k["hidden_states"])[0].clone()), with_kwargs=True),
                  P.v_site.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("v", a[0][0].clone())),
                  P.v_site.register_forward_hook(lambda m, a, o, s=s: s.__setitem__("z", o[0].clone())),
                  P.down.register_forward_pre_hook(lambda m, a, s=s: s.__setitem__("h_g", a[0][0].clone())),
                  P.layer.register_forward_hook(lambda m, a, o, s=s: s.__setitem__(
                      "out", (o[0] if isinstance(o, tuple) else o)[0].clone()))]
    try:
        model(input_ids=torch.as_tensor(ids, device=next(model.parameters()).device).reshape(1, -1),
              use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return store


# Relative tolerance of the block check per dtype: float32 rounding (measured 4.8e-7 on the embedded model); in bfloat16
# a few ulps (2^-8 = 3.9e-3 each) after one layer of sums in another order (measured 1.7e-2 with the solution).
_BLOCK_TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 6e-2}


def _block_hints(got: dict, want: dict, x, block, rms) -> dict:
    """Known wrong forms of each quantity, computed from the right values of the ones before it."""
    n, eps = block.norms, block.eps
    attn = block.attention(rms(x, n["input_layernorm"], eps), None)
    v, z, h_g = want["v"], want["z"], want["h_g"]
    gelu = torch.nn.functional.gelu
    return {
        "v": {"v is x plus the normed attention output: you left out the residual x.":
              rms(attn, n["post_attention_layernorm"], eps),
              "v = x + RMSNorm_post-attn(attention): the attention output goes through the post-attention norm "
              "before it is added.": x + attn},
        "z": {"z is the pre-feed-forward RMSNorm of v (the MLP's input): you used v itself.": v,
              "z is the pre-feed-forward norm of v, not of the block input x.": rms(x, n["pre_feedforward_layernorm"], eps)},
        "h_g": {"Gemma uses the tanh approximation of GELU: gelu(..., approximate='tanh').":
                gelu(z @ block.W_gate.T) * (z @ block.W_up.T),
                "GELU acts on the gate projection, W_gate z; the up projection W_up z multiplies it unchanged.":
                gelu(z @ block.W_up.T, approximate="tanh") * (z @ block.W_gate.T),
                "The gated hidden is the elementwise product GELU(W_gate z) ⊙ (W_up z), both on z (the MLP input), "
                "not on v.": gelu(v @ block.W_gate.T, approximate="tanh") * (v @ block.W_up.T),
                "Gemma's MLP uses GELU (tanh approximation), not SiLU (Llama's): "
                "gelu(z @ W_gate.T, approximate='tanh') * (z @ W_up.T).":
                torch.nn.functional.silu(z @ block.W_gate.T) * (z @ block.W_up.T)},
        "out": {"out = v + RMSNorm_post-FF(W_down h_g): the MLP output goes through the post-feed-forward norm (its "
                "scale m is what Theorem 1 patches).": v + h_g @ block.W_down.T,
                "out adds the residual v (after attention), not the block input x.":
                x + rms(h_g @ block.W_down.T, n["post_feedforward_layernorm"], eps),
                "The MLP output goes through the post-feed-forward norm's weight (post_feedforward_layernorm), not "
                "the pre-feed-forward one.": v + rms(h_g @ block.W_down.T, n["pre_feedforward_layernorm"], eps),
                "out is v plus the normed MLP output: you left out the residual v.":
                rms(h_g @ block.W_down.T, n["post_feedforward_layernorm"], eps)},
    }


def check_gemma_block(fn: Callable | None, model, ids: list, rms_norm: Callable | None = None) -> Checked:
    """01: ``fn(block, x, positions)`` must return ``(v, z, h_g, out)`` as ``Gemma3DecoderLayer`` computes them, on
    every layer of ``model`` (its real activations for the prompt ``ids``; ``block`` a ``GemmaBlock`` holding the
    layer's weights, with ``attention`` given). ``rms_norm``: the learner's (checked), for the hints."""
    from .block import GemmaBlock

    rms = rms_norm or solutions.rms_norm
    values = _layer_values(model, ids)
    blocks = [GemmaBlock(layer, model.config, i) for i, layer in enumerate(model.model.layers)]
    fn, own = _begin("gemma_block", fn, (blocks[0], values[0]["x"], None))
    worst = {k: 0.0 for k in ("v", "z", "h_g", "out")}
    dtype = values[0]["x"].dtype
    tol = _BLOCK_TOL.get(dtype, 1e-5)
    with torch.no_grad():
        for l, (block, want) in enumerate(zip(blocks, values)):
            out = _call(fn, (block, want["x"], None), "gemma_block")
            if not (isinstance(out, (tuple, list)) and len(out) == 4):
                raise ExerciseError("gemma_block must return the four rows (v, z, h_g, out), in that order")
            got = dict(zip(("v", "z", "h_g", "out"), out))
            for key in ("v", "z", "h_g", "out"):
                g, w = got[key], want[key]
                if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                    hint = ""
                    if key == "h_g" and isinstance(g, torch.Tensor) and g.shape == want["v"].shape \
                            and _rel(g, want["h_g"] @ block.W_down.T) < 1e-4:
                        hint = (" That is W_down h_g: return the gated hidden itself (width d_ff), before W_down.")
                    elif all(isinstance(t, torch.Tensor) for t in out) and \
                            sorted(tuple(t.shape) for t in out) == sorted(tuple(want[k].shape) for k in got):
                        hint = " Return the four rows in the order (v, z, h_g, out)."
                    raise ExerciseError(f"layer {l}: {key} has shape {tuple(getattr(g, 'shape', ()))}, "
                                        f"Gemma3DecoderLayer's {tuple(w.shape)}.{hint}")
                err = _rel(g, w)
                if err > tol:
                    hint = _hint(g, _block_hints(got, want, want["x"], block, rms)[key], max(1e-4, tol / 4))
                    raise ExerciseError(f"layer {l}: {key} differs from Gemma3DecoderLayer's by {err:.1e} (relative; "
                                        f"the check allows {tol:g}). " + (hint or "Compare with the equations "
                                        "above, one line per quantity."))
                worst[key] = max(worst[key], err)
        if own:   # the prompt's own positions start at 0, so a function that ignores `positions` passed the above
            block, x = blocks[0], values[0]["x"]
            spread = torch.arange(x.shape[0], device=x.device) * 3
            got = _call(fn, (block, x, spread), "gemma_block")[0]
            want = solutions.gemma_block(block, x, spread)[0]
            if _rel(got, want) > tol:
                raise ExerciseError(f"at positions 0, 3, 6, … your v differs from the one these positions give by "
                                    f"{_rel(got, want):.1e} (relative): pass `positions` on to "
                                    f"`block.attention(a, positions)`; a row's position sets its rotary embedding")
    if dtype != torch.float32 and own:
        # bfloat16 rounding (tolerance 6e-2) can hide a real mistake such as the exact GELU: the same function must
        # also pass on a tiny float32 Gemma 3 at float32's tolerance
        import contextlib
        import io

        from .fixtures import tiny_gemma3
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check_gemma_block(fn, tiny_gemma3(seed=0, dtype="float32"), list(range(3, 15)), rms_norm=rms_norm)
        except ExerciseError as e:
            raise ExerciseError(f"on a tiny float32 Gemma 3 (where bfloat16 rounding cannot hide it): {e}") from None
    print(f"✓ gemma_block ({_whose(own)}): v, z, h_g and out equal Gemma3DecoderLayer's on all {len(blocks)} layers "
          f"of this model ({len(ids)} tokens); largest relative difference {max(worst.values()):.1e} (allowed "
          f"{tol:g}, {str(dtype).removeprefix('torch.')} rounding)")
    if dtype != torch.float32 and own:
        print("  and on a tiny float32 Gemma 3 at float32's tolerance, where bfloat16 rounding cannot hide a mistake")
    return Checked("gemma_block", fn, own, {"layers": len(blocks), "tokens": len(ids), "max_rel_difference": worst,
                                             "allowed": tol})


# ---------------------------------------------------------------------------------------------- 02: input patch
def _input_cases() -> list:
    out = []
    for seed, (n_out, n_in) in enumerate([(5, 4), (7, 3), (12, 8)]):
        g = _gen(100 + seed)
        W = torch.randn(n_out, n_in, generator=g, dtype=torch.float64)
        z = torch.randn(n_in, generator=g, dtype=torch.float64)
        out.append((W, z, z + 0.5 * torch.randn(n_in, generator=g, dtype=torch.float64)))
    return out


def _input_wrong(W, z, zc) -> dict:
    return {
        "ΔW moves W z towards W z_C: the left factor is W(z_C − z), not W(z − z_C) (check the sign).":
            torch.outer(W @ (z - zc), z) / z.dot(z),
        "Divide by ‖z‖² (z·z), not by ‖z‖: only then is ΔW z = W(z_C − z)(z·z)/‖z‖² = W(z_C − z) exactly.":
            torch.outer(W @ (zc - z), z) / z.norm(),
        "The outer product needs the normalisation 1/‖z‖²: without it ΔW z = W(z_C − z)·‖z‖².":
            torch.outer(W @ (zc - z), z),
        "With z_C as the right factor, divide by z_C·z, not ‖z_C‖²: ΔW z must be W(z_C − z), and "
        "W(z_C − z) aᵀz / (aᵀz) is, for any a with aᵀz ≠ 0 (the paper's a = z is the smallest).":
            torch.outer(W @ (zc - z), zc) / zc.dot(zc),
        "The right factor is z, and so is the normalisation: divide by ‖z‖², not ‖z_C‖².":
            torch.outer(W @ (zc - z), z) / zc.dot(zc),
        "The left factor is the *change* W(z_C − z), not W z_C: the patch adds to W z what it lacks.":
            torch.outer(W @ zc, z) / z.dot(z),
        "Return the patch ΔW alone, not the patched matrix W + ΔW (the check adds W itself).":
            W + torch.outer(W @ (zc - z), z) / z.dot(z),
    }


def check_input_patch(fn: Callable | None) -> Checked:
    """02: ``fn(W, z, z_C)`` must return ``dW`` of W's shape, of rank <= 1, with ``(W + dW) z = W z_C``. Every
    such matrix passes; the check says whether it is the paper's, W(z_C - z) z^T / ||z||^2, the one with the
    smallest Frobenius norm."""
    cases = _input_cases()
    fn, own = _begin("input_patch", fn, cases[0])
    minimal, worst = [], 0.0
    for W, z, zc in cases:
        out = _call(fn, (W, z, zc), "input_patch")
        if not isinstance(out, torch.Tensor):
            raise ExerciseError(f"input_patch must return a tensor (ΔW), got {type(out).__name__}")
        if out.shape == W.T.shape and out.shape != W.shape:
            raise ExerciseError(f"ΔW has shape {tuple(out.shape)}, the transpose of W's {tuple(W.shape)}: the left "
                                f"factor W(z_C − z) has W's {W.shape[0]} outputs, the right factor z its {W.shape[1]} "
                                "inputs (torch.outer(left, right))")
        if out.shape == (W.shape[1], W.shape[1]) and out.shape != W.shape:
            raise ExerciseError(f"ΔW has shape {tuple(out.shape)} (in × in): the left factor is W(z_C − z), a vector "
                                f"of W's {W.shape[0]} outputs, not z_C − z")
        if out.shape != W.shape:
            raise ExerciseError(f"ΔW must have W's shape {tuple(W.shape)}; got {tuple(out.shape)}")
        out = out.double()
        err = _rel((W + out) @ z, W @ zc)
        if not torch.isfinite(out).all() or err > 1e-9:
            hint = _hint(out, _input_wrong(W, z, zc), 1e-9)
            if hint is None and err < 1e-5:
                hint = (f"close but not exact ({err:.1e}, relative): the cases are float64 and the check asks for 1e-9. "
                        "Is part of it computed in float32?")
            raise ExerciseError(hint or f"(W + ΔW) z should equal W z_C; on a {tuple(W.shape)} case they differ by "
                                        f"{err:.2e} (relative). Ask what ΔW must do to z: ΔW z = W(z_C − z).")
        s = torch.linalg.svdvals(out)
        if s.numel() > 1 and float(s[1]) > 1e-9 * float(s[0]):
            raise ExerciseError(f"(W + ΔW) z = W z_C holds, but ΔW has rank {int((s > 1e-9 * s[0]).sum())} (its "
                                f"singular values: {', '.join(f'{x:.2g}' for x in s[:3].tolist())}): Theorem 1's "
                                "patch is one outer product u aᵀ: build ΔW as a single outer product (the left factor W(z_C − z), any "
                                "right factor a with a·z ≠ 0, divided by a·z).")
        paper = solutions.input_patch(W, z, zc)
        minimal.append(_rel(out, paper) <= 1e-9)
        worst = max(worst, err)
    if all(minimal):
        note = "it is the paper's patch W(z_C − z)zᵀ/‖z‖², the smallest (in Frobenius norm) with this property"
    else:
        W, z, zc = cases[0]
        ours, paper = float(_call(fn, (W, z, zc), "input_patch").double().norm()), float(solutions.input_patch(
            W, z, zc).norm())
        note = (f"correct, and not the paper's: on the first case ‖ΔW‖_F = {ours:.6g}, {ours / paper:.4f} times the "
                f"paper's W(z_C − z)zᵀ/‖z‖² ({paper:.6g}), the smallest of all patches with ΔW z = W(z_C − z)")
    print(f"✓ input_patch ({_whose(own)}): (W + ΔW) z = W z_C on {len(cases)} cases (largest relative error "
          f"{worst:.1e}), ΔW of rank 1; {note}")
    return Checked("input_patch", fn, own, {"cases": len(cases), "max_error": worst, "minimum_norm": all(minimal)})


# ---------------------------------------------------------------------------------------------- 02: scale patch
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
        if seed == 2:                                              # tiny but not zero, as on real layers (2e-7)
            h[0] = 1e-9
        out.append((v, v_C, h, m))
    return out


def _scale_wrong(v, vc, h, m) -> dict:
    dm = solutions.scale_patch(v, vc, h, m)
    return {
        "Δm adds v_C − v to the block output: use (v_C − v), not (v − v_C) (check the sign).": -dm,
        "The block adds (m + Δm) ⊙ h, so Δm ⊙ h alone must equal v_C − v: divide by h, not by m ⊙ h.":
            solutions.scale_patch(v, vc, h * m, m),
        "You returned the new scale m + Δm; return the patch Δm itself (it is added to the stored weight).": m + dm,
        "Off by the 1 + w offset: Δm is a change of the scale, the same for m and for w = m − 1. Return (v_C − v) / h "
        "with no ±1.": dm - 1,
        "Off by the 1 + w offset (the other way): Δm is a change of the scale, no +1.": dm + 1,
    }


def check_scale_patch(fn: Callable | None) -> Checked:
    """02: ``fn(v, v_C, h, m)`` must return ``dm`` with ``v + (m + dm) h = v_C + m h`` wherever ``h_i != 0``. Where
    ``h_i = 0`` exactly no scale acts, so any finite ``dm_i`` is correct; the paper divides by 1 there."""
    cases = _scale_cases()
    fn, own = _begin("scale_patch", fn, cases[0])
    worst, zeros, paper_at_zero = 0.0, 0, True
    for v, vc, h, m in cases:
        out = _call(fn, (v, vc, h, m), "scale_patch")
        if not isinstance(out, torch.Tensor) or out.shape != v.shape:
            raise ExerciseError(f"scale_patch must return a tensor of v's shape {tuple(v.shape)} (one Δm_i per "
                                f"coordinate); got {getattr(out, 'shape', type(out).__name__)}")
        out = out.double()
        if not torch.isfinite(out).all():
            k = int((~torch.isfinite(out)).nonzero()[0])
            raise ExerciseError(f"Δm is not finite at coordinate {k}, where h_{k} = {float(h[k])}. Where h_i = 0 no "
                                "scale can act, so any finite Δm_i is correct; the paper divides by 1 there "
                                "(torch.where(h == 0, 1, h)), and the engine counts each such coordinate as a fallback")
        f32_max = torch.finfo(torch.float32).max
        if bool((out.abs() > f32_max).any()):
            k = int((out.abs() > f32_max).nonzero()[0])
            raise ExerciseError(f"Δm_{k} = {float(out[k]):.3g} where h_{k} = {float(h[k])}: finite in float64, but "
                                "infinite once stored in a float32 or bfloat16 model (their largest number is "
                                f"{f32_max:.2g}). torch.nan_to_num hides the division by zero instead of avoiding it: "
                                "divide by 1 where h_i = 0 (torch.where(h == 0, 1, h)), as the paper does")
        nz = h != 0
        lhs, rhs = v + (m + out) * h, vc + m * h
        err = float((lhs - rhs)[nz].abs().max() / rhs[nz].abs().max())
        if err > 1e-12:
            hint = _hint(out, _scale_wrong(v, vc, h, m), 1e-12)
            tiny = nz & (h.abs() < 1e-6)
            bad = ((lhs - rhs).abs() > 1e-12 * rhs[nz].abs().max()) & nz
            if hint is None and bool((bad & tiny).any()):
                hint = (f"wrong only where h_i is tiny but not 0 (h = {float(h[tiny][0]):.0e} here): divide by h itself, "
                        "not by h + eps or a clamped h. There Δm_i must be huge (the real model has |h_i| of a "
                        "few 1e-7, lesson 02 shows them); guard only the exact zeros (torch.where(h == 0, 1, h)).")
            if hint is None and err < 1e-6:
                hint = (f"close but not exact (relative error {err:.1e}; the cases are float64, so the check asks for "
                        "1e-12): is there an epsilon added to h, or a computation in float32? Divide by h itself and "
                        "guard only the exact zeros.")
            raise ExerciseError(hint or f"v + (m + Δm) ⊙ h should equal v_C + m ⊙ h where h_i ≠ 0; they differ by "
                                        f"{err:.2e} (relative)")
        zeros += int((~nz).sum())
        paper_at_zero &= bool(torch.equal(out[~nz], (vc - v)[~nz]))
        worst = max(worst, err)
    note = ("at those coordinates any finite value is right (no scale can act on a zero; the block output misses "
            "(v_C − v)_i whatever Δm_i is), and " + (f"{'yours' if own else 'the solution'} divides by 1 there, as the paper does" if paper_at_zero
                                                      else "the paper divides by 1 there, Δm_i = (v_C − v)_i; "
                                                           "yours puts another finite value"))
    print(f"✓ scale_patch ({_whose(own)}): v + (m + Δm) ⊙ h = v_C + m ⊙ h on {len(cases)} cases (largest relative "
          f"error {worst:.1e}); {zeros} coordinates with h_i = 0 exactly: {note}")
    return Checked("scale_patch", fn, own, {"cases": len(cases), "max_error": worst, "zeros": zeros,
                                            "divides_by_1_at_zeros": paper_at_zero})


# ------------------------------------------------------------------------------- 03: the from-scratch pieces
def blocks(model) -> list:
    """One ``GemmaBlock`` per decoder layer of a Gemma 3 model (they share the model's weights)."""
    from .block import GemmaBlock

    return [GemmaBlock(layer, model.config, i) for i, layer in enumerate(model.model.layers)]


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


@torch.no_grad()
def logits(model, x: torch.Tensor) -> torch.Tensor:
    """The output head on one residual row: final RMSNorm, unembedding, Gemma's logit soft-capping if configured."""
    out = model.lm_head(model.model.norm(x[None]))[0]
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(out / cap) * cap if cap else out


def make_tools(input_patch: Callable = solutions.input_patch, scale_patch: Callable = solutions.scale_patch,
               theorem1_block: Callable | None = None, patched_layer: Callable | None = None):
    """The pieces the Algorithm 1 loop is written with (notebook 03), with ``theorem1_block`` the learner's (checked
    by ``check_theorem1_block``) or one built from the given patch functions (the learner's from notebook 02, or the
    package's). ``tools.theorem1_block`` returns the patched layer's output; ``tools.patches`` the three patches
    it builds (for the schedules of Exercise 4), and ``tools.patched_layer`` runs a layer with given patches (the
    learner's, checked by ``check_patched_layer``, or the package's)."""
    from .block import unit_rms

    @torch.no_grad()
    def built(block, x: torch.Tensor, position: int, target) -> torch.Tensor:
        """One block on the query row ``x`` alone (at its absolute ``position``), patched by Theorem 1 against the
        full-context ``target``: the input patches, then the scale patch on the h the patched MLP computes."""
        tr = block(x[None], positions=torch.tensor([position]))
        v, z = tr.v[0], tr.z[0]
        W_gate = block.W_gate + input_patch(block.W_gate, z, target.z_C)
        W_up = block.W_up + input_patch(block.W_up, z, target.z_C)
        h_gated = torch.nn.functional.gelu(W_gate @ z, approximate="tanh") * (W_up @ z)
        h = unit_rms(block.W_down @ h_gated, block.eps)             # N(W_down h_g), in the norm's dtype
        m = 1.0 + block.norms["post_feedforward_layernorm"].to(h.dtype)
        dm = scale_patch(v.to(h.dtype), target.v_C.to(h.dtype), h, m)
        return (v.to(h.dtype) + (m + dm) * h).to(x.dtype)

    mine = theorem1_block is not None and getattr(theorem1_block, "own", True)

    @torch.no_grad()
    def patches(block, x: torch.Tensor, position: int, target) -> tuple:
        """The three patches (dW_gate, dW_up, dm) Theorem 1 builds for the row ``x`` against ``target``."""
        if mine:
            return tuple(theorem1_block(block, x, position, target)[1])
        return solutions.theorem1_block(block, x, position, target, input_patch, scale_patch)[1]

    run_patched = patched_layer if patched_layer is not None and getattr(patched_layer, "own", True) \
        else solutions.patched_layer
    return SimpleNamespace(blocks=blocks, full_context_targets=full_context_targets, query_embedding=query_embedding,
                           theorem1_block=(lambda *a: theorem1_block(*a)[0]) if mine else built,
                           patches=patches, patched_layer=torch.no_grad()(lambda *a: run_patched(*a)),
                           logits=logits)


def _layer_mistakes(block, x: torch.Tensor, v: torch.Tensor, z: torch.Tensor, patches) -> dict:
    """The outputs of one patched Gemma layer written with one typical mistake each, keyed by the hint that names
    it: the checks of ``theorem1_block`` and ``patched_layer`` compare a wrong answer with each. ``v`` and ``z`` are
    the layer's own, from the row ``x``; ``patches = (dW_gate, dW_up, dm)``."""
    F = torch.nn.functional
    dWg, dWu, dm = patches
    n = lambda y: unit_rms(y, block.eps)                              # N, as every RMSNorm of the engine computes it
    w = block.norms["post_feedforward_layernorm"]
    m = 1.0 + w

    def y(act=lambda a: F.gelu(a, approximate="tanh"), patched=True):
        W_gate, W_up = (block.W_gate + dWg, block.W_up + dWu) if patched else (block.W_gate, block.W_up)
        return block.W_down @ (act(W_gate @ z) * (W_up @ z))
    y_patched = y()
    h = n(y_patched)
    return {
        "Gemma's scale is m = 1 + w: block.norms holds the stored w.": v + (w + dm) * h,
        "N includes the epsilon: h = y / sqrt(mean(y²) + block.eps).":
            v + (m + dm) * (y_patched / y_patched.pow(2).mean().sqrt()),
        "Yours is the *unpatched* MLP's h: the MLP must use the patched matrices, W_gate + dW_gate and W_up + dW_up, "
        "on z, and h = N(W_down h_g) of that patched MLP.": v + (m + dm) * n(y(patched=False)),
        "Gemma uses the tanh approximation of GELU: gelu(..., approximate='tanh').": v + (m + dm) * n(y(act=F.gelu)),
        "Gemma's MLP gates with GELU (tanh approximation), not SiLU.": v + (m + dm) * n(y(act=F.silu)),
        "The residual is v, the row after attention, not the layer's input x: out = v + (m + Δm) ⊙ h.":
            x + (m + dm) * h,
        "The scale patch dm is missing: out = v + (m + Δm) ⊙ h.": v + m * h,
    }


class _Known(SimpleNamespace):
    """The full-context record as the query alone may use it (z_C, v_C): asking for more is named, not a bare
    AttributeError."""

    def __getattr__(self, name):
        raise ExerciseError(f"target.{name}: use only target.z_C and target.v_C, what the query alone may know of "
                            f"the context (the loop's records also hold x_C and out_C, the full-context input and "
                            f"output, which a procedure on the query alone cannot have)")


def check_theorem1_block(fn: Callable | None, cases: list | None = None) -> Checked:
    """03: ``fn(block, x, position, target)`` must return ``(out, (dW_gate, dW_up, dm))``: the output row of
    ``block`` run on the row ``x`` alone, patched by Theorem 1 against ``target`` (its ``z_C`` and ``v_C`` only), and
    the patches it used. The check recomputes the layer from the returned patches: each input patch is rank 1 with
    (W + dW) z = W z_C on the query's own z, the output is v + (m + dm) N(W_down h_g) of the patched MLP, and it
    equals the full-context output. Checked on every layer of a tiny float64 Gemma 3, at the query of two prompts,
    each layer fed its full-context input (so that its target is exact)."""
    cases = cases or _algorithm1_cases()
    gelu = torch.nn.functional.gelu
    model, ids = cases[0]
    t0 = full_context_targets(model, ids)[0]
    first = (blocks(model)[0], t0.x_C, len(ids) - 1, SimpleNamespace(z_C=t0.z_C, v_C=t0.v_C))
    fn, own = _begin("theorem1_block", fn, first)
    worst = 0.0
    for model, ids in cases:
        targets, p = full_context_targets(model, ids), len(ids) - 1
        for l, (block, t) in enumerate(zip(blocks(model), targets)):
            given = _Known(z_C=t.z_C, v_C=t.v_C)                       # what the query alone may know of the context
            res = _call(fn, (block, t.x_C, p, given), "theorem1_block")
            if not (isinstance(res, (tuple, list)) and len(res) == 2 and isinstance(res[1], (tuple, list))
                    and len(res[1]) == 3):
                raise ExerciseError("theorem1_block must return (out, (dW_gate, dW_up, dm)): the output row and the "
                                    "three patches it applied")
            out, (dWg, dWu, dm) = res
            with torch.no_grad():
                tr = block(t.x_C[None], positions=torch.tensor([p]))
                v, z = tr.v[0], tr.z[0]
                n = lambda y: unit_rms(y, block.eps)                  # N, as every RMSNorm of the engine computes it
                m = 1.0 + block.norms["post_feedforward_layernorm"]
                for name, W, dW in (("dW_gate", block.W_gate, dWg), ("dW_up", block.W_up, dWu)):
                    if not isinstance(dW, torch.Tensor) or dW.shape != W.shape:
                        raise ExerciseError(f"layer {l}: {name} must have the shape of the matrix it patches, "
                                            f"{tuple(W.shape)}; got {tuple(getattr(dW, 'shape', ()))}")
                    if float(dW.abs().max()) == 0.0:
                        raise ExerciseError(f"layer {l}: {name} is zero. Feeding the MLP z_C directly computes the "
                                            "same numbers, but the exercise is the weight patch: "
                                            f"{name} = input_patch(W, z, target.z_C), with z the query's own")
                    sv = torch.linalg.svdvals(dW.double())
                    if float(sv[1]) > 1e-9 * float(sv[0]):
                        raise ExerciseError(f"layer {l}: {name} has rank > 1; Theorem 1's patch is one outer product "
                                            "(input_patch from lesson 02)")
                    if _rel((W + dW) @ z, W @ t.z_C) > 1e-10:
                        raise ExerciseError(f"layer {l}: (W + {name}) z ≠ W z_C for the query's own z (from the block "
                                            "run on x alone): input_patch(W, z, target.z_C), in that order")
                if not isinstance(dm, torch.Tensor) or dm.shape != v.shape:
                    raise ExerciseError(f"layer {l}: dm must be a vector of the row's shape {tuple(v.shape)}")
                h = n(block.W_down @ (gelu((block.W_gate + dWg) @ z, approximate="tanh") * ((block.W_up + dWu) @ z)))
                rebuilt = v + (m + dm) * h
            if not isinstance(out, torch.Tensor) or out.shape != t.out_C.shape:
                raise ExerciseError(f"theorem1_block must return the output row, shape {tuple(t.out_C.shape)}; got "
                                    f"{getattr(out, 'shape', type(out).__name__)}")
            if _rel(out, rebuilt) > 1e-10:
                with torch.no_grad():
                    named = _layer_mistakes(block, t.x_C, v, z, (dWg, dWu, dm))
                hint = next((k for k, t_ in named.items() if _rel(out, t_) < 1e-10), None)
                raise ExerciseError(f"layer {l}: the returned row is not v + (m + dm) ⊙ h of the patched layer with the "
                                    "returned patches (h = N(W_down h_g) of the patched MLP on z, GELU with "
                                    "approximate='tanh'). " + (hint or "Return exactly that row."))
            err = _rel(out, t.out_C)
            if err > 1e-9:
                h0 = n(block.W_down @ (gelu(block.W_gate @ z, approximate="tanh") * (block.W_up @ z)))
                hint = None
                if float(dm.abs().max()) == 0.0:
                    hint = ("the MLP is patched, but the output misses what attention added with the context: add the "
                            "scale patch, Δm = scale_patch(v, target.v_C, h, m)")
                elif _rel(dm, solutions.scale_patch(v, t.v_C, h0, m)) < 1e-10:
                    hint = "Δm must divide by the h of the *patched* MLP on z (after the input patches), not the unpatched h"
                elif _rel(-dm, solutions.scale_patch(v, t.v_C, h, m)) < 1e-10:
                    hint = "Δm has the wrong sign: it must add what the context added, Δm = (v_C − v) ⊘ h"
                raise ExerciseError(f"layer {l}: the patched output differs from the full-context output by "
                                    f"{err:.2e} (relative). " + (hint or "Build Δm = scale_patch(v, target.v_C, h, m) "
                                    "on h = N(W_down h_g) of the patched MLP on z, with m = 1 + the stored weight."))
            worst = max(worst, err)
    print(f"✓ theorem1_block ({_whose(own)}): on every layer of a {len(blocks(model))}-layer Gemma 3 (float64), at the "
          f"query of {len(cases)} prompts: rank-1 input patches with (W + ΔW) z = W z_C, and the patched layer run on "
          f"the query alone gives the full-context output to {worst:.1e} (relative)")
    return Checked("theorem1_block", fn, own, {"cases": len(cases), "layers": len(blocks(model)),
                                               "max_rel_error": worst})


TOOLS = make_tools()


def check_patched_layer(fn: Callable | None, cases: list | None = None) -> Checked:
    """03: ``fn(block, x, position, patches)`` must run layer ``block`` on the row ``x`` alone with the given
    ``patches = (dW_gate, dW_up, dm)`` applied as they are: out = v + (m + dm) N(W_down h_g) of the patched MLP on the
    z of this ``x``. Checked on every layer of a tiny float64 Gemma 3: with patches built (by Theorem 1) for the
    full-context input x_C, the layer run on x_C must give the full-context output; run on another row (the query's
    own embedding, as the ideal schedule does at layer 0 and beyond), it must give what those same patches compute
    there, which is not the full-context output."""
    cases = cases or _algorithm1_cases()
    model, ids = cases[0]
    t0, p0 = full_context_targets(model, ids)[0], len(ids) - 1
    _, patches0 = solutions.theorem1_block(blocks(model)[0], t0.x_C, p0, t0)
    fn, own = _begin("patched_layer", fn, (blocks(model)[0], t0.x_C, p0, patches0))
    worst, moved = 0.0, 0.0
    for model, ids in cases:
        targets, p = full_context_targets(model, ids), len(ids) - 1
        x_alone = query_embedding(model, ids)
        for l, (block, t) in enumerate(zip(blocks(model), targets)):
            _, patches = solutions.theorem1_block(block, t.x_C, p, t)            # built for the full-context input
            for x, name in ((t.x_C, "the input they were built for (x_C)"), (x_alone, "another input")):
                out = _call(fn, (block, x, p, tuple(q.clone() for q in patches)), "patched_layer")
                if not isinstance(out, torch.Tensor) or out.shape != t.out_C.shape:
                    raise ExerciseError(f"patched_layer must return the output row, shape {tuple(t.out_C.shape)}; got "
                                        f"{getattr(out, 'shape', type(out).__name__)}")
                want = solutions.patched_layer(block, x, p, patches)
                err = _rel(out, want)
                if err <= 1e-10:
                    worst = max(worst, err)
                    continue
                with torch.no_grad():
                    tr = block(x[None], positions=torch.tensor([p]))
                    named = _layer_mistakes(block, x, tr.v[0], tr.z[0], patches)
                hint = next((k for k, t_ in named.items() if _rel(out, t_) <= 1e-10), None)
                raise ExerciseError(f"layer {l}, on {name}: the output differs from v + (m + dm) ⊙ N(W_down h_g) of the "
                                    f"patched layer by {err:.2e} (relative). " + (hint or "v and z come from running "
                                    "the block on x; h_g = GELU((W_gate + dW_gate) z) ⊙ (W_up + dW_up) z, with "
                                    "approximate='tanh'; m = 1 + the stored weight."))
            moved = max(moved, _rel(solutions.patched_layer(block, x_alone, p, patches), t.out_C))
    print(f"✓ patched_layer ({_whose(own)}): on every layer of a {len(blocks(model))}-layer Gemma 3 (float64), "
          f"{len(cases)} prompts, with patches built for the full-context input: on that input it returns the "
          f"full-context output, and on another it returns what those patches compute there (both within {worst:.1e} "
          f"of the reference, relative), which misses the full-context output by up to {moved:.2g} (relative)")
    return Checked("patched_layer", fn, own, {"cases": len(cases), "layers": len(blocks(model)), "max_error": worst,
                                              "other_input_miss": moved})


def _algorithm1_cases() -> list:
    from .fixtures import tiny_gemma3

    model = tiny_gemma3(seed=3, dtype="float64")
    return [(model, [2, 10, 20, 30, 40, 50, 11, 12, 13, 33]), (model, [2, 7, 7, 61, 5, 90, 44, 3, 19, 28, 71, 6])]


def _spy_tools(tools):
    """``tools`` that record every call, in order, and the record: ``theorem1`` (each tools.theorem1_block call),
    ``heads`` (tools.logits), ``built`` (tools.patches) and ``runs`` (tools.patched_layer), each entry with the
    call's arguments and its result ``out``. The checks of notebook 03's loops read from it what each layer was fed
    and what its patches were built for."""
    log = SimpleNamespace(theorem1=[], heads=[], built=[], runs=[])

    def theorem1(block, x, position, target):
        out = tools.theorem1_block(block, x, position, target)
        log.theorem1.append(SimpleNamespace(block=block, x=x, position=position, target=target, out=out))
        return out

    def head(model, x):
        out = tools.logits(model, x)
        log.heads.append(SimpleNamespace(x=x, out=out))
        return out

    def patches(block, x, position, target):
        out = tools.patches(block, x, position, target)
        log.built.append(SimpleNamespace(block=block, x=x, target=target, out=out))
        return out

    def patched_layer(block, x, position, given):
        out = tools.patched_layer(block, x, position, given)
        log.runs.append(SimpleNamespace(block=block, x=x, patches=given, out=out))
        return out
    spied = {"theorem1_block": theorem1, "logits": head, "patches": patches, "patched_layer": patched_layer}
    return SimpleNamespace(**{**vars(tools), **{k: f for k, f in spied.items() if hasattr(tools, k)}}), log


def check_algorithm1(fn: Callable | None, tools=None, cases: list | None = None) -> Checked:
    """03: ``fn(model, ids, tools)`` must return the logits Algorithm 1 gives for the last token of ``ids`` run
    alone: every layer patched, in order, each fed the output of the patched layer below (at any position: a token
    alone attends to itself only, so RoPE changes nothing; the engine uses its position in the prompt). Checked on a tiny float64 Gemma 3, where the logits must equal the same from-scratch model's full-context
    logits (transformers' Gemma 3 computes its norms in float32 even in float64, so the check compares like with
    like)."""
    tools = tools or TOOLS
    cases = cases or _algorithm1_cases()
    fn, own = _begin("algorithm1", fn, (cases[0][0], list(cases[0][1]), tools))
    moved, block_worst, logit_worst = False, 0.0, 0.0
    for model, ids in cases:
        spied, log = _spy_tools(tools)
        out = _call(fn, (model, list(ids), spied), "algorithm1")
        calls, heads = log.theorem1, log.heads
        L, p = len(model.model.layers), len(ids) - 1
        targets = full_context_targets(model, ids)
        want = logits(model, targets[-1].out_C)      # the same from-scratch model, with the whole context
        if not calls:
            raise ExerciseError("tools.theorem1_block was never called: patch every layer through it "
                                "(x = tools.theorem1_block(block, x, position, targets[layer])), so that the check can "
                                "see what each layer is fed (calling your theorem1_block directly hides the oracle "
                                "mistake this exercise is about)")
        if len(calls) != L:
            raise ExerciseError(f"{len(calls)} patched layers, but the model has {L}: Algorithm 1 patches every layer, "
                                "in order (for layer, block in enumerate(tools.blocks(model)))")
        x0 = query_embedding(model, ids)
        for k, c in enumerate(calls):
            if c.block.W_gate is not model.model.layers[k].mlp.gate_proj.weight:
                raise ExerciseError(f"call {k} of theorem1_block got the block of another layer: patch layer {k} with "
                                    f"its own block (for layer, block in enumerate(tools.blocks(model))), in order")
            if not torch.equal(c.target.v_C, targets[k].v_C):
                if any(t.v_C.shape == c.target.v_C.shape and torch.equal(c.target.v_C, t.v_C) for t in targets):
                    raise ExerciseError(f"layer {k} was patched against another layer's targets: pass targets[{k}]")
                raise ExerciseError(f"layer {k} was patched against targets that are no layer's full-context targets: "
                                    "record them once with tools.full_context_targets(model, ids) on the whole prompt "
                                    "(context and query); targets recorded from the query alone hold no context")
            if k == 0:
                if not torch.equal(c.x, x0):
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
        if torch.equal(out, logits(model, x0)):
            raise ExerciseError("these are the logits of the unpatched query embedding: apply tools.logits to the "
                                "last patched layer's output")
        fed = [h for h in heads if h.out is out]      # the tools.logits call whose result was returned
        if fed and not torch.equal(fed[-1].x, calls[-1].out) and torch.equal(fed[-1].x, targets[-1].out_C):
            raise ExerciseError("these are the logits of the recorded full-context output (targets[-1].out_C), which "
                                "the query alone never computes: return tools.logits(model, x) with x the output of "
                                "your last patched layer")
        rel = _rel(out, want)
        block_rel = max(_rel(c.out, t.out_C) for c, t in zip(calls, targets))
        if rel > 1e-10 and out.dtype != want.dtype and _rel(out, want.to(out.dtype)) == 0.0:
            raise ExerciseError(f"your logits are the right ones cast to {out.dtype} (the model computes in "
                                f"{want.dtype}): return tools.logits(model, x) as it is, without the cast")
        if rel > 1e-10:
            raise ExerciseError(f"the logits differ from the full-context logits by {rel:.2e} (relative): return "
                                "tools.logits(model, x) with x the output of the last patched layer")
        moved = moved or any(c.position != p for c in calls)
        block_worst, logit_worst = max(block_worst, block_rel), max(logit_worst, rel)
    print(f"✓ algorithm1 ({_whose(own)}): {len(cases)} prompts on a {L}-layer Gemma 3 (float64): every layer patched "
          f"from the actual output of the patched layer below; each block's output within {block_worst:.1e} of its "
          f"full-context output (relative, the largest over the prompts), and the logits "
          + ("identical to the full-context logits (the final norm computes in float32, which rounds the blocks' "
             "differences away)" if logit_worst == 0 else
             f"within {logit_worst:.1e} of the full-context logits (relative)"))
    if moved:
        print("  note: you ran the query at another position than its own, len(ids) - 1. For one token alone that "
              "changes nothing: its attention has a single key, whose softmax weight is 1 whatever RoPE does to q and "
              "k. The engine keeps the prompt's position, as the paper's setting does.")
    return Checked("algorithm1", fn, own, {"prompts": len(cases), "layers": L, "block_error": block_worst,
                                           "logit_error": logit_worst})


def check_run_schedule(fn: Callable | None, tools=None, cases: list | None = None) -> Checked:
    """03: ``fn(model, ids, targets, ideal, tools)`` must run the last token of ``ids`` alone through every layer and
    return each layer's output row, in order. Layer l is fed the output of the patched layer below (the query's
    embedding at layer 0) and runs with patches (``tools.patches``) built for the row it is fed (Algorithm 1) or,
    with ``ideal``, for the recorded full-context input ``targets[l].x_C``. Checked by watching the calls on a tiny
    float64 Gemma 3, both schedules, two prompts: what each layer's patches were built for, and what it was fed."""
    tools = tools or TOOLS
    cases = cases or _algorithm1_cases()
    model0, ids0 = cases[0]
    fn, own = _begin("run_schedule", fn, (model0, list(ids0), full_context_targets(model0, ids0), False, tools))
    worst = {False: 0.0, True: 0.0}
    for model, ids in cases:
        targets, L = full_context_targets(model, ids), len(model.model.layers)
        x0 = query_embedding(model, ids)
        for ideal in (False, True):
            name = "ideal=True (the ideal schedule)" if ideal else "ideal=False (Algorithm 1)"
            spied, log = _spy_tools(tools)
            outs = _call(fn, (model, list(ids), targets, ideal, spied), "run_schedule")
            built, runs, whole = log.built, log.runs, log.theorem1
            if whole:
                raise ExerciseError(f"{name}: {len(whole)} layers ran through tools.theorem1_block, which builds the "
                                    "patches and runs the layer in one call, so nothing shows what the patches were "
                                    "built for. Run both schedules the same way: patches = tools.patches(block, "
                                    "built_for, position, t), then x = tools.patched_layer(block, x, position, "
                                    "patches); only built_for differs")
            if len(runs) != L:
                raise ExerciseError(f"{name}: {len(runs)} calls of tools.patched_layer, but the model has {L} layers: "
                                    "run every layer, in order, as x = tools.patched_layer(block, x, position, "
                                    "patches), with patches = tools.patches(block, built_for, position, targets[l])")
            if not isinstance(outs, (list, tuple)) or len(outs) != L:
                raise ExerciseError(f"{name}: return the list of the {L} layers' output rows, in order (got "
                                    f"{type(outs).__name__}{'' if not hasattr(outs, '__len__') else f' of {len(outs)}'})")
            for k, (r, t) in enumerate(zip(runs, targets)):
                if r.block.W_gate is not model.model.layers[k].mlp.gate_proj.weight:
                    raise ExerciseError(f"{name}: call {k} of tools.patched_layer got the block of another layer: "
                                        "run the layers in order (for block, t in zip(tools.blocks(model), targets))")
                below = x0 if k == 0 else runs[k - 1].out
                if not torch.equal(r.x, below):
                    if k and torch.equal(r.x, t.x_C):
                        raise ExerciseError(f"{name}: layer {k} was fed the recorded full-context input x_C. That is "
                                            "the oracle schedule (lesson 05), which the query alone cannot run: both "
                                            "schedules feed each layer the output of the patched layer below")
                    if k and torch.equal(r.x, x0):
                        raise ExerciseError(f"{name}: layer {k} was fed the query embedding again: pass each layer's "
                                            "output on (x = tools.patched_layer(block, x, ...))")
                    raise ExerciseError(f"{name}: layer {k}'s input is not the output of the patched layer below "
                                        + ("" if k else "(layer 0 gets tools.query_embedding(model, ids))"))
                source = next((b for b in built if b.out is r.patches), None)
                if source is None:
                    raise ExerciseError(f"{name}: layer {k} ran with patches that tools.patches did not build: build "
                                        "them in the loop, patches = tools.patches(block, built_for, position, t)")
                if source.block is not r.block or not torch.equal(source.target.v_C, t.v_C):
                    raise ExerciseError(f"{name}: layer {k}'s patches were built for another layer or against "
                                        f"another layer's targets: tools.patches(block, built_for, position, "
                                        f"targets[{k}]) with layer {k}'s own block")
                if k and ideal and not torch.equal(source.x, t.x_C):
                    raise ExerciseError(f"{name}: layer {k}'s patches were built for "
                                        + ("the row it is fed, as Algorithm 1 does. " if torch.equal(source.x, r.x)
                                           else "a row that is not its recorded input. ")
                                        + "The ideal schedule builds them for the recorded full-context input, "
                                          "t.x_C, and then runs them on the row the layer is fed")
                if k and not ideal and not torch.equal(source.x, r.x):
                    raise ExerciseError(f"{name}: layer {k}'s patches were built for "
                                        + ("the recorded input x_C, as the ideal schedule does. "
                                           if torch.equal(source.x, t.x_C) else "a row it was not fed. ")
                                        + "Algorithm 1 builds each layer's patches for the row the layer is fed, x")
                got = outs[k]
                if not isinstance(got, torch.Tensor) or not torch.equal(got, r.out):
                    raise ExerciseError(f"{name}: entry {k} of the list is not layer {k}'s output (what "
                                        "tools.patched_layer returned for it): append x after each layer")
                worst[ideal] = max(worst[ideal], _rel(r.out, t.out_C))
    print(f"✓ run_schedule ({_whose(own)}): both schedules on every layer of a {L}-layer Gemma 3 (float64), "
          f"{len(cases)} prompts: each layer fed the output of the patched layer below, its patches built for that row "
          f"(Algorithm 1) or for the recorded x_C (ideal).\n  Largest relative error of a layer's output against the "
          f"full-context output: Algorithm 1 {worst[False]:.1e}, ideal {worst[True]:.1e}. In float64 the fed rows "
          f"differ from x_C by float64 rounding only, so both stay small here; the real model in float32 is next.")
    return Checked("run_schedule", fn, own, {"prompts": len(cases), "layers": L, "selfcorrect_error": worst[False],
                                             "ideal_error": worst[True]})


# ---------------------------------------------------------------------------------------------- 04: the secular root
def _secular_cases() -> list:
    """Random problems, plus the two a real layer poses: a width-640 scale with min m^2 = 2.4e-4 (the pole next to 0,
    as at layer 6 of the embedded model) and a large g, whose root lies far below min m^2 (a fixed bracket misses)."""
    out = []
    for seed, n in enumerate([5, 8, 16, 64]):
        g = _gen(300 + seed)
        m = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
        out.append((torch.randn(n, generator=g, dtype=torch.float64), m))
    g = _gen(310)
    m = 0.015625 + 2.0 * torch.rand(640, generator=g, dtype=torch.float64)
    out.append((torch.randn(640, generator=g, dtype=torch.float64), m))
    g = _gen(311)
    m = 0.5 + torch.rand(32, generator=g, dtype=torch.float64)
    out.append((100.0 * torch.randn(32, generator=g, dtype=torch.float64), m))
    # widely spaced m and a small g: F has roots between its poles too, where a bracket that reaches above min m^2
    # (to max m^2, say) lets bisection land
    out.append((torch.tensor([0.05, 0.04, -0.03, 0.02, 0.01], dtype=torch.float64),
                torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)))
    return out


def _mean_y2(mu: float, g, m) -> float:
    return float(((g * m / (m ** 2 - mu)) ** 2).mean())


def check_secular_root(fn: Callable | None) -> Checked:
    """04: ``fn(g, m)`` must return the root mu* < min m^2 of Appendix B's secular function: the Lagrange
    multiplier for which y = g m / (m^2 - mu*) has mean(y^2) = 1. Any method passes (bisection, Newton, ...) if the
    root is the right one: mean(y^2) = 1 to 1e-9, or mu within 1e-9 (relative) of the root."""
    cases = _secular_cases()
    fn, own = _begin("secular_root", fn, cases[0])
    worst = 0.0
    for g, m in cases:
        out = _call(fn, (g, m), "secular_root")
        if isinstance(out, torch.Tensor) and out.numel() > 1:
            raise ExerciseError(f"secular_root must return the number μ*, not a vector (got a tensor of shape "
                                f"{tuple(out.shape)}: is it y?)")
        try:
            mu = float(out)
        except (TypeError, ValueError):
            raise ExerciseError(f"secular_root must return a number μ*, got {type(out).__name__}") from None
        if isinstance(out, torch.Tensor) and out.dtype != torch.float64:
            raise ExerciseError(f"secular_root returned a {out.dtype} tensor: find the root in float64 (the package "
                                "does), since F is steep near its pole and float32 leaves μ* uncertain by ~1e-7")
        m2 = float((m ** 2).min())
        want = solutions.secular_root(g, m)
        if mu >= m2:
            raise ExerciseError(f"μ = {mu:.6g} is not below min m_k² = {m2:.6g}: F has more roots above it (between "
                                "its poles), but Appendix B's minimiser is the one with μ < min m_k², where F rises "
                                "monotonically from −1 to +∞. Search on (−∞, min m²).")
        err = abs(_mean_y2(mu, g, m) - 1.0)
        if math.isfinite(err) and err > 1e-9 and abs(mu - want) <= 1e-9 * max(1.0, abs(want)):
            err = 0.0                      # the root itself, to 1e-9: F is steep there, so mean(y^2) is a little off
        if math.isfinite(err) and err > 1e-9 and abs(mu - want) <= 1e-4 * max(1.0, abs(want)):
            raise ExerciseError(f"μ = {mu:.12g} is within {abs(mu - want):.1e} of the root, but not to 1e-9 (relative): "
                                "tighten your stopping rule (bisect until the bracket is narrower than about 1e-12, "
                                "or a fixed 200 halvings), and keep every step in float64")
        if not math.isfinite(err) or err > 1e-9:
            n = g.numel()
            tries = {
                "F is a *mean* over the n coordinates, (1/n) Σ_k (g_k m_k)² / (m_k² − μ)² − 1: with the sum, "
                "mean(y²) comes out 1/n.": lambda x: abs(_mean_y2(x, g, m) * n - 1.0),
                "The denominator is squared, (m_k² − μ)², because y_k = g_k m_k / (m_k² − μ) and F is mean(y²) − 1.":
                    lambda x: abs(float(((g * m) ** 2 / (m ** 2 - x)).mean()) - 1.0),
                "The poles are at m_k², not m_k: y_k = g_k m_k / (m_k² − μ).":
                    lambda x: abs(float(((g * m / (m - x)) ** 2).mean()) - 1.0),
            }
            hint = next((h for h, f in tries.items() if f(mu) < 1e-6), None)
            side = ("F > 0 there, so the root lies further left: does your bracket reach it? With a large g the root "
                    "can be far below min m² (any lo with F(lo) < 0 works, e.g. min m² − sqrt(mean((g m)²)) − 1)"
                    if _mean_y2(mu, g, m) > 1 else "F < 0 there, so the root lies to the right")
            raise ExerciseError(hint or f"at μ = {mu:.12g} the constraint misses: mean(y²) = {_mean_y2(mu, g, m):.12g}, "
                                        f"not 1 to 1e-9 (the root is {want:.12g}; is every step in float64?). F(μ) = mean((g m)² / (m² − μ)²) − 1 is "
                                        f"increasing on (−∞, min m²): {side}")
        worst = max(worst, err)
    sizes = [g.numel() for g, _ in cases]
    print(f"✓ secular_root ({_whose(own)}): on {len(cases)} problems (n = {min(sizes)} to {max(sizes)}) μ* < min m² "
          f"and mean(y²) = 1 to {worst:.1e}")
    return Checked("secular_root", fn, own, {"cases": len(cases), "sizes": sizes, "max_constraint_error": worst})



# ------------------------------------------------------------------------------------- 04: the stable update, steps 3-4
def _stable_cases() -> list:
    """Random float64 problems of a post-norm of width 24 after an MLP of width 40, m away from 0: three with h_down_C
    of RMS about 30 (Gemma's eps inside N negligible), one as on a real layer (RMS about 0.1, some m_k in the
    hundreds), where the eps matters and dm = -mu*/m is not exact."""
    out = []
    for seed in range(3):
        gen = _gen(400 + seed)
        n, k = 24, 40
        m = (0.3 + torch.rand(n, generator=gen, dtype=torch.float64)) * torch.where(
            torch.rand(n, generator=gen, dtype=torch.float64) < 0.2, -1.0, 1.0)
        h_g_C = torch.randn(k, generator=gen, dtype=torch.float64)
        W_down = 5.0 * torch.randn(n, k, generator=gen, dtype=torch.float64)
        h_down_C = W_down @ h_g_C
        dv = torch.randn(n, generator=gen, dtype=torch.float64)
        g = dv + m * h_down_C / torch.sqrt(h_down_C.pow(2).mean() + 1e-6)
        out.append((g, m, solutions.secular_root(g, m), h_g_C, h_down_C, 1e-6))
    gen = _gen(410)                 # as on layer 6 of the embedded model: RMS(h_down_C) about 0.1, some m_k in the hundreds
    n, k = 24, 40
    m = 0.3 + torch.rand(n, generator=gen, dtype=torch.float64)
    m[:3] = 300.0 * (1 + torch.rand(3, generator=gen, dtype=torch.float64))
    h_g_C = torch.randn(k, generator=gen, dtype=torch.float64)
    h_down_C = (0.02 * torch.randn(n, k, generator=gen, dtype=torch.float64)) @ h_g_C
    g = torch.randn(n, generator=gen, dtype=torch.float64) + m * h_down_C / torch.sqrt(h_down_C.pow(2).mean() + 1e-6)
    out.append((g, m, solutions.secular_root(g, m), h_g_C, h_down_C, 1e-6))
    gen = _gen(420)                 # two exact zeros of the scale, as at layers 1, 3, 4: y_k = 0 there, divide by 1
    m = 0.3 + torch.rand(n, generator=gen, dtype=torch.float64)
    m[[2, 7]] = 0.0
    h_g_C = torch.randn(k, generator=gen, dtype=torch.float64)
    h_down_C = (5.0 * torch.randn(n, k, generator=gen, dtype=torch.float64)) @ h_g_C
    g = torch.randn(n, generator=gen, dtype=torch.float64) + m * h_down_C / torch.sqrt(h_down_C.pow(2).mean() + 1e-6)
    out.append((g, m, solutions.secular_root(g, m), h_g_C, h_down_C, 1e-6))
    return out


def check_stable_patch(fn: Callable | None) -> Checked:
    """04: ``fn(g, m, mu, h_g_C, h_down_C, eps)`` must return ``(dW_down, dm)``: a rank-1 dW_down with which the
    post-norm's input (h_down_C + dW_down h_g_C) normalises to Appendix B's minimiser y = g m / (m^2 - mu), and a dm
    with (m + dm) N(that input) = g. Any scale of h_target passes (N ignores it; the paper's has RMS(h_down_C)), and
    the note says whether yours is the paper's."""
    cases = _stable_cases()
    fn, own = _begin("stable_patch", fn, cases[0])
    worst, paper_scale = 0.0, True
    N = unit_rms
    for g, m, mu, h_g_C, h_down_C, eps in cases:
        out = _call(fn, (g, m, mu, h_g_C, h_down_C, eps), "stable_patch")
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise ExerciseError("stable_patch must return the pair (dW_down, dm)")
        dW, dm = out
        shape = (h_down_C.numel(), h_g_C.numel())
        if not isinstance(dW, torch.Tensor) or tuple(dW.shape) != shape:
            raise ExerciseError(f"dW_down must have W_down's shape {shape} (output width × MLP width): an outer product "
                                f"(h_target − h_down_C) h_g_Cᵀ / ‖h_g_C‖²; got {tuple(getattr(dW, 'shape', ()))}")
        if not isinstance(dm, torch.Tensor) or dm.shape != g.shape:
            raise ExerciseError(f"dm must be a vector of g's shape {tuple(g.shape)}")
        dW, dm = dW.double(), dm.double()
        if not torch.isfinite(dm).all():
            raise ExerciseError("Δm is not finite where N(h_target) is exactly 0 (a scale m_k = 0 makes y_k = 0): no "
                                "scale acts there, so divide by 1 (torch.where(n == 0, 1, n)), as the paper does")
        y = g * m / (m ** 2 - mu)
        new = h_down_C + dW @ h_g_C
        if float(dW.abs().max()) == 0.0:
            raise ExerciseError("ΔW_down is zero, so this is the naive scale patch again: step 3 moves the post-norm's "
                                "input to h_target = RMS(h_down_C) · y with the rank-1 ΔW_down = (h_target − h_down_C) "
                                "h_g_Cᵀ / ‖h_g_C‖², and only the remainder goes into Δm")
        s = torch.linalg.svdvals(dW)
        if float(s[1]) > 1e-9 * float(s[0]):
            raise ExerciseError(f"ΔW_down has rank > 1 (second singular value {float(s[1]):.2e}): it is one outer "
                                "product, (h_target − h_down_C) h_g_Cᵀ / ‖h_g_C‖²")
        unit = lambda t: t / t.pow(2).mean().sqrt()           # the direction, without eps (any scale of h_target)
        err_y = _rel(unit(new), y)
        if err_y > 1e-9:
            wrong = {
                "(W_down + ΔW_down) h_g_C must equal h_target: divide the outer product by ‖h_g_C‖² (h_g_C · h_g_C), "
                "not by ‖h_g_C‖.": h_down_C + (dW / h_g_C.norm()) @ h_g_C,
            }
            hint = next((h for h, t in wrong.items() if _rel(unit(t), y) < 1e-8), None)
            if hint is None and _rel(unit(new), unit(g / (m ** 2 - mu))) < 1e-8:
                hint = "the minimiser is y_k = g_k m_k / (m_k² − μ): the numerator has m_k too"
            if hint is None and _rel(unit(new), unit(g)) < 1e-8:
                hint = ("h_target must be the minimiser y = g m / (m² − μ) (scaled to RMS(h_down_C)), not g itself: "
                        "the post-norm multiplies by m afterwards")
            raise ExerciseError(hint or f"the new post-norm input does not normalise to y = g m / (m² − μ): they differ "
                                        f"by {err_y:.2e} (relative). Step 3: h_target = RMS(h_down_C) · y, then "
                                        "ΔW_down = (h_target − h_down_C) h_g_Cᵀ / ‖h_g_C‖²")
        live = y != 0           # where the construction can act: at y_k = 0 (m_k = 0) no scale reaches g_k, in exact arithmetic
        err = _rel(((m + dm) * N(new, eps))[live], g[live])
        if err > 1e-8:
            r = g - m * N(new, eps)
            hint = None
            if _rel((m + r) * N(new, eps), g) < 1e-9 or _rel(dm, r) < 1e-9:
                hint = "you returned the remainder r itself; Δm divides it by N(h_target): Δm = r ⊘ N(h_target)"
            elif _rel(dm, r / m) < 1e-9:
                hint = "divide the remainder by N(h_target), not by m: (m + Δm) ⊙ N(h_target) must equal g"
            elif _rel(dm, -mu / m) < 1e-12:
                hint = ("your Δm is −μ*/m, which is what you get with N(h_target) = y, that is without ε: N includes "
                        "Gemma's ε, N(t) = t / sqrt(mean(t²) + eps) (the eps argument), and it moves Δm_k by about "
                        "δ (m_k − μ*/m_k), δ = ε / (2 RMS(h_target)²). Compute Δm = (g − m ⊙ N(h_target)) ⊘ N(h_target) with that N")
            raise ExerciseError(hint or f"(m + Δm) ⊙ N(h_target) should equal g; they differ by {err:.2e} (relative): "
                                        "Δm = (g − m ⊙ N(h_target)) ⊘ N(h_target)")
        c0 = float(h_down_C.pow(2).mean().sqrt())
        paper_scale &= abs(float(new.pow(2).mean().sqrt()) - c0) <= 1e-8 * c0
        worst = max(worst, err, err_y)
    print(f"✓ stable_patch ({_whose(own)}): on {len(cases)} problems ΔW_down is rank 1, the post-norm's new input "
          f"normalises to Appendix B's minimiser y, and (m + Δm) ⊙ N(h_target) = g, to {worst:.1e}; "
          + ("h_target has RMS(h_down_C), as in the paper" if paper_scale else
             "yours gives h_target another size than the paper's, whose RMS is C0 = RMS(h_down_C): step 4's Δm takes "
             "up the difference, so the output is the same, but ΔW_down is another matrix"))
    return Checked("stable_patch", fn, own, {"cases": len(cases), "max_error": worst, "paper_scale": paper_scale})


# ------------------------------------------------------------------------------ 04: the naive patch in low precision
def _miss_cases() -> list:
    """(dv, m, h_hat, h_C, divide_by) in float64: h_hat = h_C + a rounding-sized difference (an absolute 1e-3, so
    relatively large where h_C is small), a few h_C far smaller than the rest, m with an exact 0 and values up to the
    hundreds, as on the real model; both divisors, none of them 0."""
    cases = []
    for seed, div in ((0, "recorded"), (1, "actual"), (2, "recorded"), (3, "actual")):
        g = _gen(70 + seed)
        n = 24
        h_C = torch.randn(n, generator=g, dtype=torch.float64)
        h_C[:4] *= 1e-5                                                    # small |h_C|: a huge dm there
        h_hat = h_C + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)
        m = 1 + 300 * torch.rand(n, generator=g, dtype=torch.float64)
        m[7] = 0.0
        dv = 10 * torch.randn(n, generator=g, dtype=torch.float64)
        cases.append((dv, m, h_hat, h_C, div))
    return cases


def _direct_miss(dv, m, h_hat, h_C, div):
    """The miss as defined: the patched output minus the target, with v = 0 (only v_C - v matters)."""
    dm = dv / (h_C if div == "recorded" else h_hat)
    return dm, (m + dm) * h_hat - (dv + m * h_C)


def _miss_wrong(m, dm, dh, div) -> dict:
    other = "actual" if div == "recorded" else "recorded"
    return {
        "the sign: the miss is the patched output minus the target, v + (m + Δm) ⊙ ĥ − (v_C + m ⊙ h_C)":
            -solutions.naive_miss(m, dm, dh, div),
        f"that is the other divisor's formula: with divide_by={div!r}, Δm ⊙ "
        f"{'h_C' if div == 'recorded' else 'ĥ'} = v_C − v; substitute that into the miss":
            solutions.naive_miss(m, dm, dh, other),
        "the scale m acts on the patched layer's ĥ too: the output is v + (m + Δm) ⊙ ĥ and the target v_C + m ⊙ h_C, "
        "so m ⊙ (ĥ − h_C) is part of the miss": dm * dh,
    }


def check_naive_miss(fn: Callable | None) -> Checked:
    """04: ``fn(m, dm, dh, divide_by)`` must return, per coordinate, the naive patch's output v + (m + dm) h_hat
    minus the target v_C + m h_C, written with m, dm and dh = h_hat - h_C alone, where dm = (v_C - v) / h_C
    ("recorded") or (v_C - v) / h_hat ("actual"). The check builds each case from v_C - v, m, h_hat and h_C, computes
    the miss as defined, and compares (to 1e-9 relative, float64): only the right simplification passes."""
    cases = _miss_cases()
    first = cases[0]
    dm0, _ = _direct_miss(*first)
    fn, own = _begin("naive_miss", fn, (first[1], dm0, first[2] - first[3], first[4]))
    worst = 0.0
    for dv, m, h_hat, h_C, div in cases:
        dm, want = _direct_miss(dv, m, h_hat, h_C, div)
        dh = h_hat - h_C
        out = _call(fn, (m, dm, dh, div), "naive_miss")
        if not isinstance(out, torch.Tensor) or out.shape != m.shape:
            raise ExerciseError(f"naive_miss must return a tensor of m's shape {tuple(m.shape)} (the miss at every "
                                f"coordinate); got {getattr(out, 'shape', type(out).__name__)}")
        err = _rel(out.double(), want)
        if not math.isfinite(err) or err > 1e-9:
            raise ExerciseError(_hint(out.double(), _miss_wrong(m, dm, dh, div), 1e-9)
                                or f"with divide_by={div!r} your miss differs from v + (m + Δm) ⊙ ĥ − (v_C + m ⊙ h_C) "
                                   f"by {err:.2e} (relative to its largest coordinate). Start from that difference, "
                                   f"write ĥ = h_C + (ĥ − h_C), and use what Δm times the divisor equals")
        worst = max(worst, err)
    print(f"✓ naive_miss ({_whose(own)}): equals the patched output minus the target for both divisors, on "
          f"{len(cases)} cases with small h_C and a zero scale (largest relative difference {worst:.1e})")
    return Checked("naive_miss", fn, own, {"cases": len(cases), "max_error": worst})


# ------------------------------------------------------------------------ 04b: the condition number of a sum
def _condition_cases() -> list:
    """(W, x) pairs as a bfloat16 layer's down projection meets them: float32 tensors, with a third of the rows
    built so that their terms nearly cancel (kappa up to about 1e5: a float32 sum is off there by a good part of
    the sum itself), a row whose sum is exactly 0, and d != f so that a transposed product cannot pass."""
    g, cases = _gen(720), []
    for d, f in ((24, 40), (48, 96)):
        W = torch.randn(d, f, generator=g, dtype=torch.float64)
        x = torch.randn(f, generator=g, dtype=torch.float64).abs() + 0.1
        W, x = W.to(torch.bfloat16).double(), x.to(torch.bfloat16).double()
        for k in range(d // 3):                       # a third of the rows: the terms nearly cancel
            last = -(W[k, :-1] @ x[:-1]) / x[-1]
            W[k, -1] = last * (1 + 1e-6)
        W[d - 1] = 0.0                                 # a row whose sum is exactly 0: two equal terms of opposite sign
        W[d - 1, 0], W[d - 1, 1], x[1] = 0.5, -0.5, x[0]
        cases.append((W.float(), x.float()))
    return cases


def check_sum_condition(fn: Callable | None) -> Checked:
    """04b: ``fn(W, x)`` must return kappa_k = sum_j |W_kj x_j| / |sum_j W_kj x_j| for each row k of the product,
    a float tensor of shape (d,): to 1e-9 relative where the sum is not 0, inf where it is exactly 0. The cases
    include rows whose terms nearly cancel (kappa up to about 1e5), where a float32 or bfloat16 sum is far off (so
    the answer must compute in float64)."""
    cases = _condition_cases()
    fn, own = _begin("sum_condition", fn, cases[0])
    worst_kappa = 0.0
    for W, x in cases:
        out = _call(fn, (W, x), "sum_condition")
        d = W.shape[0]
        if not isinstance(out, torch.Tensor) or out.shape != (d,):
            raise ExerciseError(f"sum_condition must return a tensor of shape ({d},), one kappa per row of W "
                                f"(W is {tuple(W.shape)}, x {tuple(x.shape)}); got "
                                f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        want = solutions.sum_condition(W, x)
        out_dtype, out = out.dtype, out.double()
        fin = torch.isfinite(want)
        if bool(((out[fin] - want[fin]).abs() <= 1e-9 * want[fin]).all()) and bool((out[~fin] == want[~fin]).all()):
            worst_kappa = max(worst_kappa, float(want[fin].max()))
            continue
        if out_dtype != torch.float64 and bool(((out[fin] - want[fin]).abs() <= 1e-5 * want[fin]).all()):
            raise ExerciseError(f"return float64: your kappa is {out_dtype} and agrees only to that dtype's precision, "
                                f"while the check asks for 1e-9 (compute in float64 and keep the result in float64)")
        W64, x64 = W.double(), x.double()
        s64 = W64 @ x64
        wrong = {
            "kappa is 1 on every row: take the absolute value of each term W_kj x_j before you sum, not of the sum "
            "(|sum_j W_kj x_j| / |sum_j W_kj x_j| is always 1)": torch.ones_like(want),
            "you returned 1 / kappa: the terms' size sum_j |W_kj x_j| goes on top, the sum's size |sum_j W_kj x_j| "
            "below (kappa >= 1)": s64.abs() / (W64.abs() @ x64.abs()),
            "some of your values are negative: divide by the size of the sum, |sum_j W_kj x_j|": (W64.abs() @ x64.abs()) / s64,
            "compute in float64: where the terms cancel, a float32 sum is off by a good part of the sum itself (convert "
            "W and x with .double() before the product)": ((W.abs() @ x.abs()) / (W @ x).abs()).double(),
            "compute in float64, not bfloat16: where the terms cancel, a bfloat16 sum can be off by more than the sum "
            "itself (convert W and x with .double() before the product)":
                ((W.bfloat16().abs() @ x.bfloat16().abs()) / (W.bfloat16() @ x.bfloat16()).abs()).double(),
            "each row's terms' size is divided by that row's own |sum_j W_kj x_j|, not by a size of the whole "
            "product vector (its RMS or norm)": (W64.abs() @ x64.abs()) / s64.pow(2).mean().sqrt(),
            "the terms are W_kj x_j, one per j: sum_j |W_kj| |x_j|, not (sum_j |W_kj|)(sum_j |x_j|)":
                (W64.abs().sum(1) * x64.abs().sum()) / s64.abs(),
        }
        for hint, result in wrong.items():
            r_fin = torch.isfinite(result) & fin
            if bool(r_fin.any()) and bool(((out[r_fin] - result[r_fin]).abs() <= 1e-6 * result[r_fin].abs()).all()):
                raise ExerciseError(hint)
        if not bool(fin.all()) and not bool((out[~fin] == want[~fin]).all()):
            raise ExerciseError("a row whose sum is exactly 0 has kappa = inf (terms of nonzero size, a sum of 0): "
                                "let the division give inf there, or return float('inf')")
        k = int((~((out - want).abs() <= 1e-9 * want)).logical_and(fin).nonzero()[0])
        raise ExerciseError(f"row {k}: your kappa is {float(out[k]):.6g}, sum_j |W_kj x_j| / |sum_j W_kj x_j| is "
                            f"{float(want[k]):.6g} (computed in float64)")
    print(f"✓ sum_condition ({_whose(own)}): kappa on {len(cases)} products (rows whose terms nearly cancel, kappa up "
          f"to {worst_kappa:.1e}, and a sum of exactly 0), in float64")
    return Checked("sum_condition", fn, own, {"cases": len(cases), "max_kappa": worst_kappa})


# ------------------------------------------------------------------------------------------ 04b: one bfloat16 step
def _step_cases() -> torch.Tensor:
    """Values a bfloat16 layer meets: random sizes from 1e-6 to 1e4 of both signs, exact powers of two, the float32
    numbers just below and above them (where log2 in float32 rounds), and zeros."""
    g = _gen(500)
    rand = torch.exp(torch.empty(400).uniform_(math.log(1e-6), math.log(1e4), generator=g))
    rand = rand * torch.where(torch.rand(400, generator=g) < 0.5, -1.0, 1.0)
    powers = torch.tensor([2.0 ** k for k in range(-20, 15)])
    below = torch.nextafter(powers, torch.zeros_like(powers))
    above = torch.nextafter(powers, torch.full_like(powers, math.inf))
    return torch.cat([rand, powers, -powers, below, above, torch.zeros(3)]).float()


def check_bf16_step(fn: Callable | None) -> Checked:
    """04b: ``fn(x)`` must return, for every value of the float32 tensor ``x``, the spacing of bfloat16 numbers at
    |x| (2^(e - 7) for |x| in [2^e, 2^(e+1))), and 0 where x is 0. Checked exactly (these are powers of two) on values
    from 1e-6 to 1e4, exact powers of two and the float32 numbers just below and above them."""
    x = _step_cases()
    fn, own = _begin("bf16_step", fn, (x,))
    out = _call(fn, (x.clone(),), "bf16_step")
    want = solutions.bf16_step(x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise ExerciseError(f"bf16_step must return a tensor of x's shape {tuple(x.shape)} (one step per value); got "
                            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    out = out.double()
    w = want.double()
    bad = ~((out == w) | (out.isnan() & w.isnan()))
    if bool(bad.any()):
        zero = x == 0
        if bool((bad & zero).any()):
            raise ExerciseError("at x = 0 return 0: 0 lies in no interval [2^e, 2^(e+1)) (log2(0) is -inf), and a "
                                "finite number keeps the tables that use the step readable")
        if bool((bad & (x < 0)).any()) and not bool((bad & (x > 0)).any()):
            raise ExerciseError("negative values go wrong: the step depends on |x| only (take the absolute value)")
        nz = ~zero
        ratio = out[nz] / w[nz]
        for r, hint in ((2.0, "that is twice the step: bfloat16 keeps 7 bits after the leading one (8 significant "
                              "bits), so the step at |x| in [2^e, 2^(e+1)) is 2^(e - 7), not 2^(e - 6)"),
                        (0.5, "that is half the step (the largest rounding error, or 8 bits after the leading one): "
                              "the step at |x| in [2^e, 2^(e+1)) is 2^(e - 7)"),
                        (2.0 ** -16, "that is float32's step (23 bits): bfloat16 keeps 7 bits after the leading one")):
            if bool((ratio == r).all()):
                raise ExerciseError(hint)
        below = torch.isin(x.abs(), torch.nextafter(torch.tensor([2.0 ** k for k in range(-20, 15)]),
                                                    torch.zeros(35)))
        if bool(bad[nz & ~below].logical_not().all()) and bool(bad[below].any()):
            k = int((bad & below).nonzero()[0])
            raise ExerciseError(f"wrong just below a power of two: at x = {float(x[k]):.9g} (just below "
                                f"2^{round(math.log2(abs(float(x[k]))))}) the step is {float(w[k]):.3g}, you "
                                f"return {float(out[k]):.3g}, the step of the next interval up. Such a value lies "
                                "below 2^e, so its step is 2^(e - 8); log2 in float32 rounds it up to e (and so does "
                                "rounding x to bfloat16 first). Use torch.frexp (its exponent is exact), or log2 in "
                                "float64, on x itself")
        k = int(bad.nonzero()[0])
        raise ExerciseError(f"at x = {float(x[k]):.9g} the step is {float(w[k]):.6g} = 2^{int(math.log2(float(w[k])))}"
                            f" (|x| = f 2^e with 1 <= f < 2 gives 2^(e - 7)); you return {float(out[k]):.6g}. "
                            "Is it floor(log2|x|), not round or ceil?")
    print(f"✓ bf16_step ({_whose(own)}): the bfloat16 step at all {x.numel()} values (random sizes of both signs, exact "
          f"powers of two and the float32 numbers just below and above them, zeros), exactly")
    return Checked("bf16_step", fn, own, {"values": x.numel()})


# ------------------------------------------------------------------------------- 04b: where cause 2 can fall back
_CAUSE2_FRACTIONS = [0.3, 0.99, 1.0, 1.01, 1.8, 0.5]   # targets, in bfloat16 steps of the own term


def _cause2_cases() -> tuple:
    """Own terms of many sizes (zeros among them), targets at set fractions of one bfloat16 step of the own term
    (0.3, 0.99, exactly 1, 1.01, 1.8, and of either sign), and scales with exact zeros."""
    g = _gen(404)
    n = 600
    own = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 3, (n,), generator=g)).float()
    own = own.to(torch.bfloat16).float()            # the layer's own term is a bfloat16 number
    own[::97] = 0.0
    frac = torch.tensor(_CAUSE2_FRACTIONS)[torch.randint(0, len(_CAUSE2_FRACTIONS), (n,), generator=g)]
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    target = (sign * frac * solutions.bf16_step(own)).float()
    target[own == 0] = 1e-3
    m = torch.randn(n, generator=g).float()
    m[::13] = 0.0
    return own, target, m


def check_cause2_candidates(fn: Callable | None) -> Checked:
    """04b: ``fn(own, target, m)`` must return the boolean mask of coordinates with m_k != 0 and |target_k| below one
    bfloat16 step of own_k (strictly). Checked exactly on 600 synthetic coordinates."""
    own, target, m = _cause2_cases()
    fn, own_fn = _begin("cause2_candidates", fn, (own, target, m))
    out = _call(fn, (own.clone(), target.clone(), m.clone()), "cause2_candidates")
    want = solutions.cause2_candidates(own, target, m)
    if not isinstance(out, torch.Tensor) or out.shape != own.shape:
        raise ExerciseError(f"cause2_candidates must return a mask of the inputs' shape {tuple(own.shape)}; got "
                            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
    if out.dtype != torch.bool:
        raise ExerciseError(f"return a boolean mask (a comparison, combined with &), not {out.dtype}")
    if not torch.equal(out, want):
        step = solutions.bf16_step(own)
        named = {
            "the zero scales (m_k = 0) are cause 1, not cause 2: leave them out with (m != 0)":
                target.abs() < step,
            "compare the target's size, |h_target,k|, with the step: a negative target cancels as well":
                (m != 0) & (target < step),
            "strictly below one step (use <, not <=): the two roundings, each of up to half a step, cancel a target "
            "of exactly one step only if both land on a tie at once, which almost never happens; the lesson's rule "
            "is the strict one":
                (m != 0) & (target.abs() <= step),
            "one whole step, not half of one: the own term and the correction are each rounded by up to half a step, "
            "so together they can cancel a target of up to one step": (m != 0) & (target.abs() < step / 2),
            "the step is the own term's, (W_down h_g)_k, not the target's: the sum cancels when the target is small "
            "next to the own term": (m != 0) & (target.abs() < solutions.bf16_step(target)),
        }
        hint = next((k for k, v in named.items() if torch.equal(out, v)), None)
        k = int((out != want).nonzero()[0])
        raise ExerciseError(hint or f"coordinate {k}: own = {float(own[k]):.4g} (one step {float(step[k]):.3g}), "
                                    f"target = {float(target[k]):.4g}, m = {float(m[k]):.3g}: expected "
                                    f"{bool(want[k])}, you return {bool(out[k])}. The mask is m_k != 0 and "
                                    "|target_k| < one bfloat16 step of own_k")
    print(f"✓ cause2_candidates ({_whose(own_fn)}): the expected mask on {own.numel()} cases ({int(want.sum())} of them "
          f"candidates; targets at {min(_CAUSE2_FRACTIONS)} to {max(_CAUSE2_FRACTIONS)} steps of the own term, of both "
          f"signs, and zero scales)")
    return Checked("cause2_candidates", fn, own_fn, {"cases": own.numel(), "candidates": int(want.sum()),
                                                     "target_steps": [min(_CAUSE2_FRACTIONS), max(_CAUSE2_FRACTIONS)]})


# ---------------------------------------------------------------------------------- 04b: where bfloat16 gives exact zeros
def _exact_zero_cases() -> list:
    """Stand-ins for a stable-patched bfloat16 layer: a bfloat16 W_down (rows of many sizes), a hidden h_g of
    bfloat16 values, and a target h_target that is 0 on a third of the rows (cause 1), a fraction of one bfloat16
    step of the own output on a third (cause 2 can strike) and far larger on the rest (it cannot)."""
    out = []
    for seed, (d, f) in ((510, (48, 160)), (511, (96, 320))):
        g = _gen(seed)
        W = (torch.randn(d, f, generator=g) * torch.logspace(-3, 1, d)[:, None]).to(torch.bfloat16)
        h = (torch.randn(f, generator=g) * 3.0).to(torch.bfloat16).float()
        step = solutions.bf16_step((W @ h.to(torch.bfloat16)).float())
        kind = torch.arange(d) % 3
        frac = 0.05 + 0.9 * torch.rand(d, generator=g)
        sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
        target = torch.where(kind == 0, torch.zeros(d), torch.where(kind == 1, sign * frac * step, sign * 300.0 * step))
        out.append((W, h, target))
    return out


def check_exact_zeros(fn: Callable | None) -> Checked:
    """04b: ``fn(W_down, h_g, h_target)`` must return the boolean mask (d,) of the coordinates where the layer's own
    output, W_down @ h_g computed in bfloat16 as the layer computes it, plus the correction h_target - W_down h_g,
    computed in float32 and rounded to bfloat16, is exactly 0. Checked exactly on two stand-in layers whose targets
    are 0, below one step of the own output, or far above it."""
    cases = _exact_zero_cases()
    fn, own_fn = _begin("exact_zeros", fn, cases[0])
    counts = {"zero target": [0, 0], "small target": [0, 0], "large target": [0, 0]}
    for W, h, t in cases:
        out = _call(fn, (W, h, t), "exact_zeros")
        if not isinstance(out, torch.Tensor) or out.shape != (W.shape[0],):
            raise ExerciseError(f"exact_zeros must return a mask of shape ({W.shape[0]},), one value per row of W_down; "
                                f"got {type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        if out.dtype != torch.bool:
            raise ExerciseError(f"return a boolean mask (a comparison with 0), not {out.dtype}")
        want = solutions.exact_zeros(W, h, t)
        if torch.equal(out, want):
            kind = torch.arange(W.shape[0]) % 3
            for i, name in enumerate(counts):
                counts[name][0] += int(want[kind == i].sum())
                counts[name][1] += int((kind == i).sum())
            continue
        own_bf = (W @ h.to(torch.bfloat16)).float()
        exact32 = W.float() @ h.float()
        corr32 = t - exact32
        if not out.any():
            raise ExerciseError("your mask is False on every row, even where the target is 0 and a bfloat16 layer gives "
                                "exact zeros: round the correction to bfloat16 before adding it (left in float32 it "
                                "keeps bits the own output lost, and the sum is almost never exactly 0), and check its "
                                "sign: the correction is h_target - W_down h_g")
        named = {
            "compute the layer's own output as the bfloat16 layer does, W_down @ h_g in bfloat16: in float32 the sum "
            "is the target itself, 0 exactly where the target is 0 and nowhere else":
                exact32 + corr32 == 0,
            "add the two rounded terms and compare the sum with 0; |h_target| below one step of the own output is "
            "Exercise 4's necessary condition, not the outcome":
                t.abs() < solutions.bf16_step(own_bf),
            "the sum is exactly 0 where it equals 0 (==), not where it is small: a rounding residue is not a fallback":
                (own_bf + corr32.to(torch.bfloat16).float()).abs() < 1e-3,
            "the correction is the target minus the own output, h_target - W_down h_g (then rounded), not its negative":
                own_bf + (exact32 - t).to(torch.bfloat16).float() == 0,
            "the correction subtracts the product as the engine computes it, in float32 (W_down and h_g converted "
            "first), not the layer's bfloat16 own output: the two differ by the own output's rounding, which decides "
            "whether a small target cancels":
                own_bf + (t - own_bf).to(torch.bfloat16).float() == 0,
        }
        hint = next((k for k, v in named.items() if torch.equal(out, v)), None)
        k = int((out != want).nonzero()[0])
        raise ExerciseError(hint or f"row {k}: the bfloat16 own output is {float(own_bf[k]):.6g}, the target "
                                    f"{float(t[k]):.4g}, the rounded correction "
                                    f"{float(corr32[k].to(torch.bfloat16)):.6g}; expected {bool(want[k])}, you return "
                                    f"{bool(out[k])}. Compute the own output as the layer does, W_down @ h_g in "
                                    f"bfloat16 (another summation order can differ in its last bit)")
    z, s_, l_ = (counts[k] for k in counts)
    if not (z[0] == z[1] and 0 < s_[0] < s_[1] and l_[0] == 0):   # the stand-ins must show all three regimes
        raise RuntimeError(f"check_exact_zeros' stand-in layers no longer show the three regimes: {counts}")
    print(f"✓ exact_zeros ({_whose(own_fn)}): the bfloat16 sum of the own output and the rounded correction, on 2 "
          f"stand-in layers: exactly 0 at {z[0]} of {z[1]} rows with a target of 0, {s_[0]} of {s_[1]} with a target "
          f"below one step of the own output, {l_[0]} of {l_[1]} with a larger one")
    return Checked("exact_zeros", fn, own_fn, {"cases": len(cases), "counts": counts})


# ---------------------------------------------------------------------------------------- 04b: the hard case of step 2
def _hard_cases() -> list:
    """Hard cases of Appendix B's step 2 (no root of F below min m^2): lesson 04b's five-coordinate toy, two
    coordinates tied at the smallest m^2, both with g = 0, and a width-640 scale with exact zeros, as on the embedded
    model's zero-scale layers (min m^2 = 0, mu = 0)."""
    out = [(torch.tensor([0.0, 0.05, -0.04, 0.03, 0.02], dtype=torch.float64),
            torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64))]
    g = _gen(400)
    m = 1.0 + torch.rand(12, generator=g, dtype=torch.float64)
    m[3] = m[7] = 0.75
    gv = 0.1 * torch.randn(12, generator=g, dtype=torch.float64)
    gv[3] = gv[7] = 0.0
    out.append((gv, m))
    g = _gen(401)
    m = 0.5 + 2.0 * torch.rand(640, generator=g, dtype=torch.float64)
    m[[5, 77, 300, 512]] = 0.0
    gv = 0.3 * torch.randn(640, generator=g, dtype=torch.float64)       # mean((g/m)^2) < 1: a hard case at mu = 0
    out.append((gv, m))
    return out


def check_hard_case_y(fn: Callable | None) -> Checked:
    """04b: ``fn(g, m)`` must return step 2's minimiser y in the hard case: mean(y^2) = 1, and y_k = g_k m_k /
    (m_k^2 - min m^2) on every coordinate not at the smallest m^2 (mu = min m^2). The leftover norm may be split
    over the smallest-m^2 coordinates in any way and with any signs: every such y gives the same least-squares
    objective (there g_k m_k = 0, so the objective sees only the sum of their y_k^2). The check says whether yours is
    the engine's choice (an even split, positive)."""
    cases = _hard_cases()
    fn, own = _begin("hard_case_y", fn, cases[0])
    worst, engine = 0.0, True
    for g, m in cases:
        y = _call(fn, (g, m), "hard_case_y")
        if not isinstance(y, torch.Tensor) or y.shape != g.shape:
            raise ExerciseError(f"hard_case_y must return the vector y, shape {tuple(g.shape)}; got "
                                f"{type(y).__name__} {tuple(getattr(y, 'shape', ()))}")
        if not bool(torch.isfinite(y).all()):
            at = int((~torch.isfinite(y)).nonzero()[0])
            raise ExerciseError(f"y is not finite at coordinate {at} (m_k = {float(m[at]):.3g}): at the smallest m² "
                                "the formula g_k m_k / (m_k² − μ) is 0/0 when μ = min m². Those coordinates take the "
                                "leftover norm instead")
        if y.dtype != g.dtype:
            raise ExerciseError(f"y is {y.dtype}, while g and m are {g.dtype}: compute and return y in {g.dtype} "
                                f"(float32 keeps 7 significant digits, too few for the check's 1e-9)")
        y = y.double()
        m2 = m ** 2
        at_min = m2 == m2.min()
        want_others = g * m / torch.where(at_min, torch.ones_like(m2), m2 - m2.min())
        off = (y - want_others)[~at_min].abs().max() / want_others[~at_min].abs().max()
        if float(off) > 1e-9:
            k = int(torch.where(~at_min, (y - want_others).abs(), torch.zeros_like(y)).argmax())
            raise ExerciseError(
                f"coordinate {k} (not at the smallest m²) has y_k = {float(y[k]):.6g}, not g_k m_k / (m_k² − μ) = "
                f"{float(want_others[k]):.6g} with μ = min m² = {float(m2.min()):.6g}. In the hard case F has no root "
                "below min m², so μ sits at min m² itself; the stationarity condition still fixes every coordinate "
                "away from it, and only the smallest-m² coordinates are free"
                + (" (did the leftover go to all coordinates, or to the largest m²?)"
                   if float((y[~at_min] ** 2).sum()) > float((want_others[~at_min] ** 2).sum()) + 1e-9 else ""))
        c = abs(float((y ** 2).mean()) - 1.0)
        if c > 1e-9:
            leftover = g.numel() - float((want_others[~at_min] ** 2).sum())
            raise ExerciseError(
                f"mean(y²) = {float((y ** 2).mean()):.9g}, not 1: the constraint must hold. With the other coordinates "
                f"fixed, the smallest-m² coordinates ({int(at_min.sum())} here) must carry the leftover norm, "
                f"n − Σ_others y_k² = {leftover:.6g} in all (their squares sum to it)"
                + (": did you split it without a square root?" if abs(float(y[at_min].sum()) - leftover) < 1e-9
                   else ""))
        worst = max(worst, c, float(off))
        ref = solutions.hard_case_y(g, m)
        engine = engine and bool(((y - ref).abs().max() / ref.abs().max()) <= 1e-9)
    print(f"✓ hard_case_y ({_whose(own)}): on {len(cases)} hard cases (n = {min(g.numel() for g, _ in cases)} to "
          f"{max(g.numel() for g, _ in cases)}, one with min m² = 0 as on the real model) an optimal y, mean(y²) = 1 to "
          f"{worst:.1e}; "
          + ("it is the engine's choice" if engine else
             "the leftover is split otherwise than the engine's even, positive split: equally optimal (the objective "
             "sees only the sum of their squares)"))
    return Checked("hard_case_y", fn, own, {"cases": len(cases), "sizes": [g.numel() for g, _ in cases],
                                            "max_error": worst, "engine_choice": engine})

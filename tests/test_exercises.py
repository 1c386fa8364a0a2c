"""The course's exercise checks (ctxpatch_lite.exercises): a stub is answered with the package's solution and a
note; at least two different correct answers pass each check; at least five typical wrong answers are rejected,
each with the hint that names its mistake."""
import re

import pytest
import torch

from ctxpatch_lite import exercises as ex
from ctxpatch_lite import solutions as sol

IDS = [2, 10, 20, 30, 40, 50, 11, 12, 13, 33]


def stub(*args, **kwargs):
    raise NotImplementedError  # your code here


def rejects(check, fn, *words, **kw):
    with pytest.raises(ex.ExerciseError) as info:
        check(fn, **kw)
    msg = str(info.value)
    assert all(w in msg for w in words), msg
    return msg


def accepts(check, fn, capsys, **kw):
    if getattr(fn, "__module__", None) == sol.__name__:    # the package's own function is never called the learner's;
        fn = (lambda f: lambda *a, **k: f(*a, **k))(fn)      # a learner's function that computes the same is
    c = check(fn, **kw)
    out = capsys.readouterr().out
    assert c.own and out.startswith("✓") and "(yours)" in out, out
    return c, out


@pytest.mark.parametrize("name", ["rms_norm", "input_patch", "scale_patch", "secular_root", "hard_case_y",
                                  "patched_layer", "bf16_step", "run_schedule", "cause2_candidates", "exact_zeros",
                                  "sum_condition"])
def test_a_stub_runs_the_solution_and_says_so(name, capsys):
    c = getattr(ex, f"check_{name}")(stub)
    out = capsys.readouterr().out
    assert not c.own and c.fn is getattr(sol, name) and c.report["own"] is False
    assert f"{name} is not written yet" in out and f"ctxpatch_lite.solutions.{name}" in out and "✓" in out
    assert "(the solution)" in out


@pytest.mark.parametrize("name", ["rms_norm", "input_patch", "scale_patch", "secular_root", "hard_case_y",
                                  "patched_layer", "bf16_step", "run_schedule", "cause2_candidates", "exact_zeros",
                                  "sum_condition"])
def test_a_check_run_twice_never_calls_the_solution_yours(name, capsys):
    """Running a check cell again feeds it its own result: after a stub, that is still the package's solution."""
    check = getattr(ex, f"check_{name}")
    first = check(stub)
    again = check(first)
    out = capsys.readouterr().out
    assert not again.own and again.fn is getattr(sol, name) and "(yours)" not in out
    assert not check(getattr(sol, name)).own                       # the solution imported by name, too
    assert "not yours" in capsys.readouterr().out


def test_a_check_run_twice_keeps_the_learners_own(capsys):
    def mine(x, w, eps):
        return sol.rms_norm(x, w, eps)
    first = ex.check_rms_norm(mine)
    again = ex.check_rms_norm(first)
    assert first.own and again.own and again.fn is mine


# -------------------------------------------------------------------------------------------- RMSNorm (01)
def test_rms_norm_accepts_correct_answers(capsys):
    def divide(x, w, eps):
        xf = x.double() if x.dtype == torch.float64 else x.float()
        return (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * (1 + w.to(xf.dtype))).to(x.dtype)
    accepts(ex.check_rms_norm, sol.rms_norm, capsys)
    accepts(ex.check_rms_norm, divide, capsys)

    def as_transformers(x, w, eps):                 # Gemma3RMSNorm's own arithmetic: float32 whatever the input
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)
    _, out = accepts(ex.check_rms_norm, as_transformers, capsys)
    assert "computes in float32, as transformers' class does" in out


def test_rms_norm_rejects_a_fixed_eps():
    def fixed(x, w, eps):
        return sol.rms_norm(x, w, 1e-6)
    rejects(ex.check_rms_norm, fixed, "eps is an argument")


def test_rms_norm_wrong_answers():
    def f32(fn):
        return lambda x, w, eps: fn(x.double() if x.dtype == torch.float64 else x.float(), w, eps).to(x.dtype)
    rejects(ex.check_rms_norm, f32(lambda x, w, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * w), "1 + w")
    rejects(ex.check_rms_norm, f32(lambda x, w, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * (1 + w)),
            "epsilon")
    rejects(ex.check_rms_norm, f32(lambda x, w, e: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + e) * (1 + w)),
            "mean")
    rejects(ex.check_rms_norm, f32(lambda x, w, e: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + e) * (1 + w)),
            "last axis")
    rejects(ex.check_rms_norm, f32(lambda x, w, e: torch.nn.functional.layer_norm(x, x.shape[-1:], eps=e) * (1 + w)),
            "LayerNorm")
    rejects(ex.check_rms_norm, lambda x, w, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e) * (1 + w),
            "float32")
    rejects(ex.check_rms_norm, lambda x, w, e: sol.rms_norm(x, w, e).float(), "cast back")

    def scale_in_bfloat16(x, w, e):                  # normalises in float32, but 1 + w is rounded in bfloat16
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e) * (1 + w)).to(x.dtype)
    rejects(ex.check_rms_norm, scale_in_bfloat16, "1.0 + w.float()")

    def cast_then_scale(x, w, e):                    # Llama's order: normalise in float32, cast, then scale in bfloat16
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + e)).to(x.dtype) * (1 + w)
    rejects(ex.check_rms_norm, cast_then_scale, "before casting back")


# -------------------------------------------------------------------------------------------- the block (01)
@pytest.fixture(scope="module")
def tiny():
    from ctxpatch_lite.fixtures import tiny_gemma3
    return tiny_gemma3(seed=0, dtype="float32")


def _block(fix):
    """The solution with one line changed by ``fix(name, value, parts) -> value``."""
    def fn(block, x, positions=None):
        n, eps, gelu = block.norms, block.eps, torch.nn.functional.gelu
        attn = block.attention(sol.rms_norm(x, n["input_layernorm"], eps), positions)
        v = fix("v", x + sol.rms_norm(attn, n["post_attention_layernorm"], eps), locals())
        z = fix("z", sol.rms_norm(v, n["pre_feedforward_layernorm"], eps), locals())
        h_g = fix("h_g", gelu(z @ block.W_gate.T, approximate="tanh") * (z @ block.W_up.T), locals())
        out = fix("out", v + sol.rms_norm(h_g @ block.W_down.T, n["post_feedforward_layernorm"], eps), locals())
        return v, z, h_g, out
    return fn


def test_gemma_block_accepts_correct_answers(tiny, capsys):
    def linear(block, x, positions=None):
        F, n, eps = torch.nn.functional, block.norms, block.eps
        a = sol.rms_norm(x, n["input_layernorm"], eps)
        v = x + sol.rms_norm(block.attention(a, positions), n["post_attention_layernorm"], eps)
        z = sol.rms_norm(v, n["pre_feedforward_layernorm"], eps)
        h_g = F.gelu(F.linear(z, block.W_gate), approximate="tanh") * F.linear(z, block.W_up)
        return v, z, h_g, v + sol.rms_norm(F.linear(h_g, block.W_down), n["post_feedforward_layernorm"], eps)
    c, out = accepts(ex.check_gemma_block, sol.gemma_block, capsys, model=tiny, ids=IDS)
    assert c.report["layers"] == 4 and "all 4 layers" in out
    accepts(ex.check_gemma_block, linear, capsys, model=tiny, ids=IDS)
    c = ex.check_gemma_block(stub, model=tiny, ids=IDS)
    assert not c.own and "gemma_block is not written yet" in capsys.readouterr().out


def test_gemma_block_wrong_answers(tiny):
    gelu = torch.nn.functional.gelu

    def swap(name, value):
        return _block(lambda n, v, loc: value(loc) if n == name else v)

    def norm(loc, key, x):
        return sol.rms_norm(x, loc["n"][key], loc["eps"])
    kw = dict(model=tiny, ids=IDS)
    rejects(ex.check_gemma_block, swap("v", lambda l: norm(l, "post_attention_layernorm", l["attn"])), "residual x", **kw)
    rejects(ex.check_gemma_block, swap("v", lambda l: l["x"] + l["attn"]), "post-attention norm", **kw)
    rejects(ex.check_gemma_block, swap("z", lambda l: l["v"]), "pre-feed-forward RMSNorm of v", **kw)
    rejects(ex.check_gemma_block, swap("h_g", lambda l: gelu(l["z"] @ l["block"].W_gate.T) * (l["z"] @ l["block"].W_up.T)),
            "tanh", **kw)
    rejects(ex.check_gemma_block, swap("h_g", lambda l: gelu(l["z"] @ l["block"].W_up.T, approximate="tanh")
                                       * (l["z"] @ l["block"].W_gate.T)), "gate projection", **kw)
    rejects(ex.check_gemma_block, swap("out", lambda l: l["v"] + l["h_g"] @ l["block"].W_down.T),
            "post-feed-forward norm", **kw)
    rejects(ex.check_gemma_block, swap("out", lambda l: l["x"] + norm(l, "post_feedforward_layernorm",
                                                                      l["h_g"] @ l["block"].W_down.T)),
            "not the block input x", **kw)
    rejects(ex.check_gemma_block, swap("out", lambda l: l["v"] + norm(l, "pre_feedforward_layernorm",
                                                                      l["h_g"] @ l["block"].W_down.T)),
            "post_feedforward_layernorm", **kw)
    rejects(ex.check_gemma_block, lambda b, x, p=None: sol.gemma_block(b, x, p)[:3], "(v, z, h_g, out)", **kw)
    rejects(ex.check_gemma_block, lambda b, x, p=None: sol.gemma_block(b, x, None), "pass `positions` on", **kw)
    silu = torch.nn.functional.silu
    rejects(ex.check_gemma_block, swap("h_g", lambda l: silu(l["z"] @ l["block"].W_gate.T) * (l["z"] @ l["block"].W_up.T)),
            "not SiLU", **kw)
    def down_in_h_g_slot(b, x, p=None):             # the MLP's output before its norm, where h_g belongs
        v, z, h_g, out = sol.gemma_block(b, x, p)
        return v, z, h_g @ b.W_down.T, out
    rejects(ex.check_gemma_block, down_in_h_g_slot, "That is W_down h_g", **kw)

    def reordered(b, x, p=None):
        v, z, h_g, out = sol.gemma_block(b, x, p)
        return v, h_g, z, out
    rejects(ex.check_gemma_block, reordered, "in the order (v, z, h_g, out)", **kw)


# -------------------------------------------------------------------------------------------- input patch (02)
def test_input_patch_accepts_every_correct_answer(capsys):
    _, out = accepts(ex.check_input_patch, sol.input_patch, capsys)
    assert "it is the paper's patch" in out

    def other_direction(W, z, zc):              # also exact and rank 1: W(z_C - z) a^T / (a^T z) with a != z
        a = z + 0.3 * torch.ones_like(z)
        return torch.outer(W @ (zc - z), a) / a.dot(z)
    c, out = accepts(ex.check_input_patch, other_direction, capsys)
    assert "not the paper's" in out and "smallest" in out and c.report["minimum_norm"] is False
    ratio = float(re.search(r"([0-9.]+) times the paper's", out).group(1))
    assert ratio > 1.0001                              # the message shows how much larger, not two equal-looking norms
    accepts(ex.check_input_patch, lambda W, z, zc: (W @ zc - W @ z)[:, None] * z[None, :] / (z @ z), capsys)


def test_input_patch_wrong_answers():
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (z - zc), z) / z.dot(z), "sign")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (zc - z), z) / z.norm(), "‖z‖²")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (zc - z), zc) / zc.dot(zc), "divide by z_C·z")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(z, W @ (zc - z)) / z.dot(z), "transpose")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(zc - z, z) / z.dot(z), "left factor is W(z_C − z)")
    rejects(ex.check_input_patch, lambda W, z, zc: W @ (zc - z), "W's shape")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (zc - z), z), "normalisation 1/‖z‖²")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ zc, z) / z.dot(z), "*change* W(z_C − z)")
    rejects(ex.check_input_patch, lambda W, z, zc: W + sol.input_patch(W, z, zc), "not the patched matrix")

    def rank2(W, z, zc):                        # exact on z, but with a second direction orthogonal to z
        q = torch.randn(z.shape, dtype=z.dtype, generator=torch.Generator().manual_seed(1))
        q = q - q.dot(z) / z.dot(z) * z
        return sol.input_patch(W, z, zc) + torch.outer(torch.ones(W.shape[0], dtype=W.dtype), q)
    rejects(ex.check_input_patch, rank2, "rank 2")


def test_learner_exceptions_are_named_not_hidden():
    def broken(W, z, zc):
        return W @ zc @ z          # a shape error of the learner's own
    msg = rejects(ex.check_input_patch, broken, "input_patch raised")
    assert "RuntimeError" in msg


# -------------------------------------------------------------------------------------------- scale patch (02)
def test_scale_patch_accepts_every_correct_answer(capsys):
    _, out = accepts(ex.check_scale_patch, sol.scale_patch, capsys)
    assert "divides by 1 there, as the paper does" in out
    c, out = accepts(ex.check_scale_patch, lambda v, vc, h, m: torch.where(h == 0, torch.zeros_like(h),
                                                                           (vc - v) / torch.where(h == 0, 1.0, h)),
                     capsys)                    # any finite value where h_i = 0 is right
    assert "the paper divides by 1 there" in out and c.report["divides_by_1_at_zeros"] is False


def test_scale_patch_wrong_answers():
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v) / h, "not finite", "divides by 1 there")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: sol.scale_patch(v, vc, m * h, m), "not by m ⊙ h")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: sol.scale_patch(vc, v, h, m), "sign")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: m + sol.scale_patch(v, vc, h, m), "new scale")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: sol.scale_patch(v, vc, h, m) - 1, "1 + w offset")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: sol.scale_patch(v, vc, h, m) + 1, "no +1")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v).sum(), "v's shape")


# -------------------------------------------------------------------------------------------- Algorithm 1 (03)
def test_algorithm1_accepts_correct_answers(capsys):
    def while_loop(model, ids, tools):
        targets, blocks = tools.full_context_targets(model, ids), tools.blocks(model)
        x, layer = tools.query_embedding(model, ids), 0
        while layer < len(blocks):
            x = tools.theorem1_block(blocks[layer], x, len(ids) - 1, targets[layer])
            layer += 1
        return tools.logits(model, x)
    def position_zero(model, ids, tools):          # a token alone attends to itself only: RoPE changes nothing
        targets, x = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x, 0, targets[l])
        return tools.logits(model, x)

    accepts(ex.check_algorithm1, sol.algorithm1, capsys)
    accepts(ex.check_algorithm1, while_loop, capsys)
    _, out = accepts(ex.check_algorithm1, position_zero, capsys)
    assert "changes nothing" in out

    def own_layer_function(model, ids, tools):      # the learner's own theorem1_block, not the tool: still right
        targets, x = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = sol.theorem1_block(b, x, len(ids) - 1, targets[l])[0]
        return tools.logits(model, x)
    rejects(ex.check_algorithm1, own_layer_function, "so that the check can see what each layer is fed")
    c = ex.check_algorithm1(stub)
    assert not c.own and "algorithm1 is not written yet" in capsys.readouterr().out


def test_algorithm1_with_the_learners_patch_functions(capsys):
    tools = ex.make_tools(lambda W, z, zc: torch.outer(W @ (zc - z), z + 1) / (z + 1).dot(z), sol.scale_patch)
    accepts(ex.check_algorithm1, sol.algorithm1, capsys, tools=tools)   # another exact input patch: still exact


def test_algorithm1_names_a_cast_of_the_right_logits():
    rejects(ex.check_algorithm1, lambda model, ids, tools: sol.algorithm1(model, ids, tools).float(),
            "the right ones cast to torch.float32")


def test_algorithm1_wrong_answers():
    def no_chain(model, ids, tools):
        targets, x0 = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x0, len(ids) - 1, targets[l])
        return tools.logits(model, x)

    def oracle(model, ids, tools):
        targets = tools.full_context_targets(model, ids)
        x = tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, targets[l].x_C if l else x, len(ids) - 1, targets[l])
        return tools.logits(model, x)

    def one_short(model, ids, tools):
        targets, x = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)[:-1]):
            x = tools.theorem1_block(b, x, len(ids) - 1, targets[l])
        return tools.logits(model, x)

    def unpatched_logits(model, ids, tools):
        targets, x0 = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        x = x0
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x, len(ids) - 1, targets[l])
        return tools.logits(model, x0)

    def no_patch(model, ids, tools):
        x = tools.query_embedding(model, ids)
        for b in tools.blocks(model):
            x = b(x[None], positions=torch.tensor([len(ids) - 1])).out[0]
        return tools.logits(model, x)

    def wrong_targets(model, ids, tools):
        targets, x = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x, len(ids) - 1, targets[0])
        return tools.logits(model, x)

    rejects(ex.check_algorithm1, no_chain, "query embedding again")
    rejects(ex.check_algorithm1, oracle, "oracle")
    rejects(ex.check_algorithm1, one_short, "patches every layer")
    rejects(ex.check_algorithm1, unpatched_logits, "unpatched query embedding")
    rejects(ex.check_algorithm1, no_patch, "never called")
    rejects(ex.check_algorithm1, wrong_targets, "another layer's targets")

    def query_alone_targets(model, ids, tools):
        targets, x = tools.full_context_targets(model, ids[-1:]), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x, len(ids) - 1, targets[l])
        return tools.logits(model, x)

    rejects(ex.check_algorithm1, query_alone_targets, "from the query alone hold no context")


def test_from_scratch_full_context_is_the_real_model():
    """The pieces of the loop are the real model: the from-scratch full-context logits equal transformers' up to
    its float32 RMSNorms (it computes them in float32 even for a float64 model)."""
    from ctxpatch_lite.fixtures import tiny_gemma3
    model = tiny_gemma3(seed=5, dtype="float64")
    ids = [2, 10, 20, 30, 40, 50, 11, 12, 13, 33, 44]
    ours = ex.logits(model, ex.full_context_targets(model, ids)[-1].out_C)
    theirs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    assert rel < 1e-5
    assert int(ours.argmax()) == int(theirs.argmax())


# -------------------------------------------------------------------------------------------- secular root (04)
def test_secular_root_accepts_any_method(capsys):
    def doubling_then_bisection(g, m):           # another bracket, the constraint itself as the test
        top = float((m ** 2).min())
        lo, step = top - 1.0, 1.0
        while float(((g * m / (m ** 2 - lo)) ** 2).mean()) > 1:
            step *= 2
            lo = top - step
        hi = top
        for _ in range(300):
            mid = (lo + hi) / 2
            if float(((g * m / (m ** 2 - mid)) ** 2).mean()) < 1:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2
    accepts(ex.check_secular_root, sol.secular_root, capsys)
    accepts(ex.check_secular_root, doubling_then_bisection, capsys)
    accepts(ex.check_secular_root, lambda g, m: torch.tensor(sol.secular_root(g, m), dtype=torch.float64), capsys)


def test_secular_root_wrong_answers():
    def bisect(F):
        def root(g, m):
            lo, hi = float((m ** 2).min()) - 100.0, float((m ** 2).min())
            for _ in range(200):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if F(mid, g, m) < 0 else (lo, mid)
            return lo
        return root
    rejects(ex.check_secular_root, bisect(lambda mu, g, m: float(((g * m) ** 2 / (m ** 2 - mu) ** 2).sum() - 1)),
            "*mean*")
    rejects(ex.check_secular_root, bisect(lambda mu, g, m: float(((g * m) ** 2 / (m ** 2 - mu)).mean() - 1)), "squared")

    def m_not_m2(g, m):
        lo, hi = float(m.min()) - 100.0, float(m.min())
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(((g * m / (m - mid)) ** 2).mean() - 1) < 0 else (lo, mid)
        return lo
    rejects(ex.check_secular_root, m_not_m2, "m_k²")
    rejects(ex.check_secular_root, lambda g, m: float((m ** 2).max()) + 1.0, "not below min m_k²")
    rejects(ex.check_secular_root, lambda g, m: g * m / (m ** 2 - sol.secular_root(g, m)), "is it y?")
    rejects(ex.check_secular_root, lambda g, m: sol.secular_root(g, m) - 0.01, "constraint misses")
    rejects(ex.check_secular_root, lambda g, m: torch.tensor(sol.secular_root(g, m)), "float64")

    def fixed_bracket(g, m):                         # [min m² − 10, min m²]: misses a root further left
        lo, hi = float((m ** 2).min()) - 10.0, float((m ** 2).min())
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(sol.secular(mid, g, m)) < 0 else (lo, mid)
        return lo
    rejects(ex.check_secular_root, fixed_bracket, "does your bracket reach it")


def test_gemma_block_in_bfloat16_still_names_the_exact_gelu(capsys):
    """bfloat16's tolerance (6e-2) would let the exact GELU through: the check runs the learner's block on a tiny
    float32 Gemma 3 as well."""
    from ctxpatch_lite.fixtures import tiny_gemma3
    bf = tiny_gemma3(seed=1, dtype="bfloat16")
    gelu = torch.nn.functional.gelu
    exact = _block(lambda n, v, loc: gelu(loc["z"] @ loc["block"].W_gate.T) * (loc["z"] @ loc["block"].W_up.T)
                   if n == "h_g" else v)
    _, out = accepts(ex.check_gemma_block, _block(lambda n, v, loc: v), capsys, model=bf, ids=list(range(3, 15)))
    assert "tiny float32 Gemma 3" in out
    rejects(ex.check_gemma_block, exact, "tanh", model=bf, ids=list(range(3, 15)))


def test_theorem1_block_accepts_correct_answers_and_names_mistakes(capsys):
    def by_hand(block, x, position, target):          # the paper's formulas inline, and the dm written out
        tr = block(x[None], positions=torch.tensor([position]))
        v, z = tr.v[0], tr.z[0]
        dz = target.z_C - z
        dWg, dWu = torch.outer(block.W_gate @ dz, z) / z.dot(z), torch.outer(block.W_up @ dz, z) / z.dot(z)
        y = block.W_down @ (torch.nn.functional.gelu((block.W_gate + dWg) @ z, approximate="tanh") * ((block.W_up + dWu) @ z))
        h = y / torch.sqrt(y.pow(2).mean() + block.eps)
        m = 1 + block.norms["post_feedforward_layernorm"]
        dm = (target.v_C - v) / torch.where(h == 0, 1.0, h)
        return v + (m + dm) * h, (dWg, dWu, dm)
    accepts(ex.check_theorem1_block, sol.theorem1_block, capsys)
    accepts(ex.check_theorem1_block, by_hand, capsys)
    c = ex.check_theorem1_block(stub)
    assert not c.own and "theorem1_block is not written yet" in capsys.readouterr().out

    gelu = torch.nn.functional.gelu

    def variant(**kw):
        def fn(block, x, position, target):
            tr = block(x[None], positions=torch.tensor([position]))
            v, z = tr.v[0], tr.z[0]
            a, b = (target.z_C, z) if kw.get("swap") else (z, target.z_C)
            dWg, dWu = sol.input_patch(block.W_gate, a, b), sol.input_patch(block.W_up, a, b)
            if kw.get("z_C_directly"):                 # the same numbers, but no weight patch
                dWg, dWu, z = torch.zeros_like(dWg), torch.zeros_like(dWu), target.z_C
            act = gelu if kw.get("exact") else (lambda t: gelu(t, approximate="tanh"))
            N = lambda y: y / torch.sqrt(y.pow(2).mean() + block.eps)
            h = N(block.W_down @ (act((block.W_gate + dWg) @ z) * ((block.W_up + dWu) @ z)))
            h0 = N(block.W_down @ (act(block.W_gate @ tr.z[0]) * (block.W_up @ tr.z[0])))
            m = 1 + block.norms["post_feedforward_layernorm"]
            dm = torch.zeros_like(v) if kw.get("no_scale") else sol.scale_patch(v, target.v_C, h0 if kw.get("h0") else h, m)
            out = v + (m + dm) * (h0 if kw.get("h0_throughout") else h)
            if kw.get("h0_throughout"):                 # the unpatched h in dm and in the output alike
                dm = sol.scale_patch(v, target.v_C, h0, m)
                out = v + (m + dm) * h0
            if kw.get("bias_after_norm"):
                out, dm = v + m * h + (target.v_C - v), torch.zeros_like(v)
            return out, (dWg, dWu, dm)
        return fn
    rejects(ex.check_theorem1_block, lambda b, x, p, t: b(x[None], positions=torch.tensor([p])).out[0],
            "(out, (dW_gate, dW_up, dm))")
    rejects(ex.check_theorem1_block, variant(z_C_directly=True), "the exercise is the weight patch")
    rejects(ex.check_theorem1_block, variant(no_scale=True), "add the scale patch")
    rejects(ex.check_theorem1_block, variant(bias_after_norm=True), "not v + (m + dm)")
    rejects(ex.check_theorem1_block, variant(h0=True), "*patched* MLP")
    rejects(ex.check_theorem1_block, variant(h0_throughout=True), "*unpatched* MLP's h")
    rejects(ex.check_theorem1_block, variant(swap=True), "in that order")
    rejects(ex.check_theorem1_block, variant(exact=True), "Gemma uses the tanh approximation")


def test_scale_patch_names_a_clamped_or_shifted_divisor():
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v) / torch.where(h.abs() < 1e-6, 1e-6, h),
            "tiny but not 0")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v) / torch.where(h == 0, 1.0, h + 1e-12), "epsilon")


# -------------------------------------------------------------------------------------------- stable update (04)
def _stable(**kw):
    def fn(g, m, mu, h_g_C, h_down_C, eps):
        y = g * (1 if kw.get("no_m") else m) / (m ** 2 - mu)
        if kw.get("g_itself"):
            y = g
        h_t = (1.0 if kw.get("unscaled") else h_down_C.pow(2).mean().sqrt()) * y
        denom = h_g_C.norm() if kw.get("norm_not_squared") else h_g_C.dot(h_g_C)
        dW = torch.outer(h_t - h_down_C, h_g_C) / denom
        if kw.get("zero"):
            dW = torch.zeros_like(dW)
            h_t = h_down_C
        n_t = h_t / torch.sqrt(h_t.pow(2).mean() + eps)
        r = g - m * n_t
        n_safe = n_t if kw.get("unguarded") else torch.where(n_t == 0, torch.ones_like(n_t), n_t)
        dm = r if kw.get("remainder") else r / m if kw.get("by_m") else r / n_safe
        return dW, dm
    return fn


def test_stable_patch_accepts_correct_answers(capsys):
    _, out = accepts(ex.check_stable_patch, sol.stable_patch, capsys)
    assert "as in the paper" in out
    _, out = accepts(ex.check_stable_patch, _stable(unscaled=True), capsys)     # any scale: N ignores it
    assert "another size" in out
    accepts(ex.check_stable_patch, _stable(), capsys)
    c = ex.check_stable_patch(stub)
    assert not c.own and "stable_patch is not written yet" in capsys.readouterr().out


def test_stable_patch_wrong_answers():
    rejects(ex.check_stable_patch, _stable(zero=True), "naive scale patch again")
    rejects(ex.check_stable_patch, _stable(norm_not_squared=True), "‖h_g_C‖²")
    rejects(ex.check_stable_patch, _stable(no_m=True), "numerator has m_k")
    rejects(ex.check_stable_patch, _stable(g_itself=True), "not g itself")
    rejects(ex.check_stable_patch, _stable(remainder=True), "remainder r itself")
    rejects(ex.check_stable_patch, _stable(by_m=True), "not by m")
    rejects(ex.check_stable_patch, _stable(unguarded=True), "divide by 1")
    rejects(ex.check_stable_patch, lambda g, m, mu, a, b, e: (torch.outer(a, b), g), "shape")

    def closed_form(g, m, mu, h_g_C, h_down_C, eps):  # dm = -mu*/m: exact only with eps = 0
        dW, _ = sol.stable_patch(g, m, mu, h_g_C, h_down_C, eps)
        return dW, -mu / m
    rejects(ex.check_stable_patch, closed_form, "without ε", "N includes")


def test_secular_root_accepts_a_root_to_1e9_and_asks_for_a_tighter_stop_near_it(capsys):
    def bisect(width):
        def root(g, m):
            lo, hi = float((m ** 2).min()) - float(((g * m) ** 2).mean().sqrt()) - 1.0, float((m ** 2).min())
            while hi - lo > width:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if float(sol.secular(mid, g, m)) < 0 else (lo, mid)
            return lo
        return root
    accepts(ex.check_secular_root, bisect(1e-12), capsys)
    rejects(ex.check_secular_root, bisect(1e-7), "tighten your stopping rule")

    def halvings(k):                                 # a fixed number of halvings: 30 leave the root ~1e-6 off
        def root(g, m):
            lo, hi = float((m ** 2).min()) - float(((g * m) ** 2).mean().sqrt()) - 1.0, float((m ** 2).min())
            for _ in range(k):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if float(sol.secular(mid, g, m)) < 0 else (lo, mid)
            return lo
        return root
    rejects(ex.check_secular_root, halvings(30), "tighten your stopping rule")


# ------------------------------------------------------------------------------------ naive patch's miss (04, Part B)
def test_naive_miss_accepts_every_correct_answer(capsys):
    def expanded(m, dm, dh, divide_by):                     # the same algebra, multiplied out
        return m * dh + dm * dh if divide_by == "recorded" else m * dh + 0 * dm

    def with_where(m, dm, dh, divide_by):
        return torch.where(torch.tensor(divide_by == "recorded"), (m + dm) * dh, m * dh)

    for fn in (sol.naive_miss, expanded, with_where):
        c, out = accepts(ex.check_naive_miss, fn, capsys)
        assert "for both divisors" in out and c.report["cases"] == 4
    c = ex.check_naive_miss(stub)
    assert not c.own and "naive_miss is not written yet" in capsys.readouterr().out


def test_sum_condition_accepts_every_correct_answer(capsys):
    def termwise(W, x):                                # the terms written out, then summed row by row
        terms = W.double() * x.double()
        return terms.abs().sum(1) / terms.sum(1).abs()

    def einsum(W, x):                                  # |W| |x| is |W x| term by term
        W, x = W.double(), x.double()
        return torch.einsum("kj,j->k", W.abs(), x.abs()) / torch.einsum("kj,j->k", W, x).abs()

    def rows(W, x):                                    # a loop, float('inf') set by hand where the sum is 0
        out = []
        for w in W.double():
            s = float(w @ x.double())
            out.append(float((w * x.double()).abs().sum()) / abs(s) if s != 0 else float("inf"))
        return torch.tensor(out, dtype=torch.float64)

    for fn in (sol.sum_condition, termwise, einsum, rows):
        c, out = accepts(ex.check_sum_condition, fn, capsys)
        assert c.report["cases"] == 2 and c.report["max_kappa"] > 1e4     # rows that nearly cancel are checked
    c = ex.check_sum_condition(stub)
    assert not c.own and "sum_condition is not written yet" in capsys.readouterr().out


def test_sum_condition_wrong_answers():
    d = lambda t: t.double()  # noqa: E731
    rejects(ex.check_sum_condition, lambda W, x: (d(W) @ d(x)).abs() / (d(W) @ d(x)).abs(), "kappa is 1")
    rejects(ex.check_sum_condition, lambda W, x: (d(W) @ d(x)).abs() / (d(W).abs() @ d(x).abs()), "1 / kappa")
    rejects(ex.check_sum_condition, lambda W, x: (d(W).abs() @ d(x).abs()) / (d(W) @ d(x)), "negative")
    rejects(ex.check_sum_condition, lambda W, x: (W.abs() @ x.abs()) / (W @ x).abs(), "compute in float64")
    rejects(ex.check_sum_condition, lambda W, x: ((W.bfloat16().abs() @ x.bfloat16().abs())
                                                  / (W.bfloat16() @ x.bfloat16()).abs()), "not bfloat16")
    rejects(ex.check_sum_condition, lambda W, x: (d(W).abs() @ d(x).abs()) / (d(W) @ d(x)).pow(2).mean().sqrt(),
            "that row's own")
    rejects(ex.check_sum_condition, lambda W, x: d(W).abs().sum(1) * d(x).abs().sum() / (d(W) @ d(x)).abs(),
            "one per j")
    rejects(ex.check_sum_condition, lambda W, x: torch.nan_to_num(sol.sum_condition(W, x), posinf=0.0), "inf")
    rejects(ex.check_sum_condition, lambda W, x: sol.sum_condition(W, x).sum(), "shape")
    rejects(ex.check_sum_condition, lambda W, x: sol.sum_condition(W, x).float(), "return float64")
    rejects(ex.check_sum_condition, lambda W, x: W.T.abs() @ x.abs(), "raised")


def test_naive_miss_wrong_answers():
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: -sol.naive_miss(m, dm, dh, div), "the sign")
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: (m + dm) * dh, "the other divisor's formula")      # actual wrong
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: m * dh, "the other divisor's formula")             # recorded wrong
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: dm * dh if div == "recorded" else m * dh,
            "m ⊙ (ĥ − h_C) is part of the miss")
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: dm * dh * 0 + dh, "Start from that difference")
    rejects(ex.check_naive_miss, lambda m, dm, dh, div: sol.naive_miss(m, dm, dh, div)[:-1], "m's shape")


def test_a_written_function_calling_a_stub_is_named_not_replaced():
    """In a notebook (module __main__), a written function calling a helper that is still a stub."""
    cell = {"__name__": "__main__"}
    exec("def my_norm(x, w, eps):\n    raise NotImplementedError\n\n"
         "def mine(x, w, eps):\n    return my_norm(x, w, eps) * 1.0\n", cell)
    rejects(ex.check_rms_norm, cell["mine"], "the my_norm it calls is not yet")


def test_a_decorated_stub_is_a_stub_and_a_library_error_is_the_learners(capsys):
    @torch.no_grad()
    def decorated(x, w, eps):
        raise NotImplementedError  # your code here
    assert not ex.check_rms_norm(decorated).own

    def calls_an_unimplemented_module(x, w, eps):
        return torch.nn.Module()(x)                     # torch's own NotImplementedError (no forward)
    rejects(ex.check_rms_norm, calls_an_unimplemented_module, "raised NotImplementedError")


def test_algorithm1_check_run_twice_never_calls_the_solution_yours(capsys):
    def algorithm1(model, ids, tools):
        raise NotImplementedError  # your code here
    first = ex.check_algorithm1(algorithm1)
    assert not first.own
    assert not ex.check_algorithm1(first).own and not ex.check_algorithm1(sol.algorithm1).own


def test_algorithm1_rejects_the_recorded_full_context_logits():
    def recorded(model, ids, tools):
        targets = tools.full_context_targets(model, ids)
        x = tools.query_embedding(model, ids)
        for layer, block in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(block, x, len(ids) - 1, targets[layer])
        return tools.logits(model, targets[-1].out_C)
    rejects(ex.check_algorithm1, recorded, "recorded full-context output")


# ------------------------------------------------------------------------------------------- the hard case (04b)
def test_hard_case_y_accepts_every_optimal_split(capsys):
    """The leftover norm may go to the smallest-m^2 coordinates in any split and with any signs: the objective sees
    only the sum of their squares. The check says whether a split is the engine's."""
    c, out = accepts(ex.check_hard_case_y, sol.hard_case_y, capsys)
    assert c.report["engine_choice"] and "the engine's choice" in out

    def all_on_one_negative(g, m):
        y = sol.hard_case_y(g, m)
        at_min = (m ** 2 == (m ** 2).min()).nonzero().flatten()
        y[at_min] = 0.0
        y[at_min[0]] = -(g.numel() - float((y ** 2).sum())) ** 0.5
        return y

    c, out = accepts(ex.check_hard_case_y, all_on_one_negative, capsys)
    assert not c.report["engine_choice"] and "equally optimal" in out


def test_hard_case_y_wrong_answers():
    def no_leftover(g, m):
        y = sol.hard_case_y(g, m)
        y[m ** 2 == (m ** 2).min()] = 0.0
        return y

    def leftover_without_root(g, m):
        y = no_leftover(g, m)
        at_min = m ** 2 == (m ** 2).min()
        y[at_min] = (g.numel() - float((y ** 2).sum())) / int(at_min.sum())
        return y

    def leftover_everywhere(g, m):
        y = no_leftover(g, m)
        return y * (g.numel() / float((y ** 2).sum())) ** 0.5

    def formula_everywhere(g, m):
        return g * m / (m ** 2 - (m ** 2).min())

    rejects(ex.check_hard_case_y, no_leftover, "mean(y²)", "leftover norm")
    rejects(ex.check_hard_case_y, leftover_without_root, "mean(y²)", "leftover")
    rejects(ex.check_hard_case_y, leftover_everywhere, "not g_k m_k / (m_k² − μ)", "did the leftover go")
    rejects(ex.check_hard_case_y, formula_everywhere, "not finite", "leftover norm instead")
    rejects(ex.check_hard_case_y, lambda g, m: sol.hard_case_y(g, m)[:-1], "shape")


# ------------------------------------------------------------------------------------------ patched layer (03)
def test_patched_layer_accepts_correct_answers(capsys):
    def written_otherwise(block, x, position, patches):
        dWg, dWu, dm = patches
        tr = block(x[None], positions=torch.tensor([position]))
        v, z = tr.v[0], tr.z[0]
        F = torch.nn.functional
        h_g = F.gelu(F.linear(z, block.W_gate) + dWg @ z, approximate="tanh") * (F.linear(z, block.W_up) + dWu @ z)
        y = F.linear(h_g, block.W_down)
        return v + (1.0 + block.norms["post_feedforward_layernorm"]) * (y * torch.rsqrt(y.pow(2).mean() + block.eps)) \
            + dm * y / torch.sqrt(y.pow(2).mean() + block.eps)

    c, out = accepts(ex.check_patched_layer, sol.patched_layer, capsys)
    assert c.report["other_input_miss"] > 1e-3        # patches built for x_C do not fit the query's own input
    accepts(ex.check_patched_layer, written_otherwise, capsys)


def test_patched_layer_wrong_answers():
    F = torch.nn.functional

    def variant(scale_w=False, unpatched=False, no_dm=False, residual_x=False, exact_gelu=False, no_eps=False):
        def fn(block, x, position, patches):
            dWg, dWu, dm = patches
            tr = block(x[None], positions=torch.tensor([position]))
            v, z = tr.v[0], tr.z[0]
            Wg, Wu = (block.W_gate, block.W_up) if unpatched else (block.W_gate + dWg, block.W_up + dWu)
            h_g = (F.gelu(Wg @ z) if exact_gelu else F.gelu(Wg @ z, approximate="tanh")) * (Wu @ z)
            y = block.W_down @ h_g
            h = y / torch.sqrt(y.pow(2).mean() + (0.0 if no_eps else block.eps))
            w = block.norms["post_feedforward_layernorm"]
            m = w if scale_w else 1.0 + w
            return (x if residual_x else v) + (m + (0.0 if no_dm else dm)) * h
        return fn

    rejects(ex.check_patched_layer, variant(scale_w=True), "m = 1 + w")
    rejects(ex.check_patched_layer, variant(unpatched=True), "patched matrices")
    rejects(ex.check_patched_layer, variant(no_dm=True), "dm is missing")
    rejects(ex.check_patched_layer, variant(residual_x=True), "residual is v")
    rejects(ex.check_patched_layer, variant(exact_gelu=True), "tanh")
    rejects(ex.check_patched_layer, variant(no_eps=True), "epsilon")
    rejects(ex.check_patched_layer, lambda b, x, p, patches: patches[2][:-1], "shape")


# ------------------------------------------------------------------------------------------- one bfloat16 step (04b)
def test_bf16_step_accepts_correct_answers(capsys):
    def by_log2_in_float64(x):
        e = torch.floor(torch.log2(x.double().abs()))
        return torch.where(x == 0, torch.zeros_like(x), (2.0 ** (e - 7)).float())

    accepts(ex.check_bf16_step, sol.bf16_step, capsys)
    accepts(ex.check_bf16_step, by_log2_in_float64, capsys)


def test_bf16_step_wrong_answers():
    def step(bits=7, log2_f32=False, zero=True, absolute=True, half=False):
        def fn(x):
            a = x.abs() if absolute else x
            e = torch.floor(torch.log2(a)) if log2_f32 else torch.floor(torch.log2(a.double())).float()
            out = 2.0 ** (e - bits) * (0.5 if half else 1.0)
            return torch.where(x == 0, torch.zeros_like(x), out) if zero else out
        return fn

    rejects(ex.check_bf16_step, step(log2_f32=True), "just below a power of two", "frexp")
    rejects(ex.check_bf16_step, step(bits=6), "twice the step")
    rejects(ex.check_bf16_step, step(bits=8), "half the step")
    rejects(ex.check_bf16_step, step(half=True), "half the step")
    rejects(ex.check_bf16_step, step(bits=23), "float32's step")
    accepts_zero = step(zero=False)(torch.zeros(1))          # 2^(-inf) is 0 already: no guard needed
    assert float(accepts_zero[0]) == 0.0
    rejects(ex.check_bf16_step, lambda x: torch.where(x == 0, torch.full_like(x, float("nan")), sol.bf16_step(x)),
            "at x = 0 return 0")
    rejects(ex.check_bf16_step, step(absolute=False), "negative values")
    rejects(ex.check_bf16_step, lambda x: sol.bf16_step(x)[:-1], "shape")


def test_theorem1_block_names_silu_a_residual_from_x_and_a_flipped_scale_patch():
    F = torch.nn.functional

    def variant(act=None, residual_x=False, flip=False):
        def fn(block, x, position, target):
            tr = block(x[None], positions=torch.tensor([position]))
            v, z = tr.v[0], tr.z[0]
            dWg = sol.input_patch(block.W_gate, z, target.z_C)
            dWu = sol.input_patch(block.W_up, z, target.z_C)
            a = act or (lambda t: F.gelu(t, approximate="tanh"))
            y = block.W_down @ (a((block.W_gate + dWg) @ z) * ((block.W_up + dWu) @ z))
            h = y / torch.sqrt(y.pow(2).mean() + block.eps)
            m = 1.0 + block.norms["post_feedforward_layernorm"]
            dm = sol.scale_patch(v, target.v_C, h, m) * (-1 if flip else 1)
            return (x if residual_x else v) + (m + dm) * h, (dWg, dWu, dm)
        return fn

    rejects(ex.check_theorem1_block, variant(act=F.silu), "not SiLU")
    rejects(ex.check_theorem1_block, variant(residual_x=True), "residual is v")
    rejects(ex.check_theorem1_block, variant(flip=True), "wrong sign")


def test_rms_norm_is_checked_on_a_batch_of_sequences():
    def last_two_axes(x, w, eps):                  # a mean over axis 1 passes on 2-D inputs, not on (2, 5, 24)
        xf = x.float()
        return ((1.0 + w.float()) * xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + eps)).to(x.dtype)

    rejects(ex.check_rms_norm, last_two_axes)


def test_theorem1_block_names_a_target_field_the_query_cannot_know():
    def uses_out_C(block, x, position, target):
        return target.out_C, None

    rejects(ex.check_theorem1_block, uses_out_C, "target.out_C", "only target.z_C and target.v_C")


def test_secular_root_rejects_a_bracket_that_reaches_above_min_m2():
    def to_max_m2(g, m):                            # bisection on (lo, max m^2): lands between two poles
        lo, hi = float((m ** 2).min()) - float(((g * m) ** 2).mean().sqrt()) - 1.0, float((m ** 2).max())
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if float(sol.secular(mid, g, m)) < 0 else (lo, mid)
        return lo

    rejects(ex.check_secular_root, to_max_m2, "not below min m_k²")


# ---------------------------------------------------------------------------------------- the two schedules (03)
def test_run_schedule_accepts_correct_answers(capsys):
    def indexed(model, ids, targets, ideal, tools):
        blocks, outs = tools.blocks(model), []
        x = tools.query_embedding(model, ids)
        for l in range(len(blocks)):
            patches = tools.patches(blocks[l], targets[l].x_C if ideal else x, len(ids) - 1, targets[l])
            x = tools.patched_layer(blocks[l], x, len(ids) - 1, patches)
            outs += [x]
        return outs

    c, out = accepts(ex.check_run_schedule, sol.run_schedule, capsys)
    assert c.report["selfcorrect_error"] < 1e-12 and "Algorithm 1" in out and "ideal" in out
    accepts(ex.check_run_schedule, indexed, capsys)


def _schedule(built_for=None, fed=None, last_only=False, via_theorem1=False):
    """A run_schedule written wrong in one way: ``built_for(x, t, ideal)`` and ``fed(x, t)`` pick the rows."""
    def fn(model, ids, targets, ideal, tools):
        x, p, outs = tools.query_embedding(model, ids), len(ids) - 1, []
        for l, (block, t) in enumerate(zip(tools.blocks(model), targets)):
            if via_theorem1 and not ideal:
                x = tools.theorem1_block(block, x, p, t)
            else:
                row = fed(x, t) if fed and l else x
                patches = tools.patches(block, built_for(x, t, ideal) if built_for else (t.x_C if ideal else x), p, t)
                x = tools.patched_layer(block, row, p, patches)
            outs.append(x)
        return outs[-1:] if last_only else outs
    return fn


def test_run_schedule_wrong_answers():
    rejects(ex.check_run_schedule, _schedule(built_for=lambda x, t, ideal: x), "ideal=True", "built for the row it "
            "is fed", "t.x_C")
    rejects(ex.check_run_schedule, _schedule(built_for=lambda x, t, ideal: t.x_C), "ideal=False", "recorded input "
            "x_C, as the ideal schedule does")
    rejects(ex.check_run_schedule, _schedule(fed=lambda x, t: t.x_C), "oracle schedule")
    rejects(ex.check_run_schedule, _schedule(last_only=True), "return the list")
    rejects(ex.check_run_schedule, _schedule(via_theorem1=True), "tools.theorem1_block", "only built_for differs")
    rejects(ex.check_run_schedule, lambda model, ids, targets, ideal, tools: sol.run_schedule(
        model, ids, targets[::-1], ideal, tools), "another layer")


def test_scale_patch_rejects_nan_to_num_at_the_zeros():
    """torch.nan_to_num turns x / 0 into 1.8e308: finite in float64, infinite once stored in a float32 model."""
    rejects(ex.check_scale_patch, lambda v, v_C, h, m: torch.nan_to_num((v_C - v) / h), "nan_to_num",
            "torch.where(h == 0, 1, h)")


def test_hard_case_y_names_a_float32_answer():
    rejects(ex.check_hard_case_y, lambda g, m: sol.hard_case_y(g, m).float(), "torch.float32", "torch.float64")


# ------------------------------------------------------------------------------ where cause 2 can fall back (04b)
def test_cause2_candidates_accepts_correct_answers(capsys):
    def by_frexp(own, target, m):
        e = torch.frexp(own).exponent
        step = torch.where(own == 0, torch.zeros_like(own), torch.ldexp(torch.ones_like(own), e - 8))
        return (target.abs() < step) & (m != 0)

    c, out = accepts(ex.check_cause2_candidates, sol.cause2_candidates, capsys)
    assert 0 < c.report["candidates"] < c.report["cases"]
    accepts(ex.check_cause2_candidates, by_frexp, capsys)


def test_cause2_candidates_wrong_answers():
    step = sol.bf16_step
    rejects(ex.check_cause2_candidates, lambda own, t, m: t.abs() < step(own), "m != 0")
    rejects(ex.check_cause2_candidates, lambda own, t, m: (m != 0) & (t < step(own)), "negative target")
    rejects(ex.check_cause2_candidates, lambda own, t, m: (m != 0) & (t.abs() <= step(own)), "strictly below")
    rejects(ex.check_cause2_candidates, lambda own, t, m: (m != 0) & (t.abs() < step(own) / 2), "one whole step")
    rejects(ex.check_cause2_candidates, lambda own, t, m: (m != 0) & (t.abs() < step(t)), "the own term's")
    rejects(ex.check_cause2_candidates, lambda own, t, m: ((m != 0) & (t.abs() < step(own))).float(), "boolean")


# ------------------------------------------------------------------- where the bfloat16 layer computes an exact 0 (04b)
def test_exact_zeros_accepts_correct_answers(capsys):
    def with_mv(W, h, t):
        own = torch.mv(W, h.bfloat16())
        return (own.float() + (t - torch.mv(W.float(), h)).bfloat16().float()) == 0

    c, out = accepts(ex.check_exact_zeros, sol.exact_zeros, capsys)
    assert c.report["counts"]["zero target"][0] == c.report["counts"]["zero target"][1]
    assert "0 of 48 with a larger one" in out
    accepts(ex.check_exact_zeros, with_mv, capsys)


def test_exact_zeros_wrong_answers():
    own = lambda W, h: (W @ h.bfloat16()).float()
    rejects(ex.check_exact_zeros, lambda W, h, t: own(W, h) + (t - W.float() @ h) == 0, "round the correction",
            "False on every row")
    rejects(ex.check_exact_zeros, lambda W, h, t: W.float() @ h + (t - W.float() @ h) == 0, "as the bfloat16 layer does")
    rejects(ex.check_exact_zeros, lambda W, h, t: t.abs() < sol.bf16_step(own(W, h)), "necessary condition")
    rejects(ex.check_exact_zeros, lambda W, h, t: (own(W, h) + (t - W.float() @ h).bfloat16().float()).abs() < 1e-3,
            "(==)")
    rejects(ex.check_exact_zeros, lambda W, h, t: own(W, h) + (W.float() @ h - t).bfloat16().float() == 0,
            "check its sign")
    rejects(ex.check_exact_zeros, lambda W, h, t: own(W, h) + (t - own(W, h)).bfloat16().float() == 0,
            "as the engine computes it, in float32")
    rejects(ex.check_exact_zeros, lambda W, h, t: torch.ones(W.shape[0], dtype=torch.bool), "expected False")
    rejects(ex.check_exact_zeros, lambda W, h, t: sol.exact_zeros(W, h, t).float(), "boolean")

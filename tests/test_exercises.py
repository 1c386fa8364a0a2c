"""The course's exercise checks: the reference solutions pass, and each check rejects typical wrong answers with
the hint that names the mistake (at least two per exercise, as the learner would write them)."""
import pytest
import torch

from ctxpatch_lite import exercises as ex


def rejects(check, fn, *words):
    with pytest.raises(ex.ExerciseError) as info:
        check(fn)
    msg = str(info.value)
    assert all(w in msg for w in words), msg
    return msg


def test_solutions_pass(capsys):
    ex.check_input_patch(ex.input_patch)
    ex.check_scale_patch(ex.scale_patch)
    ex.check_bisection_step(ex.bisection_step)
    ex.check_algorithm1(ex.algorithm1)
    out = capsys.readouterr().out
    assert out.count("✓") == 4 and "rank 1" in out and "divided by 1" in out


def test_input_patch_wrong_answers():
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (z - zc), z) / z.dot(z), "sign")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (zc - z), z) / z.norm(), "‖z‖²")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(W @ (zc - z), zc) / zc.dot(zc), "right factor must be z")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(z, W @ (zc - z)) / z.dot(z), "transpose")
    rejects(ex.check_input_patch, lambda W, z, zc: torch.outer(zc - z, z) / z.dot(z), "left factor is W(z_C − z)")
    rejects(ex.check_input_patch, lambda W, z, zc: W @ (zc - z), "W's shape")
    rejects(ex.check_input_patch, lambda W, z, zc: 0.5 * ex.input_patch(W, z, zc), "(W + ΔW) z should equal W z_C")


def test_scale_patch_wrong_answers():
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v) / h, "not finite", "divide by 1")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: ex.scale_patch(v, vc, m * h, m), "not by m ⊙ h")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: ex.scale_patch(vc, v, h, m), "sign")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: m + ex.scale_patch(v, vc, h, m), "new scale")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: ex.scale_patch(v, vc, h, m) - 1, "1 + w offset")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: torch.nan_to_num((vc - v) / h, posinf=0.0, neginf=0.0),
            "divides by 1" if False else "divide", "set Δm_i = 0")
    rejects(ex.check_scale_patch, lambda v, vc, h, m: (vc - v).sum(), "v's shape")


def test_bisection_step_wrong_answers():
    def swapped(lo, hi, g, m):
        mid = (lo + hi) / 2
        return (lo, mid) if ex.secular(mid, g, m) < 0 else (mid, hi)

    def summed(lo, hi, g, m):
        mid = (lo + hi) / 2
        F = float(((g * m) ** 2 / (m ** 2 - mid) ** 2).sum() - 1)
        return (mid, hi) if F < 0 else (lo, mid)

    def unsquared(lo, hi, g, m):
        mid = (lo + hi) / 2
        F = float(((g * m) ** 2 / (m ** 2 - mid)).mean() - 1)
        return (mid, hi) if F < 0 else (lo, mid)

    rejects(ex.check_bisection_step, swapped, "swapped")
    rejects(ex.check_bisection_step, summed, "1/n")
    rejects(ex.check_bisection_step, unsquared, "squared")
    rejects(ex.check_bisection_step, lambda lo, hi, g, m: (lo + hi) / 2, "pair (lo, hi)")
    rejects(ex.check_bisection_step, lambda lo, hi, g, m: ((lo + hi) / 2,) * 2, "not the midpoint twice")


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

    def position_zero(model, ids, tools):
        targets, x = tools.full_context_targets(model, ids), tools.query_embedding(model, ids)
        for l, b in enumerate(tools.blocks(model)):
            x = tools.theorem1_block(b, x, 0, targets[l])
        return tools.logits(model, x)

    def no_patch(model, ids, tools):
        x = tools.query_embedding(model, ids)
        for b in tools.blocks(model):
            x = b(x[None], positions=torch.tensor([len(ids) - 1])).out[0]
        return tools.logits(model, x)

    rejects(ex.check_algorithm1, no_chain, "query embedding again")
    rejects(ex.check_algorithm1, oracle, "oracle")
    rejects(ex.check_algorithm1, one_short, "patches every layer")
    rejects(ex.check_algorithm1, position_zero, "absolute position")
    rejects(ex.check_algorithm1, no_patch, "never called")


def test_learner_exceptions_are_named_not_hidden():
    def broken(W, z, zc):
        return W @ zc @ z          # a shape error of the learner's own
    msg = rejects(ex.check_input_patch, broken, "input_patch raised")
    assert "RuntimeError" in msg


def test_from_scratch_full_context_is_the_real_model():
    """The pieces of exercise 4 are the real model: the from-scratch full-context logits equal transformers' up to
    its float32 RMSNorms (it computes them in float32 even for a float64 model)."""
    from ctxpatch_lite.fixtures import tiny_gemma3
    model = tiny_gemma3(seed=5, dtype="float64")
    ids = [2, 10, 20, 30, 40, 50, 11, 12, 13, 33, 44]
    ours = ex.logits(model, ex.full_context_targets(model, ids)[-1].out_C)
    theirs = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    assert rel < 1e-5
    assert int(ours.argmax()) == int(theirs.argmax())

"""Appendix B: RMSNorm inversion by bisection (float64), its optimality, and the hard case."""
import pytest
import torch

from ctxpatch_lite.stable import F, invert_rmsnorm, invert_rmsnorm_unit


def objective(y, g, m):
    return float(((m * y - g) ** 2).sum())


@pytest.mark.parametrize("seed", range(8))
def test_inversion_constraint_and_optimality(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 64
    m = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64))
    g = torch.randn(n, generator=gen, dtype=torch.float64) * (0.1 + 3 * seed)
    res = invert_rmsnorm_unit(g, m)
    assert not res.hard_case
    assert res.constraint_residual <= 1e-10          # F(mu) = 0 solved before any renormalisation
    assert abs(float(F(res.mu, g, m))) <= 1e-10
    assert abs(float((res.y ** 2).mean()) - 1) <= 1e-12
    assert res.mu < float((m ** 2).min())
    best = objective(res.y, g, m)
    for _ in range(200):  # no feasible perturbation does better
        y2 = res.y + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
        y2 = y2 / (y2 ** 2).mean().sqrt()
        assert objective(y2, g, m) >= best - 1e-12


def test_target_rms_is_kept():
    gen = torch.Generator().manual_seed(0)
    g, m = torch.randn(32, generator=gen, dtype=torch.float64), 1 + torch.rand(32, generator=gen, dtype=torch.float64)
    h, _ = invert_rmsnorm(g, m, rms=7.5)
    assert abs(float(h.pow(2).mean().sqrt()) - 7.5) <= 1e-10


def test_hard_case_detected_and_handled():
    # The coordinate with the smallest m^2 has g = 0, and g is small elsewhere: F stays below 0 on (-inf, min m^2).
    m = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    g = torch.tensor([0.0, 0.05, -0.04, 0.03, 0.02], dtype=torch.float64)
    res = invert_rmsnorm_unit(g, m)
    assert res.hard_case and res.mu == pytest.approx(0.25)
    assert abs(float((res.y ** 2).mean()) - 1) <= 1e-12
    assert res.y[0] != 0  # the leftover norm went into the minimum-m^2 coordinate
    best = objective(res.y, g, m)
    gen = torch.Generator().manual_seed(1)
    for _ in range(500):
        y2 = res.y + 0.05 * torch.randn(5, generator=gen, dtype=torch.float64)
        y2 = y2 / (y2 ** 2).mean().sqrt()
        assert objective(y2, g, m) >= best - 1e-12


def test_near_hard_case_still_interior():
    m = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)
    g = torch.tensor([1e-9, 0.05, -0.04], dtype=torch.float64)
    res = invert_rmsnorm_unit(g, m)
    assert not res.hard_case and abs(float((res.y ** 2).mean()) - 1) <= 1e-10


def test_bad_inputs():
    with pytest.raises(ValueError, match="1-D"):
        invert_rmsnorm_unit(torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="non-finite"):
        invert_rmsnorm_unit(torch.tensor([float("nan"), 1.0]), torch.ones(2))


@__import__("torch").no_grad()                 # as every pass of the engine runs
def test_in_patch_dtype_reuses_one_buffer_with_the_values_of_to():
    import torch
    from ctxpatch_lite.patches import in_patch_dtype
    W = torch.randn(8, 5).bfloat16()
    a = in_patch_dtype(W, torch.float32)
    assert torch.equal(a, W.to(torch.float32))
    b = in_patch_dtype(W * 2, torch.float32)
    assert b.data_ptr() == a.data_ptr() and torch.equal(b, (W * 2).to(torch.float32))   # the same scratch, overwritten
    assert in_patch_dtype(W.float(), torch.float32).dtype == torch.float32
    assert torch.equal(in_patch_dtype(W.t(), torch.float32), W.t().float())            # a strided view: W.to


def test_in_patch_dtype_works_in_and_out_of_inference_mode():
    import torch
    from ctxpatch_lite.patches import free_scratch, in_patch_dtype
    free_scratch()
    W = torch.randn(6, 3).bfloat16()
    with torch.inference_mode():
        a = in_patch_dtype(W, torch.float32).clone()
    with torch.no_grad():
        assert torch.equal(in_patch_dtype(W, torch.float32), a)       # the buffer made in inference mode is reusable
    fresh = in_patch_dtype(W, torch.float32)                          # grad mode: a tensor of its own (W.to)
    assert torch.equal(fresh, a) and fresh.data_ptr() != in_patch_dtype(W * 1, torch.float32).data_ptr()

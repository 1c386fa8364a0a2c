import math

import pytest
import torch

from ctxpatch_lite.metrics import _counted_ranks, aggregate, average_ranks, compare_logits, format_fraction, spearman


def test_compare_identical():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    m = compare_logits(x, x.clone())
    assert m["match"] and m["linf"] == 0 and m["tvd"] == 0 and m["top1_diff"] == 0
    assert m["rank_corr"] == pytest.approx(1.0)


def test_compare_known_values():
    p = torch.tensor([2.0, 1.0, 0.0])
    q = torch.tensor([0.0, 1.0, 2.0])
    m = compare_logits(p, q)
    sp, sq = torch.softmax(p.double(), 0), torch.softmax(q.double(), 0)
    assert not m["match"] and m["baseline_token"] == 0 and m["patched_token"] == 2
    assert m["linf"] == 2.0
    assert m["tvd"] == pytest.approx(0.5 * float((sp - sq).abs().sum()))
    assert m["top1_diff"] == pytest.approx(float(sp[0] - sq[0]))
    assert m["rank_corr"] == pytest.approx(-1.0)


def test_average_ranks_ties():
    r = average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0]))
    assert r.tolist() == [2.5, 0.0, 2.5, 1.0]
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])) == pytest.approx(1.0)
    assert math.isnan(spearman(torch.ones(3), torch.tensor([1.0, 2.0, 3.0])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_counted_ranks_equal_the_sorted_ones(dtype):
    """16-bit logits are ranked by counting: the same float64 ranks as sorting their float64 values, ties, both
    zeros and both infinities included, and so the same rank correlation bit for bit."""
    g = torch.Generator().manual_seed(1)
    for scale in (0.01, 1.0, 40.0):
        x = (torch.randn(3, 4000, generator=g) * scale).to(dtype)
        x[0, :10], x[0, 10:20] = 0.0, -0.0
        x[1, :5], x[1, 5:9] = float("inf"), -float("inf")
        x[2, :300] = x[2, 300:600]                                         # many ties
        counted = _counted_ranks(x)
        assert counted.dtype == torch.float64
        assert torch.equal(counted, average_ranks(x.double()))
        y = (x.double() + torch.randn(3, 4000, generator=g, dtype=torch.float64) * scale / 10).to(dtype)
        for i in range(3):
            assert spearman(x[i], y[i]) == spearman(x[i].double(), y[i].double())
    assert _counted_ranks(torch.tensor([2.0, -1.0, 2.0, 0.5], dtype=dtype)).tolist() == [2.5, 0.0, 2.5, 1.0]
    wide = (torch.randn(2, 70000, generator=g) * 10).to(dtype)          # a vocabulary of 65,536 or more: counted
    assert torch.equal(average_ranks(wide), average_ranks(wide.double()))


def test_aggregate_counts():
    steps = [{"match": True, "linf": 1.0, "tvd": 0.1, "rank_corr": 1.0, "top1_diff": 0.0},
             {"match": False, "linf": 3.0, "tvd": 0.3, "rank_corr": 0.5, "top1_diff": 0.2}]
    a = aggregate(steps)
    assert a["n_tokens"] == 2 and a["n_match"] == 1 and a["token_match"] == 0.5
    assert a["linf_median"] == 2.0 and a["linf_max"] == 3.0
    assert format_fraction(1, 2) == "50.0% (1/2)" and aggregate([])["n_tokens"] == 0

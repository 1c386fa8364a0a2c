import math

import pytest
import torch

from ctxpatch_lite.metrics import aggregate, average_ranks, compare_logits, format_fraction, spearman


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


def test_aggregate_counts():
    steps = [{"match": True, "linf": 1.0, "tvd": 0.1, "rank_corr": 1.0, "top1_diff": 0.0},
             {"match": False, "linf": 3.0, "tvd": 0.3, "rank_corr": 0.5, "top1_diff": 0.2}]
    a = aggregate(steps)
    assert a["n_tokens"] == 2 and a["n_match"] == 1 and a["token_match"] == 0.5
    assert a["linf_median"] == 2.0 and a["linf_max"] == 3.0
    assert format_fraction(1, 2) == "50.0% (1/2)" and aggregate([])["n_tokens"] == 0

"""Shared test helpers (imported as ``helpers``: two ``conftest.py`` files, tests/ and notebooks/, cannot both be
imported by the name ``conftest``)."""
import torch

CONTEXT_IDS = [2, 10, 20, 30, 40, 50, 11, 12, 13, 33]


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(model, snap):
    now = model.state_dict()
    assert set(now) == set(snap)
    for k, v in snap.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), f"parameter {k} changed"

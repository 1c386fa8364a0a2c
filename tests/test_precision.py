"""exact_float32 across torch's two float32-precision APIs (legacy global flags, per-backend fp32_precision): inside
the block every flag reads IEEE float32 and none raises; after it every setting is back, whatever state the user
left, a mixed one included. (On torch 2.11 with CUDA the legacy-only version raised on entry after a test had set
allow_tf32: found by scripts/gpu_check.sh on an H200.)"""
import pytest
import torch

from ctxpatch_lite.hooks import _readable, exact_float32, fp32_precision_state, precision_flags


def snapshot():
    return (fp32_precision_state(), _readable(torch.get_float32_matmul_precision),
            _readable(lambda: torch.backends.cuda.matmul.allow_tf32), _readable(lambda: torch.backends.cudnn.allow_tf32))


def legacy_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True


def legacy_high():
    torch.set_float32_matmul_precision("high")


def new_api_tf32():                                   # the per-backend API only: legacy flags disagree (mixed)
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def new_api_then_legacy():
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture
def restore_torch_defaults():
    before = snapshot()
    yield
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    for path, value in before[0].items():
        from ctxpatch_lite.hooks import _node
        _node(path).fp32_precision = value
    assert snapshot() == before


@pytest.mark.parametrize("user", [None, legacy_tf32, legacy_high, new_api_tf32, new_api_then_legacy])
def test_exact_float32_strict_inside_and_restores_any_user_state(user, restore_torch_defaults):
    if user is not None:
        if user in (new_api_tf32, new_api_then_legacy) and not fp32_precision_state():
            pytest.skip("this torch has no per-backend fp32_precision API")
        user()
    before = snapshot()
    flags_before = precision_flags()                  # never raises, also in a mixed state
    with exact_float32():
        inside = precision_flags()
        assert inside["float32_matmul_precision"] == "highest"
        assert inside["cuda_matmul_allow_tf32"] is False and inside["cudnn_allow_tf32"] is False
        assert set(inside["fp32_precision"].values()) <= {"ieee"}
        assert torch.backends.cuda.matmul.allow_tf32 is False          # the legacy getter reads, no 'mixed' raise
        a = torch.randn(8, 8)
        assert torch.equal(a @ torch.eye(8), a)
    assert snapshot() == before
    assert precision_flags() == flags_before


def test_exact_float32_disabled_touches_nothing(restore_torch_defaults):
    legacy_high()
    before = snapshot()
    with exact_float32(False):
        assert snapshot() == before
    assert snapshot() == before


def test_exact_float32_restores_after_an_error(restore_torch_defaults):
    legacy_tf32()
    before = snapshot()
    with pytest.raises(KeyError):
        with exact_float32():
            raise KeyError("mid-pass")
    assert snapshot() == before

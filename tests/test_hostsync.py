"""Host transfers made by the package's own code per generated token (each one stalls a GPU): at most 5."""
import pytest
import torch

from helpers import CONTEXT_IDS
from ctxpatch_lite.algorithm import PatchConfig
from ctxpatch_lite.fixtures import tiny_gemma3
from ctxpatch_lite.hostsync import count_host_syncs
from ctxpatch_lite.protocol import run_protocol


def test_counter_sees_every_kind_of_transfer():
    t = torch.arange(3.0)
    with count_host_syncs() as c:
        t.tolist(), t.sum().item(), float(t[0]), int(t[1]), bool(t[2]), t.cpu(), t.numpy()
    assert c["total"] == 7 and c["package"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["naive", "stable"])
@pytest.mark.parametrize("batched", [False, True])
def test_at_most_five_host_transfers_per_token(dtype, variant, batched):
    model = tiny_gemma3(seed=0, dtype=dtype)
    cfg = PatchConfig(variant=variant)
    run_protocol(model, prompt_ids=CONTEXT_IDS, n_tokens=2, config=cfg, progress=False, batched=batched)  # warm-up
    n = 6
    with count_host_syncs() as c:
        run_protocol(model, prompt_ids=CONTEXT_IDS, n_tokens=n, config=cfg, progress=False, batched=batched)
    assert c["package"] / n <= 5, dict(c["by_file"])

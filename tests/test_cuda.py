"""The GPU path (run by scripts/gpu_check.sh on a machine with CUDA; skipped elsewhere): exactness, precision flags,
loop/batched agreement, bit-exact restore, PatchSet forms, host transfers, and the calls notebook 03 makes."""
import pytest
import torch

from ctxpatch_lite.algorithm import Algorithm1

from helpers import CONTEXT_IDS, assert_bit_identical, snapshot

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch")]


def tiny(dtype="float32", seed=0):
    from ctxpatch_lite.fixtures import tiny_gemma3
    return tiny_gemma3(seed=seed, dtype=dtype).to("cuda")


def run(model, n=6, batched=False, **cfg):
    from ctxpatch_lite.algorithm import PatchConfig
    from ctxpatch_lite.protocol import run_protocol
    return run_protocol(model, prompt_ids=CONTEXT_IDS, n_tokens=n, config=PatchConfig(**cfg), progress=False,
                        batched=batched)


def test_float32_exact_on_cuda_with_tf32_off_and_restored():
    torch.backends.cuda.matmul.allow_tf32 = True            # a user's setting, to be restored
    model = tiny("float32")
    r = run(model)
    assert r["summary"]["n_match"] == 6 and max(r["linf"]) <= 1e-4
    assert r["config"]["precision_flags"]["cuda_matmul_allow_tf32"] is False
    assert torch.backends.cuda.matmul.allow_tf32 is True
    torch.backends.cuda.matmul.allow_tf32 = False


def test_float64_exact_on_cuda():
    r = run(tiny("float64"), variant="stable")
    assert max(r["linf"]) <= 1e-10


def test_bfloat16_stable_on_cuda():
    r = run(tiny("bfloat16"), variant="stable")
    assert r["n_tokens"] == 6 and all(x == x for x in r["linf"]) and r["config"]["device"].startswith("cuda")


@pytest.mark.parametrize("variant", ["naive", "stable"])
def test_loop_and_batched_agree_on_cuda(variant):
    model = tiny("float32")
    loop, bat = run(model, variant=variant), run(model, variant=variant, batched=True)
    assert [s["patched_token"] for s in loop["steps"]] == [s["patched_token"] for s in bat["steps"]]
    assert max(bat["linf"]) <= 1e-3


def test_weights_restored_bit_for_bit_on_cuda():
    model = tiny("float32")
    snap = snapshot(model)
    for apply in ("factored", "materialized"):
        for variant in ("naive", "stable"):
            run(model, n=3, apply=apply, variant=variant)
            assert_bit_identical(model, snap)


def test_patchset_forms_on_cuda(tmp_path):
    import ctxpatch_lite as cp
    model = tiny("float32")
    ps = cp.absorb(model, CONTEXT_IDS)
    base = Algorithm1(model)
    full = base.full_context(CONTEXT_IDS)[0]
    q = lambda: model(torch.tensor([[CONTEXT_IDS[-1]]], device="cuda"),  # noqa: E731
                      position_ids=torch.tensor([[len(CONTEXT_IDS) - 1]], device="cuda")).logits[0, -1]
    with torch.no_grad(), ps.applied(model):
        assert float((q() - full).abs().max()) <= 1e-4
    with torch.no_grad():
        restore = ps.merge_into(model)
        assert float((q() - full).abs().max()) <= 1e-4
        restore()
    ps.save(tmp_path / "p")
    assert cp.PatchSet.load(tmp_path / "p", model=model).patches[0].dv.device.type == "cuda"


def test_host_transfers_per_token_on_cuda():
    from ctxpatch_lite.hostsync import count_host_syncs
    model = tiny("float32")
    for batched in (False, True):
        run(model, n=2, batched=batched)
        with count_host_syncs() as c:
            run(model, n=6, batched=batched)
        assert c["package"] / 6 <= 5, dict(c["by_file"])


def test_notebook_03_calls_on_cuda(tmp_path):
    from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer
    from ctxpatch_lite.views import Algorithm1View
    tiny_gemma3(seed=7).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    view = Algorithm1View()
    res = view.render("hello there", model_name=str(tmp_path), tokens=3)
    assert res["run"]["config"]["device"].startswith("cuda") and res["run"]["n_tokens"] == 3
    for dt in ("bfloat16", "float32"):
        for var in ("naive", "stable"):
            assert view.run("hello there", str(tmp_path), dt, 3, var)["n_tokens"] == 3

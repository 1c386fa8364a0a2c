"""The output head's re-viewed rows (models.standard_head_strides): the same logits bit for bit as without the
re-view, on a model loaded from a local folder in bfloat16 and float32."""
import pytest
import torch

from ctxpatch_lite.fixtures import tiny_gemma3, tiny_tokenizer
from ctxpatch_lite.models import load_model, standard_head_strides

from helpers import CONTEXT_IDS


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "gemma"
    tiny_gemma3(seed=3).save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kept_rows_give_the_same_logits(folder, dtype):
    model, _ = load_model(folder, dtype=dtype, device="cpu", progress=False)
    head = model.get_output_embeddings()
    assert getattr(head, "_ctxpatch_restride", False) and len(head._forward_pre_hooks) == 1
    assert not standard_head_strides(model)             # once per model
    ids = torch.tensor([CONTEXT_IDS])
    with torch.no_grad():
        kept = {k: model(input_ids=ids, logits_to_keep=k).logits for k in (1, 3)}
        rows = torch.randn(1, 7, head.in_features, dtype=head.weight.dtype)[:, -2:]   # a strided view, as transformers slices
        assert rows.stride()[0] == 7 * head.in_features
        restrided = head(rows)
        hooks = dict(head._forward_pre_hooks)
        head._forward_pre_hooks.clear()
        try:
            for k, logits in kept.items():
                assert torch.equal(logits, model(input_ids=ids, logits_to_keep=k).logits), k
            assert torch.equal(restrided, head(rows))
        finally:
            head._forward_pre_hooks.update(hooks)

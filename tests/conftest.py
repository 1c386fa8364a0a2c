import os

import pytest
import torch

# Steady timings on 2 cores (see shared PITFALLS): one torch thread for the test session.
torch.set_num_threads(int(os.environ.get("CTXPATCH_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny64():
    from ctxpatch_lite.fixtures import tiny_gemma3
    return tiny_gemma3(seed=0, dtype="float64")


@pytest.fixture(scope="session")
def tiny32():
    from ctxpatch_lite.fixtures import tiny_gemma3
    return tiny_gemma3(seed=0, dtype="float32")


@pytest.fixture(scope="session")
def embedded():
    """The real Gemma 3 270M (float32), from the user cache (converted on first use)."""
    from ctxpatch_lite import load_model
    return load_model(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def prompts():
    from ctxpatch_lite.prompts import load_prompts
    return load_prompts()


from helpers import CONTEXT_IDS, assert_bit_identical, snapshot  # noqa: E402,F401  (shared helpers)

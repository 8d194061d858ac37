"""Test setup: the Triton interpreter and the sm_90a CuTeDSL target on CPU-only machines, the `gpu` marker, fresh seeds per test."""
import os

import pytest

# must happen before triton is imported anywhere
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CPU compile checks target Hopper: cutlass reads the arch when it is first imported, which collecting the
    # CuTeDSL GPU test modules can do before any test module sets it (without a GPU cutlass assumes sm_100a)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


# the xdist group of the tests marked gpu_memory_heavy: --dist loadgroup sends a group to one worker, so two of them
# never hold their memory at the same time (the other workers run the rest)
MEMORY_HEAVY_GROUP = "gpu-memory-heavy"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu_memory_heavy") is not None:
            item.add_marker(pytest.mark.xdist_group(MEMORY_HEAVY_GROUP))
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """'cuda' when a GPU is present, else 'cpu' (kernels then run under the Triton interpreter)."""
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture(scope="module")
def hf_registered():
    """``attn_implementation="ffpa"`` registered with transformers for one test module (unregistered after it)."""
    from ffpa_attn.integrations import transformers as hf

    assert hf.register_ffpa_attention()
    yield hf
    hf.unregister_ffpa_attention()

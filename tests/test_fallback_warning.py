"""FFPAFallbackWarning: an implicit CUDA call with 256 < D <= 1024 that lands on SDPA says so once, with the
reason and the fix; CPU calls and head dims outside the range stay silent."""
from __future__ import annotations

import warnings

import pytest
import torch

import ffpa_attn
from ffpa_attn import fallback
from ffpa_attn.config import SDPABackend
from ffpa_attn.common import device as device_facts
from ffpa_attn.dispatch import registry
from ffpa_attn.dispatch.planner import plan as plan_call
from ffpa_attn.contract import DenseProblem


def _prob(d: int, device: str = "cuda", dropout_p: float = 0.0) -> DenseProblem:
    return DenseProblem(batch=1, hq=2, hkv=2, nq=128, nkv=128, d=d, dv=d, dtype=torch.bfloat16,
                        device=torch.device(device, 0) if device == "cuda" else torch.device(device),
                        causal=False, scale=d ** -0.5, dropout_p=dropout_p, mask_kind="none",
                        mask_requires_grad=False)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Plan for a CUDA device without one: the device check answers with the capability given."""
    monkeypatch.setattr(fallback, "_WARNED", set())

    def use(cap: tuple[int, int], cutlass: bool = True) -> None:
        monkeypatch.setattr(device_facts, "capability", lambda device: cap if device.type == "cuda" else None)
        monkeypatch.setattr(device_facts, "sm_count", lambda device: 132)
        present = registry.module_present
        monkeypatch.setattr(registry, "module_present", lambda name: cutlass if name == "cutlass" else present(name))
    return use


def test_old_gpu_warns_once_with_reason_and_fix(fake_gpu):
    fake_gpu((7, 5))
    with pytest.warns(ffpa_attn.FFPAFallbackWarning) as rec:
        plan = plan_call(_prob(512), None, None)
    assert plan.forward.backend == "sdpa"
    msgs = [str(w.message) for w in rec if issubclass(w.category, ffpa_attn.FFPAFallbackWarning)]
    assert len(msgs) == 1, msgs
    assert "head dim 512 falls back to torch SDPA" in msgs[0]
    assert "compute capability (7, 5): the Triton backend needs sm80 or newer" in msgs[0]
    assert "sm80 or newer GPU" in msgs[0]  # the fix
    assert rec[0].filename == __file__  # points at the caller, not at the package
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call with the same reason: silent
        plan_call(_prob(512), None, None)


def test_missing_triton_names_the_install_fix(fake_gpu, monkeypatch):
    fake_gpu((9, 0), cutlass=False)
    present = registry.module_present
    monkeypatch.setattr(registry, "module_present", lambda name: False if name in ("triton", "cutlass") else present(name))
    with pytest.warns(ffpa_attn.FFPAFallbackWarning, match=r"triton is not installed.*Fix: pip install"):
        plan_call(_prob(384), None, None)


def test_no_warning_on_cpu_outside_the_range_or_for_a_named_backend(fake_gpu):
    fake_gpu((7, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_call(_prob(128), None, None)  # D <= 256: SDPA is the documented path
        plan_call(_prob(512, device="cpu"), None, None)  # CPU: no fast path to lose
        plan_call(_prob(512), SDPABackend(), None)  # named: the caller chose SDPA


def test_filterable_by_category(fake_gpu):
    fake_gpu((7, 5))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=ffpa_attn.FFPAFallbackWarning)
        plan_call(_prob(640), None, None)
    assert not [w for w in rec if issubclass(w.category, ffpa_attn.FFPAFallbackWarning)]
    assert issubclass(ffpa_attn.FFPAFallbackWarning, UserWarning)


def test_fix_hints():
    assert fallback.fix_for("cutedsl: nvidia-cutlass-dsl is not installed (pip ...)") == "pip install 'ffpa-attn[cute]'"
    assert "backend='triton'" in fallback.fix_for("dropout with forward 'cutedsl' / backward 'cutedsl'")
    assert "explain" in fallback.fix_for("something else")

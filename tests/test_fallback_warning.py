"""FFPAFallbackWarning: an implicit CUDA call with 256 < D <= 1024 that lands on SDPA says so once, with the
reason and the fix; CPU calls and head dims outside the range stay silent. One class for the whole package: README's
filter line silences the transformers binding's fallbacks too."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

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
    assert fallback.fix_for("cutedsl: nvidia-cutlass-dsl is not installed (pip ...)") == \
        f"pip install '{ffpa_attn.__distribution__}[cute]'"
    assert "backend='triton'" in fallback.fix_for("dropout with forward 'cutedsl' / backward 'cutedsl'")
    assert "explain" in fallback.fix_for("something else")


def _readme_filter_line() -> str:
    """README's line that silences the fallback warnings (the test runs what users copy)."""
    readme = (Path(ffpa_attn.__file__).resolve().parents[1] / "README.md").read_text()
    m = re.search(r"`(warnings\.filterwarnings\([^`]*FFPAFallbackWarning\))`", readme)
    assert m, "README no longer shows how to silence FFPAFallbackWarning"
    return m.group(1)


def test_readme_filter_silences_the_transformers_binding(monkeypatch):
    """The binding warns with the package's class (a head dim FFPA does not cover sends a layer to SDPA):
    README's filter line silences it, and without the filter it is shown."""
    pytest.importorskip("transformers")
    from ffpa_attn.integrations import transformers as hf
    from ffpa_attn.testing import make_qkv

    assert hf.FFPAFallbackWarning is ffpa_attn.FFPAFallbackWarning

    class Layer(torch.nn.Module):  # what transformers' attention functions read from a module
        is_causal, num_key_value_groups, head_dim = True, 2, 128

    q, k, v = make_qkv(1, 4, 2, 8, 8, 128, torch.bfloat16)

    def layer_warnings(filter_line: str | None) -> list[warnings.WarningMessage]:
        monkeypatch.setattr(hf, "_FALLBACK_WARNED", set())  # once per reason: let this call warn again
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            if filter_line:
                exec(filter_line, {"warnings": warnings, "ffpa_attn": ffpa_attn})
            hf.ffpa_attention_forward(Layer(), q, k, v, None)
        return [w for w in rec if "this layer runs on" in str(w.message)]

    shown = layer_warnings(None)
    assert len(shown) == 1 and shown[0].category is ffpa_attn.FFPAFallbackWarning, shown
    assert "head_dim=128" in str(shown[0].message)
    assert layer_warnings(_readme_filter_line()) == []

"""The plan memo of the hot path (ffpa_attn.interface): a call signature seen before skips validation and planning,
anything that could change either misses, and errors are never memoized. Also: eager varlen calls pass the caller's
boundary tensors on without a copy, re-checked only when they change."""
from __future__ import annotations

import threading

import pytest
import torch

import ffpa_attn
from ffpa_attn import interface
from ffpa_attn.dispatch import planner
from ffpa_attn.testing import make_qkv


@pytest.fixture
def spy(monkeypatch):
    """Counts the validations and plans the interface makes."""
    interface.clear_plan_memo()
    counts = {"check": 0, "plan": 0}
    real_check, real_plan = interface.check_dense, interface.plan

    def check(*a, **k):
        counts["check"] += 1
        return real_check(*a, **k)

    def plan(*a, **k):
        counts["plan"] += 1
        return real_plan(*a, **k)

    monkeypatch.setattr(interface, "check_dense", check)
    monkeypatch.setattr(interface, "plan", plan)
    return counts


def _call(q, k, v, **kw):
    return ffpa_attn.ffpa_attn_func(q, k, v, **{"backend": "sdpa", **kw})


def test_repeated_signature_is_planned_once(spy):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    _call(q, k, v, is_causal=True)
    q2, k2, v2 = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)  # other tensors, same signature
    _call(q2, k2, v2, is_causal=True)
    assert spy == {"check": 1, "plan": 1}


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "requires_grad", "no_grad", "causal_type", "scale",
                                    "scale_type", "kwargs", "env", "deterministic", "invalidate", "mask"])
def test_anything_the_plan_reads_misses(spy, monkeypatch, change):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    _call(q, k, v, scale=0.5)
    kw = {"scale": 0.5}
    if change == "shape":
        q, k, v = make_qkv(1, 2, 2, 9, 9, 512, torch.bfloat16)
    elif change == "stride":
        q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16, layout="bnhd")
    elif change == "dtype":
        q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.float16)
    elif change == "requires_grad":
        q.requires_grad_(True)
    elif change == "causal_type":
        kw["is_causal"] = 1  # an int, not a bool: must raise, not hit the is_causal=True-like entry
        with pytest.raises(TypeError, match="is_causal"):
            _call(q, k, v, **kw)
        return
    elif change == "scale":
        kw["scale"] = 0.25
    elif change == "scale_type":
        kw["scale"] = torch.tensor(0.5)  # not a real number: TypeError, whatever was memoized for 0.5
        with pytest.raises(TypeError, match="scale"):
            _call(q, k, v, **kw)
        return
    elif change == "kwargs":
        kw["backend"] = ffpa_attn.SDPABackend(high_precision_grad=True)
    elif change == "env":
        monkeypatch.setenv("FFPA_ATTN_TAIL_SPLIT", "0")
    elif change == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    elif change == "invalidate":
        planner.invalidate()
    elif change == "mask":
        kw["attn_mask"] = torch.ones(8, 8, dtype=torch.bool)
    if change == "no_grad":
        q.requires_grad_(True)
        with torch.no_grad():
            _call(q, k, v, **kw)
    else:
        _call(q, k, v, **kw)
    assert spy["plan"] == 2, change


def test_errors_are_never_memoized(spy):
    q, k, v = make_qkv(1, 4, 3, 8, 8, 512, torch.bfloat16)
    for _ in range(2):
        with pytest.raises(ValueError, match="multiple of"):
            _call(q, k, v, enable_gqa=True)
    assert spy["check"] == 2


def test_explain_plans_afresh(spy):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    _call(q, k, v)
    ffpa_attn.explain(q, k, v, backend="sdpa")
    ffpa_attn.explain(q, k, v, backend="sdpa")
    assert spy["plan"] == 3


def test_bounded(spy, monkeypatch):
    monkeypatch.setattr(interface, "MEMO_SIZE", 4)
    for n in range(1, 8):
        _call(*make_qkv(1, 1, 1, n, n, 320, torch.bfloat16))
    assert len(interface._MEMO) == 4
    _call(*make_qkv(1, 1, 1, 7, 7, 320, torch.bfloat16))  # the most recent: still there
    assert spy["plan"] == 7


def test_tensor_subclass_and_compiling_skip_the_memo(monkeypatch):
    class Sub(torch.Tensor):
        pass

    q = torch.empty(1, 1, 2, 320).as_subclass(Sub)
    assert interface._memo_key((q,), {}, ()) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert interface._memo_key((torch.empty(1),), {}, ()) is None


def test_threads_get_the_same_answers():
    interface.clear_plan_memo()
    shapes = [(1, 2, 2, n, n, 512) for n in (4, 5, 6, 7)]
    inputs = [make_qkv(*s, torch.bfloat16) for s in shapes]
    want = [ffpa_attn.explain(q, k, v, backend="sdpa") for q, k, v in inputs]
    errors = []

    def run():
        try:
            for _ in range(20):
                for (q, k, v), w in zip(inputs, want):
                    _, pl, _ = interface._plan_dense(q, k, v, None, 0.0, False, None, False, {"backend": "sdpa"},
                                                     False)
                    assert pl == w
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ------------------------------------------------------------------------------- varlen boundaries, eager


def test_eager_varlen_passes_the_boundaries_on_uncopied(monkeypatch):
    from ffpa_attn import sdpa

    seen = []
    real = sdpa.varlen_forward

    def spy_fwd(q, k, v, cu_q, cu_k, *a, **kw):
        seen.append((cu_q.data_ptr(), cu_k.data_ptr()))
        return real(q, k, v, cu_q, cu_k, *a, **kw)

    monkeypatch.setattr(sdpa, "varlen_forward", spy_fwd)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 320, dtype=torch.bfloat16)
    ffpa_attn.ffpa_attn_varlen_func(q, q, q, cu, cu, 5, 5, backend="sdpa")
    assert seen == [(cu.data_ptr(), cu.data_ptr())]


def test_a_boundary_tensor_changed_in_place_is_checked_again():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 2, 320, dtype=torch.bfloat16)
    ffpa_attn.ffpa_attn_varlen_func(q, q, q, cu, cu, 5, 5, backend="sdpa")
    cu[1] = 1  # now a sequence of 7 > max_seqlen 5
    with pytest.raises(ValueError, match="max_seqlen"):
        ffpa_attn.ffpa_attn_varlen_func(q, q, q, cu, cu, 5, 5, backend="sdpa")

"""The tensor-keyed memo (ffpa_attn/common/tensor_memo.py) and the two things kept in it: the varlen boundary
check (tests/test_contract.py) and the CuTeDSL varlen work lists (here)."""
from __future__ import annotations

import gc

import pytest
import torch

from ffpa_attn.common.tensor_memo import TensorMemo
from ffpa_attn.cute import api as cute_api
from ffpa_attn.cute import ranges


def test_hit_only_for_the_same_unchanged_tensors_and_extra():
    memo = TensorMemo(4)
    a, b = torch.arange(3), torch.arange(3)
    memo.put((a, b), "x", 1)
    assert memo.get((a, b), "x") == 1
    assert memo.get((a, b), "y") is None  # other extra
    assert memo.get((a.clone(), b), "x") is None  # equal values, other object
    assert memo.get((b, a), "x") is None  # order matters
    assert memo.get((a,), "x") is None
    a.add_(1)  # in place: the version counter moves
    assert memo.get((a, b), "x", "miss") == "miss"


def test_inference_tensors_are_never_kept():
    memo = TensorMemo(4)
    with torch.inference_mode():
        t = torch.arange(3)
    memo.put((t,), 0, 1)
    assert len(memo) == 0 and memo.get((t,), 0) is None


def test_oldest_goes_first_and_dead_tensors_are_dropped():
    memo = TensorMemo(2)
    ts = [torch.arange(i + 1) for i in range(3)]
    for i, t in enumerate(ts):
        memo.put((t,), None, i)
    assert [memo.get((t,), None) for t in ts] == [None, 1, 2]
    del ts[1]
    gc.collect()
    memo.put((ts[0],), None, 0)
    assert len(memo) == 2 and memo.get((ts[0],), None) == 0 and memo.get((ts[1],), None) == 2
    with pytest.raises(ValueError, match="capacity"):
        TensorMemo(0)


def test_get_or_compute_computes_once_per_key():
    memo, calls = TensorMemo(3), []
    t = torch.zeros(2)
    for _ in range(3):
        assert memo.get_or_compute((t,), 1, lambda: calls.append(1) or len(calls)) == 1
    t[0] = 1.0
    assert memo.get_or_compute((t,), 1, lambda: calls.append(1) or len(calls)) == 2


@pytest.mark.parametrize("key_stationary", [False, True])
def test_cute_work_lists_are_reused_until_the_boundaries_change(monkeypatch, key_stationary):
    """Every layer of a step passes the same cu_seqlens: the work list is built once, and rebuilt (matching the
    new boundaries) after an in-place change."""
    monkeypatch.setattr(cute_api, "_WORK_LISTS", TensorMemo(12))
    builds = []
    real = ranges.varlen_work_items
    monkeypatch.setattr(cute_api, "varlen_work_items", lambda *a: (builds.append(a), real(*a))[1])
    cu = torch.tensor([0, 70, 75, 200], dtype=torch.int32)
    first = cute_api._work_list(cu, cu, 200, 64, 64, True, key_stationary)
    assert cute_api._work_list(cu, cu, 200, 64, 64, True, key_stationary) is first and len(builds) == 1
    assert torch.equal(first, real(cu, cu, 200, 64, 64, True, key_stationary))
    other = cute_api._work_list(cu, cu, 200, 64, 64, False, key_stationary)  # other arguments: its own list
    assert len(builds) == 2 and torch.equal(other, real(cu, cu, 200, 64, 64, False, key_stationary))
    cu[1] = 130
    again = cute_api._work_list(cu, cu, 200, 64, 64, True, key_stationary)
    assert len(builds) == 3 and torch.equal(again, real(cu, cu, 200, 64, 64, True, key_stationary))
    assert not torch.equal(again, first)

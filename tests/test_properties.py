"""Property-based tests of the public API against the fp64 reference, and a table of bad inputs.

Random (but derandomized, so CI sees the same examples every run) tiny problems: batch, GQA groups,
causal, bool / float masks with rows masked by ``-inf`` or by a finite minimum, broadcast mask shapes,
non-contiguous q/k/v, varlen batches with empty sequences, strided ``cu_seqlens`` and generous
``max_seqlen``; forward and backward. Sized to run in a few minutes on 2 CPU cores under the interpreter.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffpa_attn import ffpa_attn_bwd, ffpa_attn_func, ffpa_attn_fwd, ffpa_attn_varlen_func
from ffpa_attn.testing import (TOL, assert_close, assert_grads_close, assert_results_close, cu_seqlens,
                               func_fwd_bwd, make_qkv, make_varlen_qkv, randn, reference_fwd_bwd,
                               reference_varlen_fwd_bwd)

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [264, 300]
GRAD_TOL_FACTOR = 2.0  # gradients go through two fp16/bf16 roundings more than the output


def _layout(t: torch.Tensor, strided: bool, dim_n: int) -> torch.Tensor:
    """``t`` itself, or an equal non-contiguous view (token and head dims swapped in storage)."""
    if not strided:
        return t
    dims = list(range(t.dim()))
    dims[dim_n - 1], dims[dim_n] = dims[dim_n], dims[dim_n - 1]
    return t.permute(dims).contiguous().permute(dims)


@st.composite
def dense_problems(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2]))
    nq = draw(st.integers(1, 9))
    nkv = draw(st.integers(1, 24))
    causal = draw(st.booleans())
    if causal:
        nkv = max(nkv, nq)
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "float-min-rows"]))
    mask_shape = draw(st.sampled_from(["full", "2d", "1d", "b1"]))
    return dict(b=b, hq=hkv * group, hkv=hkv, nq=nq, nkv=nkv, causal=causal, mask_kind=mask_kind,
                mask_shape=mask_shape, d=draw(st.sampled_from(HEAD_DIMS)), dtype=draw(st.sampled_from(DTYPES)),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _mask(p, gen):
    kind = p["mask_kind"]
    if kind == "none":
        return None
    shape = {"full": (p["b"], p["hq"], p["nq"], p["nkv"]), "2d": (p["nq"], p["nkv"]), "1d": (p["nkv"],),
             "b1": (p["b"], 1, p["nq"], p["nkv"])}[p["mask_shape"]]
    if kind == "bool":
        return torch.rand(shape, generator=gen) > 0.3
    m = torch.randn(shape, generator=gen)
    if kind == "float-min-rows":
        rows = torch.rand(shape[:-1], generator=gen) < 0.4
        m[rows] = torch.finfo(torch.float32).min  # whole rows masked by a finite minimum
        m[torch.rand(shape, generator=gen) < 0.2] = float("-inf")  # and some keys by -inf
    return m


@settings(max_examples=14, **SETTINGS)
@given(dense_problems())
def test_dense_forward_backward_match_reference(p):
    gen = torch.Generator().manual_seed(p["seed"])
    dt = p["dtype"]

    q, k, v = (_layout(t, p["strided"], 2) for t in make_qkv(p["b"], p["hq"], p["hkv"], p["nq"], p["nkv"], p["d"],
                                                             dt, generator=gen))
    do = randn(p["b"], p["hq"], p["nq"], p["d"], dtype=dt, generator=gen)
    mask = _mask(p, gen)
    ref = reference_fwd_bwd(q, k, v, do, mask=mask, causal=p["causal"], mask_grad=False, dtype=torch.float64)
    got = func_fwd_bwd(q, k, v, do, attn_mask=mask, mask_grad=False, is_causal=p["causal"])
    assert_results_close(got, ref, dt, tol=GRAD_TOL_FACTOR * TOL[dt])


@st.composite
def varlen_problems(draw):
    nseq = draw(st.integers(1, 3))
    lens_q = draw(st.lists(st.integers(0, 6), min_size=nseq, max_size=nseq))
    lens_k = draw(st.lists(st.integers(0, 9), min_size=nseq, max_size=nseq))
    causal = draw(st.booleans())
    if causal:
        lens_k = [max(a, b) for a, b in zip(lens_q, lens_k)]
    hkv = draw(st.integers(1, 2))
    return dict(lens_q=lens_q, lens_k=lens_k, causal=causal, hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2])),
                d=draw(st.sampled_from(HEAD_DIMS)), dtype=draw(st.sampled_from(DTYPES)),
                strided=draw(st.booleans()), strided_cu=draw(st.booleans()), slack=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**16)))


def _cu(lens, strided):
    cu = cu_seqlens(lens)
    if strided:  # every other element of an interleaved buffer
        cu = torch.stack([cu, torch.full_like(cu, -7)], 1).reshape(-1)[::2]
        assert not cu.is_contiguous()
    return cu


@settings(max_examples=12, **SETTINGS)
@given(varlen_problems())
def test_varlen_forward_backward_match_reference(p):
    gen = torch.Generator().manual_seed(p["seed"])
    dt = p["dtype"]
    q, k, v, _, _, max_q, max_k = make_varlen_qkv(p["lens_q"], p["lens_k"], p["hq"], p["hkv"], p["d"], dt,
                                                  generator=gen)
    q, k, v = (_layout(t, p["strided"], 1) for t in (q, k, v))
    do = randn(*q.shape, dtype=dt, generator=gen)
    cu_q, cu_k = _cu(p["lens_q"], p["strided_cu"]), _cu(p["lens_k"], p["strided_cu"])
    ref = reference_varlen_fwd_bwd(q, k, v, cu_q.contiguous(), cu_k.contiguous(), do, causal=p["causal"],
                                   dtype=torch.float64)
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ffpa_attn_varlen_func(qs, ks, vs, cu_q, cu_k, max_q + p["slack"], max_k + p["slack"],
                                     causal=p["causal"], enable_gqa=p["hq"] != p["hkv"], return_lse=True)
    assert_close(out, ref.out, dt)
    fin = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(lse), fin), "rows that see no key must have lse -inf"
    assert_close(lse[fin], ref.lse[fin], torch.float32, name="lse", tol=1e-3)
    if q.shape[0]:
        out.backward(do)
        assert_grads_close((qs.grad, ks.grad, vs.grad), ref.grads, dt, tol=GRAD_TOL_FACTOR * TOL[dt])


# --------------------------------------------------------------------------------------------- bad inputs


def _dense(d=264, nq=4, nkv=8, hq=2, hkv=2):
    return make_qkv(1, hq, hkv, nq, nkv, d, torch.float16, generator=torch.Generator().manual_seed(0))


def _varlen(lens=(5, 7), d=264):
    """(q, k, v, cu_seqlens, max_seqlen) of self-attention over packed sequences of lengths ``lens``."""
    q, k, v, cu, _, m, _ = make_varlen_qkv(lens, lens, 2, 2, d, torch.float16)
    return q, k, v, cu, m


def _fwd_lse():
    q, k, v = _dense()
    out, lse = ffpa_attn_fwd(q, k, v)
    return q, k, v, out, lse


BAD_INPUTS = [
    # (id, call, exception type, argument the message must name)
    ("is_causal-int", lambda: ffpa_attn_func(*_dense(), is_causal=1), TypeError, "is_causal"),
    ("causal-int", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu, cu, m, m, causal=1))(
        *_varlen()), TypeError, "causal"),
    ("scale-str", lambda: ffpa_attn_func(*_dense(), scale="0.1"), TypeError, "scale"),
    ("scale-nan", lambda: ffpa_attn_func(*_dense(), scale=np.float32("nan")), ValueError, "scale"),
    ("scale-tensor", lambda: ffpa_attn_func(*_dense(), scale=torch.tensor(0.1)), TypeError, "scale"),
    ("softmax_scale-inf", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(
        q, k, v, cu, cu, m, m, softmax_scale=math.inf))(*_varlen()), ValueError, "softmax_scale"),
    ("dropout_p-1", lambda: ffpa_attn_func(*_dense(), dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_p-bool", lambda: ffpa_attn_func(*_dense(), dropout_p=True), TypeError, "dropout_p"),
    ("max_seqlen_q-float", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu, cu, 7.0, m))(
        *_varlen()), TypeError, "max_seqlen_q"),
    ("max_seqlen_k-negative", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu, cu, m, -1))(
        *_varlen()), ValueError, "max_seqlen_k"),
    ("max_seqlen_k-short", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu, cu, m, 3))(
        *_varlen()), ValueError, "max_seqlen_k"),
    ("cu_seqlens_q-int64", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu.long(), cu, m, m))(
        *_varlen()), TypeError, "cu_seqlens_q"),
    ("cu_seqlens_q-2d", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(
        q, k, v, cu[None], cu, m, m))(*_varlen()), ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k-start", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(q, k, v, cu, cu + 1, m, m))(
        *_varlen()), ValueError, "cu_seqlens_k"),
    ("cu_seqlens_k-decreasing", lambda: (lambda q, k, v, cu, m: ffpa_attn_varlen_func(
        q, k, v, cu, torch.tensor([0, 9, 5, 12], dtype=torch.int32), m, 9))(*_varlen((4, 4, 4))),
     ValueError, "cu_seqlens_k"),
    ("attn_mask-int", lambda: ffpa_attn_func(*_dense(), attn_mask=torch.ones(4, 8, dtype=torch.int32)),
     TypeError, "attn_mask"),
    ("attn_mask-shape", lambda: ffpa_attn_func(*_dense(), attn_mask=torch.ones(3, 8, dtype=torch.bool)),
     ValueError, "attn_mask"),
    ("query-3d", lambda: ffpa_attn_func(_dense()[0][0], *_dense()[1:]), ValueError, "query"),
    ("key-head-dim", lambda: ffpa_attn_func(_dense()[0], _dense(d=272)[1], _dense()[2]), ValueError, "key"),
    ("enable_gqa", lambda: ffpa_attn_func(*_dense(hkv=1)), ValueError, "enable_gqa"),
    ("unknown-kwarg", lambda: ffpa_attn_func(*_dense(), window_size=(1, 1)), TypeError, "window_size"),
    ("lse-dtype", lambda: (lambda q, k, v, o, lse: ffpa_attn_bwd(o, q, k, v, o, lse.double()))(*_fwd_lse()),
     TypeError, "lse"),
    ("dout-shape", lambda: (lambda q, k, v, o, lse: ffpa_attn_bwd(o[:, :1], q, k, v, o, lse))(*_fwd_lse()),
     ValueError, "dout"),
]


@pytest.mark.parametrize("call,exc,arg", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(call, exc, arg):
    with pytest.raises(exc) as info:
        call()
    assert arg in str(info.value), f"{exc.__name__} message does not name {arg!r}: {info.value}"

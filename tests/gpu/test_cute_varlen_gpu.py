"""CuTeDSL sm90a varlen (packed-sequence) forward on an H200 (skipped without CUDA / sm90 / nvidia-cutlass-dsl).

Calls :func:`ffpa_attn.cutedsl.api.run_varlen_forward` (every D the kernel compiles for) and the public varlen entry
points. Every check is per sequence against the fp32 reference, with torch SDPA's same-dtype error as the 2x
baseline. Sentinels: out / lse start as NaN with guard rows before the first and after the last sequence that must
stay NaN, and each sequence is launched alone on the full packed tensors (its neighbours' rows are the guards:
nothing outside its rows may change, even though its boxes over-read them).

    python -m pytest -q tests/gpu/test_cute_varlen_gpu.py
"""
from __future__ import annotations

import math

import pytest
import torch

from ffpa_attn.reference import attention
from ffpa_attn.testing import (assert_close, assert_grads_close, assert_lse_close, cu_seqlens, make_varlen_qkv,
                               reference_varlen_fwd_bwd, sdpa_output, sm90_with_cutedsl, unpack_sequence)

BF16, FP16 = torch.bfloat16, torch.float16
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_with_cutedsl(), reason="needs an sm90 GPU and nvidia-cutlass-dsl")]

GUARD = 7  # rows before the first and after the last sequence, never written

MIXES = {  # name: (query lengths, key lengths)
    "empty_and_one": ([0, 1, 37, 64, 130, 0, 257], [0, 1, 37, 64, 130, 0, 257]),
    "one_long_many_short": ([3000, 1, 5, 17, 63, 65, 100, 1], [3000, 1, 5, 17, 63, 65, 100, 1]),
    # Nq < Nk (a short query block reading many keys finishes after its neighbour's first block: an unbounded
    # store of its partial block would land on the neighbour's rows last)
    "cross_nq_lt_nk": ([37, 300, 1, 64, 129], [2000, 450, 77, 64, 700]),
    # Nq > Nk: causal rows before the first key get out 0, lse -inf; an empty key sequence
    "cross_nq_gt_nk": ([100, 70, 5, 200], [30, 0, 5, 190]),
}

CASES = [  # D, dtype, causal, mix, Hq, Hkv
    (264, FP16, True, "empty_and_one", 4, 4),
    (264, BF16, False, "one_long_many_short", 8, 2),
    (512, BF16, True, "cross_nq_lt_nk", 8, 2),
    (512, BF16, True, "cross_nq_gt_nk", 4, 1),
    (512, FP16, False, "empty_and_one", 8, 2),
    (512, BF16, True, "one_long_many_short", 8, 2),
    (1024, BF16, True, "cross_nq_lt_nk", 4, 2),
    (1024, FP16, False, "cross_nq_gt_nk", 4, 4),
]


def _inputs(mix: str, hq: int, hkv: int, d: int, dtype: torch.dtype):
    lens_q, lens_k = MIXES[mix]
    tq, tk = GUARD + sum(lens_q) + GUARD, GUARD + sum(lens_k) + GUARD
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(tk, hkv, d, device="cuda", dtype=dtype)
    return q, k, v, cu_seqlens(lens_q, GUARD, "cuda"), cu_seqlens(lens_k, GUARD, "cuda")


def _check_sequences(q, k, v, cu_q, cu_k, out, lse, causal, scale):
    """out / lse of every sequence against the fp32 reference (SDPA's same-dtype error as baseline)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, refs, sdpas = [], [], []
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i]:
            continue
        qs, ks, vs = (unpack_sequence(t, a, b) for t, a, b in ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]),
                                                               (v, ck[i], ck[i + 1])))
        ref, ref_lse = attention(qs, ks, vs, is_causal=causal, scale=scale)
        got, got_lse = unpack_sequence(out, cq[i], cq[i + 1]), lse[:, cq[i]:cq[i + 1]]
        assert_lse_close(got_lse, ref_lse[0], atol=2e-3, scaled=True, name=f"lse of sequence {i}")
        assert (got.float()[0][torch.isinf(ref_lse[0])] == 0).all(), f"sequence {i}: a row without keys is not 0"
        sd = sdpa_output(qs, ks, vs, causal=causal, scale=scale) if ks.shape[2] else torch.zeros_like(qs)
        outs.append(got.flatten())
        refs.append(ref.flatten())
        sdpas.append(sd.flatten())
    assert_close(torch.cat(outs), torch.cat(refs), q.dtype, "out", baseline=torch.cat(sdpas))


@pytest.mark.parametrize("d,dtype,causal,mix,hq,hkv", CASES,
                         ids=[f"D{c[0]}-{str(c[1])[6:]}-{'causal' if c[2] else 'full'}-{c[3]}-Hq{c[4]}-Hkv{c[5]}"
                              for c in CASES])
def test_varlen_forward_matches_reference_and_stays_in_bounds(d, dtype, causal, mix, hq, hkv):
    from ffpa_attn.cutedsl.api import run_varlen_forward

    torch.manual_seed(0)
    q, k, v, cu_q, cu_k = _inputs(mix, hq, hkv, d, dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    run_varlen_forward(q, k, v, cu_q, cu_k, causal, scale, out=out, lse=lse)
    torch.cuda.synchronize()
    first, last = int(cu_q[0]), int(cu_q[-1])
    assert out[:first].isnan().all() and out[last:].isnan().all(), "a row outside every sequence was written"
    assert lse[:, :first].isnan().all() and lse[:, last:].isnan().all(), "an lse outside every sequence was written"
    assert not out[first:last].isnan().any() and not lse[:, first:last].isnan().any(), "a sequence row was not written"
    _check_sequences(q, k, v, cu_q, cu_k, out, lse, causal, scale)

    # each sequence alone on the same packed tensors: only its own rows change
    cq = cu_q.tolist()
    for i in range(len(cq) - 1):
        alone_out = torch.full_like(q, float("nan"))
        alone_lse = torch.full_like(lse, float("nan"))
        run_varlen_forward(q, k, v, cu_q[i:i + 2], cu_k[i:i + 2], causal, scale, out=alone_out, lse=alone_lse)
        torch.cuda.synchronize()
        outside = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
        outside[cq[i]:cq[i + 1]] = False
        assert alone_out[outside].isnan().all(), f"sequence {i} wrote outside its rows"
        assert alone_lse[:, outside].isnan().all(), f"sequence {i} wrote lse outside its rows"
        # same kernel, same tiles: bit-identical to the batched launch
        assert torch.equal(alone_out[cq[i]:cq[i + 1]], out[cq[i]:cq[i + 1]]), f"sequence {i}: out differs alone"


def test_varlen_forward_captures_without_host_sync():
    """The call (work list on the device + one kernel launch) never synchronizes with the device: it runs under a
    CUDA graph capture (which fails on a sync), and the captured graph replays to the same result."""
    from ffpa_attn.cutedsl.api import run_varlen_forward

    q, k, v, cu_q, cu_k = _inputs("one_long_many_short", 8, 2, 512, BF16)
    scale = 1 / math.sqrt(512)
    out, lse = run_varlen_forward(q, k, v, cu_q, cu_k, True, scale)  # compile + warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    o2 = torch.full_like(out, float("nan"))
    l2 = torch.full_like(lse, float("nan"))
    with torch.cuda.graph(g):
        run_varlen_forward(q, k, v, cu_q, cu_k, True, scale, out=o2, lse=l2)
    g.replay()
    torch.cuda.synchronize()
    a, b = int(cu_q[0]), int(cu_q[-1])
    assert torch.equal(o2[a:b], out[a:b]) and torch.equal(l2[:, a:b], lse[:, a:b])


@pytest.mark.parametrize("causal", [False, True])
def test_public_varlen_routes_forward_to_cutedsl(causal):
    """ffpa_attn_varlen_func: the implicit default runs the forward and the backward on CuTeDSL at D=512 (as the
    dense call), and the gradients match the reference; backend="cutedsl" gives the same forward."""
    import ffpa_attn

    lens = [300, 1, 77, 0, 129]
    q, k, v, cu, _, _, _ = make_varlen_qkv(lens, lens, 8, 2, 512, BF16, "cuda", requires_grad=True)
    plan = ffpa_attn.explain_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, enable_gqa=True)
    assert plan.forward.backend == "cutedsl" and plan.forward.kernel == "varlen_fwd_sm90", str(plan)
    assert plan.backward.kernel == "varlen_bwd_sm90+varlen_bwd_dq_sm90", str(plan)
    out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, enable_gqa=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference_varlen_fwd_bwd(q, k, v, cu, cu, dout, causal=causal)  # (GQA: the reference expands Hkv)
    assert_close(out, ref.out, BF16, "out")
    assert_grads_close((q.grad, k.grad, v.grad), ref.grads, BF16)
    with torch.no_grad():
        o2 = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, enable_gqa=True,
                                             backend="cutedsl")
    assert torch.equal(o2, out.detach())


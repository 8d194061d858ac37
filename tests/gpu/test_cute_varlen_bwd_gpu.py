"""CuTeDSL sm90a packed-sequence (THD) backward on an H200 (skipped without CUDA / sm90 / nvidia-cutlass-dsl).

Calls :func:`ffpa_attn.cutedsl.api.run_varlen_backward` (one launch of the dK/dV kernel and one of the dQ kernel for
the whole batch) and compares dq, dk, dv of every sequence with autograd through the fp32 reference of that
sequence alone (tolerances of :mod:`ffpa_attn.testing`, with torch's same-dtype SDPA backward error of the
sequence as the 2x baseline where SDPA can run it). Sequences: empty, length 1, one longer than all others
together, lengths that are no multiple of any tile, Nq_i != Nk_i (causal tail-aligned per sequence), GQA / MQA,
max_seqlen above every length. The sentinel test puts finite garbage rows before and after the packed sequences
(inputs) and NaN there in the outputs: gradients must not change them, and the garbage must not reach a sequence.
"""
from __future__ import annotations

import math

import pytest
import torch

from ffpa_attn.reference import attention
from ffpa_attn.testing import (assert_grads_close, cu_seqlens, reference_fwd_bwd, sdpa_grad_errors, sm90_with_cutedsl,
                               unpack_sequence)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_with_cutedsl(), reason="needs an sm90 GPU and nvidia-cutlass-dsl")]

BF16, FP16 = torch.bfloat16, torch.float16


def _reference(q, k, v, do, dlse, cu_q, cu_k, causal, scale):
    """Per sequence: (:class:`AttnResult` of the sequence alone ``[1, H, n, D]``, SDPA baseline errors or None),
    from autograd through the fp32 reference (loss = <out, dO> + <lse, dlse>, lse = -inf rows excluded)."""
    res = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for a, b, c, e in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        qs, ks, vs, dos = (unpack_sequence(t, lo, hi) for t, lo, hi in ((q, a, b), (k, c, e), (v, c, e), (do, a, b)))
        dl = None if dlse is None else dlse[:, a:b].unsqueeze(0)
        ref = reference_fwd_bwd(qs, ks, vs, dos, causal=causal, scale=scale, dlse=dl)
        base = None
        if dlse is None and b > a and e > c:  # SDPA's same-dtype error (None where a row sees no key)
            base = sdpa_grad_errors(qs, ks, vs, dos, ref.grads, causal=causal, scale=scale)
        res.append((ref, base))
    return res


def _check_sequences(grads, ref, cu_q, cu_k, dtype):
    """Packed (dq, dk, dv) sequence by sequence against :func:`_reference`'s: finite, within the tolerance or 2x
    SDPA's error."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i, (r, base) in enumerate(ref):
        spans = ((cq[i], cq[i + 1]), (ck[i], ck[i + 1]), (ck[i], ck[i + 1]))
        got = [unpack_sequence(g, lo, hi) for g, (lo, hi) in zip(grads, spans)]
        names = [f"{n} of sequence {i} (rows {lo}..{hi})" for n, (lo, hi) in zip(("dq", "dk", "dv"), spans)]
        assert_grads_close(got, r.grads, dtype, names=names, baselines=base)


def _pack(pieces: list[torch.Tensor], t_total: int, fill: torch.Tensor, start: int, dim: int) -> torch.Tensor:
    """Concatenate per-sequence tensors along ``dim`` into a copy of ``fill`` from row ``start``."""
    out = fill.clone()
    if pieces:
        cat = torch.cat(pieces, dim=dim)
        out.narrow(dim, start, cat.shape[dim]).copy_(cat)
    return out


def run_case(lens_q, lens_k, hq, hkv, d, causal, dtype, with_dlse=False, max_extra=0, pad=0, seed=0):
    """Pack random sequences (``pad`` garbage rows before and after), run the CuTeDSL varlen backward with the
    reference's out / lse (the ring-attention protocol: caller out / lse / dlse), compare per sequence."""
    from ffpa_attn.cutedsl.api import run_varlen_backward

    torch.manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    scale = 1.0 / math.sqrt(d)

    def rows(t, h):  # real rows random, garbage rows finite but large (a leak would show)
        x = torch.randn(t + 2 * pad, h, d, device="cuda")
        x[:pad] *= 20
        x[pad + t:] *= 20
        return x.to(dtype)

    q, do = rows(tq, hq), rows(tq, hq)
    k, v = rows(tk, hkv), rows(tk, hkv)
    cu_q, cu_k = cu_seqlens(lens_q, pad, "cuda"), cu_seqlens(lens_k, pad, "cuda")
    dlse = torch.randn(hq, tq + 2 * pad, device="cuda") if with_dlse else None
    ref = _reference(q, k, v, do, dlse, cu_q, cu_k, causal, scale)
    # out / lse as a forward would have written them (garbage rows: finite values the kernels must not use)
    out = _pack([r.out[0].transpose(0, 1).to(dtype) for r, _ in ref], tq + 2 * pad, torch.randn_like(q) * 20, pad,
                0)
    lse = _pack([r.lse[0] for r, _ in ref], tq + 2 * pad, torch.randn(hq, tq + 2 * pad, device="cuda"), pad, 1)
    outs = None
    if pad:  # caller-given outputs: rows outside the sequences must stay NaN
        outs = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                    dv=torch.full_like(v, float("nan")))
    dq, dk, dv = run_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lens_q, default=0) + max_extra,
                                     max(lens_k, default=0) + max_extra, causal, scale, dlse=dlse, **(outs or {}))
    torch.cuda.synchronize()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    if pad:
        for name, g, t in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tk)):
            assert torch.isnan(g[:pad]).all() and torch.isnan(g[pad + t:]).all(), f"{name}: rows outside written"
    _check_sequences((dq, dk, dv), ref, cu_q, cu_k, dtype)
    return dq, dk, dv


CASES = [  # lens_q, lens_k (None = lens_q), Hq, Hkv, D, causal, dtype -- smallest first
    ([64, 100], None, 2, 2, 512, False, BF16),
    ([1, 0, 64, 129, 0, 333, 77], None, 2, 2, 512, True, BF16),           # empty, length 1, tails
    ([1000, 1, 5, 17, 3, 64, 2, 90], None, 4, 2, 512, True, FP16),       # one longer than all others, GQA 2
    ([50, 1, 128, 0, 70], [300, 65, 128, 40, 70], 8, 2, 264, True, BF16),  # causal Nq_i < Nk_i, GQA 4, D=264
    ([100, 200, 1, 7], [0, 50, 257, 7], 4, 1, 264, False, FP16),          # a sequence without keys, MQA
    ([300, 20], [200, 20], 2, 2, 512, True, BF16),                        # causal Nq > Nk: rows without keys
    ([1, 130, 0, 300], None, 2, 1, 1024, True, BF16),                     # D=1024: V / dO streamed, 4 parts
    ([190, 65, 3], [260, 64, 3], 2, 2, 576, False, FP16),                 # D=576: a part wholly past D
    ([129, 257], [257, 129], 4, 4, 384, True, FP16),
]


def _id(c):
    lq, lk, hq, hkv, d, causal, dtype = c
    return f"q{'-'.join(map(str, lq))}_k{'-'.join(map(str, lk or lq))}_H{hq}x{hkv}_D{d}_c{int(causal)}_{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_varlen_backward(case):
    lq, lk, hq, hkv, d, causal, dtype = case
    run_case(lq, lk or lq, hq, hkv, d, causal, dtype)


@pytest.mark.parametrize("d", [512, 1024])
def test_varlen_backward_sentinels_dlse_and_large_max_seqlen(d):
    """Garbage rows around the packed batch, caller dlse (ring attention), max_seqlen 100 above every length."""
    run_case([33, 0, 200, 1], [70, 5, 200, 64], 4, 2, d, True, BF16, with_dlse=True, max_extra=100, pad=37)


def test_varlen_backward_deterministic():
    """dk / dv are reduced over the GQA group inside one CTA, dq written once: two calls are bitwise equal."""
    args = ([300, 1, 77], [400, 9, 77], 8, 2, 512, True, BF16)
    g1 = run_case(*args, seed=3)
    g2 = run_case(*args, seed=3)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_varlen_backward_matches_dense():
    """One sequence of a dense shape: the varlen kernels give the dense kernels' gradients (same math and order)."""
    from ffpa_attn.cutedsl.api import run_backward, run_varlen_backward

    torch.manual_seed(5)
    nq, nk, hq, hkv, d = 200, 333, 4, 2, 512
    q, do = (torch.randn(1, hq, nq, d, device="cuda", dtype=BF16) for _ in range(2))
    k, v = (torch.randn(1, hkv, nk, d, device="cuda", dtype=BF16) for _ in range(2))
    out, lse = attention(q, k, v, is_causal=True, scale=0.05)
    out = out.to(BF16)
    dense = run_backward(do, q, k, v, out, lse, True, 0.05)
    packed = (t[0].transpose(0, 1).contiguous() for t in (do, q, k, v, out))
    cu_q, cu_k = cu_seqlens([nq], device="cuda"), cu_seqlens([nk], device="cuda")
    var = run_varlen_backward(*packed, lse[0].contiguous(), cu_q, cu_k, nq, nk, True, 0.05)
    for a, b in zip(dense, var):
        assert torch.equal(a[0].transpose(0, 1), b)


@pytest.mark.parametrize("backend", ["cutedsl", None], ids=["named", "default"])
def test_varlen_func_autograd(backend):
    """The user path: ffpa_attn_varlen_func forward + autograd backward (CuTeDSL varlen forward and backward, by
    name and by the implicit default), gradients per sequence against the fp32 reference."""
    import ffpa_attn

    torch.manual_seed(11)
    lens_q, lens_k, hq, hkv, d = [130, 1, 0, 257], [200, 64, 3, 257], 8, 2, 512
    cu_q, cu_k = cu_seqlens(lens_q, device="cuda"), cu_seqlens(lens_k, device="cuda")
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=BF16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
    kw = {} if backend is None else {"backend": backend}
    plan = ffpa_attn.explain_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, enable_gqa=True, **kw)
    assert plan.backward.kernel == "varlen_bwd_sm90+varlen_bwd_dq_sm90", str(plan)
    out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, enable_gqa=True,
                                          **kw)
    do = torch.randn_like(out)
    out.backward(do)
    ref = _reference(q.detach(), k.detach(), v.detach(), do, None, cu_q, cu_k, True, 1.0 / math.sqrt(d))
    _check_sequences((q.grad, k.grad, v.grad), ref, cu_q, cu_k, BF16)

"""Triton split-D backward at scale on a GPU (skipped without CUDA): causal bf16 at N=8192, every FFPA head
dim, GQA/MQA, masks with gradients, dropout, varlen, determinism, 64-bit offsets and torch.compile. Every
check is against autograd through the fp32 reference on fresh inputs, and no worse than 2x torch's own
same-dtype SDPA backward where SDPA can run the case.

    python -m pytest -q tests/gpu/test_triton_bwd_gpu.py
"""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import TritonBackend
from ffpa_attn.interface import _draw_rng
from ffpa_attn.testing import (assert_grads_close, cu_seqlens, func_fwd_bwd, randn, reference_grads,
                               reference_varlen_fwd_bwd, sdpa_grad_errors)

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"



def _check_varlen(q, k, v, do, cu, max_len, causal, **kw):
    """Triton's packed backward (q / do ``[T, Hq, D]``, k / v ``[T, Hkv, D]``, one ``cu`` for both) against the
    fp32 reference's gradients."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = ffpa_attn.ffpa_attn_varlen_func(qs, ks, vs, cu, cu, max_len, max_len, causal=causal, backend="triton", **kw)
    out.backward(do)
    ref = reference_varlen_fwd_bwd(q, k, v, cu, cu, do, causal=causal)
    assert_grads_close((qs.grad, ks.grad, vs.grad), ref.grads, q.dtype)


def _case(b, hq, hkv, nq, nkv, d, dtype, causal, mask=None, **kw):
    q, do = randn(b, hq, nq, d, dtype=dtype, device=DEV), randn(b, hq, nq, d, dtype=dtype, device=DEV)
    k, v = randn(b, hkv, nkv, d, dtype=dtype, device=DEV), randn(b, hkv, nkv, d, dtype=dtype, device=DEV)
    kw.setdefault("backend", "triton")
    got = func_fwd_bwd(q, k, v, do, attn_mask=mask, is_causal=causal, **kw).grads
    refs = reference_grads(q, k, v, do, mask=mask, causal=causal)
    assert_grads_close(got, refs, dtype, baselines=sdpa_grad_errors(q, k, v, do, refs, mask=mask, causal=causal),
                       strict=True)
    return got


def test_causal_bf16_n8192_gqa():
    _case(1, 2, 1, 8192, 8192, 512, BF16, True)


@pytest.mark.parametrize("d", [320, 640, 1024])  # remainder slice; DS=128 / DS=256 default plans
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(d, causal):
    _case(1, 4, 2, 1500, 2048 if causal else 1700, d, BF16, causal)


@pytest.mark.parametrize("d", [264, 392, 520, 776, 1016])  # D = 8 mod 128: 16-wide remainder slices
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["dense", "bool_mask", "varlen"])
def test_small_remainder_head_dims(d, causal, kind):
    """Head dims whose last D-slice holds 8 (or 120) columns compile and match the fp32 reference, in the
    dense, masked and varlen backward (the ones that go to Triton on every GPU)."""
    if kind == "varlen":
        lens = [50, 79]
        cu = torch.tensor([0, 50, 129], dtype=torch.int32, device=DEV)
        q, do, k, v = (randn(129, 2, d, dtype=BF16, device=DEV) for _ in range(4))
        _check_varlen(q, k, v, do, cu, max(lens), causal)
        return
    mask = torch.rand(1, 1, 129, 129, device=DEV) > 0.3 if kind == "bool_mask" else None
    if mask is not None:
        mask[..., 0] = True  # every row sees a key (causal included): SDPA's error stays a fair baseline
    _case(1, 2, 2, 129, 129, d, BF16, causal, mask=mask)


def test_fp16_mqa_cross_split():
    _case(2, 4, 1, 777, 3001, 512, FP16, True, backend=TritonBackend(split_launch=True))


@pytest.mark.parametrize("shape", [(1, 4, 1024, 1536), (2, 1, 1, 1536)])
def test_float_mask_grad(shape):
    _case(2, 4, 4, 1024, 1536, 512, BF16, False, mask=randn(*shape, dtype=BF16, device=DEV))


def test_float_mask_grad_deterministic_broadcast():
    _case(1, 4, 2, 1000, 1000, 384, BF16, True, mask=randn(1, 1, 1000, 1000, dtype=BF16, device=DEV),
          backend=TritonBackend(deterministic=True))


def test_bool_mask_with_empty_rows():
    mask = torch.rand(2, 1, 900, 1100, device=DEV) > 0.3
    mask[:, :, 7] = False
    got = _case(2, 4, 1, 900, 1100, 640, BF16, False, mask=mask)  # MQA
    assert torch.count_nonzero(got[0][:, :, 7]) == 0


@pytest.mark.parametrize("split", [False, True])
def test_dropout(split):
    from ffpa_attn.triton.dropout import dense_keep_mask

    b, hq, hkv, nq, nkv, d, p = 1, 4, 2, 1024, 1300, 512, 0.15
    q, do = randn(b, hq, nq, d, dtype=BF16, device=DEV), randn(b, hq, nq, d, dtype=BF16, device=DEV)
    k, v = randn(b, hkv, nkv, d, dtype=BF16, device=DEV), randn(b, hkv, nkv, d, dtype=BF16, device=DEV)
    torch.manual_seed(77)
    got = func_fwd_bwd(q, k, v, do, dropout_p=p, is_causal=True, backend=TritonBackend(split_launch=split)).grads
    torch.manual_seed(77)
    keep = dense_keep_mask(_draw_rng(q.device), b, hq, nq, nkv, p)
    assert_grads_close(got, reference_grads(q, k, v, do, causal=True, dropout_p=p, keep=keep), BF16)


def test_deterministic_bitwise():
    q, do = randn(1, 8, 4096, 512, dtype=BF16, device=DEV), randn(1, 8, 4096, 512, dtype=BF16, device=DEV)
    k, v = randn(1, 2, 4096, 512, dtype=BF16, device=DEV), randn(1, 2, 4096, 512, dtype=BF16, device=DEV)
    be = TritonBackend(deterministic=True)
    a = func_fwd_bwd(q, k, v, do, is_causal=True, backend=be).grads
    b = func_fwd_bwd(q, k, v, do, is_causal=True, backend=be).grads
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert_grads_close(a, reference_grads(q, k, v, do, causal=True), BF16)


def test_varlen_at_scale():
    g = torch.Generator().manual_seed(3)
    lens = [0, 1] + torch.randint(2, 2500, (14,), generator=g).tolist()
    cu = cu_seqlens(lens, device=DEV)
    t = sum(lens)
    q, do = randn(t, 8, 512, dtype=BF16, device=DEV), randn(t, 8, 512, dtype=BF16, device=DEV)
    k, v = randn(t, 2, 512, dtype=BF16, device=DEV), randn(t, 2, 512, dtype=BF16, device=DEV)
    _check_varlen(q, k, v, do, cu, max(lens), True, enable_gqa=True)


@pytest.mark.gpu_memory_heavy
def test_64bit_offsets():
    """Batch 1 of q/out/dout starts past 2**31 elements: every base offset must be 64-bit."""
    b, h, n, d = 2, 1, 256, 512
    big = 2**31 + 4096

    def huge_view():
        store = torch.empty(big + h * n * d, device=DEV, dtype=BF16)
        t = store.as_strided((b, h, n, d), (big, n * d, d, 1))
        t.copy_(torch.randn(b, h, n, d, device=DEV))
        return t

    q, do = huge_view(), huge_view()
    k, v = randn(b, h, n, d, dtype=BF16, device=DEV), randn(b, h, n, d, dtype=BF16, device=DEV)
    out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, backend="triton")
    out_h = huge_view()
    out_h.copy_(out)
    del out
    dq, dk, dv = ffpa_attn.ffpa_attn_bwd(do, q, k, v, out_h, lse, causal=True, backend="triton")
    refs = reference_grads(q, k, v, do, causal=True)
    assert_grads_close((dq, dk, dv), refs, BF16)


def test_torch_compile_fullgraph():
    q, k, v = (randn(1, 4, 1024, 512, dtype=BF16, device=DEV).requires_grad_() for _ in range(3))
    do = randn(1, 4, 1024, 512, dtype=BF16, device=DEV)
    f = torch.compile(lambda q, k, v: ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, backend="triton"),
                      fullgraph=True)
    f(q, k, v).backward(do)
    assert_grads_close((q.grad, k.grad, v.grad), reference_grads(q, k, v, do, causal=True), BF16)


def test_peak_memory_n8192():
    """fwd+bwd peak above the inputs <= out + lse + fp32 dQ + (dq, dk, dv) (+ 5% slack)."""
    b, h, n, d = 1, 8, 8192, 512
    q, k, v = (randn(b, h, n, d, dtype=BF16, device=DEV).requires_grad_() for _ in range(3))
    do = randn(b, h, n, d, dtype=BF16, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, backend="triton").backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    elems = b * h * n * d
    budget = elems * (2 + 4 + 3 * 2) + b * h * n * 4
    assert peak <= 1.05 * budget, (peak / 2**20, budget / 2**20)

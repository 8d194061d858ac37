"""CuTeDSL sm90a forward kernel on an H200 (skipped without CUDA / sm90 / nvidia-cutlass-dsl).

Calls :func:`ffpa_attn.cute.api.run_forward` directly, so it tests every head dim the kernel compiles
for, not only those listed in ``SUPPORTED_HEAD_DIMS`` (the backends layer routes only those). Every
check is against the fp32 reference on fresh inputs, with the error of torch's own same-dtype SDPA as
the 2x baseline; outputs are fresh allocations the kernel must fully write (lse NaN-checked too).

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python -m pytest -q tests/gpu/test_cute_gpu.py
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ffpa_attn._checks import causal_mask
from ffpa_attn.reference import _expand_kv, attention
from ffpa_attn.testing import assert_close, make_qkv

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _has_cutlass() -> bool:
    try:
        import cutlass  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


skip_reason = None if _sm90() and _has_cutlass() else "needs an sm90 GPU and nvidia-cutlass-dsl"
if skip_reason:
    pytestmark = [pytestmark, pytest.mark.skip(reason=skip_reason)]


def sdpa_baseline(q, k, v, causal, scale):
    """torch SDPA in the input dtype (tail-aligned causal as an explicit mask)."""
    hq = q.shape[1]
    mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    return F.scaled_dot_product_attention(q, _expand_kv(k, hq), _expand_kv(v, hq), attn_mask=mask, scale=scale)


def check(q, k, v, causal, scale=None):
    from ffpa_attn.cute.api import run_forward

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = run_forward(q, k, v, causal, scale)
    torch.cuda.synchronize()
    ref, ref_lse = attention(q, k, v, is_causal=causal, scale=scale)
    base = (sdpa_baseline(q, k, v, causal, scale).double() - ref.double()).norm() / ref.double().norm()
    assert_close(out, ref, q.dtype, "out", baseline=float(base))
    assert torch.isfinite(lse).all(), "lse has NaN/inf"
    assert (lse - ref_lse).abs().max().item() < 2e-3 * max(1.0, ref_lse.abs().max().item()), "lse"
    return out, lse


SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype
    (1, 2, 2, 64, 64, 512, False, BF16),
    (1, 2, 2, 128, 128, 512, True, BF16),
    (2, 4, 4, 200, 200, 512, False, FP16),
    (2, 4, 4, 333, 333, 512, True, BF16),
    (1, 8, 2, 100, 777, 512, True, BF16),     # GQA 4, Nq < Nkv, tails
    (1, 8, 1, 257, 1000, 512, False, FP16),   # MQA
    (2, 3, 3, 1, 513, 512, True, BF16),       # one query row
    (1, 2, 2, 1024, 1024, 384, True, BF16),
    (1, 4, 2, 130, 300, 384, False, FP16),
    (1, 2, 2, 500, 700, 320, True, BF16),
    (1, 2, 1, 300, 300, 448, False, BF16),
    (1, 2, 2, 190, 260, 264, True, FP16),     # d_wg = 144: swizzle-32 layouts, zero-padded columns
    (1, 2, 2, 100, 100, 296, False, BF16),    # D not a multiple of 32
    # 2-CTA clusters: each CTA owns half of D, partial S exchanged through DSMEM
    (1, 2, 2, 64, 64, 1024, False, BF16),
    (1, 2, 2, 333, 333, 1024, True, BF16),
    (1, 8, 2, 100, 777, 1024, True, FP16),    # GQA 4, Nq < Nkv, tails
    (2, 4, 4, 200, 250, 768, False, BF16),
    (1, 4, 1, 130, 130, 640, True, BF16),     # MQA
    (1, 2, 2, 257, 300, 576, True, FP16),     # d_wg = 144
    (1, 2, 2, 99, 99, 520, False, BF16),      # last part mostly zero padding
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nkv{}-D{}-c{}-{}".format(
    *s[:-1], str(s[-1])[6:]))
def test_forward(shape):
    b, hq, hkv, nq, nkv, d, causal, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    check(q, k, v, causal)


def test_noncontiguous_and_scale():
    """[B, N, H, D] storage viewed as [B, H, N, D] (a model's transpose), a negative and a large scale."""
    q, k, v = make_qkv(2, 4, 2, 150, 260, 512, BF16, device="cuda", layout="bnhd")
    check(q, k, v, causal=True, scale=-0.07)
    check(q, k, v, causal=False, scale=0.2)


@pytest.mark.parametrize("d", [512, 1024])
def test_large_causal(d):
    q, k, v = make_qkv(1, 2, 2, 4096, 4096, d, BF16, device="cuda")
    check(q, k, v, causal=True)


def test_empty_and_no_keys():
    from ffpa_attn.cute.api import run_forward

    q, k, v = make_qkv(1, 2, 2, 0, 64, 512, BF16, device="cuda")
    out, lse = run_forward(q, k, v, False, 0.05)
    assert out.shape == (1, 2, 0, 512) and lse.shape == (1, 2, 0)
    q, k, v = make_qkv(1, 2, 2, 5, 0, 512, BF16, device="cuda")
    out, lse = run_forward(q, k, v, False, 0.05)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_deterministic_and_second_call_is_cached():
    import time

    from ffpa_attn.cute.api import run_forward

    q, k, v = make_qkv(1, 4, 4, 256, 256, 512, BF16, device="cuda")
    out1, lse1 = run_forward(q, k, v, True, 0.05)
    t0 = time.perf_counter()
    out2, lse2 = run_forward(q, k, v, True, 0.05)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 0.5
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)

"""The S-recompute CuTeDSL forward for 512 < D <= 1024 (``run_forward(..., recompute=True)``,
``CuTeDSLBackend(fwd_recompute=True)``) on an H200 against the fp32 reference (skipped without an sm90 GPU
and nvidia-cutlass-dsl). Outputs are fresh allocations the kernel must fully write (NaN-poisoned); both CTAs
of a query block compute lse, exactly one writes it.

    python -m pytest -q tests/gpu/test_cute_recompute_gpu.py
"""
from __future__ import annotations

import math

import pytest
import torch

from ffpa_attn.reference import attention
from ffpa_attn.testing import PoisonTorch, assert_close, assert_forward_close, make_qkv, shape_id, sm90_with_cutedsl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_with_cutedsl(), reason="needs an sm90 GPU and nvidia-cutlass-dsl")]

BF16, FP16 = torch.bfloat16, torch.float16

SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype
    (1, 2, 2, 64, 64, 1024, False, BF16),
    (1, 2, 2, 333, 333, 1024, True, BF16),
    (1, 8, 2, 100, 777, 1024, True, FP16),    # GQA 4, Nq < Nkv, tails
    (2, 4, 4, 200, 250, 1024, False, FP16),   # Nq != Nkv non-causal
    (2, 4, 4, 200, 250, 768, False, BF16),    # tile_n 48
    (1, 4, 1, 130, 130, 768, True, FP16),     # MQA
    (1, 4, 2, 257, 300, 640, True, BF16),     # tile_n 64
    (1, 2, 2, 190, 190, 640, False, FP16),
    (1, 2, 2, 99, 99, 520, False, BF16),      # d_wg 144: the last part mostly zero padding
    (1, 2, 2, 257, 300, 520, True, FP16),
    (1, 2, 2, 300, 400, 896, True, BF16),     # tile_n 32, 8 ring slots
    (2, 3, 3, 1, 513, 1024, True, BF16),      # one query row
]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    """run_forward's out / lse start as NaN: an element neither CTA writes fails the test."""
    from ffpa_attn.cutedsl import api

    monkeypatch.setattr(api, "torch", PoisonTorch())


def check(q, k, v, causal, scale=None):
    """run_forward(..., recompute=True) against the fp32 reference with the checks of the default kernel's
    (tests/gpu/test_cute_gpu.py): torch SDPA's error as the 2x baseline, lse within 2e-3 x max(1, |lse|)."""
    from ffpa_attn.cutedsl.api import run_forward

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = run_forward(q, k, v, causal, scale, recompute=True)
    assert_forward_close(out, lse, q, k, v, causal=causal, scale=scale, baseline=True, lse_atol=2e-3, lse_scaled=True)
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_recompute_forward(shape):
    b, hq, hkv, nq, nkv, d, causal, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    check(q, k, v, causal)


def test_recompute_noncontiguous_and_scale():
    """[B, N, H, D] storage viewed as [B, H, N, D], a negative scale."""
    q, k, v = make_qkv(2, 4, 2, 150, 260, 1024, BF16, device="cuda", layout="bnhd")
    check(q, k, v, causal=True, scale=-0.05)


@pytest.mark.parametrize("d", [768, 1024])
def test_recompute_large_causal_matches_cluster_kernel(d):
    """Long causal rows; the variant agrees with the default cluster kernel within the dtype's tolerance."""
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 2, 2, 2048, 2048, d, BF16, device="cuda")
    out, lse = check(q, k, v, causal=True)
    out_c, lse_c = run_forward(q, k, v, True, 1.0 / math.sqrt(d))
    assert_close(out, out_c.float(), BF16, "recompute vs cluster")
    assert (lse - lse_c).abs().max().item() < 1e-3


def test_recompute_tile_n_choices_and_determinism():
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 2, 2, 200, 300, 640, FP16, device="cuda")
    outs = [run_forward(q, k, v, True, 0.04, tile_n=t, recompute=True) for t in (32, 48, 64)]
    ref, _ = attention(q, k, v, is_causal=True, scale=0.04)
    for out, _ in outs:
        assert_close(out, ref, FP16, "out")
    again = run_forward(q, k, v, True, 0.04, tile_n=32, recompute=True)
    assert torch.equal(again[0], outs[0][0]) and torch.equal(again[1], outs[0][1])


def test_recompute_through_the_backend_option():
    """CuTeDSLBackend(fwd_recompute=True) reaches the variant through ffpa_attn's public entry point."""
    import ffpa_attn
    from ffpa_attn import CuTeDSLBackend
    from ffpa_attn.cutedsl import api

    calls = []
    real = api.run_forward

    def spy(*a, **kw):
        calls.append(kw.get("recompute"))
        return real(*a, **kw)

    api.run_forward = spy
    try:
        q, k, v = make_qkv(1, 4, 4, 128, 128, 1024, BF16, device="cuda")
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, backend=CuTeDSLBackend(fwd_recompute=True))
    finally:
        api.run_forward = real
    assert calls == [True]
    ref, _ = attention(q, k, v, is_causal=True, scale=1 / 32)
    assert_close(out, ref, BF16, "out")


def test_recompute_rejects_small_head_dims():
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 2, 2, 64, 64, 512, BF16, device="cuda")
    with pytest.raises(ValueError, match="S-recompute"):
        run_forward(q, k, v, False, 0.05, recompute=True)

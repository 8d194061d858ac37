"""Split-KV decode forward at scale on a GPU (skipped without CUDA): long KV caches, GQA/MQA, causal with
Nq > 1, masks, odd head dims, strided caches, 64-bit offsets, the public API's dispatch and the backward
that consumes the split-KV lse. Every check is against the fp32 reference on fresh inputs.

    python -m pytest -q tests/gpu/test_decode_gpu.py
"""
import math

import pytest
import torch

import ffpa_attn
from ffpa_attn.reference import attention
from ffpa_attn.testing import assert_close, assert_fwd_bwd_close, make_qkv, shape_id

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16


def _decode():
    from ffpa_attn.triton import splitkv as decode

    return decode


def check(q, k, v, *, attn_mask=None, causal=False, cfg=None, splits=None):
    decode = _decode()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = decode.splitkv_launch(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, cfg=cfg,
                                     splits=splits)
    ref, ref_lse = attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    if (~empty).any():
        assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < 2e-3
    return out, lse


SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype
    (1, 32, 32, 1, 32768, 512, False, BF16),
    (1, 32, 8, 4, 32768, 512, True, BF16),
    (1, 32, 2, 16, 32768, 512, True, BF16),
    (2, 16, 16, 4, 8191, 1024, True, FP16),
    (1, 8, 1, 64, 5000, 320, True, BF16),
    (3, 8, 4, 3, 20000, 576, False, FP16),
    (4, 4, 2, 1, 3000, 256, False, BF16),
    (1, 8, 8, 2, 257, 512, True, BF16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_default_config(shape):
    b, hq, hkv, nq, nkv, d, causal, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    check(q, k, v, causal=causal)


def test_forced_splits_with_empty_slices_and_d_split():
    from ffpa_attn.triton.autotune import KernelConfig

    q, k, v = make_qkv(1, 16, 4, 8, 10000, 512, BF16, device="cuda")
    for cfg in (KernelConfig(16, 32, 4, 2, (("block_do", 512), ("qk_chunk", 512))),
                KernelConfig(64, 32, 8, 2, (("block_do", 256), ("qk_chunk", 128)))):
        check(q, k, v, causal=True, cfg=cfg, splits=300)  # 300 x 64 keys > 10000: empty slices
        check(q, k, v, causal=True, cfg=cfg, splits=1)


def test_masks():
    q, k, v = make_qkv(2, 16, 4, 4, 16384, 512, BF16, device="cuda")
    bmask = torch.rand(2, 1, 1, 16384, device="cuda") > 0.2
    bmask[1, ..., 3000:12000] = False
    check(q, k, v, attn_mask=bmask, causal=True)
    bias = torch.randn(2, 16, 4, 16384, device="cuda", dtype=BF16)
    bias[0, 3] = float("-inf")  # a head that sees nothing
    check(q, k, v, attn_mask=bias)


def test_strided_cache():
    q, k, v = make_qkv(2, 32, 8, 1, 12000, 512, BF16, device="cuda", layout="bnhd")
    check(q, k, v)
    cache = torch.randn(2, 8, 20000, 512, device="cuda", dtype=BF16)
    check(q, cache[:, :, :12000], v, causal=False)


@pytest.mark.gpu_memory_heavy
def test_64bit_offsets():
    """K/V with more than 2**31 elements: every offset must be 64-bit (one head, so the reference does
    not expand K/V; ~26 GiB in all)."""
    nkv = (1 << 31) // 512 + 4096
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~30 GiB of GPU memory")
    q = torch.randn(1, 1, 4, 512, device="cuda", dtype=BF16)
    k = torch.randn(1, 1, nkv, 512, device="cuda", dtype=BF16)
    v = torch.randn(1, 1, nkv, 512, device="cuda", dtype=BF16)
    k[0, 0, -3000:] *= 3  # the tail beyond 2**31 elements dominates the softmax
    check(q, k, v, causal=True)
    del k, v
    torch.cuda.empty_cache()


def test_public_api_dispatch_and_backward():
    q, k, v = make_qkv(1, 16, 4, 8, 8192, 512, BF16, device="cuda", requires_grad=True)
    plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
    assert plan.forward.kernel == "splitkv_fwd", str(plan)
    out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
    ref, _ = attention(q, k, v, is_causal=True)
    assert_fwd_bwd_close(out, ref, (q, k, v), BF16)


def test_autotuned_path_then_cuda_graph():
    """TritonBackend() autotunes on the first call; a CUDA graph then replays the cached choice."""
    q, k, v = make_qkv(1, 32, 8, 1, 16384, 512, BF16, device="cuda")
    ref, _ = attention(q, k, v)
    out = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend="triton")
    assert_close(out, ref, BF16, "out")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend="triton")
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        gout = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend="triton")
    q.copy_(torch.randn_like(q))
    g.replay()
    ref2, _ = attention(q, k, v)
    assert_close(gout, ref2, BF16, "graph out")


@pytest.mark.parametrize("hkv,nq", [(8, 16), (2, 1), (2, 16)])
def test_every_candidate_config(hkv, nq):
    """Every tile config the autotuner may pick ("max" set: 16/32/64-row tiles, occ = 2 split counts) at
    the decode benchmark's row counts (64, 16, 256 rows per KV head), D = 512, causal, on a shorter cache."""
    decode = _decode()
    q, k, v = make_qkv(1, 32, hkv, nq, 6000, 512, BF16, device="cuda")
    rows = 32 // hkv * nq
    for cfg in decode.candidate_configs(512, rows, q.device, mode="max"):
        check(q, k, v, causal=True, cfg=cfg)


def test_autotune_max_mode_and_cache():
    """TritonBackend(autotune_mode="max") tunes over the wide set at 64 rows per KV head; a second call
    reuses the choice."""
    q, k, v = make_qkv(1, 32, 8, 16, 8192, 512, BF16, device="cuda")
    ref, _ = attention(q, k, v)
    be = ffpa_attn.TritonBackend(autotune_mode="max")
    for _ in range(2):
        out = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend=be)
        assert_close(out, ref, BF16, "out")

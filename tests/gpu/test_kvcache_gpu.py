"""KV-cache attention kernels at serving shapes on a GPU (skipped without CUDA), against the fp32 reference:
paged caches (pages of 16 / 64 / 256, transformers' interleaved page views), contiguous caches with
``cache_batch_idx``, ragged lengths up to 16K, GQA decode (Nq = 1) and multi-token causal steps with append,
D = 320 / 512 / 576 / 1024, fp16 / bf16; a CUDA-graph capture replayed after the lengths and tables changed in
place; the packed gather feeding the public varlen forward (chunked prefill).

    python -m pytest -q tests/gpu/test_kvcache_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from ffpa_attn import reference
from ffpa_attn.common.device import sm_count
from ffpa_attn.contract import check_kvcache
from ffpa_attn.dispatch import kvcache as kvplan
from ffpa_attn.testing import assert_close, capture, make_kvcache, ragged_seqlens, relocate_kvcache
from ffpa_attn.triton import kvcache as kv

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"


def _arch() -> int:
    return torch.cuda.get_device_capability()[0]


def _plan(q: torch.Tensor, case) -> tuple:
    b, nq, hq, d = q.shape
    rows = hq // case.k_cache.shape[2] * nq
    tiles = kvplan.tiles(d, rows, _arch())
    splits = kvplan.num_splits(b, case.k_cache.shape[2], rows, case.capacity, sm_count(q.device), tiles=tiles, d=d)
    return kv.config_from(tiles.params().get), splits


def check(q, case, k=None, v=None, *, causal=True, splits=None):
    ref, ref_lse = reference.kvcache_attention(q, case.k_cache, case.v_cache, k, v, causal=causal, **case.kwargs())
    ref_k = ref_v = None
    if k is not None:
        ref_k, ref_v = reference.kvcache_append(case.k_cache, case.v_cache, k, v, case.cache_seqlens,
                                                block_table=case.block_table, cache_batch_idx=case.cache_batch_idx)
    cfg, s = _plan(q, case)
    check_kvcache(q, case.k_cache, case.v_cache, k, v, **case.kwargs())
    out, lse = kv.decode_forward(q, case.k_cache, case.v_cache, k, v, causal=causal, cfg=cfg,
                                 splits=s if splits is None else splits, **case.kwargs())
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()
    if (~empty).any():
        assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < 2e-3
    if k is not None:
        assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v)
    return out, lse


SHAPES = [  # B, Hq, Hkv, Nq, D, page, capacity, dtype
    (8, 32, 8, 1, 512, 64, 16384, BF16),
    (8, 32, 8, 4, 512, 64, 8192, BF16),
    (6, 32, 8, 1, 512, 16, 8192, BF16),
    (6, 16, 2, 2, 512, 256, 8192, FP16),
    (4, 8, 1, 1, 1024, 64, 4096, BF16),
    (4, 16, 4, 3, 576, 32, 4096, FP16),
    (5, 8, 8, 1, 320, None, 6000, BF16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-D{}-page{}-cap{}-{}".format(*s))
@pytest.mark.parametrize("append", [False, True])
def test_serving_shapes(shape, append):
    b, hq, hkv, nq, d, page, cap, dtype = shape
    n_new = nq if append else 0
    lens = ragged_seqlens(b, cap, page or 16, n_new)
    case = make_kvcache(lens, hkv, d, dtype, page_size=page, capacity=cap, n_new=n_new, device=DEV,
                        batch_cache=b + 3 if page is None else None)
    q = torch.randn(b, nq, hq, d, device=DEV).to(dtype)
    k = v = None
    if append:
        k = torch.randn(b, n_new, hkv, d, device=DEV).to(dtype)
        v = torch.randn(b, n_new, hkv, d, device=DEV).to(dtype)
    check(q, case, k, v, causal=True)


def test_interleaved_transformers_pages():
    case = make_kvcache(ragged_seqlens(8, 4096, 64, 1), 8, 512, BF16, page_size=64, capacity=4096, n_new=1,
                        interleaved=True, device=DEV)
    q = torch.randn(8, 1, 32, 512, device=DEV).to(BF16)
    k = torch.randn(8, 1, 8, 512, device=DEV).to(BF16)
    v = torch.randn(8, 1, 8, 512, device=DEV).to(BF16)
    check(q, case, k, v)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_split_counts(splits):
    case = make_kvcache([3000, 1, 0, 2048], 8, 512, BF16, page_size=64, capacity=4096, device=DEV)
    q = torch.randn(4, 1, 32, 512, device=DEV).to(BF16)
    check(q, case, splits=splits)


def test_cuda_graph_replay_follows_lengths_and_tables():
    """Capture append + attention once (no value checks inside the capture), then change cache_seqlens and the block
    table in place: each replay must follow the new values (they are read on the device)."""
    b, hq, hkv, d, page, cap = 4, 32, 8, 512, 64, 2048
    case = make_kvcache([100, 700, 64, 1500], hkv, d, BF16, page_size=page, capacity=cap, n_new=1, device=DEV,
                        spare_blocks=40)
    q = torch.randn(b, 1, hq, d, device=DEV).to(BF16)
    k = torch.randn(b, 1, hkv, d, device=DEV).to(BF16)
    v = torch.randn(b, 1, hkv, d, device=DEV).to(BF16)
    cfg, splits = _plan(q, case)
    check_kvcache(q, case.k_cache, case.v_cache, k, v, **case.kwargs())

    def step():
        return kv.decode_forward(q, case.k_cache, case.v_cache, k, v, causal=True, cfg=cfg, splits=splits,
                                 **case.kwargs())

    graph, (out, lse) = capture(step, warmup=1)  # the eager warm-up validates the tables
    for lens in ([5, 1999, 0, 63], [1024, 64, 1, 2000]):
        before = (case.k_cache.clone(), case.v_cache.clone())
        relocate_kvcache(case, lens, n_new=1)
        check_kvcache(q, case.k_cache, case.v_cache, k, v, **case.kwargs())
        graph.replay()
        ref, ref_lse = reference.kvcache_attention(q, *before, k, v, causal=True, **case.kwargs())
        assert_close(out, ref, BF16, "out")
        assert (lse - ref_lse).abs().max().item() < 2e-3


def test_gather_feeds_varlen_forward():
    """Chunked prefill: append a 200-token chunk per sequence, gather the caches into packed THD buffers and run
    the public varlen forward over them (a padding sequence of no queries over the unused rows)."""
    from ffpa_attn import ffpa_attn_varlen_func

    b, hq, hkv, d, nq, page = 3, 16, 4, 512, 200, 64
    case = make_kvcache([1000, 0, 3000], hkv, d, BF16, page_size=page, capacity=4096, n_new=nq, device=DEV)
    q = torch.randn(b, nq, hq, d, device=DEV).to(BF16)
    k = torch.randn(b, nq, hkv, d, device=DEV).to(BF16)
    v = torch.randn(b, nq, hkv, d, device=DEV).to(BF16)
    ref, _ = reference.kvcache_attention(q, case.k_cache, case.v_cache, k, v, causal=True, **case.kwargs())
    kv.append_kv(case.k_cache, case.v_cache, k, v, case.cache_seqlens, block_table=case.block_table)
    kp, vp, cu_k, max_k = kv.gather_kv(case.k_cache, case.v_cache, case.cache_seqlens, block_table=case.block_table,
                                       n_new=nq, pad_sequence=True)
    cu_q = torch.tensor([0, nq, 2 * nq, 3 * nq, 3 * nq], dtype=torch.int32, device=DEV)
    out = ffpa_attn_varlen_func(q.flatten(0, 1), kp, vp, cu_q, cu_k, nq, max_k, causal=True, enable_gqa=True)
    assert_close(out.view(b, nq, hq, d), ref, BF16, "out")

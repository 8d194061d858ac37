"""The paged varlen forward (``ffpa_attn_varlen_func`` with ``block_table`` / ``seqused_k``) on a GPU (skipped without
CUDA), against the fp32 reference: serving shapes (D = 320 / 512 / 1024, GQA 32 / 8, pages of 16 / 64 / 256, fp16 and
bf16, ragged lengths with empty and one-key sequences), a mixed batch of decode rows and prefill chunks, the KV-cache
entry's chunk over pages (in place) against its packed route, and a CUDA-graph capture replayed after the lengths and
the block table changed in place.

    python -m pytest -q tests/gpu/test_paged_varlen_gpu.py
"""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import assert_close, capture, cu_seqlens, make_kvcache, relocate_kvcache

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"


def _batch(lens_q, lens_k, hq, hkv, d, dtype, page, **kw):
    case = make_kvcache(lens_k, hkv, d, dtype, page_size=page, device=DEV, **kw)
    q = torch.randn(sum(lens_q), hq, d, device=DEV).to(dtype)
    return q, cu_seqlens(lens_q, device=DEV), case


def _call(q, cu_q, case, causal=True, max_q=2048, **kw):
    """The paged varlen call (``max_q`` a bound known on the host: nothing here reads the device, so it captures)."""
    return ffpa_attn.ffpa_attn_varlen_func(q, case.k_cache, case.v_cache, cu_q, None, max_q, 0, causal=causal,
                                           enable_gqa=True, return_lse=True, seqused_k=case.cache_seqlens,
                                           block_table=case.block_table, **kw)


def _check(out, lse, q, cu_q, case, causal=True, rows=slice(None)):
    """out / lse of sequences ``rows`` of the case against the reference."""
    ref, ref_lse = reference.paged_varlen_attention(q, case.k_cache, case.v_cache, cu_q, case.cache_seqlens[rows],
                                                    case.block_table[rows], causal=causal)
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty) and (out.transpose(0, 1)[empty] == 0).all()
    if (~empty).any():
        assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < 2e-3


@pytest.mark.parametrize("d", [320, 512, 1024])
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [None, "triton"])
def test_serving_shapes(d, page, causal, backend):
    """Ragged key counts (0, 1, page - 1, page + 1, a few thousand) with chunks of 1..300 queries, GQA 32 / 8: the
    planner's route (pages packed for CuTeDSL where it comes first on sm90) and Triton named (in place)."""
    lens_k = [0, 1, page - 1, page + 1, 3000, 1200]
    lens_q = [1, 1, 17, 300, 256, 1]
    q, cu_q, case = _batch(lens_q, lens_k, 32, 8, d, BF16, page)
    kw = {"backend": backend} if backend else {}
    plan = ffpa_attn.explain_varlen(q, case.k_cache, case.v_cache, cu_q, None, 300, 0, causal=causal,
                                    enable_gqa=True, seqused_k=case.cache_seqlens, block_table=case.block_table, **kw)
    assert plan.forward.backend == "triton" and (plan.route == "in place" or backend is None), str(plan)
    out, lse = _call(q, cu_q, case, causal, **kw)
    _check(out, lse, q, cu_q, case, causal)


def test_fp16_interleaved_pages():
    q, cu_q, case = _batch([64, 1, 130], [700, 90, 2048], 16, 4, 512, FP16, 64, interleaved=True)
    out, lse = _call(q, cu_q, case)
    _check(out, lse, q, cu_q, case)


def test_mixed_batch_matches_the_separate_calls():
    """32 decode rows over 4K-32K keys and 4 chunks of 512 queries in one call equal the decode call of the KV-cache
    entry and the chunks' own paged varlen call."""
    g = torch.Generator().manual_seed(0)
    decode = torch.randint(4096, 32769, (32,), generator=g).tolist()
    lens_k, lens_q = decode + [8192] * 4, [1] * 32 + [512] * 4
    q, cu_q, case = _batch(lens_q, lens_k, 32, 8, 512, BF16, 64)
    out, lse = _call(q, cu_q, case)
    rows = cu_q[:32].long()
    d_out, d_lse = ffpa_attn.ffpa_attn_with_kvcache(q[rows].unsqueeze(1), case.k_cache, case.v_cache,
                                                    cache_seqlens=case.cache_seqlens[:32],
                                                    block_table=case.block_table[:32], causal=True,
                                                    return_softmax_lse=True)
    assert_close(out[rows], d_out[:, 0], BF16, "decode rows")
    assert (lse[:, rows] - d_lse[:, :, 0].T).abs().max().item() < 2e-3
    lo = int(cu_q[32])
    c_out, c_lse = ffpa_attn.ffpa_attn_varlen_func(q[lo:], case.k_cache, case.v_cache, cu_q[32:] - lo, None, 512, 0,
                                                   causal=True, enable_gqa=True, return_lse=True,
                                                   seqused_k=case.cache_seqlens[32:],
                                                   block_table=case.block_table[32:])
    assert_close(out[lo:], c_out, BF16, "chunks")  # (bitwise where both runs take the same kernel)
    assert (lse[:, lo:] - c_lse).abs().max().item() < 2e-3
    # the chunks against the reference (the decode rows were checked against the decode kernel above)
    _check(c_out, c_lse, q[lo:], cu_q[32:] - lo, case, rows=slice(32, None))


@pytest.mark.parametrize("leftpad", [False, True])
def test_kvcache_chunk_in_place_equals_the_packed_route(leftpad):
    """ffpa_attn_with_kvcache on a 300-token chunk over a paged cache at D = 320 (Triton is the varlen order's first
    there: in place without cache_leftpad) and packed (an all-zero cache_leftpad, same keys), both within tolerance of
    the reference."""
    b, hq, hkv, d, nq = 3, 16, 4, 320, 300
    case = make_kvcache([1000, 0, 3000], hkv, d, BF16, page_size=64, capacity=4096, n_new=nq, device=DEV)
    q = torch.randn(b, nq, hq, d, device=DEV).to(BF16)
    pad = torch.zeros(b, dtype=torch.int32, device=DEV) if leftpad else None
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, causal=True, cache_leftpad=pad, **case.kwargs())
    assert plan.route == ("gather+varlen" if leftpad else "paged varlen"), str(plan)
    out, lse = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, causal=True, cache_leftpad=pad,
                                                return_softmax_lse=True, **case.kwargs())
    ref, ref_lse = reference.kvcache_attention(q, case.k_cache, case.v_cache, causal=True, **case.kwargs())
    assert_close(out, ref, BF16, "out")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-3


@pytest.mark.parametrize("backend", [None, "triton"])
def test_cuda_graph_replay_follows_lengths_and_tables(backend):
    """A paged varlen call captured once (value checks skipped inside the capture; the gather route sizes its packed
    buffers by the table's capacity) and replayed after seqused_k and the block table changed in place: each replay
    follows the new values. The planner's route and Triton named (in place)."""
    lens_q, hq, hkv, d, page = [1, 1, 64, 1], 32, 8, 512, 64
    q, cu_q, case = _batch(lens_q, [100, 700, 1500, 64], hq, hkv, d, BF16, page, capacity=2048, spare_blocks=40)
    kw = {"backend": backend} if backend else {}
    _call(q, cu_q, case, **kw)  # validated (and compiled / tuned) before the capture
    graph, (out, lse) = capture(lambda: _call(q, cu_q, case, **kw))
    for lens in ([100, 700, 1500, 64], [2000, 3, 64, 1024], [0, 64, 65, 2048]):
        relocate_kvcache(case, lens)
        graph.replay()
        torch.cuda.synchronize()
        _check(out.clone(), lse.clone(), q, cu_q, case)

"""The public KV-cache entry ``ffpa_attn_with_kvcache`` on a GPU (skipped without CUDA), against the fp32 reference:
the planner's tiles and split counts at serving shapes (paged 16 / 64 / 256, contiguous with cache_batch_idx, ragged
lengths, append, GQA decode and Nq = 4 causal, D = 320 / 512 / 1024); the chunked-prefill route (packed gather +
the varlen forward the planner picks: CuTeDSL on sm90) including sequences shorter than the chunk; a CUDA-graph
capture of decode steps replayed after the lengths and tables changed in place (value checks skipped inside the
capture); torch.compile (inductor, fullgraph) of a decode step.

    python -m pytest -q tests/gpu/test_kvcache_entry_gpu.py
"""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import (assert_close, assert_kvcache_matches, capture, make_kvcache, ragged_seqlens,
                               relocate_kvcache)

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
DEV = "cuda"


def _call(q, case, k=None, v=None, *, causal=True, **kw):
    before = (case.k_cache.clone(), case.v_cache.clone())
    out, lse = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, causal=causal,
                                                return_softmax_lse=True, **case.kwargs(), **kw)
    assert_kvcache_matches(out, lse, q, case, *before, k, v, causal=causal, lse_tol=2e-3)
    return out, lse


SHAPES = [  # B, Hq, Hkv, Nq, D, page, capacity, dtype
    (8, 32, 8, 1, 512, 64, 16384, BF16),
    (8, 32, 8, 4, 512, 16, 8192, BF16),
    (6, 32, 8, 1, 512, 256, 8192, FP16),
    (6, 32, 8, 1, 512, None, 6000, BF16),
    (4, 8, 1, 2, 1024, 64, 4096, BF16),
    (5, 8, 8, 1, 320, 32, 4096, BF16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-D{}-page{}-cap{}-{}".format(*s))
@pytest.mark.parametrize("append", [False, True])
def test_decode_route_at_serving_shapes(shape, append):
    b, hq, hkv, nq, d, page, cap, dtype = shape
    n_new = nq if append else 0
    case = make_kvcache(ragged_seqlens(b, cap, page or 16, n_new), hkv, d, dtype, page_size=page, capacity=cap,
                        n_new=n_new, device=DEV, batch_cache=b + 3 if page is None else None)
    q = torch.randn(b, nq, hq, d, device=DEV).to(dtype)
    k = v = None
    if append:
        k = torch.randn(b, n_new, hkv, d, device=DEV).to(dtype)
        v = torch.randn(b, n_new, hkv, d, device=DEV).to(dtype)
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True, **case.kwargs())
    assert plan.route == "decode" and plan.kvcache.kernel == "kvcache_fwd", str(plan)
    _call(q, case, k, v)


@pytest.mark.parametrize("page", [64, None])
def test_chunked_prefill_route(page):
    """200 new queries per sequence appended onto ragged caches (the varlen forward of the planner: CuTeDSL on an
    H200 over the packed keys; paged, where the planner's varlen forward is Triton's, over the pages in place), and a
    chunk without append over sequences shorter than it (their first rows see no key)."""
    b, hq, hkv, d, nq = 3, 16, 4, 512, 200
    case = make_kvcache([1000, 0, 3000], hkv, d, BF16, page_size=page, capacity=4096, n_new=nq, device=DEV)
    q = torch.randn(b, nq, hq, d, device=DEV).to(BF16)
    k = torch.randn(b, nq, hkv, d, device=DEV).to(BF16)
    v = torch.randn(b, nq, hkv, d, device=DEV).to(BF16)
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True, **case.kwargs())
    in_place = page is not None and plan.varlen.backend == "triton"  # else packed for a forward that reads no pages
    assert plan.route == ("paged varlen" if in_place else "gather+varlen"), str(plan)
    if torch.cuda.get_device_capability() == (9, 0):
        assert plan.varlen.backend == "cutedsl", str(plan)
    _call(q, case, k, v)
    short = make_kvcache([150, 0, 1000], hkv, d, BF16, page_size=page, capacity=1024, device=DEV)
    _, lse = _call(q, short)
    assert torch.isneginf(lse[0, :, :50]).all() and torch.isfinite(lse[0, :, 50:]).all()
    assert torch.isneginf(lse[1]).all()


def test_cuda_graph_capture_follows_lengths_and_tables():
    """Decode steps captured once through the public entry (the value checks are skipped inside the capture), then
    replayed after cache_seqlens and the block table changed in place: each replay follows the new values."""
    b, hq, hkv, d, page, cap = 4, 32, 8, 512, 64, 2048
    case = make_kvcache([100, 700, 64, 1500], hkv, d, BF16, page_size=page, capacity=cap, n_new=1, device=DEV,
                        spare_blocks=40)
    q = torch.randn(b, 1, hq, d, device=DEV).to(BF16)
    k = torch.randn(b, 1, hkv, d, device=DEV).to(BF16)
    v = torch.randn(b, 1, hkv, d, device=DEV).to(BF16)

    def step():
        return ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True,
                                                return_softmax_lse=True, **case.kwargs())

    graph, (out, lse) = capture(step, warmup=1)  # the eager warm-up validates the tables
    for lens in ([5, 1999, 0, 63], [1024, 64, 1, 2000]):
        before = (case.k_cache.clone(), case.v_cache.clone())
        relocate_kvcache(case, lens, n_new=1)
        graph.replay()
        ref, ref_lse = reference.kvcache_attention(q, *before, k, v, causal=True, **case.kwargs())
        assert_close(out, ref, BF16, "out")
        assert (lse - ref_lse).abs().max().item() < 2e-3


def test_torch_compile_inductor_decode_step():
    """A decode step (append + attention) under torch.compile (inductor, fullgraph): the same output and the same
    cache writes as eager (the caches are the op's mutated arguments)."""
    torch._dynamo.reset()
    cases = [make_kvcache([300, 17, 1024], 8, 512, BF16, page_size=64, capacity=2048, n_new=1, device=DEV)
             for _ in range(2)]
    for a, b in ((cases[1].k_cache, cases[0].k_cache), (cases[1].v_cache, cases[0].v_cache),
                 (cases[1].block_table, cases[0].block_table)):
        a.copy_(b)
    q = torch.randn(3, 1, 32, 512, device=DEV).to(BF16)
    k = torch.randn(3, 1, 8, 512, device=DEV).to(BF16)
    v = torch.randn(3, 1, 8, 512, device=DEV).to(BF16)

    def step(q, kc, vc, k, v, seqlens, table):
        return ffpa_attn.ffpa_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                                causal=True)

    ref = step(q, cases[1].k_cache, cases[1].v_cache, k, v, cases[1].cache_seqlens, cases[1].block_table)
    out = torch.compile(step, fullgraph=True)(q, cases[0].k_cache, cases[0].v_cache, k, v,
                                              cases[0].cache_seqlens, cases[0].block_table)
    assert torch.equal(out, ref)
    assert torch.equal(cases[0].k_cache, cases[1].k_cache) and torch.equal(cases[0].v_cache, cases[1].v_cache)

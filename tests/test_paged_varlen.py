"""The serving forms of ``ffpa_attn_varlen_func`` on the Triton interpreter against the fp32 reference
(``ffpa_attn.reference.paged_varlen_attention``): paged K/V caches read through ``block_table`` with per-sequence key
counts ``seqused_k`` (flash-attn's paged varlen call, vLLM's unified prefill + decode batch): shuffled tables, pages of
16 / 48 / 64 / 256 keys (one table entry per key tile, or one per key row where the tile crosses pages), ragged lengths
(0, 1, page boundaries), sequences with no queries, GQA, causal and not, lse, K/V page views interleaved in one
storage, a mixed batch of decode rows and prefill chunks against the separate calls; ``seqused_k`` over packed K/V and
flash-attn's ``cu_seqlens_k`` counts; torch.compile (fullgraph); a hypothesis property test; argument and value errors
naming the argument; unchecked bad values reading nothing outside the caches; the plan (named backends without paged
reads refused); the sm_90 compile of the paged kernel (no spills in its key loops).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import (assert_close, compile_rows, cu_seqlens, make_kvcache, pretend_gpu, ptxas_available,
                               relocate_kvcache)

BF16, FP16 = torch.bfloat16, torch.float16
ROOT = Path(__file__).resolve().parents[1]


def make_batch(lens_q, lens_k, hq, hkv, d, dtype, page, device, *, interleaved=False, seed=0):
    """(q [T_q, Hq, D], cu_seqlens_q, a paged KV-cache case whose cache_seqlens are the key counts)."""
    g = torch.Generator().manual_seed(seed)  # tables and q; cache values from the device's generator on a GPU
    torch.manual_seed(seed)
    case = make_kvcache(lens_k, hkv, d, dtype, page_size=page, device=device, interleaved=interleaved,
                        generator=g if str(device) == "cpu" else None)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype).to(device)
    return q, cu_seqlens(lens_q, device=device), case


def call(q, cu_q, case, *, causal, max_q=None, **kw):
    """The paged varlen call an engine makes (cu_seqlens_k None, seqused_k, block_table), with lse."""
    max_q = max_q if max_q is not None else max(int((cu_q[1:] - cu_q[:-1]).max()), 1)
    return ffpa_attn.ffpa_attn_varlen_func(q, case.k_cache, case.v_cache, cu_q, None, max_q, case.capacity,
                                           causal=causal, enable_gqa=True, return_lse=True,
                                           seqused_k=case.cache_seqlens, block_table=case.block_table, **kw)


def gather_op(q, cu_q, case, *, causal, max_q, max_total=0):
    """The gather route's op: Triton's varlen_gather packs the pages, then a varlen forward (here Triton's, the only
    one on the CPU) runs over them."""
    from ffpa_attn.config import TritonBackend

    cfg = TritonBackend().to_config()
    return torch.ops.ffpa_attn.paged_varlen_attn(
        q, case.k_cache, case.v_cache, cu_q, None, case.cache_seqlens, case.block_table, max_q, 0, causal,
        q.shape[-1] ** -0.5, max_total, "triton", "varlen_gather", cfg, "triton", "varlen_fwd", cfg)


def check(out, lse, q, cu_q, case, *, causal, lse_tol=5e-4):
    """out within the dtype's tolerance and lse within ``lse_tol`` of the reference; rows that see no key at out 0
    and lse -inf."""
    ref, ref_lse = reference.paged_varlen_attention(q, case.k_cache, case.v_cache, cu_q, case.cache_seqlens,
                                                    case.block_table, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without a visible key must get lse = -inf"
    assert (out.transpose(0, 1)[empty] == 0).all(), "rows without a visible key must get out = 0"
    if (~empty).any():
        assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < lse_tol


# ------------------------------------------------------------------------------------------ results


@pytest.mark.parametrize("page", [16, 48, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_ragged_gqa(device, page, causal):
    """Ragged key counts (0, 1, page - 1, page + 1, two pages and a bit) under shuffled tables with -1 past each
    sequence's pages, query counts from 0 to 9 (causal: fewer keys than queries leaves the first rows empty), GQA 4 / 2
    at D = 48 (two power-of-two parts, 32 + 16)."""
    lens_k = [0, 1, page - 1, page + 1, 2 * page + 3]
    lens_q = [3, 1, 9, 0, 5]
    q, cu_q, case = make_batch(lens_q, lens_k, 4, 2, 48, BF16, page, device, seed=page)
    out, lse = call(q, cu_q, case, causal=causal)
    check(out, lse, q, cu_q, case, causal=causal)


def test_interleaved_page_views_fp16_mha(device):
    """K and V pages interleaved in one storage (page views with a page stride of two pages), fp16, Hq = Hkv."""
    q, cu_q, case = make_batch([2, 7], [40, 17], 2, 2, 64, FP16, 16, device, interleaved=True, seed=3)
    assert case.k_cache.stride(0) == 2 * case.k_cache[0].numel()
    out, lse = call(q, cu_q, case, causal=True)
    check(out, lse, q, cu_q, case, causal=True)


def test_mixed_decode_and_prefill_batch_matches_separate_calls(device):
    """One call with decode rows (1 query each) and prefill chunks (many queries) over one paged cache, as a serving
    engine batches them, equals the decode rows through ffpa_attn_with_kvcache plus the chunks through a paged varlen
    call of their own, and the reference."""
    lens_k = [37, 5, 64, 90, 16, 70]
    lens_q = [1, 24, 1, 1, 16, 33]  # decode, chunk, decode, decode, chunk, chunk
    q, cu_q, case = make_batch(lens_q, lens_k, 4, 1, 32, BF16, 16, device, seed=7)
    out, lse = call(q, cu_q, case, causal=True)
    check(out, lse, q, cu_q, case, causal=True)
    decode = [i for i, n in enumerate(lens_q) if n == 1]
    rows = cu_q[decode].long()
    d_out, d_lse = ffpa_attn.ffpa_attn_with_kvcache(q[rows].unsqueeze(1), case.k_cache, case.v_cache,
                                                    cache_seqlens=case.cache_seqlens[decode],
                                                    block_table=case.block_table[decode], causal=True,
                                                    return_softmax_lse=True)
    assert_close(out[rows], d_out[:, 0], BF16, "decode rows")
    assert (lse[:, rows] - d_lse[:, :, 0].T).abs().max().item() < 5e-4
    chunks = [i for i, n in enumerate(lens_q) if n > 1]
    c_rows = torch.cat([torch.arange(int(cu_q[i]), int(cu_q[i + 1])) for i in chunks])
    c_cu = cu_seqlens([lens_q[i] for i in chunks], device=device)
    c_out, c_lse = ffpa_attn.ffpa_attn_varlen_func(q[c_rows], case.k_cache, case.v_cache, c_cu, None, 33, 0,
                                                   causal=True, enable_gqa=True, return_lse=True,
                                                   seqused_k=case.cache_seqlens[chunks],
                                                   block_table=case.block_table[chunks])
    torch.testing.assert_close(out[c_rows], c_out, atol=0, rtol=0)
    torch.testing.assert_close(lse[:, c_rows], c_lse, atol=0, rtol=0)


def test_cu_seqlens_k_gives_the_counts_without_seqused_k(device):
    """flash-attn's rule: with a table and no seqused_k the key counts are cu_seqlens_k's differences."""
    q, cu_q, case = make_batch([4, 2, 3], [20, 0, 33], 2, 1, 32, BF16, 16, device, seed=11)
    out, lse = ffpa_attn.ffpa_attn_varlen_func(q, case.k_cache, case.v_cache, cu_q,
                                               cu_seqlens([20, 0, 33], device=device), 4, 33, enable_gqa=True,
                                               return_lse=True, block_table=case.block_table)
    check(out, lse, q, cu_q, case, causal=False)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_k_over_packed_kv(device, causal):
    """seqused_k without a table: packed K/V with the usual cu_seqlens_k, sequence b uses its first seqused_k[b]
    keys (the rest of its keys, here NaN, are never read)."""
    lens_q, lens_k, used = [3, 1, 4], [9, 6, 12], [5, 0, 12]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), 2, 32, generator=g).to(BF16).to(device)
    k = torch.randn(sum(lens_k), 2, 32, generator=g).to(BF16).to(device)
    v = torch.randn(sum(lens_k), 2, 32, generator=g).to(BF16).to(device)
    cu_q, cu_k = cu_seqlens(lens_q, device=device), cu_seqlens(lens_k, device=device)
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    for b, n in enumerate(used):  # keys past seqused_k: a read shows up as NaN
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
        v[int(cu_k[b]) + n:int(cu_k[b + 1])] = float("nan")
    out, lse = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 12, causal=causal, return_lse=True,
                                               seqused_k=seqused)
    trimmed = torch.cat([k[int(cu_k[b]):int(cu_k[b]) + n] for b, n in enumerate(used)])
    trimmed_v = torch.cat([v[int(cu_k[b]):int(cu_k[b]) + n] for b, n in enumerate(used)])
    ref, ref_lse = reference.varlen_attention(q, trimmed, trimmed_v, cu_q, cu_seqlens(used, device=device),
                                              causal=causal)
    assert_close(out, ref, BF16, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty) and (out.transpose(0, 1)[empty] == 0).all()
    assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < 5e-4


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_paged_varlen(device, data):
    """Random pages, heads, query and key counts (shorter than the queries too), table order, causality and route (in
    place, or the pages packed for a varlen forward)."""
    page = data.draw(st.sampled_from([16, 32, 48, 64]), "page")
    hq, hkv = data.draw(st.sampled_from([(2, 1), (4, 2), (2, 2)]), "heads")
    batch = data.draw(st.integers(1, 4), "batch")
    lens_q = data.draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch), "lens_q")
    lens_k = data.draw(st.lists(st.integers(0, 3 * page), min_size=batch, max_size=batch), "lens_k")
    causal = data.draw(st.booleans(), "causal")
    seed = data.draw(st.integers(0, 2**16), "seed")
    gather = data.draw(st.booleans(), "gather")  # the gather route's op (pages packed, then a varlen forward)
    q, cu_q, case = make_batch(lens_q, lens_k, hq, hkv, 32, BF16, page, device, seed=seed)
    if gather:
        out, lse = gather_op(q, cu_q, case, causal=causal, max_q=max(max(lens_q), 1))
    else:
        out, lse = call(q, cu_q, case, causal=causal)
    check(out, lse, q, cu_q, case, causal=causal)


def test_torch_compile_fullgraph(device):
    """The paged varlen call compiled with fullgraph=True (no graph break: lengths and tables stay on the device)
    gives the eager result bit for bit, and follows new lengths and tables without recompiling."""
    torch._dynamo.reset()
    q, cu_q, case = make_batch([1, 6, 1], [20, 33, 47], 2, 1, 32, BF16, 16, device, seed=2)

    def step(q, k_cache, v_cache, cu_q, seqused, table):
        return ffpa_attn.ffpa_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 6, 0, causal=True, enable_gqa=True,
                                               return_lse=True, seqused_k=seqused, block_table=table)

    from torch._dynamo.testing import CompileCounter

    frames = CompileCounter()
    compiled = torch.compile(step, fullgraph=True, backend=frames)
    for lens in ([20, 33, 47], [47, 1, 0]):
        relocate_kvcache(case, lens)  # new lengths and pages in the same tensors
        args = (q, case.k_cache, case.v_cache, cu_q, case.cache_seqlens, case.block_table)
        out, lse = compiled(*args)
        ref_out, ref_lse = step(*args)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        check(out, lse, q, cu_q, case, causal=True)
    assert frames.frame_count == 1


# ------------------------------------------------------------------------------------------ errors


def _errcase(device="cpu"):
    q, cu_q, case = make_batch([2, 3], [20, 33], 2, 1, 32, BF16, 16, device)
    return q, cu_q, case


def _bad_values(case, what):
    if what == "block id past the cache":
        case.block_table[1, 1] = case.k_cache.shape[0]
    elif what == "negative block id":
        case.block_table[0, 0] = -1
    elif what == "seqused_k past the capacity":
        case.cache_seqlens[1] = case.capacity + 1
    elif what == "negative seqused_k":
        case.cache_seqlens[0] = -2


BAD_VALUES = [
    ("block id past the cache", r"block_table\[1, 1\] = \d+ is outside the cache's \d+ blocks"),
    ("negative block id", r"block_table\[0, 0\] = -1 is outside"),
    ("seqused_k past the capacity", r"seqused_k \d+ is past the cache's capacity"),
    ("negative seqused_k", r"seqused_k\[0\] = -2 is negative"),
]


@pytest.mark.parametrize("what, match", BAD_VALUES)
def test_bad_values_raise_naming_the_argument(what, match):
    q, cu_q, case = _errcase()
    _bad_values(case, what)
    with pytest.raises(ValueError, match=match):
        call(q, cu_q, case, causal=True)


@pytest.mark.parametrize("what", [w for w, _ in BAD_VALUES])
def test_unchecked_bad_values_read_nothing_outside_the_caches(monkeypatch, what):
    """With the value checks off, bad block ids and counts are clamped in the kernel: the caches are views into a
    NaN-filled storage and the result stays finite (a read outside them would bring NaN)."""
    monkeypatch.setenv("FFPA_ATTN_VARLEN_VALUE_CHECKS", "0")
    q, cu_q, case = _errcase()
    n, page, hkv, d = case.k_cache.shape
    for name in ("k_cache", "v_cache"):
        storage = torch.full((n + 4, page, hkv, d), float("nan"), dtype=BF16)
        storage[2:n + 2] = getattr(case, name)
        setattr(case, name, storage[2:n + 2])
    _bad_values(case, what)
    out, lse = call(q, cu_q, case, causal=False)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


def test_argument_errors():
    q, cu_q, case = _errcase()
    kc, vc, bt, used = case.k_cache, case.v_cache, case.block_table, case.cache_seqlens
    f = ffpa_attn.ffpa_attn_varlen_func
    with pytest.raises(ValueError, match="block_table needs the key count of each sequence: seqused_k"):
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt)
    with pytest.raises(TypeError, match="seqused_k must be int32"):
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used.long())
    with pytest.raises(ValueError, match=r"seqused_k must have shape \[B\] = \[2\]"):
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used[:1])
    with pytest.raises(TypeError, match="block_table must be int32"):
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt.long(), seqused_k=used)
    with pytest.raises(ValueError, match=r"block_table must have shape \[B, max_pages\] with B = 2"):
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt[:1], seqused_k=used)
    with pytest.raises(ValueError, match=r"k must be 4-D \[num_blocks, page, Hkv, D\]"):
        f(q, kc.flatten(0, 1), vc.flatten(0, 1), cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(ValueError, match=r"the page size \(k.shape\[1\]\) must be a positive multiple of 16"):
        f(q, kc[:, :8], vc[:, :8], cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(ValueError, match="v .* must match k"):
        f(q, kc, vc[:-1], cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(ValueError, match="H_q=2 != H_kv=1 with enable_gqa=False"):
        f(q, kc, vc, cu_q, None, 3, 0, block_table=bt, seqused_k=used)
    with pytest.raises(ValueError, match=r"max_seqlen_q=2 is smaller than the longest sequence \(3\)"):
        f(q, kc, vc, cu_q, None, 2, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=5 must equal the packed length 4"):
        f(q[:4], kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(NotImplementedError, match="dropout_p=0.1 with block_table / seqused_k"):
        f(q, kc, vc, cu_q, None, 3, 0, dropout_p=0.1, enable_gqa=True, block_table=bt, seqused_k=used)
    with pytest.raises(NotImplementedError, match="forward-only"):
        f(q.requires_grad_(), kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)
    with torch.no_grad():  # the same inputs under no_grad run
        f(q, kc, vc, cu_q, None, 3, 0, enable_gqa=True, block_table=bt, seqused_k=used)


def test_seqused_k_past_the_packed_keys_raises():
    q = torch.randn(3, 1, 32).to(BF16)
    k = torch.randn(5, 1, 32).to(BF16)
    used = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 4 must lie in \[0, 3\]"):
        ffpa_attn.ffpa_attn_varlen_func(q, k, k, cu_seqlens([1, 2]), cu_seqlens([2, 3]), 2, 3, seqused_k=used)


# ------------------------------------------------------------------------------------------ the plan


@pytest.mark.parametrize("name", ["cutedsl", "cuda", "sdpa"])
def test_named_backends_without_paged_reads_are_refused(monkeypatch, name):
    """On a (pretended) H200 a named backend whose varlen forward reads no pages is refused with the registry's
    reason (no silent fallback)."""
    pretend_gpu(monkeypatch, capability=(9, 0))
    case = make_kvcache([8] * 4, 8, 512, BF16, page_size=64, capacity=4096, device="meta")
    q = torch.empty(4 * 300, 32, 512, dtype=BF16, device="meta")
    cu_q = torch.arange(5, dtype=torch.int32, device="meta") * 300
    kw = dict(causal=True, enable_gqa=True, seqused_k=case.cache_seqlens, block_table=case.block_table)
    with pytest.raises(NotImplementedError, match=f"backend '{name}' cannot run this forward: .*(paged K/V|"
                                                  "no varlen forward)"):
        ffpa_attn.explain_varlen(q, case.k_cache, case.v_cache, cu_q, None, 300, 0, backend=name, **kw)
    plan = ffpa_attn.explain_varlen(q, case.k_cache, case.v_cache, cu_q, None, 300, 0, backend="triton", **kw)
    assert plan.route == "in place" and plan.forward.kernel == "varlen_fwd" and plan.varlen is None, str(plan)


@pytest.mark.parametrize("d, route", [(512, "gather"), (320, "in place")])
def test_implicit_route_on_an_h200(monkeypatch, d, route):
    """Implicitly (heuristic paged_gather_first) the pages are packed for the CuTeDSL varlen forward where it is the
    varlen order's first (D = 512 on sm90) and read in place by the Triton forward where Triton comes first
    (D = 320); explain names both kernels and says the call is forward only."""
    pretend_gpu(monkeypatch, capability=(9, 0))
    case = make_kvcache([8] * 4, 8, d, BF16, page_size=64, capacity=4096, device="meta")
    q = torch.empty(4 * 300, 32, d, dtype=BF16, device="meta")
    cu_q = torch.arange(5, dtype=torch.int32, device="meta") * 300
    plan = ffpa_attn.explain_varlen(q, case.k_cache, case.v_cache, cu_q, None, 300, 0, causal=True, enable_gqa=True,
                                    seqused_k=case.cache_seqlens, block_table=case.block_table)
    assert plan.route == route and plan.forward.backend == "triton", str(plan)
    if route == "gather":
        assert plan.forward.kernel == "varlen_gather" and plan.varlen.backend == "cutedsl", str(plan)
    else:
        assert plan.forward.kernel == "varlen_fwd" and plan.varlen is None, str(plan)
        assert "cutedsl: the CuTeDSL backend's varlen forward does not read paged K/V" in plan.forward.reason
    assert "backward: none (forward only" in str(plan)


@pytest.mark.parametrize("max_total", [0, 200])
def test_gather_route_runs(device, max_total):
    """The gather route's op (pages packed by Triton's varlen_gather kernel, then a varlen forward, here Triton's, over
    the packed keys) against the reference; ``max_total`` 0: the kernel module reads the key count itself."""
    q, cu_q, case = make_batch([3, 1, 9, 0], [20, 1, 45, 7], 4, 2, 32, BF16, 16, device, seed=4)
    out, lse = gather_op(q, cu_q, case, causal=True, max_q=9, max_total=max_total)
    check(out, lse, q, cu_q, case, causal=True)


# ------------------------------------------------------------------------------------------ sm_90 compile


_COMPILE = r"""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import torch, triton
from triton.backends.compiler import GPUTarget
import compile_report as cr
from ffpa_attn.triton import fwd

meta = torch.device("meta")
rows = []
for d, page in json.loads(sys.argv[1]):
    cfg = cr._fwd_config(d, 90, True, False)  # the untuned pointer-load config (paged K/V take no descriptors)
    q = torch.empty(4096, 32, d, dtype=torch.bfloat16, device=meta)
    kc = torch.empty(4096, page, 8, d, dtype=torch.bfloat16, device=meta)
    bt = torch.empty(8, 32768 // page, dtype=torch.int32, device=meta)
    used = torch.empty(8, dtype=torch.int32, device=meta)
    cu = torch.empty(9, dtype=torch.int32, device=meta)
    (fn, args, kw), = cr.record_launches(lambda: fwd.varlen_forward(
        q, kc, kc, cu, None, 2048, 0, dropout_p=0.0, rng=None, causal=True, scale=1.0, config=None,
        kernel_config=cfg, seqused_k=used, block_table=bt))
    src, opts = cr.specialize(fn, args, kw, 90)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    r = {"d": d, "page": page, "cfg": str(cfg), "shared": int(k.metadata.shared)}
    r.update(cr._resource_usage(k.asm["cubin"]))
    rows.append(r)
print(json.dumps(rows))
"""


@pytest.mark.skipif(not ptxas_available(), reason="triton without the bundled ptxas")
def test_sm90_compile_paged_without_loop_spills(tmp_path):
    """The paged varlen forward compiled for sm_90 with the untuned config a GPU starts from: one table entry per
    tile (pages of 64) and one per key row (pages of 16 under 16-key tiles too, D = 320), within the 227 KiB of
    shared memory and without a spill instruction in the key loops."""
    rows = compile_rows(_COMPILE, [(320, 16), (512, 64), (512, 16), (1024, 64)], ROOT, tmp_path / "triton-cache")
    for r in rows:
        assert r["shared"] <= 227 * 1024 and r["loops"] >= 1 and r["loop_spills"] == 0, r

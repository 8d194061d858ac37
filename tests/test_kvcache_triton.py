"""KV-cache attention kernels (``ffpa_attn.triton.kvcache``) on the Triton interpreter against the fp32 reference
(``ffpa_attn.reference.kvcache_attention``): paged caches (pages of 16 / 48 / 64 / 256 keys, shuffled block
tables, -1 past a sequence's pages, transformers' interleaved K/V page views) and contiguous ones
(``cache_batch_idx``), ragged lengths (0, 1, page boundaries, full), GQA / MQA, causal with several new tokens,
append then attend in one call, lse, split counts, the packed gather for chunked prefill, sentinel checks that
nothing outside the addressed slots is written (also with invalid, unchecked lengths and tables); the planner's tile
and split arithmetic (``ffpa_attn.dispatch.kvcache``); a hypothesis property test; and the sm_90 compile of the
D = 512, page-64 kernel (shared memory, registers, no spills). The public entry ``ffpa_attn_with_kvcache`` (errors,
routing, compile, autocast) is tested in tests/test_kvcache.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ffpa_attn import reference
from ffpa_attn.contract import check_kvcache
from ffpa_attn.dispatch import kvcache as kvplan
from ffpa_attn.testing import (PoisonTorch, assert_close, assert_kvcache_matches, compile_rows, make_kvcache,
                               ptxas_available, ragged_seqlens)
from ffpa_attn.triton import kvcache as kv
from ffpa_attn.triton.autotune import KernelConfig

BF16, FP16 = torch.bfloat16, torch.float16
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def poisoned(monkeypatch):
    """The module's torch.empty returns NaN-filled float tensors: an output or partial a kernel forgets shows up."""
    monkeypatch.setattr(kv, "torch", PoisonTorch())


def new_tokens(batch: int, n: int, hkv: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    k = torch.randn(batch, n, hkv, d, device=device).to(dtype)
    v = torch.randn(batch, n, hkv, d, device=device).to(dtype)
    return k, v


def interpreter_config(d: int, rows: int) -> KernelConfig:
    """The tiles the planner gives an interpreter call (the kernel-level functions take them as a config)."""
    return kv.config_from(kvplan.tiles(d, rows, None).params().get)


def run(q, case, k=None, v=None, *, causal=False, splits=1, cache_leftpad=None, cfg=None):
    """decode_forward on the case's caches (their own layout, e.g. interleaved page views) after the contract's
    checks, restored afterwards; returns (out, lse, k_cache after, v_cache after)."""
    kc, vc = case.k_cache, case.v_cache
    saved = (kc.clone(), vc.clone())
    rows = q.shape[2] // kc.shape[2] * q.shape[1]
    cfg = cfg or interpreter_config(q.shape[-1], rows)
    check_kvcache(q, kc, vc, k, v, cache_leftpad=cache_leftpad, **case.kwargs())
    try:
        out, lse = kv.decode_forward(q, kc, vc, k, v, causal=causal, cfg=cfg, splits=splits,
                                     cache_leftpad=cache_leftpad, **case.kwargs())
        after = (kc.clone(), vc.clone())
    finally:
        kc.copy_(saved[0])
        vc.copy_(saved[1])
    return out, lse, *after


def check(q, case, k=None, v=None, *, causal=False, splits=1, cache_leftpad=None, cfg=None):
    """Out, lse and both caches after the call against the reference (:func:`assert_kvcache_matches`)."""
    before = (case.k_cache.clone(), case.v_cache.clone())
    out, lse, kc, vc = run(q, case, k, v, causal=causal, splits=splits, cache_leftpad=cache_leftpad, cfg=cfg)
    after = dataclasses.replace(case, k_cache=kc, v_cache=vc)
    assert_kvcache_matches(out, lse, q, after, *before, k, v, causal=causal, cache_leftpad=cache_leftpad)
    return out, lse


@pytest.mark.parametrize("page", [16, 64, 256])
def test_paged_page_sizes_ragged(poisoned, device, page):
    """D = 320 (padded tiles), lengths 0 / 1 / page - 1 / page / page + 1 / full, shuffled tables, split and not."""
    g = torch.Generator().manual_seed(page)
    cap = 2 * page if page < 256 else 256
    lens = ragged_seqlens(6, cap, page, generator=g)
    case = make_kvcache(lens, 2, 320, BF16, page_size=page, capacity=cap, device=device, generator=g)
    q = torch.randn(len(lens), 1, 4, 320, device=device).to(BF16)
    check(q, case, splits=1)
    check(q, case, splits=3)


def test_page_not_a_power_of_two(poisoned, device):
    """Page 48: a 16-key tile stays inside a page, a 32-key tile straddles two (one page id per key row)."""
    case = make_kvcache([0, 47, 48, 49, 95, 96], 1, 64, FP16, page_size=48, capacity=96, device=device)
    q = torch.randn(6, 2, 4, 64, device=device).to(FP16)
    for bn in (16, 32):
        check(q, case, splits=2, cfg=KernelConfig(16, bn, 4, 1, (("block_do", 64),)), causal=True)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_tiles_spanning_pages(poisoned, device, prefetch):
    """Page 16 with 32- and 64-key tiles (2 and 4 page ids per tile), with and without the page-id prefetch."""
    case = make_kvcache([130, 17, 64, 0], 2, 64, BF16, page_size=16, capacity=160, device=device)
    q = torch.randn(4, 1, 8, 64, device=device).to(BF16)
    for bn in (32, 64):
        cfg = KernelConfig(16, bn, 4, 1, (("block_do", 64), ("pf", prefetch)))
        check(q, case, splits=2, cfg=cfg)


def test_transformers_interleaved_pages(poisoned, device):
    """K and V pages interleaved in one storage (transformers' per-layer page views, page stride = 2 pages),
    -1 table entries past each sequence, appending one decode token per sequence."""
    case = make_kvcache([5, 0, 31, 32], 2, 64, BF16, page_size=16, capacity=64, n_new=1, interleaved=True,
                        device=device)
    assert case.k_cache.stride(0) == 2 * case.k_cache[0].numel() and (case.block_table == -1).any()
    q = torch.randn(4, 1, 8, 64, device=device).to(BF16)
    k, v = new_tokens(4, 1, 2, 64, BF16, device)
    check(q, case, k, v, causal=True, splits=2)


def test_contiguous_cache_batch_idx(poisoned, device):
    g = torch.Generator().manual_seed(1)
    case = make_kvcache([0, 1, 33, 64, 20], 2, 96, FP16, capacity=64, batch_cache=8, device=device, generator=g)
    assert case.cache_batch_idx is not None
    q = torch.randn(5, 2, 4, 96, device=device).to(FP16)
    check(q, case, splits=1)
    check(q, case, splits=4, causal=True)


def test_contiguous_without_lengths_uses_capacity(poisoned, device):
    case = make_kvcache([40, 40], 1, 64, BF16, capacity=40, device=device)
    case.cache_seqlens = None
    q = torch.randn(2, 3, 2, 64, device=device).to(BF16)
    check(q, case, splits=2, causal=True)


@pytest.mark.parametrize("page", [None, 16])
def test_append_then_attend_causal(poisoned, device, page):
    """Nq = 3 queries with 3 and 2 new tokens appended in the same call: row r sees keys <= r + len - Nq, and
    a sequence shorter than Nq (0 cached + 2 new < 3) leaves its first row empty (out 0, lse -inf)."""
    for n_new in (3, 2):
        lens = [0, 15, 16, 29]
        case = make_kvcache(lens, 2, 64, BF16, page_size=page, n_new=n_new, capacity=32, device=device)
        q = torch.randn(4, 3, 4, 64, device=device).to(BF16)
        k, v = new_tokens(4, n_new, 2, 64, BF16, device)
        _, lse = check(q, case, k, v, causal=True, splits=2)
        if n_new == 2:
            assert torch.isneginf(lse[0, :, 0]).all() and torch.isfinite(lse[0, :, 1:]).all()


@pytest.mark.parametrize("hq,hkv,nq", [(4, 1, 2), (8, 2, 1), (4, 4, 3), (8, 2, 5)])
def test_gqa_packed_rows(poisoned, device, hq, hkv, nq):
    """R = group * Nq rows per KV head (8 x 5 = 40: three 16-row blocks)."""
    case = make_kvcache([50, 3, 64], hkv, 64, BF16, page_size=16, capacity=64, device=device)
    q = torch.randn(3, nq, hq, 64, device=device).to(BF16)
    check(q, case, causal=True, splits=2)


def test_leftpad(poisoned, device):
    case = make_kvcache([40, 17, 5], 2, 64, FP16, capacity=48, device=device)
    leftpad = torch.tensor([10, 17, 0], dtype=torch.int32, device=device)
    q = torch.randn(3, 2, 4, 64, device=device).to(FP16)
    check(q, case, causal=True, splits=3, cache_leftpad=leftpad)


def test_large_head_dim_split_columns(poisoned, device):
    """D = 1024 with O's columns split over two programs per row block (BLOCK_DO = 512)."""
    case = make_kvcache([20, 33], 1, 1024, BF16, page_size=16, capacity=48, device=device)
    q = torch.randn(2, 1, 2, 1024, device=device).to(BF16)
    check(q, case, splits=2, cfg=KernelConfig(16, 16, 4, 1, (("block_do", 512),)))


def test_splits_are_deterministic_and_agree(device):
    case = make_kvcache([100, 7], 2, 64, BF16, page_size=16, capacity=112, device=device)
    q = torch.randn(2, 1, 4, 64, device=device).to(BF16)
    a = run(q, case, splits=5)
    b = run(q, case, splits=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    one = run(q, case, splits=1)
    assert (a[1] - one[1]).abs().max().item() < 1e-4


def test_int_cache_seqlens(device):
    case = make_kvcache([24, 24], 2, 64, BF16, page_size=16, capacity=32, device=device)
    q = torch.randn(2, 1, 4, 64, device=device).to(BF16)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out, lse = kv.decode_forward(q, kc, vc, cache_seqlens=24, block_table=case.block_table,
                                 cfg=interpreter_config(64, 2), splits=1)
    ref, ref_lse = reference.kvcache_attention(q, kc, vc, cache_seqlens=24, block_table=case.block_table)
    assert_close(out, ref, BF16)
    assert (lse - ref_lse).abs().max().item() < 5e-4


# ------------------------------------------------------------------------------------------ gather


@pytest.mark.parametrize("page", [None, 16, 64])
def test_gather_packs_sequences(device, page):
    g = torch.Generator().manual_seed(3)
    lens = [0, 17, 64, 5]
    case = make_kvcache(lens, 2, 48, BF16, page_size=page, capacity=64, n_new=0, device=device, generator=g,
                        batch_cache=6 if page is None else None)
    leftpad = None if page else torch.tensor([0, 4, 0, 5], dtype=torch.int32, device=device)
    kp, vp, cu, max_k = kv.gather_kv(case.k_cache, case.v_cache, case.cache_seqlens, block_table=case.block_table,
                                     cache_batch_idx=case.cache_batch_idx, cache_leftpad=leftpad)
    starts = [0] * 4 if leftpad is None else leftpad.tolist()
    want = [0]
    for b, n in enumerate(lens):
        want.append(want[-1] + n - starts[b])
    assert cu.dtype == torch.int32 and cu.tolist() == want and max_k == case.capacity
    assert kp.shape == (4 * case.capacity, 2, 48)
    for b, n in enumerate(lens):
        a, z = want[b], want[b + 1]
        for cache, packed in ((case.k_cache, kp), (case.v_cache, vp)):
            seq = reference.kvcache_sequence(cache, b, starts[b], n, block_table=case.block_table,
                                             cache_batch_idx=case.cache_batch_idx)
            assert torch.equal(packed[a:z], seq)
    guard = slice(want[-1], min(want[-1] + kv.GATHER_GUARD_ROWS, kp.shape[0]))
    assert (kp[guard] == 0).all() and (vp[guard] == 0).all()


def test_gather_pad_sequence_and_bound(device):
    case = make_kvcache([3, 9], 1, 32, FP16, page_size=16, capacity=16, n_new=2, device=device)
    k, v = new_tokens(2, 2, 1, 32, FP16, device)
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    kv.append_kv(kc, vc, k, v, case.cache_seqlens, block_table=case.block_table)
    kp, vp, cu, max_k = kv.gather_kv(kc, vc, case.cache_seqlens, block_table=case.block_table, n_new=2,
                                     max_total=20, pad_sequence=True)
    assert cu.tolist() == [0, 5, 16, 20] and max_k == 20 and kp.shape[0] == 20
    assert torch.equal(kp[:5], torch.cat([case.k_cache[case.block_table[0, 0]][:3], k[0]]))
    with pytest.raises(ValueError, match="max_total"):
        kv.gather_kv(kc, vc, case.cache_seqlens, block_table=case.block_table, n_new=2, max_total=15)


# ------------------------------------------------------------------------------------------ unchecked values


@pytest.mark.parametrize("page", [None, 16])
def test_bad_values_unchecked_write_nothing_outside(device, page):
    """Without the value checks (check_values=False, the CUDA-graph path) lengths past the capacity and block ids
    out of range are clamped in the kernels: no exception, finite outputs, and every cache slot outside the valid
    appends keeps its value (the spare blocks and unused slots are random sentinels)."""
    case = make_kvcache([30, 20], 2, 64, BF16, page_size=page, capacity=32, n_new=2, device=device)
    k, v = new_tokens(2, 2, 2, 64, BF16, device)
    seq = torch.tensor([31, 20], dtype=torch.int32, device=device)  # sequence 0: one token past the capacity
    bad = case.kwargs()
    bad["cache_seqlens"] = seq
    if page:
        table = case.block_table.clone()
        table[1, 1] = 10_000  # the page sequence 1's append and reads go through
        bad["block_table"] = table
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    out, lse = kv.decode_forward(torch.randn(2, 2, 4, 64, device=device).to(BF16), kc, vc, k, v,
                                 cfg=interpreter_config(64, 4), splits=2, **bad)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    # the only slots that may change: sequence 0's position 31, sequence 1's positions 20, 21 when their page is
    # valid (page 16: position 20 and 21 lie in the bad page 1, so nothing of sequence 1 is written)
    ref_k, ref_v = case.k_cache.clone(), case.v_cache.clone()
    pos0 = (case.block_table[0, 1], 15) if page else (0, 31)
    ref_k[pos0] = k[0, 0]
    ref_v[pos0] = v[0, 0]
    if not page:
        ref_k[1, 20:22] = k[1]
        ref_v[1, 20:22] = v[1]
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


# ------------------------------------------------------------------------------------------ splits, config


def test_num_splits_is_a_pure_rule():
    t = kvplan.tiles(512, 4, 9)
    occ = kvplan.occupancy(t, 512)
    assert occ == 2  # 112 KiB of shared memory, 4 warps
    # B = 32, Hkv = 8: 256 programs per slice; two waves of 2 x 132 programs -> 2 slices
    assert kvplan.num_splits(32, 8, 4, 32768, 132, tiles=t, d=512) == 2
    # B = 8: 64 programs per slice -> 8 slices (512 programs, just under two waves, not 9: a sliver of a third)
    assert kvplan.num_splits(8, 8, 4, 16384, 132, tiles=t, d=512) == 8
    # one sequence, one KV head: as many slices as two waves want, capped by the 4-tile / 8 * rows minimum
    assert kvplan.num_splits(1, 1, 4, 32768, 132, tiles=t, d=512) == min(2 * occ * 132, 32768 // t.block_n // 4,
                                                                          kvplan.MAX_SPLITS)
    assert kvplan.num_splits(1, 1, 4, 4096, 132, tiles=t, d=512) == 4096 // t.block_n // 4
    assert kvplan.num_splits(1, 1, 4, 100, 132, tiles=t, d=512) == 1  # no slice shorter than 4 tiles
    # 256 rows: 16 row blocks; slices of at least 8 * 256 keys allow 4 of 8192
    assert kvplan.num_splits(1, 1, 256, 8192, 132, tiles=t, d=512) == 4
    assert kvplan.num_splits(1, 8, 4, 0, 132, tiles=t, d=512) == 1
    assert kvplan.num_splits(64, 8, 4, 4096, 132, tiles=t, d=512) == 1  # more than two waves already


def test_ragged_lengths_share_the_programs(device):
    """Sequences of 1, 40 and 160 keys with 8 slices: the long one takes all 8 programs, the short ones fewer
    (balanced on the device from the lengths), and every split count gives the same answer."""
    case = make_kvcache([160, 1, 40], 2, 32, BF16, page_size=16, capacity=160, device=device)
    q = torch.randn(3, 1, 4, 32, device=device).to(BF16)
    outs = [run(q, case, splits=s)[:2] for s in (1, 3, 8)]
    for out, lse in outs[1:]:
        assert (out.float() - outs[0][0].float()).abs().max().item() < 2e-2
        assert (lse - outs[0][1]).abs().max().item() < 1e-4
    check(q, case, splits=8)


@pytest.mark.parametrize("d", [64, 256, 320, 512, 640, 1024])
@pytest.mark.parametrize("rows", [1, 4, 16, 40, 128])
def test_default_tiles_fit(d, rows):
    for arch, limit in ((9, 232448), (8, 166912)):
        t = kvplan.tiles(d, rows, arch)
        assert kvplan.smem_bytes(t, d) <= limit - 8 * 1024, (arch, t)
        assert kvplan.acc_regs(t, d) <= 128, t


def test_roofline_counts():
    r = kv.roofline([4096] * 32, 32, 8, 1, 512, splits=2)
    assert r["kv_bytes"] == 2 * 32 * 4096 * 8 * 512 * 2 and r["flop_per_byte"] == 4.0
    assert r["partial_bytes"] < 0.01 * r["kv_bytes"]


# ------------------------------------------------------------------------------------------ property


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_lengths_pages_gqa(device, data):
    page = data.draw(st.sampled_from([None, 16, 32, 48, 64]), "page")
    hq, hkv = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 4), (8, 2)]), "heads")
    nq = data.draw(st.integers(1, 3), "nq")
    n_new = data.draw(st.integers(0, 2), "n_new")
    cap = data.draw(st.sampled_from([16, 48, 96]), "cap")
    if page:
        cap = max(page, cap // page * page)
    batch = data.draw(st.integers(1, 3), "batch")
    lens = data.draw(st.lists(st.integers(0, cap - n_new), min_size=batch, max_size=batch), "lens")
    causal = data.draw(st.booleans(), "causal")
    splits = data.draw(st.integers(1, 4), "splits")
    case = make_kvcache(lens, hkv, 32, BF16, page_size=page, capacity=cap, n_new=n_new, device=device,
                        batch_cache=batch + 1 if page is None else None)
    q = torch.randn(batch, nq, hq, 32, device=device).to(BF16)
    k = v = None
    if n_new:
        k, v = new_tokens(batch, n_new, hkv, 32, BF16, device)
    check(q, case, k, v, causal=causal, splits=splits)


# ------------------------------------------------------------------------------------------ sm_90 compile


_COMPILE = r"""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import torch, triton
from triton.backends.compiler import GPUTarget
import compile_report as cr
from ffpa_attn.dispatch import kvcache as kvplan
from ffpa_attn.triton import kvcache as kv

rows = []
kv.launch_combine = lambda *args, **kwargs: None  # nothing runs on meta tensors; only the kernel is compiled
for d, page, nq, splits in json.loads(sys.argv[1]):
    sink = []
    real = kv._kvcache_fwd_kernel
    kv._kvcache_fwd_kernel = cr._Recorder(real, sink)
    try:
        meta = torch.device("meta")
        q = torch.empty(32, nq, 32, d, dtype=torch.bfloat16, device=meta)
        kc = torch.empty(16384, page, 8, d, dtype=torch.bfloat16, device=meta)
        bt = torch.empty(32, 512, dtype=torch.int32, device=meta)
        sl = torch.empty(32, dtype=torch.int32, device=meta)
        tiles = kvplan.tiles(d, 4 * nq, 9)
        cfg = kv.config_from(tiles.params().get)
        kv.kvcache_attention(q, kc, kc, cache_seqlens=sl, block_table=bt, causal=True, scale=0.05, cfg=cfg,
                             splits=splits)
    finally:
        kv._kvcache_fwd_kernel = real
    fn, args, kw = sink[0]
    src, opts = cr.specialize(fn, args, kw, 90)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    r = {"d": d, "page": page, "nq": nq, "splits": splits, "cfg": str(cfg), "shared": int(k.metadata.shared),
         "planned": kvplan.smem_bytes(tiles, d)}
    r.update(cr._resource_usage(k.asm["cubin"]))
    rows.append(r)
print(json.dumps(rows))
"""


@pytest.mark.skipif(not ptxas_available(), reason="triton without the bundled ptxas")
def test_sm90_compile_no_spills(tmp_path):
    """The default tiles compiled for sm_90 (what an H200 runs without tuning), written directly (one slice) and
    as partials (slices balanced over the lengths): within the shared memory the config plans and the 227 KiB
    limit; D = 512 with 64-key pages (the serving shape) without any spill instruction, the others (16-key
    pages, D = 1024) without spills in the KV loop (the fp32 partial epilogue may spill a few registers
    once per program)."""
    strict = [(512, 64, 1, 1), (512, 64, 1, 2), (512, 64, 4, 2)]
    shapes = strict + [(512, 16, 1, 2), (1024, 64, 1, 2)]
    rows = compile_rows(_COMPILE, shapes, ROOT, tmp_path / "triton-cache")
    for shape, r in zip(shapes, rows):
        assert r["shared"] <= min(r["planned"] + 4096, 227 * 1024), r
        assert r["loops"] >= 1 and 0 < r["regs"] <= 255 and r["loop_spills"] == 0, r
        if shape in strict:
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["local"] == 0, r

"""CPU checks of the CuTeDSL kernels' block ranges and varlen work list (ffpa_attn/cutedsl/ranges.py, no cutlass).

The arithmetic the kernels evaluate (through ffpa_attn/cutedsl/block_info.py) is checked against brute force over
(row, key) pairs, and a block-level emulation of the varlen forward (work list -> key blocks, top blocks
masked, boxes over-reading into the neighbouring sequence, stores bounded by the sequence) is checked against
the reference on random cu_seqlens.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ffpa_attn.cutedsl import ranges
from ffpa_attn.reference import varlen_attention

TILES = st.sampled_from([(4, 3), (4, 4), (3, 5), (8, 4), (64, 80)])
LENS = st.integers(0, 40)


def visible(row: int, key: int, nq: int, nk: int, causal: bool) -> bool:
    """The reference rule: key < Nk and (causal) key <= row + Nk - Nq, for a real row < Nq."""
    return row < nq and key < nk and (not causal or key <= row + nk - nq)


@settings(max_examples=150, deadline=None)
@given(nq=LENS, nk=LENS, tiles=TILES, causal=st.booleans())
def test_key_block_range_is_exact(nq, nk, tiles, causal):
    tm, tn = tiles
    for m in range(ranges.ceil_div(nq, tm)):
        lo, hi = ranges.key_block_range(m, nq, nk, tm, tn, causal)
        need = {k // tn for r in range(m * tm, (m + 1) * tm) for k in range(nk) if visible(r, k, nq, nk, causal)}
        assert lo == 0
        # every needed block is read, and the top block read is needed (no wasted tile)
        assert need <= set(range(lo, hi)), (m, lo, hi, need)
        assert (hi <= lo) == (not need) and (not need or hi - 1 in need), (m, lo, hi, need)
        # masked blocks: everything below them is fully visible to every row of the tile (even rows past Nq,
        # which the kernel computes and drops); every block with an invisible (real row, key) pair is masked
        n_masked = ranges.masked_key_blocks(m, nq, nk, tm, tn, causal, hi)
        assert 0 <= n_masked <= max(hi, 0)
        for blk in range(max(hi, 0)):
            full = all(k < nk and (not causal or k <= r + nk - nq)
                       for r in range(m * tm, (m + 1) * tm) for k in range(blk * tn, (blk + 1) * tn))
            if blk < hi - n_masked:
                assert full, (m, blk, hi, n_masked)


@settings(max_examples=150, deadline=None)
@given(nq=LENS, nk=LENS, tiles=TILES, causal=st.booleans())
def test_query_block_range_inverts_key_block_range(nq, nk, tiles, causal):
    tm, tn = tiles
    for n in range(ranges.ceil_div(nk, tn)):
        lo, hi = ranges.query_block_range(n, nq, nk, tm, tn, causal)
        readers = {m for m in range(ranges.ceil_div(nq, tm))
                   if n < ranges.key_block_range(m, nq, nk, tm, tn, causal)[1]}
        need = {r // tm for r in range(nq) for k in range(n * tn, min((n + 1) * tn, nk))
                if visible(r, k, nq, nk, causal)}
        assert need <= readers <= set(range(lo, hi)) or not readers, (n, lo, hi, readers)
        assert readers == set(range(lo, hi)) or (not readers and hi <= lo), (n, lo, hi, readers)


SEQS = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=0, max_size=6)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()) if lens else [0],
                        dtype=torch.int32)


@settings(max_examples=100, deadline=None)
@given(seqs=SEQS, long=st.sampled_from([0, 1, 77]), tiles=TILES, causal=st.booleans(), slack=st.integers(0, 9))
def test_work_items_match_the_model(seqs, long, tiles, causal, slack):
    """The device-built work list (here on CPU) equals the pure model: every (sequence, block) exactly once,
    most key blocks first, slots past the real count marked -1, within the capacity bound."""
    tm, tn = tiles
    seqs = seqs + ([(long, long + 3)] if long else [])
    lens_q = [a for a, _ in seqs]
    lens_k = [b for _, b in seqs]
    total_q = sum(lens_q) + slack  # packed q may hold rows past the last sequence
    items = ranges.varlen_work_items(_cu(lens_q), _cu(lens_k), total_q, tm, tn, causal)
    cap = ranges.work_list_capacity(total_q, len(seqs), tm)
    assert items.dtype == torch.int32 and tuple(items.shape) == (2, cap)
    model = ranges.varlen_work_items_model(lens_q, lens_k, tm, tn, causal)
    real = [(int(b), int(m)) for b, m in items.t().tolist() if b >= 0]
    assert real == model
    assert all(b == -1 for b, _ in items.t().tolist()[len(real):])
    assert sorted(real) == [(b, m) for b, n in enumerate(lens_q) for m in range(ranges.ceil_div(n, tm))]
    work = [ranges.key_block_range(m, lens_q[b], lens_k[b], tm, tn, causal)[1] for b, m in real]
    assert work == sorted(work, reverse=True)


@settings(max_examples=60, deadline=None)
@given(seqs=SEQS, tiles=TILES, causal=st.booleans(), slack=st.integers(0, 9))
def test_key_stationary_work_items_match_the_model(seqs, tiles, causal, slack):
    """The dK/dV kernel's list: every (sequence, key block) once, most query blocks first."""
    tm, tn = tiles
    lens_q = [a for a, _ in seqs]
    lens_k = [b for _, b in seqs]
    total_k = sum(lens_k) + slack
    items = ranges.varlen_work_items(_cu(lens_q), _cu(lens_k), total_k, tm, tn, causal, key_stationary=True)
    assert tuple(items.shape) == (2, ranges.work_list_capacity(total_k, len(seqs), tn))
    real = [(int(b), int(n)) for b, n in items.t().tolist() if b >= 0]
    assert real == ranges.varlen_work_items_model(lens_q, lens_k, tm, tn, causal, key_stationary=True)
    assert sorted(real) == [(b, n) for b, nk in enumerate(lens_k) for n in range(ranges.ceil_div(nk, tn))]
    spans = [ranges.query_block_range(n, lens_q[b], lens_k[b], tm, tn, causal) for b, n in real]
    work = [hi - lo for lo, hi in spans]
    assert work == sorted(work, reverse=True)


def emulate_varlen_forward(q, k, v, cu_q, cu_k, tm, tn, causal, scale):
    """The varlen forward kernel at block level, in fp64: one CTA per (work item, head); Q and K/V boxes start
    at the sequence's row offset and read whatever rows follow (the next sequence, zeros past the tensor); only
    the top ``masked_key_blocks`` tiles are masked; only rows < Nq are stored. out starts as NaN (sentinel)."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, tq), float("nan"), dtype=q.dtype)

    def box(t, start, rows):  # TMA box: rows past the tensor read as zero
        part = t[start:start + rows]
        return torch.cat([part, t.new_zeros(rows - part.shape[0], *t.shape[1:])])

    items = ranges.varlen_work_items(cu_q, cu_k, tq, tm, tn, causal)
    for b, m in items.t().tolist():
        if b < 0:
            continue
        oq, nq = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b])
        ok, nk = int(cu_k[b]), int(cu_k[b + 1] - cu_k[b])
        _, hi = ranges.key_block_range(m, nq, nk, tm, tn, causal)
        n_masked = ranges.masked_key_blocks(m, nq, nk, tm, tn, causal, hi)
        rows = torch.arange(m * tm, (m + 1) * tm)
        keep_rows = rows < nq
        for h in range(hq):
            if hi <= 0:
                o = torch.zeros(tm, d, dtype=q.dtype)
                l_ = torch.full((tm,), float("-inf"), dtype=q.dtype)
            else:
                qt = box(q[:, h], oq + m * tm, tm)
                s_all, v_all = [], []
                for t, blk in enumerate(range(hi - 1, -1, -1)):
                    kt = box(k[:, h * hkv // hq], ok + blk * tn, tn)
                    s = qt @ kt.T * scale
                    if t < n_masked:
                        cols = torch.arange(blk * tn, (blk + 1) * tn)
                        keep = cols[None, :] < nk
                        if causal:
                            keep = keep & (cols[None, :] <= rows[:, None] + nk - nq)
                        s = s.masked_fill(~keep, float("-inf"))
                    s_all.append(s)
                    v_all.append(box(v[:, h * hkv // hq], ok + blk * tn, tn))
                s = torch.cat(s_all, 1)
                l_ = torch.logsumexp(s, 1)
                p = torch.exp(s - l_[:, None]).nan_to_num(0.0)
                o = p @ torch.cat(v_all, 0)
                o[~torch.isfinite(l_)] = 0.0
            r = oq + rows[keep_rows]
            out[r, h] = o[keep_rows]
            lse[h, r] = l_[keep_rows]
    return out, lse


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 13)), min_size=1, max_size=5),
       long=st.sampled_from([0, 1, 31]), tiles=st.sampled_from([(4, 3), (3, 5), (8, 4)]), causal=st.booleans(),
       heads=st.sampled_from([(1, 1), (4, 2), (3, 1)]), seed=st.integers(0, 2**16))
def test_emulated_varlen_forward_matches_reference(seqs, long, tiles, causal, heads, seed):
    tm, tn = tiles
    hq, hkv = heads
    if long:
        seqs = seqs + [(long, long // 2 + 1)]
    lens_q = [a for a, _ in seqs]
    lens_k = [b for _, b in seqs]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    g = torch.Generator().manual_seed(seed)
    d = 4
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    scale = 1 / math.sqrt(d)
    out, lse = emulate_varlen_forward(q, k, v, cu_q, cu_k, tm, tn, causal, scale)
    ref_out, ref_lse = varlen_attention(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, dtype=torch.float64)
    assert not out.isnan().any() and not lse.isnan().any(), "a row of some sequence was never written"
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)


def test_emulation_catches_a_wrong_range():
    """The emulation test can fail: dropping the last key block of every query block changes the result."""
    cu = _cu([9, 5])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(14, 1, 4, generator=g, dtype=torch.float64) for _ in range(3))
    real = ranges.key_block_range
    try:
        ranges.key_block_range = lambda *a, **kw: (0, real(*a, **kw)[1] - 1)
        out, _ = emulate_varlen_forward(q, k, v, cu, cu, 4, 3, False, 0.5)
    finally:
        ranges.key_block_range = real
    ref, _ = varlen_attention(q, k, v, cu, cu, softmax_scale=0.5, dtype=torch.float64)
    assert not torch.allclose(out.nan_to_num(0.0), ref)


@pytest.mark.parametrize("causal", [False, True])
def test_work_list_has_no_host_sync_inputs(causal):
    """The work list's size depends only on T_q, B and the tile (what the host knows without a sync)."""
    cu = _cu([5, 0, 70, 1])
    items = ranges.varlen_work_items(cu, cu, 76, 64, 64, causal)
    assert items.shape[1] == ranges.work_list_capacity(76, 4, 64) == 2 + 4
    assert [tuple(x) for x in items.t().tolist()][:4] == ([(2, 1), (0, 0), (2, 0), (3, 0)] if causal else
                                                          [(2, 0), (2, 1), (0, 0), (3, 0)])

"""Attention over a KV cache (flash-attn's ``flash_attn_with_kvcache`` semantics): paged or contiguous caches,
per-sequence lengths read on the device, split-KV ("flash decoding") with packed GQA rows.

Layouts (flash-attn's):

* ``q [B, Nq, Hq, D]``; out like q; ``lse [B, Hq, Nq]`` fp32, natural log.
* contiguous cache: ``k_cache / v_cache [B_cache, N_max, Hkv, D]``; sequence ``b`` lives in cache row
  ``cache_batch_idx[b]`` (default ``b``); capacity ``N_max``.
* paged cache: ``k_cache / v_cache [num_blocks, page, Hkv, D]`` and int32 ``block_table [B, max_pages]``: key
  ``j`` of sequence ``b`` is row ``j % page`` of block ``block_table[b, j // page]``; capacity
  ``max_pages * page``. Any strides with a unit stride on D, so transformers' continuous-batching cache
  (``PagedAttentionCache``, full-attention layers) is served as it is: its per-layer K and V page views
  (``FullAttentionCacheAllocator.get_cache_for_block_table``) are ``[num_pages, page, Hkv, D]`` views with
  strides ``(page*Hkv*D, Hkv*D, D, 1)`` into one interleaved K/V tensor, its block table is int32 with page
  indices into those views (``-1`` past a request's pages, entries never read here), and its cache lengths
  are int32. The flat ``[tokens, Hkv, D]`` token view it uses for ``index_copy_`` is not addressed by a block
  table and is not an input here.
* ``cache_seqlens`` int32 ``[B]``: keys already cached; with new ``k / v [B, Nq_new, Hkv, D]`` these are
  first written at positions ``cache_seqlens[b] ..`` (:func:`append_kv`) and the attention runs over
  ``len_b = cache_seqlens[b] + Nq_new`` keys. ``None``: every sequence has the full capacity.
  ``cache_leftpad`` int32 ``[B]``: keys before it are not part of the sequence.
* causal is tail-aligned per sequence: query row ``r`` sees keys ``j <= r + len_b - Nq`` (and
  ``j >= leftpad_b``); a row that sees no key gets out 0 and lse -inf (``len_b = 0``, or ``len_b < Nq``
  causal).

Kernel. One program per (output column slice, row block, KV slice, sequence x KV head), like
:mod:`.splitkv`: the ``R = group * Nq`` query rows that read one KV head (row ``r`` = query head
``hk * group + r // Nq``, position ``r % Nq``) share one pass over that head's keys. A call has ``S`` KV
slices per (sequence, KV head); sequence b takes ``S_b = clamp(cdiv(S * tiles_b, tiles_max), 1, S)`` of them
(tiles_max: the longest sequence's, read from the lengths on the device) and cuts its key tiles into ``S_b``
equal runs, so every program gets about ``tiles_max / S`` tiles whatever the lengths, and the programs past
``S_b`` find no tile and exit. Each program runs the online softmax over its tiles and writes a normalised
fp32 partial and its running max and sum, merged by the shared combine (:mod:`ffpa_attn.common.combine`);
with ``S = 1`` it writes out and lse directly. A key tile of ``BLOCK_N`` rows is one run of consecutive
positions: where ``BLOCK_N`` divides the page it lies inside one page (one page id per tile, rows at the
page's row stride ``Hkv * D``, read as whole 16-row groups with 16-byte vector loads along D); where the page
is smaller (page 16 under 32-key tiles) each key row gathers its page id. Page ids are loaded one tile ahead,
so the K/V loads the pipeliner issues stages ahead depend on registers, not on an id load in the same
iteration (without it Triton gives the K/V loads fewer buffers or waits on the id load each tile; config
option ``pf=0`` turns it off for comparisons). Page ids, cache
rows and lengths are clamped in the kernels: a bad table entry or length reads and writes nothing outside
the cache (it cannot give a right answer: :func:`ffpa_attn.contract.check_kvcache` is what reports it).

Roofline of a decode step (``L = sum_b len_b`` cached keys, bf16): K/V bytes ``4 * L * Hkv * D`` (read once:
the group's query heads and the Nq new tokens share each read), q/out ``4 * B * Nq * Hq * D``, partials
``8 * B * Hq * S * Nq * D`` (fp32 write + read, a few % at most by the split rule below); FLOPs
``4 * L * Hq * Nq * D`` (non-causal), i.e. ``R = group * Nq`` FLOP per K/V byte. At the serving shape
(Hq = 32, Hkv = 8, D = 512): R = 4 (Nq = 1) and 16 (Nq = 4), against ~200 FLOP/B where an H200 turns
compute-bound: the kernel must stream K/V at the memory's rate and nothing else matters much (B = 32 at 4K
keys is 2.1 GB of K/V, ~0.5 ms). The MMA tiles are therefore the smallest ``tl.dot`` allows (BLOCK_M = 16
rows, mma.sync: idle rows cost tensor-core time that is free here) and the shared memory goes to K/V
pipeline stages and to a second program per SM (:func:`ffpa_attn.dispatch.kvcache.tiles`: 16-key tiles, 3
buffers, 112 KiB, two programs per SM, ~190 KiB of loads in flight per SM against the ~40 KiB an SM's share of
the bandwidth times the latency needs). At R = 64 and more (Hkv = 2, Nq = 4) the 64-row tiles are MMA-bound and this
kernel is far from the copy rate (docs/design.md, "CuTeDSL kernels", has the packed split-KV decode path).

Tiles and the split count are the planner's (:mod:`ffpa_attn.dispatch.kvcache`, recorded in the kernel spec
``kvcache_fwd[block_m=..;splits=..]`` and read back with :func:`config_from`): about two waves of programs at the
tiles' occupancy, rounded down to whole slice counts, capped so that a slice holds at least 4 tiles and ``8 * R``
keys of the longest sequence (partials stay small next to the K/V reads).

Entry points (kernel level, on validated inputs: :func:`ffpa_attn.contract.check_kvcache`; no host sync and
lengths / tables read on the device only, so they run under CUDA-graph capture and fit a torch.library op whose
fake implementation gives out like q and lse ``[B, Hq, Nq]`` fp32): :func:`decode_forward` (append + attention),
:func:`kvcache_attention`, :func:`append_kv`, :func:`gather_kv` (packed THD copy of the cached keys) and
:func:`gather_forward` (append + gather + a varlen forward: chunked prefill; it reads the packed key count on the
host unless told it), :func:`config_from`, :func:`roofline`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from typing import Callable

from ..common.combine import launch_combine, partial_buffers, pow2
from ..contract import check_kvcache, check_kvcache_values, default_scale, kvcache_capacity
from .autotune import KernelConfig
from .common import key_rows, page_ids, round_cast
from .splitkv import _dot

KERNEL_NAME = "kvcache_fwd"
# rows of the packed buffer after the last sequence that gather_kv zeroes: more than any key tile a varlen
# kernel reads past a sequence's end, so no uninitialised NaN meets a zero probability there
GATHER_GUARD_ROWS = 256


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _seq_bounds(SEQLENS, LEFTPAD, b, n_new, capacity, HAS_SEQLENS: tl.constexpr, HAS_LEFTPAD: tl.constexpr):
    """(start, end) of sequence b's keys, clamped to [0, capacity]: end = cache_seqlens[b] + n_new (capacity
    without lengths), start = cache_leftpad[b] (0 without)."""
    if HAS_SEQLENS:
        end = tl.load(SEQLENS + b) + n_new
    else:
        end = capacity + b * 0
    end = tl.minimum(tl.maximum(end, 0), capacity)
    if HAS_LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), end)
    else:
        start = end * 0
    return start, end


@triton.jit
def _cache_row(BIDX, b, n_rows, HAS_BIDX: tl.constexpr):
    """(cache row of sequence b in a contiguous cache, whether it is in range)."""
    if HAS_BIDX:
        cb = tl.load(BIDX + b)
    else:
        cb = b
    ok = (cb >= 0) & (cb < n_rows)
    return tl.where(ok, cb, 0).to(tl.int64), ok


@triton.jit
def _longest_tiles(SEQLENS, B, n_new, capacity, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Key tiles of the longest sequence, ``cdiv(max_b min(cache_seqlens[b] + n_new, capacity), BLOCK_N)``."""
    longest = B * 0
    for b0 in range(0, B, BLOCK_B):
        bb = b0 + tl.arange(0, BLOCK_B)
        ends = tl.load(SEQLENS + bb, mask=bb < B, other=0) + n_new
        longest = tl.maximum(longest, tl.max(tl.minimum(tl.maximum(ends, 0), capacity), 0))
    return tl.cdiv(longest, BLOCK_N)


@triton.jit(do_not_specialize=["B", "Hkv", "GROUP", "Nq", "n_new", "capacity", "n_blocks", "n_rows", "n_splits",
                               "n_mblk", "n_dsplit"])
def _kvcache_fwd_kernel(
    Q, K, V, O, M, L, SEQLENS, BT, BIDX, LEFTPAD,
    sqb, sqn, sqh, sqd,
    sk0, sk1, skh, skd,
    sv0, sv1, svh, svd,
    sbt,
    sob, soh, sos, son, sod,
    smb, smh, sms, smn,
    B, Hkv, GROUP, Nq, n_new, capacity, n_blocks, n_rows, scale, n_splits, n_mblk, n_dsplit,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_BIDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
    EVEN_D: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr, PF: tl.constexpr,
    BALANCE: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One (D-slice of O, row block, KV slice, sequence * KV head) program; 1-D grid, D-slice fastest.

    Q [B, Nq, Hq, D]; K/V paged [num_blocks, PAGE, Hkv, D] or contiguous [B_cache, capacity, Hkv, D] (s0, s1,
    sh, sd strides). Partial mode: O = normalised partial out [B, Hq, S, Nq, D] fp32, M = running max,
    L = running sum ([B, Hq, S, Nq] fp32). DIRECT (S = 1): O = out (as [B, Hq, 1, Nq, D] strides), M = lse.
    """
    pid = tl.program_id(0)
    dsp = pid % n_dsplit
    rest = pid // n_dsplit
    m_blk = rest % n_mblk
    rest = rest // n_mblk
    split = rest % n_splits
    bh = rest // n_splits
    b = bh // Hkv
    hk = (bh % Hkv).to(tl.int64)
    b64 = b.to(tl.int64)

    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Nq
    qi = rows % Nq
    hq = hk * GROUP + rows // Nq  # the query heads h with kv_head(h) == hk
    qi64 = qi.to(tl.int64)
    q_rows = Q + b64 * sqb + qi64 * sqn + hq * sqh
    offs_d = tl.arange(0, BLOCK_D)
    offs_do = dsp * BLOCK_DO + tl.arange(0, BLOCK_DO)
    if EVEN_D:
        q = tl.load(q_rows[:, None] + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_rows[:, None] + offs_d[None, :] * sqd,
                    mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    start, end = _seq_bounds(SEQLENS, LEFTPAD, b, n_new, capacity, HAS_SEQLENS, HAS_LEFTPAD)
    k_base = K + hk * skh
    v_base = V + hk * svh
    bt_row = BT + b64 * sbt
    if not PAGED:
        cb, cb_ok = _cache_row(BIDX, b, n_rows, HAS_BIDX)
        k_base = k_base + cb * sk0
        v_base = v_base + cb * sv0
        end = tl.where(cb_ok, end, start)  # a cache row out of range reads nothing
    # this program's run of the sequence's key tiles: the sequence takes S_b of the n_splits programs, S_b in
    # proportion to its tiles against the longest sequence's (BALANCE), so every program gets about the same
    # number of tiles whatever the lengths; the programs past S_b find no tile and exit
    t_lo = start // BLOCK_N
    tiles = tl.cdiv(end, BLOCK_N) - t_lo
    if BALANCE:
        longest = tl.maximum(_longest_tiles(SEQLENS, B, n_new, capacity, BLOCK_N, BLOCK_B), 1)
        n_sp = tl.minimum(tl.maximum(tl.cdiv(n_splits * tiles, longest), 1), n_splits)
    else:
        n_sp = n_splits
    per = tl.cdiv(tiles, n_sp)
    lo = (t_lo + split * per) * BLOCK_N
    hi = tl.minimum(lo + per * BLOCK_N, end)
    causal_off = end - Nq

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DO], tl.float32)
    # page ids are fetched one tile ahead (PF): the K/V loads then depend on a value already in registers,
    # so the pipeliner streams them with every stage instead of waiting on the id load each tile
    cols = lo + tl.arange(0, BLOCK_N)
    blk_next = page_ids(bt_row, lo, hi, cols, (cols >= start) & (cols < hi), PAGE, PAGED, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = (cols >= start) & (cols < hi)
        if PF:
            blk = blk_next
            nxt = cols + BLOCK_N
            blk_next = page_ids(bt_row, n0 + BLOCK_N, hi, nxt, (nxt >= start) & (nxt < hi), PAGE, PAGED, BLOCK_N)
        else:
            blk = page_ids(bt_row, n0, hi, cols, col_ok, PAGE, PAGED, BLOCK_N)
        blk, in_page, k_ok = key_rows(blk, n0, cols, col_ok, n_blocks, PAGE, PAGED, BLOCK_N)
        k_rows = blk * sk0 + in_page * sk1
        v_rows = blk * sv0 + in_page * sv1
        v_ok = k_ok
        # K as K^T tiles [D, BLOCK_N]: the load feeds the dot operand from shared memory, multi-buffered
        if EVEN_D:
            kt = tl.load(k_base + offs_d[:, None] * skd + k_rows[None, :], mask=k_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_base + offs_d[:, None] * skd + k_rows[None, :],
                         mask=k_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        s = _dot(q, kt, DOT_F32) * scale
        visible = k_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (cols[None, :] <= qi[:, None] + causal_off)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        alpha = tl.math.exp2((m_i - m_ref) * 1.4426950408889634)
        p = tl.math.exp2((s - m_ref[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_D:
            v = tl.load(v_base + v_rows[:, None] + offs_do[None, :] * svd, mask=v_ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + v_rows[:, None] + offs_do[None, :] * svd,
                        mask=v_ok[:, None] & (offs_do[None, :] < HEAD_DIM), other=0.0)
        acc = acc * alpha[:, None] + _dot(round_cast(p, v.dtype, DOT_F32), v, DOT_F32)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    split64 = split.to(tl.int64)
    o_rows = O + b64 * sob + hq * soh + split64 * sos + qi64 * son
    o_mask = row_ok[:, None]
    if not EVEN_D:
        o_mask = o_mask & (offs_do[None, :] < HEAD_DIM)
    tl.store(o_rows[:, None] + offs_do[None, :] * sod, round_cast(o, O.dtype.element_ty, DOT_F32), mask=o_mask)
    m_rows = b64 * smb + hq * smh + split64 * sms + qi64 * smn
    if dsp == 0:
        if DIRECT:
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(M + m_rows, lse, mask=row_ok)
        else:  # max and sum apart: the merge stays exact where m is huge
            tl.store(M + m_rows, tl.where(seen, m_i, float("-inf")), mask=row_ok)
            tl.store(L + m_rows, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["n_new", "Hkv", "capacity", "n_blocks", "n_rows"])
def _append_kernel(
    KN, VN, K, V, SEQLENS, BT, BIDX,
    snb, snn, snh, snd,
    svnb, svnn, svnh, svnd,
    sk0, sk1, skh, skd,
    sv0, sv1, svh, svd,
    sbt,
    n_new, Hkv, capacity, n_blocks, n_rows,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_BIDX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b * n_new + t): write token t of sequence b, all KV heads, at position cache_seqlens[b] + t.
    A position past the capacity, a page id or cache row out of range writes nothing."""
    pid = tl.program_id(0)
    b = pid // n_new
    t = pid % n_new
    b64 = b.to(tl.int64)
    pos = tl.load(SEQLENS + b) + t
    ok = (pos >= 0) & (pos < capacity)
    pos = tl.where(ok, pos, 0)
    if PAGED:
        blk = tl.load(BT + b64 * sbt + pos // PAGE)
        ok = ok & (blk >= 0) & (blk < n_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        k_dst = K + blk * sk0 + (pos % PAGE).to(tl.int64) * sk1
        v_dst = V + blk * sv0 + (pos % PAGE).to(tl.int64) * sv1
    else:
        cb, cb_ok = _cache_row(BIDX, b, n_rows, HAS_BIDX)
        ok = ok & cb_ok
        k_dst = K + cb * sk0 + pos.to(tl.int64) * sk1
        v_dst = V + cb * sv0 + pos.to(tl.int64) * sv1
    k_src = KN + b64 * snb + t.to(tl.int64) * snn
    v_src = VN + b64 * svnb + t.to(tl.int64) * svnn
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, Hkv, BLOCK_H):
        hh = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        m = tl.where(ok, (hh[:, None] < Hkv) & (offs_d[None, :] < HEAD_DIM), False)
        kx = tl.load(k_src + hh[:, None] * snh + offs_d[None, :] * snd, mask=m)
        tl.store(k_dst + hh[:, None] * skh + offs_d[None, :] * skd, kx, mask=m)
        vx = tl.load(v_src + hh[:, None] * svnh + offs_d[None, :] * svnd, mask=m)
        tl.store(v_dst + hh[:, None] * svh + offs_d[None, :] * svd, vx, mask=m)


@triton.jit(do_not_specialize=["B", "n_new", "Hkv", "capacity", "n_blocks", "n_rows", "total"])
def _gather_kernel(
    K, V, KO, VO, CU, SEQLENS, BT, BIDX, LEFTPAD,
    sk0, sk1, skh, skd,
    sv0, sv1, svh, svd,
    sbt, sot, soh,
    B, n_new, Hkv, capacity, n_blocks, n_rows, total,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, HAS_SEQLENS: tl.constexpr,
    HAS_BIDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, GUARD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (tile, b): copy keys [start_b + tile * BLOCK_T, ...) of sequence b (all KV heads) to packed rows
    CU[b] + (j - start_b) of KO / VO [total, Hkv, D] (out strides sot, soh, 1). Programs b == B zero the GUARD
    rows after the last sequence (those < total)."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    if b == B:
        dst = tl.load(CU + B) + offs_t
        t_ok = (offs_t < GUARD) & (dst < total)
        zero = tl.zeros([BLOCK_T, BLOCK_D], KO.dtype.element_ty)
        for h in range(0, Hkv):
            o = dst.to(tl.int64)[:, None] * sot + h * soh + offs_d[None, :]
            tl.store(KO + o, zero, mask=t_ok[:, None] & d_ok[None, :])
            tl.store(VO + o, zero, mask=t_ok[:, None] & d_ok[None, :])
    else:
        start, end = _seq_bounds(SEQLENS, LEFTPAD, b, n_new, capacity, HAS_SEQLENS, HAS_LEFTPAD)
        cols = start + offs_t
        col_ok = cols < end
        k_base = K
        v_base = V
        bt_row = BT + b.to(tl.int64) * sbt
        if PAGED:
            blk = tl.load(bt_row + cols // PAGE, mask=col_ok, other=0)
            blk_ok = (blk >= 0) & (blk < n_blocks)
            blk = tl.where(blk_ok, blk, 0).to(tl.int64)
            k_rows = blk * sk0 + (cols % PAGE).to(tl.int64) * sk1
            v_rows = blk * sv0 + (cols % PAGE).to(tl.int64) * sv1
        else:
            cb, blk_ok = _cache_row(BIDX, b, n_rows, HAS_BIDX)
            k_base = k_base + cb * sk0
            v_base = v_base + cb * sv0
            k_rows = cols.to(tl.int64) * sk1
            v_rows = cols.to(tl.int64) * sv1
        dst = tl.load(CU + b) + offs_t
        ok = col_ok & (dst < total)
        src_ok = tl.where(blk_ok, ok, False)  # a bad page id or cache row leaves zeros, never reads outside the cache
        for h in range(0, Hkv):
            o = dst.to(tl.int64)[:, None] * sot + h * soh + offs_d[None, :]
            kx = tl.load(k_base + k_rows[:, None] + h * skh + offs_d[None, :] * skd,
                         mask=src_ok[:, None] & d_ok[None, :], other=0.0)
            tl.store(KO + o, kx, mask=ok[:, None] & d_ok[None, :])
            vx = tl.load(v_base + v_rows[:, None] + h * svh + offs_d[None, :] * svd,
                         mask=src_ok[:, None] & d_ok[None, :], other=0.0)
            tl.store(VO + o, vx, mask=ok[:, None] & d_ok[None, :])


# -------------------------------------------------------------------------------------------- host side


def config_from(get: Callable[..., object]) -> KernelConfig:
    """The launch config a ``kvcache_fwd`` kernel spec records (``get``: its
    :meth:`~ffpa_attn.kernel_module.KernelSpec.get`, or a dict's ``get``): the planner's tiles
    (:func:`ffpa_attn.dispatch.kvcache.tiles`), run verbatim."""
    return KernelConfig(int(get("block_m")), int(get("block_n")), int(get("warps")), int(get("stages")),
                        (("block_do", int(get("block_do"))), ("pf", int(get("pf", 1)))))


def _tile(cfg: KernelConfig, d: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DO) of a config for head dim d."""
    block_d = pow2(d)
    return block_d, min(pow2(cfg.opt("block_do", block_d)), block_d)


def roofline(lens: list[int] | tuple[int, ...], hq: int, hkv: int, nq: int, d: int, splits: int = 1,
             elt: int = 2) -> dict:
    """Work of one non-causal call over sequences of ``lens`` keys: tensor-core FLOPs ``4 * L * Hq * Nq * D``
    (L = sum of lens; padding not counted), K/V bytes read once ``2 * L * Hkv * D * elt``, q + out bytes, fp32
    partial bytes (written and read back when ``splits`` > 1) and FLOP per K/V byte (``group * Nq`` at 2 bytes)."""
    total = float(sum(lens))
    b = len(lens)
    flops = 4.0 * total * hq * nq * d
    kv_bytes = 2.0 * total * hkv * d * elt
    qo_bytes = 2.0 * b * nq * hq * d * elt
    part_bytes = 0.0 if splits <= 1 else 2.0 * b * hq * splits * nq * (d + 2) * 4
    return {"flops": flops, "kv_bytes": kv_bytes, "qo_bytes": qo_bytes, "partial_bytes": part_bytes,
            "flop_per_byte": flops / max(kv_bytes, 1.0)}


def as_seqlens(cache_seqlens: int | torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
    """``cache_seqlens`` as a contiguous int32 ``[B]`` tensor on ``device`` (an int becomes a filled tensor: a
    device fill, no sync); None stays None (every sequence at the cache's capacity)."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return None if cache_seqlens is None else cache_seqlens.contiguous()
    return torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=device)


def _geometry(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> tuple[bool, int, int, int, int]:
    """(paged, page, capacity, num_blocks, cache rows) for the kernels' bounds."""
    paged = block_table is not None
    page = k_cache.shape[1] if paged else 1
    return paged, page, kvcache_capacity(k_cache, block_table), k_cache.shape[0], k_cache.shape[0]


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cache_seqlens: int | torch.Tensor, *, block_table: torch.Tensor | None = None,
              cache_batch_idx: torch.Tensor | None = None) -> None:
    """Write ``k / v [B, Nq_new, Hkv, D]`` into the caches in place at positions ``cache_seqlens[b] ..
    cache_seqlens[b] + Nq_new - 1`` (paged: through ``block_table``; contiguous: cache row
    ``cache_batch_idx[b]``). One launch, positions read on the device; a position past the capacity or a bad
    page id / cache row writes nothing (validate with :func:`check_kvcache` to get an error instead).
    With duplicate ``cache_batch_idx`` entries which sequence's values land is not defined (as in flash-attn).
    """
    batch, n_new, hkv, d = k.shape
    if batch == 0 or n_new == 0:
        return
    seqlens = as_seqlens(cache_seqlens, batch, k.device)
    paged, page, capacity, n_blocks, n_rows = _geometry(k_cache, block_table)
    block_d = pow2(d)
    block_h = min(pow2(hkv, lo=1), max(1, 8192 // block_d))
    bt = block_table if paged else seqlens
    bidx = cache_batch_idx if cache_batch_idx is not None else seqlens
    _append_kernel[(batch * n_new,)](
        k, v, k_cache, v_cache, seqlens, bt, bidx,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0) if paged else 0,
        n_new, hkv, capacity, n_blocks, n_rows,
        HEAD_DIM=d, PAGE=page, PAGED=paged, HAS_BIDX=cache_batch_idx is not None,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def kvcache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None = None,
                      cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                      n_new: int = 0, causal: bool = False, scale: float, cfg: KernelConfig,
                      splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over each sequence's cached keys (no append; validated inputs).

    Args:
        q: ``[B, Nq, Hq, D]`` (any strides).
        k_cache, v_cache: paged ``[num_blocks, page, Hkv, D]`` with ``block_table`` int32 ``[B, max_pages]``,
            or contiguous ``[B_cache, N_max, Hkv, D]`` (row ``cache_batch_idx[b]``, default b); unit D stride.
        cache_seqlens: int32 ``[B]`` (None: the full capacity); the sequence holds
            ``cache_seqlens[b] + n_new`` keys (``n_new``: tokens :func:`append_kv` just wrote).
        cache_leftpad: int32 ``[B]`` or None: keys before it are not part of the sequence.
        causal: tail-aligned per sequence; scale: softmax scale.
        cfg: tiles (:func:`default_config`); splits: KV slices per sequence (:func:`num_splits`).

    Returns:
        ``(out [B, Nq, Hq, D] contiguous in q.dtype, lse [B, Hq, Nq] fp32)``.
    """
    b, nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    rows = group * nq
    out = torch.empty(b, nq, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    paged, page, capacity, n_blocks, n_rows = _geometry(k_cache, block_table)
    block_d, block_do = _tile(cfg, d)
    n_dsplit = triton.cdiv(d, block_do)
    n_mblk = triton.cdiv(rows, cfg.block_m)
    splits = max(1, int(splits))
    o_buf, m_buf, l_buf, ostr, mstr = partial_buffers(out.transpose(1, 2), lse, splits)
    seqlens = cache_seqlens.contiguous() if cache_seqlens is not None else None
    dummy = seqlens if seqlens is not None else lse
    _kvcache_fwd_kernel[(n_dsplit * n_mblk * splits * b * hkv,)](
        q, k_cache, v_cache, o_buf, m_buf, l_buf, dummy,
        block_table if paged else dummy,
        cache_batch_idx.contiguous() if cache_batch_idx is not None else dummy,
        cache_leftpad.contiguous() if cache_leftpad is not None else dummy,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0) if paged else 0,
        *ostr, *mstr,
        b, hkv, group, nq, int(n_new), capacity, n_blocks, n_rows, float(scale), splits, n_mblk, n_dsplit,
        HEAD_DIM=d, PAGE=page, PAGED=paged, HAS_SEQLENS=seqlens is not None,
        HAS_BIDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None, CAUSAL=bool(causal),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DO=block_do,
        EVEN_D=(d == block_d), DIRECT=splits == 1, DOT_F32=q.device.type == "cpu", PF=bool(cfg.opt("pf", 1)),
        BALANCE=splits > 1 and seqlens is not None, BLOCK_B=min(pow2(b), 1024),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        launch_combine(o_buf, m_buf, l_buf, out.transpose(1, 2), lse, b * hq, nq, hq, out.stride(0),
                       out.stride(2), lse.stride(0), lse.stride(1), lse_only=False)
    return out, lse


def decode_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                   cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                   cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                   causal: bool = False, scale: float | None = None, cfg: KernelConfig,
                   splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's ``flash_attn_with_kvcache`` on validated inputs (:func:`ffpa_attn.contract.check_kvcache`):
    write ``k / v`` into the caches in place (:func:`append_kv`), attend over ``cache_seqlens + Nq_new`` keys per
    sequence (:func:`kvcache_attention`) with the tiles ``cfg`` and ``splits`` KV slices the caller decided.

    Returns ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``; the caches are mutated when k / v are given.
    """
    seqlens = as_seqlens(cache_seqlens, q.shape[0], q.device)
    n_new = 0
    if k is not None:
        append_kv(k_cache, v_cache, k, v, seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx)
        n_new = k.shape[1]
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return kvcache_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, n_new=n_new,
                             causal=causal, scale=scale, cfg=cfg, splits=splits)


def packed_total(k_cache: torch.Tensor, cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                 cache_leftpad: torch.Tensor | None, batch: int, n_new: int) -> torch.Tensor:
    """The keys all sequences hold (``sum_b min(cache_seqlens[b] + n_new, capacity) - leftpad_b``), clamped as the
    kernels clamp, as a 0-d device tensor (no sync)."""
    capacity = kvcache_capacity(k_cache, block_table)
    if cache_seqlens is None:
        ends = torch.full((batch,), capacity, dtype=torch.int64, device=k_cache.device)
    else:
        ends = (cache_seqlens.long() + n_new).clamp(0, capacity)
    starts = 0 if cache_leftpad is None else torch.minimum(cache_leftpad.long().clamp(min=0), ends)
    return (ends - starts).sum()


def paged_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                  v: torch.Tensor | None, *, cache_seqlens: torch.Tensor | None, block_table: torch.Tensor,
                  cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, causal: bool,
                  scale: float, varlen: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill over a paged cache in place, on validated inputs: append ``k / v``, then ``varlen`` -- the
    planner's varlen forward, ``(q [T_q, Hq, D], k_cache, v_cache, cu_q, None, max_q, max_k, seqused_k=,
    block_table=) -> (out [T_q, Hq, D], lse [Hq, T_q])``, which reads the pages through the table -- runs sequence
    b's ``Nq`` queries over its ``cache_seqlens[b] + Nq_new`` keys (no packed copy of the keys, no host sync).
    ``cache_leftpad`` is not supported on this route (the planner sends such calls to :func:`gather_forward`).
    Returns ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``.
    """
    del scale, cache_batch_idx  # the scale is bound into ``varlen``; a table has no cache rows
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad: the paged route reads keys from position 0 (use the gather route)")
    b, nq, hq, d = q.shape
    seqlens = as_seqlens(cache_seqlens, b, q.device)
    n_new = 0
    if k is not None:
        append_kv(k_cache, v_cache, k, v, seqlens, block_table=block_table)
        n_new = k.shape[1]
    capacity = kvcache_capacity(k_cache, block_table)
    if seqlens is None:
        used = torch.full((b,), capacity, dtype=torch.int32, device=q.device)
    else:
        used = (seqlens + n_new).to(torch.int32)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * nq
    out, lse = varlen(q.reshape(b * nq, hq, d), k_cache, v_cache, cu_q, None, nq, capacity, seqused_k=used,
                      block_table=block_table)
    return out.view(b, nq, hq, out.shape[-1]), lse.view(hq, b, nq).permute(1, 0, 2).contiguous()


def gather_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seqused_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int, *, max_total: int,
                  varlen: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """A varlen call over paged caches, packed for another varlen forward (validated inputs): sequence b's first
    ``seqused_k[b]`` keys go to packed THD buffers (:func:`gather_kv`, with the padding sequence over the unused
    rows), then ``varlen`` -- ``(q [T_q, Hq, D], k, v, cu_q, cu_k, max_q, max_k) -> (out [T_q, Hq, D],
    lse [Hq, T_q])`` -- runs the queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` over them. ``max_total``: rows of
    the buffers (0: the key count is read here, one device-to-host copy, or ``B * capacity`` while a CUDA graph is
    being captured)."""
    b = cu_seqlens_q.numel() - 1
    total = int(max_total)
    if total <= 0:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            total = b * kvcache_capacity(k_cache, block_table)
        else:
            total = int(packed_total(k_cache, seqused_k, block_table, None, b, 0))
    kp, vp, cu_k, max_k = gather_kv(k_cache, v_cache, seqused_k, block_table=block_table, batch=b,
                                    max_total=max(total, 1), pad_sequence=True, check_values=False)
    cu_q = torch.cat([cu_seqlens_q, cu_seqlens_q[-1:]])  # the padding sequence has no queries
    return varlen(q, kp, vp, cu_q, cu_k, max_seqlen_q, max_k)


def gather_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                   v: torch.Tensor | None, *, cache_seqlens: torch.Tensor | None, block_table: torch.Tensor | None,
                   cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, causal: bool,
                   scale: float, max_total: int, varlen: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked prefill on validated inputs: append ``k / v``, pack each sequence's keys (:func:`gather_kv`) and run
    ``varlen`` -- the planner's varlen forward, ``(q [T_q, Hq, D], k, v, cu_q, cu_k, max_q, max_k) -> (out
    [T_q, Hq, D], lse [Hq, T_q])`` -- over the packed chunk: sequence b's ``Nq`` queries against its keys, then a
    padding sequence of no queries over the buffer's unused rows.

    ``max_total``: rows of the packed buffers (at least the keys the sequences hold; the interface passes the count
    it read while validating). 0: the count is read here (one device-to-host copy), or, while a CUDA graph is being
    captured, the bound ``B * capacity`` is used. ``scale`` is the call's softmax scale (the varlen function takes
    it from its caller). Returns ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``.
    """
    del scale  # bound into ``varlen`` by the caller
    b, nq, hq, d = q.shape
    seqlens = as_seqlens(cache_seqlens, b, q.device)
    n_new = 0
    if k is not None:
        append_kv(k_cache, v_cache, k, v, seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx)
        n_new = k.shape[1]
    total = int(max_total)
    if total <= 0:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            total = b * kvcache_capacity(k_cache, block_table)
        else:
            total = int(packed_total(k_cache, seqlens, block_table, cache_leftpad, b, n_new))
    kp, vp, cu_k, max_k = gather_kv(k_cache, v_cache, seqlens, block_table=block_table,
                                    cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, batch=b,
                                    n_new=n_new, max_total=max(total, 1), pad_sequence=True, check_values=False)
    # sequence i's queries are rows [i * Nq, (i + 1) * Nq); the padding sequence has none
    cu_q = (torch.arange(b + 2, dtype=torch.int32, device=q.device) * nq).clamp_(max=b * nq)
    out, lse = varlen(q.reshape(b * nq, hq, d), kp, vp, cu_q, cu_k, nq, max_k)
    return out.view(b, nq, hq, out.shape[-1]), lse.view(hq, b, nq).permute(1, 0, 2).contiguous()


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: int | torch.Tensor | None, *,
              block_table: torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
              cache_leftpad: torch.Tensor | None = None, batch: int | None = None, n_new: int = 0,
              max_total: int | None = None, pad_sequence: bool = False,
              check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Copy each sequence's keys and values out of a cache into packed THD buffers, for the varlen forward.

    Long new chunks (chunked prefill: hundreds to thousands of queries onto a long cache) are MMA work that
    the split-KV kernel does with 16-row tiles; the varlen forward runs them with full query tiles. This
    helper gives it its inputs without a host sync: after :func:`append_kv` has written the chunk, the keys of
    sequence b (``[leftpad_b, cache_seqlens[b] + n_new)``) go to rows ``cu[b] .. cu[b+1]`` of ``[T, Hkv, D]``
    buffers, with ``cu`` built on the device from the lengths. ``T`` is an upper bound known on the host
    (``max_total``, default ``B * capacity``); rows past ``cu[B]`` are not part of any sequence (the first
    :data:`GATHER_GUARD_ROWS` of them are zeroed so that a tile read past the last sequence meets no NaN).

    Args:
        k_cache, v_cache, block_table, cache_batch_idx, cache_leftpad: as in :func:`kvcache_attention`.
        cache_seqlens: int or int32 ``[B]`` (None: full capacity); batch: B when cache_seqlens is an int or
            None and there is no table (default: the table's or the lengths' B, else the cache's rows).
        n_new: tokens already appended after ``cache_seqlens`` (counted into each sequence).
        max_total: rows of the buffers, at least the sum of the lengths (checked with ``check_values``; keys
            that do not fit are otherwise dropped).
        pad_sequence: append one more boundary ``T`` to ``cu`` (a padding sequence over the unused rows), so
            that ``cu`` ends at the packed length as the varlen contract asks; the queries' ``cu_seqlens_q``
            then needs its last entry repeated (a padding sequence of 0 queries), and ``max_seqlen_k`` covers it.
        check_values: validate with :func:`check_kvcache` (host sync; pass False under CUDA-graph capture).

    Returns:
        ``(k [T, Hkv, D], v [T, Hkv, D], cu_seqlens_k int32 [B + 1] (or [B + 2] with pad_sequence),
        max_seqlen_k)``: ``max_seqlen_k`` is the capacity (with pad_sequence: ``max(capacity, T)``), an upper
        bound the varlen forward accepts.
    """
    if batch is None:
        if block_table is not None:
            batch = block_table.shape[0]
        elif isinstance(cache_seqlens, torch.Tensor):
            batch = cache_seqlens.shape[0]
        elif cache_batch_idx is not None:
            batch = cache_batch_idx.shape[0]
        else:
            batch = k_cache.shape[0]
    check_kvcache(None, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, batch=batch, values=False)
    device = k_cache.device
    paged, page, capacity, n_blocks, n_rows = _geometry(k_cache, block_table)
    seqlens = as_seqlens(cache_seqlens, batch, device)
    total = batch * capacity if max_total is None else int(max_total)
    if check_values:
        check_kvcache_values(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, n_new)
    # per-sequence lengths and their boundaries, on the device (the kernel clamps the same way)
    if seqlens is None:
        ends = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    else:
        ends = (seqlens + n_new).clamp(0, capacity)
    starts = torch.zeros_like(ends) if cache_leftpad is None else torch.minimum(cache_leftpad.clamp(min=0), ends)
    cu = torch.zeros(batch + 1 + int(pad_sequence), dtype=torch.int32, device=device)
    cu[1:batch + 1] = torch.cumsum(ends - starts, 0, dtype=torch.int32)
    if pad_sequence:
        cu[batch + 1] = total
    if check_values:
        need = int(cu[batch])
        if need > total:
            raise ValueError(f"the sequences hold {need} keys, more than max_total = {total}")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_out = torch.empty(total, hkv, d, dtype=k_cache.dtype, device=device)
    v_out = torch.empty(total, hkv, d, dtype=v_cache.dtype, device=device)
    if batch and total:
        block_d = pow2(d)
        block_t = max(1, min(64, 8192 // block_d))
        block_t = 1 << (block_t.bit_length() - 1)
        dummy = cu
        grid = (triton.cdiv(max(capacity, GATHER_GUARD_ROWS), block_t), batch + 1)
        _gather_kernel[grid](
            k_cache, v_cache, k_out, v_out, cu, seqlens if seqlens is not None else dummy,
            block_table if paged else dummy,
            cache_batch_idx.contiguous() if cache_batch_idx is not None else dummy,
            cache_leftpad.contiguous() if cache_leftpad is not None else dummy,
            *k_cache.stride(), *v_cache.stride(),
            block_table.stride(0) if paged else 0, k_out.stride(0), k_out.stride(1),
            batch, int(n_new), hkv, capacity, n_blocks, n_rows, total,
            HEAD_DIM=d, PAGE=page, PAGED=paged, HAS_SEQLENS=seqlens is not None,
            HAS_BIDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None, GUARD=GATHER_GUARD_ROWS,
            BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
        )
    max_seqlen = max(capacity, total) if pad_sequence else capacity
    return k_out, v_out, cu, max_seqlen


__all__ = ["KERNEL_NAME", "GATHER_GUARD_ROWS", "config_from", "roofline", "as_seqlens", "append_kv",
           "kvcache_attention", "decode_forward", "packed_total", "paged_forward", "gather_varlen", "gather_forward",
           "gather_kv"]

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
the cache (it cannot give a right answer: :func:`check_kvcache` is what reports it).

Roofline of a decode step (``L = sum_b len_b`` cached keys, bf16): K/V bytes ``4 * L * Hkv * D`` (read once:
the group's query heads and the Nq new tokens share each read), q/out ``4 * B * Nq * Hq * D``, partials
``8 * B * Hq * S * Nq * D`` (fp32 write + read, a few % at most by the split rule below); FLOPs
``4 * L * Hq * Nq * D`` (non-causal), i.e. ``R = group * Nq`` FLOP per K/V byte. At the serving shape
(Hq = 32, Hkv = 8, D = 512): R = 4 (Nq = 1) and 16 (Nq = 4), against ~200 FLOP/B where an H200 turns
compute-bound: the kernel must stream K/V at the memory's rate and nothing else matters much (B = 32 at 4K
keys is 2.1 GB of K/V, ~0.5 ms). The MMA tiles are therefore the smallest ``tl.dot`` allows (BLOCK_M = 16
rows, mma.sync: idle rows cost tensor-core time that is free here) and the shared memory goes to K/V
pipeline stages and to a second program per SM (:func:`default_config`: 16-key tiles, 3 buffers, 112 KiB,
two programs per SM, ~190 KiB of loads in flight per SM against the ~40 KiB an SM's share of the bandwidth
times the latency needs). At R = 64 and more (Hkv = 2, Nq = 4) the 64-row tiles are MMA-bound and this
kernel is far from the copy rate (docs/design.md, "CuTeDSL kernels", has the packed split-KV decode path).

Split count (:func:`num_splits`, a pure function the caller evaluates and passes in): about two waves of
programs at the config's occupancy, rounded down to whole slice counts, capped so that a slice holds at
least 4 tiles and ``8 * R`` keys of the longest sequence (partials stay small next to the K/V reads).

Entry points (kernel level; no host sync and lengths / tables read on the device only, so they run under
CUDA-graph capture and fit a torch.library op whose fake implementation gives out like q and lse
``[B, Hq, Nq]`` fp32): :func:`kvcache_forward` (append + attention), :func:`kvcache_attention`,
:func:`append_kv`, :func:`gather_kv` (packed THD copy of the cached keys, for chunked prefill through the
varlen forward), :func:`check_kvcache` (host validation, eager only), :func:`default_config`,
:func:`num_splits`, :func:`occupancy`, :func:`roofline`, :func:`smem_bytes`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.combine import launch_combine, pow2
from .autotune import KernelConfig
from .common import round_cast
from .splitkv import _dot

KERNEL_NAME = "kvcache_fwd"
MAX_SPLITS = 256
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
def _page_ids(BT_ROW, n0, hi, cols, col_ok, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-table entries of key positions ``cols = n0 + arange(BLOCK_N)`` (n0 a multiple of BLOCK_N; nothing
    is read at or past ``hi``): one scalar where the tile lies inside one page, else one per key row (0
    without a table)."""
    if PAGED:
        if PAGE % BLOCK_N == 0:
            blk = tl.load(BT_ROW + n0 // PAGE, mask=n0 < hi, other=0)
        else:
            blk = tl.load(BT_ROW + cols // PAGE, mask=col_ok, other=0)
    else:
        blk = n0 * 0
    return blk


@triton.jit
def _key_rows(blk, n0, cols, col_ok, n_blocks, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block, row inside the block) of key positions ``cols = n0 + arange(BLOCK_N)`` of one sequence (int64;
    contiguous caches: block 0, row = position), and the keys that may be read: col_ok and, paged, a block id
    in [0, n_blocks) (a bad id is clamped to block 0 and its keys masked)."""
    if PAGED:
        if PAGE % BLOCK_N == 0:  # consecutive rows of one page
            in_page = ((n0 % PAGE) + tl.arange(0, BLOCK_N)).to(tl.int64)
        else:
            in_page = (cols % PAGE).to(tl.int64)
        ok = (blk >= 0) & (blk < n_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        ok = tl.where(ok, col_ok, False)  # (a scalar ok: the interpreter mistypes scalar & vector masks)
    else:
        in_page = cols.to(tl.int64)
        ok = col_ok
    return blk, in_page, ok


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
    blk_next = _page_ids(bt_row, lo, hi, cols, (cols >= start) & (cols < hi), PAGE, PAGED, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = (cols >= start) & (cols < hi)
        if PF:
            blk = blk_next
            nxt = cols + BLOCK_N
            blk_next = _page_ids(bt_row, n0 + BLOCK_N, hi, nxt, (nxt >= start) & (nxt < hi), PAGE, PAGED, BLOCK_N)
        else:
            blk = _page_ids(bt_row, n0, hi, cols, col_ok, PAGE, PAGED, BLOCK_N)
        blk, in_page, k_ok = _key_rows(blk, n0, cols, col_ok, n_blocks, PAGE, PAGED, BLOCK_N)
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


# opt-in shared memory per block by compute-capability major (the planner passes the device's own number)
_SMEM_BY_ARCH = {8: 166912, 9: 232448, 10: 232448, 12: 101376}


def _tile(cfg: KernelConfig, d: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DO) of a config for head dim d."""
    block_d = pow2(d)
    return block_d, min(pow2(cfg.opt("block_do", block_d)), block_d)


def smem_bytes(cfg: KernelConfig, d: int, elt: int = 2) -> int:
    """Shared memory of the attention kernel: the resident Q tile plus the K^T / V tile buffers, ``num_stages - 1``
    of them for the mma.sync tiles (BLOCK_M < 64: what Triton 3.6-3.9 allocate for sm80 / sm90, the compiler's
    own number in tests/test_kvcache_triton.py), ``num_stages`` for the 64-row wgmma tiles on sm90."""
    block_d, block_do = _tile(cfg, d)
    bufs = max(cfg.num_stages - (cfg.block_m < 64), 1)
    return bufs * cfg.block_n * (block_d + block_do) * elt + cfg.block_m * block_d * elt


def acc_regs(cfg: KernelConfig, d: int) -> int:
    """fp32 O-accumulator registers per thread."""
    return cfg.block_m * _tile(cfg, d)[1] // (32 * cfg.num_warps)


def default_config(d: int, rows: int, page_size: int | None, arch: int | None,
                   smem_limit: int | None = None) -> KernelConfig:
    """The tile config for head dim ``d``, ``rows = group * Nq`` query rows per KV head, a paged cache's page
    size (None: contiguous) on a GPU of compute-capability major ``arch`` (None: the Triton interpreter).

    BLOCK_M: the rows rounded up to 16 / 32 / 64, at most 64 KiB of resident Q (more rows: several row blocks,
    the later ones reading the K/V tiles from L2). 16-row tiles up to D = 512 run on 4 warps, others on 8; O's columns
    split over programs (BLOCK_DO) where the fp32 accumulator would pass 64 registers per thread (every warp
    of a mma.sync QK^T also holds the Q operand of its rows, ~128 registers at D = 512). K/V tiles of 16 keys
    (32 at D <= 256) in four pipeline stages (three buffers) where they fit: at D = 512 a program takes
    112 KiB of shared memory and ~190 registers, two programs share an SM, and each keeps 96 KiB of K/V loads
    in flight; on an H200 it streamed K/V faster than 32-key tiles on 8 warps (three buffers, 208 KiB, one
    program per SM) and than 16-key tiles on 8 warps, at every page size and Nq in {1, 4} that
    :mod:`ffpa_attn.bench.kvcache` measured. Above D = 512 (padded D 1024) 32-key tiles on 8 warps with a
    single buffer (160 KiB) measured faster than the 16-key pipelines on 4 warps. The page size does not
    change the tile: a tile inside one page loads one page id, a tile over several pages one id per key row.
    """
    block_d = pow2(d)
    # Q stays resident: at most 64 KiB of it (D = 1024: 32 rows), more rows take more row blocks
    block_m = max(16, min(16 if rows <= 16 else (32 if rows <= 32 else 64), 32768 // block_d))
    if arch is None:  # interpreter: the smallest tiles run fastest on numpy
        return KernelConfig(block_m, 16, 4, 1, (("block_do", block_d),))
    num_warps = 4 if block_m == 16 and block_d <= 512 else 8
    block_do = block_d
    while block_m * block_do > 64 * 32 * num_warps:
        block_do //= 2
    limit = (smem_limit or _SMEM_BY_ARCH.get(arch, 101376)) - 8 * 1024
    opts = (("block_do", block_do),)
    if block_d > 512:  # 32-key tiles on 8 warps, even with one buffer, beat 16-key pipelines here
        tiles = ((32, 2), (16, 3), (16, 2))
    else:
        bn = 32 if block_d <= 256 else 16
        tiles = ((bn, 4), (bn, 3), (bn, 2))
    for bn, stages in tiles:
        cfg = KernelConfig(block_m, bn, num_warps, stages, opts)
        if smem_bytes(cfg, d) <= limit:
            return cfg
    return KernelConfig(block_m, 16, num_warps, 1, opts)


def occupancy(cfg: KernelConfig, d: int, smem_limit: int = _SMEM_BY_ARCH[9]) -> int:
    """Programs of ``cfg`` one SM holds (1..4): by shared memory (:func:`smem_bytes` plus 1 KiB reserved per
    program) and by registers at Triton's cap of 255 per thread (4 warps: 2, 8 warps: 1)."""
    by_smem = (smem_limit + 1024) // (smem_bytes(cfg, d) + 1024)
    by_regs = 65536 // (255 * 32 * cfg.num_warps) if cfg.num_warps <= 8 else 1
    return max(1, min(4, by_smem, by_regs))


def num_splits(batch: int, hkv: int, rows: int, max_len: int, sm_count: int, *, cfg: KernelConfig, d: int,
               smem_limit: int = _SMEM_BY_ARCH[9]) -> int:
    """KV slices per sequence for :func:`kvcache_attention` (a pure function: the caller evaluates it once per
    shape bucket, e.g. with ``max_len`` the cache capacity or a known bound, and passes the result in).

    About two waves of programs (``2 * occupancy * sm_count``, rounded down to whole slice counts so the last
    wave is not a sliver): the kernel hands a sequence a share of the ``S`` programs in proportion to its
    length, so with ragged lengths every program still gets about the same number of keys, and a second wave
    evens out what is left. Never slices shorter than 4 tiles or ``8 * rows`` keys of a ``max_len`` sequence:
    the fp32 partials (``rows x D`` per slice, written and read back) then stay below ~25% of the slice's K/V
    bytes.

    Args:
        batch, hkv: sequences and KV heads; rows: query rows per KV head (``Hq // Hkv * Nq``).
        max_len: the longest sequence the call may see (keys); sm_count: the GPU's SMs.
        cfg, d: the tile config the launch will use and the head dim; smem_limit: shared memory per SM.
    """
    block_do = _tile(cfg, d)[1]
    per_split = max(1, batch * hkv * triton.cdiv(rows, cfg.block_m) * triton.cdiv(d, block_do))
    tiles = triton.cdiv(max(int(max_len), 1), cfg.block_n)
    min_tiles = max(4, triton.cdiv(8 * rows, cfg.block_n))
    cap = max(1, min(MAX_SPLITS, tiles // min_tiles))
    want = (2 * occupancy(cfg, d, smem_limit) * max(int(sm_count), 1)) // per_split
    return max(1, min(want, cap))


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


def _is_paged(block_table: torch.Tensor | None) -> bool:
    return block_table is not None


def _capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Keys one sequence can hold: ``max_pages * page`` (paged) or ``N_max`` (contiguous)."""
    if block_table is not None:
        return block_table.shape[1] * k_cache.shape[1]
    return k_cache.shape[1]


def as_seqlens(cache_seqlens: int | torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
    """``cache_seqlens`` as a contiguous int32 ``[B]`` tensor on ``device`` (an int becomes a filled tensor: a
    device fill, no sync); None stays None (every sequence at the cache's capacity)."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return None if cache_seqlens is None else cache_seqlens.contiguous()
    return torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=device)


def _int32_vector(t: torch.Tensor | None, name: str, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [B]), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the cache on {device}")


def _check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
                        cache_batch_idx: torch.Tensor | None, batch: int) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "[num_blocks, page, Hkv, D]" if block_table is not None else "[B_cache, N_max, Hkv, D]"
            hint = (" (a flat [tokens, Hkv, D] paged cache is addressed by a block table as its "
                    "[tokens // page, page, Hkv, D] view)" if t.dim() == 3 else "")
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}{hint}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name}.dtype must be torch.float16 or torch.bfloat16, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on the head dim, got strides {tuple(t.stride())}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} {v_cache.device} must match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [B, max_pages] with B = {batch}, got "
                             f"{tuple(block_table.shape)}")
        if block_table.shape[1] > 0 and block_table.stride(1) != 1:
            raise ValueError(f"block_table must have a unit stride along its pages, got {tuple(block_table.stride())}")
        if block_table.device != k_cache.device:
            raise ValueError(f"block_table is on {block_table.device}, the cache on {k_cache.device}")
        page = k_cache.shape[1]
        if page < 16 or page % 16:
            raise ValueError(f"the page size (k_cache.shape[1]) must be a positive multiple of 16, got {page}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table maps each "
                             "sequence to its pages)")
    else:
        _int32_vector(cache_batch_idx, "cache_batch_idx", batch, k_cache.device)
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than the batch ({batch}); pass "
                             "cache_batch_idx to map sequences to cache rows")


def check_kvcache(q: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                  cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                  batch: int | None = None, values: bool = True) -> None:
    """Validate a KV-cache call; raises TypeError (dtypes) or ValueError (shapes, layouts, values).

    Always (no device access, fine under CUDA-graph capture and torch.compile): ranks, shapes, dtypes (fp16 /
    bf16 data, int32 lengths, tables and indices), devices, unit stride on D for the caches, page size a
    multiple of 16, block_table and cache_batch_idx not together, k and v together and only with lengths.
    With ``values=True`` (eager only: it reads lengths and tables to the host, a device sync; refused while a
    CUDA graph is being captured): ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + Nq_new <=`` capacity,
    ``0 <= cache_leftpad[b] <= cache_seqlens[b]``, cache rows in ``[0, B_cache)``, and every block-table entry
    of a page the sequence occupies in ``[0, num_blocks)`` (entries past a sequence's pages are never read
    and may hold anything, e.g. transformers' -1). Callers that guarantee valid tables (a serving engine
    that built them, a CUDA-graph replay) pass ``values=False``; the kernels then still clamp every index,
    so a bad entry reads and writes nothing outside the cache, but the result is not defined.

    Args:
        q: ``[B, Nq, Hq, D]`` (None: cache-only calls such as :func:`gather_kv`; then ``batch`` gives B).
        k_cache, v_cache: ``[num_blocks, page, Hkv, D]`` with ``block_table``, else ``[B_cache, N_max, Hkv, D]``.
        k, v: new keys / values ``[B, Nq_new, Hkv, D]`` (written at ``cache_seqlens``) or None.
        cache_seqlens: int or int32 ``[B]``; None = full capacity (not allowed with k / v).
        block_table: int32 ``[B, max_pages]``; cache_batch_idx, cache_leftpad: int32 ``[B]``.
    """
    if q is not None:
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 4:
            raise ValueError(f"q must be 4-D [B, Nq, Hq, D], got shape {tuple(q.shape)}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"q.dtype must be torch.float16 or torch.bfloat16, got {q.dtype}")
        batch = q.shape[0]
    if batch is None:
        raise ValueError("check_kvcache needs q or batch")
    _check_cache_layout(k_cache, v_cache, block_table, cache_batch_idx, batch)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if q is not None:
        if q.dtype != k_cache.dtype or q.device != k_cache.device:
            raise ValueError(f"q ({q.dtype}, {q.device}) and k_cache ({k_cache.dtype}, {k_cache.device}) must "
                             "share dtype and device")
        if q.shape[3] != d:
            raise ValueError(f"q's head dim {q.shape[3]} != the cache's {d}")
        if hkv < 1 or q.shape[2] % hkv:
            raise ValueError(f"Hq = {q.shape[2]} must be a multiple of the cache's Hkv = {hkv}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    n_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("appending k / v needs cache_seqlens (where the new tokens go)")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != k_cache.dtype or t.device != k_cache.device:
                raise ValueError(f"{name} ({t.dtype}, {t.device}) must match the cache ({k_cache.dtype}, "
                                 f"{k_cache.device})")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != (hkv, d):
                raise ValueError(f"{name} must have shape [B, Nq_new, Hkv, D] = [{batch}, *, {hkv}, {d}], got "
                                 f"{tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        n_new = k.shape[1]
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        _int32_vector(cache_seqlens, "cache_seqlens", batch, k_cache.device)
    _int32_vector(cache_leftpad, "cache_leftpad", batch, k_cache.device)
    if values:
        _check_values(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, n_new)


def _check_values(k_cache: torch.Tensor, cache_seqlens: int | torch.Tensor | None,
                  block_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                  cache_leftpad: torch.Tensor | None, batch: int, n_new: int) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("checking KV-cache lengths and tables reads them on the host, which a CUDA graph "
                           "capture forbids: validate before capture and pass check_values=False inside it")
    capacity = _capacity(k_cache, block_table)
    if cache_seqlens is None:
        ends = torch.full((batch,), capacity, dtype=torch.int64)
    else:
        seq = (torch.full((batch,), int(cache_seqlens), dtype=torch.int64) if isinstance(cache_seqlens, int)
               else cache_seqlens.detach().cpu().long())
        neg = (seq < 0).nonzero()
        if len(neg):
            i = int(neg[0])
            raise ValueError(f"cache_seqlens[{i}] = {int(seq[i])} is negative")
        ends = seq + n_new
        over = (ends > capacity).nonzero()
        if len(over):
            i = int(over[0])
            raise ValueError(f"sequence {i}: cache_seqlens {int(seq[i])} + {n_new} new tokens = {int(ends[i])} "
                             f"is past the cache's capacity of {capacity} keys")
    starts = torch.zeros(batch, dtype=torch.int64)
    if cache_leftpad is not None:
        starts = cache_leftpad.detach().cpu().long()
        bad = ((starts < 0) | (starts > ends - n_new)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"cache_leftpad[{i}] = {int(starts[i])} must lie in [0, cache_seqlens[{i}] = "
                             f"{int(ends[i]) - n_new}]")
    if cache_batch_idx is not None:
        idx = cache_batch_idx.detach().cpu().long()
        bad = ((idx < 0) | (idx >= k_cache.shape[0])).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"cache_batch_idx[{i}] = {int(idx[i])} is outside the cache's {k_cache.shape[0]} rows")
    if block_table is not None:
        page, n_blocks = k_cache.shape[1], k_cache.shape[0]
        table = block_table.detach().cpu().long()
        pages = torch.arange(table.shape[1]).unsqueeze(0)
        used = (pages >= (starts // page).unsqueeze(1)) & (pages < ((ends + page - 1) // page).unsqueeze(1))
        bad = (used & ((table < 0) | (table >= n_blocks))).nonzero()
        if len(bad):
            b, p = (int(x) for x in bad[0])
            raise ValueError(f"block_table[{b}, {p}] = {int(table[b, p])} is outside the cache's {n_blocks} "
                             f"blocks (sequence {b} occupies pages {int(starts[b]) // page}.."
                             f"{(int(ends[b]) + page - 1) // page - 1})")


def _geometry(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> tuple[bool, int, int, int, int]:
    """(paged, page, capacity, num_blocks, cache rows) for the kernels' bounds."""
    paged = block_table is not None
    page = k_cache.shape[1] if paged else 1
    return paged, page, _capacity(k_cache, block_table), k_cache.shape[0], k_cache.shape[0]


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
    if splits == 1:
        o_buf, m_buf, l_buf = out, lse, lse
        ostr = (out.stride(0), out.stride(2), 0, out.stride(1), out.stride(3))
        mstr = (lse.stride(0), lse.stride(1), 0, lse.stride(2))
    else:
        o_buf = torch.empty(b, hq, splits, nq, d, dtype=torch.float32, device=q.device)
        m_buf, l_buf = torch.empty(2, b, hq, splits, nq, dtype=torch.float32, device=q.device).unbind(0)
        ostr, mstr = o_buf.stride(), m_buf.stride()
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


def kvcache_forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                    cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                    cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                    causal: bool = False, scale: float | None = None, cfg: KernelConfig, splits: int,
                    check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn's ``flash_attn_with_kvcache`` at kernel level: validate (:func:`check_kvcache`; the value
    checks only with ``check_values``), write ``k / v`` into the caches in place (:func:`append_kv`), attend
    over ``cache_seqlens + Nq_new`` keys per sequence (:func:`kvcache_attention`).

    ``cfg`` and ``splits`` are the caller's (:func:`default_config`, :func:`num_splits`). Under CUDA-graph
    capture pass ``check_values=False``. Returns ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``; the caches are
    mutated when k / v are given.
    """
    from ..contract import default_scale

    check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, values=check_values)
    seqlens = as_seqlens(cache_seqlens, q.shape[0], q.device)
    n_new = 0
    if k is not None:
        append_kv(k_cache, v_cache, k, v, seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx)
        n_new = k.shape[1]
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return kvcache_attention(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table,
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, n_new=n_new,
                             causal=causal, scale=scale, cfg=cfg, splits=splits)


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
        _check_values(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, n_new)
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


__all__ = ["KERNEL_NAME", "MAX_SPLITS", "GATHER_GUARD_ROWS", "default_config", "num_splits", "roofline",
           "smem_bytes", "acc_regs", "occupancy", "as_seqlens", "check_kvcache", "append_kv", "kvcache_attention",
           "kvcache_forward", "gather_kv"]

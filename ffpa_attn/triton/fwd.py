"""Triton split-D FFPA forward, dense ``[B, H, N, D]`` and varlen (packed ``[T, H, D]``), one kernel body.

Math per program (one query block of ``BLOCK_M`` rows, one query head, one batch entry / sequence, and one
of ``NSPLIT`` column slices of the output)::

    S  = scale * (Q1 K1^T + Q2 K2^T) (+ bias)        Q = [Q1 | Q2], widths D1 = 2^floor(log2 D), D2 >= D - D1
    m' = max(m, rowmax S);  P = exp(S - m');  l = l e^(m-m') + rowsum P
    O_j = O_j e^(m-m') + dropout(P) V_j                 the output slice as two accumulators DV1 + DV2
    out = O / l,  lse = m + log l                        (0 and -inf for rows that saw no key)

Why two accumulators: Triton tensors have power-of-two shapes, and padding D=320 to 512 would waste 37%
of the MMA work; D = D1 + D2 wastes at most the pad of the small second part. ``NSPLIT > 1`` splits the
output columns over programs (each recomputes S) for D where one program's fp32 O would not fit the
register file (D=1024: 64 x 1024 x 4 B = 256 KiB, the whole SM).

The softmax runs in base 2 (``qk_scale = scale * log2 e``); lse is converted back to the natural log.
Causal is tail-aligned (``common.causal_visible``): the KV loop stops at the block's last visible key, and
tiles below the diagonal run without masks (a second loop handles the diagonal and the N tail). GQA reads
KV head ``common.kv_head(h, GROUP)``. Dropout draws ``common.dropout_keep`` with counter ``(col, row,
b*Hq+h, offset)`` dense and ``(packed col, packed row, h, offset)`` varlen; (seed, offset) are loaded from
the int64 ``rng`` tensor inside the kernel (no host sync). The attention mask is read through the
stride-0 view of ``contract.canonical_mask`` (never expanded). Every base offset is 64-bit.

Memory paths: on sm90+ K/V tiles come through host tensor descriptors (TMA; 4-D over [B, H, N, D] dense,
3-D over [T, H, D] varlen, zero fill past N and D; ``TritonBackend.enable_tma``), elsewhere (sm80, strides
that are not 16-byte aligned, the interpreter by default) through masked pointer loads. Paged varlen K/V
(``block_table``: caches [num_blocks, page, Hkv, D]) always take pointer loads: a key tile's rows are found through
the block table (``common.page_ids`` / ``common.key_rows``, the KV-cache kernel's lookup), one entry per tile where
the page is a multiple of BLOCK_N, else one per key row. Configs
(``BLOCK_M``, ``BLOCK_N``, warps, stages, output split, TMA) come from :mod:`ffpa_attn.triton.autotune`:
shipped H200 defaults, the on-disk cache, or a search over :func:`candidate_configs`.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..contract import canonical_mask
from ..common import device as hw
from . import autotune
from .autotune import KernelConfig
from .common import (add_float_mask, causal_visible, dropout_keep, dropout_threshold, key_rows, kv_head, page_ids,
                     round_cast, tma_layout_ok)

KERNEL_NAME = "ffpa_fwd"
LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------ device


@triton.jit
def _attn_tile(
    acc1, acc2, m_i, l_i, q1, q2,
    k_base, v_base, mask_rows, start_n, offs_m, offs_n, seqlen_k, causal_off,
    skn, skd, svn, svd, smn, qk_scale,
    seed, rng_off, rng_head, row_off, col_off, p_thresh, v_col0,
    kd1, kd2, vd1, vd2, tma_b, tma_h, bt_row, n_blocks, skb, svb,
    USE_TMA: tl.constexpr, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV1: tl.constexpr, DV2: tl.constexpr,
    V_DMASK: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_F32: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    """One (query block, key block) step of the online softmax; returns the updated (acc1, acc2, m, l).

    q1 [BM, D1], q2 [BM, D2]; acc1 [BM, DV1], acc2 [BM, DV2] fp32; m_i, l_i [BM] fp32 (base-2 running max
    and denominator). MASKED: this tile may cross the N tail or the causal diagonal. USE_TMA: K/V tiles come
    from tensor descriptors kd1/kd2/vd1/vd2 (dense [B, H, N, D] at (tma_b, tma_h, row, col); varlen
    [T, H, D] at (col_off + row, tma_h, col)) with zero fill past N and D, else from k_base/v_base pointers.
    PAGED: k_base/v_base point at the KV head of paged caches [num_blocks, PAGE, Hkv, D] (block strides skb/svb,
    row strides skn/svn) and key position j of the sequence is row j % PAGE of block bt_row[j // PAGE].
    """
    cols = start_n + offs_n
    if PAGED:  # one block-table entry per tile where the tile lies in one page, else one per key row
        col_ok = cols < seqlen_k
        blk = page_ids(bt_row, start_n, seqlen_k, cols, col_ok, PAGE, True, BLOCK_N)
        blk, in_page, _ = key_rows(blk, start_n, cols, col_ok, n_blocks, PAGE, True, BLOCK_N)
        kp = k_base + (blk * skb + in_page * skn)[:, None]
        vp = v_base + (blk * svb + in_page * svn)[:, None]
    else:
        kp = k_base + tl.cast(start_n, tl.int64) * skn + offs_n[:, None] * skn
        vp = v_base + tl.cast(start_n, tl.int64) * svn + offs_n[:, None] * svn
    d1 = tl.arange(0, D1)
    if USE_TMA:
        if IS_VARLEN:
            k1 = kd1.load([col_off + start_n, tma_h, 0]).reshape([BLOCK_N, D1])
        else:
            k1 = kd1.load([tma_b, tma_h, start_n, 0]).reshape([BLOCK_N, D1])
    elif MASKED:
        kmask = offs_n[:, None] < seqlen_k - start_n
        k1 = tl.load(kp + d1[None, :] * skd, mask=kmask, other=0.0)
    else:
        k1 = tl.load(kp + d1[None, :] * skd)
    if DOT_F32:
        s = tl.dot(q1.to(tl.float32), tl.trans(k1.to(tl.float32)))
    else:
        s = tl.dot(q1, tl.trans(k1))
    if D2 > 0:
        d2 = D1 + tl.arange(0, D2)
        if USE_TMA:
            if IS_VARLEN:
                k2 = kd2.load([col_off + start_n, tma_h, D1]).reshape([BLOCK_N, D2])
            else:
                k2 = kd2.load([tma_b, tma_h, start_n, D1]).reshape([BLOCK_N, D2])
        else:
            if MASKED:
                k2mask = (offs_n[:, None] < seqlen_k - start_n) & (d2[None, :] < HEAD_DIM)
            else:
                k2mask = (offs_n[:, None] >= 0) & (d2[None, :] < HEAD_DIM)
            k2 = tl.load(kp + d2[None, :] * skd, mask=k2mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q2.to(tl.float32), tl.trans(k2.to(tl.float32)), s)
        else:
            s = tl.dot(q2, tl.trans(k2), s)
    s = s * qk_scale
    if MASK_KIND != 0:
        mptr = mask_rows[:, None] + cols[None, :].to(tl.int64) * smn
        if MASKED:
            mv = tl.load(mptr, mask=offs_n[None, :] < seqlen_k - start_n, other=0)
        else:
            mv = tl.load(mptr)
        if MASK_KIND == 1:
            s = tl.where(mv != 0, s, float("-inf"))
        else:
            s = add_float_mask(s, mv, 1.4426950408889634)
    if MASKED:
        vis = offs_n[None, :] < seqlen_k - start_n
        if IS_CAUSAL:
            vis = vis & causal_visible(offs_m, cols, causal_off)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED or MASK_KIND != 0:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, rng_off, rng_head, row_off + offs_m, col_off + cols, p_thresh)
        p = tl.where(keep, p, 0.0)
    dv1 = v_col0 + tl.arange(0, DV1)
    if USE_TMA:
        if IS_VARLEN:
            v1 = vd1.load([col_off + start_n, tma_h, v_col0]).reshape([BLOCK_N, DV1])
        else:
            v1 = vd1.load([tma_b, tma_h, start_n, v_col0]).reshape([BLOCK_N, DV1])
    elif MASKED:
        vmask1 = offs_n[:, None] < seqlen_k - start_n
        if V_DMASK:
            vmask1 = vmask1 & (dv1[None, :] < HEAD_DIM)
        v1 = tl.load(vp + dv1[None, :] * svd, mask=vmask1, other=0.0)
    elif V_DMASK:
        v1 = tl.load(vp + dv1[None, :] * svd, mask=dv1[None, :] < HEAD_DIM, other=0.0)
    else:
        v1 = tl.load(vp + dv1[None, :] * svd)
    acc1 = acc1 * alpha[:, None]
    if DOT_F32:
        acc1 = tl.dot(p, v1.to(tl.float32), acc1)
    else:
        acc1 = tl.dot(p.to(v1.dtype), v1, acc1)
    if DV2 > 0:
        dv2 = v_col0 + DV1 + tl.arange(0, DV2)
        if USE_TMA:
            if IS_VARLEN:
                v2 = vd2.load([col_off + start_n, tma_h, v_col0 + DV1]).reshape([BLOCK_N, DV2])
            else:
                v2 = vd2.load([tma_b, tma_h, start_n, v_col0 + DV1]).reshape([BLOCK_N, DV2])
        else:
            vmask2 = dv2[None, :] < HEAD_DIM
            if MASKED:
                vmask2 = vmask2 & (offs_n[:, None] < seqlen_k - start_n)
            v2 = tl.load(vp + dv2[None, :] * svd, mask=vmask2, other=0.0)
        acc2 = acc2 * alpha[:, None]
        if DOT_F32:
            acc2 = tl.dot(p, v2.to(tl.float32), acc2)
        else:
            acc2 = tl.dot(p.to(v2.dtype), v2, acc2)
    return acc1, acc2, m_new, l_i


@triton.jit
def _ffpa_fwd_kernel(
    Q, K, V, O, LSE, MASK, RNG, CU_Q, CU_K, KD1, KD2, VD1, VD2, SEQUSED, BT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    slb, slh, slm, smb, smh, smm, smn, sbt,
    HQ, NQ, NKV, n_blocks, qk_scale, p_thresh, p_scale,
    HEAD_DIM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV1: tl.constexpr, DV2: tl.constexpr,
    NSPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_F32: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, HAS_SEQUSED: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr,
):
    """Grid: (query blocks of max(Nq), Hq * NSPLIT, B). Dense strides are (batch, head, row, dim); varlen
    passes batch stride 0 and row strides over packed tokens, and the sequence offsets come from CU_Q/CU_K.
    LSE strides: dense (b, h, row); varlen (0, h, token). KD1/KD2/VD1/VD2: K/V tensor descriptors when
    USE_TMA (block shapes [1, 1, BLOCK_N, D1|D2|DV1|DV2] dense, [BLOCK_N, 1, ...] varlen), else unused.
    HAS_SEQUSED (varlen): sequence b uses its first SEQUSED[b] keys. PAGED (varlen, with HAS_SEQUSED): K/V are
    paged caches [num_blocks, PAGE, Hkv, D] (the batch strides carry the block strides), sequence b's keys are
    addressed through block-table row BT + b * sbt, its key count SEQUSED[b] is clamped to NKV (the table's
    capacity) and CU_K is not read.
    """
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heavy (late, causal) query blocks first
    pid_hs = tl.program_id(1)
    pid_b = tl.program_id(2)
    h = pid_hs // NSPLIT
    split = pid_hs % NSPLIT
    hk = kv_head(h, GROUP)
    m0 = pid_m * BLOCK_M
    if IS_VARLEN:
        q_start = tl.load(CU_Q + pid_b)
        seqlen_q = tl.load(CU_Q + pid_b + 1) - q_start
        if PAGED:  # keys start at position 0 of the sequence's pages; the table bounds the count
            k_start = q_start * 0
            seqlen_k = tl.minimum(tl.maximum(tl.load(SEQUSED + pid_b), 0), NKV)
        else:
            k_start = tl.load(CU_K + pid_b)
            seqlen_k = tl.load(CU_K + pid_b + 1) - k_start
            if HAS_SEQUSED:
                seqlen_k = tl.minimum(tl.maximum(tl.load(SEQUSED + pid_b), 0), seqlen_k)
        q_row0 = q_start.to(tl.int64)
        k_row0 = k_start.to(tl.int64)
        rng_head = h
        row_off = q_start
        col_off = k_start
        q_off = q_row0 * sqm
        k_off = k_row0 * skn
        v_off = k_row0 * svn
        o_off = q_row0 * som
        l_off = q_row0 * slm
    else:
        q_start = 0
        seqlen_q = NQ
        seqlen_k = NKV
        bb = pid_b.to(tl.int64)
        rng_head = pid_b * HQ + h
        row_off = 0
        col_off = 0
        q_off = bb * sqb
        k_off = bb * skb
        v_off = bb * svb
        o_off = bb * sob
        l_off = bb * slb
    if m0 >= seqlen_q:
        return
    q_base = Q + q_off + h.to(tl.int64) * sqh + m0.to(tl.int64) * sqm
    k_base = K + k_off + hk.to(tl.int64) * skh
    v_base = V + v_off + hk.to(tl.int64) * svh
    bt_row = BT + pid_b.to(tl.int64) * sbt
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < seqlen_q - m0

    d1 = tl.arange(0, D1)
    q1 = tl.load(q_base + offs_m[:, None] * sqm + d1[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    if D2 > 0:
        d2 = D1 + tl.arange(0, D2)
        q2 = tl.load(q_base + offs_m[:, None] * sqm + d2[None, :] * sqd,
                     mask=row_ok[:, None] & (d2[None, :] < HEAD_DIM), other=0.0)
    else:
        q2 = q1
    acc1 = tl.zeros([BLOCK_M, DV1], dtype=tl.float32)
    if DV2 > 0:
        acc2 = tl.zeros([BLOCK_M, DV2], dtype=tl.float32)
    else:
        acc2 = acc1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    V_DMASK: tl.constexpr = NSPLIT * (DV1 + DV2) != HEAD_DIM
    v_col0 = split * (DV1 + DV2)

    if MASK_KIND != 0:
        mrow = tl.minimum(m0 + offs_m, seqlen_q - 1)  # tail rows read a valid address
        mask_rows = MASK + pid_b.to(tl.int64) * smb + h.to(tl.int64) * smh + mrow.to(tl.int64) * smm
    else:
        mask_rows = offs_m
    if HAS_DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
    else:
        seed = 0
        rng_off = 0

    # KV range: [0, full_hi) needs no mask; [full_hi, hi) holds the causal diagonal and the N tail
    if IS_CAUSAL:
        causal_off = seqlen_k - seqlen_q
        hi = tl.maximum(tl.minimum(seqlen_k, m0 + BLOCK_M + causal_off), 0)
        full_hi = tl.maximum(tl.minimum(seqlen_k, m0 + 1 + causal_off), 0)
        full_hi = (full_hi // BLOCK_N) * BLOCK_N
    else:
        causal_off = 0
        hi = seqlen_k
        full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    offs_m_abs = m0 + offs_m
    for start_n in tl.range(0, full_hi, BLOCK_N, warp_specialize=WARP_SPEC):
        acc1, acc2, m_i, l_i = _attn_tile(
            acc1, acc2, m_i, l_i, q1, q2, k_base, v_base, mask_rows, start_n, offs_m_abs, offs_n, seqlen_k,
            causal_off, skn, skd, svn, svd, smn, qk_scale, seed, rng_off, rng_head, row_off, col_off,
            p_thresh, v_col0, KD1, KD2, VD1, VD2, pid_b, hk, bt_row, n_blocks, skb, svb, USE_TMA, IS_VARLEN, HEAD_DIM,
            D1, D2, DV1, DV2, V_DMASK, BLOCK_N, False, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, DOT_F32, PAGED, PAGE)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc1, acc2, m_i, l_i = _attn_tile(
            acc1, acc2, m_i, l_i, q1, q2, k_base, v_base, mask_rows, start_n, offs_m_abs, offs_n, seqlen_k,
            causal_off, skn, skd, svn, svd, smn, qk_scale, seed, rng_off, rng_head, row_off, col_off,
            p_thresh, v_col0, KD1, KD2, VD1, VD2, pid_b, hk, bt_row, n_blocks, skb, svb, USE_TMA, IS_VARLEN, HEAD_DIM,
            D1, D2, DV1, DV2, V_DMASK, BLOCK_N, True, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, DOT_F32, PAGED, PAGE)

    empty = l_i == 0.0
    inv = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv = inv * p_scale
    o_base = O + o_off + h.to(tl.int64) * soh + m0.to(tl.int64) * som
    dv1 = v_col0 + tl.arange(0, DV1)
    omask1 = row_ok[:, None]
    if V_DMASK:
        omask1 = omask1 & (dv1[None, :] < HEAD_DIM)
    tl.store(o_base + offs_m[:, None] * som + dv1[None, :] * sod,
             round_cast(acc1 * inv[:, None], O.dtype.element_ty, DOT_F32), mask=omask1)
    if DV2 > 0:
        dv2 = v_col0 + DV1 + tl.arange(0, DV2)
        tl.store(o_base + offs_m[:, None] * som + dv2[None, :] * sod,
                 round_cast(acc2 * inv[:, None], O.dtype.element_ty, DOT_F32), mask=row_ok[:, None] & (dv2[None, :] < HEAD_DIM))
    if split == 0:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        l_ptr = LSE + l_off + h.to(tl.int64) * slh + (m0 + offs_m).to(tl.int64) * slm
        tl.store(l_ptr, lse, mask=row_ok)


# -------------------------------------------------------------------------------------------------- host


def split_dims(d: int) -> tuple[int, int]:
    """(D1, D2): D1 the largest power of two <= d, D2 the next power of two >= d - D1 (0 if none; min 16)."""
    d1 = 1 << (d.bit_length() - 1)
    rest = d - d1
    if rest == 0:
        return max(d1, 16), 0
    return d1, max(16, 1 << (rest - 1).bit_length())


def output_dims(d: int, nsplit: int) -> tuple[int, int]:
    """(DV1, DV2) of one of ``nsplit`` output column slices (widths of ceil(d / nsplit) split like D)."""
    return split_dims(-(-d // nsplit))


def smem_estimate(d: int, cfg: KernelConfig, elem: int = 2) -> int:
    """Bytes of shared memory the config needs (Q resident + num_stages K/V tiles; a planning estimate,
    ``tools/compile_report.py`` gives the compiler's number)."""
    d1, d2 = split_dims(d)
    nsplit = cfg.opt("nsplit", 1)
    dv1, dv2 = output_dims(d, nsplit)
    stages = max(cfg.num_stages, 1)
    q_rows = cfg.block_m if cfg.block_m >= 64 else 0  # below 64 rows (mma.sync) Q stays in registers
    return elem * (q_rows * (d1 + d2) + stages * cfg.block_n * (d1 + d2 + dv1 + dv2))


def acc_regs(d: int, cfg: KernelConfig) -> int:
    """fp32 O-accumulator registers per thread of the config."""
    dv1, dv2 = output_dims(d, cfg.opt("nsplit", 1))
    return cfg.block_m * (dv1 + dv2) // (32 * cfg.num_warps)


# O-accumulator registers per thread allowed for the one "wide" tile (see _wide): BLOCK_M 128 on 8 warps with
# descriptor loads, BLOCK_N 32, 2 stages, no split -- each warpgroup owns 64 rows and all D1 + D2 <= 384 columns, so
# S is computed once (no split recompute). sm_90a (tools/compile_report.py): D1 + D2 = 272 / 320 no spills (225 / 242
# registers); 384: 255 registers, 2-5 spill stores outside the KV loop, none inside, for the plain / varlen / GQA /
# fp16 variants (Triton 3.9; Triton 3.6 puts 24-35 spill instructions in the loop at 384 and still measures the
# same speed); with a mask or dropout it spills heavily inside the loop, so it is offered to plain calls only. It beats
# the best split tile by ~40% at D = 384 (docs/design.md, "Triton kernels").
WIDE_ACC_REGS = 192


def _wide(d: int, c: KernelConfig) -> bool:
    """The wide unsplit tile (:data:`WIDE_ACC_REGS`) for head dim ``d``."""
    return (c.opt("nsplit", 1) == 1 and bool(c.opt("tma", False)) and not c.opt("ws") and c.block_m == 128
            and c.num_warps == 8 and c.block_n == 32 and c.num_stages == 2 and 128 < acc_regs(d, c) <= WIDE_ACC_REGS)


def _all_configs(d: int, mode: str, tma: bool, ws: bool | None) -> list[KernelConfig]:
    out = []
    warps = (4, 8, 16) if mode == "max" else (4, 8)
    for nsplit in (1, 2):
        for bm in (32, 64, 128):
            for bn in (16, 32, 64, 128):
                for w in warps:
                    for s in (1, 2, 3):
                        if tma and s == 1:
                            continue  # unpipelined descriptor loads stage through registers and spill
                        opts = {"nsplit": nsplit}
                        if tma:
                            opts["tma"] = True
                        out.append(KernelConfig(bm, bn, w, s).with_options(**opts))
                        if tma and ws and nsplit == 1:  # Triton 3.6 ignores it on sm90 (same PTX)
                            out.append(KernelConfig(bm, bn, w, s).with_options(ws=True, **opts))
    return out


def candidate_configs(d: int, causal: bool, device: torch.device | None, mode: str = "fast", *,
                      tma: bool = False, ws: bool | None = None,
                      smem: int | None = None, plain: bool = True) -> list[KernelConfig]:
    """Configs worth trying for head dim ``d`` on ``device``, best guess first.

    Pruned by the shared-memory estimate against the device's limit (so sm80's 163 KiB gets smaller
    tiles; ``smem`` overrides the limit) and by O-accumulator registers per thread (<= 128 of the 255 a
    thread may hold, 160 in 'max' mode; 16 warps cap a thread at 128 registers, so they need <= 64). The
    rules come from ``tools/compile_report.py`` on sm90: no spills at <= 128 accumulator registers with 8
    warps; 16 warps and 1-stage descriptor loads spill. ``nsplit=2`` (output columns over two programs, S
    recomputed by each) serves BLOCK_M >= 64 where one warpgroup's O at BLOCK_M=64 exceeds 128 registers
    (D1 + D2 > 256): it keeps the wgmma path with a 64 x D/2 accumulator on 4 warps; the fast set then holds
    the 4 best unsplit and the 2 best split guesses. ``mode="max"`` widens the set;
    ``tma`` / ``ws``: tensor-descriptor and warp-specialized variants. ``plain`` (no mask, no dropout): the one
    wide unsplit tile (:func:`_wide`, up to :data:`WIDE_ACC_REGS` accumulator registers) is offered, first.
    """
    del causal
    if smem is None and (device is None or device.type != "cuda"):
        # interpreter: one small config (the interpreter ignores warps/stages; small tiles run fastest)
        opts = {"nsplit": 1, **({"tma": True} if tma else {})}
        return [KernelConfig(32 if d >= 512 else 64, 32, 4, 1).with_options(**opts)]
    limit = (smem if smem is not None else hw.smem_limit(device)) - 8 * 1024  # compiler scratch
    if mode == "max":
        limit = limit * 5 // 4  # the estimate is conservative; a config that does not fit fails to launch
    scored = []
    for c in _all_configs(d, mode, tma, ws):
        nsplit = c.opt("nsplit")
        regs = acc_regs(d, c)
        cap = 64 if c.num_warps == 16 else (160 if mode == "max" else 128)
        if plain and _wide(d, c) and smem_estimate(d, c) <= limit:
            scored.append(((0,), c))  # before every (nsplit, ...) score
            continue
        if not 16 <= regs <= cap or smem_estimate(d, c) > limit:
            continue
        if nsplit > 1 and (c.block_m < 64 or acc_regs(d, KernelConfig(64, 16, 4, 1)) <= 128):
            continue  # split the output only where one warpgroup's O (BLOCK_M=64: the wgmma M) does not fit
        if c.block_m == 32 and d <= 384:
            continue
        if c.block_n == 128 and d > 256:
            continue
        if c.block_n == 16 and d <= 256:
            continue
        if mode == "fast" and (c.num_stages == 3 and d > 256 and nsplit == 1 or c.block_n == 16 and d < 512 and tma):
            continue
        # best guess first: no split, BLOCK_M 64, 2 stages, BLOCK_N 32 with descriptors (16 with pointer
        # loads, whose per-thread addresses cost registers: BLOCK_N 32 spills at D=320 on sm80), more
        # accumulator registers; split: BLOCK_M 64 on one warpgroup, 3 stages, BLOCK_N 32 (faster than unsplit at
        # D=512: docs/design.md, "Triton kernels")
        bn_pref = 32 if (tma or d <= 256) else 16
        if nsplit > 1:
            score = (nsplit, abs(c.block_m - 64), abs(c.num_stages - 3), abs(c.block_n - 32), c.num_warps,
                     int(bool(c.opt("ws"))))
        else:
            score = (nsplit, abs(c.block_m - 64), abs(c.num_stages - 2), abs(c.block_n - bn_pref), -regs,
                     int(bool(c.opt("ws"))))
        scored.append((score, c))
    if not scored:  # small shared memory (sm80 at D >= 640): the smallest tiles that fit
        fits = [c for c in _all_configs(d, mode, tma, ws)
                if 16 <= acc_regs(d, c) <= 128 and smem_estimate(d, c) <= limit]
        scored = [((smem_estimate(d, c) * -1, c.opt("nsplit")), c) for c in fits]
    scored.sort(key=lambda t: t[0])
    out = [c for _, c in scored]
    if mode != "fast":
        return out
    split = [c for c in out if c.opt("nsplit", 1) > 1]  # the fast set tries both kinds where both exist
    return (out[:4] + split[:2]) if split and len(out) - len(split) >= 4 else out[:6]


def _tune_key(d: int, causal: bool, mask_kind: int, dropout: bool, varlen: int, dtype: torch.dtype,
              nq: int, nkv: int, group: int, tma: bool) -> tuple:
    return (str(dtype).replace("torch.", ""), d, int(causal), mask_kind, int(dropout), int(varlen),
            int(group > 1), int(tma), autotune.bucket(nq), autotune.bucket(nkv))


def _default_key(key: tuple) -> tuple:
    """The tuned-defaults key: no sequence-length buckets, and varlen / GQA share the dense MHA entry
    (same tiles; only the sequence offsets and the KV-head index differ)."""
    dtype, d, causal, mask, drop, _varlen, _gqa, tma = key[:8]
    return (dtype, d, causal, mask, drop, 0, 0, tma)


def _plain_key(key: tuple) -> tuple:
    """The tuned-defaults key of the same dtype/D/causal/TMA without mask, dropout, varlen or GQA."""
    dtype, d, causal, _mask, _drop, _varlen, _gqa, tma = key[:8]
    return (dtype, d, causal, 0, 0, 0, 0, tma)


def tma_possible(*tensors: torch.Tensor) -> bool:
    """Whether K/V can be read through TMA descriptors: sm90+ (any device under the interpreter) and the
    layout rule of :func:`common.tma_layout_ok`."""
    if not hw.interpreter_on():
        for t in tensors:
            if hw.capability_major(t.device) < 9:
                return False
    return tma_layout_ok(*tensors)


def _use_tma(config, tensors) -> bool:
    want = getattr(config, "enable_tma", None)
    if want is False:
        return False
    if want is None and hw.interpreter_on():
        return False  # the interpreter tests TMA only when asked explicitly
    return tma_possible(*tensors)


def _make_descs(k: torch.Tensor, v: torch.Tensor, d: int, cfg: KernelConfig, varlen: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    d1, d2 = split_dims(d)
    dv1, dv2 = output_dims(d, cfg.opt("nsplit", 1))
    bn = cfg.block_n

    def desc(t: torch.Tensor, width: int):
        if width == 0:
            width = 16
        block = [bn, 1, width] if varlen else [1, 1, bn, width]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    return desc(k, d1), desc(k, d2), desc(v, dv1), desc(v, dv2)


def _launch(cfg: KernelConfig, q, k, v, out, lse, mask, rng, cu_q, cu_k, strides, hq, nq, nkv, grid_m, nbatch,
            group, d, causal, scale, dropout_p, mask_kind, varlen, warmup=False, seqused=None, block_table=None):
    d1, d2 = split_dims(d)
    nsplit = cfg.opt("nsplit", 1)
    dv1, dv2 = output_dims(d, nsplit)
    tma = bool(cfg.opt("tma", False))
    descs = _make_descs(k, v, d, cfg, varlen) if tma else (k, k, v, v)
    grid = (triton.cdiv(grid_m, cfg.block_m), hq * nsplit, nbatch)
    dummy = q
    kernel = _ffpa_fwd_kernel.warmup if warmup else _ffpa_fwd_kernel[grid]
    extra = {"grid": grid} if warmup else {}
    return kernel(
        q, k, v, out, lse, mask if mask is not None else dummy, rng if rng is not None else dummy,
        cu_q if cu_q is not None else dummy, cu_k if cu_k is not None else dummy, *descs,
        seqused if seqused is not None else dummy, block_table if block_table is not None else dummy,
        *strides, block_table.stride(0) if block_table is not None else 0, hq, nq, nkv,
        k.shape[0] if block_table is not None else 0, scale * LOG2E,
        dropout_threshold(dropout_p) if dropout_p > 0 else 0, 1.0 / (1.0 - dropout_p),
        HEAD_DIM=d, D1=d1, D2=d2, DV1=dv1, DV2=dv2, NSPLIT=nsplit, GROUP=group, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, IS_CAUSAL=causal, MASK_KIND=mask_kind, HAS_DROPOUT=dropout_p > 0,
        IS_VARLEN=varlen, DOT_F32=hw.interpreter_on(), USE_TMA=tma, WARP_SPEC=bool(cfg.opt("ws", False)),
        HAS_SEQUSED=seqused is not None, PAGED=block_table is not None,
        PAGE=k.shape[1] if block_table is not None else 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )


def _mask_view(attn_mask: torch.Tensor | None, b: int, hq: int, nq: int, nkv: int):
    if attn_mask is None:
        return None, 0, (0, 0, 0, 0)
    m = canonical_mask(attn_mask, b, hq, nq, nkv)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
        kind = 1
    else:
        kind = 2
    return m, kind, tuple(m.stride())


def _select(d: int, causal: bool, device: torch.device, config, key: tuple, tma: bool, bench,
            forced: KernelConfig | None) -> KernelConfig:
    if forced is not None:
        return forced
    mode = getattr(config, "autotune_mode", "fast")
    tune = bool(getattr(config, "autotune", True))
    plain_problem = key[3] == 0 and not key[4]  # no mask, no dropout
    cands = candidate_configs(d, causal, device, mode, tma=tma, ws=getattr(config, "enable_ws", None),
                              plain=plain_problem)
    if not tune:  # no search: the tuned default of the feature-less problem is the best first guess
        plain = autotune.tuned_default(KERNEL_NAME, hw.gpu_name(device), _plain_key(key))
        if plain is not None and (plain_problem or not _wide(d, plain)):  # the wide tile spills with features
            cands = [plain] + [c for c in cands if c != plain]
    return autotune.pick_config(KERNEL_NAME, key, cands, bench, device=device,
                                fingerprint=autotune.source_fingerprint(__file__), autotune=tune, mode=mode,
                                default_key=_default_key(key))


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config, kernel_config=None,
                  warmup=False):
    """Split-D forward. q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (any strides), attn_mask broadcastable
    to ``[B, Hq, Nq, Nkv]`` (bool keep / float bias) or None, rng int64 ``[2]`` (seed, offset) when
    dropout_p > 0. Returns ``(out [B, Hq, Nq, D] (q's layout), lse [B, Hq, Nq] fp32)``.

    ``kernel_config`` (benchmarks, tests) forces a :class:`KernelConfig`, bypassing the autotuner;
    ``warmup=True`` (with it) only compiles the kernel and returns Triton's compiled kernel object instead
    (``n_regs`` / ``n_spills`` after it is loaded on a GPU).
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    mask, mask_kind, mstr = _mask_view(attn_mask, b, hq, nq, nkv)
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(), *mstr)
    tma = _use_tma(config, (k, v)) if kernel_config is None else bool(kernel_config.opt("tma", False))
    key = _tune_key(d, causal, mask_kind, dropout_p > 0, False, q.dtype, nq, nkv, hq // hkv, tma)

    def run(cfg: KernelConfig, warm: bool = False):
        return _launch(cfg, q, k, v, out, lse, mask, rng, None, None, strides, hq, nq, nkv, nq, b, hq // hkv, d,
                       causal, scale, dropout_p, mask_kind, False, warm)

    if warmup:
        return run(kernel_config, True)

    cfg = _select(d, causal, q.device, config, key, tma, lambda c: autotune.bench_ms(lambda: run(c)),
                  kernel_config)
    run(cfg)
    return out, lse


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config,
                   kernel_config=None, seqused_k=None, block_table=None):
    """Packed forward. q ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]``, cu_q/cu_k int32 ``[B+1]``; one launch over
    (query blocks of max_q, heads, sequences). Returns ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)``.

    ``seqused_k`` int32 ``[B]``: sequence b uses only its first ``seqused_k[b]`` keys. With ``block_table`` int32
    ``[B, max_pages]`` (and ``seqused_k``, required then), k/v are paged caches ``[num_blocks, page, Hkv, D]`` (any
    strides with a unit stride on D, any page size) read in place through the table; ``cu_k`` is not read (may be
    None). Inputs validated by the caller (:func:`ffpa_attn.contract.check_paged_varlen`); lengths and block ids are
    clamped in the kernel, so bad values read nothing outside the caches.
    """
    tq, hq, d = q.shape
    paged = block_table is not None
    hkv = k.shape[2] if paged else k.shape[1]
    nbatch = cu_q.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device)
    if nbatch == 0 or max_q == 0 or tq == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if paged:  # the batch-stride slots carry the block strides; rows are a page's rows
        kvs = (k.stride(0), k.stride(2), k.stride(1), k.stride(3), v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        max_k = block_table.shape[1] * k.shape[1]  # the kernel clamps each key count to the table's capacity
    else:
        kvs = (0, k.stride(1), k.stride(0), k.stride(2), 0, v.stride(1), v.stride(0), v.stride(2))
    strides = (0, q.stride(1), q.stride(0), q.stride(2), *kvs, 0, out.stride(1), out.stride(0), out.stride(2),
               0, lse.stride(0), lse.stride(1), 0, 0, 0, 0)
    # paged K/V rows are gathered through the table: no tensor descriptor covers them
    tma = False if paged else (_use_tma(config, (k, v)) if kernel_config is None
                               else bool(kernel_config.opt("tma", False)))
    key = _tune_key(d, causal, 0, dropout_p > 0, 2 if paged else 1, q.dtype, max_q, max_k, hq // hkv, tma)
    seqused = seqused_k.contiguous() if seqused_k is not None else None

    def run(cfg: KernelConfig):
        _launch(cfg, q, k, v, out, lse, None, rng, cu_q, cu_k, strides, hq, max_q, max_k, max_q, nbatch,
                hq // hkv, d, causal, scale, dropout_p, 0, True, seqused=seqused, block_table=block_table)

    cfg = _select(d, causal, q.device, config, key, tma, lambda c: autotune.bench_ms(lambda: run(c)),
                  kernel_config)
    run(cfg)
    return out, lse

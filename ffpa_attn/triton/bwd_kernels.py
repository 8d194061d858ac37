"""Triton device code of the split-D backward: delta preprocess, K/V-stationary dK/dV(/dQ) kernel, dQ kernel.

Math (per query head; ``s = scale * q.k + bias``, ``P = exp(s - lse)``, dropout keep-mask ``Z``, ``r = 1/(1-p)``):

    dV   = (P * Z * r)^T dO
    dP   = (dO V^T) * Z * r
    dS   = P * (dP - delta),       delta = rowsum(dO * O) - dlse
    dK   = scale * dS^T Q,         dQ = scale * dS K,         d(bias) = dS

Split-D: a dK/dV program owns one key block and one D-slice ``[ds0, ds0 + DS)`` of dK/dV (fp32 registers;
64 x 256 x 2 fp32 is half the register file, so D is split over programs). For every query block it
recomputes ``S^T = K Q^T`` and ``dP^T = V dO^T`` over the full D: a pipelined loop over the BK-wide column
chunks outside its slice, then the slice's own columns, whose Q/dO tiles the updates reuse:
``dV_s += P^T dO_s``, ``dK_s += dS^T Q_s`` and (fused mode) ``dQ_s += scale * dS K_s`` into an fp32 buffer
(TMA reduce-add or atomics). The K/V slice stays in shared memory for the whole program (TMA path). Work
with s slices: 2s + 3 GEMM units against 5 (S and dP are recomputed per slice). The dQ kernel (split /
deterministic mode) is query-stationary, same structure with the roles of Q and K swapped.

Index conventions shared with the forward (``common.py``): tail-aligned causal (``causal_visible``), GQA
(``kv_head``), and the dropout counter ``(col, row, head, offset)`` (``dropout_keep``): dense kernels pass
in-sequence rows/cols and ``head = b * Hq + h``; varlen kernels the packed row/col and ``head = h``.
``VARLEN`` switches the sequence bookkeeping only: ``row0``/``col0`` (packed start) and the per-sequence
lengths come from ``cu_seqlens`` while the batch stride is 0; the body is shared.

Rows whose lse is ``-inf`` (they saw no key) get P = 0, hence zero gradients and no NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import add_float_mask, causal_visible, dropout_keep, kv_head, round_cast

LOG2E = 1.4426950408889634  # host side
_LOG2E = tl.constexpr(LOG2E)  # device side


@triton.jit
def _mm(a, b, acc, INTERP: tl.constexpr):
    """acc += a @ b (fp32 accumulate). INTERP (set only under TRITON_INTERPRET=1): exact fp32 operands,
    because the interpreter's bf16 dot is wrong and its default fp32 dot emulates tf32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, NQ, NKV, VARLEN: tl.constexpr):
    """(row0, nq, col0, nkv): packed start (int64) and length of sequence ``b`` (dense: 0, NQ, 0, NKV)."""
    if VARLEN:
        q_lo = tl.load(CU_Q + b)
        k_lo = tl.load(CU_K + b)
        nq = tl.load(CU_Q + b + 1) - q_lo
        nkv = tl.load(CU_K + b + 1) - k_lo
        row0 = q_lo.to(tl.int64)
        col0 = k_lo.to(tl.int64)
    else:
        row0 = 0
        nq = NQ
        col0 = 0
        nkv = NKV
    return row0, nq, col0, nkv


@triton.jit
def _tile_probs(s, lse, rows, cols, nq, nkv, causal_off, mask_ptr, smm, smn, qk_scale,
                CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, TRANS: tl.constexpr):
    """P = exp(scale * s + bias - lse) with 0 where the (row, col) pair is not visible.

    s: fp32 raw scores, [len(rows), len(cols)] (TRANS=False) or [len(cols), len(rows)] (TRANS=True).
    lse: fp32 [len(rows)] (natural log; -inf = empty row). rows/cols: in-sequence query/key indices.
    mask_ptr: the (b, h) base of the canonical [Nq, Nkv] mask view (MASK_KIND 0 none, 1 bool, 2 float).
    """
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E  # empty row -> exp2(-inf) = 0
    if TRANS:
        rr = rows[None, :]
        cc = cols[:, None]
    else:
        rr = rows[:, None]
        cc = cols[None, :]
    z = s * qk_scale
    valid = (rr < nq) & (cc < nkv)
    if MASK_KIND != 0:
        mptrs = mask_ptr + rr.to(tl.int64) * smm + cc.to(tl.int64) * smn
        if MASK_KIND == 1:
            valid = valid & (tl.load(mptrs, mask=valid, other=0) != 0)
        else:  # the forward's floor rule, so P matches the forward's softmax
            z = add_float_mask(z, tl.load(mptrs, mask=valid, other=0.0), _LOG2E)
    if TRANS:
        z = z - lse[None, :]
    else:
        z = z - lse[:, None]
    if CAUSAL:
        vis = causal_visible(rows, cols, causal_off)
        if TRANS:
            vis = tl.trans(vis)
        valid = valid & vis
    return tl.where(valid, tl.math.exp2(z), 0.0)


@triton.jit
def _tile_keep(seed, rng_off, head, rows, cols, p_thresh, TRANS: tl.constexpr):
    """The forward's dropout keep-mask for (rows, cols), laid out like the score tile (see _tile_probs)."""
    keep = dropout_keep(seed, rng_off, head, rows, cols, p_thresh)
    if TRANS:
        keep = tl.trans(keep)
    return keep


@triton.jit
def _tile(desc, base, r0, rows, nrows, stride_r, c0, D, stride_c, W: tl.constexpr, USE_TMA: tl.constexpr,
          TRANS: tl.constexpr):
    """Tile of rows ``r0 + [0, len(rows))`` and columns ``c0 + [0, W)`` ([rows, W]; TRANS: [W, rows]), zero
    past ``nrows`` and ``D``. USE_TMA: through ``desc`` (block [len(rows), W]), else masked pointer loads from
    ``base`` (the sequence's row 0); ``rows`` = r0 + arange."""
    if USE_TMA:
        t = desc.load([r0, c0])
        if TRANS:
            t = tl.trans(t)
    else:
        cols = c0 + tl.arange(0, W)
        r64 = rows.to(tl.int64)
        if TRANS:
            t = tl.load(base + r64[None, :] * stride_r + cols[:, None] * stride_c,
                        mask=(rows < nrows)[None, :] & (cols < D)[:, None], other=0.0)
        else:
            t = tl.load(base + r64[:, None] * stride_r + cols[None, :] * stride_c,
                        mask=(rows < nrows)[:, None] & (cols < D)[None, :], other=0.0)
    return t


@triton.jit
def _desc(base, nrows, D, stride_r, R: tl.constexpr, W: tl.constexpr, USE_TMA: tl.constexpr):
    """A [nrows, D] tensor descriptor with [R, W] blocks (None without TMA)."""
    if USE_TMA:
        desc = tl.make_tensor_descriptor(base, shape=[nrows, D], strides=[stride_r, 1], block_shape=[R, W])
    else:
        desc = None
    return desc


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DQA, DK, DV, MASK, DMASK, RNG, CU_Q, CU_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    slb, slh, slm, sdb, sdh, sdm,
    sab, sah, sam, sad, sgb, sgh, sgn, sgd,
    smb, smh, smm, smn, sxb, sxh, sxm, sxn,
    HQ, HKV, NQ, NKV, D, D0, NSLICE, scale, qk_scale, p_thresh, p_scale,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr,
    NJ: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_GRAD: tl.constexpr,
    DMASK_ATOMIC: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    USE_TMA: tl.constexpr, INTERP: tl.constexpr,
):
    """dK/dV for key block ``pid_n`` and D-slice ``[ds0, ds0 + DS)`` (``ds0 = D0 + pid_s * DS``) of KV head g.

    Grid: (cdiv(Nkv_max, BN) * NSLICE, B * Hkv). Loops over the GROUP query heads of ``g`` and the query
    blocks that see the key block (causal: from the first visible one). Per query block:

    * S^T, dP^T over the columns outside the slice: a pipelined loop of BK-wide chunks;
    * the slice's own columns close the sums with the slice tiles, which the slice updates reuse:
      ``dV_s += P^T dO_s``, ``dK_s += dS^T Q_s`` (and DQ_ATOMIC: ``dQ_s += scale * dS K_s`` in fp32).

    The slice is held as NJ (1 or 2) halves of width DH = DS / NJ (smaller TMA-reduce staging for dQ).
    With USE_TMA the key block's slice of K and V is loaded once and stays in shared memory; tiles come
    through per-sequence tensor descriptors (zero-filled past the sequence and past D). DK/DV are written
    once (scaled); MASK_GRAD (slice 0 only) writes dS into DMASK (atomics when the mask is broadcast).
    """
    DH: tl.constexpr = DS // NJ
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    pid_s = pid0 % NSLICE
    pid_n = pid0 // NSLICE
    b = pid1 // HKV
    g = pid1 % HKV
    row0, nq, col0, nkv = _seq_bounds(CU_Q, CU_K, b, NQ, NKV, VARLEN)
    n0 = pid_n * BN
    if n0 >= nkv:
        return
    one = (n0 < nkv).to(tl.int32)
    dt = K.dtype.element_ty
    causal_off = nkv - nq
    b64 = b.to(tl.int64)
    g64 = g.to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    col_ok = cols < nkv
    ds0 = D0 + pid_s * DS
    n_out = ds0 + tl.maximum(D - ds0 - DS, 0)  # head-dim columns outside the slice
    k_seq = K + b64 * skb + g64 * skh + col0 * skn
    v_seq = V + b64 * svb + g64 * svh + col0 * svn
    kd_c = _desc(k_seq, nkv, D, skn, BN, BK, USE_TMA)
    vd_c = _desc(v_seq, nkv, D, svn, BN, BK, USE_TMA)
    kd_h = _desc(k_seq, nkv, D, skn, BN, DH, USE_TMA)
    vd_h = _desc(v_seq, nkv, D, svn, BN, DH, USE_TMA)
    if USE_TMA:  # loop-invariant: stays in shared memory for the whole program
        k_h0 = kd_h.load([n0, ds0])
        v_h0 = vd_h.load([n0, ds0])
        if NJ == 2:
            k_h1 = kd_h.load([n0, ds0 + DH])
            v_h1 = vd_h.load([n0, ds0 + DH])
    if DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
    m_lo = 0
    if CAUSAL:
        m_lo = (tl.maximum(n0 - causal_off, 0) // BM) * BM
    dk0 = tl.zeros([BN, DH], dtype=tl.float32)
    dv0 = tl.zeros([BN, DH], dtype=tl.float32)
    if NJ == 2:
        dk1 = tl.zeros([BN, DH], dtype=tl.float32)
        dv1 = tl.zeros([BN, DH], dtype=tl.float32)
    for hi in range(0, GROUP):
        h = g * GROUP + hi
        h64 = h.to(tl.int64)
        q_seq = Q + b64 * sqb + h64 * sqh + row0 * sqm
        do_seq = DO + b64 * sob + h64 * soh + row0 * som
        a_seq = DQA + b64 * sab + h64 * sah + row0 * sam
        l_base = LSE + b64 * slb + h64 * slh + row0 * slm
        dl_base = DELTA + b64 * sdb + h64 * sdh + row0 * sdm
        m_base = MASK + b64 * smb + h64 * smh
        qd_c = _desc(q_seq, nq, D, sqm, BM, BK, USE_TMA)
        dod_c = _desc(do_seq, nq, D, som, BM, BK, USE_TMA)
        qd_h = _desc(q_seq, nq, D, sqm, BM, DH, USE_TMA)
        dod_h = _desc(do_seq, nq, D, som, BM, DH, USE_TMA)
        # fp32 dQ reduce target (the interpreter has no descriptor reduce: pointer atomics there)
        ad = _desc(a_seq, nq, D, sam, BM, DH, DQ_ATOMIC and USE_TMA and not INTERP)
        if VARLEN:
            head = h
        else:
            head = b * HQ + h
        for m0 in range(m_lo, nq, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < nq
            r64 = rows.to(tl.int64)
            # S^T = K Q^T and dP^T = V dO^T: the columns outside the slice, BK at a time
            st = tl.zeros([BN, BM], dtype=tl.float32)
            dpt = tl.zeros([BN, BM], dtype=tl.float32)
            for c in range(0, n_out, BK):
                cc = c + (c >= ds0).to(tl.int32) * DS
                k_c = _tile(kd_c, k_seq, n0, cols, nkv, skn, cc, D, skd, BK, USE_TMA, False)
                qt_c = _tile(qd_c, q_seq, m0, rows, nq, sqm, cc, D, sqd, BK, USE_TMA, True)
                st = _mm(k_c, qt_c, st, INTERP)
                v_c = _tile(vd_c, v_seq, n0, cols, nkv, svn, cc, D, svd, BK, USE_TMA, False)
                dot_c = _tile(dod_c, do_seq, m0, rows, nq, som, cc, D, sod, BK, USE_TMA, True)
                dpt = _mm(v_c, dot_c, dpt, INTERP)
            # ... and the slice's own columns, whose tiles the updates below reuse
            q_h0 = _tile(qd_h, q_seq, m0, rows, nq, sqm, ds0, D, sqd, DH, USE_TMA, False)
            do_h0 = _tile(dod_h, do_seq, m0, rows, nq, som, ds0, D, sod, DH, USE_TMA, False)
            if not USE_TMA:
                k_h0 = _tile(kd_h, k_seq, n0, cols, nkv, skn, ds0, D, skd, DH, USE_TMA, False)
                v_h0 = _tile(vd_h, v_seq, n0, cols, nkv, svn, ds0, D, svd, DH, USE_TMA, False)
            if NJ == 2:
                q_h1 = _tile(qd_h, q_seq, m0, rows, nq, sqm, ds0 + DH, D, sqd, DH, USE_TMA, False)
                do_h1 = _tile(dod_h, do_seq, m0, rows, nq, som, ds0 + DH, D, sod, DH, USE_TMA, False)
                if not USE_TMA:
                    k_h1 = _tile(kd_h, k_seq, n0, cols, nkv, skn, ds0 + DH, D, skd, DH, USE_TMA, False)
                    v_h1 = _tile(vd_h, v_seq, n0, cols, nkv, svn, ds0 + DH, D, svd, DH, USE_TMA, False)
            # One-trip loops (``one`` is 1 at run time, unknown to the compiler), one dot per accumulator
            # each: Triton lays out a dot whose result reaches another dot for chaining (all 8 warps along
            # M), which replicates a 64-row tile over both warpgroups and spills.
            for _once in range(0, one):
                st = _mm(k_h0, tl.trans(q_h0), st, INTERP)
                dpt = _mm(v_h0, tl.trans(do_h0), dpt, INTERP)
            if NJ == 2:
                for _once in range(0, one):
                    st = _mm(k_h1, tl.trans(q_h1), st, INTERP)
                    dpt = _mm(v_h1, tl.trans(do_h1), dpt, INTERP)
            lse = tl.load(l_base + r64 * slm, mask=row_ok, other=0.0)
            delta = tl.load(dl_base + r64 * sdm, mask=row_ok, other=0.0)
            pt = _tile_probs(st, lse, rows, cols, nq, nkv, causal_off, m_base, smm, smn, qk_scale,
                             CAUSAL, MASK_KIND, True)
            if DROPOUT:
                if VARLEN:
                    keep = _tile_keep(seed, rng_off, head, row0 + rows, col0 + cols, p_thresh, True)
                else:
                    keep = _tile_keep(seed, rng_off, head, rows, cols, p_thresh, True)
                pdt = tl.where(keep, pt * p_scale, 0.0)
                dpt = tl.where(keep, dpt * p_scale, 0.0)
            else:
                pdt = pt
            dst = pt * (dpt - delta[None, :])
            if MASK_GRAD:
                if pid_s == 0:
                    x_ptrs = (DMASK + b64 * sxb + h64 * sxh + r64[None, :] * sxm
                              + cols[:, None].to(tl.int64) * sxn)
                    x_ok = row_ok[None, :] & col_ok[:, None]
                    if DMASK_ATOMIC:
                        tl.atomic_add(x_ptrs, dst, mask=x_ok, sem="relaxed")
                    else:
                        tl.store(x_ptrs, dst, mask=x_ok)
            p_lo = round_cast(pdt, dt, INTERP)
            ds_lo = round_cast(dst, dt, INTERP)
            dv0 = _mm(p_lo, do_h0, dv0, INTERP)
            dk0 = _mm(ds_lo, q_h0, dk0, INTERP)
            if NJ == 2:
                dv1 = _mm(p_lo, do_h1, dv1, INTERP)
                dk1 = _mm(ds_lo, q_h1, dk1, INTERP)
            if DQ_ATOMIC:
                ds_q = tl.trans(ds_lo)
                dq_h = _mm(ds_q, k_h0, tl.zeros([BM, DH], dtype=tl.float32), INTERP) * scale
                _dq_add(ad, a_seq, m0, rows, nq, sam, ds0, D, sad, dq_h, DH, USE_TMA and not INTERP)
                if NJ == 2:
                    dq_h = _mm(ds_q, k_h1, tl.zeros([BM, DH], dtype=tl.float32), INTERP) * scale
                    _dq_add(ad, a_seq, m0, rows, nq, sam, ds0 + DH, D, sad, dq_h, DH, USE_TMA and not INTERP)
    pcols = (col0 + cols).to(tl.int64)
    dk_rows = DK + b64 * sgb + g64 * sgh + pcols[:, None] * sgn
    dv_rows = DV + b64 * sgb + g64 * sgh + pcols[:, None] * sgn
    _store_half(dk_rows, dk0 * scale, col_ok, ds0, D, sgd, DH, INTERP)
    _store_half(dv_rows, dv0, col_ok, ds0, D, sgd, DH, INTERP)
    if NJ == 2:
        _store_half(dk_rows, dk1 * scale, col_ok, ds0 + DH, D, sgd, DH, INTERP)
        _store_half(dv_rows, dv1, col_ok, ds0 + DH, D, sgd, DH, INTERP)


@triton.jit
def _dq_add(desc, base, r0, rows, nrows, stride_r, c0, D, stride_c, val, W: tl.constexpr, USE_TMA: tl.constexpr):
    """fp32 dQ[rows, c0:c0 + W] += val: a TMA reduce-add (clipped to the descriptor) or masked atomics."""
    if USE_TMA:
        desc.atomic_add([r0, c0], val)
    else:
        cols = c0 + tl.arange(0, W)
        tl.atomic_add(base + rows[:, None].to(tl.int64) * stride_r + cols[None, :] * stride_c, val,
                      mask=(rows < nrows)[:, None] & (cols < D)[None, :], sem="relaxed")


@triton.jit
def _store_half(rows_ptr, val, row_ok, c0, D, stride_c, W: tl.constexpr, INTERP: tl.constexpr):
    """Store val [R, W] (fp32) to the output dtype at rows_ptr[:, None] + columns c0 + [0, W) (< D)."""
    cols = c0 + tl.arange(0, W)
    tl.store(rows_ptr + cols[None, :] * stride_c, round_cast(val, rows_ptr.dtype.element_ty, INTERP),
             mask=row_ok[:, None] & (cols < D)[None, :])


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, MASK, RNG, CU_Q, CU_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    slb, slh, slm, sdb, sdh, sdm, sab, sah, sam, sad, smb, smh, smm, smn,
    HQ, NQ, NKV, D, D0, NSLICE, scale, qk_scale, p_thresh, p_scale,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    USE_TMA: tl.constexpr, INTERP: tl.constexpr,
):
    """dQ for query block ``pid_m`` and D-slice ``[ds0, ds0 + DS)`` of query head ``h``.

    Grid: (cdiv(Nq_max, BM) * NSLICE, B * Hq), causal in reverse block order (heaviest first).
    Deterministic (no atomics): loops over the visible key
    blocks; S and dP over the columns outside the slice in a pipelined BK-chunk loop, then the slice's own
    columns with the K/V slice tiles that ``dQ_s += dS K_s`` reuses. Stores ``scale * dQ_s`` once. With
    USE_TMA the query block's Q/dO slice stays in shared memory for the whole program.
    """
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    pid_s = pid0 % NSLICE
    pid_m = pid0 // NSLICE
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        pid_m = tl.num_programs(0) // NSLICE - 1 - pid_m
    b = pid1 // HQ
    h = pid1 % HQ
    row0, nq, col0, nkv = _seq_bounds(CU_Q, CU_K, b, NQ, NKV, VARLEN)
    m0 = pid_m * BM
    if m0 >= nq:
        return
    dt = K.dtype.element_ty
    causal_off = nkv - nq
    g = kv_head(h, GROUP)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    g64 = g.to(tl.int64)
    rows = m0 + tl.arange(0, BM)
    row_ok = rows < nq
    r64 = rows.to(tl.int64)
    ds0 = D0 + pid_s * DS
    n_out = ds0 + tl.maximum(D - ds0 - DS, 0)
    q_seq = Q + b64 * sqb + h64 * sqh + row0 * sqm
    do_seq = DO + b64 * sob + h64 * soh + row0 * som
    k_seq = K + b64 * skb + g64 * skh + col0 * skn
    v_seq = V + b64 * svb + g64 * svh + col0 * svn
    m_base = MASK + b64 * smb + h64 * smh
    qd_c = _desc(q_seq, nq, D, sqm, BM, BK, USE_TMA)
    dod_c = _desc(do_seq, nq, D, som, BM, BK, USE_TMA)
    kd_c = _desc(k_seq, nkv, D, skn, BN, BK, USE_TMA)
    vd_c = _desc(v_seq, nkv, D, svn, BN, BK, USE_TMA)
    kd_s = _desc(k_seq, nkv, D, skn, BN, DS, USE_TMA)
    vd_s = _desc(v_seq, nkv, D, svn, BN, DS, USE_TMA)
    qd_s = _desc(q_seq, nq, D, sqm, BM, DS, USE_TMA)
    dod_s = _desc(do_seq, nq, D, som, BM, DS, USE_TMA)
    q_s = _tile(qd_s, q_seq, m0, rows, nq, sqm, ds0, D, sqd, DS, USE_TMA, False)
    do_s = _tile(dod_s, do_seq, m0, rows, nq, som, ds0, D, sod, DS, USE_TMA, False)
    lse = tl.load(LSE + b64 * slb + h64 * slh + row0 * slm + r64 * slm, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + b64 * sdb + h64 * sdh + row0 * sdm + r64 * sdm, mask=row_ok, other=0.0)
    if DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
    if VARLEN:
        head = h
    else:
        head = b * HQ + h
    n_hi = nkv
    if CAUSAL:
        n_hi = tl.minimum(nkv, m0 + BM + causal_off)
    dq = tl.zeros([BM, DS], dtype=tl.float32)
    for n0 in range(0, n_hi, BN):
        cols = n0 + tl.arange(0, BN)
        s = tl.zeros([BM, BN], dtype=tl.float32)
        dp = tl.zeros([BM, BN], dtype=tl.float32)
        for c in range(0, n_out, BK):
            cc = c + (c >= ds0).to(tl.int32) * DS
            q_c = _tile(qd_c, q_seq, m0, rows, nq, sqm, cc, D, sqd, BK, USE_TMA, False)
            kt_c = _tile(kd_c, k_seq, n0, cols, nkv, skn, cc, D, skd, BK, USE_TMA, True)
            s = _mm(q_c, kt_c, s, INTERP)
            do_c = _tile(dod_c, do_seq, m0, rows, nq, som, cc, D, sod, BK, USE_TMA, False)
            vt_c = _tile(vd_c, v_seq, n0, cols, nkv, svn, cc, D, svd, BK, USE_TMA, True)
            dp = _mm(do_c, vt_c, dp, INTERP)
        k_s = _tile(kd_s, k_seq, n0, cols, nkv, skn, ds0, D, skd, DS, USE_TMA, False)
        v_s = _tile(vd_s, v_seq, n0, cols, nkv, svn, ds0, D, svd, DS, USE_TMA, False)
        s = _mm(q_s, tl.trans(k_s), s, INTERP)
        dp = _mm(do_s, tl.trans(v_s), dp, INTERP)
        p = _tile_probs(s, lse, rows, cols, nq, nkv, causal_off, m_base, smm, smn, qk_scale,
                        CAUSAL, MASK_KIND, False)
        if DROPOUT:
            if VARLEN:
                keep = _tile_keep(seed, rng_off, head, row0 + rows, col0 + cols, p_thresh, False)
            else:
                keep = _tile_keep(seed, rng_off, head, rows, cols, p_thresh, False)
            dp = tl.where(keep, dp * p_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = _mm(round_cast(ds, dt, INTERP), k_s, dq, INTERP)
    _store_half(DQ + b64 * sab + h64 * sah + row0 * sam + r64[:, None] * sam, dq * scale, row_ok, ds0, D, sad,
                DS, INTERP)

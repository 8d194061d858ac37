"""Triton device code of the split-D backward: delta preprocess, K/V-stationary dK/dV(/dQ) kernel, dQ kernel.

Math (per query head; ``s = scale * q.k + bias``, ``P = exp(s - lse)``, dropout keep-mask ``Z``, ``r = 1/(1-p)``):

    dV   = (P * Z * r)^T dO
    dP   = (dO V^T) * Z * r
    dS   = P * (dP - delta),       delta = rowsum(dO * O) - dlse
    dK   = scale * dS^T Q,         dQ = scale * dS K,         d(bias) = dS

Split-D: a dK/dV program owns one key block and one D-slice ``[d0, d0 + DS)`` of dK/dV (fp32 registers).
For every query block it recomputes ``S^T = K Q^T`` and ``dP^T = V dO^T`` over the full D (in ``BK``-wide
chunks), then updates its slice: ``dV_s += P^T dO_s``, ``dK_s += dS^T Q_s`` and (fused mode) adds
``dS K_s`` into an fp32 dQ buffer with atomics. The dQ kernel (split / deterministic mode) is
query-stationary: it owns one query block and one D-slice of dQ and loops over the key blocks.

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

from .common import causal_visible, dropout_keep, kv_head

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
def _cvt(x, dt: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> dt with round-to-nearest-even. The GPU rounds so already; the interpreter truncates to bf16,
    so under INTERP the rounding is done on the bits first (the truncating cast is then exact)."""
    if INTERP:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


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
        z = s * qk_scale - lse[None, :]
    else:
        rr = rows[:, None]
        cc = cols[None, :]
        z = s * qk_scale - lse[:, None]
    valid = (rr < nq) & (cc < nkv)
    if MASK_KIND != 0:
        mptrs = mask_ptr + rr.to(tl.int64) * smm + cc.to(tl.int64) * smn
        if MASK_KIND == 1:
            valid = valid & (tl.load(mptrs, mask=valid, other=0) != 0)
        else:
            z = z + tl.load(mptrs, mask=valid, other=0.0).to(tl.float32) * _LOG2E
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
def _bwd_preprocess_kernel(
    O, DO, DLSE, DELTA,
    sob, soh, som, sod, sdob, sdoh, sdom, sdod, slb, slh, slm, sdb, sdh, sdm,
    H, N, D,
    HAS_DLSE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):
    """delta[b, h, m] = sum_d dO * O (fp32) - dlse. Grid (cdiv(N, BM), B * H); varlen: B = 1, N = T_q."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < N
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BM], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        msk = row_ok[:, None] & (dd < D)[None, :]
        o = tl.load(O + b * sob + h * soh + r64[:, None] * som + dd[None, :] * sod, mask=msk, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + r64[:, None] * sdom + dd[None, :] * sdod, mask=msk, other=0.0)
        acc += tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        acc -= tl.load(DLSE + b * slb + h * slh + r64 * slm, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + b * sdb + h * sdh + r64 * sdm, acc, mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DQA, DK, DV, MASK, DMASK, RNG, CU_Q, CU_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    slb, slh, slm, sdb, sdh, sdm,
    sab, sah, sam, sad, sgb, sgh, sgn, sgd,
    smb, smh, smm, smn, sxb, sxh, sxm, sxn,
    HQ, HKV, NQ, NKV, D, D0, NSLICE, scale, qk_scale, p_thresh, p_scale,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr,
    DQ_W: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASK_GRAD: tl.constexpr,
    DMASK_ATOMIC: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, INTERP: tl.constexpr,
):
    """dK/dV for key block ``pid_n`` and D-slice ``[D0 + pid_s * DS, ... + DS)`` of KV head ``g``.

    Grid: (cdiv(Nkv_max, BN) * NSLICE, B * Hkv). Loops over the GROUP query heads of ``g`` and the query
    blocks that see the key block (causal: from the first visible one). Writes DK/DV (scaled) once;
    DQ_ATOMIC adds ``scale * dS K_s`` into the fp32 DQA buffer; MASK_GRAD (slice 0 only) writes dS into
    DMASK (atomics when the mask is broadcast). USE_TMA: tiles come through per-sequence tensor
    descriptors (zero-filled past the sequence and past D) instead of masked pointer loads; the host
    enables it only for 16-byte aligned rows with a unit last stride.
    """
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
    dt = K.dtype.element_ty
    causal_off = nkv - nq
    b64 = b.to(tl.int64)
    g64 = g.to(tl.int64)
    cols = n0 + tl.arange(0, BN)
    col_ok = cols < nkv
    pcols = (col0 + cols).to(tl.int64)  # packed key rows
    ds0 = D0 + pid_s * DS
    dcol = ds0 + tl.arange(0, DS)
    d_ok = dcol < D
    k_seq = K + b64 * skb + g64 * skh + col0 * skn
    v_seq = V + b64 * svb + g64 * svh + col0 * svn
    k_rows = k_seq + cols[:, None].to(tl.int64) * skn
    v_rows = v_seq + cols[:, None].to(tl.int64) * svn
    if USE_TMA:
        kd_c = tl.make_tensor_descriptor(k_seq, shape=[nkv, D], strides=[skn, 1], block_shape=[BN, BK])
        vd_c = tl.make_tensor_descriptor(v_seq, shape=[nkv, D], strides=[svn, 1], block_shape=[BN, BK])
        if DQ_ATOMIC and not INTERP:
            # loop-invariant: the compiler keeps these K slice halves in shared memory for the whole program
            kd_j = tl.make_tensor_descriptor(k_seq, shape=[nkv, D], strides=[skn, 1], block_shape=[BN, DQ_W])
            k_j0 = kd_j.load([n0, ds0])
            if DS // DQ_W == 2:
                k_j1 = kd_j.load([n0, ds0 + DQ_W])
    if DROPOUT:
        seed = tl.load(RNG)
        rng_off = tl.load(RNG + 1)
    m_lo = 0
    if CAUSAL:
        m_lo = (tl.maximum(n0 - causal_off, 0) // BM) * BM
    dk = tl.zeros([BN, DS], dtype=tl.float32)
    dv = tl.zeros([BN, DS], dtype=tl.float32)
    for hi in range(0, GROUP):
        h = g * GROUP + hi
        h64 = h.to(tl.int64)
        q_seq = Q + b64 * sqb + h64 * sqh + row0 * sqm
        do_seq = DO + b64 * sob + h64 * soh + row0 * som
        a_seq = DQA + b64 * sab + h64 * sah + row0 * sam
        l_base = LSE + b64 * slb + h64 * slh + row0 * slm
        dl_base = DELTA + b64 * sdb + h64 * sdh + row0 * sdm
        m_base = MASK + b64 * smb + h64 * smh
        if USE_TMA:
            qd_c = tl.make_tensor_descriptor(q_seq, shape=[nq, D], strides=[sqm, 1], block_shape=[BM, BK])
            dod_c = tl.make_tensor_descriptor(do_seq, shape=[nq, D], strides=[som, 1], block_shape=[BM, BK])
            qd_s = tl.make_tensor_descriptor(q_seq, shape=[nq, D], strides=[sqm, 1], block_shape=[BM, DS])
            dod_s = tl.make_tensor_descriptor(do_seq, shape=[nq, D], strides=[som, 1], block_shape=[BM, DS])
            if DQ_ATOMIC and not INTERP:
                ad = tl.make_tensor_descriptor(a_seq, shape=[nq, D], strides=[sam, 1], block_shape=[BM, DQ_W])
        if VARLEN:
            head = h
        else:
            head = b * HQ + h
        for m0 in range(m_lo, nq, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < nq
            r64 = rows.to(tl.int64)
            # S^T = K Q^T and dP^T = V dO^T over the full head dim, BK columns at a time
            st = tl.zeros([BN, BM], dtype=tl.float32)
            dpt = tl.zeros([BN, BM], dtype=tl.float32)
            for c in range(0, D, BK):
                if USE_TMA:
                    k_c = kd_c.load([n0, c])
                    qt_c = tl.trans(qd_c.load([m0, c]))
                    v_c = vd_c.load([n0, c])
                    dot_c = tl.trans(dod_c.load([m0, c]))
                else:
                    kk = c + tl.arange(0, BK)
                    if EVEN_K:
                        kmask = col_ok[:, None]
                        qmask = row_ok[None, :]
                    else:
                        kmask = col_ok[:, None] & (kk < D)[None, :]
                        qmask = row_ok[None, :] & (kk < D)[:, None]
                    k_c = tl.load(k_rows + kk[None, :] * skd, mask=kmask, other=0.0)
                    qt_c = tl.load(q_seq + r64[None, :] * sqm + kk[:, None] * sqd, mask=qmask, other=0.0)
                    v_c = tl.load(v_rows + kk[None, :] * svd, mask=kmask, other=0.0)
                    dot_c = tl.load(do_seq + r64[None, :] * som + kk[:, None] * sod, mask=qmask, other=0.0)
                st = _mm(k_c, qt_c, st, INTERP)
                dpt = _mm(v_c, dot_c, dpt, INTERP)
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
            if USE_TMA:
                do_s = dod_s.load([m0, ds0])
                q_s = qd_s.load([m0, ds0])
            else:
                qd_mask = row_ok[:, None] & d_ok[None, :]
                do_s = tl.load(do_seq + r64[:, None] * som + dcol[None, :] * sod, mask=qd_mask, other=0.0)
                q_s = tl.load(q_seq + r64[:, None] * sqm + dcol[None, :] * sqd, mask=qd_mask, other=0.0)
            ds_lo = _cvt(dst, dt, INTERP)
            dv = _mm(_cvt(pdt, dt, INTERP), do_s, dv, INTERP)
            dk = _mm(ds_lo, q_s, dk, INTERP)
            if DQ_ATOMIC:
                ds_q = tl.trans(ds_lo)
                if USE_TMA and not INTERP:  # (the interpreter has no descriptor reduce)
                    # TMA reduce-add from shared memory (DQ_W is DS or DS / 2 on this path)
                    dq_j = _mm(ds_q, k_j0, tl.zeros([BM, DQ_W], dtype=tl.float32), INTERP) * scale
                    ad.atomic_add([m0, ds0], dq_j)
                    if DS // DQ_W == 2:
                        dq_j = _mm(ds_q, k_j1, tl.zeros([BM, DQ_W], dtype=tl.float32), INTERP) * scale
                        ad.atomic_add([m0, ds0 + DQ_W], dq_j)
                else:
                    for j in tl.static_range(DS // DQ_W):
                        dj = ds0 + j * DQ_W + tl.arange(0, DQ_W)
                        dj_ok = dj < D
                        k_j = tl.load(k_rows + dj[None, :] * skd, mask=col_ok[:, None] & dj_ok[None, :],
                                      other=0.0)
                        dq_j = _mm(ds_q, k_j, tl.zeros([BM, DQ_W], dtype=tl.float32), INTERP) * scale
                        tl.atomic_add(a_seq + r64[:, None] * sam + dj[None, :] * sad, dq_j,
                                      mask=row_ok[:, None] & dj_ok[None, :], sem="relaxed")
    out_mask = col_ok[:, None] & d_ok[None, :]
    g_off = b64 * sgb + g64 * sgh + pcols[:, None] * sgn + dcol[None, :] * sgd
    tl.store(DK + g_off, _cvt(dk * scale, DK.dtype.element_ty, INTERP), mask=out_mask)
    tl.store(DV + g_off, _cvt(dv, DV.dtype.element_ty, INTERP), mask=out_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, MASK, RNG, CU_Q, CU_K,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    slb, slh, slm, sdb, sdh, sdm, sab, sah, sam, sad, smb, smh, smm, smn,
    HQ, NQ, NKV, D, D0, NSLICE, scale, qk_scale, p_thresh, p_scale,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DS: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, INTERP: tl.constexpr,
):
    """dQ for query block ``pid_m`` and D-slice ``[D0 + pid_s * DS, ... + DS)`` of query head ``h``.

    Grid: (cdiv(Nq_max, BM) * NSLICE, B * Hq). Deterministic (no atomics): loops over the visible key
    blocks, recomputing S and dP over the full D, and stores ``scale * sum_n dS K_s`` once.
    """
    pid0 = tl.program_id(0)
    pid1 = tl.program_id(1)
    pid_s = pid0 % NSLICE
    pid_m = pid0 // NSLICE
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
    dcol = ds0 + tl.arange(0, DS)
    d_ok = dcol < D
    q_seq = Q + b64 * sqb + h64 * sqh + row0 * sqm
    do_seq = DO + b64 * sob + h64 * soh + row0 * som
    k_seq = K + b64 * skb + g64 * skh + col0 * skn
    v_seq = V + b64 * svb + g64 * svh + col0 * svn
    q_rows = q_seq + r64[:, None] * sqm
    do_rows = do_seq + r64[:, None] * som
    m_base = MASK + b64 * smb + h64 * smh
    if USE_TMA:
        qd_c = tl.make_tensor_descriptor(q_seq, shape=[nq, D], strides=[sqm, 1], block_shape=[BM, BK])
        dod_c = tl.make_tensor_descriptor(do_seq, shape=[nq, D], strides=[som, 1], block_shape=[BM, BK])
        kd_c = tl.make_tensor_descriptor(k_seq, shape=[nkv, D], strides=[skn, 1], block_shape=[BN, BK])
        vd_c = tl.make_tensor_descriptor(v_seq, shape=[nkv, D], strides=[svn, 1], block_shape=[BN, BK])
        kd_s = tl.make_tensor_descriptor(k_seq, shape=[nkv, D], strides=[skn, 1], block_shape=[BN, DS])
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
        col_ok = cols < nkv
        c64 = cols.to(tl.int64)
        s = tl.zeros([BM, BN], dtype=tl.float32)
        dp = tl.zeros([BM, BN], dtype=tl.float32)
        for c in range(0, D, BK):
            if USE_TMA:
                q_c = qd_c.load([m0, c])
                kt_c = tl.trans(kd_c.load([n0, c]))
                do_c = dod_c.load([m0, c])
                vt_c = tl.trans(vd_c.load([n0, c]))
            else:
                kk = c + tl.arange(0, BK)
                if EVEN_K:
                    qmask = row_ok[:, None]
                    kmask = col_ok[None, :]
                else:
                    qmask = row_ok[:, None] & (kk < D)[None, :]
                    kmask = col_ok[None, :] & (kk < D)[:, None]
                q_c = tl.load(q_rows + kk[None, :] * sqd, mask=qmask, other=0.0)
                kt_c = tl.load(k_seq + c64[None, :] * skn + kk[:, None] * skd, mask=kmask, other=0.0)
                do_c = tl.load(do_rows + kk[None, :] * sod, mask=qmask, other=0.0)
                vt_c = tl.load(v_seq + c64[None, :] * svn + kk[:, None] * svd, mask=kmask, other=0.0)
            s = _mm(q_c, kt_c, s, INTERP)
            dp = _mm(do_c, vt_c, dp, INTERP)
        p = _tile_probs(s, lse, rows, cols, nq, nkv, causal_off, m_base, smm, smn, qk_scale,
                        CAUSAL, MASK_KIND, False)
        if DROPOUT:
            if VARLEN:
                keep = _tile_keep(seed, rng_off, head, row0 + rows, col0 + cols, p_thresh, False)
            else:
                keep = _tile_keep(seed, rng_off, head, rows, cols, p_thresh, False)
            dp = tl.where(keep, dp * p_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if USE_TMA:
            k_s = kd_s.load([n0, ds0])
        else:
            k_s = tl.load(k_seq + c64[:, None] * skn + dcol[None, :] * skd,
                          mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        dq = _mm(_cvt(ds, dt, INTERP), k_s, dq, INTERP)
    tl.store(DQ + b64 * sab + h64 * sah + row0 * sam + r64[:, None] * sam + dcol[None, :] * sad,
             _cvt(dq * scale, DQ.dtype.element_ty, INTERP), mask=row_ok[:, None] & d_ok[None, :])

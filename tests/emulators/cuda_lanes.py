"""Lane-level emulator of the CUDA forward kernel (``ffpa_attn/cuda/csrc/ffpa_fwd.cu``) on the CPU.

What it models: one CTA of the kernel at the level of shared-memory bytes and per-lane ``mma.sync`` /
``ldmatrix`` fragments, in numpy: the 128-byte XOR swizzle, the cp.async loader and its ring of K/V column
chunks (slot schedule and prefetch distance of ``stages``), the fragment addresses of Q, K, V and P, the
exchange of partial S between the warps that split D (``wn``), the causal / tail masks, the online softmax
and the epilogue (out and lse). Two variants: :func:`emulate_cta` (16 rows per warp, ``rm = 1``, partial S
summed through one or two exchange buffers) and :func:`emulate_cta_rm2` (32 rows per warp, ``rm = 2``,
reduce-scatter of S partials, slice maxima and P fragments through shared memory one barrier phase at a
time). fp16 inputs, fp32 accumulators.

How tests use it: :func:`emulate` runs every CTA of a ``KernelSpec`` (:mod:`ffpa_attn.cuda.config`) over
fp16 q ``[Nq, D]``, k / v ``[Nkv, D]`` and returns out / lse for a comparison with
:func:`ffpa_attn.reference.attention` (tests/test_cuda_backend.py). A wrong swizzle, fragment address, slot
index or mask there gives a wrong answer here, without a GPU; the GPU tests check the kernel itself.
"""
from __future__ import annotations

import numpy as np
import torch

from ffpa_attn.cuda.config import KernelSpec


def swizzle(row_bytes: int, row: int, col: int) -> int:
    """Byte address of 16-bit element ``(row, col)`` of a shared-memory tile with ``row_bytes`` per row: the
    16-byte vector index XORed with ``row & 7`` (the kernel's bank-conflict-free layout)."""
    return row * row_bytes + (((col >> 3) ^ (row & 7)) << 4) + ((col & 7) << 1)


class CTA:
    """One thread block's shared memory (bytes, sized as the kernel's ``spec.smem_bytes``) with the kernel's
    tile loader and ``ldmatrix``; ``sw`` columns per K/V chunk, ``cw`` per warp of a chunk, ``nch`` chunks."""

    def __init__(self, spec: KernelSpec, stages: int, xbufs: int):
        self.spec, self.stages, self.xbufs = spec, stages, xbufs
        self.smem = np.zeros(spec.smem_bytes(stages, xbufs), dtype=np.uint8)
        self.sw = spec.chunk_cols
        self.cw = self.sw // spec.wn
        self.nch = spec.dpad // self.sw

    # shared memory ---------------------------------------------------------------------------------
    def st16(self, addr, vals_u16):
        self.smem[addr:addr + 16] = np.asarray(vals_u16, dtype=np.uint16).view(np.uint8)

    def load_tile(self, s_base, g, row0, nrows, col0, d, rows, cols):
        """cp.async of a ``rows x cols`` tile of global ``g`` (uint16 ``[N, D]``) from ``(row0, col0)`` to
        ``s_base``, thread by thread as the kernel issues its 16-byte vectors; zeros past ``nrows`` / ``d``."""
        nt = self.spec.threads
        vpr = cols // 8
        for tid in range(nt):
            if nt % vpr == 0:
                rs = nt // vpr
                r0, cv = tid // vpr, tid % vpr
                items = [(r0 + i * rs, cv) for i in range(rows // rs)]
            else:
                items = [((tid + i * nt) // vpr, (tid + i * nt) % vpr) for i in range(rows * vpr // nt)]
            for r, cv in items:
                gr, gc = row0 + r, col0 + cv * 8
                ok = gr < nrows and gc < d
                vals = g[gr, gc:gc + 8] if ok else np.zeros(8, np.uint16)
                self.st16(s_base + swizzle(cols * 2, r, cv * 8), vals)

    def ldsm(self, addrs, trans):
        """``ldmatrix.x4`` (``.trans`` when ``trans``): four 8x8 matrices from the 32 lanes' row addresses
        ``addrs``; returns the per-lane registers ``[32, 4]`` uint32 (two halves each)."""
        regs = np.zeros((32, 4), dtype=np.uint32)
        for j in range(4):
            m = np.stack([self.smem[a:a + 16].view(np.uint16) for a in addrs[8 * j:8 * j + 8]])  # 8 x 8
            for lane in range(32):
                g, t = lane // 4, lane % 4
                lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
                regs[lane, j] = int(lo) | (int(hi) << 16)
        return regs


def half_of(u32, half):
    """The fp16 in half ``half`` (0 = low) of each uint32 register, as fp32."""
    return ((u32 >> (16 * half)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)


def mma(c, a, b0, b1):
    """c [32, 4] f32 += A [16x16] B [16x8] from per-lane fragments (m16n8k16 layouts)."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (r, c0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[r, c0], A[r, c0 + 1] = half_of(a[lane, reg], 0), half_of(a[lane, reg], 1)
        B[2 * t, g], B[2 * t + 1, g] = half_of(b0[lane], 0), half_of(b0[lane], 1)
        B[2 * t + 8, g], B[2 * t + 9, g] = half_of(b1[lane], 0), half_of(b1[lane], 1)
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def pack_half2(lo, hi):
    """Two fp32 values rounded to fp16 and packed into a uint32 register (``lo`` in the low half)."""
    return (np.float16(lo).view(np.uint16).astype(np.uint32) | (np.float16(hi).view(np.uint16).astype(np.uint32) << 16))


def cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal):
    """The CTA's Q load and its cp.async ring of K/V chunks (K chunks of a tile, then V), as the kernel runs
    them: ``(n_tiles, acquire)`` where ``acquire(g)`` prefetches chunk ``g + stages - 1`` and returns the
    shared-memory address of chunk ``g``."""
    nch, sw, br = cta.nch, cta.sw, spec.block_m
    s_q, s_ring = 0, spec.q_bytes
    n_tiles = -(-nkv // 64)
    if causal:
        n_tiles = min(n_tiles, (q0 + br - 1 + off) // 64 + 1)
    total = n_tiles * 2 * nch

    def load_chunk(gi, slot):
        t, r = gi // (2 * nch), gi % (2 * nch)
        is_v, c = r >= nch, r % nch
        cta.load_tile(s_ring + slot * spec.chunk_bytes, vg if is_v else kg, t * 64, nkv, c * sw, d, 64, sw)

    cta.load_tile(s_q, qg, q0, nq, 0, d, br, spec.dpad)
    state = {"rd": 0, "wr": stages - 1}
    if stages > 1:
        for s in range(stages - 1):
            if s < total:
                load_chunk(s, s)

    def acquire(g):
        if stages == 1:
            load_chunk(g, 0)
            return s_ring
        gn = g + stages - 1
        if gn < total:
            load_chunk(gn, state["wr"])
        state["wr"] = 0 if state["wr"] + 1 == stages else state["wr"] + 1
        base = s_ring + state["rd"] * spec.chunk_bytes
        state["rd"] = 0 if state["rd"] + 1 == stages else state["rd"] + 1
        return base

    return n_tiles, acquire


def qk_chunks(cta, acquire, g, s, lanes):
    """S += Q K^T over the ``nch`` K chunks of one key tile, as every warp of the CTA runs it: the Q fragments
    of the warp's ``rm`` row tiles (rows ``wm * rows_per_warp + rm * 16``, Q at shared-memory offset 0) and each
    ldmatrix'd K fragment feed ``rm`` MMAs. s ``[nw, rm, 8, 32, 4]`` f32 (rm = 1: pass ``s[:, None]``); returns
    the next chunk index ``g``."""
    spec = cta.spec
    nw, rm_ = s.shape[:2]
    wn_, nch, cw, sw = spec.wn, cta.nch, cta.cw, cta.sw
    for c in range(nch):
        kb = acquire(g)
        g += 1
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            qcol0 = c * sw + wn * cw
            for kk in range(cw // 16):
                a = [cta.ldsm([swizzle(spec.dpad * 2, wm * spec.rows_per_warp + rm * 16 + (ln & 15),
                                       qcol0 + kk * 16 + (ln >> 4) * 8) for ln in lanes], False)
                     for rm in range(rm_)]
                for nn in range(4):
                    bf = cta.ldsm([kb + swizzle(sw * 2, nn * 16 + (ln & 7) + ((ln >> 4) << 3),
                                                wn * cw + kk * 16 + ((ln >> 3) & 1) * 8) for ln in lanes], False)
                    for rm in range(rm_):
                        mma(s[w, rm, 2 * nn], a[rm], bf[:, 0], bf[:, 1])
                        mma(s[w, rm, 2 * nn + 1], a[rm], bf[:, 2], bf[:, 3])
    return g


def pv_chunks(cta, acquire, g, o, pa, nch, wn_, cw, sw, lanes):
    """O += P V over the ``nch`` V chunks of one key tile, as every warp of the CTA runs it: each ldmatrix'd V
    fragment feeds the MMAs of all ``rm`` row tiles of the warp. o ``[nw, rm, nch, 2 * cw / 16, 32, 4]`` f32,
    pa ``[nw, rm, 4, 32, 4]`` P A-fragments (rm = 1: pass ``o[:, None]`` / ``pa[:, None]``); returns the next
    chunk index ``g``."""
    nw, rm_ = pa.shape[:2]
    for c in range(nch):
        vb = acquire(g)
        g += 1
        for w in range(nw):
            wn = w % wn_
            for kk in range(4):
                for nn in range(cw // 16):
                    bf = cta.ldsm([vb + swizzle(sw * 2, kk * 16 + (ln & 7) + ((ln >> 3) & 1) * 8,
                                             wn * cw + nn * 16 + (ln >> 4) * 8) for ln in lanes], True)
                    for rm in range(rm_):
                        mma(o[w, rm, c, 2 * nn], pa[w, rm, kk], bf[:, 0], bf[:, 1])
                        mma(o[w, rm, c, 2 * nn + 1], pa[w, rm, kk], bf[:, 2], bf[:, 3])
    return g


def emulate_cta(spec, stages, xbufs, qg, kg, vg, nq, nkv, d, q0, causal, scale):
    """The rm = 1 kernel (16 rows per warp) on the CTA of query rows ``q0 .. q0 + block_m``: qg / kg / vg uint16
    views of fp16 ``[Nq, D]`` / ``[Nkv, D]``; partial S summed through ``xbufs`` exchange buffers; returns
    (out ``[block_m, dpad]`` fp32, lse ``[block_m]`` fp32) with rows past Nq and columns past D unused."""
    cta = CTA(spec, stages, xbufs)
    wn_, nw, br, nch, cw, sw = spec.wn, spec.nw, spec.block_m, cta.nch, cta.cw, cta.sw
    dpad = spec.dpad
    lanes = np.arange(32)
    x_base = spec.q_bytes + stages * spec.chunk_bytes
    off = nkv - nq if causal else 0
    n_tiles, acquire = cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal)

    o = np.zeros((nw, nch, cw // 8, 32, 4), np.float32)
    m_r = np.full((nw, 32, 2), -np.inf, np.float32)
    l_r = np.zeros((nw, 32, 2), np.float32)
    g = 0
    xbuf = 0
    log2e = 1.0 / np.log(2.0)
    for t in range(n_tiles):
        s = np.zeros((nw, 8, 32, 4), np.float32)
        g = qk_chunks(cta, acquire, g, s[:, None], lanes)
        xf = cta.smem[x_base:].view(np.float32)
        xb = xbuf * nw * 1024
        for w in range(nw):  # every warp writes, then (after the named barrier) reads
            for j in range(8):
                idx = xb + w * 1024 + (j * 32 + lanes) * 4
                for e in range(4):
                    xf[idx + e] = s[w, j, :, e]
        summed = np.zeros_like(s)
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            for j in range(8):
                if wn_ == 2:
                    idx = xb + (wm * wn_ + (wn ^ 1)) * 1024 + (j * 32 + lanes) * 4
                    summed[w, j] = s[w, j] + np.stack([xf[idx + e] for e in range(4)], 1)
                else:
                    acc = None
                    for w2 in range(wn_):
                        idx = xb + (wm * wn_ + w2) * 1024 + (j * 32 + lanes) * 4
                        part = np.stack([xf[idx + e] for e in range(4)], 1)
                        acc = part if acc is None else acc + part
                    summed[w, j] = acc
        s = summed
        if xbufs == 2:
            xbuf ^= 1
        k0 = t * 64
        need_mask = (k0 + 64 > nkv) or (causal and k0 + 63 > q0 + off)
        pa = np.zeros((nw, 4, 32, 4), np.uint32)
        for w in range(nw):
            wm = w // wn_
            g8, tq = lanes >> 2, lanes & 3
            row_a = q0 + wm * 16 + g8
            rows = (row_a, row_a + 8)
            x = s[w] * np.float32(scale * log2e)
            if need_mask:
                for i in range(2):
                    lim = np.full(32, nkv - 1)
                    if causal:
                        lim = np.minimum(rows[i] + off, lim)
                    lim_rel = lim - k0 - 2 * tq
                    for j in range(8):
                        for e in (2 * i, 2 * i + 1):
                            x[j, :, e] = np.where(j * 8 + (e & 1) > lim_rel, -np.inf, x[j, :, e])
            for i in range(2):
                mx = np.maximum(m_r[w, :, i], x[:, :, 2 * i:2 * i + 2].max(axis=(0, 2)))
                mx = mx.reshape(8, 4).max(axis=1).repeat(4)  # quad reduction
                mu = np.where(np.isneginf(mx), 0.0, mx).astype(np.float32)
                alpha = np.exp2(m_r[w, :, i] - mu)
                m_r[w, :, i] = mx
                l_r[w, :, i] *= alpha
                o[w, :, :, :, 2 * i:2 * i + 2] *= alpha[None, None, :, None]
                p = np.exp2(x[:, :, 2 * i:2 * i + 2] - mu[None, :, None])
                l_r[w, :, i] += p.sum(axis=(0, 2))
                for j in range(8):
                    pa[w, j >> 1, :, (j & 1) * 2 + i] = pack_half2(p[j, :, 0], p[j, :, 1])
        g = pv_chunks(cta, acquire, g, o[:, None], pa[:, None], nch, wn_, cw, sw, lanes)
    out = np.zeros((br, dpad), np.float32)
    lse = np.full(br, -np.inf, np.float32)
    for w in range(nw):
        wm, wn = w // wn_, w % wn_
        g8, tq = lanes >> 2, lanes & 3
        for i in range(2):
            l = l_r[w, :, i].reshape(8, 4).sum(axis=1).repeat(4)
            inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0.0)
            if wn == 0:
                sel = tq == 0
                lse[wm * 16 + 8 * i + g8[sel]] = np.where(l[sel] > 0, (m_r[w, sel, i] + np.log2(np.where(
                    l[sel] > 0, l[sel], 1))) * np.log(2.0), -np.inf)
            for c in range(nch):
                for j in range(cw // 8):
                    col = c * sw + wn * cw + j * 8 + tq * 2
                    out[wm * 16 + 8 * i + g8, col] = o[w, c, j, :, 2 * i] * inv
                    out[wm * 16 + 8 * i + g8, col + 1] = o[w, c, j, :, 2 * i + 1] * inv
    return out, lse


def emulate_cta_rm2(spec, stages, qg, kg, vg, nq, nkv, d, q0, causal, scale):
    """The rm = 2 kernel (32 rows per warp, reduce-scatter exchange) at the same level as
    :func:`emulate_cta`: partials, slice maxima and P fragments go through the shared-memory bytes at the
    kernel's addresses, one barrier phase at a time (all warps write, then all warps read)."""
    assert spec.rm == 2
    cta = CTA(spec, stages, 1)
    wn_, nw, br, nch, cw, sw = spec.wn, spec.nw, spec.block_m, cta.nch, cta.cw, cta.sw
    rm_, wr, ks = spec.rm, spec.rows_per_warp, 64 // spec.wn
    nj = ks // 8
    dpad = spec.dpad
    lanes = np.arange(32)
    g8, tq = lanes >> 2, lanes & 3
    x_base = spec.q_bytes + stages * spec.chunk_bytes
    x_floats = nw * rm_ * 1024
    off = nkv - nq if causal else 0
    n_tiles, acquire = cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal)

    o = np.zeros((nw, rm_, nch, cw // 8, 32, 4), np.float32)
    m_r = np.full((nw, rm_, 2, 32), -np.inf, np.float32)
    l_r = np.zeros((nw, rm_, 2, 32), np.float32)
    g = 0
    log2e = 1.0 / np.log(2.0)
    for t in range(n_tiles):
        s = np.zeros((nw, rm_, 8, 32, 4), np.float32)
        g = qk_chunks(cta, acquire, g, s, lanes)
        xf = cta.smem[x_base:].view(np.float32)
        for w in range(nw):  # partials
            for rm in range(rm_):
                for j in range(8):
                    idx = w * rm_ * 1024 + ((rm * 8 + j) * 32 + lanes) * 4
                    for e in range(4):
                        xf[idx + e] = s[w, rm, j, :, e]
        # barrier A: slice sums, scale, mask, slice maxima
        k0 = t * 64
        need_mask = (k0 + 64 > nkv) or (causal and k0 + 63 > q0 + off)
        sq = np.zeros((nw, rm_, nj, 32, 4), np.float32)
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            for w2 in range(wn_):
                for rm in range(rm_):
                    for jj in range(nj):
                        idx = (wm * wn_ + w2) * rm_ * 1024 + ((rm * 8 + wn * nj + jj) * 32 + lanes) * 4
                        sq[w, rm, jj] += np.stack([xf[idx + e] for e in range(4)], 1)
            sq[w] *= np.float32(scale * log2e)
            for rm in range(rm_):
                for i in range(2):
                    if need_mask:
                        lim = np.full(32, nkv - 1)
                        if causal:
                            lim = np.minimum(q0 + wm * wr + rm * 16 + i * 8 + g8 + off, lim)
                        lim_rel = lim - k0 - wn * ks - 2 * tq
                        for jj in range(nj):
                            for e in (2 * i, 2 * i + 1):
                                sq[w, rm, jj, :, e] = np.where(jj * 8 + (e & 1) > lim_rel, -np.inf,
                                                               sq[w, rm, jj, :, e])
                    mx = sq[w, rm, :, :, 2 * i:2 * i + 2].max(axis=(0, 2)).reshape(8, 4).max(axis=1)
                    xf[x_floats + w * wr + rm * 16 + i * 8 + np.arange(8)] = mx
        # barrier B: group maxima, P slices -> the group's partial space
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            pbase = x_base + wm * wn_ * rm_ * 1024 * 4
            for rm in range(rm_):
                for i in range(2):
                    mx = m_r[w, rm, i].copy()
                    for w2 in range(wn_):
                        mx = np.maximum(mx, xf[x_floats + (wm * wn_ + w2) * wr + rm * 16 + i * 8 + g8])
                    mu = np.where(np.isneginf(mx), 0.0, mx).astype(np.float32)
                    alpha = np.exp2(m_r[w, rm, i] - mu)
                    m_r[w, rm, i] = mx
                    l_r[w, rm, i] *= alpha
                    o[w, rm, :, :, :, 2 * i:2 * i + 2] *= alpha[None, None, :, None]
                    p = np.exp2(sq[w, rm, :, :, 2 * i:2 * i + 2] - mu[None, :, None])
                    l_r[w, rm, i] += p.sum(axis=(0, 2))
                    for jj in range(nj):
                        j = wn * nj + jj
                        for ln in range(32):
                            addr = pbase + ((rm * 4 + (j >> 1)) * 32 + ln) * 16 + (j & 1) * 8 + i * 4
                            cta.smem[addr:addr + 4] = np.array([int(pack_half2(p[jj, ln, 0], p[jj, ln, 1]))],
                                                               np.uint32).view(np.uint8)
        # barrier C: every warp reads all of P of its group
        pa = np.zeros((nw, rm_, 4, 32, 4), np.uint32)
        for w in range(nw):
            wm = w // wn_
            pbase = x_base + wm * wn_ * rm_ * 1024 * 4
            for rm in range(rm_):
                for kk in range(4):
                    for ln in range(32):
                        addr = pbase + ((rm * 4 + kk) * 32 + ln) * 16
                        pa[w, rm, kk, ln] = cta.smem[addr:addr + 16].view(np.uint32)
        g = pv_chunks(cta, acquire, g, o, pa, nch, wn_, cw, sw, lanes)
    # epilogue: slice sums of l through shared memory, fixed order
    xf = cta.smem[x_base:].view(np.float32)
    for w in range(nw):
        for rm in range(rm_):
            for i in range(2):
                xf[w * wr + rm * 16 + i * 8 + np.arange(8)] = l_r[w, rm, i].reshape(8, 4).sum(axis=1)
    out = np.zeros((br, dpad), np.float32)
    lse = np.full(br, -np.inf, np.float32)
    for w in range(nw):
        wm, wn = w // wn_, w % wn_
        for rm in range(rm_):
            for i in range(2):
                l = np.zeros(32, np.float32)
                for w2 in range(wn_):
                    l += xf[(wm * wn_ + w2) * wr + rm * 16 + i * 8 + g8]
                inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0.0)
                r0 = wm * wr + rm * 16 + 8 * i
                if wn == 0:
                    sel = tq == 0
                    lse[r0 + g8[sel]] = np.where(l[sel] > 0, (m_r[w, rm, i, sel] + np.log2(np.where(
                        l[sel] > 0, l[sel], 1))) * np.log(2.0), -np.inf)
                for c in range(nch):
                    for j in range(cw // 8):
                        col = c * sw + wn * cw + j * 8 + tq * 2
                        out[r0 + g8, col] = o[w, rm, c, j, :, 2 * i] * inv
                        out[r0 + g8, col + 1] = o[w, rm, c, j, :, 2 * i + 1] * inv
    return out, lse


def emulate(spec: KernelSpec, stages: int, xbufs: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every CTA of the kernel ``spec`` (``spec.rm`` picks the variant; ``xbufs`` exchange buffers for rm = 1)
    on fp16 q ``[Nq, D]``, k / v ``[Nkv, D]``: (out fp32 ``[Nq, D]``, lse fp32 ``[Nq]``)."""
    nq, d = q.shape
    nkv = k.shape[0]
    qg, kg, vg = (t.contiguous().numpy().view(np.uint16) for t in (q, k, v))
    outs, lses = [], []
    for q0 in range(0, nq, spec.block_m):
        if spec.rm == 2:
            o, l = emulate_cta_rm2(spec, stages, qg, kg, vg, nq, nkv, d, q0, causal, scale)
        else:
            o, l = emulate_cta(spec, stages, xbufs, qg, kg, vg, nq, nkv, d, q0, causal, scale)
        outs.append(o)
        lses.append(l)
    return torch.from_numpy(np.concatenate(outs)[:nq, :d]), torch.from_numpy(np.concatenate(lses)[:nq])

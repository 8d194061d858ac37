"""sm90a (Hopper) attention backward in CuTeDSL, dK/dV kernel: K/V-stationary, head dim split over CTAs, TMA + wgmma.

This kernel computes dK and dV; :mod:`.bwd_dq_sm90` computes dQ in a second launch (no dQ GEMMs here, no dS tile,
no reductions; consumer 1 arrives on the DS barrier once it has read P^T and consumer 0 waits on it before writing
the next P^T).

One CTA per (64-key block ``n``, head-dim part ``p`` of ``n_parts``, kv head, batch): grid ``(n_parts *
ceil(Nkv/64), Hkv, B)``; ``n_parts`` = 2 up to D = 512, ``ceil(D / 256)`` above (see "D > 512" below). The
CTA owns ``dK[n, part p]`` and ``dV[n, part p]`` (``d_part = n_part_chunks * 64`` columns, fp32 in
registers) and loops over every query head of its GQA group and every 64-row query block that sees the key
block (causal: from the first block that sees a key of ``n``). The score tiles S and dP are computed over
the full head dim by every part of a key block (recompute; a 2-CTA cluster that exchanged partial S^T / dP^T
instead measured slower, docs/design.md). Per CTA, three warpgroups:

* warpgroup 0, warp 0 (producer, setmaxnreg 40): TMA-loads K and V of the key block once (all
  ``nc = ceil(D/64)`` column chunks of 64 x 64, one mbarrier), then per (head, query block) streams
  64 x 64 chunks through two mbarrier rings:
  ring A (consumer 0): Q chunks 0..nc-1, then the dO chunks of part p;
  ring B (consumer 1): dO chunks 0..nc-1, then the Q chunks of part p.
* warpgroup 1 (consumer 0, setmaxnreg 232):
  S^T = K Q^T (m64 n64, k = D, A = K chunk, B = Q chunk, both shared memory);
  P^T = exp2(S^T * scale*log2e - lse*log2e), 0 where masked / query row >= Nq / row without keys;
  P^T (fp32) -> shared memory for consumer 1; dV_p += P^T dO_p (A = P^T bf16 from registers).
* warpgroup 2 (consumer 1, setmaxnreg 232):
  dP^T = V dO^T (m64 n64, k = D); dS^T = P^T (dP^T - delta) in fp32 (P^T read from shared memory);
  dK_p += dS^T Q_p (A from registers).
  The end: dK_p * scale and dV_p converted and stored (rows >= Nkv, columns >= D clipped).

Budget (D = 512, ``nc = 8`` chunks, part = 4 chunks = 256 columns; see :class:`..config.BwdConfig`):

* shared memory: K and V resident 2 x 64 x 512 x 2 B = 128 KiB; P^T exchange 64 x 64 fp32 = 16 KiB;
  rings A and B 4 slots each of 64 x 64 x 2 B = 64 KiB; total 208 KiB + mbarriers <= 227 KiB. D < 512 uses
  deeper rings (D = 448: 6 slots, 384: 7, 320 / 264: 8).
* registers per consumer thread (setmaxnreg 232): dV_p (or dK_p) 64 x 256 fp32 / 128 threads = 128,
  S^T (or dP^T) 32, P^T / dS^T as 16-bit A fragment 16, lse / delta of the thread's 16 query columns 16;
  producer 40 (128 x 40 + 256 x 232 = 64512). ptxas (sm_90a): at most 168 registers at launch (384 threads),
  0 bytes spilled, no stack frame (tests/test_cute_compile.py).
* traffic per (key block, query block) and CTA: Q and dO over the full D once each plus the part's
  chunks again (1.5 x 2 x 64 x D x 2 B), K/V once per CTA. dK/dV are reduced inside one CTA in a fixed
  order (bit-reproducible).

D > 512 (``BwdConfig.stream``): K and V of a key block no longer fit next to the rings
(2 x 128 KiB at D = 1024), so V is not resident: ring B carries V_c, dO_c pairs (consumer 1's dP^T = sum_c V_c
dO_c^T reads both operands from the ring through :meth:`BwdSm90Base.pair_gemm`, a ring walk of two-slot items),
then the part's Q chunks; K stays resident for consumer 0. Parts of <= 4 chunks (D = 1024: 4 CTAs per key block,
each recomputing S^T and dP^T over the full D). Ring B moves twice the bytes of ring A per GEMM step and a pair
walk holds 4 of its slots, so it gets the deeper ring (``BwdConfig.ring_split``; D = 1024: K 128 KiB + P^T 16
KiB + ring A 4 x 8 KiB + ring B 6 x 8 KiB = 224 KiB; equal rings of 5 measured 86 against 134 TFLOPS).
Registers as at D = 512 (ptxas: 168, no spills).

Packed sequences (``BwdConfig.varlen``): q/dO/out ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]`` are
passed as ``[1, H, T, D]`` views (lse / delta ``[1, Hq, T_q]``) with ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 ``[B
+ 1]``) and a work list (:func:`..ranges.varlen_work_items` with ``key_stationary``: one item per (sequence, key
block), most query blocks first, built on the device); the grid is (work-list slots x parts, KV heads)
(:class:`..tile_scheduler.VarlenTileScheduler`; slots past the real work exit). Each CTA views every tensor from
its sequence's first row (:class:`..seqlen_info.SeqlenInfo`) and then runs the dense code with the sequence's
lengths: causal is tail-aligned per sequence, rows and keys past the
sequence (the next sequence's, read by the 64-row TMA boxes) are masked by the sequence's lengths exactly as rows
past Nq / Nkv are in the dense case, and every store is clipped at the sequence's end. One launch per kernel for
the whole batch; no padding, no copy.

Conventions (:mod:`ffpa_attn.contract`): tail-aligned causal (query row r sees key k iff
``k <= r + Nkv - Nq``), ``kv_head = q_head // (Hq // Hkv)``; lse natural log of the scaled scores, fp32
``[B, Hq, Nq]`` (-inf for a row without keys); ``delta = rowsum(dO * O) - dlse`` fp32 ``[B, Hq, Nq]``
(computed by the caller).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

from .block_info import BlockInfo
from .bwd_sm90_common import _CH, _TILE, _WG, BwdCta, BwdSm90Base
from .config import BwdConfig
from .mask import Mask
from .named_barrier import DkDvBarrier
from .softmax import probs_from_lse, softmax_grad

# S^T (keys x queries) C fragment: the thread's 16 query columns are those of registers (v % 2) + 4 (v // 4);
# register v reads entry (v % 2) + 2 (v // 4) of a per-column cache (tests/test_cute_compile.py)
_COL_REGS = [(i % 2) + 4 * (i // 2) for i in range(16)]
_COL_OF_REG = [(v % 2) + 2 * (v // 4) for v in range(32)]


class FlashBwdSm90SplitD(BwdSm90Base):
    """dK/dV kernel for one :class:`BwdConfig` (compile-time: D, dtype, causal, ring depths).

    Call (inside ``cute.compile``) with q/do ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit, unit
    stride on D), lse and delta ``[B, Hq, Nq]`` fp32, dk/dv ``[B, Hkv, Nkv, D]`` 16-bit (fully written),
    ``scale``, ``scale_log2 = scale * log2(e)``, ``group = Hq // Hkv`` and a stream (``cfg.varlen``: then
    ``cu_seqlens_q``, ``cu_seqlens_k`` and the work list). Sizes and strides are runtime values.
    """

    reverse_blocks = False  # key blocks in grid order

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg)
        self.ncp = cfg.part_chunks
        self.stages = cfg.stages
        self.stages_b = cfg.stages_b
        self.parts = cfg.n_parts  # D > 512 (V streamed): more head-dim parts
        assert self.ncp <= self.stages  # see BwdConfig: the rings cannot deadlock

    # ------------------------------------------------------------------------------------------------
    # host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale: Float32,
                 scale_log2: Float32, group: Int32, stream: cuda.CUstream, mCuQ: cute.Tensor | None = None,
                 mCuK: cute.Tensor | None = None, mItems: cute.Tensor | None = None):
        (kv_layout, ring_layout, ring_layout_b), (mQt, mKt, _, _), atoms, mmas = self.host_setup(mQ, mK, mV, mdO)
        (tma_q, tQ), (tma_k, tK), (tma_v, tV), (tma_do, tdO) = atoms
        mma_ss, mma_rs, _ = mmas
        self.shared_storage = self.smem_struct(kv_layout, ring_layout, ring_layout_b)  # (no dS tile)
        kernel = self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_do, tdO, mLSE, mDelta, mdK, mdV, mma_ss, mma_rs,
                             kv_layout, ring_layout, ring_layout_b, scale, scale_log2, group, mCuQ, mCuK, mItems)
        self.launch(kernel, mKt, mItems, stream)

    # ------------------------------------------------------------------------------------------------
    # device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mma_ss: cute.TiledMma,
               mma_rs: cute.TiledMma, kv_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
               ring_layout_b: cute.ComposedLayout, scale: Float32, scale_log2: Float32, group: Int32,
               mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None, mItems: cute.Tensor | None):
        cta = self.prologue((tma_q, tma_k, tma_v, tma_do), mQ, mK, mV, mdO, (mLSE, mDelta), (mdK, mdV), kv_layout,
                            ring_layout, ring_layout_b, mCuQ, mCuK, mItems)
        m_block_min, m_block_max = BlockInfo(_TILE, _TILE, self.causal).query_block_range(cta.seq, cta.block)
        # query blocks that see key block cta.block; the max (a no-op) tells the compiler n_m >= 0, so the loops'
        # it // n_m, it % n_m stay unsigned divisions
        n_m = cutlass.max(m_block_max - m_block_min, 0)
        n_iter = n_m * group
        self.run_warpgroups(
            cta, lambda: self.produce(cta, tma_q, tma_k, tma_v, tma_do, group, m_block_min, n_m, n_iter),
            lambda tid: self.consume_s(cta, mma_ss, mma_rs, scale_log2, group, m_block_min, n_m, n_iter, tid),
            lambda tid: self.consume_dp(cta, mma_ss, mma_rs, scale, group, m_block_min, n_m, n_iter, tid))

    @cute.jit
    def produce(self, cta: BwdCta, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                tma_do: cute.CopyAtom, group: Int32, m_block_min: Int32, n_m: Int32, n_iter: Int32):
        """Warp 0 of the producer warpgroup: K/V of the key block once (stream: K only), then per (head,
        query block) the Q / dO (stream: V and dO) chunks of rings A and B, in the order the consumers use
        them."""
        tVsB, tVg = self.load_resident(cta, tma_k, cta.mK, tma_v, cta.mV)  # (tVsB: ring B's slots with stream)
        st_a, st_b = self.producer_states()
        for it in cutlass.range(n_iter, unroll=1):
            head = cta.kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            tQsA, tQsB, tQg = self.ring_views(cta, tma_q, cta.mQ, head, m_block)
            tdOsA, tdOsB, tdOg = self.ring_views(cta, tma_do, cta.mdO, head, m_block)
            st_a, st_b = self.load_score_chunks(cta, st_a, st_b, tma_q, tQg, tQsA, tma_do, tdOg, tdOsB, tma_v, tVg,
                                                tVsB)
            for j in cutlass.range_constexpr(self.ncp):  # then the part's dO (ring A) and Q (ring B) chunks
                _, cc = self.chunk_of_part(cta.part, self.ncp, j)
                st_a = self.load_chunk(cta.ring_a, st_a, tma_do, tdOg[None, cc], tdOsA)
                st_b = self.load_chunk(cta.ring_b, st_b, tma_q, tQg[None, cc], tQsB)

    # ------------------------------------------------------------------------------------------------
    # consumer pieces

    @cute.jit
    def store_part(self, cta: BwdCta, accs: list, mma_rs: cute.TiledMma, mOut: cute.Tensor, mul: Float32,
                   tid: Int32):
        """mOut[batch, kv_head, keys of the key block, columns of the part] = accs * mul (16-bit, clipped)."""
        self.store_tiles(accs, mma_rs, mOut, mul, cta.block, cta.part * self.ncp, cta.kv_head, cta.batch,
                         cta.seq.seqlen_k, tid)

    @cute.jit
    def consume_s(self, cta: BwdCta, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, scale_log2: Float32,
                  group: Int32, m_block_min: Int32, n_m: Int32, n_iter: Int32, tid: Int32):
        """Consumer 0: S^T, P^T (-> shared memory for consumer 1), dV_p."""
        mLSE, mdV, sA, sP, ring = cta.q_rows[0], cta.k_rows[1], cta.sA, cta.sP, cta.ring_a
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        tSrK = thr_ss.make_fragment_A(thr_ss.partition_A(cta.sRes))  # (MMA, 1, 4, nc)
        tSrQ = thr_ss.make_fragment_B(thr_ss.partition_B(sA))  # (MMA, 1, 4, S)
        sAT = cute.composition(sA, cute.make_ordered_layout((_CH, _TILE, self.stages), order=(1, 0, 2)))
        tVrdO = thr_rs.make_fragment_B(thr_rs.partition_B(sAT))  # (MMA, 1, 4, S): dO^T view
        acc_S = cute.make_rmem_tensor(thr_ss.partition_shape_C((_TILE, _TILE)), Float32)
        tOrP = cute.make_rmem_tensor(thr_rs.partition_shape_A((_TILE, _TILE)), self.dtype)
        tOrP_as_S = cute.make_tensor(tOrP.iterator, acc_S.layout)
        tScS = thr_ss.partition_C(cute.make_identity_tensor((_TILE, _TILE)))  # (key, query)
        acc_dV = self.zero_accs(thr_rs, self.ncp)
        lse2 = cute.make_rmem_tensor((16,), Float32)
        n0 = cta.block * _TILE
        mask = Mask.create(cta.seq, self.causal)

        cute.arch.mbarrier_wait(cta.mbar_res, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for it in cutlass.range(n_iter, unroll=1):
            head = cta.kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            m0 = m_block * _TILE
            self.load_query_values(mLSE, tScS, lse2, _COL_REGS, 1, cta.batch, head, m_block, cta.seq.seqlen_q, True)
            state = self.score_gemm(mma_ss, acc_S, tSrK, tSrQ, ring, state)
            # P^T; keys past Nkv (zero K rows) get P = 0, never inf * 0 downstream
            probs_from_lse(acc_S, tScS, lse2, _COL_OF_REG, scale_log2, mask, m0, n0, 0)
            if it > 0:  # consumer 1 has read the previous P^T (it arrives after its read)
                cute.arch.barrier(barrier_id=DkDvBarrier.P_READ, number_of_threads=2 * _WG)
            cute.autovec_copy(acc_S, sP[None, tid])
            # consumer 0 waits for nothing
            cute.arch.barrier_arrive(barrier_id=DkDvBarrier.P_WRITTEN, number_of_threads=2 * _WG)
            tOrP_as_S.store(acc_S.load().to(self.dtype))
            # dV_p += P^T dO_p
            state = self.part_gemm(mma_rs, acc_dV, tOrP, tVrdO, ring, state)
        self.store_part(cta, acc_dV, mma_rs, mdV, Float32(1.0), tid)

    @cute.jit
    def consume_dp(self, cta: BwdCta, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, scale: Float32, group: Int32,
                   m_block_min: Int32, n_m: Int32, n_iter: Int32, tid: Int32):
        """Consumer 1: dP^T, dS^T, dK_p."""
        mDelta, mdK, sB, sP, ring = cta.q_rows[1], cta.k_rows[0], cta.sB, cta.sP, cta.ring_b
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        tSrdO = thr_ss.make_fragment_B(thr_ss.partition_B(sB))  # (MMA, 1, 4, S)
        if const_expr(self.stream):
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(sB))  # (MMA, 1, 4, S): V chunks in ring B
        else:
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(cta.sRes1))  # (MMA, 1, 4, nc)
        sBT = cute.composition(sB, cute.make_ordered_layout((_CH, _TILE, self.stages_b), order=(1, 0, 2)))
        tKrQ = thr_rs.make_fragment_B(thr_rs.partition_B(sBT))  # (MMA, 1, 4, S): Q^T view
        acc_dP = cute.make_rmem_tensor(thr_ss.partition_shape_C((_TILE, _TILE)), Float32)
        rP = cute.make_rmem_tensor_like(acc_dP, Float32)
        tKrdS = cute.make_rmem_tensor(thr_rs.partition_shape_A((_TILE, _TILE)), self.dtype)
        tKrdS_as_S = cute.make_tensor(tKrdS.iterator, acc_dP.layout)
        tScS = thr_ss.partition_C(cute.make_identity_tensor((_TILE, _TILE)))
        acc_dK = self.zero_accs(thr_rs, self.ncp)
        delta = cute.make_rmem_tensor((16,), Float32)

        cute.arch.mbarrier_wait(cta.mbar_res, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages_b)
        for it in cutlass.range(n_iter, unroll=1):
            head = cta.kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            self.load_query_values(mDelta, tScS, delta, _COL_REGS, 1, cta.batch, head, m_block, cta.seq.seqlen_q,
                                   False)
            if const_expr(self.stream):
                state = self.pair_gemm(mma_ss, acc_dP, tSrV, tSrdO, ring, state, self.nc)
            else:
                state = self.score_gemm(mma_ss, acc_dP, tSrV, tSrdO, ring, state)
            cute.arch.barrier(barrier_id=DkDvBarrier.P_WRITTEN, number_of_threads=2 * _WG)
            cute.autovec_copy(sP[None, tid], rP)
            # P^T read: consumer 0 may write the next one (it waits for this arrive from its second iteration on,
            # so the counts match)
            if it < n_iter - 1:
                cute.arch.barrier_arrive(barrier_id=DkDvBarrier.P_READ, number_of_threads=2 * _WG)
            softmax_grad(acc_dP, rP, delta, _COL_OF_REG)
            tKrdS_as_S.store(acc_dP.load().to(self.dtype))
            # dK_p += dS^T Q_p
            state = self.part_gemm(mma_rs, acc_dK, tKrdS, tKrQ, ring, state)
        self.store_part(cta, acc_dK, mma_rs, mdK, scale, tid)

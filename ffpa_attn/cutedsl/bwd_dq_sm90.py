"""sm90a attention backward, dQ kernel: query-stationary, no reductions.

The dK/dV kernel (:mod:`.bwd_sm90`) computes no dQ at all, so there is no fp32 dQ buffer, no zero fill, no
Nkv/64 reduce-adds per element (~64 GiB of L2 reduction traffic at B=1, H=32, N=8192, D=512: ~40% of the time
of a dK/dV kernel that reduced dQ) and no final conversion; this kernel recomputes S and dP once more and
writes dQ in the input dtype, every element once (deterministic).

One CTA per (64-row query block, query head, batch): grid ``(ceil(Nq/64), Hq, B)``, heavy (late, causal)
query blocks first. Three warpgroups:

* warpgroup 0, warp 0 (producer, setmaxnreg 40): TMA-loads Q and dO of the query block once (all
  ``nc = ceil(D/64)`` chunks of 64 x 64, one mbarrier), then per visible 64-key block ``n`` of the query
  block's KV head streams 64 x 64 chunks through two mbarrier rings:
  ring A (consumer 0): K chunks 0..nc-1, then K chunks 0..h0-1 (``h0 = ceil(nc/2)``);
  ring B (consumer 1): V chunks 0..nc-1, then K chunks h0..nc-1 (the second read of a K block hits L2).
* warpgroup 1 (consumer 0, setmaxnreg 232): S = Q K^T (m64 n64, k = D, both operands in shared memory);
  P = exp2(S * scale*log2e - lse*log2e), 0 where masked / for rows >= Nq / rows without keys; P (fp32)
  -> shared memory; after consumer 1 wrote dS: dQ[:, chunks 0..h0-1] += dS K (A = dS from shared memory).
* warpgroup 2 (consumer 1, setmaxnreg 232): dP = dO V^T; dS = P (dP - delta) -> shared memory (16-bit,
  (query, key) K-major: the A operand of dQ); dQ[:, chunks h0..nc-1] += dS K.
  The end: both consumers store ``scale * dQ`` of their chunks (rows >= Nq, columns >= D clipped).

Budget (D = 512, ``nc = 8``, ``h0 = 4``; :class:`..config.BwdConfig` ``dq_fixed_bytes`` / ``dq_stages``):

* shared memory: Q and dO resident 2 x 64 x 512 x 2 B = 128 KiB; P exchange 64 x 64 fp32 = 16 KiB; dS
  64 x 64 x 2 B = 8 KiB; two rings of 4 slots of 64 x 64 x 2 B = 64 KiB. Total 216 KiB + mbarriers.
  D = 320: 7 slots per ring.
* registers per consumer thread (setmaxnreg 232): dQ of 4 chunks 64 x 256 fp32 / 128 threads = 128; S or
  dP 32; P read back 32 (consumer 1); lse / delta of the thread's 2 rows 2.
* GEMM work per (query block, key block): S and dP over the full D, dQ over D (split between the two
  consumers): 3 units, against the dK/dV kernel's 6 (S and dP for each of its two head-dim parts, dV and
  dK); 9 in all instead of the 7 of a kernel that reduces dQ, but no reductions.
* synchronisation per key block: named barrier P (consumer 0 arrives after writing P, consumer 1 waits)
  and DS (both wait: dS written and fenced to the async proxy). P and dS are single-buffered: consumer 0
  writes P(n+1) only after it passed DS(n), i.e. after consumer 1 had read P(n); consumer 1 writes
  dS(n+1) only after P(n+1), which consumer 0 reaches after its dQ wgmma of block n has completed.

D > 512 (``BwdConfig.stream``): Q and dO of a query block no longer fit both, so dO is streamed: ring B carries
dO_c, V_c pairs for consumer 1's dP = sum_c dO_c V_c^T (:meth:`BwdSm90Base.pair_gemm`), Q stays resident; and a
64 x D fp32 dQ no longer fits one CTA's registers, so 2 CTAs per query block (grid x = 2 x query blocks, a block's
parts adjacent) each own ``dq_part_chunks`` dQ chunks (consumer 0 the first ``h0``, consumer 1 the rest; a chunk
past D is loaded from the last real one, never stored) and both recompute S and dP over the full D. D = 1024:
Q 128 KiB + P 16 KiB + dS 8 KiB + ring A 3 x 8 KiB + ring B 6 x 8 KiB = 224 KiB.

Packed sequences (``BwdConfig.varlen``): as in :mod:`.bwd_sm90`, over the forward's work list (one item per
(sequence, query block), most key blocks first: :func:`..ranges.varlen_work_items`); grid (work-list slots x parts,
query heads), the parts of a query block adjacent (they read the same K / V rows).

Conventions as in :mod:`.bwd_sm90` (tail-aligned causal, ``kv_head = q_head // group``, lse natural log,
-inf for a row without keys, ``delta = rowsum(dO * O) - dlse``); ``dq`` ``[B, Hq, Nq, D]`` 16-bit is
fully written (rows without keys get 0).
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
from .named_barrier import DqBarrier
from .softmax import probs_from_lse, softmax_grad

# the S (queries x keys) C fragment: register v holds query row (v // 2) % 2 of the thread's two rows
_ROW_OF_REG = [(v // 2) % 2 for v in range(32)]


class FlashBwdDqSm90(BwdSm90Base):
    """dQ kernel for one :class:`BwdConfig` (compile-time: D, dtype, causal).

    Call (inside ``cute.compile``) with q/do ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit, unit
    stride on D), lse and delta ``[B, Hq, Nq]`` fp32, dq ``[B, Hq, Nq, D]`` 16-bit (fully written),
    ``scale``, ``scale_log2 = scale * log2(e)``, ``group = Hq // Hkv`` and a stream.
    """

    reverse_blocks = True  # heavy (late, causal) query blocks first

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg)
        self.parts = cfg.dq_parts  # D > 512 (dO streamed): 2 CTAs split dQ's columns
        self.pc = cfg.dq_part_chunks  # dQ chunks per CTA: consumer 0 the first h0, consumer 1 the rest
        self.h0 = cfg.dq_half_chunks
        self.stages = cfg.dq_stages
        self.stages_b = cfg.dq_stages_b
        assert self.stages >= 2

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, scale: Float32, scale_log2: Float32,
                 group: Int32, stream: cuda.CUstream, mCuQ: cute.Tensor | None = None,
                 mCuK: cute.Tensor | None = None, mItems: cute.Tensor | None = None):
        (res_layout, ring_layout, ring_layout_b), (mQt, _, _, _), atoms, mmas = self.host_setup(mQ, mK, mV, mdO)
        (tma_q, tQ), (tma_k, tK), (tma_v, tV), (tma_do, tdO) = atoms
        mma_ss, _, mma_dq = mmas
        ds_layout = self._smem_layout(1)
        self.shared_storage = self.smem_struct(res_layout, ring_layout, ring_layout_b, cute.cosize(ds_layout))
        kernel = self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_do, tdO, mLSE, mDelta, mdQ, mma_ss, mma_dq,
                             res_layout, ring_layout, ring_layout_b, ds_layout, scale, scale_log2, group, mCuQ, mCuK,
                             mItems)
        self.launch(kernel, mQt, mItems, stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mma_ss: cute.TiledMma,
               mma_dq: cute.TiledMma, res_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
               ring_layout_b: cute.ComposedLayout,
               ds_layout: cute.ComposedLayout, scale: Float32, scale_log2: Float32, group: Int32,
               mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None, mItems: cute.Tensor | None):
        cta = self.prologue((tma_q, tma_k, tma_v, tma_do), mQ, mK, mV, mdO, (mLSE, mDelta, mdQ), (), res_layout,
                            ring_layout, ring_layout_b, mCuQ, mCuK, mItems, group)
        sdS = cta.storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)  # (64 q, 64 keys, 1)
        n_begin, n_end = BlockInfo(_TILE, _TILE, self.causal).key_block_range(cta.seq, cta.block)
        assert n_begin == 0  # (trace time) the loops below start at key block 0
        self.run_warpgroups(
            cta, lambda: self.produce(cta, tma_q, tma_k, tma_v, tma_do, n_end),
            lambda tid: self.consume(True, cta, mma_ss, mma_dq, sdS, scale, scale_log2, n_end, tid),
            lambda tid: self.consume(False, cta, mma_ss, mma_dq, sdS, scale, scale_log2, n_end, tid))

    @cute.jit
    def produce(self, cta: BwdCta, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                tma_do: cute.CopyAtom, n_end: Int32):
        """Warp 0 of the producer warpgroup: Q / dO (stream: Q only) of the query block once, then per key
        block the K / V (stream: K / dO and V) chunks of rings A and B in the order the consumers use them."""
        tdOsB, tdOg = self.load_resident(cta, tma_q, cta.mQ, tma_do, cta.mdO)  # (tdOsB: ring B's slots with stream)
        st_a, st_b = self.producer_states()
        for n in cutlass.range(n_end, unroll=1):
            tKsA, tKsB, tKg = self.ring_views(cta, tma_k, cta.mK, cta.kv_head, n)
            _, tVsB, tVg = self.ring_views(cta, tma_v, cta.mV, cta.kv_head, n)
            st_a, st_b = self.load_score_chunks(cta, st_a, st_b, tma_k, tKg, tKsA, tma_v, tVg, tVsB, tma_do, tdOg,
                                                tdOsB)
            for j in cutlass.range_constexpr(self.h0):  # then K again: dQ chunks of consumer 0 (A), consumer 1 (B)
                st_a = self.load_chunk(cta.ring_a, st_a, tma_k, tKg[None, self.dq_chunk(cta.part, j)], tKsA)
                if const_expr(self.h0 + j < self.pc):
                    st_b = self.load_chunk(cta.ring_b, st_b, tma_k, tKg[None, self.dq_chunk(cta.part, self.h0 + j)],
                                           tKsB)

    def dq_chunk(self, part, j: int):
        """The K chunk of the ``j``-th dQ chunk of ``part`` (:meth:`BwdSm90Base.chunk_of_part`, clamped to a real
        chunk); one part (D <= 512): ``j`` itself (a trace-time constant)."""
        if const_expr(self.parts == 1):
            return j
        return self.chunk_of_part(part, self.pc, j)[1]

    @cute.jit
    def consume(self, is_s: cutlass.Constexpr, cta: BwdCta, mma_ss: cute.TiledMma, mma_dq: cute.TiledMma,
                sdS: cute.Tensor, scale: Float32, scale_log2: Float32, n_end: Int32, tid: Int32):
        """One consumer. ``is_s``: consumer 0 (``sRes`` = Q, ``mRow`` = lse, ring A; S -> P), else consumer 1
        (``sRes`` = dO, ``mRow`` = delta, ring B; dP -> dS). The score GEMM reads the resident chunks as A and
        the ring's K (or V) chunks as B (stream, consumer 1: both from the ring, dO_c then V_c); the dQ
        GEMM reads dS (shared memory) as A and the ring's K chunks, viewed (d, key), as B."""
        mLSE, mDelta, mdQ = cta.q_rows
        if const_expr(is_s):
            mRow, sRes, sR, ring = mLSE, cta.sRes, cta.sA, cta.ring_a
        else:
            mRow, sRes, sR, ring = mDelta, cta.sRes1, cta.sB, cta.ring_b
        m_block, head, batch, seqlen_q = cta.block, cta.head, cta.batch, cta.seq.seqlen_q
        thr_ss = mma_ss.get_slice(tid)
        thr_dq = mma_dq.get_slice(tid)
        pairs = const_expr(self.stream and not is_s)
        if const_expr(pairs):
            tSrA = thr_ss.make_fragment_A(thr_ss.partition_A(sR))  # (MMA, 1, 4, S): dO chunks in ring B
        else:
            tSrA = thr_ss.make_fragment_A(thr_ss.partition_A(sRes))  # (MMA, 1, 4, nc)
        tSrB = thr_ss.make_fragment_B(thr_ss.partition_B(sR))  # (MMA, 1, 4, S)
        ring_stages = self.stages if const_expr(is_s) else self.stages_b
        sRT = cute.composition(sR, cute.make_ordered_layout((_CH, _TILE, ring_stages), order=(1, 0, 2)))
        tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sRT))  # (MMA, 1, 4, S): K chunk as (d, key)
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))  # (MMA, 1, 4, 1)
        tdQrdS0 = tdQrdS[None, None, None, 0]
        acc = cute.make_rmem_tensor(thr_ss.partition_shape_C((_TILE, _TILE)), Float32)
        tScS = thr_ss.partition_C(cute.make_identity_tensor((_TILE, _TILE)))  # (query, key)
        n_dq = self.h0 if const_expr(is_s) else self.pc - self.h0
        acc_dQ = self.zero_accs(thr_dq, n_dq)
        m0 = m_block * _TILE
        mask = Mask.create(cta.seq, self.causal)
        # the thread's two query rows: registers 4i, 4i+1 hold row tScS[0][0], 4i+2, 4i+3 row tScS[2][0]
        # (tests/test_cute_compile.py::test_bwd_dq_fragment_rows)
        rows = cute.make_rmem_tensor((2,), Float32)
        self.load_query_values(mRow, tScS, rows, [0, 2], 0, batch, head, m_block, seqlen_q, is_s)
        rP = cute.make_rmem_tensor_like(acc, Float32)
        dS16 = cute.make_rmem_tensor_like(acc, self.dtype)
        tSsdS = thr_ss.partition_C(sdS[None, None, 0])  # dS (query, key) at the C fragment's positions

        cute.arch.mbarrier_wait(cta.mbar_res, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring_stages)
        for n in cutlass.range(n_end, unroll=1):
            if const_expr(pairs):
                state = self.pair_gemm(mma_ss, acc, tSrA, tSrB, ring, state, self.nc)
            else:
                state = self.score_gemm(mma_ss, acc, tSrA, tSrB, ring, state)
            if const_expr(is_s):
                # keys past Nkv (zero K rows): P = 0, never inf * 0 downstream
                probs_from_lse(acc, tScS, rows, _ROW_OF_REG, scale_log2, mask, m0, n * _TILE, 1)
                cute.autovec_copy(acc, cta.sP[None, tid])
                cute.arch.barrier_arrive(barrier_id=DqBarrier.P_WRITTEN, number_of_threads=2 * _WG)
                cute.arch.barrier(barrier_id=DqBarrier.DS_WRITTEN, number_of_threads=2 * _WG)
            else:
                cute.arch.barrier(barrier_id=DqBarrier.P_WRITTEN, number_of_threads=2 * _WG)
                cute.autovec_copy(cta.sP[None, tid], rP)
                softmax_grad(acc, rP, rows, _ROW_OF_REG)
                dS16.store(acc.load().to(self.dtype))
                for v in cutlass.range_constexpr(cute.size(acc)):
                    tSsdS[v] = dS16[v]
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> wgmma (async proxy) reads
                cute.arch.barrier(barrier_id=DqBarrier.DS_WRITTEN, number_of_threads=2 * _WG)
            # dQ[:, own chunks] += dS K_chunk
            state = self.part_gemm(mma_dq, acc_dQ, tdQrdS0, tdQrK, ring, state)
        chunk0 = cta.part * self.pc + (0 if const_expr(is_s) else self.h0)
        self.store_tiles(acc_dQ, mma_dq, mdQ, scale, m_block, chunk0, head, batch, seqlen_q, tid)

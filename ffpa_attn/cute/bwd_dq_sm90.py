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
from cutlass.cute.nvgpu import cpasync, warpgroup

from .block_info import BlockInfo
from .bwd_sm90 import _CH, _CONSUMER_REGS, _PRODUCER_REGS, _TILE, _WG, BwdSm90Base, _dtype, _rows_from
from .config import BwdConfig
from .mask import Mask
from .named_barrier import DqBarrier
from .seqlen_info import SeqlenInfo
from .softmax import probs_from_lse
from .tile_scheduler import DenseTileScheduler, VarlenTileScheduler

# the S (queries x keys) C fragment: register v holds query row (v // 2) % 2 of the thread's two rows
_ROW_OF_REG = [(v // 2) % 2 for v in range(32)]


class FlashBwdDqSm90(BwdSm90Base):
    """dQ kernel for one :class:`BwdConfig` (compile-time: D, dtype, causal).

    Call (inside ``cute.compile``) with q/do ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit, unit
    stride on D), lse and delta ``[B, Hq, Nq]`` fp32, dq ``[B, Hq, Nq, D]`` 16-bit (fully written),
    ``scale``, ``scale_log2 = scale * log2(e)``, ``group = Hq // Hkv`` and a stream.
    """

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = _dtype(cfg.dtype)
        self.nc = cfg.n_chunks
        # D > 512: dO is streamed through ring B next to V (Q alone stays resident) and 2 CTAs split dQ's columns
        self.stream = cfg.stream
        self.parts = cfg.dq_parts
        self.pc = cfg.dq_part_chunks  # dQ chunks per CTA: consumer 0 the first h0, consumer 1 the rest
        self.h0 = cfg.dq_half_chunks
        self.stages = cfg.dq_stages
        self.stages_b = cfg.dq_stages_b
        self.kv_stages = self.nc  # chunks per score GEMM (the resident Q / dO: the full head dim)
        self.causal = cfg.causal
        self.varlen = cfg.varlen
        self.num_threads = 3 * _WG
        assert self.stages >= 2

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, scale: Float32, scale_log2: Float32,
                 group: Int32, stream: cuda.CUstream, mCuQ: cute.Tensor | None = None,
                 mCuK: cute.Tensor | None = None, mItems: cute.Tensor | None = None):
        res_layout = self._smem_layout(self.nc)
        ring_layout = self._smem_layout(self.stages)
        ring_layout_b = self._smem_layout(self.stages_b)
        ds_layout = self._smem_layout(1)
        chunk_layout = cute.slice_(ring_layout, (None, None, 0))
        (mQt, _, _, _), ((tma_q, tQ), (tma_k, tK), (tma_v, tV), (tma_do, tdO)) = self.tma_loads(
            (mQ, mK, mV, mdO), chunk_layout)
        mma_ss, _, mma_dq = self._tiled_mmas()

        stages = self.stages
        stages_b = self.stages_b
        n_do = cute.cosize(res_layout) if const_expr(not self.stream) else 8  # stream: dO comes through ring B

        @cute.struct
        class SharedStorage:
            mbar_a: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_b: cute.struct.MemRange[cutlass.Int64, 2 * stages_b]
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(res_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, n_do], 1024]
            ringA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 1024]
            ringB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout_b)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, _TILE * _TILE], 128]

        self.shared_storage = SharedStorage
        if const_expr(self.varlen):  # (work-list slots x parts, query heads), a block's parts adjacent
            grid = VarlenTileScheduler(1, self.parts).grid(cute.size(mQt.shape[2]), mItems.shape[1])
        else:
            grid = DenseTileScheduler(1, True, self.parts).grid(cute.ceil_div(mQt.shape[0], _TILE),
                                                               cute.size(mQt.shape[2]), cute.size(mQt.shape[3]))
        self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_do, tdO, mLSE, mDelta, mdQ, mma_ss, mma_dq, res_layout,
                    ring_layout, ring_layout_b, ds_layout, scale, scale_log2, group, mCuQ, mCuK, mItems).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdQ: cute.Tensor, mma_ss: cute.TiledMma,
               mma_dq: cute.TiledMma, res_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
               ring_layout_b: cute.ComposedLayout,
               ds_layout: cute.ComposedLayout, scale: Float32, scale_log2: Float32, group: Int32,
               mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None, mItems: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG)
        active = True  # dense: every CTA has a query block
        if const_expr(self.varlen):  # work-list slot -> (sequence, query block); tensors from the sequence's rows
            work = VarlenTileScheduler(1, self.parts).work(mItems)
            head, part = work.head, work.part
            m_block = work.block
            active = work.valid  # (a slot past the real work: the CTA exits; it reads sequence 0's bounds)
            seq = SeqlenInfo.from_cu_seqlens(cutlass.max(work.batch, 0), mCuQ, mCuK)
            mQ, mdO, mK, mV = seq.rows_q(mQ), seq.rows_q(mdO), seq.rows_k(mK), seq.rows_k(mV)
            mLSE, mDelta, mdQ = (_rows_from(t, seq.offset_q) for t in (mLSE, mDelta, mdQ))
            batch = Int32(0)
        else:
            work = DenseTileScheduler(1, True, self.parts).work()  # heavy (late, causal) query blocks first
            head, batch, m_block, part = work.head, work.batch, work.block, work.part
            seq = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
        kv_head = head // group
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar_qdo = storage.mbar_qdo.data_ptr()
        ring_a, ring_b = self.make_rings(storage)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_qdo, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(res_layout.outer, swizzle=res_layout.inner)  # (64 rows, 64, nc)
        sdO = None  # stream: dO chunks are read from ring B
        if const_expr(not self.stream):
            sdO = storage.sdO.get_tensor(res_layout.outer, swizzle=res_layout.inner)
        sA = storage.ringA.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)  # (64 keys, 64, S)
        sB = storage.ringB.get_tensor(ring_layout_b.outer, swizzle=ring_layout_b.inner)
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)  # (64 q, 64 keys, 1)
        sP = self.p_exchange(storage)

        n_begin, n_end = BlockInfo(_TILE, _TILE, self.causal).key_block_range(seq, m_block)
        assert n_begin == 0  # (trace time) the loops below start at key block 0

        if active:  # (a whole CTA: no thread reaches a barrier the others skip)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self.produce(tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, sQ, sdO, sA, sB, ring_a, ring_b,
                                 mbar_qdo, m_block, head, kv_head, batch, n_end, part)
            else:
                cute.arch.setmaxregister_increase(_CONSUMER_REGS)
                tid = tidx % _WG
                if wg_idx == 1:
                    self.consume(True, mLSE, mdQ, mma_ss, mma_dq, sQ, sA, sdS, sP, ring_a, mbar_qdo, scale, scale_log2,
                                 m_block, head, batch, n_end, seqlen_q, seqlen_k, tid, part)
                else:
                    self.consume(False, mDelta, mdQ, mma_ss, mma_dq, sdO, sB, sdS, sP, ring_b, mbar_qdo, scale,
                                 scale_log2, m_block, head, batch, n_end, seqlen_q, seqlen_k, tid, part)

    @cute.jit
    def produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
                sQ: cute.Tensor, sdO: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                ring_a: pipeline.PipelineTmaAsync, ring_b: pipeline.PipelineTmaAsync, mbar_qdo,
                m_block: Int32, head: Int32, kv_head: Int32, batch: Int32, n_end: Int32, part: Int32):
        """Warp 0 of the producer warpgroup: Q / dO (stream: Q only) of the query block once, then per key
        block the K / V (stream: K / dO and V) chunks of rings A and B in the order the consumers use them."""
        box = (_TILE, _CH)
        one = cute.make_layout(1)
        gQ = cute.local_tile(mQ[None, None, head, batch], box, (m_block, None))  # (64, 64, nc)
        gdO = cute.local_tile(mdO[None, None, head, batch], box, (m_block, None))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        if const_expr(self.stream):
            tdOsB, tdOg = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sB, 0, 2),
                                                cute.group_modes(gdO, 0, 2))
        else:
            tdOs, tdOg = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2),
                                               cute.group_modes(gdO, 0, 2))
        resident = 1 if const_expr(self.stream) else 2
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_qdo, resident * self.nc * self.cfg.chunk_bytes)
        for c in cutlass.range_constexpr(self.nc):
            cute.copy(tma_q, tQg[None, c], tQs[None, c], tma_bar_ptr=mbar_qdo)
            if const_expr(not self.stream):
                cute.copy(tma_do, tdOg[None, c], tdOs[None, c], tma_bar_ptr=mbar_qdo)

        st_a = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        st_b = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages_b)
        for n in cutlass.range(n_end, unroll=1):
            gK = cute.local_tile(mK[None, None, kv_head, batch], box, (n, None))  # (64, 64, nc)
            gV = cute.local_tile(mV[None, None, kv_head, batch], box, (n, None))
            tKsA, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gK, 0, 2))
            tKsB, _ = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gK, 0, 2))
            tVsB, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gV, 0, 2))
            for c in cutlass.range_constexpr(self.nc):
                ring_a.producer_acquire(st_a)
                cute.copy(tma_k, tKg[None, c], tKsA[None, st_a.index], tma_bar_ptr=ring_a.producer_get_barrier(st_a))
                st_a.advance()
                if const_expr(self.stream):  # dO_c next to V_c (pair_gemm)
                    ring_b.producer_acquire(st_b)
                    cute.copy(tma_do, tdOg[None, c], tdOsB[None, st_b.index],
                              tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                    st_b.advance()
                ring_b.producer_acquire(st_b)
                cute.copy(tma_v, tVg[None, c], tVsB[None, st_b.index], tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                st_b.advance()
            for j in cutlass.range_constexpr(self.h0):
                ring_a.producer_acquire(st_a)
                cute.copy(tma_k, tKg[None, self.dq_chunk(part, j)], tKsA[None, st_a.index],
                          tma_bar_ptr=ring_a.producer_get_barrier(st_a))
                st_a.advance()
                if const_expr(self.h0 + j < self.pc):
                    ring_b.producer_acquire(st_b)
                    cute.copy(tma_k, tKg[None, self.dq_chunk(part, self.h0 + j)], tKsB[None, st_b.index],
                              tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                    st_b.advance()

    def dq_chunk(self, part, j: int):
        """The K chunk of the ``j``-th dQ chunk of ``part`` (:meth:`BwdSm90Base.chunk_of_part`, clamped to a real
        chunk); one part (D <= 512): ``j`` itself (a trace-time constant)."""
        if const_expr(self.parts == 1):
            return j
        return self.chunk_of_part(part, self.pc, j)[1]

    @cute.jit
    def consume(self, is_s: cutlass.Constexpr, mRow: cute.Tensor, mdQ: cute.Tensor, mma_ss: cute.TiledMma,
                mma_dq: cute.TiledMma, sRes: cute.Tensor, sR: cute.Tensor, sdS: cute.Tensor, sP: cute.Tensor,
                ring: pipeline.PipelineTmaAsync, mbar_qdo, scale: Float32, scale_log2: Float32,
                m_block: Int32, head: Int32, batch: Int32, n_end: Int32, seqlen_q: Int32,
                seqlen_k: Int32, tid: Int32, part: Int32):
        """One consumer. ``is_s``: consumer 0 (``sRes`` = Q, ``mRow`` = lse; S -> P), else consumer 1
        (``sRes`` = dO, ``mRow`` = delta; dP -> dS). The score GEMM reads the resident chunks as A and
        the ring's K (or V) chunks as B (stream, consumer 1: both from the ring, dO_c then V_c); the dQ
        GEMM reads dS (shared memory) as A and the ring's K chunks, viewed (d, key), as B."""
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
        acc_dQ = []
        for _ in cutlass.range_constexpr(n_dq):
            a = cute.make_rmem_tensor(thr_dq.partition_shape_C((_TILE, _CH)), Float32)
            a.fill(0.0)
            acc_dQ.append(a)
        m0 = m_block * _TILE
        mask = Mask(seqlen_q, seqlen_k, self.causal)
        # the thread's two query rows: registers 4i, 4i+1 hold row tScS[0][0], 4i+2, 4i+3 row tScS[2][0]
        # (tests/test_cute_compile.py::test_bwd_dq_fragment_rows)
        rows = cute.make_rmem_tensor((2,), Float32)
        self.load_query_values(mRow, tScS, rows, [0, 2], 0, batch, head, m_block, seqlen_q, is_s)
        rP = cute.make_rmem_tensor_like(acc, Float32)
        dS16 = cute.make_rmem_tensor_like(acc, self.dtype)
        tSsdS = thr_ss.partition_C(sdS[None, None, 0])  # dS (query, key) at the C fragment's positions

        cute.arch.mbarrier_wait(mbar_qdo, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ring_stages)
        for n in cutlass.range(n_end, unroll=1):
            if const_expr(pairs):
                state = self.pair_gemm(mma_ss, acc, tSrA, tSrB, ring, state, self.nc)
            else:
                state = self.score_gemm(mma_ss, acc, tSrA, tSrB, ring, state)
            if const_expr(is_s):
                # keys past Nkv (zero K rows): P = 0, never inf * 0 downstream
                probs_from_lse(acc, tScS, rows, _ROW_OF_REG, scale_log2, mask, m0, n * _TILE, 1)
                cute.autovec_copy(acc, sP[None, tid])
                cute.arch.barrier_arrive(barrier_id=DqBarrier.P_WRITTEN, number_of_threads=2 * _WG)
                cute.arch.barrier(barrier_id=DqBarrier.DS_WRITTEN, number_of_threads=2 * _WG)
            else:
                cute.arch.barrier(barrier_id=DqBarrier.P_WRITTEN, number_of_threads=2 * _WG)
                cute.autovec_copy(sP[None, tid], rP)
                for v in cutlass.range_constexpr(cute.size(acc)):
                    acc[v] = rP[v] * (acc[v] - rows[(v // 2) % 2])
                dS16.store(acc.load().to(self.dtype))
                for v in cutlass.range_constexpr(cute.size(acc)):
                    tSsdS[v] = dS16[v]
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> wgmma (async proxy) reads
                cute.arch.barrier(barrier_id=DqBarrier.DS_WRITTEN, number_of_threads=2 * _WG)
            # dQ[:, own chunks] += dS K_chunk
            state = self.part_gemm(mma_dq, acc_dQ, tdQrdS0, tdQrK, ring, state)
        chunk0 = part * self.pc + (0 if const_expr(is_s) else self.h0)
        self.store_tiles(acc_dQ, mma_dq, mdQ, scale, m_block, chunk0, head, batch, seqlen_q, tid)

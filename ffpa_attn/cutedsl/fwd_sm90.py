"""sm90a (Hopper) split-D attention forward in CuTeDSL: TMA + mbarrier ring, wgmma, warp specialization.

One query block (``tile_m = 64`` rows of one (batch, head)) is computed by ``cluster`` CTAs (1 for
D <= 512; a 2-CTA cluster above), each CTA owning two of the ``2 * cluster`` head-dim column parts of
width ``d_wg`` (see :mod:`ffpa_attn.cutedsl.config` for the shared-memory and register budget). Per CTA:

* warpgroup 0, warp 0 (producer, setmaxnreg 24): TMA-loads the CTA's two Q parts (once), then its K/V
  parts in the order the consumers use them: K(0), K(1), V(0), K(2), V(1), ..., V(n-1). Every item is
  two ring slots (part 0 for consumer 0, part 1 for consumer 1). Tiles are visited from the last KV
  block to the first, so the blocks that need a mask (KV tail, causal diagonal) come first.
* warpgroups 1 and 2 (consumers c = 0, 1; setmaxnreg 240). Per tile j:
    1. issue S_p = Q_p K_p(j)^T (wgmma, both operands in shared memory, fp32 accumulators);
    2. rescale O_p by the previous tile's row factor, issue O_p += P(j-1) V_p(j-1) (P from registers);
    3. wait for S_p and write it into the consumer's own K(j) slot (dead once its wgmma completed);
       after a barrier (named barrier; with a cluster an mbarrier both CTAs arrive on) read the other
       partials -- the local consumer's, and with a cluster the peer CTA's two through DSMEM -- and sum
       all partials in one fixed order, so every consumer holds bit-identical S, hence identical P, m, l;
    4. release the K(j) slots (with a cluster also the peer's, which read them), mask (KV tail /
       causal, only on the first few tiles), online softmax in fp32 (exp2, scale folded in), wait for
       P.V(j-1), release V(j-1), convert P to 16 bits.
  After the last tile: the final P.V, O_p /= l, O_p -> the consumer's own Q part (stmatrix) -> TMA
  store (rows >= Nq and columns >= D are clipped by the TMA bounds); lse = (m + log2 l) ln 2 from
  consumer 0 of cluster rank 0. With a cluster, a final cluster barrier keeps each CTA's shared memory
  alive until the peer no longer reads it.

Conventions (from :mod:`ffpa_attn.contract`): tail-aligned causal (query row r sees key k iff
``k <= r + Nkv - Nq``), GQA head mapping ``kv_head = q_head // (Hq // Hkv)``, lse natural log of the
scaled scores, fp32 ``[B, Hq, Nq]``.
"""
from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.utils import LayoutEnum

from .block_info import BlockInfo
from .config import FwdConfig
from .mask import Mask
from .named_barrier import FwdBarrier
from .seqlen_info import SeqlenInfo
from .softmax import OnlineSoftmax
from .tile_scheduler import DenseTileScheduler, VarlenTileScheduler

_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_WG = 128  # threads per warpgroup
_CONSUMER_WARPS = 8


def _dtype(name: str) -> Type[cutlass.Numeric]:
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


class FlashFwdSm90SplitD:
    """Forward kernel for one :class:`FwdConfig` (compile-time: D, dtype, causal, tiles, ring depth,
    cluster size).

    Call (inside ``cute.compile``) with q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``, o like q,
    lse ``[B, Hq, Nq]`` fp32 (all with unit stride on the last mode), ``scale_log2 = scale * log2(e)``,
    ``group = Hq // Hkv`` and a stream. Sizes and strides are runtime values.
    """

    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self.dtype = _dtype(cfg.dtype)
        self.tile_m = cfg.tile_m
        self.tile_n = cfg.tile_n
        self.d_wg = cfg.d_wg
        self.stages = cfg.stages
        self.causal = cfg.causal
        self.cluster = cfg.cluster
        self.varlen = cfg.varlen
        self.block_info = BlockInfo(cfg.tile_m, cfg.tile_n, cfg.causal)
        self.num_threads = 3 * _WG
        # resident Q parts per CTA; a subclass computing S over more columns than it owns of O
        # (:mod:`.fwd_sm90_recompute`) changes it and :meth:`dense_scheduler`
        self.q_parts = 2
        assert cfg.exchange_fits and self.cluster in (1, 2)

    # ------------------------------------------------------------------------------------------------
    # host side

    def _smem_layout(self, rows: int, stages: int):
        """(rows, d_wg, stages) K-major swizzled layout of the Q parts / O tile (rows = tile_m) and of the
        ring slots (rows = tile_n; read K-major for K and, transposed, MN-major for V)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.d_wg), self.dtype)
        return cute.tile_to_shape(atom, (rows, self.d_wg, stages), order=(0, 1, 2))

    def _tiled_mmas(self):
        qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
            (self.tile_m, self.tile_n))
        pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
            (self.tile_m, self.d_wg), warpgroup.OperandSource.RMEM)
        return qk, pv

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, scale_log2: Float32, group: Int32, cta_limit: Int32, stream: cuda.CUstream,
                 mCuSeqlensQ: Optional[cute.Tensor] = None, mCuSeqlensK: Optional[cute.Tensor] = None,
                 mItems: Optional[cute.Tensor] = None):
        """Varlen (``cfg.varlen``): q/k/v/o are ``[1, H, T, D]`` views of the packed ``[T, H, D]`` tensors, lse
        ``[1, Hq, T_q]``, ``mCuSeqlensQ`` / ``mCuSeqlensK`` int32 ``[B + 1]``, ``mItems`` the int32 ``[2, capacity]``
        work list of :func:`ffpa_attn.cutedsl.ranges.varlen_work_items`; ``cta_limit`` is ignored."""
        # (B, H, N, D) -> (N, D, H, B): TMA-friendly mode order, D contiguous
        mQt, mKt, mVt, mOt = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
                              for t in (mQ, mK, mV, mO)]
        sQ_layout = self._smem_layout(self.tile_m, self.q_parts)
        ring_layout = self._smem_layout(self.tile_n, self.stages)
        q_tile_layout = cute.slice_(sQ_layout, (None, None, 0))
        kv_tile_layout = cute.slice_(ring_layout, (None, None, 0))
        q_tile = (self.tile_m, self.d_wg)
        kv_tile = (self.tile_n, self.d_wg)
        g2s, s2g = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQt, q_tile_layout, q_tile)
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mKt, kv_tile_layout, kv_tile)
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mVt, kv_tile_layout, kv_tile)
        tma_o, tO = cpasync.make_tiled_tma_atom(s2g, mOt, q_tile_layout, q_tile)
        tiled_mma_qk, tiled_mma_pv = self._tiled_mmas()
        # the mbarrier transaction counts must equal what the TMA boxes deliver (else consumers hang)
        assert cute.size_in_bytes(self.dtype, kv_tile_layout) == self.cfg.slot_bytes
        assert self.q_parts * cute.size_in_bytes(self.dtype, q_tile_layout) == self.cfg.q_bytes

        stages = self.stages

        @cute.struct
        class SharedStorage:
            mbar_ring: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_x: cute.struct.MemRange[cutlass.Int64, 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            ring: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 1024]

        self.shared_storage = SharedStorage
        if const_expr(self.varlen):
            grid = VarlenTileScheduler(self.cluster).grid(cute.size(mQt.shape[2]), cute.size(mItems.shape[1]))
        else:
            num_m_blocks = cute.ceil_div(mQt.shape[0], self.tile_m)
            # q_broadcast: q has one batch entry that serves every batch entry of k / v (the KV slices of split-KV)
            batches = cute.size(mKt.shape[3]) if const_expr(self.cfg.q_broadcast) else cute.size(mQt.shape[3])
            grid = self.dense_scheduler().grid(num_m_blocks, cute.size(mQt.shape[2]), batches)
        # varlen: the plain O tensor too (bounded stores of a sequence's last, partial block)
        mO_rows = mOt if const_expr(self.varlen) else None
        kernel = self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_o, tO, mLSE, tiled_mma_qk, tiled_mma_pv,
                             sQ_layout, ring_layout, scale_log2, group, cta_limit, mO_rows, mCuSeqlensQ,
                             mCuSeqlensK, mItems)
        if const_expr(self.cluster > 1):
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], cluster=[self.cluster, 1, 1],
                          stream=stream, min_blocks_per_mp=1)
        else:
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------------
    # device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
               mLSE: cute.Tensor, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout, scale_log2: Float32,
               group: Int32, cta_limit: Int32, mO_rows: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor],
               mCuSeqlensK: Optional[cute.Tensor], mItems: Optional[cute.Tensor]):
        if const_expr(self.varlen):
            # slots past the real work list hold sequence -1 (both CTAs of a cluster read the same slot)
            if VarlenTileScheduler(self.cluster).work(mItems).valid:
                self.cta(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mLSE, tiled_mma_qk, tiled_mma_pv, sQ_layout,
                         ring_layout, scale_log2, group, mO_rows, mCuSeqlensQ, mCuSeqlensK, mItems)
        else:
            # CTAs whose linear index (x fastest, then head, batch) is >= cta_limit exit at once
            # (ffpa_attn/tail_split.py: the last partial wave runs as a split-KV launch instead; cluster size 1 only)
            bidx, head, batch = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            if (batch * gy + head) * gx + bidx < cta_limit:
                self.cta(tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mLSE, tiled_mma_qk, tiled_mma_pv, sQ_layout,
                         ring_layout, scale_log2, group, mO_rows, mCuSeqlensQ, mCuSeqlensK, mItems)

    @cute.jit
    def cta(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
            tma_v: cute.CopyAtom, mV: cute.Tensor, tma_o: cute.CopyAtom, mO: cute.Tensor,
            mLSE: cute.Tensor, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
            sQ_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout, scale_log2: Float32,
            group: Int32, mO_rows: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor],
            mCuSeqlensK: Optional[cute.Tensor], mItems: Optional[cute.Tensor]):
        """The whole work of one CTA (see the module docstring)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG)
        if const_expr(self.varlen):
            work = VarlenTileScheduler(self.cluster).work(mItems)
            seqlen = SeqlenInfo.from_cu_seqlens(work.batch, mCuSeqlensQ, mCuSeqlensK)
            batch = 0  # the packed tensors' only batch entry; the sequence is the row offset of `seqlen`
        else:
            # causal: the longest query blocks (most KV tiles) start first
            work = self.dense_scheduler().work()
            seqlen = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
            batch = work.batch
        m_block, head, rank = work.block, work.head, work.rank
        kv_head = head // group
        seqlen_q = seqlen.seqlen_q
        seqlen_k = seqlen.seqlen_k

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar_q = storage.mbar_q.data_ptr()
        mbar_x = storage.mbar_x.data_ptr()
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_ring.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            # every consumer warp of every CTA of the cluster releases every slot
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _CONSUMER_WARPS * self.cluster),
            tx_count=self.cfg.slot_bytes,
            defer_sync=True,
        )
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_q, 1)
                cute.arch.mbarrier_init(mbar_x, _CONSUMER_WARPS * self.cluster)
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cluster > 1):  # the peer arrives on our barriers: they must exist first
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, d_wg, 2)
        sRing = storage.ring.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)  # (64, d_wg, S)

        _, n_block_max = self.block_info.key_block_range(seqlen, m_block)
        n_tiles = n_block_max  # blocks n_block_max-1 .. 0

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp_idx == 0:
                if const_expr(self.varlen):
                    if n_tiles > 0:  # else: rows without keys (causal Nq > Nk, or Nk = 0), nothing to load
                        self.produce(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sRing, ring, mbar_q, m_block, head,
                                     kv_head, batch, n_block_max, n_tiles, rank, seqlen)
                else:
                    self.produce(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sRing, ring, mbar_q, m_block, head,
                                 kv_head, batch, n_block_max, n_tiles, rank, seqlen)
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            if const_expr(self.varlen):
                if n_tiles > 0:
                    self.consume(tma_o, mO, mLSE, tiled_mma_qk, tiled_mma_pv, sQ, sRing, storage, ring, mbar_q,
                                 mbar_x, scale_log2, m_block, head, batch, seqlen, n_block_max, n_tiles,
                                 wg_idx - 1, tidx % _WG, rank, mO_rows)
                else:
                    self.store_empty(mO_rows, mLSE, m_block, head, seqlen, wg_idx - 1, tidx % _WG, rank)
            else:
                self.consume(tma_o, mO, mLSE, tiled_mma_qk, tiled_mma_pv, sQ, sRing, storage, ring, mbar_q,
                             mbar_x, scale_log2, m_block, head, batch, seqlen, n_block_max, n_tiles,
                             wg_idx - 1, tidx % _WG, rank, mO_rows)
        if const_expr(self.cluster > 1):  # keep this CTA's shared memory alive while the peer reads it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sRing: cute.Tensor,
                ring: pipeline.PipelineTmaAsync, mbar_q, m_block: Int32, head: Int32, kv_head: Int32,
                batch: Int32, n_block_max: Int32, n_tiles: Int32, rank: Int32, seqlen: SeqlenInfo):
        """Warp 0 of the producer warpgroup: the Q parts of the CTA's S once, then the K items (the same parts)
        and V items (the CTA's two O parts) in consumption order.

        Varlen: boxes start at the sequence's first row; the rows of a box past the sequence's end (the next
        sequence's, or TMA zero fill past the tensor) only reach query rows that are never stored or keys
        that the mask removes."""
        part0 = 2 * rank  # this CTA's first O part: its V parts are part0, part0 + 1
        # the Q / K parts of this CTA's S: its own two (the exchange adds the others' partials), or every part
        qk_part0 = part0 if const_expr(self.q_parts == 2) else 0
        tQs, tQg, tKs, tKg, tVs, tVg = self.load_views(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sRing, m_block, head,
                                                       kv_head, batch, seqlen)

        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, self.cfg.q_bytes)
        for p in cutlass.range_constexpr(self.q_parts):
            cute.copy(tma_q, tQg[None, qk_part0 + p], tQs[None, p], tma_bar_ptr=mbar_q)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        state = self.load_item(tma_k, tKg, tKs, ring, state, n_block_max - 1, qk_part0, self.q_parts)  # K(0)
        for t in cutlass.range(1, n_tiles, unroll=1):
            blk = n_block_max - 1 - t
            state = self.load_item(tma_k, tKg, tKs, ring, state, blk, qk_part0, self.q_parts)  # K(t)
            state = self.load_item(tma_v, tVg, tVs, ring, state, blk + 1, part0, 2)  # V(t-1)
        state = self.load_item(tma_v, tVg, tVs, ring, state, n_block_max - n_tiles, part0, 2)  # V(n-1)

    @cute.jit
    def load_item(self, tma: cute.CopyAtom, tg: cute.Tensor, ts: cute.Tensor, ring: pipeline.PipelineTmaAsync,
                  state: pipeline.PipelineState, blk: Int32, part0, n_slots: int):
        """TMA-load head-dim parts ``part0 .. part0 + n_slots - 1`` of key block ``blk`` into the next
        ``n_slots`` ring slots; returns ``state`` advanced past them (rebind it: the tracer carries loop state
        through plain local assignments only)."""
        for p in cutlass.range_constexpr(n_slots):
            ring.producer_acquire(state)
            cute.copy(tma, tg[None, blk, part0 + p], ts[None, state.index],
                      tma_bar_ptr=ring.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def load_views(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                   tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sRing: cute.Tensor, m_block: Int32,
                   head: Int32, kv_head: Int32, batch: Int32, seqlen: SeqlenInfo):
        """TMA (shared, global) partitions of the producer: Q parts (by part), K and V (by key block, part)."""
        q_batch = 0 if const_expr(self.cfg.q_broadcast) else batch
        gQ = cute.local_tile(seqlen.rows_q(mQ[None, None, head, q_batch]), (self.tile_m, self.d_wg), (m_block, None))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))  # gQ: (64, d_wg, parts)
        kv_tile = (self.tile_n, self.d_wg)
        gK = cute.local_tile(seqlen.rows_k(mK[None, None, kv_head, batch]), kv_tile, (None, None))  # (n, d_wg, nblk, parts)
        gV = cute.local_tile(seqlen.rows_k(mV[None, None, kv_head, batch]), kv_tile, (None, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sRing, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sRing, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        return tQs, tQg, tKs, tKg, tVs, tVg

    @cute.jit
    def consume(self, tma_o: cute.CopyAtom, mO: cute.Tensor, mLSE: cute.Tensor,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor,
                sRing: cute.Tensor, storage, ring: pipeline.PipelineTmaAsync, mbar_q, mbar_x,
                scale_log2: Float32, m_block: Int32, head: Int32, batch: Int32, seqlen: SeqlenInfo,
                n_block_max: Int32, n_tiles: Int32, c: Int32, tid: Int32, rank: Int32,
                mO_rows: Optional[cute.Tensor]):
        """One consumer warpgroup: head-dim part ``2 * rank + c`` of the S partials and of O."""
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        sQc = sQ[None, None, c]  # (64, d_wg)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQc))  # (MMA, 1, d_wg/16)
        tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, sX = self.consumer_tensors(thr_qk, thr_pv, sRing, storage)
        sX_peer = sX
        if const_expr(self.cluster > 1):  # the same slots in the peer CTA (DSMEM)
            sX_peer = cute.make_tensor(cute.arch.map_dsmem_ptr(sX.iterator, 1 - rank), sX.layout)
        softmax = OnlineSoftmax.create()
        self.consume_tiles(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, sX,
                           sX_peer, ring, mbar_q, mbar_x, softmax, scale_log2, m_block, seqlen, n_block_max, n_tiles,
                           c, tid, rank, 2, 2)
        self.finish(tma_o, mO, mLSE, tiled_mma_pv, acc_O, softmax, sQ, c, tScS, m_block, head, batch, seqlen, c, tid,
                    rank, mO_rows)

    @cute.jit
    def consume_tiles(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tSrQ, tSrK: cute.Tensor,
                      tOrV: cute.Tensor, acc_S: cute.Tensor, acc_O: cute.Tensor, tOrP: cute.Tensor,
                      tOrP_as_S: cute.Tensor, tScS: cute.Tensor, sX: cute.Tensor, sX_peer: cute.Tensor,
                      ring: pipeline.PipelineTmaAsync, mbar_q, mbar_x, softmax: OnlineSoftmax, scale_log2: Float32,
                      m_block: Int32, seqlen: SeqlenInfo, n_block_max: Int32, n_tiles: Int32, c: Int32, tid: Int32,
                      rank: Int32, k_slots: int, v_slots: int):
        """A consumer's main loop over the key tiles (descending block order), leaving O (unnormalised) in
        ``acc_O`` and the row statistics in ``softmax``: tile 0 computes S only; each next tile t issues S(t) =
        Q K(t)^T and O = O * scale(t-1) + P(t-1) V(t-1) together, exchanges the S partials, masks (the first
        ``n_masked`` tiles), runs the online softmax; then the last P.V.

        The ring holds K(0), then per tile K(t), V(t-1), then V(n-1); a K item takes ``k_slots`` slots and a V
        item ``v_slots``. ``self.qk_gemm`` issues this consumer's partial S from ``tSrQ`` (its Q fragments)."""
        mask = Mask.create(seqlen, self.causal)
        # tiles that may need a mask come first (descending block order)
        n_masked = self.block_info.masked_key_blocks(seqlen, m_block, n_block_max)

        cute.arch.mbarrier_wait(mbar_q, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        x_phase = Int32(0)  # the cluster exchange's mbarrier phase (unused with one CTA per query block)

        # ---- tile 0: S only
        self.qk_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, ring, state, c)
        warpgroup.wait_group(0)
        self.exchange(acc_S, sX, sX_peer, ring, state, mbar_x, x_phase, c, tid, rank, scale_log2)
        x_phase = x_phase ^ 1
        mask.apply(acc_S, tScS, m_block * self.tile_m, (n_block_max - 1) * self.tile_n)
        softmax.online(acc_S)
        tOrP_as_S.store(acc_S.load().to(self.dtype))
        for _ in cutlass.range_constexpr(k_slots):
            state.advance()

        for t in cutlass.range(1, n_tiles, unroll=1):
            blk = n_block_max - 1 - t
            # S(t) = Q K(t)^T (async)
            self.qk_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, ring, state, c)
            # O = O * scale(t-1) + P(t-1) V(t-1) (async); V(t-1) follows K(t) in the ring
            softmax.rescale(acc_O)
            v_state = state.clone()
            for _ in cutlass.range_constexpr(k_slots):
                v_state.advance()
            self.ring_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, ring, v_state, c, t > 1)
            warpgroup.wait_group(1)
            self.exchange(acc_S, sX, sX_peer, ring, state, mbar_x, x_phase, c, tid, rank, scale_log2)
            x_phase = x_phase ^ 1
            if t < n_masked:
                mask.apply(acc_S, tScS, m_block * self.tile_m, blk * self.tile_n)
            softmax.online(acc_S)
            warpgroup.wait_group(0)
            self.release_item(ring, v_state, rank)
            tOrP_as_S.store(acc_S.load().to(self.dtype))
            for _ in cutlass.range_constexpr(k_slots + v_slots):
                state.advance()

        # ---- last P.V
        softmax.rescale(acc_O)
        self.ring_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, ring, state, c, n_tiles > 1)
        warpgroup.wait_group(0)
        self.release_item(ring, state, rank)

    def dense_scheduler(self) -> DenseTileScheduler:
        """The dense grid's tile scheduler (clusters of ``self.cluster`` CTAs per query block along grid x)."""
        return DenseTileScheduler(self.cluster, self.causal)

    @cute.jit
    def consumer_tensors(self, thr_qk, thr_pv, sRing: cute.Tensor, storage):
        """A consumer's ring fragments (K for QK^T, V^T for P.V), register tensors (S, O, P and P viewed with
        S's layout), the (row, col) of each S register and the fp32 exchange view of the ring."""
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sRing))  # (MMA, 1, d_wg/16, S)
        sRingT = cute.composition(sRing, cute.make_ordered_layout(
            (self.d_wg, self.tile_n, self.stages), order=(1, 0, 2)))  # (d_wg, tile_n, S): V^T view
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sRingT))  # (MMA, 1, tile_n/16, S)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.d_wg)), Float32)
        tOrP = cute.make_rmem_tensor(thr_pv.partition_shape_A((self.tile_m, self.tile_n)), self.dtype)
        # same flat register order as acc_S (checked in tests/test_cute_compile.py)
        tOrP_as_S = cute.make_tensor(tOrP.iterator, acc_S.layout)
        # (row, col) of each S register of this thread
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        # fp32 view of the ring for the partial-S exchange: (value, thread, slot); each thread's values in
        # 16-byte groups, consecutive threads' groups adjacent (128-bit, bank-conflict-free accesses)
        n_s = cute.size(acc_S)
        slot_f32 = self.cfg.slot_bytes // 4
        sX = cute.make_tensor(cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32),
                              cute.make_layout(((4, n_s // 4), _WG, self.stages),
                                               stride=((1, 4 * _WG), 4, slot_f32)))
        return tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, sX

    @cute.jit
    def finish(self, tma_o: cute.CopyAtom, mO: cute.Tensor, mLSE: cute.Tensor, tiled_mma_pv: cute.TiledMma,
               acc_O: cute.Tensor, softmax: OnlineSoftmax, sQ: cute.Tensor, o_slot: Int32, tScS: cute.Tensor,
               m_block: Int32, head: Int32, batch: Int32, seqlen: SeqlenInfo, c: Int32, tid: Int32, rank: Int32,
               mO_rows: Optional[cute.Tensor]):
        """After the last P.V: O_p /= l, O_p -> Q part ``o_slot`` of shared memory (no longer read by any wgmma)
        -> store of head-dim part ``2 * rank + c``; lse from consumer 0 of rank 0."""
        seqlen_q = seqlen.seqlen_q
        # ---- finalize: O /= l, lse
        lse = softmax.finalize()
        softmax.rescale(acc_O)

        # ---- epilogue: O part -> own Q part (smem) -> TMA store; lse from consumer 0 of rank 0
        sOc = sQ[None, None, o_slot]
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tid)
        cute.copy(st_atom, thr_st.retile(rO), thr_st.partition_D(sOc))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=FwdBarrier.EPILOGUE + c, number_of_threads=_WG)

        if c == 0 and rank == 0:
            row0 = m_block * self.tile_m
            if tScS[0][1] == 0:
                for h in cutlass.range_constexpr(2):
                    row = row0 + tScS[2 * h][0]
                    if row < seqlen_q:
                        mLSE[batch, head, seqlen.offset_q + row] = lse[h]
        if const_expr(self.varlen):
            # TMA clips at the tensor, not the sequence: a block reaching past the sequence's last row is
            # stored by predicated plain stores instead (one per sequence and head)
            if (m_block + 1) * self.tile_m <= seqlen_q:
                self.store_o_tma(tma_o, mO, sOc, m_block, head, batch, seqlen, c, tid, rank)
            else:
                self.store_o_rows(mO_rows, sOc, m_block, head, seqlen, c, tid, rank)
        else:
            self.store_o_tma(tma_o, mO, sOc, m_block, head, batch, seqlen, c, tid, rank)

    @cute.jit
    def store_o_tma(self, tma_o: cute.CopyAtom, mO: cute.Tensor, sOc: cute.Tensor, m_block: Int32, head: Int32,
                    batch: Int32, seqlen: SeqlenInfo, c: Int32, tid: Int32, rank: Int32):
        """TMA store of the consumer's O part (in ``sOc``); rows past the tensor and columns past D are clipped."""
        if tid < 32:
            gO = cute.local_tile(seqlen.rows_q(mO[None, None, head, batch]), (self.tile_m, self.d_wg),
                                 (m_block, 2 * rank + c))
            tOs, tOg = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sOc, 0, 2),
                                             cute.group_modes(gO, 0, 2))
            cute.copy(tma_o, tOs, tOg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_o_rows(self, mO_rows: cute.Tensor, sOc: Optional[cute.Tensor], m_block: Int32, head: Int32,
                     seqlen: SeqlenInfo, c: Int32, tid: Int32, rank: Int32):
        """Varlen: the consumer's O part (``sOc``; None = zeros) -> rows ``< seqlen_q`` of the sequence and
        columns ``< D``, by plain stores of 8 elements (16 bytes, D is a multiple of 8) per thread and step."""
        gO = cute.local_tile(seqlen.rows_q(mO_rows[None, None, head, 0]), (self.tile_m, self.d_wg),
                             (m_block, 2 * rank + c))
        rows = seqlen.seqlen_q - m_block * self.tile_m
        cols = mO_rows.shape[1] - (2 * rank + c) * self.d_wg
        chunks = self.d_wg // 8
        for i in cutlass.range_constexpr((self.tile_m * chunks + _WG - 1) // _WG):
            idx = i * _WG + tid
            row = idx // chunks
            col = (idx - row * chunks) * 8
            if row < rows and col < cols and idx < self.tile_m * chunks:
                for e in cutlass.range_constexpr(8):
                    if const_expr(sOc is None):
                        gO[row, col + e] = self.dtype(0.0)
                    else:
                        gO[row, col + e] = sOc[row, col + e]

    @cute.jit
    def store_empty(self, mO_rows: cute.Tensor, mLSE: cute.Tensor, m_block: Int32, head: Int32,
                    seqlen: SeqlenInfo, c: Int32, tid: Int32, rank: Int32):
        """Varlen query block whose rows see no key (causal Nq > Nk, or Nk = 0): out 0, lse -inf."""
        if c == 0 and rank == 0:
            for i in cutlass.range_constexpr(self.tile_m // _WG + 1):
                row = i * _WG + tid
                if row < self.tile_m and m_block * self.tile_m + row < seqlen.seqlen_q:
                    mLSE[0, head, seqlen.offset_q + m_block * self.tile_m + row] = -Float32.inf
        self.store_o_rows(mO_rows, None, m_block, head, seqlen, c, tid, rank)

    # ------------------------------------------------------------------------------------------------
    # consumer pieces

    @cute.jit
    def half_slot(self, state: pipeline.PipelineState, c: Int32):
        """(slot index, phase) of part ``c`` of the two-slot item that starts at ``state``."""
        idx = state.index + c
        phase = state.phase
        if idx >= self.stages:
            idx = idx - self.stages
            phase = phase ^ 1
        return idx, phase

    @cute.jit
    def wait_half(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, c: Int32):
        idx, phase = self.half_slot(state, c)
        cute.arch.mbarrier_wait(ring.sync_object_full.get_barrier(idx), phase)
        return idx

    @cute.jit
    def release_item(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, rank: Int32):
        """Every consumer warp arrives once on both ring slots of the item at ``state`` (with a cluster,
        on the peer CTA's too: its K slots hold partials this CTA read)."""
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            for h in cutlass.range_constexpr(2):
                idx, _ = self.half_slot(state, h)
                cute.arch.mbarrier_arrive(ring.sync_object_empty.get_barrier(idx))
                if const_expr(self.cluster > 1):
                    cute.arch.mbarrier_arrive(ring.sync_object_empty.get_barrier(idx),
                                              peer_cta_rank_in_cluster=1 - rank, scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def qk_gemm(self, tiled_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, c: Int32):
        """Wait for this consumer's K part of the item at ``state``; issue S = Q_p K_p^T (committed)."""
        self.ring_gemm(tiled_mma, acc_S, tSrQ, tSrK, ring, state, c, False)

    @cute.jit
    def ring_gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                  ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, c: Int32, accumulate):
        """Wait for this consumer's part of the item at ``state``; issue acc (+)= A B_p with B_p from that ring slot
        (committed): S = Q_p K_p^T, or O_p (+)= P V_p."""
        idx = self.wait_half(ring, state, c)
        warpgroup.fence()
        mma = cute.make_mma_atom(tiled_mma.op)
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k, idx], acc)
            mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def exchange(self, acc_S: cute.Tensor, sX: cute.Tensor, sX_peer: cute.Tensor,
                 ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, mbar_x, x_phase: Int32,
                 c: Int32, tid: Int32, rank: Int32, scale_log2: Float32):
        """S = (sum of all consumers' partials, in a fixed order) * scale * log2(e); then release the item.

        Each consumer writes its partial into its own K slot of the item. Cluster of 1: a named barrier,
        then S = S_0 + S_1 (commutative, so both consumers get the same bits). Cluster of 2: every
        consumer warp arrives on the exchange mbarrier of both CTAs, then S = (S_00 + S_01) + (S_10 + S_11)
        (rank, consumer) with the peer's two partials read through DSMEM. The scale is applied before
        any masking so that -inf stays -inf for a negative scale.
        """
        own, other = self.exchange_slots(state, c)
        cute.autovec_copy(acc_S, sX[None, tid, own])
        if const_expr(self.cluster == 1):
            cute.arch.barrier(barrier_id=FwdBarrier.EXCHANGE, number_of_threads=2 * _WG)
        else:
            cute.arch.fence_acq_rel_cluster()  # our partial visible to the peer before the arrive
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive(mbar_x)
                cute.arch.mbarrier_arrive(mbar_x, peer_cta_rank_in_cluster=1 - rank,
                                          scope=nvvm.MemScopeKind.CLUSTER)
            cute.arch.mbarrier_wait(mbar_x, x_phase)
            cute.arch.fence_acq_rel_cluster()
        slot0, _ = self.half_slot(state, 0)
        slot1, _ = self.half_slot(state, 1)
        # 16-byte groups of 4 values: few registers live besides acc_S and acc_O
        for g in cutlass.range_constexpr(cute.size(acc_S) // 4):
            other_g = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(sX[(None, g), tid, other], other_g)
            if const_expr(self.cluster == 1):
                for i in cutlass.range_constexpr(4):
                    acc_S[4 * g + i] = (acc_S[4 * g + i] + other_g[i]) * scale_log2
            else:
                peer0_g = cute.make_rmem_tensor((4,), Float32)
                peer1_g = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(sX_peer[(None, g), tid, slot0], peer0_g)
                cute.autovec_copy(sX_peer[(None, g), tid, slot1], peer1_g)
                for i in cutlass.range_constexpr(4):
                    mine = acc_S[4 * g + i]
                    a0 = mine if c == 0 else other_g[i]  # this CTA's consumer 0
                    a1 = other_g[i] if c == 0 else mine  # this CTA's consumer 1
                    here = a0 + a1
                    there = peer0_g[i] + peer1_g[i]
                    total = here + there if rank == 0 else there + here
                    acc_S[4 * g + i] = total * scale_log2
        # the slots are next written by TMA (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.release_k_item(ring, state, rank)

    @cute.jit
    def exchange_slots(self, state: pipeline.PipelineState, c: Int32):
        """(this consumer's, the other consumer's) ring slot holding its partial S of the K item at ``state``:
        each consumer's own K slot, dead once its QK^T completed."""
        own, _ = self.half_slot(state, c)
        other, _ = self.half_slot(state, 1 - c)
        return own, other

    @cute.jit
    def release_k_item(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, rank: Int32):
        """Release the K item at ``state`` once its partials were read (two slots here)."""
        self.release_item(ring, state, rank)

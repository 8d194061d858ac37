"""sm90a forward for D <= 512 with a P handoff between the two consumers (no partial-S exchange).

The base kernel (:class:`~ffpa_attn.cutedsl.fwd_sm90.FlashFwdSm90SplitD`) gives each consumer half of the head
dim for Q, K, V and O: per key tile both compute a partial S, exchange 64 x tile_n fp32 partials through shared
memory, and both run the same online softmax. Here the two consumers have different jobs (the producer, the ring
contents and their order are the base kernel's):

* consumer 0 computes the whole S = Q K(j)^T (both K slots of the item, one wgmma chain), masks, runs the online
  softmax, and P.V over head-dim part 0 (P from registers); it writes P (16 bits, in its register order) and the
  rows' rescale factors into the part-0 K slot of the tile, which its finished QK^T no longer reads;
* consumer 1 waits for that handoff (named barrier ``P_WRITTEN``), copies P into the same register order,
  acknowledges (``P_READ``) and releases the slot, rescales its O and runs P.V over head-dim part 1.

Per tile and CTA this moves 2 x tile_m x tile_n x 2 B of P through shared memory instead of 4 x tile_m x tile_n x
4 B of partial S, and the exponentials run once instead of twice. The QK^T of tile j+1 is issued before the
P.V of tile j in consumer 0, so its softmax overlaps both consumers' P.V on the tensor cores. Every ring slot is
read by exactly one warpgroup (K part 0: consumer 0, then consumer 1 reads P from it; K part 1 and V part 0:
consumer 0; V part 1: consumer 1), so each slot is released by that warpgroup's 4 warps. After the last tile
consumer 0 hands over 1 / l through a 1 KiB block of its own (:data:`~ffpa_attn.cutedsl.config.HANDOFF_FINAL_BYTES`)
and writes lse; each consumer stores its O part as in the base kernel.

``P_WRITTEN`` / ``P_READ`` alternate strictly (consumer 0 waits for the acknowledgement of tile j-1 before it
announces tile j), so a named barrier never collects two arrivals of one side in one phase.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from .config import HandoffFwdConfig
from .fwd_sm90 import FlashFwdSm90SplitD
from .mask import Mask
from .named_barrier import FwdBarrier
from .seqlen_info import SeqlenInfo
from .softmax import OnlineSoftmax

_WG = 128
_K_SLOTS = 2  # ring slots of a K item (head-dim parts 0, 1)
_V_SLOTS = 2


class FlashFwdSm90Handoff(FlashFwdSm90SplitD):
    """Forward kernel for one :class:`HandoffFwdConfig`; called like the base kernel."""

    def __init__(self, cfg: HandoffFwdConfig):
        assert isinstance(cfg, HandoffFwdConfig) and cfg.cluster == 1 and cfg.handoff_fits
        super().__init__(cfg)
        self.ring_consumer_warps = 4  # one warpgroup reads (and releases) each slot

    def storage_fields(self, sQ_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout) -> dict:
        """The base kernel's shared memory plus the block that hands over the final 1 / l (fp32, 2 per thread)."""
        fields = super().storage_fields(sQ_layout, ring_layout)
        fields["final"] = cute.struct.Align[cute.struct.MemRange[Float32, 2 * _WG], 16]
        return fields

    @cute.jit
    def consume(self, tma_o: cute.CopyAtom, mO: cute.Tensor, mLSE: cute.Tensor,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor,
                sRing: cute.Tensor, storage, ring: pipeline.PipelineTmaAsync, mbar_q, mbar_x,
                scale_log2: Float32, m_block: Int32, head: Int32, batch: Int32, seqlen: SeqlenInfo,
                n_block_max: Int32, n_tiles: Int32, c: Int32, tid: Int32, rank: Int32, mO_rows):
        """Consumer 0: S, softmax, P.V over part 0; consumer 1: P.V over part 1 (see the module docstring)."""
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, _ = self.consumer_tensors(thr_qk, thr_pv, sRing, storage)
        sP, sScale, sFinal = self.handoff_views(storage)
        softmax = OnlineSoftmax.create()
        if c == 0:
            tSrQ = [thr_qk.make_fragment_A(thr_qk.partition_A(sQ[None, None, p])) for p in range(_K_SLOTS)]
            lse = self.softmax_tiles(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S,
                                     tScS, sP, sScale, sFinal, ring, mbar_q, softmax, scale_log2, m_block, seqlen,
                                     n_block_max, n_tiles, tid)
            softmax.rescale(acc_O)  # row_scale = 1 / l
            self.epilogue(tma_o, mO, mLSE, tiled_mma_pv, acc_O, lse, sQ, 0, tScS, m_block, head, batch, seqlen, c,
                          tid, rank, mO_rows)
        else:
            self.pv_tiles(tiled_mma_pv, tOrV, acc_O, tOrP, sP, sScale, sFinal, ring, softmax, n_tiles, tid)
            softmax.rescale(acc_O)  # row_scale = 1 / l, from consumer 0
            # c = 1 never writes lse: row_sum stands in for the argument
            self.epilogue(tma_o, mO, mLSE, tiled_mma_pv, acc_O, softmax.row_sum, sQ, 1, tScS, m_block, head, batch,
                          seqlen, c, tid, rank, mO_rows)

    # ------------------------------------------------------------------------------------------------
    # pieces

    def handoff_views(self, storage):
        """Views of the handoff: P ``(value, thread, slot)`` in the input dtype and the rescale factors
        ``(row half, thread, slot)`` fp32 inside the ring slots (16-byte groups, consecutive threads adjacent:
        conflict-free 128-bit accesses), and the final 1 / l ``(row half, thread)``."""
        n_p = self.tile_m * self.tile_n // _WG  # P values per thread
        slot_elems = self.cfg.slot_bytes // 2
        sP = cute.make_tensor(storage.ring.data_ptr(),
                              cute.make_layout(((8, n_p // 8), _WG, self.stages), stride=((1, 8 * _WG), 8, slot_elems)))
        ring_f32 = cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32)
        p_f32 = self.tile_m * self.tile_n // 2  # fp32 words taken by P at the start of a slot
        sScale = cute.make_tensor(ring_f32 + p_f32, cute.make_layout((2, _WG, self.stages),
                                                                     stride=(1, 2, slot_elems // 2)))
        sFinal = cute.make_tensor(storage.final.data_ptr(), cute.make_layout((2, _WG), stride=(1, 2)))
        return sP, sScale, sFinal

    @cute.jit
    def slot_at(self, pos: Int32, part: int):
        """(ring slot, phase) of head-dim part ``part`` of the item starting at consumer position ``pos`` (slots
        counted from the first K item; the phase flips at every wrap of the ring)."""
        p = pos + part
        return p % self.stages, (p // self.stages) % 2

    @cute.jit
    def release_slot(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, part: int):
        """The calling warpgroup's 4 warps arrive once on ring slot ``part`` of the item at ``state``."""
        idx, _ = self.half_slot(state, part)
        self.release_at(ring, idx)

    @cute.jit
    def release_at(self, ring: pipeline.PipelineTmaAsync, idx: Int32):
        """The calling warpgroup's 4 warps arrive once on ring slot ``idx``."""
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(ring.sync_object_empty.get_barrier(idx))

    @cute.jit
    def qk_full(self, tiled_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: list, tSrK: cute.Tensor,
                ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState):
        """Issue S = Q_0 K_0^T + Q_1 K_1^T of the K item at ``state`` (one commit group), waiting for each slot
        right before its wgmmas."""
        mma = cute.make_mma_atom(tiled_mma.op)
        mma.set(warpgroup.Field.ACCUMULATE, False)
        for p in cutlass.range_constexpr(_K_SLOTS):
            idx = self.wait_half(ring, state, p)
            if const_expr(p == 0):
                warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ[p], mode=[2])):
                cute.gemm(mma, acc_S, tSrQ[p][None, None, k], tSrK[None, None, k, idx], acc_S)
                mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def publish(self, acc_S: cute.Tensor, tOrP: cute.Tensor, tOrP_as_S: cute.Tensor, softmax: OnlineSoftmax,
                sP: cute.Tensor, sScale: cute.Tensor, ring: pipeline.PipelineTmaAsync,
                state: pipeline.PipelineState, tid: Int32, first: bool):
        """P (from the softmaxed ``acc_S``) into this thread's registers and, with the rows' rescale factors, into
        the part-0 K slot of the item at ``state``; announce it to consumer 1 once it acknowledged the previous
        tile's (not for the first tile)."""
        tOrP_as_S.store(acc_S.load().to(self.dtype))
        slot, _ = self.half_slot(state, 0)
        if const_expr(not first):
            cute.arch.barrier(barrier_id=FwdBarrier.P_READ, number_of_threads=2 * _WG)
        cute.autovec_copy(tOrP, sP[None, tid, slot])
        for h in cutlass.range_constexpr(2):
            sScale[h, tid, slot] = softmax.row_scale[h]
        # the slot is overwritten by TMA (async proxy) once consumer 1 released it
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=FwdBarrier.P_WRITTEN, number_of_threads=2 * _WG)

    @cute.jit
    def softmax_tiles(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tSrQ: list,
                      tSrK: cute.Tensor, tOrV: cute.Tensor, acc_S: cute.Tensor, acc_O: cute.Tensor,
                      tOrP: cute.Tensor, tOrP_as_S: cute.Tensor, tScS: cute.Tensor, sP: cute.Tensor,
                      sScale: cute.Tensor, sFinal: cute.Tensor, ring: pipeline.PipelineTmaAsync, mbar_q,
                      softmax: OnlineSoftmax,
                      scale_log2: Float32, m_block: Int32, seqlen: SeqlenInfo, n_block_max: Int32, n_tiles: Int32,
                      tid: Int32):
        """Consumer 0's main loop (descending key blocks): S(t) and P.V(t-1) issued together, S scaled, masked
        (first ``n_masked`` tiles), online softmax, P(t) handed over; after the last tile the final 1 / l is handed
        over too. Returns lse; leaves O unnormalised in ``acc_O`` and ``softmax.row_scale`` = 1 / l."""
        mask = Mask.create(seqlen, self.causal)
        n_masked = self.block_info.masked_key_blocks(seqlen, m_block, n_block_max)
        cute.arch.mbarrier_wait(mbar_q, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        # ---- tile 0: S only
        self.qk_full(tiled_mma_qk, acc_S, tSrQ, tSrK, ring, state)
        warpgroup.wait_group(0)
        self.release_slot(ring, state, 1)
        for v in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[v] = acc_S[v] * scale_log2
        mask.apply(acc_S, tScS, m_block * self.tile_m, (n_block_max - 1) * self.tile_n)
        softmax.online(acc_S)
        self.publish(acc_S, tOrP, tOrP_as_S, softmax, sP, sScale, ring, state, tid, True)
        for _ in cutlass.range_constexpr(_K_SLOTS):
            state.advance()

        for t in cutlass.range(1, n_tiles, unroll=1):
            blk = n_block_max - 1 - t
            self.qk_full(tiled_mma_qk, acc_S, tSrQ, tSrK, ring, state)
            softmax.rescale(acc_O)
            v_state = state.clone()
            for _ in cutlass.range_constexpr(_K_SLOTS):
                v_state.advance()
            self.ring_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, ring, v_state, 0, t > 1)
            warpgroup.wait_group(1)  # S(t)
            self.release_slot(ring, state, 1)
            for v in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[v] = acc_S[v] * scale_log2
            if t < n_masked:
                mask.apply(acc_S, tScS, m_block * self.tile_m, blk * self.tile_n)
            softmax.online(acc_S)
            warpgroup.wait_group(0)  # P(t-1).V(t-1): tOrP is free again
            self.release_slot(ring, v_state, 0)
            self.publish(acc_S, tOrP, tOrP_as_S, softmax, sP, sScale, ring, state, tid, False)
            for _ in cutlass.range_constexpr(_K_SLOTS + _V_SLOTS):
                state.advance()

        # ---- last P.V; meanwhile 1 / l to consumer 1, once it acknowledged the last P
        softmax.rescale(acc_O)
        self.ring_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, ring, state, 0, n_tiles > 1)
        lse = softmax.finalize()
        cute.arch.barrier(barrier_id=FwdBarrier.P_READ, number_of_threads=2 * _WG)
        for h in cutlass.range_constexpr(2):
            sFinal[h, tid] = softmax.row_scale[h]
        cute.arch.barrier_arrive(barrier_id=FwdBarrier.P_WRITTEN, number_of_threads=2 * _WG)
        warpgroup.wait_group(0)
        self.release_slot(ring, state, 0)
        return lse

    @cute.jit
    def pv_tiles(self, tiled_mma_pv: cute.TiledMma, tOrV: cute.Tensor, acc_O: cute.Tensor, tOrP: cute.Tensor,
                 sP: cute.Tensor, sScale: cute.Tensor, sFinal: cute.Tensor, ring: pipeline.PipelineTmaAsync,
                 softmax: OnlineSoftmax, n_tiles: Int32, tid: Int32):
        """Consumer 1's loop: per tile wait for P(t), take it and its rescale factors, release the slot, rescale O
        and issue O += P(t) V_1(t); then take 1 / l into ``softmax.row_scale`` and finish the last P.V.

        Ring positions (slots from the first K item): K(0) at 0, K(t) at 4t - 2 (t >= 1), V(t) at 4t + 4 (after
        V(t-1) and K(t+1)), the last V(n-1) at 4n - 2."""
        v_idx = Int32(0)  # the slot of the V part read by the P.V in flight
        for t in cutlass.range(0, n_tiles, unroll=1):
            cute.arch.barrier(barrier_id=FwdBarrier.P_WRITTEN, number_of_threads=2 * _WG)
            if t > 0:
                warpgroup.wait_group(0)  # P(t-1).V(t-1) has read tOrP
                self.release_at(ring, v_idx)
            k_slot, _ = self.slot_at(cutlass.max(4 * t - 2, 0), 0)
            cute.autovec_copy(sP[None, tid, k_slot], tOrP)
            for h in cutlass.range_constexpr(2):
                softmax.row_scale[h] = sScale[h, tid, k_slot]
            # the slot is next written by TMA (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            self.release_at(ring, k_slot)
            cute.arch.barrier_arrive(barrier_id=FwdBarrier.P_READ, number_of_threads=2 * _WG)
            softmax.rescale(acc_O)
            v_pos = 4 * t + 4 if t + 1 < n_tiles else 4 * n_tiles - 2
            idx, phase = self.slot_at(v_pos, 1)
            cute.arch.mbarrier_wait(ring.sync_object_full.get_barrier(idx), phase)
            warpgroup.fence()
            mma = cute.make_mma_atom(tiled_mma_pv.op)
            mma.set(warpgroup.Field.ACCUMULATE, t > 0)
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(mma, acc_O, tOrP[None, None, k], tOrV[None, None, k, idx], acc_O)
                mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            v_idx = idx
        cute.arch.barrier(barrier_id=FwdBarrier.P_WRITTEN, number_of_threads=2 * _WG)
        for h in cutlass.range_constexpr(2):
            softmax.row_scale[h] = sFinal[h, tid]
        warpgroup.wait_group(0)
        self.release_at(ring, v_idx)

"""sm90a forward for 512 < D <= 1024 by S recompute: two CTAs per query block, no cluster, no DSMEM.

The default kernel above D = 512 (:class:`~ffpa_attn.cutedsl.fwd_sm90.FlashFwdSm90SplitD` with a 2-CTA cluster)
splits S = Q K^T over the two CTAs of a query block and sums the partials through distributed shared memory
on the critical path of every tile. Here each of the two CTAs of a 64-row query block (grid x = 2 x query
blocks, CTA h = grid x % 2) computes the whole S itself and owns half of O's columns:

* the head dim is cut into 4 parts of ``d_wg`` columns (:class:`~ffpa_attn.cutedsl.config.RecomputeFwdConfig`);
  the CTA keeps all 4 Q parts resident; consumer c computes the partial S over Q/K parts 2c, 2c+1 and owns O
  part 2h + c;
* the producer (the base kernel's, with 4 Q parts) loads, per tile j, K(j) over all 4 parts (4 ring slots) and
  V(j) over the CTA's two parts (2 slots), in the order K(0), K(1), V(0), K(2), V(1), ..., V(n-1);
* the two partial S meet in shared memory exactly as in the D <= 512 kernel (each consumer writes its
  partial into its first K slot of the tile, named barrier, S = S_0 + S_1 in both consumers), so both
  consumers -- and both CTAs, which run the same arithmetic on the same inputs -- hold bit-identical S, P,
  m and l; lse is written once, by consumer 0 of CTA 0.

GEMM work per tile: S over D (the two CTAs compute it twice) + P.V over the CTA's D / 2: 3 units where 2 are
useful. Shared-memory budget: see the comment block above ``RecomputeFwdConfig`` in :mod:`.config`.
Everything else (the consumer's main loop over the key tiles, tile order, masks, online softmax, epilogue,
conventions) is the base kernel's.
"""
from __future__ import annotations

from dataclasses import replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from .config import RecomputeFwdConfig
from .fwd_sm90 import FlashFwdSm90SplitD
from .seqlen_info import SeqlenInfo
from .softmax import OnlineSoftmax
from .tile_scheduler import DenseTileScheduler, WorkTile

_K_SLOTS = 4  # ring slots of one K item: every head-dim part
_V_SLOTS = 2  # ring slots of one V item: the CTA's two parts


class PairTileScheduler(DenseTileScheduler):
    """The dense grid with two head-dim parts per query block and no cluster (build it with ``parts=2``): the
    two CTAs of a query block are adjacent in grid x (they read the same K/V at about the same time, so the
    second read mostly hits L2); the part ``x % 2`` is the CTA's rank: it owns O parts 2 rank, 2 rank + 1."""

    def work(self) -> WorkTile:
        tile = super().work()
        return replace(tile, rank=tile.part, part=0)


class FlashFwdSm90Recompute(FlashFwdSm90SplitD):
    """Forward kernel for one :class:`RecomputeFwdConfig`; called like the base kernel (``cta_limit`` >= the
    grid size: the tail-wave split is not wired for this variant)."""

    def __init__(self, cfg: RecomputeFwdConfig):
        assert isinstance(cfg, RecomputeFwdConfig) and cfg.cluster == 1 and not cfg.varlen
        super().__init__(cfg)
        self.q_parts = _K_SLOTS

    def dense_scheduler(self) -> PairTileScheduler:
        return PairTileScheduler(1, self.causal, parts=2)

    @cute.jit
    def consume(self, tma_o: cute.CopyAtom, mO: cute.Tensor, mLSE: cute.Tensor,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sQ: cute.Tensor,
                sRing: cute.Tensor, storage, ring: pipeline.PipelineTmaAsync, mbar_q, mbar_x,
                scale_log2: Float32, m_block: Int32, head: Int32, batch: Int32, seqlen: SeqlenInfo,
                n_block_max: Int32, n_tiles: Int32, c: Int32, tid: Int32, rank: Int32, mO_rows):
        """One consumer warpgroup: the partial S over parts 2c, 2c+1, the whole S after the exchange, and O
        part 2 * rank + c (the base kernel's main loop with 4-slot K items and this class's :meth:`qk_gemm`)."""
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        # this consumer's two Q parts 2c, 2c+1, each (MMA, 1, d_wg/16)
        tSrQ = [thr_qk.make_fragment_A(thr_qk.partition_A(sQ[None, None, 2 * c + s])) for s in range(2)]
        tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, sX = self.consumer_tensors(thr_qk, thr_pv, sRing, storage)
        softmax = OnlineSoftmax.create()
        self.consume_tiles(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tOrP, tOrP_as_S, tScS, sX, sX,
                           ring, mbar_q, mbar_x, softmax, scale_log2, m_block, seqlen, n_block_max, n_tiles, c, tid,
                           rank, _K_SLOTS, _V_SLOTS)
        # O part -> this consumer's first Q part (only it reads that part, and its last QK^T has completed)
        self.finish(tma_o, mO, mLSE, tiled_mma_pv, acc_O, softmax, sQ, 2 * c, tScS, m_block, head, batch, seqlen, c,
                    tid, rank, mO_rows)

    # ------------------------------------------------------------------------------------------------
    # pieces that differ from the base kernel

    @cute.jit
    def qk_gemm(self, tiled_mma: cute.TiledMma, acc_S: cute.Tensor, tSrQ: list, tSrK: cute.Tensor,
                ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, c: Int32):
        """Issue the partial S = sum over parts p = 2c, 2c+1 of Q_p K_p^T (one commit group; ``tSrQ``: the
        consumer's two Q part fragments), waiting for each K slot only right before its wgmmas."""
        mma = cute.make_mma_atom(tiled_mma.op)
        mma.set(warpgroup.Field.ACCUMULATE, False)
        for s in cutlass.range_constexpr(2):
            idx = self.wait_half(ring, state, 2 * c + s)
            if const_expr(s == 0):
                warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ[s], mode=[2])):
                cute.gemm(mma, acc_S, tSrQ[s][None, None, k], tSrK[None, None, k, idx], acc_S)
                mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def exchange_slots(self, state: pipeline.PipelineState, c: Int32):
        """Each consumer's partial goes into its first K slot of the item (part 2c)."""
        own, _ = self.half_slot(state, 2 * c)
        other, _ = self.half_slot(state, 2 - 2 * c)
        return own, other

    @cute.jit
    def release_k_item(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, rank: Int32):
        """The K item has 4 slots: two 2-slot releases."""
        self.release_item(ring, state, rank)
        second = state.clone()
        second.advance()
        second.advance()
        self.release_item(ring, second, rank)

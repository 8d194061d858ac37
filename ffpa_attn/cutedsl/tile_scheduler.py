"""Which work tile a CTA of a CuTeDSL kernel computes (imports cutlass).

One protocol, two implementations, each one CTA per tile (no persistent loop). Several CTAs may share one
block: the ``cluster`` CTAs of a hardware cluster (forward above D = 512) and the ``parts`` CTAs that own the
head-dim parts of a block (backward kernels, the S-recompute forward); they lie next to each other along grid x
(``x = (block * parts + part) * cluster + rank``), so they read the block's shared rows at about the same time.

* :class:`DenseTileScheduler` -- grid ``(blocks * parts * cluster, H, B)``: block x of a (head, batch) row; with
  ``reverse`` the last block is block 0, so it starts first (causal forward and the dQ kernel: the last query
  block reads the most key blocks).
* :class:`VarlenTileScheduler` -- grid ``(capacity * parts * cluster, H)``: grid x indexes the work list
  ``mItems`` (int32 ``[2, capacity]``: sequence, block) built on the device by
  :func:`ffpa_attn.cutedsl.ranges.varlen_work_items` from ``cu_seqlens``, sorted most work first. The grid comes
  from the real tile count (its bound ``T / tile + B``, known without a sync; the few slots past the real
  count hold sequence -1 and exit). As in the dense grid, the blocks of one head are the fastest mode: the
  CTAs running together read one head's K/V (at D = 512 a CTA alone is bandwidth-bound, 64 FLOP per byte of
  K/V; the reuse through L2 is what makes it compute-bound), and within a head the items with the most key
  blocks start first, so a long sequence's causal tail never runs alone at the end of its head. The parts of
  an item lie along x as in the dense grid rather than along y: L2 holds the rows they share either way, and
  this keeps one layout for both grids and grid y for the heads.

Both give a :class:`WorkTile`; the kernel then reads the sequence's offsets and lengths
(:class:`ffpa_attn.cutedsl.seqlen_info.SeqlenInfo`) and its block range
(:class:`ffpa_attn.cutedsl.block_info.BlockInfo`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class WorkTile:
    """One CTA's tile: ``block`` (query block for the forward / dQ, key block for dK/dV) of ``head`` in
    ``batch`` (dense batch entry or varlen sequence); ``rank`` the CTA's rank in its cluster; ``valid``
    False for a slot past the real work (the CTA exits); ``part`` the head-dim part (0 with one part)."""

    block: Any
    head: Any
    batch: Any
    rank: Any
    valid: Any
    part: Any = 0


def _split_cluster(x: Any, cluster: int) -> tuple[Any, Any]:
    """Grid-x index -> (index of the cluster along x, this CTA's rank in it); clusters lie along grid x."""
    if cluster > 1:
        return x // cluster, cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    return x, Int32(0)


def _split_parts(x: Any, parts: int) -> tuple[Any, Any]:
    """Index of a cluster along grid x -> (block index, head-dim part); the parts of a block are adjacent."""
    if parts > 1:
        return x // parts, x % parts
    return x, 0


@dataclass(frozen=True)
class DenseTileScheduler:
    """Grid ``(num_blocks * parts * cluster, heads, batches)``; ``reverse``: block ``num_blocks - 1`` first."""

    cluster: int
    reverse: bool
    parts: int = 1

    def grid(self, num_blocks: Any, heads: Any, batches: Any) -> tuple:
        return (num_blocks * self.parts * self.cluster, heads, batches)

    def work(self) -> WorkTile:
        """The tile of this CTA (trace time, inside ``@cute.jit`` code)."""
        bidx, head, batch = cute.arch.block_idx()
        idx, rank = _split_cluster(bidx, self.cluster)
        idx, part = _split_parts(idx, self.parts)
        block = idx
        if self.reverse:  # compile-time
            num_blocks = cute.arch.grid_dim()[0] // (self.parts * self.cluster)
            block = num_blocks - 1 - idx
        return WorkTile(block, head, batch, rank, True, part)


@dataclass(frozen=True)
class VarlenTileScheduler:
    """Grid ``(capacity * parts * cluster, heads)`` over the work list ``mItems`` (int32 ``[2, capacity]``);
    along x the ``parts`` of one item are adjacent (``x = (item * parts + part) * cluster + rank``)."""

    cluster: int
    parts: int = 1

    def grid(self, heads: Any, capacity: Any) -> tuple:
        return (capacity * self.parts * self.cluster, heads, 1)

    def work(self, mItems: cute.Tensor) -> WorkTile:
        """The tile of this CTA (trace time, inside ``@cute.jit`` code): ``valid`` is a runtime predicate."""
        bidx, head, _ = cute.arch.block_idx()
        idx, rank = _split_cluster(bidx, self.cluster)
        item, part = _split_parts(idx, self.parts)
        batch = mItems[0, item]
        block = mItems[1, item]
        return WorkTile(block, head, batch, rank, batch >= 0, part)

"""Which work tile a CTA of a CuTeDSL kernel computes (imports cutlass).

One protocol, two implementations, each one CTA per tile (no persistent loop):

* :class:`DenseTileScheduler` -- grid ``(blocks * cluster, H, B)``: block x of a (head, batch) row; with
  ``reverse`` (causal) the last query block, which reads the most key blocks, is block 0, so it starts first.
* :class:`VarlenTileScheduler` -- grid ``(capacity * parts * cluster, H)``: grid x indexes the work list
  ``mItems`` (int32 ``[2, capacity]``: sequence, block) built on the device by
  :func:`ffpa_attn.cute.ranges.varlen_work_items` from ``cu_seqlens``, sorted most work first. The grid comes
  from the real tile count (its bound ``T / tile + B``, known without a sync; the few slots past the real
  count hold sequence -1 and exit). As in the dense grid, the blocks of one head are the fastest mode: the
  CTAs running together read one head's K/V (at D = 512 a CTA alone is bandwidth-bound, 64 FLOP per byte of
  K/V; the reuse through L2 is what makes it compute-bound), and within a head the items with the most key
  blocks start first, so a long sequence's causal tail never runs alone at the end of its head. With ``parts``
  (the backward's head-dim parts of one block) the parts of an item are adjacent along x, as in the dense grid:
  they read the same Q / dO (dK/dV kernel) or K / V (dQ kernel) rows. (Measured on an H200, D=512 causal, 8
  packed sequences: 235 TFLOPS against 238 with the parts along y -- the same within noise, L2 held the shared
  rows either way; the layout is kept because it matches the dense kernels and frees grid y for the heads.)

Both give a :class:`WorkTile`; the kernel then reads the sequence's offsets and lengths
(:class:`ffpa_attn.cute.seqlen_info.SeqlenInfo`) and its block range
(:class:`ffpa_attn.cute.block_info.BlockInfo`).
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
    False for a slot past the real work (the CTA exits); ``part`` the head-dim part (backward kernels)."""

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


@dataclass(frozen=True)
class DenseTileScheduler:
    """Grid ``(num_blocks * cluster, heads, batches)``; ``reverse``: block ``num_blocks - 1`` first."""

    cluster: int
    reverse: bool

    def grid(self, num_blocks: Any, heads: Any, batches: Any) -> tuple:
        return (num_blocks * self.cluster, heads, batches)

    def work(self) -> WorkTile:
        """The tile of this CTA (trace time, inside ``@cute.jit`` code)."""
        bidx, head, batch = cute.arch.block_idx()
        idx, rank = _split_cluster(bidx, self.cluster)
        num_blocks = cute.arch.grid_dim()[0] // self.cluster
        block = num_blocks - 1 - idx if self.reverse else idx
        return WorkTile(block, head, batch, rank, True)


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
        item, part = idx, Int32(0)
        if self.parts > 1:  # compile-time
            item, part = idx // self.parts, idx % self.parts
        batch = mItems[0, item]
        block = mItems[1, item]
        return WorkTile(block, head, batch, rank, batch >= 0, part)

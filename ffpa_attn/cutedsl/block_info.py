"""Key-block / query-block ranges of the CuTeDSL kernels (imports cutlass).

:class:`BlockInfo` evaluates the arithmetic of :mod:`ffpa_attn.cutedsl.ranges` (the single source, plain Python,
checked against the reference by the CPU tests) on a kernel's runtime lengths: the forward and the dQ kernel
ask which key blocks a query block reads, the dK/dV kernel which query blocks read a key block.
Tail-aligned causal per sequence: query row ``r`` sees key ``k`` iff ``k <= r + Nk - Nq``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass

from . import ranges
from .seqlen_info import SeqlenInfo


@dataclass(frozen=True)
class BlockInfo:
    """Compile-time tiling of one kernel: ``tile_m`` query rows x ``tile_n`` keys per block, causal or not.

    Methods run at trace time inside ``@cute.jit`` code (plain Python over DSL values)."""

    tile_m: int
    tile_n: int
    causal: bool

    def key_block_range(self, seqlen: SeqlenInfo, m_block: Any) -> tuple[Any, Any]:
        """``(n_block_min, n_block_max)`` of query block ``m_block``; empty (max <= min) when its rows see no
        key (their out is 0, lse -inf)."""
        return ranges.key_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k, self.tile_m, self.tile_n,
                                      self.causal, cutlass.min, cutlass.max)

    def masked_key_blocks(self, seqlen: SeqlenInfo, m_block: Any, n_block_max: Any) -> Any:
        """How many key blocks, counted down from ``n_block_max - 1``, need the KV-tail / causal mask."""
        return ranges.masked_key_blocks(m_block, seqlen.seqlen_q, seqlen.seqlen_k, self.tile_m, self.tile_n,
                                        self.causal, n_block_max, cutlass.min, cutlass.max)

    def query_block_range(self, seqlen: SeqlenInfo, n_block: Any) -> tuple[Any, Any]:
        """``(m_block_min, m_block_max)``: the query blocks that read key block ``n_block`` (dK/dV)."""
        return ranges.query_block_range(n_block, seqlen.seqlen_q, seqlen.seqlen_k, self.tile_m, self.tile_n,
                                        self.causal, cutlass.min, cutlass.max)

"""Which keys a query row sees, inside the CuTeDSL kernels (imports cutlass).

One sequence (a dense batch entry or a packed varlen sequence, :class:`~ffpa_attn.cutedsl.seqlen_info.SeqlenInfo`)
of ``Nq`` query rows and ``Nk`` keys: row ``r`` sees key ``k`` iff ``k < Nk`` and, causal (tail-aligned),
``k <= r + causal_offset(Nq, Nk)`` (:func:`ffpa_attn.common.causal.causal_offset`: ``Nk - Nq``). Which key
blocks need a mask at all is :class:`~ffpa_attn.cutedsl.block_info.BlockInfo`'s business; this module masks the
values of one tile. Rows past ``Nq`` are not masked here: their output is never stored (the backward zeroes
their P through an infinite lse).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..common.causal import causal_offset
from .seqlen_info import SeqlenInfo


@dataclass(frozen=True)
class Mask:
    """The lengths of one sequence (runtime values) and ``causal`` (compile-time).

    Methods run at trace time inside ``@cute.jit`` code; frozen, so the DSL's runtime loops may read it."""

    seqlen_q: Any
    seqlen_k: Any
    causal: bool

    @staticmethod
    def create(seqlen: SeqlenInfo, causal: bool) -> "Mask":
        return Mask(seqlen.seqlen_q, seqlen.seqlen_k, causal)

    @cute.jit
    def keep(self, key: Any, query0: Any, query: Any):
        """Whether query row ``query0 + query`` sees ``key`` (indices within the sequence)."""
        keep = key < self.seqlen_k
        if const_expr(self.causal):
            keep = keep and key <= query0 + query + causal_offset(self.seqlen_q, self.seqlen_k)
        return keep

    @cute.jit
    def apply(self, acc_S: cute.Tensor, coords: cute.Tensor, query0: Any, key0: Any):
        """acc_S (a score tile, queries x keys; ``coords[v]``: (row, column) of register v) <- -inf where row
        ``query0 + row`` does not see key ``key0 + column``."""
        for v in cutlass.range_constexpr(cute.size(acc_S)):
            keep = self.keep(key0 + coords[v][1], query0, coords[v][0])
            acc_S[v] = acc_S[v] if keep else -Float32.inf

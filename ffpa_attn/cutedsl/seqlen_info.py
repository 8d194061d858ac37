"""Where one sequence's rows live in the tensors a CuTeDSL kernel reads (imports cutlass).

Dense calls hold one fixed-length sequence per batch entry (``[B, H, N, D]``: the offsets are 0 and the lengths
the tensors' N modes). Varlen calls pack every sequence into one ``[T, H, D]`` tensor, passed to the kernels as
a ``[1, H, T, D]`` view: sequence ``b`` is rows ``cu_seqlens[b] : cu_seqlens[b + 1]``. :class:`SeqlenInfo`
reads both offsets and lengths once at the start of a work tile, so the rest of the kernel is written once for
both layouts (tensors are viewed from the sequence's first row with :meth:`SeqlenInfo.rows_q` /
:meth:`SeqlenInfo.rows_k`, which shift one row mode of a tensor by the sequence's offset).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    """Offsets and lengths of one sequence (query and key side).

    Attributes:
        offset_q, offset_k: first packed row of the sequence's queries / keys (0 for dense: a Python int, so
            dense kernels compile exactly as without it).
        seqlen_q, seqlen_k: its query / key count (runtime values).
        varlen: compile-time: the offsets come from ``cu_seqlens``.
    """

    offset_q: Any
    offset_k: Any
    seqlen_q: Any
    seqlen_k: Any
    varlen: bool

    @staticmethod
    def dense(seqlen_q: Int32, seqlen_k: Int32) -> "SeqlenInfo":
        """One sequence per batch entry: lengths = the tensors' row counts."""
        return SeqlenInfo(0, 0, seqlen_q, seqlen_k, False)

    @staticmethod
    def from_cu_seqlens(batch: Int32, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor] = None
                        ) -> "SeqlenInfo":
        """Sequence ``batch`` of a packed call: int32 ``cu_seqlens`` ``[B + 1]`` (keys default to the queries')."""
        mCuSeqlensK = mCuSeqlensQ if mCuSeqlensK is None else mCuSeqlensK
        offset_q = mCuSeqlensQ[batch]
        offset_k = mCuSeqlensK[batch]
        return SeqlenInfo(offset_q, offset_k, mCuSeqlensQ[batch + 1] - offset_q, mCuSeqlensK[batch + 1] - offset_k,
                          True)

    def rows_q(self, mT: cute.Tensor, mode: int = 0) -> cute.Tensor:
        """``mT`` with row 0 of its query-row mode ``mode`` at the sequence's first query row (mode 0: the TMA
        views ``(T_q, D, ...)``; mode 2: ``[B, H, T_q(, D)]`` tensors such as lse)."""
        return self._shift(mT, mode, self.offset_q)

    def rows_k(self, mT: cute.Tensor, mode: int = 0) -> cute.Tensor:
        """``mT`` with row 0 of its key-row mode ``mode`` at the sequence's first key row."""
        return self._shift(mT, mode, self.offset_k)

    def _shift(self, mT: cute.Tensor, mode: int, offset) -> cute.Tensor:
        if self.varlen:  # compile-time (plain Python: these helpers run at trace time)
            return cute.domain_offset((0,) * mode + (offset,) + (0,) * (cute.rank(mT) - mode - 1), mT)
        return mT

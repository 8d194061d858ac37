"""The tail-aligned causal rule as integer arithmetic, without torch: kernel code that must import without torch
(the CuTeDSL kernels, which a compile server imports, :mod:`ffpa_attn.cache.pool`) reads it here;
:mod:`ffpa_attn.contract` re-exports it."""
from __future__ import annotations


def causal_offset(nq: int, nkv: int) -> int:
    """Tail-aligned causal offset: row r sees key k iff ``k <= r + causal_offset(nq, nkv)``."""
    return nkv - nq


__all__ = ["causal_offset"]

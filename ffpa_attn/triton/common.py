"""Triton device helpers shared by every FFPA Triton kernel (forward, backward, varlen, split-KV).

One source of truth for what the forward and the backward must agree on bit for bit:

* dropout: a Philox counter per score element, ``counter = (col, row, head, offset)`` keyed by ``seed``;
  element kept iff the first 32-bit output >= ``p_thresh = round(p * 2**32)``. Dense kernels pass
  ``row`` in [0, Nq), ``col`` in [0, Nkv) and ``head = b * Hq + h``; varlen kernels pass the packed query
  row, the packed key column and ``head = h``.
* GQA: query head ``h`` reads KV head ``h // group`` (``kv_head``).
* causal: row r sees key k iff ``k <= r + (Nkv - Nq)`` (``causal_visible``).
"""
from __future__ import annotations

import triton
import triton.language as tl


def dropout_threshold(p: float) -> int:
    """The uint32 threshold of ``dropout_keep`` for drop probability ``p`` (host side)."""
    return min(int(round(p * 2**32)), 2**32 - 1)


@triton.jit
def dropout_keep(seed, offset, head, rows, cols, p_thresh):
    """Bool tile [len(rows), len(cols)]: True where the element survives dropout.

    seed, offset: int64 scalars (from the rng tensor); head: int scalar; rows/cols: int32 1-D index tensors;
    p_thresh: uint32-range int scalar from ``dropout_threshold``.
    """
    c0 = (cols[None, :] + rows[:, None] * 0).to(tl.uint32)
    c1 = (rows[:, None] + cols[None, :] * 0).to(tl.uint32)
    c2 = (c0 * 0 + head).to(tl.uint32)
    c3 = (c0 * 0 + offset.to(tl.uint32)).to(tl.uint32)
    r0, _r1, _r2, _r3 = tl.philox(seed, c0, c1, c2, c3)
    return r0 >= p_thresh.to(tl.uint32)


@triton.jit
def kv_head(h, GROUP: tl.constexpr):
    """GQA: the KV head read by query head ``h`` (GROUP = Hq // Hkv)."""
    return h // GROUP


@triton.jit
def causal_visible(rows, cols, causal_off):
    """Bool tile: key col visible from query row under tail-aligned causal (causal_off = Nkv - Nq)."""
    return cols[None, :] <= rows[:, None] + causal_off

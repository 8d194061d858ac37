"""Triton device helpers shared by every FFPA Triton kernel (forward, backward, varlen, split-KV).

One source of truth for what the forward and the backward must agree on bit for bit:

* dropout: a Philox counter per score element, ``counter = (col, row, head, offset)`` keyed by ``seed``;
  element kept iff the first 32-bit output >= ``p_thresh = round(p * 2**32)``. Dense kernels pass
  ``row`` in [0, Nq), ``col`` in [0, Nkv) and ``head = b * Hq + h``; varlen kernels pass the packed query
  row, the packed key column and ``head = h``.
* GQA: query head ``h`` reads KV head ``h // group`` (``kv_head``).
* causal: row r sees key k iff ``k <= r + (Nkv - Nq)`` (``causal_visible``).
* float masks: an entry at or below ``contract.MASK_FLOOR`` replaces the score by the floor
  (``add_float_mask``), so a ``finfo.min`` mask never overflows when scaled by log2(e).
* paged K/V: a key tile's block-table entries and its rows inside the blocks (``page_ids``, ``key_rows``), read
  the same way by the KV-cache decode kernel and the paged varlen forward.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from ..common.rounding import round_cast  # noqa: F401  (re-exported for the Triton kernels)
from ..contract import MASK_FLOOR

_MASK_FLOOR = tl.constexpr(MASK_FLOOR)


def tma_layout_ok(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can address these tensors: unit last stride, 16-byte aligned base and
    16-byte multiples for every other (positive) stride (D=300 fp16 contiguous is not: 600-byte rows).
    The same rule holds on the GPU and under the interpreter, so CPU runs take the path a GPU takes."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(st <= 0 or (st * t.element_size()) % 16 for st in t.stride()[:-1]):
            return False
    return True


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


@triton.jit
def add_float_mask(s, bias, UNIT: tl.constexpr):
    """``s + bias * UNIT`` under the floor rule of ``contract.add_float_mask``.

    s: fp32 scores already in the kernel's units (UNIT = log2 e for base-2 kernels, 1.0 for natural log);
    bias: the float mask tile (any float dtype, natural-log units). ``bias <= MASK_FLOOR`` gives
    ``MASK_FLOOR * UNIT`` (``-inf`` for a ``-inf`` bias), so ``bias * UNIT`` is only formed where it cannot
    overflow.
    """
    b = bias.to(tl.float32)
    floor = tl.where(b == float("-inf"), float("-inf"), _MASK_FLOOR * UNIT)
    return tl.where(b > _MASK_FLOOR, s + tl.maximum(b, _MASK_FLOOR) * UNIT, floor)


# ---------------------------------------------------------------------------------------------- paged K/V
# A paged cache [num_blocks, PAGE, Hkv, D] with an int32 block table row per sequence: key position j of a sequence
# is row j % PAGE of block table[j // PAGE]. The KV-cache decode kernel and the paged varlen forward address their
# key tiles through these two helpers, so a page is looked up, clamped and masked the same way everywhere.


@triton.jit
def page_ids(BT_ROW, n0, hi, cols, col_ok, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-table entries of key positions ``cols = n0 + arange(BLOCK_N)`` (n0 a multiple of BLOCK_N; nothing
    is read at or past ``hi``): one scalar where the tile lies inside one page, else one per key row (0
    without a table)."""
    if PAGED:
        if PAGE % BLOCK_N == 0:
            blk = tl.load(BT_ROW + n0 // PAGE, mask=n0 < hi, other=0)
        else:
            blk = tl.load(BT_ROW + cols // PAGE, mask=col_ok, other=0)
    else:
        blk = n0 * 0
    return blk


@triton.jit
def key_rows(blk, n0, cols, col_ok, n_blocks, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(block, row inside the block) of key positions ``cols = n0 + arange(BLOCK_N)`` of one sequence (int64;
    contiguous caches: block 0, row = position), and the keys that may be read: col_ok and, paged, a block id
    in [0, n_blocks) (a bad id is clamped to block 0 and its keys masked)."""
    if PAGED:
        if PAGE % BLOCK_N == 0:  # consecutive rows of one page
            in_page = ((n0 % PAGE) + tl.arange(0, BLOCK_N)).to(tl.int64)
        else:
            in_page = (cols % PAGE).to(tl.int64)
        ok = (blk >= 0) & (blk < n_blocks)
        blk = tl.where(ok, blk, 0).to(tl.int64)
        ok = tl.where(ok, col_ok, False)  # (a scalar ok: the interpreter mistypes scalar & vector masks)
    else:
        in_page = cols.to(tl.int64)
        ok = col_ok
    return blk, in_page, ok

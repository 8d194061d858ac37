"""Softmax of the CuTeDSL kernels, in the log2 domain (imports cutlass).

Scores reach these functions already multiplied by ``scale * log2(e)`` (the forward folds it into the partial-S
exchange, the backward into the exponent), so every exponential is one ``exp2`` and the row statistics are in
log2 units; lse leaves the forward in natural-log units and enters the backward multiplied by ``log2(e)``.

* :class:`OnlineSoftmax` (forward): running row max and row sum over the key tiles, the rescale factor of O,
  and the final ``1 / l`` and lse.
* :func:`probs_from_lse` (backward kernels): P = exp2(S * scale * log2(e) - lse * log2(e)) of a recomputed
  score tile, 0 where :class:`~ffpa_attn.cutedsl.mask.Mask` hides the key; :func:`softmax_grad`: dS = P (dP - delta).

Register layout (wgmma m64 C fragment, 128 threads): a thread holds values of two rows; register ``v`` belongs
to row half ``(v // 2) % 2`` (checked by tests/test_cute_compile.py::test_fragment_orders).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .mask import Mask

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclass(frozen=True)
class OnlineSoftmax:
    """Per-thread statistics of its two rows, fp32 registers: ``row_max`` (log2 domain, -inf before the first
    key), ``row_sum`` (this thread's partial sum of P until :meth:`finalize` reduces it over the 4 threads of a
    row) and ``row_scale`` (``exp2(m_old - m_new)`` of the last tile, the factor O is rescaled by).

    Frozen: the register tensors change in place, the object never (the DSL carries only immutable Python
    objects through its runtime loops)."""

    row_max: cute.Tensor
    row_sum: cute.Tensor
    row_scale: cute.Tensor

    @staticmethod
    def create() -> "OnlineSoftmax":
        """The statistics before the first tile (trace time, inside a consumer): -inf, 0, 1."""
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_scale = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        row_scale.fill(1.0)
        return OnlineSoftmax(row_max, row_sum, row_scale)

    @cute.jit
    def online(self, acc_S: cute.Tensor):
        """acc_S (scores of one tile, log2 domain) <- exp2(S - m_new); row_scale <- exp2(m_old - m_new);
        row_sum <- row_sum * row_scale + the thread's part of the tile's row sums. A row that has seen no key
        (m_new = -inf) keeps P = 0 and scale 1 instead of NaN."""
        row_max, row_sum, row_scale = self.row_max, self.row_sum, self.row_scale
        n = cute.size(acc_S)
        for h in cutlass.range_constexpr(2):
            mx = row_max[h]
            for v in cutlass.range_constexpr(n):
                if const_expr((v // 2) % 2 == h):
                    mx = cute.arch.fmax(mx, acc_S[v])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            safe = 0.0 if mx == -Float32.inf else mx
            row_scale[h] = cute.math.exp2(row_max[h] - safe, fastmath=True)
            row_max[h] = mx
            total = row_sum[h] * row_scale[h]
            for v in cutlass.range_constexpr(n):
                if const_expr((v // 2) % 2 == h):
                    p = cute.math.exp2(acc_S[v] - safe, fastmath=True)
                    acc_S[v] = p
                    total = total + p
            row_sum[h] = total

    @cute.jit
    def rescale(self, acc_O: cute.Tensor):
        """acc_O (a C fragment of the same rows) *= row_scale of its row."""
        s0 = self.row_scale[0]
        s1 = self.row_scale[1]
        for i in cutlass.range(cute.size(acc_O) // 4, unroll_full=True):
            # registers 4i, 4i+1 belong to row half 0, 4i+2, 4i+3 to row half 1
            acc_O[4 * i] = acc_O[4 * i] * s0
            acc_O[4 * i + 1] = acc_O[4 * i + 1] * s0
            acc_O[4 * i + 2] = acc_O[4 * i + 2] * s1
            acc_O[4 * i + 3] = acc_O[4 * i + 3] * s1

    @cute.jit
    def finalize(self) -> cute.Tensor:
        """After the last tile: reduce the row sums l over the 4 threads of a row, set row_scale = 1 / l (the
        :meth:`rescale` that normalises O) and return the two rows' lse = (m + log2 l) ln 2 (natural log); a row
        without keys (l = 0) gets scale 0 (O = 0) and lse -inf."""
        lse = cute.make_rmem_tensor((2,), Float32)
        for h in cutlass.range_constexpr(2):
            total = self.row_sum[h]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            empty = total == 0.0 or total != total
            inv = 0.0 if empty else cute.arch.rcp_approx(total)
            self.row_scale[h] = inv
            lse[h] = -Float32.inf if empty else (self.row_max[h] + cute.math.log2(total, fastmath=False)) * LN_2
        return lse


@cute.jit
def probs_from_lse(acc: cute.Tensor, coords: cute.Tensor, lse_log2: cute.Tensor, lse_of_reg: list,
                   scale_log2: Float32, mask: Mask, query0: Any, key0: Any, key_mode: int):
    """acc (a recomputed score tile S or S^T, unscaled) <- P = exp2(S * scale_log2 - lse_log2), 0 where ``mask``
    hides the key (or the query row is past Nq / has no keys: the caller's lse_log2 is +inf there).

    ``coords[v]``: the (row, column) of register v in the tile; the key is mode ``key_mode`` of it (1 for S,
    0 for S^T), the query the other; ``query0`` / ``key0`` the tile's first query row / key; ``lse_log2[
    lse_of_reg[v]]`` the lse * log2(e) of register v's query row."""
    for v in cutlass.range_constexpr(cute.size(acc)):
        p = cute.math.exp2(acc[v] * scale_log2 - lse_log2[lse_of_reg[v]], fastmath=True)
        keep = mask.keep(key0 + coords[v][key_mode], query0, coords[v][1 - key_mode])
        acc[v] = p if keep else Float32(0.0)


@cute.jit
def softmax_grad(acc_dP: cute.Tensor, rP: cute.Tensor, delta: cute.Tensor, delta_of_reg: list):
    """acc_dP (dP or dP^T of one tile) <- dS = P (dP - delta), the softmax backward: ``rP`` holds P in the same
    fragment, ``delta[delta_of_reg[v]]`` rowsum(dO * O) - dlse of register v's query row."""
    for v in cutlass.range_constexpr(cute.size(acc_dP)):
        acc_dP[v] = rP[v] * (acc_dP[v] - delta[delta_of_reg[v]])

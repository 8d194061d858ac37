"""Materialize the dropout keep-mask that the Triton kernels use (for tests and debugging only)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import dropout_keep, dropout_threshold


@triton.jit
def _keep_mask_kernel(out_ptr, seed_ptr, s_b, s_h, s_m, NQ, NKV, HQ, p_thresh,
                      BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    seed = tl.load(seed_ptr)
    offset = tl.load(seed_ptr + 1)
    rows = pid_m * BM + tl.arange(0, BM)
    for n0 in range(0, NKV, BN):
        cols = n0 + tl.arange(0, BN)
        keep = dropout_keep(seed, offset, pid_bh, rows, cols, p_thresh)
        ptrs = out_ptr + b.to(tl.int64) * s_b + h * s_h + rows[:, None].to(tl.int64) * s_m + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < NQ) & (cols[None, :] < NKV))


def dense_keep_mask(rng: torch.Tensor, b: int, hq: int, nq: int, nkv: int, p: float) -> torch.Tensor:
    """The bool ``[B, Hq, Nq, Nkv]`` keep-mask a dense Triton kernel applies for ``rng`` and ``p``."""
    out = torch.empty(b, hq, nq, nkv, dtype=torch.int8, device=rng.device)
    grid = (triton.cdiv(nq, 32), b * hq)
    _keep_mask_kernel[grid](out, rng, out.stride(0), out.stride(1), out.stride(2), nq, nkv, hq,
                            dropout_threshold(p), BM=32, BN=32)
    return out.bool()

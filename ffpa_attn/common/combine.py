"""The split-KV combine: merge ``S`` partial attention results of disjoint key slices with lse weights.

A Triton kernel shared by the Triton split-KV forward (partials as max / sum pairs) and the CuTeDSL split-KV
forward (partials as lse); fp32 weights, ``-inf``-safe (rows that saw no key give out 0, lse -inf).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_cast


@triton.jit(do_not_specialize=["Hq", "Nq", "D", "n_splits", "n_dc"])
def _combine_kernel(
    OP, MP, LP, O, L,
    Hq, Nq, D, n_splits, n_dc,
    sob, soh, son, sod, slb, slh, sln,
    BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, LSE_ONLY: tl.constexpr = False, INTERP: tl.constexpr = False,
):
    """Merge S partials of one (batch, head, row) over BLOCK_DC columns; 1-D grid, column block fastest.

    OP [B, Hq, S, Nq, D] (fp32, or the input dtype), MP / LP (max, sum) [B, Hq, S, Nq], fp32 contiguous;
    O [B, Hq, Nq, D], L [B, Hq, Nq]. Weights w_s = l_s * exp(m_s - M) with M = max_s m_s; out = sum w_s o_s /
    sum w_s, lse = M + log(sum w_s); no weight (every m_s = -inf) -> out 0, lse -inf. LSE_ONLY: MP holds
    each partial's lse and LP is unused (w_s = exp(lse_s - M)).
    """
    pid = tl.program_id(0)
    dc = pid % n_dc
    row = pid // n_dc
    qi = (row % Nq).to(tl.int64)
    bhq = (row // Nq).to(tl.int64)
    h = bhq % Hq
    b = bhq // Hq
    sp = bhq * n_splits * Nq + qi  # + s * Nq
    op = OP + sp * D  # + s * Nq * D

    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.load(MP + sp + ss.to(tl.int64) * Nq, mask=ss < n_splits, other=float("-inf")))
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)

    offs = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs < D
    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_DC], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        s_ok = ss < n_splits
        ms = tl.load(MP + sp + ss.to(tl.int64) * Nq, mask=s_ok, other=float("-inf"))
        if LSE_ONLY:
            ls = tl.full([BLOCK_S], 1.0, tl.float32)
        else:
            ls = tl.load(LP + sp + ss.to(tl.int64) * Nq, mask=s_ok, other=0.0)
        w = tl.where(ms == float("-inf"), 0.0, ls * tl.math.exp2((ms - m_ref) * 1.4426950408889634))
        den += w
        part = tl.load(op + ss.to(tl.int64)[:, None] * Nq * D + offs[None, :], mask=s_ok[:, None] & d_ok[None, :],
                       other=0.0).to(tl.float32)
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(den, 0)
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    tl.store(O + b * sob + h * soh + qi * son + offs * sod, round_cast(out, O.dtype.element_ty, INTERP), mask=d_ok)
    if dc == 0:
        lse = tl.where(seen, m_ref + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(L + b * slb + h * slh + qi * sln, lse)


def pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def partial_buffers(out: torch.Tensor, lse: torch.Tensor, splits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """Where a split-KV kernel writes: ``(o_buf, m_buf, l_buf, o_strides, ml_strides)``.

    ``out`` is a ``[B, Hq, Nq, D]`` view of the call's output (any strides), ``lse`` ``[B, Hq, Nq]`` fp32. With one
    split the kernel writes ``out`` / ``lse`` directly (the split stride is 0; ``m_buf`` and ``l_buf`` are ``lse``);
    else fp32 partials ``[B, Hq, S, Nq, D]`` and the running max / sum ``[B, Hq, S, Nq]`` each, for
    :func:`launch_combine`. Strides are ``(b, h, split, row, d)`` and ``(b, h, split, row)``."""
    if splits == 1:
        return (out, lse, lse, (out.stride(0), out.stride(1), 0, out.stride(2), out.stride(3)),
                (lse.stride(0), lse.stride(1), 0, lse.stride(2)))
    b, hq, nq, d = out.shape
    o_buf = torch.empty(b, hq, splits, nq, d, dtype=torch.float32, device=out.device)
    m_buf, l_buf = torch.empty(2, b, hq, splits, nq, dtype=torch.float32, device=out.device).unbind(0)
    return o_buf, m_buf, l_buf, o_buf.stride(), m_buf.stride()


def launch_combine(op: torch.Tensor, mp: torch.Tensor, lp: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    n_heads: int, n_rows: int, heads_per_batch: int, sob: int, soh: int, slb: int, slh: int,
                    lse_only: bool) -> None:
    splits, d = op.shape[-3], op.shape[-1]
    block_s = min(pow2(splits), 64)
    # a 16 KiB tile of partials per program on 2 warps: the split sum is a cross-warp reduction, so fewer, wider
    # programs measured about twice as fast as 4 KiB tiles on 4 warps (docs/design.md, "Triton kernels")
    block_dc = max(16, min(pow2(d), (16384 // op.element_size()) // block_s))
    n_dc = triton.cdiv(d, block_dc)
    _combine_kernel[(n_dc * n_heads * n_rows,)](
        op, mp, lp, out, lse, heads_per_batch, n_rows, d, splits, n_dc,
        sob, soh, out.stride(-2), out.stride(-1), slb, slh, lse.stride(-1),
        BLOCK_S=block_s, BLOCK_DC=block_dc, LSE_ONLY=lse_only, INTERP=out.device.type == "cpu", num_warps=2,
    )


def combine_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
                     hkv: int, group: int) -> None:
    """Merge split-KV partials whose rows pack the ``group`` query heads of each KV head (lse weights).

    Args:
        part_o: ``[B * Hkv, S, R, D]`` contiguous, normalised partial outputs (fp32 or the input dtype), with
            ``R = group * Nq`` rows ``g * Nq + i`` = query head ``h * group + g``, row ``i``.
        part_lse: ``[B * Hkv, S, R]`` fp32 contiguous, each partial's lse (``-inf`` = saw nothing).
        out: ``[B, Hq, Nq, D]`` and lse ``[B, Hq, Nq]`` fp32, written; both contiguous over (Hq, Nq).
    """
    bh, _, rows, _ = part_o.shape
    nq = out.shape[2]
    assert part_o.is_contiguous() and part_lse.is_contiguous() and rows == group * nq
    assert out.stride(1) == nq * out.stride(2) and lse.stride(1) == nq * lse.stride(2)
    launch_combine(part_o, part_lse, part_lse, out, lse, bh, rows, hkv, out.stride(0), group * out.stride(1),
                    lse.stride(0), group * lse.stride(1), lse_only=True)


__all__ = ["combine_partials", "launch_combine", "pow2"]

"""The backward preprocess every backward needs: ``delta = rowsum(dO * O) - dlse`` in fp32, one Triton pass.

Shared by the Triton and the CuTeDSL backwards (no fp32 copies of dO / O). Tensors are described to the kernel as
(batch, head, row, col) strides; varlen tensors ``[T, H, D]`` get batch stride 0 (:func:`s4_thd`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_PRE_BM = 64
_PRE_BD = 128


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DLSE, DELTA,
    sob, soh, som, sod, sdob, sdoh, sdom, sdod, slb, slh, slm, sdb, sdh, sdm,
    H, N, D,
    HAS_DLSE: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
):
    """delta[b, h, m] = sum_d dO * O (fp32) - dlse. Grid (cdiv(N, BM), B * H); varlen: B = 1, N = T_q."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < N
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BM], dtype=tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        msk = row_ok[:, None] & (dd < D)[None, :]
        o = tl.load(O + b * sob + h * soh + r64[:, None] * som + dd[None, :] * sod, mask=msk, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + r64[:, None] * sdom + dd[None, :] * sdod, mask=msk, other=0.0)
        acc += tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        acc -= tl.load(DLSE + b * slb + h * slh + r64 * slm, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + b * sdb + h * sdh + r64 * sdm, acc, mask=row_ok)


def s4_dense(t: torch.Tensor) -> tuple[int, int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def s4_thd(t: torch.Tensor) -> tuple[int, int, int, int]:
    """[T, H, D] -> (0, h, row, col)."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


def s3_dense(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def s3_ht(t: torch.Tensor) -> tuple[int, int, int]:
    """[H, T] -> (0, h, row)."""
    return 0, t.stride(0), t.stride(1)


def backward_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                   varlen: bool = False) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse in fp32, laid out like lse ([B, Hq, Nq] or [Hq, T_q]); one Triton pass,
    no fp32 copies of dO/O. Shared by every backward that needs it (Triton, CuTeDSL)."""
    if varlen:
        t, h, d = out.shape
        delta = torch.empty(h, t, dtype=torch.float32, device=out.device)
        so, sdo, sd = s4_thd(out), s4_thd(dout), s3_ht(delta)
        sl = s3_ht(dlse) if dlse is not None else (0, 0, 0)
        nb, n = 1, t
    else:
        nb, h, n, d = out.shape
        delta = torch.empty(nb, h, n, dtype=torch.float32, device=out.device)
        so, sdo, sd = s4_dense(out), s4_dense(dout), s3_dense(delta)
        sl = s3_dense(dlse) if dlse is not None else (0, 0, 0)
    grid = (triton.cdiv(n, _PRE_BM), nb * h)
    _bwd_preprocess_kernel[grid](
        out, dout, dlse if dlse is not None else delta, delta, *so, *sdo, *sl, *sd, h, n, d,
        HAS_DLSE=dlse is not None, BM=_PRE_BM, BD=min(_PRE_BD, triton.next_power_of_2(d)), num_warps=4)
    return delta


__all__ = ["backward_delta", "s4_dense", "s4_thd", "s3_dense", "s3_ht"]

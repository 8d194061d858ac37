"""Split-KV forward for short queries on the sm90a forward kernel: decode and speculative decoding with GQA.

Few query rows against a long KV cache leave the per-(batch, head, 64-row block) grid of
:mod:`ffpa_attn.cute.fwd_sm90` with a handful of CTAs. Here the same compiled kernel runs on views:

* the ``group`` query heads of one KV head share that head's K/V, so their rows are packed into one row
  block: q ``[B, Hq, Nq, D]`` -> ``[B * Hkv, group * Nq, D]`` (a view when q is contiguous);
* the KV sequence is cut into ``S`` equal slices that become the kernel's batch mode: k/v ``[B, Hkv, Nkv, D]``
  -> ``[S, B * Hkv, Nkv / S, D]`` (a strided view; K/V are read exactly once);
* the packed queries are passed once (``FwdConfig.q_broadcast``: every slice's CTAs read the same Q tiles; a
  copy per slice cost 9 of 62 us at Hkv=2, Nq=4 on an H200), and each CTA writes its slice's normalised
  partial out (input dtype) and lse;
* :func:`ffpa_attn.common.combine.combine_partials` merges the ``S`` partials with lse weights (fp32, -inf
  safe) straight into ``out [B, Hq, Nq, D]`` and ``lse [B, Hq, Nq]``.

Packing puts rows of different query heads into one block, which is exact only when every row sees the same
keys: the path serves non-causal calls and causal calls with ``Nq == 1`` (the one row sees every key). The
rule that picks it, :func:`ffpa_attn.backends.cute_forward_kernel`, is the one ``explain()`` reports.
Partial outputs are rounded to the input dtype before the merge (as in ring attention): one extra rounding.
"""
from __future__ import annotations

import torch

from ..common.device import sm_count
from ..tail_split import divisor_near
from .api import launch_q_broadcast

TILE_M = 64
MIN_SLICE = 256  # keys per slice at least (a slice is a few K/V tiles)
# keys per K/V tile: 64 (5 ring slots at D=512) measured faster than the forward's tuned 80 (4 slots) on all nine
# decode shapes (H200, 2026-12-01, D=512, Nkv=32768: 1-5%): a slice
# is a short memory-bound stream, where ring depth beats tile width
TILE_N = 64


def num_slices(b: int, hkv: int, rows: int, nkv: int, n_sms: int) -> int:
    """Slices S: about one wave of CTAs (``b * hkv * ceil(rows / 64) * S ~ n_sms``), S dividing Nkv when a
    divisor is near (else the last ``Nkv mod S`` keys get their own call), at least :data:`MIN_SLICE` keys each."""
    ctas = b * hkv * -(-rows // TILE_M)
    target = max(1, min(n_sms // max(ctas, 1), nkv // MIN_SLICE))
    return divisor_near(nkv, target) or target


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            splits: int | None = None, tile_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV forward on validated inputs.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; fp16/bf16 on an sm90 device, Hq % Hkv == 0, Nkv >= 1.
        causal: allowed only with Nq == 1 (then every key is visible; ValueError otherwise).
        scale: softmax scale.
        splits: number of KV slices; None = :func:`num_slices`.
        tile_n: keys per K/V tile of the kernel (one of ``config.TILE_N_CHOICES``; benchmarks); None =
            :data:`TILE_N`.
    Returns:
        ``(out [B, Hq, Nq, D] like q, lse [B, Hq, Nq] fp32)``.
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    if causal and nq != 1:
        raise ValueError(f"the packed split-KV path is exact for causal only with Nq == 1, got Nq={nq}")
    group = hq // hkv
    rows = group * nq
    from ..common.combine import combine_partials

    if splits is None:
        splits = num_slices(b, hkv, rows, nkv, sm_count(q.device))
    splits = max(1, min(int(splits), nkv))
    tile_n = TILE_N if tile_n is None else tile_n
    length = nkv // splits
    tail = nkv - splits * length
    if b * hkv > 65535 or splits > 65535:
        raise NotImplementedError(f"split-KV grid: B*Hkv = {b * hkv} and S = {splits} must be <= 65535")

    qp = q.contiguous().view(b * hkv, rows, d)
    kv = [_slices(t, splits, length) for t in (k, v)]
    part_o = torch.empty(b * hkv, splits + (tail > 0), rows, d, dtype=q.dtype, device=q.device)
    part_l = torch.empty(b * hkv, splits + (tail > 0), rows, dtype=torch.float32, device=q.device)
    launch_q_broadcast(qp.unsqueeze(0), kv[0], kv[1], part_o[:, :splits].permute(1, 0, 2, 3),
                       part_l[:, :splits].permute(1, 0, 2), scale, tile_n)
    if tail:
        kt, vt = (_slices(t[:, :, splits * length:], 1, tail) for t in (k, v))
        launch_q_broadcast(qp.unsqueeze(0), kt, vt, part_o[:, splits:].permute(1, 0, 2, 3),
                           part_l[:, splits:].permute(1, 0, 2), scale, tile_n)
    out = torch.empty(b, hq, nq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    combine_partials(part_o, part_l, out, lse, hkv=hkv, group=group)
    return out, lse


def _foldable(t: torch.Tensor) -> bool:
    """Whether ``[B, Hkv, ...]`` folds into one ``B * Hkv`` mode without a copy."""
    return t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _slices(t: torch.Tensor, splits: int, length: int) -> torch.Tensor:
    """``[B, Hkv, Nkv, D]`` -> ``[S, B * Hkv, L, D]`` view of the first ``S * L`` keys (copied only when B > 1
    and the batch stride does not fold into the head stride)."""
    b, hkv, _, d = t.shape
    if not _foldable(t):
        t = t.contiguous()
    sb, sh, sn, sd = t.stride()
    return t.as_strided((splits, b * hkv, length, d), (length * sn, sh, sn, sd))

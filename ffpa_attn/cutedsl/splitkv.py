"""Split-KV forward for short queries on the sm90a forward kernel: decode and speculative decoding with GQA.

Few query rows against a long KV cache leave the per-(batch, head, 64-row block) grid of
:mod:`ffpa_attn.cutedsl.fwd_sm90` with a handful of CTAs. Here the same compiled kernel runs on views:

* the ``group`` query heads of one KV head share that head's K/V, so their rows are packed into one row
  block: q ``[B, Hq, Nq, D]`` -> ``[B * Hkv, group * Nq, D]`` (a view when q is contiguous);
* the KV sequence is cut into ``S`` equal slices that become the kernel's batch mode: k/v ``[B, Hkv, Nkv, D]``
  -> ``[S, B * Hkv, Nkv / S, D]`` (a strided view; K/V are read exactly once);
* the packed queries are passed once (``FwdConfig.q_broadcast``: every slice's CTAs read the same Q tiles; a
  copy per slice costs a seventh of a decode step at Hkv=2, Nq=4), and each CTA writes its slice's normalised
  partial out (input dtype) and lse;
* :func:`ffpa_attn.common.combine.combine_partials` merges the ``S`` partials with lse weights (fp32, -inf
  safe) straight into ``out [B, Hq, Nq, D]`` and ``lse [B, Hq, Nq]``.

Packing puts rows of different query heads into one block, which is exact only when every row sees the same
keys: the path serves non-causal calls and causal calls with ``Nq == 1`` (the one row sees every key). The
planner picks it (and the slice count, :func:`ffpa_attn.dispatch.waves.splitkv_slices`); ``explain()`` reports both.
Partial outputs are rounded to the input dtype before the merge (as in ring attention): one extra rounding.
"""
from __future__ import annotations

import torch

from .api import launch_q_broadcast


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, splits: int,
            tile_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV forward on validated inputs.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; fp16/bf16 on an sm90 device, Hq % Hkv == 0, Nkv >= 1.
        causal: allowed only with Nq == 1 (then every key is visible; ValueError otherwise).
        scale: softmax scale.
        splits: number of KV slices, ``1 <= splits <= Nkv``: the planner's count (``KernelSpec`` parameter
            ``splits`` of ``explain(...).forward.spec``). The planner owns it, so the module takes no default and
            computes none: None is a TypeError, a count out of range a ValueError.
        tile_n: keys per K/V tile of the kernel (one of ``config.TILE_N_CHOICES``); None =
            ``config.DEFAULT_TILE_N``.
    Returns:
        ``(out [B, Hq, Nq, D] like q, lse [B, Hq, Nq] fp32)``.
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    if causal and nq != 1:
        raise ValueError(f"the packed split-KV path is exact for causal only with Nq == 1, got Nq={nq}")
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise TypeError(f"splits: the number of KV slices must be an int (the planner's count, "
                        f"explain(...).forward.spec.get('splits')), got {splits!r}")
    if not 1 <= splits <= nkv:
        raise ValueError(f"splits: the number of KV slices must be in [1, Nkv={nkv}], got {splits}")
    group = hq // hkv
    rows = group * nq
    from ..common.combine import combine_partials

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

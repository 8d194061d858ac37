"""Wave quantization of the one-CTA-per-SM forward kernels, and the split of the last wave that removes it.

The dense forward kernels (CUDA ``ffpa_fwd``, CuTeDSL ``fwd_sm90``) run one CTA per SM on an H100/H200 and
give every (query block, head, batch) one CTA of equal cost when not causal. ``T`` such CTAs on ``W`` SMs
take ``ceil(T / W)`` waves; at B=1, H=32, N=8192 with 64-row blocks that is 4096 CTAs = 31 waves + 4 CTAs,
so the 32nd wave holds only 4 CTAs for 132 SMs: 3% of the call's time with 97% of the GPU idle.

The split: the kernel runs the first ``T - t`` CTAs (``t = T mod W`` tail CTAs exit at once: the kernels
take a ``cta_limit`` on the linear CTA index, x fastest, then y = head, z = batch), and the ``t`` tail
query blocks -- the last blocks of the last (batch, head) -- run as a second launch of the same kernel on
views: the tail rows repeated over ``S`` KV slices (a stride-0 view; TMA taking no stride-0 mode, the
CuTeDSL launch passes its first entry to the kernel's ``q_broadcast`` variant), ``S * t <= W`` CTAs of
``1 / S`` the work, merged with lse weights (:func:`ffpa_attn.common.lse.merge_stacked`). The last wave then
costs ``~1/S`` of a wave plus a small merge; measured on an H200 (2026-11-29): +1 to +2.5% for the CUDA
forward at every D, +2% for the
CuTeDSL forward at D=384/512 (-0.9% at D=320, where it stays off). Non-causal only: causal kernels order
their blocks longest first, and their tail is already short.

``FFPA_ATTN_TAIL_SPLIT=0`` turns the split off everywhere (A/B benchmarks).

The partial outputs of the tail are rounded to the input dtype before the merge (as in ring attention and
the split-KV decode): one extra rounding, on those rows only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .common.env import env_flag
from .common.lse import merge_stacked

MIN_SLICES = 4  # fewer slices save too little of the last wave to pay for the second launch and the merge
MIN_SLICE_KEYS = 256  # keys per slice at least (a slice is a few K/V tiles)


def divisor_near(n: int, target: int) -> int | None:
    """The largest divisor of ``n`` in ``[3/4 target, target]`` (None if there is none)."""
    for s in range(target, max(1, 3 * target // 4) - 1, -1):
        if n % s == 0:
            return s
    return None


@dataclass(frozen=True)
class TailSplit:
    """How one forward call is cut: ``main_ctas`` CTAs in the main launch, then the rows ``row0 ..`` of
    (``batch``, ``head``) over ``slices`` KV slices of ``Nkv / slices`` keys each."""

    main_ctas: int
    batch: int
    head: int
    row0: int
    slices: int


def plan_tail_split(b: int, hq: int, nq: int, nkv: int, block_m: int, n_sms: int, *, causal: bool,
                    ctas_per_sm: int = 1, min_slice_keys: int = MIN_SLICE_KEYS) -> TailSplit | None:
    """The :class:`TailSplit` of a dense forward launch of ``(ceil(Nq / block_m), Hq, B)`` CTAs, or None
    when splitting is off (``FFPA_ATTN_TAIL_SPLIT=0``) or does not pay: causal, no partial wave, a single
    wave, a tail wider than one head's blocks, fewer than :data:`MIN_SLICES` slices of at least
    ``min_slice_keys`` keys dividing Nkv. ``ctas_per_sm``: resident CTAs per SM (the kernels here: 1)."""
    if causal or min(b, hq, nq, nkv) <= 0 or not env_flag("FFPA_ATTN_TAIL_SPLIT"):
        return None
    mblk = -(-nq // block_m)
    wave = n_sms * ctas_per_sm
    full, tail = divmod(b * hq * mblk, wave)
    if full == 0 or tail == 0 or tail > mblk:
        return None
    target = min(wave // tail, nkv // max(1, min_slice_keys))
    if target < MIN_SLICES:
        return None
    slices = divisor_near(nkv, target)
    if slices is None or slices < MIN_SLICES:
        return None
    return TailSplit(b * hq * mblk - tail, b - 1, hq - 1, (mblk - tail) * block_m, slices)


def run_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             split: TailSplit,
             launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Compute the tail rows of ``split`` into ``out`` / ``lse`` (in place).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; out ``[B, Hq, Nq, Dv]``, lse ``[B, Hq, Nq]`` fp32.
        launch: the backend's non-causal forward on views, ``(q [S, 1, R, D], k [S, 1, L, D], v [S, 1, L, Dv])
            -> (out [S, 1, R, Dv], lse [S, 1, R])``; q is a stride-0 repeat of the tail rows, k/v the slices.
    """
    group = q.shape[1] // k.shape[1]
    s, hk = split.slices, split.head // group
    qt = q[split.batch, split.head, split.row0:]
    rows = qt.shape[0]
    qv = qt.unsqueeze(0).unsqueeze(0).expand(s, 1, rows, qt.shape[-1])
    kv, vv = (t[split.batch, hk].view(s, t.shape[2] // s, t.shape[-1]).unsqueeze(1) for t in (k, v))
    po, pl = launch(qv, kv, vv)
    o, l = merge_stacked(po[:, 0], pl[:, 0])
    out[split.batch, split.head, split.row0:] = o.to(out.dtype)
    lse[split.batch, split.head, split.row0:] = l


__all__ = ["TailSplit", "plan_tail_split", "run_tail", "divisor_near", "MIN_SLICES", "MIN_SLICE_KEYS"]

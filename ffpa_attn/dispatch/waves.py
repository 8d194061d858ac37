"""Wave arithmetic of the planner: the last-wave split of the dense forwards and the KV slices of the split-KV
forwards. Pure integer functions of the call's shape and the SM count (no torch, no device): the planner evaluates
them once per call and records the result in the :class:`ffpa_attn.kernel_module.KernelSpec` the kernel runs.

The last-wave split: a one-CTA-per-SM forward of ``T`` equal CTAs on ``W`` SMs takes ``ceil(T / W)`` waves; at B=1,
H=32, N=8192 with 64-row blocks that is 4096 CTAs = 31 waves + 4 CTAs, so the 32nd wave holds 4 CTAs for 132 SMs:
~3% of the call with the GPU almost idle. The main launch stops before the tail; the tail's query blocks run again
as ``S`` KV slices (``S * tail <= W``) merged with lse weights (:mod:`ffpa_attn.common.tail_split`), so the last
wave costs ~1/S of a wave plus a small merge. Non-causal only: causal kernels order their blocks longest first, and
their tail is already short.
"""
from __future__ import annotations

from ..common.tail_split import TailSplit

MIN_SLICES = 4  # fewer slices save too little of the last wave to pay for the second launch and the merge
MIN_SLICE_KEYS = 256  # keys per slice at least (a slice is a few K/V tiles)


def divisor_near(n: int, target: int) -> int | None:
    """The largest divisor of ``n`` in ``[3/4 target, target]`` (None if there is none)."""
    for s in range(target, max(1, 3 * target // 4) - 1, -1):
        if n % s == 0:
            return s
    return None


def plan_tail_split(b: int, hq: int, nq: int, nkv: int, block_m: int, n_sms: int, *, causal: bool,
                    ctas_per_sm: int = 1, min_slice_keys: int = MIN_SLICE_KEYS) -> TailSplit | None:
    """The :class:`TailSplit` of a dense forward launch of ``(ceil(Nq / block_m), Hq, B)`` CTAs, or None when it
    does not pay: causal, no partial wave, a single wave, a tail wider than one head's blocks, fewer than
    :data:`MIN_SLICES` slices of at least ``min_slice_keys`` keys dividing Nkv. ``ctas_per_sm``: resident CTAs per
    SM (the kernels here: 1)."""
    if causal or min(b, hq, nq, nkv) <= 0:
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
    return TailSplit(b * hq * mblk - tail, b - 1, hq - 1, (mblk - tail) * block_m, slices, block_m)


def splitkv_slices(b: int, hkv: int, rows: int, nkv: int, n_sms: int, *, tile_m: int = 64,
                   min_slice: int = MIN_SLICE_KEYS) -> int:
    """KV slices of the packed split-KV forward (rows of one KV head in ``tile_m``-row blocks): about one wave of
    CTAs (``b * hkv * ceil(rows / tile_m) * S ~ n_sms``), S dividing Nkv when a divisor is near (else the last
    ``Nkv mod S`` keys get their own launch), at least ``min_slice`` keys each."""
    ctas = b * hkv * -(-rows // tile_m)
    target = max(1, min(n_sms // max(ctas, 1), nkv // min_slice))
    return max(1, min(divisor_near(nkv, target) or target, max(nkv, 1)))


__all__ = ["MIN_SLICES", "MIN_SLICE_KEYS", "divisor_near", "plan_tail_split", "splitkv_slices"]

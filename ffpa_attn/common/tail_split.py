"""Running a forward whose partial last wave the planner split over KV slices (the geometry: :class:`TailSplit`).

The dense forward kernels (CUDA ``ffpa_fwd``, CuTeDSL ``fwd_sm90``) run one CTA per SM on an H100/H200 and give every
(query block, head, batch) one CTA of equal cost when not causal, so ``T`` CTAs on ``W`` SMs take ``ceil(T / W)``
waves, the last one nearly empty at the benchmark shapes. Whether and how to split it is the planner's decision
(:func:`ffpa_attn.dispatch.waves.plan_tail_split`, shown by ``explain()``); this module only runs it:

the kernel runs the first ``main_ctas`` CTAs (the tail CTAs exit at once: the kernels take a ``cta_limit`` on the
linear CTA index, x fastest, then y = head, z = batch), and the tail query blocks -- the last blocks of the last
(batch, head) -- run as a second launch of the same kernel on views: the tail rows repeated over ``slices`` KV slices
(a stride-0 view), merged with lse weights (:func:`ffpa_attn.common.lse.merge_stacked`). The partial outputs are
rounded to the input dtype before the merge (as in ring attention and the split-KV decode): one extra rounding, on
those rows only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .lse import merge_stacked


@dataclass(frozen=True)
class TailSplit:
    """How one forward call is cut: ``main_ctas`` CTAs of ``block_m`` query rows in the main launch, then the rows
    ``row0 ..`` of (``batch``, ``head``) over ``slices`` KV slices of ``Nkv / slices`` keys each."""

    main_ctas: int
    batch: int
    head: int
    row0: int
    slices: int
    block_m: int

    def as_param(self) -> tuple[int, ...]:
        """The tuple a :class:`ffpa_attn.kernel_module.KernelSpec` carries (``tail=...``)."""
        return (self.main_ctas, self.batch, self.head, self.row0, self.slices, self.block_m)

    def check(self, b: int, hq: int, nq: int, block_m: int) -> None:
        """ValueError unless this split was planned for a launch of ``(ceil(Nq / block_m), Hq, B)`` CTAs (a kernel
        whose geometry differs from the planner's would run the wrong rows)."""
        total = -(-nq // block_m) * hq * b
        tail = -(-nq // block_m) - self.row0 // max(self.block_m, 1)
        if block_m != self.block_m or self.main_ctas + tail != total or (self.batch, self.head) != (b - 1, hq - 1):
            raise ValueError(f"kernel: tail split {self} was not planned for B={b}, Hq={hq}, Nq={nq} with "
                             f"{block_m}-row blocks")


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


__all__ = ["TailSplit", "run_tail"]

"""Which work each ring step does: full, diagonal (causal), or skipped, and on which rows.

At ring step ``s`` rank ``r`` holds the K/V shard owned by rank ``src = (r - s) mod R``. With global
self-attention under the causal rule (query position ``p`` sees key positions ``<= p``):

* contiguous: ``src == r`` is the *diagonal* step (causal with ``Nq == Nkv``, offset 0), ``src < r`` is
  *full* (every key precedes every query), ``src > r`` is fully masked and *skipped*.
* zigzag (local rows = chunk ``r`` then chunk ``2R-1-r``, ``c`` rows each): ``src == r`` is diagonal
  (plain causal on the local rows is exactly the global rule); ``src < r``: all local queries see the
  first half of the visiting K/V (chunk ``src``) and none of the second, so *full* on ``kv_sel = [0, c)``;
  ``src > r``: only the second half of the local queries (chunk ``2R-1-r``) sees anything, and it sees all
  of it, so *full* on ``q_sel = [c, 2c)``. Every step costs the same ``c * 2c`` score block.

Without causality every step is full on all rows (attention is invariant to how keys are distributed).
Varlen applies the same rules per packed sequence and adds the per-step ``cu_seqlens`` of the selected
rows. Everything here is host-side index math; the tensors of a step live on the compute device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from .layout import check_cu_seqlens, local_cu_seqlens

Sel = Union[None, slice, torch.Tensor]  # rows along the sequence dim: all, a range, or int64 indices


@dataclass(frozen=True)
class Step:
    """One ring step of one rank.

    Attributes:
        kind: ``"skip"`` (nothing visible), ``"full"`` (no mask) or ``"diag"`` (causal, Nq == Nkv).
        q_sel: local query rows taking part (None = all); dense: a slice, varlen: int64 indices.
        kv_sel: rows of the visiting K/V taking part (None = all).
        cu_q, cu_k: varlen only, int32 ``[B+1]`` boundaries of the selected rows per sequence.
        max_q, max_k: varlen only, the longest selected sequence pieces.
    """

    kind: str
    q_sel: Sel = None
    kv_sel: Sel = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    @property
    def causal(self) -> bool:
        return self.kind == "diag"


SKIP = Step("skip")


def source_rank(rank: int, step: int, world: int) -> int:
    """The rank whose K/V shard ``rank`` holds at ring step ``step``."""
    return (rank - step) % world


def dense_schedule(rank: int, world: int, n_local: int, causal: bool, layout: str) -> list[Step]:
    """The steps (index = ring step) of ``rank`` for dense shards of ``n_local`` rows (self-attention)."""
    steps = []
    for s in range(world):
        src = source_rank(rank, s, world)
        if not causal:
            steps.append(Step("full"))
        elif src == rank:
            steps.append(Step("diag"))
        elif layout == "contiguous":
            steps.append(Step("full") if src < rank else SKIP)
        else:
            c = n_local // 2
            steps.append(Step("full", kv_sel=slice(0, c)) if src < rank else Step("full", q_sel=slice(c, n_local)))
    return steps


def _cu(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device), max(lengths, default=0)


def _lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _varlen_step(kind: str, lq: list[int], lk: list[int], device: torch.device, q_sel: Sel = None,
                 kv_sel: Sel = None) -> Step:
    if not any(a > 0 and b > 0 for a, b in zip(lq, lk)):
        return SKIP  # no sequence has both queries and keys in this step
    cu_q, max_q = _cu(lq, device)
    cu_k, max_k = _cu(lk, device)
    return Step(kind, q_sel, kv_sel, cu_q, cu_k, max_q, max_k)


def _half_rows(cu_local: list[int], second: bool, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Packed local row indices of the first (or second) half of every sequence piece, and their lengths."""
    idx, lens = [], []
    for a, b in zip(cu_local[:-1], cu_local[1:]):
        h = (b - a) // 2
        start = a + h if second else a
        idx.append(torch.arange(start, start + h))
        lens.append(h)
    rows = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    return rows.to(device), lens


def varlen_schedule(cu_seqlens: torch.Tensor | list[int], rank: int, world: int, causal: bool, layout: str,
                    device: torch.device) -> list[Step]:
    """The steps of ``rank`` for packed shards described by the *global* ``cu_seqlens`` (self-attention)."""
    cu = check_cu_seqlens(cu_seqlens, world, layout)
    mine = local_cu_seqlens(cu, rank, world, layout)
    steps = []
    for s in range(world):
        src = source_rank(rank, s, world)
        theirs = local_cu_seqlens(cu, src, world, layout)
        lq, lk = _lengths(mine), _lengths(theirs)
        if not causal:
            steps.append(_varlen_step("full", lq, lk, device))
        elif src == rank:
            steps.append(_varlen_step("diag", lq, lk, device))
        elif layout == "contiguous":
            steps.append(_varlen_step("full", lq, lk, device) if src < rank else SKIP)
        elif src < rank:
            kv_rows, lk_half = _half_rows(theirs, second=False, device=device)
            steps.append(_varlen_step("full", lq, lk_half, device, kv_sel=kv_rows))
        else:
            q_rows, lq_half = _half_rows(mine, second=True, device=device)
            steps.append(_varlen_step("full", lq_half, lk, device, q_sel=q_rows))
    return steps

"""How a global sequence is sharded over the ranks of a ring: which global tokens each rank holds.

Two layouts, for dense ``[B, H, N, D]`` tensors (sharded along N) and packed varlen ``[T, H, D]`` tensors
(sharded along T, with global ``cu_seqlens``):

* ``"contiguous"``: rank ``r`` of ``R`` holds the ``r``-th of ``R`` equal pieces. Dense: tokens
  ``[r*n, (r+1)*n)``. Varlen: the packed stream is cut into ``R`` equal pieces regardless of sequence
  boundaries, so a sequence may straddle ranks. Causal work is unbalanced (rank ``R-1`` does ``R`` blocks,
  rank 0 one).
* ``"zigzag"``: the sequence is cut into ``2R`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2R-1-r`` (in that order), so every rank does the same causal work. Varlen: each *sequence* is cut into
  ``2R`` chunks (every sequence length must be a multiple of ``2R``) and rank ``r`` holds chunks ``r`` and
  ``2R-1-r`` of every sequence, packed in sequence order.

All functions take the global description (lengths, ``cu_seqlens``) and are pure index math on the host,
except :func:`gather` / :func:`gather_varlen` which all-gather over a process group.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> str:
    """ValueError unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of size {world}")


def dense_positions(n_global: int, rank: int, world: int, layout: str = "zigzag",
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Global token positions (int64 ``[N_local]``, in local order) that ``rank`` holds.

    ValueError unless ``n_global`` is a multiple of ``world`` (contiguous) or ``2*world`` (zigzag).
    Use them for position ids (e.g. RoPE) of the local shard.
    """
    check_layout(layout)
    _check_rank(rank, world)
    if layout == "contiguous":
        if n_global % world:
            raise ValueError(f"contiguous layout needs N={n_global} divisible by the world size {world}")
        n = n_global // world
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    if n_global % (2 * world):
        raise ValueError(f"zigzag layout needs N={n_global} divisible by 2 * world size = {2 * world}")
    c = n_global // (2 * world)
    j = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(j * c, (j + 1) * c, device=device)])


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The local shard of a global tensor (dense: ``dim=2`` of ``[B, H, N, D]``); a new contiguous tensor."""
    pos = dense_positions(x.shape[dim], rank, world, layout, device=x.device)
    return x.index_select(dim, pos)


def unshard(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from the shards of ranks ``0..R-1`` (in rank order)."""
    world = len(shards)
    n_global = sum(s.shape[dim] for s in shards)
    order = torch.cat([dense_positions(n_global, r, world, layout) for r in range(world)])
    return _scatter_rows(torch.cat(list(shards), dim=dim), order, dim)


def _scatter_rows(stacked: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """``out`` with ``out.index_select(dim, order) == stacked`` (order is a permutation)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return stacked.index_select(dim, inv.to(stacked.device))


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def gather(x: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = "zigzag",
           dim: int = 2) -> torch.Tensor:
    """All-gather local shards (same shape on every rank) into the global tensor on every rank.

    A collective (every rank of ``group`` must call it); not differentiable. For checks and tooling.
    """
    return unshard(_all_gather(x, group), layout, dim)


# ------------------------------------------------------------------------------------------------ varlen


def _cu_list(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    return cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(c) for c in cu_seqlens]


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], world: int, layout: str) -> list[int]:
    """Validate global ``cu_seqlens`` for a layout; returns them as a host list.

    ValueError unless they start at 0, never decrease, the total is a multiple of ``world`` (contiguous)
    and every sequence length is a multiple of ``2*world`` (zigzag).
    """
    check_layout(layout)
    cu = _cu_list(cu_seqlens)
    if not cu or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[:4]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    if layout == "contiguous" and cu[-1] % world:
        raise ValueError(f"contiguous layout needs the packed length {cu[-1]} divisible by the world size "
                         f"{world}")
    if layout == "zigzag":
        bad = [i for i, n in enumerate(lens) if n % (2 * world)]
        if bad:
            raise ValueError(f"zigzag layout needs every sequence length divisible by 2 * world size = "
                             f"{2 * world}; sequence {bad[0]} has length {lens[bad[0]]}")
    return cu


def varlen_positions(cu_seqlens: torch.Tensor | Sequence[int], rank: int, world: int,
                     layout: str = "zigzag", device: torch.device | str | None = None) -> torch.Tensor:
    """Global packed token indices (int64 ``[T_local]``, in local order) that ``rank`` holds.

    A token's position inside its sequence is ``index - cu_seqlens[seq]`` (for RoPE position ids).
    """
    cu = check_cu_seqlens(cu_seqlens, world, layout)
    _check_rank(rank, world)
    if layout == "contiguous":
        t = cu[-1] // world
        return torch.arange(rank * t, (rank + 1) * t, device=device)
    parts = []
    j = 2 * world - 1 - rank
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * world)
        parts.append(torch.arange(a + rank * c, a + (rank + 1) * c))
        parts.append(torch.arange(a + j * c, a + (j + 1) * c))
    return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)


def local_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], rank: int, world: int,
                     layout: str = "zigzag") -> list[int]:
    """Boundaries (host list, length ``B+1``) of each global sequence inside ``rank``'s packed shard.

    A sequence with no token on ``rank`` has length 0 there.
    """
    cu = check_cu_seqlens(cu_seqlens, world, layout)
    _check_rank(rank, world)
    if layout == "contiguous":
        t = cu[-1] // world
        return [min(max(c - rank * t, 0), t) for c in cu]
    return [c // world for c in cu]


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int], rank: int, world: int,
                 layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """The local shard of a packed global tensor (``dim=0`` of ``[T, H, D]``); a new tensor."""
    return x.index_select(dim, varlen_positions(cu_seqlens, rank, world, layout, device=x.device))


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor | Sequence[int],
                   layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_varlen` from the shards of ranks ``0..R-1`` (in rank order)."""
    world = len(shards)
    order = torch.cat([varlen_positions(cu_seqlens, r, world, layout) for r in range(world)])
    return _scatter_rows(torch.cat(list(shards), dim=dim), order, dim)


def gather_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
                  group: dist.ProcessGroup | None = None, layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """All-gather packed local shards into the global packed tensor on every rank (a collective)."""
    return unshard_varlen(_all_gather(x, group), cu_seqlens, layout, dim)

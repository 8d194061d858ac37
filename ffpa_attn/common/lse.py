"""Log-sum-exp helpers shared by every path that combines partial attention results (ring, split-KV)."""
from __future__ import annotations

import torch


def empty_result(q: torch.Tensor, dv: int, lse_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of attention with no query rows or no keys: out = 0 ``[*q.shape[:-1], dv]`` (q's dtype) and
    lse = -inf (fp32, ``lse_shape``), the convention of every path (rows that see no key)."""
    return (q.new_zeros((*q.shape[:-1], dv)),
            torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device))


def _weights(lse_stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w, safe_total, m_safe, empty)`` of stacked lse ``[S, ...]``: ``w = exp(lse - max)`` (0 for -inf),
    the weight sum (1 where every partial is empty), the finite max and the mask of rows that saw nothing."""
    m = lse_stack.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_stack - m_safe)  # exp(-inf) = 0
    total = w.sum(dim=0)
    empty = total == 0
    return w, torch.where(empty, torch.ones_like(total), total), m_safe, empty


def _merged_lse(safe: torch.Tensor, m_safe: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    return torch.where(empty, torch.full_like(safe, float("-inf")), torch.log(safe) + m_safe)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets: -inf-safe log-sum-exp weighting in fp32.

    Args:
        outs: partial outputs ``[..., N, D]``; lses: matching ``[..., N]`` lse (``-inf`` = saw nothing).
    Returns:
        ``(out, lse)`` of attention over the union of the key sets.
    """
    w, safe, m_safe, empty = _weights(torch.stack([lse.float() for lse in lses]))
    out = sum(wi.unsqueeze(-1) * o.float() for wi, o in zip(w, outs)) / safe.unsqueeze(-1)
    return out, _merged_lse(safe, m_safe, empty)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_partials` of partials stacked on a leading mode: outs ``[S, ..., N, D]``, lses
    ``[S, ..., N]``; returns fp32 ``(out [..., N, D], lse [..., N])``."""
    w, safe, m_safe, empty = _weights(lses.float())
    out = torch.einsum("s...n,s...nd->...nd", w, outs.float()) / safe.unsqueeze(-1)
    return out, _merged_lse(safe, m_safe, empty)

"""Log-sum-exp helpers shared by every path that combines partial attention results (ring, split-KV)."""
from __future__ import annotations

import torch


def empty_result(q: torch.Tensor, dv: int, lse_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of attention with no query rows or no keys: out = 0 ``[*q.shape[:-1], dv]`` (q's dtype) and
    lse = -inf (fp32, ``lse_shape``), the convention of every path (rows that see no key)."""
    return (q.new_zeros((*q.shape[:-1], dv)),
            torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device))


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets: -inf-safe log-sum-exp weighting in fp32.

    Args:
        outs: partial outputs ``[..., N, D]``; lses: matching ``[..., N]`` lse (``-inf`` = saw nothing).
    Returns:
        ``(out, lse)`` of attention over the union of the key sets.
    """
    lse_stack = torch.stack([lse.float() for lse in lses])
    m = lse_stack.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_stack - m_safe)  # exp(-inf) = 0
    total = w.sum(dim=0)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    out = sum(wi.unsqueeze(-1) * o.float() for wi, o in zip(w, outs)) / safe.unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), torch.log(safe) + m_safe)
    return out, lse

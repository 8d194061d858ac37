"""Exact attention in fp32/fp64: the oracle for every test and self-check of the project.

All functions here materialize the full ``Nq x Nkv`` score matrix; they are meant for correctness checks,
not speed. Conventions (causal alignment, GQA mapping, lse) come from :mod:`ffpa_attn.contract`.
They are differentiable (autograd through them gives the exact gradients) and never produce NaN for rows
that see no key: such rows get ``out = 0``, ``lse = -inf`` and zero gradients.
"""
from __future__ import annotations

import torch

from .contract import canonical_mask, causal_mask, default_scale


def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, N, D] -> [B, Hq, N, D] following the GQA mapping (query head h reads KV head h // group)."""
    hkv = t.shape[1]
    if hkv == hq:
        return t
    return t.repeat_interleave(hq // hkv, dim=1)


def scores_bias(
    b: int, hq: int, nq: int, nkv: int, attn_mask: torch.Tensor | None, is_causal: bool,
    device: torch.device, dtype: torch.dtype,
) -> torch.Tensor | None:
    """Additive ``[B|1, Hq|1, Nq, Nkv]`` bias (0 / -inf / float mask) combining causal and attn_mask."""
    bias = None
    if attn_mask is not None:
        m = canonical_mask(attn_mask, b, hq, nq, nkv)
        if m.dtype == torch.bool:
            bias = torch.zeros(m.shape, device=device, dtype=dtype).masked_fill(~m, float("-inf"))
        else:
            bias = m.to(dtype)
    if is_causal:
        cm = torch.zeros(nq, nkv, device=device, dtype=dtype).masked_fill(
            ~causal_mask(nq, nkv, device), float("-inf"))
        bias = cm if bias is None else bias + cm
    return bias


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact dense attention.

    Args:
        query: ``[B, Hq, Nq, D]``; key/value: ``[B, Hkv, Nkv, D]`` with Hq a multiple of Hkv (GQA).
        attn_mask: broadcastable to ``[B, Hq, Nq, Nkv]``; bool True = participates, float = additive.
        is_causal: tail-aligned causal (row r sees k <= r + Nkv - Nq).
        scale: softmax scale, default 1/sqrt(D).
        dropout_p, dropout_keep: dropout given an explicit bool keep-mask broadcastable to
            ``[B, Hq, Nq, Nkv]``; kept probabilities are scaled by 1/(1-p). lse is that of the softmax
            before dropout.
        dtype: compute dtype (fp32 or fp64).

    Returns:
        ``(out [B, Hq, Nq, D] in dtype, lse [B, Hq, Nq] in dtype)``.
    """
    b, hq, nq, d = query.shape
    nkv = key.shape[2]
    scale = default_scale(d) if scale is None else scale
    q = query.to(dtype)
    k = _expand_kv(key.to(dtype), hq)
    v = _expand_kv(value.to(dtype), hq)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    bias = scores_bias(b, hq, nq, nkv, attn_mask, is_causal, q.device, dtype)
    if bias is not None:
        s = s + bias
    out, lse = _softmax_v(s, v, dropout_p, dropout_keep)
    return out, lse


def _softmax_v(s: torch.Tensor, v: torch.Tensor, dropout_p: float,
               dropout_keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-free softmax(s) @ v with lse; rows of all -inf (or no keys at all) give out 0 and lse -inf."""
    if s.shape[-1] == 0:
        out = s.new_zeros(*s.shape[:-1], v.shape[-1])
        return out + 0 * v.sum(), s.new_full(s.shape[:-1], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    empty = denom == 0
    safe = torch.where(empty, torch.ones_like(denom), denom)
    p = p / safe
    lse = torch.where(empty, torch.full_like(denom, float("-inf")), torch.log(safe) + m).squeeze(-1)
    if dropout_p > 0.0:
        if dropout_keep is None:
            raise ValueError("reference dropout needs an explicit dropout_keep mask")
        p = p * dropout_keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v), lse


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact packed (THD) attention, one sequence at a time.

    Args:
        q: ``[T_q, Hq, D]``; k/v: ``[T_k, Hkv, D]``; cu_seqlens_*: int ``[B+1]`` boundaries.
        causal: tail-aligned per sequence.

    Returns:
        ``(out [T_q, Hq, D], lse [Hq, T_q])`` in ``dtype``.
    """
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    cq = cu_seqlens_q.tolist()
    ck = cu_k.tolist()
    tq, hq, d = q.shape
    out = torch.zeros(tq, hq, d, dtype=dtype, device=q.device)
    lse = torch.full((hq, tq), float("-inf"), dtype=dtype, device=q.device)
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0)
        if qs.shape[2] == 0:
            continue
        o_i, l_i = attention(qs, ks, vs, is_causal=causal, scale=softmax_scale, dtype=dtype)
        outs.append((cq[i], cq[i + 1], o_i[0].transpose(0, 1), l_i[0]))
    if outs:  # assemble without in-place writes on views so autograd stays simple
        pieces_o, pieces_l, last = [], [], 0
        for a, b_, o_i, l_i in outs:
            if a > last:
                pieces_o.append(out[last:a])
                pieces_l.append(lse[:, last:a])
            pieces_o.append(o_i)
            pieces_l.append(l_i)
            last = b_
        if last < tq:
            pieces_o.append(out[last:])
            pieces_l.append(lse[:, last:])
        out = torch.cat(pieces_o, dim=0)
        lse = torch.cat(pieces_l, dim=1)
    return out, lse

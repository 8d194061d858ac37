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


def _kvcache_slots(cache_seqlens: torch.Tensor, n: int, page: int | None, block_table: torch.Tensor | None,
                   cache_batch_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first index, second index) into a ``[rows|blocks, N|page, Hkv, D]`` cache of positions
    ``cache_seqlens[b] + t`` for t < n, each ``[B, n]``."""
    b = cache_seqlens.shape[0]
    pos = cache_seqlens.long().unsqueeze(1) + torch.arange(n, device=cache_seqlens.device).unsqueeze(0)
    if block_table is not None:
        blk = torch.gather(block_table.long(), 1, pos // page)
        return blk, pos % page
    rows = (torch.arange(b, device=pos.device) if cache_batch_idx is None else cache_batch_idx.long())
    return rows.unsqueeze(1).expand(b, n), pos


def kvcache_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                   cache_batch_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with ``k / v [B, Nq_new, Hkv, D]`` written at positions ``cache_seqlens[b] + t``
    (paged ``[num_blocks, page, Hkv, D]`` through ``block_table [B, max_pages]``, or contiguous
    ``[B_cache, N_max, Hkv, D]`` at row ``cache_batch_idx[b]``); the inputs are not modified."""
    kc, vc = k_cache.clone(), v_cache.clone()
    n = k.shape[1]
    if n:
        page = k_cache.shape[1] if block_table is not None else None
        i0, i1 = _kvcache_slots(cache_seqlens, n, page, block_table, cache_batch_idx)
        kc[i0.reshape(-1), i1.reshape(-1)] = k.reshape(-1, *k.shape[2:]).to(kc.dtype)
        vc[i0.reshape(-1), i1.reshape(-1)] = v.reshape(-1, *v.shape[2:]).to(vc.dtype)
    return kc, vc


def kvcache_sequence(cache: torch.Tensor, b: int, start: int, end: int, *, block_table: torch.Tensor | None = None,
                     cache_batch_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Keys ``start .. end - 1`` of sequence ``b`` of a paged or contiguous cache, ``[end - start, Hkv, D]``."""
    pos = torch.arange(start, end, device=cache.device)
    if block_table is not None:
        page = cache.shape[1]
        return cache[block_table[b].long()[pos // page], pos % page]
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    return cache[row, start:end]


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a KV cache, flash-attn's ``flash_attn_with_kvcache`` semantics, one sequence at a
    time (lengths read on the host; the caches are not modified).

    Args:
        q: ``[B, Nq, Hq, D]``.
        k_cache, v_cache: paged ``[num_blocks, page, Hkv, D]`` with ``block_table`` int ``[B, max_pages]``,
            or contiguous ``[B_cache, N_max, Hkv, D]`` with optional ``cache_batch_idx [B]``.
        k, v: new tokens ``[B, Nq_new, Hkv, D]``, appended at ``cache_seqlens`` before attending (on copies).
        cache_seqlens: int or ``[B]``; None = the full capacity. Sequence b holds keys
            ``[cache_leftpad[b], cache_seqlens[b] + Nq_new)``.
        causal: tail-aligned per sequence: query row r sees keys ``j <= r + len_b - Nq``.
        dtype: compute dtype (fp32 or fp64).

    Returns:
        ``(out [B, Nq, Hq, D], lse [B, Hq, Nq])`` in ``dtype``; a row that sees no key gets out 0, lse -inf.
    """
    bsz, nq, hq, d = q.shape
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        seq = torch.full((bsz,), capacity, dtype=torch.long, device=q.device)
    elif isinstance(cache_seqlens, int):
        seq = torch.full((bsz,), cache_seqlens, dtype=torch.long, device=q.device)
    else:
        seq = cache_seqlens.long()
    n_new = 0
    if k is not None:
        k_cache, v_cache = kvcache_append(k_cache, v_cache, k, v, seq, block_table=block_table,
                                          cache_batch_idx=cache_batch_idx)
        n_new = k.shape[1]
    ends = (seq + n_new).tolist()
    starts = [0] * bsz if cache_leftpad is None else cache_leftpad.tolist()
    outs, lses = [], []
    for b in range(bsz):
        kb = kvcache_sequence(k_cache, b, starts[b], ends[b], block_table=block_table,
                              cache_batch_idx=cache_batch_idx)
        vb = kvcache_sequence(v_cache, b, starts[b], ends[b], block_table=block_table,
                              cache_batch_idx=cache_batch_idx)
        o, lse = attention(q[b].transpose(0, 1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0),
                           vb.transpose(0, 1).unsqueeze(0), is_causal=causal, scale=softmax_scale, dtype=dtype)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def paged_varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact varlen attention over paged caches (flash-attn's ``flash_attn_varlen_func`` with ``block_table`` and
    ``seqused_k``): sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` attend over its first
    ``seqused_k[b]`` keys, key j being row ``j % page`` of block ``block_table[b, j // page]`` (tail-aligned causal
    per sequence; lengths read on the host).

    Args:
        q: ``[T_q, Hq, D]``; k_cache, v_cache: ``[num_blocks, page, Hkv, D]``; cu_seqlens_q: ``[B+1]``;
        seqused_k: ``[B]``; block_table: ``[B, max_pages]``.

    Returns:
        ``(out [T_q, Hq, D], lse [Hq, T_q])`` in ``dtype``; a row that sees no key gets out 0, lse -inf.
    """
    cu = cu_seqlens_q.tolist()
    used = seqused_k.tolist()
    outs, lses = [], []
    for b in range(len(cu) - 1):
        qb = q[cu[b]:cu[b + 1]].unsqueeze(0)
        kb = kvcache_sequence(k_cache, b, 0, used[b], block_table=block_table)
        vb = kvcache_sequence(v_cache, b, 0, used[b], block_table=block_table)
        o, lse = attention(qb.transpose(1, 2), kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0),
                           is_causal=causal, scale=softmax_scale, dtype=dtype)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)

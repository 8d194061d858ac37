"""Triton kernels: split-D FFPA forward/backward (dense and varlen) and split-KV decode.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`). The dense forward picks the
split-KV kernel for short queries against long KV by :func:`ffpa_attn.dispatch.heuristics.triton_forward_kernel`, the
same rule :func:`ffpa_attn.explain` reports.
"""
from __future__ import annotations

from ..dispatch.heuristics import triton_forward_kernel
from . import fwd, splitkv
from .bwd import dense_backward, varlen_backward  # noqa: F401
from .fwd import varlen_forward  # noqa: F401


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config):
    """Dense forward ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)``; see :mod:`ffpa_attn.kernel_module`."""
    if triton_forward_kernel(q.shape[2], k.shape[2], dropout=dropout_p > 0) == "splitkv_fwd":
        return splitkv.splitkv_forward(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, config=config)
    return fwd.dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, causal=causal,
                             scale=scale, config=config)

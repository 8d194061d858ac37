"""Placeholder until the split-KV decode kernel lands (delegates to the split-D forward)."""
from __future__ import annotations

from . import fwd


def splitkv_forward(q, k, v, *, attn_mask, causal, scale, config):
    """``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)`` for short queries against a long KV."""
    return fwd.dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=0.0, rng=None, causal=causal, scale=scale,
                             config=config)

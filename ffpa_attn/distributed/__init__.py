"""Context parallelism: exact ring attention over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

* :func:`ring_attn_func`: dense shards ``[B, H, N_local, D]``; :func:`ring_attn_varlen_func`: packed
  shards ``[T_local, H, D]`` with global ``cu_seqlens``. Both differentiable, any backend of the package.
* Layouts ``"zigzag"`` (balanced causal work) and ``"contiguous"``, with shard / unshard / gather helpers
  and the global positions of each rank's tokens (for position ids).

See docs/ring_attention.md for the algorithm and the expected scaling.
"""
from .layout import (
    LAYOUTS,
    dense_positions,
    gather,
    gather_varlen,
    local_cu_seqlens,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
    varlen_positions,
)
from .ring import ring_attn_func, ring_attn_varlen_func

__all__ = [
    "LAYOUTS",
    "dense_positions",
    "gather",
    "gather_varlen",
    "local_cu_seqlens",
    "ring_attn_func",
    "ring_attn_varlen_func",
    "shard",
    "shard_varlen",
    "unshard",
    "unshard_varlen",
    "varlen_positions",
]

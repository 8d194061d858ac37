"""Triton kernels: split-D FFPA forward/backward (dense and varlen) and split-KV decode.

Implements the kernel-module protocol documented in :mod:`ffpa_attn.sdpa`.
"""
from .bwd import dense_backward, varlen_backward  # noqa: F401
from .fwd import dense_forward, varlen_forward  # noqa: F401

"""What the CuTeDSL (sm90a) kernels are enabled for, readable without importing cutlass.

Read by :mod:`ffpa_attn.backends`. A head dim is listed here only after its kernels passed the GPU tests
on an H200 (``tests/gpu/test_cute_gpu.py``, ``bench/explore_cute.py``); the forward kernel in
:mod:`ffpa_attn.cute.fwd_sm90` compiles for every D in :data:`ffpa_attn.cute.config.FWD_HEAD_DIMS`
(264..1024, multiples of 8).
"""
from __future__ import annotations

# dense forward (ffpa_attn.cute.dense_forward)
SUPPORTED_HEAD_DIMS: tuple[int, ...] = ()
# dense backward (ffpa_attn.cute.dense_backward): not implemented yet
SUPPORTED_BWD_HEAD_DIMS: tuple[int, ...] = ()
# varlen forward/backward: not implemented yet
SUPPORTS_VARLEN: bool = False

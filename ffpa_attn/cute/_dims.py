"""Head dims the CuTeDSL (sm90a) kernels are enabled for.

Read by :mod:`ffpa_attn.backends` without importing cutlass. A dim is listed here only after its
kernels passed the GPU tests on an H200 (``tests/gpu/test_cute_gpu.py``); the forward kernel in
:mod:`ffpa_attn.cute.fwd_sm90` can be compiled for more dims (see :data:`ffpa_attn.cute.config.FWD_HEAD_DIMS`).
"""
from __future__ import annotations

SUPPORTED_HEAD_DIMS: tuple[int, ...] = ()

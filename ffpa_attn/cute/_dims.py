"""What the CuTeDSL (sm90a) kernels are enabled for, readable without importing cutlass.

Read by :mod:`ffpa_attn.dispatch.capabilities`. A head dim is listed here only after its kernels passed the GPU tests
on an H200 (``tests/gpu/test_cute_gpu.py``); the forward kernel in
:mod:`ffpa_attn.cute.fwd_sm90` compiles for every D in :data:`ffpa_attn.cute.config.FWD_HEAD_DIMS`
(264..1024, multiples of 8).
"""
from __future__ import annotations

# dense forward (ffpa_attn.cute.dense_forward): every multiple of 8 in [264, 1024] compiles; D in
# {264, 296, 320, 384, 448, 512, 576, 768, 1024} x causal x GQA x tails passed on an H200 (2026-11-29,
# tests/gpu/test_cute_gpu.py), the others share those code paths (d_wg padding, 2-CTA cluster).
SUPPORTED_HEAD_DIMS: tuple[int, ...] = tuple(range(264, 1025, 8))
# where the implicit default picks this backend's forward (measured faster): ffpa_attn.dispatch.heuristics
# dense backward (ffpa_attn.cute.dense_backward, ffpa_attn.cute.bwd_sm90 + bwd_dq_sm90): every multiple of 8 in
# [264, 1024] compiles (64-column chunks, the last one zero-padded by the TMA bounds); D in {264, 320, 384, 448,
# 512} x causal x GQA x tails x Nq != Nkv passed on an H200 (2026-11-29:
# 27/27 GPU tests, 16/16 explore shapes, compute-sanitizer memcheck clean); D > 512 (V / dO streamed, more
# head-dim parts): D in {520, 576, 640, 768, 896, 960, 1024} on an H200 (2026-12-01).
SUPPORTED_BWD_HEAD_DIMS: tuple[int, ...] = tuple(range(264, 1025, 8))
# directions with a packed-sequence (varlen, cu_seqlens) kernel, for the same head dims as the dense one: the
# forward (ffpa_attn.cute.varlen_forward: one launch over a device-built work list, every D of
# SUPPORTED_HEAD_DIMS, D > 512 on the same 2-CTA cluster) and the backward (ffpa_attn.cute.varlen_backward: the
# dense backward's dK/dV and dQ kernels with BwdConfig.varlen, one launch each over key-block / query-block work
# lists, every D of SUPPORTED_BWD_HEAD_DIMS; compiled in CI at D 264 / 512 / 1024, GPU tests
# tests/gpu/test_cute_varlen_bwd_gpu.py not yet run on an H200 as of 2026-12-01).
VARLEN_DIRECTIONS: tuple[str, ...] = ("forward", "backward")

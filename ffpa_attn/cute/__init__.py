"""CuTeDSL (sm90a, Hopper) kernels: the kernel module of the ``cutedsl`` backend.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`). Importing this package imports neither
cutlass nor torch kernels: :mod:`ffpa_attn.backends` reads :data:`SUPPORTED_HEAD_DIMS` (and
``SUPPORTED_BWD_HEAD_DIMS`` / ``VARLEN_DIRECTIONS``, from :mod:`ffpa_attn.cute._dims`) to decide routing,
and cutlass is imported on the first kernel call.

Modules: :mod:`.config` (tile configuration and budgets, no cutlass), :mod:`.fwd_sm90` (the forward
kernel: D in (256, 1024], one CTA per query block up to D = 512, a 2-CTA cluster above),
:mod:`.bwd_sm90` (the backward's dK/dV kernel: D in (256, 1024], key-stationary, one CTA per 64-key block and
head-dim part), :mod:`.bwd_dq_sm90` (the backward's dQ kernel: query-stationary, dQ written once per element),
:mod:`.splitkv` (decode: the forward kernel on packed GQA rows x KV slices + lse combine),
:mod:`._compile` (compile on symbolic shapes), :mod:`._cache` (CuTeDSL's use of :mod:`ffpa_attn.cache`: compiled
kernels in memory and on disk, compiled in compile workers where a call needs several kernels), :mod:`.api` (torch
tensors in, kernel launched; :func:`.api.run_forward` / :func:`.api.run_backward` bypass the head-dim gates for tests and
benchmarks).

Status (H200, 2026-12-01): dense forward and backward (fp16/bf16, D a multiple of 8 in [264, 1024], causal,
GQA/MQA, Nq != Nkv, tails, any scale) pass the GPU tests and are routed by the implicit default; the backward
is two kernels (dK/dV and dQ, deterministic); the varlen forward (:mod:`.fwd_sm90` with ``FwdConfig.varlen``:
packed q/k/v, a work list built on the device from ``cu_seqlens``, stores bounded by each sequence; shared
pieces :mod:`.seqlen_info`, :mod:`.block_info`, :mod:`.tile_scheduler`, :mod:`.ranges`) compiles for every D;
the varlen backward runs the dense backward's two kernels with ``BwdConfig.varlen`` (:func:`varlen_backward`:
one launch each over key-block / query-block work lists; GPU tests: tests/gpu/test_cute_varlen_bwd_gpu.py).
:func:`prepare_backward` (the kernel-module protocol's optional hook) starts the backward's compiles while the
forward of a call that needs its backward runs.
"""
from __future__ import annotations

from ..kernel_module import check_kernel
from ._dims import SUPPORTED_HEAD_DIMS

__all__ = ["SUPPORTED_HEAD_DIMS", "dense_forward", "dense_backward", "prepare_backward", "varlen_forward",
           "varlen_backward"]

# the public ffpa-attn package's names for its SDPA-layout low-level calls (compatibility entry points that
# run on whichever backend the planner picks); resolved lazily so this package still imports no kernel code
_COMPAT_NAMES = ("_ffpa_attn_forward_cute", "_ffpa_attn_backward_cute")


def __getattr__(name: str):
    if name in _COMPAT_NAMES:
        from .. import compat

        return getattr(compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config, kernel):
    """Dense forward ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)`` by the kernel the planner named:
    ``"fwd_sm90"`` (:mod:`.fwd_sm90`), ``"fwd_sm90_recompute"`` (:mod:`.fwd_sm90_recompute`, 512 < D <= 1024) or
    ``"splitkv_fwd_sm90"`` (:mod:`.splitkv`); see :mod:`ffpa_attn.kernel_module`."""
    del rng, config  # no dropout; the config's fwd_recompute is already in the kernel's name
    check_kernel("cutedsl", "dense_forward", kernel, ("fwd_sm90", "fwd_sm90_recompute", "splitkv_fwd_sm90"))
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no attn_mask and no dropout")
    if kernel == "splitkv_fwd_sm90":
        from . import splitkv

        return splitkv.forward(q, k, v, causal, scale)
    from .api import run_forward

    return run_forward(q, k, v, causal, scale, recompute=kernel == "fwd_sm90_recompute")


def dense_backward(dout, q, k, v, out, lse, *, dlse, attn_mask, mask_grad, dropout_p, rng, causal, scale,
                   config, kernel):
    """Dense backward ``(dq, dk, dv, None)`` (dk/dv reduced to Hkv); see :mod:`ffpa_attn.kernel_module`.

    Every D up to 1024: the dK/dV kernel of :mod:`.bwd_sm90` and the dQ kernel of :mod:`.bwd_dq_sm90` (above
    D = 512 with V / dO streamed next to their partner chunks and more head-dim parts per block)."""
    del rng, config, mask_grad
    check_kernel("cutedsl", "dense_backward", kernel, ("bwd_sm90+bwd_dq_sm90",))  # the dK/dV and the dQ kernel
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no attn_mask and no dropout")
    from .api import run_backward

    dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, scale, dlse=dlse)
    return dq, dk, dv, None


def prepare_backward(q, k, v, *, attn_mask, dropout_p, causal) -> None:
    """Start compiling the backward's kernels of this call in compile workers (:func:`.api.prefetch_backward`)
    so that they compile while the forward runs; see :mod:`ffpa_attn.kernel_module`."""
    del k, v
    if attn_mask is not None or dropout_p > 0 or q.device.type != "cuda":
        return  # dense_backward raises for these; nothing to prepare
    from .api import prefetch_backward

    prefetch_backward(q.shape[-1], q.dtype, causal, varlen=q.dim() == 3)  # packed q [T, H, D]: the varlen kernels


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config, kernel):
    """Packed forward ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)`` in one launch (:func:`.api.run_varlen_forward`,
    kernel ``"varlen_fwd_sm90"``); see :mod:`ffpa_attn.kernel_module`."""
    del rng, config, max_q, max_k  # the grid comes from T_q and the batch size, not from max_seqlen
    check_kernel("cutedsl", "varlen_forward", kernel, ("varlen_fwd_sm90",))
    if dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend has no dropout")
    from .api import run_varlen_forward

    return run_varlen_forward(q, k, v, cu_q, cu_k, causal, scale)


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, kernel):
    """Packed (THD) backward ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])``; see
    :mod:`ffpa_attn.kernel_module`.

    One launch of each backward kernel for the whole batch (:func:`.api.run_varlen_backward`): every D of the
    dense backward, causal tail-aligned per sequence, cross lengths, GQA, caller ``out`` / ``lse`` / ``dlse``."""
    del rng, config
    check_kernel("cutedsl", "varlen_backward", kernel, ("varlen_bwd_sm90+varlen_bwd_dq_sm90",))
    if dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no dropout")
    from .api import run_varlen_backward

    return run_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=dlse)

"""CuTeDSL (sm90a, Hopper) kernels: the kernel module of the ``cutedsl`` backend.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`); ``backend.json`` beside this file describes
what it runs. Importing this package imports neither cutlass nor torch kernels; cutlass is imported on the first
kernel call. Each entry point runs the :class:`~ffpa_attn.kernel_module.KernelSpec` the planner chose, verbatim
(tile sizes, the last-wave split, split-KV slices, ring depths are the spec's parameters).

Modules: :mod:`.config` (tile configuration and budgets, no cutlass), :mod:`.fwd_sm90` (the forward kernel: one
CTA per query block up to D = 512, a 2-CTA cluster above), :mod:`.fwd_sm90_recompute` (512 < D <= 1024: two CTAs
per query block, each computing the whole S and half of O), :mod:`.bwd_sm90` (the backward's dK/dV kernel:
key-stationary, one CTA per 64-key block and head-dim part), :mod:`.bwd_dq_sm90` (the backward's dQ kernel:
query-stationary, dQ written once per element), :mod:`.splitkv` (decode: the forward kernel on packed GQA rows x
KV slices + lse combine), the pieces the kernels share (:mod:`.seqlen_info`, :mod:`.block_info`,
:mod:`.tile_scheduler`, :mod:`.ranges`), :mod:`._compile` (compile on symbolic shapes, with TVM-FFI), :mod:`._cache` (CuTeDSL's use of
:mod:`ffpa_attn.cache`: compiled kernels in memory and on disk as shared objects, compile workers), :mod:`._server`
(the compile server's first import) and :mod:`.api` (torch tensors in, kernel launched through TVM-FFI).
"""
from __future__ import annotations

# no torch at import (the torch-free compile server imports this package): kernel code is imported by the entry points
from ..kernel_module import check_kernel, load_spec

SPEC = load_spec(__name__)  # this backend's description (backend.json)

__all__ = ["SPEC", "dense_forward", "dense_backward", "prepare_backward", "varlen_forward", "varlen_backward",
           "kvcache_forward"]


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config, kernel):
    """Dense forward ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)`` by the kernel the planner named:
    ``"fwd_sm90"`` (:mod:`.fwd_sm90`; ``tile_n``, ``tail``), ``"fwd_sm90_recompute"`` (:mod:`.fwd_sm90_recompute`,
    512 < D <= 1024) or ``"splitkv_fwd_sm90"`` (:mod:`.splitkv`; ``splits``, ``tile_n``); see
    :mod:`ffpa_attn.kernel_module`."""
    del rng, config  # no dropout; the config's choices are in the kernel spec
    kernel = check_kernel(SPEC, "dense_forward", kernel)
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no attn_mask and no dropout")
    if kernel.name == "splitkv_fwd_sm90":
        from . import splitkv

        return splitkv.forward(q, k, v, causal, scale, splits=kernel.get("splits"), tile_n=kernel.get("tile_n"))
    from ..common.tail_split import TailSplit
    from .api import run_forward

    tail = kernel.get("tail")
    return run_forward(q, k, v, causal, scale, tile_n=kernel.get("tile_n"), tail=TailSplit(*tail) if tail else None,
                       recompute=kernel.name == "fwd_sm90_recompute")


def dense_backward(dout, q, k, v, out, lse, *, dlse, attn_mask, mask_grad, dropout_p, rng, causal, scale,
                   config, kernel):
    """Dense backward ``(dq, dk, dv, None)`` (dk/dv reduced to Hkv); see :mod:`ffpa_attn.kernel_module`.

    Every D up to 1024: the dK/dV kernel of :mod:`.bwd_sm90` and the dQ kernel of :mod:`.bwd_dq_sm90` (above
    D = 512 with V / dO streamed next to their partner chunks and more head-dim parts per block)."""
    del rng, config, mask_grad
    kernel = check_kernel(SPEC, "dense_backward", kernel)  # the dK/dV and the dQ kernel
    if attn_mask is not None or dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no attn_mask and no dropout")
    from .api import run_backward

    dq, dk, dv = run_backward(dout, q, k, v, out, lse, causal, scale, dlse=dlse,
                              max_stages=kernel.get("ring_stages"))
    return dq, dk, dv, None


def prepare_backward(q, k, v, *, attn_mask, dropout_p, causal, kernel) -> None:
    """Start compiling the backward kernels of this call (``kernel``: the backward's spec) in compile workers
    (:func:`.api.prefetch_backward`) so that they compile while the forward runs; see :mod:`ffpa_attn.kernel_module`."""
    del k, v
    if attn_mask is not None or dropout_p > 0 or q.device.type != "cuda":
        return  # dense_backward raises for these; nothing to prepare
    from .api import prefetch_backward

    # packed q [T, H, D]: the varlen kernels
    prefetch_backward(q.shape[-1], q.dtype, causal, varlen=q.dim() == 3, max_stages=kernel.get("ring_stages"))


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config, kernel):
    """Packed forward ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)`` in one launch (:func:`.api.run_varlen_forward`,
    kernel ``"varlen_fwd_sm90"``); see :mod:`ffpa_attn.kernel_module`."""
    del rng, config, max_q, max_k  # the grid comes from T_q and the batch size, not from max_seqlen
    kernel = check_kernel(SPEC, "varlen_forward", kernel)
    if dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend has no dropout")
    from .api import run_varlen_forward

    return run_varlen_forward(q, k, v, cu_q, cu_k, causal, scale, tile_n=kernel.get("tile_n"))


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, kernel):
    """Packed (THD) backward ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])``; see
    :mod:`ffpa_attn.kernel_module`.

    One launch of each backward kernel for the whole batch (:func:`.api.run_varlen_backward`): every D of the
    dense backward, causal tail-aligned per sequence, cross lengths, GQA, caller ``out`` / ``lse`` / ``dlse``."""
    del rng, config
    kernel = check_kernel(SPEC, "varlen_backward", kernel)
    if dropout_p > 0:
        raise NotImplementedError("the CuTeDSL backend takes no dropout")
    from .api import run_varlen_backward

    return run_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, dlse=dlse,
                               max_stages=kernel.get("ring_stages"))


def kvcache_forward(*args, **kwargs):
    """Not implemented: the CuTeDSL backend has no KV-cache kernel (its backend.json lists none, so the planner
    never routes a KV-cache call here)."""
    raise NotImplementedError("the CuTeDSL backend has no KV-cache kernel: ffpa_attn_with_kvcache runs on the Triton "
                              "backend")

"""Triton kernels: split-D FFPA forward/backward (dense and varlen), split-KV decode and KV-cache attention.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`): each entry point runs the kernel the
planner named (``kernel``; :func:`ffpa_attn.explain` / :func:`ffpa_attn.explain_kvcache` report it) and decides
nothing itself. Kernels: dense forward ``"fwd"`` (split-D, :mod:`.fwd`) or ``"splitkv_fwd"`` (split-KV for short
queries against a long KV, :mod:`.splitkv`), dense backward ``"bwd"``, varlen ``"varlen_fwd"`` / ``"varlen_bwd"``
(:mod:`.bwd`; the varlen forward also reads paged K/V through a block table and per-sequence key counts), KV cache
``"kvcache_fwd"`` (append + split-KV attention over a paged or contiguous cache), ``"kvcache_paged"`` (append + the
planner's varlen forward over the pages in place: chunked prefill) or ``"kvcache_gather"`` (append + packed gather +
the planner's varlen forward) (:mod:`.kvcache`).
"""
from __future__ import annotations

from ..kernel_module import check_kernel, load_spec
from . import bwd, fwd, kvcache, splitkv

SPEC = load_spec(__name__)  # this backend's description (backend.json): its kernel names, devices, features


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config, kernel):
    """Dense forward ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)``; see :mod:`ffpa_attn.kernel_module`."""
    kernel = check_kernel(SPEC, "dense_forward", kernel)
    if kernel.name == "splitkv_fwd":
        if dropout_p > 0:
            raise NotImplementedError("the Triton split-KV forward has no dropout (the split-D kernel 'fwd' has)")
        return splitkv.splitkv_forward(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, config=config)
    return fwd.dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, causal=causal,
                             scale=scale, config=config)


def dense_backward(dout, q, k, v, out, lse, *, dlse, attn_mask, mask_grad, dropout_p, rng, causal, scale, config,
                   kernel):
    """Dense backward ``(dq, dk [B, Hkv, Nkv, D], dv, dmask or None)``; see :mod:`ffpa_attn.kernel_module`."""
    check_kernel(SPEC, "dense_backward", kernel)
    return bwd.dense_backward(dout, q, k, v, out, lse, dlse=dlse, attn_mask=attn_mask, mask_grad=mask_grad,
                              dropout_p=dropout_p, rng=rng, causal=causal, scale=scale, config=config)


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config, kernel,
                   seqused_k=None, block_table=None, varlen=None, max_total=0):
    """Packed forward ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)``; see :mod:`ffpa_attn.kernel_module`. With
    ``block_table`` k/v are paged caches ``[num_blocks, page, Hkv, D]`` and ``seqused_k`` int32 ``[B]`` gives each
    sequence's key count (features ``paged_kv``, ``seqused_k``): kernel ``"varlen_fwd"`` reads the pages in place,
    ``"varlen_gather"`` packs them (``max_total`` rows, 0: read here) and runs ``varlen`` -- the planner's varlen
    forward of another backend -- over them."""
    kernel = check_kernel(SPEC, "varlen_forward", kernel)
    if kernel.name == "varlen_gather":
        if varlen is None or block_table is None:
            raise ValueError("kernel: 'varlen_gather' packs paged K/V (block_table) for the varlen forward the "
                             "planner chose (varlen)")
        return kvcache.gather_varlen(q, k, v, cu_q, seqused_k, block_table, max_q, max_total=max_total,
                                     varlen=varlen)
    return fwd.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, rng=rng, causal=causal,
                              scale=scale, config=config, seqused_k=seqused_k, block_table=block_table)


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, kernel):
    """Packed backward ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv)``; see :mod:`ffpa_attn.kernel_module`."""
    check_kernel(SPEC, "varlen_backward", kernel)
    return bwd.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dlse=dlse, dropout_p=dropout_p,
                               rng=rng, causal=causal, scale=scale, config=config)


def kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, *, causal,
                    scale, config, kernel, max_total=0, varlen=None):
    """KV-cache attention ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``, appending ``k / v`` first; see
    :mod:`ffpa_attn.kernel_module`. ``"kvcache_fwd"`` runs the tiles and split count of the spec; ``"kvcache_gather"``
    packs the cached keys and runs ``varlen`` (the planner's varlen forward) over them."""
    del config  # the KV-cache kernels have no tunable the config names
    kernel = check_kernel(SPEC, "kvcache_forward", kernel)
    args = dict(cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                cache_leftpad=cache_leftpad, causal=causal, scale=scale)
    if kernel.name in ("kvcache_gather", "kvcache_paged"):
        if varlen is None:
            raise ValueError(f"kernel: {kernel.name!r} needs the varlen forward the planner chose (varlen=None)")
        if kernel.name == "kvcache_paged":
            return kvcache.paged_forward(q, k_cache, v_cache, k, v, varlen=varlen, **args)
        return kvcache.gather_forward(q, k_cache, v_cache, k, v, max_total=max_total, varlen=varlen, **args)
    return kvcache.decode_forward(q, k_cache, v_cache, k, v, cfg=kvcache.config_from(kernel.get),
                                  splits=int(kernel.get("splits", 1)), **args)

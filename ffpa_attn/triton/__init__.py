"""Triton kernels: split-D FFPA forward/backward (dense and varlen) and split-KV decode.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`): each entry point runs the kernel the
planner named (``kernel``; :func:`ffpa_attn.explain` reports it) and decides nothing itself. Kernels: dense
forward ``"fwd"`` (split-D, :mod:`.fwd`) or ``"splitkv_fwd"`` (split-KV for short queries against a long KV,
:mod:`.splitkv`), dense backward ``"bwd"``, varlen ``"varlen_fwd"`` / ``"varlen_bwd"`` (:mod:`.bwd`).
"""
from __future__ import annotations

from ..kernel_module import check_kernel, load_spec
from . import bwd, fwd, splitkv

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


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config, kernel):
    """Packed forward ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)``; see :mod:`ffpa_attn.kernel_module`."""
    check_kernel(SPEC, "varlen_forward", kernel)
    return fwd.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, rng=rng, causal=causal,
                              scale=scale, config=config)


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, kernel):
    """Packed backward ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv)``; see :mod:`ffpa_attn.kernel_module`."""
    check_kernel(SPEC, "varlen_backward", kernel)
    return bwd.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dlse=dlse, dropout_p=dropout_p,
                               rng=rng, causal=causal, scale=scale, config=config)

"""The torch op family ``torch.ops.ffpa_attn.*``: the single dispatch point of every FFPA kernel.

Ops (all functional, with fake implementations so ``torch.compile(fullgraph=True)`` traces them):

* ``attn(q, k, v, attn_mask?, dropout_p, rng?, is_causal, scale, fwd_backend, fwd_kernel, fwd_config,
  bwd_backend, bwd_kernel, bwd_config) -> (out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)`` with a registered
  autograd formula that calls ``attn_backward``.
* ``attn_backward(dout, q, k, v, out, lse, dlse?, attn_mask?, mask_grad, dropout_p, rng?, is_causal, scale,
  backend, kernel, config) -> (dq, dk [B, Hkv, ...], dv, dmask)``; ``dmask`` has the mask's shape when
  ``mask_grad`` else shape ``[0]``.
* ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, rng?, causal, scale, fwd_backend, fwd_kernel,
  fwd_config, bwd_backend, bwd_kernel, bwd_config) -> (out [T_q, Hq, Dv], lse [Hq, T_q] fp32)`` with autograd.
* ``varlen_boundaries(cu_q, cu_k, total_q, total_k, max_q, max_k, causal) -> (cu_q, cu_k)``: the checked,
  contiguous boundaries every varlen call runs on (its value checks run in compiled graphs too).
* ``varlen_attn_backward(dout, q, k, v, out, lse, dlse?, cu_q, cu_k, max_q, max_k, dropout_p, rng?, causal,
  scale, backend, kernel, config) -> (dq, dk, dv)``.

Each direction crosses the op boundary as the planner's choice (:meth:`ffpa_attn.dispatch.planner.KernelChoice.op_args`):
the backend's name, the kernel spec the planner decided (name and parameters, ``KernelSpec.encode``; the kernel
module runs exactly that) and the backend's fields as a string (``Backend.to_config``). ``rng`` is
an int64 ``[2]`` (seed, offset) tensor drawn from torch's generator by the caller when dropout_p > 0.
Inputs are validated by :mod:`ffpa_attn.interface` before they get here.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from .common.lse import empty_result
from .config import from_config
from .contract import check_varlen_values
from .dispatch.registry import REGISTRY, kernel_package
from .kernel_module import KernelSpec, decode_kernel

_LIB = "ffpa_attn"


def kernel_module(name: str) -> ModuleType:
    """Import the kernel package of backend ``name`` (lazily: only when a call runs on it)."""
    return importlib.import_module(kernel_package(name))


def _layout_of(g: Tensor, x: Tensor) -> Tensor:
    """``g`` in the strides ``torch.empty_like(x)`` has (what the fake impls promise); a copy only when a kernel
    returned another layout (e.g. a contiguous dq for a transposed q), because compiled graphs assert the
    fake's strides on the real output."""
    want = torch.empty_like(x, device="meta").stride()
    if g.stride() == want:
        return g
    return torch.empty_like(x).copy_(g)


def prepare_backward(backend: str, kernel: KernelSpec, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                     dropout_p: float, causal: bool) -> None:
    """Let the kernel module of ``backend`` prepare the backward (``kernel``) of a call before its forward runs (the
    optional ``prepare_backward`` hook of :mod:`ffpa_attn.kernel_module`); a no-op for modules without it."""
    if backend not in REGISTRY or kernel.name in ("none", "torch_sdpa_autograd"):
        return
    hook = getattr(kernel_module(backend), "prepare_backward", None)
    if hook is not None:
        hook(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, causal=causal, kernel=kernel)


# ---------------------------------------------------------------------------------------------- dense


@torch.library.custom_op(f"{_LIB}::attn", mutates_args=())
def attn(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
    is_causal: bool, scale: float, fwd_backend: str, fwd_kernel: str, fwd_config: str, bwd_backend: str,
    bwd_kernel: str, bwd_config: str,
) -> tuple[Tensor, Tensor]:
    del bwd_backend, bwd_kernel, bwd_config  # used by the autograd formula
    if q.numel() == 0 or k.shape[2] == 0:  # empty: kernels never see it
        return empty_result(q, v.shape[-1], (q.shape[0], q.shape[1], q.shape[2]))
    mod = kernel_module(fwd_backend)
    out, lse = mod.dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, causal=is_causal,
                                 scale=scale, config=from_config(fwd_backend, fwd_config), kernel=decode_kernel(fwd_kernel))
    return out.contiguous(), lse.contiguous()  # the fake's layout (new_empty)


@attn.register_fake
def _attn_fake(q, k, v, attn_mask, dropout_p, rng, is_causal, scale, fwd_backend, fwd_kernel, fwd_config,
               bwd_backend, bwd_kernel, bwd_config):
    b, hq, nq, _ = q.shape
    out = q.new_empty(b, hq, nq, v.shape[-1])
    lse = q.new_empty(b, hq, nq, dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{_LIB}::attn_backward", mutates_args=())
def attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    attn_mask: Optional[Tensor], mask_grad: bool, dropout_p: float, rng: Optional[Tensor], is_causal: bool,
    scale: float, backend: str, kernel: str, config: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.shape[2] == 0:
        dmask = torch.zeros_like(attn_mask) if (mask_grad and attn_mask is not None) else q.new_empty(0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    mod = kernel_module(backend)
    dq, dk, dv, dmask = mod.dense_backward(
        dout, q, k, v, out, lse, dlse=dlse, attn_mask=attn_mask, mask_grad=mask_grad, dropout_p=dropout_p,
        rng=rng, causal=is_causal, scale=scale, config=from_config(backend, config), kernel=decode_kernel(kernel))
    if dmask is None:
        dmask = q.new_empty(0)
    return _layout_of(dq, q), _layout_of(dk, k), _layout_of(dv, v), dmask.contiguous()


@attn_backward.register_fake
def _attn_backward_fake(dout, q, k, v, out, lse, dlse, attn_mask, mask_grad, dropout_p, rng, is_causal, scale,
                        backend, kernel, config):
    dmask = attn_mask.new_empty(attn_mask.shape) if (mask_grad and attn_mask is not None) else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _attn_setup(ctx, inputs, output):
    q, k, v, attn_mask, dropout_p, rng, is_causal, scale, _fb, _fk, _fc, bwd_backend, bwd_kernel, bwd_config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng)
    ctx.meta = (dropout_p, is_causal, scale, bwd_backend, bwd_kernel, bwd_config)


def _attn_grad(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, rng = ctx.saved_tensors
    dropout_p, is_causal, scale, backend, kernel, config = ctx.meta
    mask_grad = bool(attn_mask is not None and ctx.needs_input_grad[3])
    dq, dk, dv, dmask = torch.ops.ffpa_attn.attn_backward(
        dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, dlse, attn_mask, mask_grad,
        dropout_p, rng, is_causal, scale, backend, kernel, config)
    return (dq, dk, dv, (dmask if mask_grad else None)) + (None,) * 10


attn.register_autograd(_attn_grad, setup_context=_attn_setup)


# --------------------------------------------------------------------------------------------- varlen


@torch.library.custom_op(f"{_LIB}::varlen_boundaries", mutates_args=())
def varlen_boundaries(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int, max_seqlen_q: int,
                      max_seqlen_k: int, causal: bool) -> tuple[Tensor, Tensor]:
    """Checked, contiguous copies of the boundary tensors (int32 ``[B+1]`` each).

    Every varlen entry point passes its boundaries through this op, eager or compiled: the value checks of
    :func:`ffpa_attn.contract.check_varlen_values` (which read the boundaries on the host) therefore also run
    inside a ``torch.compile`` graph, where the interface cannot read tensor values, so a ``max_seqlen``
    shorter than a sequence raises instead of leaving rows the kernels never write. The copies are
    contiguous because the kernels index the boundaries as a dense array.
    """
    check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, causal)
    return cu_seqlens_q.contiguous().clone(), cu_seqlens_k.contiguous().clone()


@varlen_boundaries.register_fake
def _varlen_boundaries_fake(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, causal):
    return torch.empty_like(cu_seqlens_q, memory_format=torch.contiguous_format), torch.empty_like(
        cu_seqlens_k, memory_format=torch.contiguous_format)



@torch.library.custom_op(f"{_LIB}::varlen_attn", mutates_args=())
def varlen_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float, fwd_backend: str,
    fwd_kernel: str, fwd_config: str, bwd_backend: str, bwd_kernel: str, bwd_config: str,
) -> tuple[Tensor, Tensor]:
    del bwd_backend, bwd_kernel, bwd_config
    if q.numel() == 0 or k.shape[0] == 0:
        return empty_result(q, v.shape[-1], (q.shape[1], q.shape[0]))
    mod = kernel_module(fwd_backend)
    return mod.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              dropout_p=dropout_p, rng=rng, causal=causal, scale=scale,
                              config=from_config(fwd_backend, fwd_config), kernel=decode_kernel(fwd_kernel))


@varlen_attn.register_fake
def _varlen_attn_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, rng, causal,
                      scale, fwd_backend, fwd_kernel, fwd_config, bwd_backend, bwd_kernel, bwd_config):
    tq, hq, _ = q.shape
    return q.new_empty(tq, hq, v.shape[-1]), q.new_empty(hq, tq, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::varlen_attn_backward", mutates_args=())
def varlen_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
    rng: Optional[Tensor], causal: bool, scale: float, backend: str, kernel: str, config: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    mod = kernel_module(backend)
    dq, dk, dv = mod.varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, dlse=dlse, dropout_p=dropout_p, rng=rng, causal=causal,
                                     scale=scale, config=from_config(backend, config), kernel=decode_kernel(kernel))
    return _layout_of(dq, q), _layout_of(dk, k), _layout_of(dv, v)


@varlen_attn_backward.register_fake
def _varlen_attn_backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p, rng, causal, scale, backend, kernel, config):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, rng, causal, scale, _fb, _fk, _fc, bwd_backend, bwd_kernel,
     bwd_config) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)
    ctx.meta = (max_q, max_k, dropout_p, causal, scale, bwd_backend, bwd_kernel, bwd_config)


def _varlen_grad(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
    max_q, max_k, dropout_p, causal, scale, backend, kernel, config = ctx.meta
    dq, dk, dv = torch.ops.ffpa_attn.varlen_attn_backward(
        dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k,
        dropout_p, rng, causal, scale, backend, kernel, config)
    return (dq, dk, dv) + (None,) * 14


varlen_attn.register_autograd(_varlen_grad, setup_context=_varlen_setup)

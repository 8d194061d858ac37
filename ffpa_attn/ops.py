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
* ``paged_varlen_attn(q, k, v, cu_q, cu_k?, seqused_k, block_table?, max_q, max_k, causal, scale, max_total,
  backend, kernel, config, varlen_backend, varlen_kernel, varlen_config) -> (out [T_q, Hq, D], lse [Hq, T_q] fp32)``:
  the serving forms of the varlen forward (paged K/V caches read through ``block_table``, per-sequence key counts
  ``seqused_k``), forward only; on the gather route the pages are packed and run by the ``varlen_*`` forward.
* ``kvcache_attn(q, k_cache, v_cache, cache_seqlens?, block_table?, cache_batch_idx?, cache_leftpad?, causal, scale,
  max_total, backend, kernel, config, varlen_backend, varlen_kernel, varlen_config) -> (out [B, Nq, Hq, D],
  lse [B, Hq, Nq] fp32)`` (forward only) and ``kvcache_append_attn(q, k_cache, v_cache, k, v, cache_seqlens, ...)``,
  which writes k / v into the caches first (the caches are its mutated arguments).

Autocast: the ops run with autocast off (:func:`register_autocast`); the public entry points cast their inputs to an
active region's dtype before they validate and plan (:func:`autocast_inputs`, docs/design.md "Contract").

Each direction crosses the op boundary as the planner's choice (:meth:`ffpa_attn.dispatch.planner.KernelChoice.op_args`):
the backend's name, the kernel spec the planner decided (name and parameters, ``KernelSpec.encode``; the kernel
module runs exactly that) and the backend's fields as a string (``Backend.to_config``). ``rng`` is
an int64 ``[2]`` (seed, offset) tensor drawn from torch's generator by the caller when dropout_p > 0.
Inputs are validated by :mod:`ffpa_attn.interface` before they get here.
"""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from .common.lse import empty_result
from .config import from_config
from .contract import SUPPORTED_DTYPES, check_varlen_values
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


# ------------------------------------------------------------------------------------------- autocast
# torch SDPA is on autocast's lower-precision list: inside an active fp16/bf16 region its floating inputs of another
# dtype run in the region's dtype. Every entry point of this package does the same, before it validates and plans
# (the plan depends on the dtype, so the cast cannot wait for the op). The ops themselves run with autocast off: the
# parts the kernels keep in fp32 (lse, a float mask's bias, merges of partial results, the SDPA module's fp32
# matmuls) must not be downcast by the region that called them, in the forward or in a backward run inside it.

AUTOCAST_DEVICES = ("cpu", "cuda")  # the device types our kernels run on


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype an active autocast region on ``device_type`` gives SDPA's inputs (fp16/bf16), else None (no region,
    or a region of another dtype)."""
    if device_type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if dtype in SUPPORTED_DTYPES else None


def _device_type(t: Tensor) -> str:
    return "cuda" if t.is_cuda else t.device.type  # is_cuda first: no device object on the common path


def _cast(t: object, device_type: str, dtype: torch.dtype) -> object:
    """``t`` in ``dtype`` when autocast would cast it (a floating tensor on ``device_type`` other than float64:
    autocast's eligibility rule), else ``t`` unchanged. Differentiable: fp32 leaves get fp32 gradients."""
    if (not isinstance(t, Tensor) or t.dtype in (dtype, torch.float64) or not t.is_floating_point()
            or _device_type(t) != device_type):
        return t
    return t.to(dtype)


def autocast_inputs(*tensors: object) -> tuple:
    """``tensors`` as an autocast region hands them to torch SDPA: each eligible one cast to the region's dtype when
    autocast is active on the first tensor's device type; unchanged otherwise (non-tensors pass through, for the
    validation to reject). Callers pass q/k/v (and dout/out), never lse or a mask: lse is fp32 by contract and a
    float mask is added in fp32 where the kernels add it."""
    first = tensors[0] if tensors else None
    if not isinstance(first, Tensor):
        return tensors
    device_type = _device_type(first)
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return tensors
    return tuple(_cast(t, device_type, dtype) for t in tensors)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context that leaves an active fp16/bf16 autocast region of ``device_type`` (for fp32 work outside the ops,
    e.g. the ring's merges); a no-op context otherwise."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _autocast_kernel(op: torch._ops.OpOverload, device_type: str, cast: tuple[int, ...]):
    """The Autocast<device> kernel of ``op`` (see :func:`register_autocast`)."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))
    off = torch._C.DispatchKeySet(key)

    def kernel(*args):
        dtype = autocast_dtype(device_type)
        if dtype is not None and cast:
            args = tuple(_cast(a, device_type, dtype) if i in cast else a for i, a in enumerate(args))
        # the key excluded, as torch's own autocast kernels do: the op and all it calls run outside the region
        with torch._C._ExcludeDispatchKeyGuard(off):
            return op(*args)

    return kernel


def register_autocast(qualname: str, cast: tuple[int, ...] = ()) -> None:
    """Give op ``qualname`` its autocast rule on each device type of :data:`AUTOCAST_DEVICES`: in an active fp16/bf16
    region the eligible tensors among the positional arguments ``cast`` become the region's dtype, and the op runs
    with autocast off. Unlike ``torch.library.register_autocast``, whose dtype is fixed at registration, the dtype is
    the region's, read at each call (what autocast does for SDPA)."""
    ns, name = qualname.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
    for device_type in AUTOCAST_DEVICES:
        torch.library.impl(qualname, "Autocast" + torch._C._dispatch_key_for_device(device_type),
                           _autocast_kernel(op, device_type, cast))


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


def _varlen_of(backend: str, kernel: str, config: str, causal: bool, scale: float):
    """The varlen forward of a plan's second choice as a callable ``(q, k, v, cu_q, cu_k, max_q, max_k, **paged)``
    (paged: ``seqused_k``, ``block_table``), or None without one (empty strings)."""
    if not backend:
        return None
    mod, cfg, spec = kernel_module(backend), from_config(backend, config), decode_kernel(kernel)

    def varlen(qp, kp, vp, cu_q, cu_k, max_q, max_k, **paged):
        return mod.varlen_forward(qp, kp, vp, cu_q, cu_k, max_q, max_k, dropout_p=0.0, rng=None, causal=causal,
                                  scale=scale, config=cfg, kernel=spec, **paged)

    return varlen


@torch.library.custom_op(f"{_LIB}::paged_varlen_attn", mutates_args=())
def paged_varlen_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor], seqused_k: Tensor,
    block_table: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float, max_total: int,
    backend: str, kernel: str, config: str, varlen_backend: str, varlen_kernel: str, varlen_config: str,
) -> tuple[Tensor, Tensor]:
    """The varlen forward over paged K/V caches ``[num_blocks, page, Hkv, D]`` addressed by ``block_table``, or over
    packed ``[T_k, Hkv, D]`` K/V with ``cu_seqlens_k`` (``block_table`` None); sequence b uses ``seqused_k[b]`` keys.
    The six trailing strings are the planner's (:meth:`ffpa_attn.dispatch.planner.PagedVarlenPlan.op_args`): on the
    gather route ``kernel`` packs the pages (``max_total`` rows, 0: sized by the kernel module) for the ``varlen_*``
    forward. Forward only (no autograd formula: the interface refuses inputs that require grad)."""
    if q.numel() == 0:
        return empty_result(q, v.shape[-1], (q.shape[1], q.shape[0]))
    mod = kernel_module(backend)
    gather = {} if not varlen_backend else {
        "varlen": _varlen_of(varlen_backend, varlen_kernel, varlen_config, causal, scale), "max_total": max_total}
    return mod.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              rng=None, causal=causal, scale=scale, config=from_config(backend, config),
                              kernel=decode_kernel(kernel), seqused_k=seqused_k, block_table=block_table, **gather)


@paged_varlen_attn.register_fake
def _paged_varlen_attn_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                            causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                            varlen_config):
    tq, hq, _ = q.shape
    return q.new_empty(tq, hq, v.shape[-1]), q.new_empty(hq, tq, dtype=torch.float32)


# ------------------------------------------------------------------------------------------- KV cache


def _kvcache_run(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                 cache_seqlens: Optional[Tensor], block_table: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                 cache_leftpad: Optional[Tensor], causal: bool, scale: float, max_total: int, backend: str,
                 kernel: str, config: str, varlen_backend: str, varlen_kernel: str,
                 varlen_config: str) -> tuple[Tensor, Tensor]:
    """Run the plan of a KV-cache call: the KV-cache kernel of ``backend``, handed the varlen forward of
    ``varlen_backend`` when the plan has one (the gather route; empty strings otherwise)."""
    b, nq, hq, _ = q.shape
    if q.numel() == 0 and (k is None or k.numel() == 0):  # nothing to write nor to compute
        return q.new_empty(q.shape), q.new_full((b, hq, nq), float("-inf"), dtype=torch.float32)
    varlen = _varlen_of(varlen_backend, varlen_kernel, varlen_config, causal, scale)
    out, lse = kernel_module(backend).kvcache_forward(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal=causal,
        scale=scale, config=from_config(backend, config), kernel=decode_kernel(kernel), max_total=max_total,
        varlen=varlen)
    return out.contiguous(), lse.contiguous()


def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal,
                  scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel, varlen_config):
    b, nq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(b, hq, nq, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::kvcache_attn", mutates_args=())
def kvcache_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor], block_table: Optional[Tensor],
    cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], causal: bool, scale: float, max_total: int,
    backend: str, kernel: str, config: str, varlen_backend: str, varlen_kernel: str, varlen_config: str,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q [B, Nq, Hq, D]`` over a KV cache (no new tokens): ``(out [B, Nq, Hq, D], lse [B, Hq, Nq])``.

    Lengths and tables are read on the device only (no host sync on the decode route), so the op runs under
    ``torch.compile(fullgraph=True)`` and inside CUDA graphs; the six trailing strings are the planner's
    (:meth:`ffpa_attn.dispatch.planner.KVCachePlan.op_args`). ``max_total``: rows of the packed keys of the gather
    route (0: sized by the kernel module)."""
    return _kvcache_run(q, k_cache, v_cache, None, None, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                        causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                        varlen_config)


@kvcache_attn.register_fake
def _kvcache_attn_fake(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal,
                       scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel, varlen_config):
    return _kvcache_fake(q, k_cache, v_cache, None, None, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                         causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                         varlen_config)


@torch.library.custom_op(f"{_LIB}::kvcache_append_attn", mutates_args=("k_cache", "v_cache"))
def kvcache_append_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor,
    block_table: Optional[Tensor], cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], causal: bool,
    scale: float, max_total: int, backend: str, kernel: str, config: str, varlen_backend: str, varlen_kernel: str,
    varlen_config: str,
) -> tuple[Tensor, Tensor]:
    """:func:`kvcache_attn` after writing ``k / v [B, Nq_new, Hkv, D]`` into the caches in place at
    ``cache_seqlens[b] ..`` (the caches are the op's mutated arguments); attends over ``cache_seqlens + Nq_new``
    keys per sequence. The caller advances its lengths, as with flash-attn."""
    return _kvcache_run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal,
                        scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel, varlen_config)


@kvcache_append_attn.register_fake
def _kvcache_append_attn_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                              causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                              varlen_config):
    return _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                         causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                         varlen_config)


for _name in ("attn", "attn_backward", "varlen_attn", "varlen_attn_backward", "paged_varlen_attn", "kvcache_attn",
              "kvcache_append_attn"):
    register_autocast(f"{_LIB}::{_name}")

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

Eager calls do not go through these ops: :func:`run_attn`, :func:`run_varlen_attn`, :func:`run_attn_backward`,
:func:`run_varlen_attn_backward` and :func:`run_kvcache_attn` (what the public functions call) run the same
implementations directly, inside a ``torch.autograd.Function`` where a backward can follow, under a profiler range
named after the op (``ffpa_attn::attn`` ...). torch's op dispatch costs about 100 us of host time per call
(``torch.library``'s argument handling and autograd wrapper) and its first call imports torch's compiler stack
(``torch._dynamo``, ``sympy``: seconds); torch SDPA pays neither. The ops are what torch.compile / export traces
(dynamo sees :func:`torch.compiler.is_compiling`), and what runs under a torch dispatch mode (fake tensors, flop
counters), a functorch transform or a tensor subclass (:func:`direct`).

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
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .common.lse import empty_result
from .config import from_config
from .contract import SUPPORTED_DTYPES, check_varlen_values
from .dispatch.registry import REGISTRY, kernel_package
from .kernel_module import KernelSpec, decode_kernel

if TYPE_CHECKING:
    from .config import Backend
    from .dispatch.planner import KernelChoice, KVCachePlan, PagedVarlenPlan

_LIB = "ffpa_attn"


_KERNEL_MODULES: dict[str, ModuleType] = {}


def kernel_module(name: str) -> ModuleType:
    """Import the kernel package of backend ``name`` (lazily: only when a call runs on it; then one dict lookup)."""
    mod = _KERNEL_MODULES.get(name)
    if mod is None:
        mod = _KERNEL_MODULES[name] = importlib.import_module(kernel_package(name))
    return mod


def _layout_of(g: Tensor, x: Tensor) -> Tensor:
    """``g`` in the strides ``torch.empty_like(x)`` has (what the fake impls promise); a copy only when a kernel
    returned another layout (e.g. a contiguous dq for a transposed q), because compiled graphs assert the
    fake's strides on the real output."""
    if x.is_contiguous() and g.is_contiguous():  # empty_like keeps a contiguous x's strides: no meta tensor
        return g
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


# ------------------------------------------------------------------------------------------ eager calls


def direct(*tensors: Optional[Tensor]) -> bool:
    """Whether a call with these tensors may run the implementation without the op: not traced (torch.compile,
    export), no torch dispatch mode (fake tensors, flop counters see the op) or functorch transform active, and
    plain tensors (a subclass dispatches through the op)."""
    return (not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) is Tensor for t in tensors))


def _wants_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run(name: str, device_type: str, fn, *args):
    """``fn(*args)`` as the op ``name`` runs: outside an autocast region (the ops' autocast rule) and, while the
    torch profiler records, inside a range named after the op."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return _run_outside_autocast(device_type, fn, args)
    return _run_outside_autocast(device_type, fn, args)


def _run_outside_autocast(device_type: str, fn, args: tuple):
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return fn(*args)
    return fn(*args)


# ---------------------------------------------------------------------------------------------- dense


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                   rng: Optional[Tensor], is_causal: bool, scale: float, backend: str, config: Backend,
                   kernel: KernelSpec) -> tuple[Tensor, Tensor]:
    """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)`` from backend ``backend``'s kernel module, contiguous."""
    if q.numel() == 0 or k.shape[2] == 0:  # empty: kernels never see it
        return empty_result(q, v.shape[-1], (q.shape[0], q.shape[1], q.shape[2]))
    out, lse = kernel_module(backend).dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, rng=rng,
                                                    causal=is_causal, scale=scale, config=config, kernel=kernel)
    return out.contiguous(), lse.contiguous()  # the fake's layout (new_empty)


def _dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                    attn_mask: Optional[Tensor], mask_grad: bool, dropout_p: float, rng: Optional[Tensor],
                    is_causal: bool, scale: float, backend: str, config: Backend,
                    kernel: KernelSpec) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(dq, dk [B, Hkv, Nkv, D], dv, dmask or None)``, each gradient in the layout of its input."""
    if q.numel() == 0 or k.shape[2] == 0:
        dmask = torch.zeros_like(attn_mask) if (mask_grad and attn_mask is not None) else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dmask
    dq, dk, dv, dmask = kernel_module(backend).dense_backward(
        dout, q, k, v, out, lse, dlse=dlse, attn_mask=attn_mask, mask_grad=mask_grad, dropout_p=dropout_p,
        rng=rng, causal=is_causal, scale=scale, config=config, kernel=kernel)
    return _layout_of(dq, q), _layout_of(dk, k), _layout_of(dv, v), None if dmask is None else dmask.contiguous()


class _Attn(torch.autograd.Function):
    """The eager autograd node of a dense call (what ``attn``'s registered autograd formula does, without the op)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p, rng, is_causal, scale, fwd, bwd):
        out, lse = _dense_forward(q, k, v, attn_mask, dropout_p, rng, is_causal, scale, fwd.backend, fwd.config,
                                  fwd.spec)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng)
        ctx.meta = (dropout_p, is_causal, scale, bwd)
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient (dlse None)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels' gradients have no graph: a double backward raises, as through the op
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, rng = ctx.saved_tensors
        dropout_p, is_causal, scale, bwd = ctx.meta
        mask_grad = bool(attn_mask is not None and ctx.needs_input_grad[3])
        dout = torch.zeros_like(out) if dout is None else (dout.contiguous() if dout.stride(-1) != 1 else dout)
        dq, dk, dv, dmask = _run(f"{_LIB}::attn_backward", _device_type(q), _dense_backward, dout, q, k, v, out,
                                 lse, dlse, attn_mask, mask_grad, dropout_p, rng, is_causal, scale, bwd.backend,
                                 bwd.config, bwd.spec)
        return dq, dk, dv, (dmask if mask_grad else None), None, None, None, None, None, None


def run_attn(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
             is_causal: bool, scale: float, fwd: KernelChoice, bwd: KernelChoice) -> tuple[Tensor, Tensor]:
    """A dense call on the planner's choices: ``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)``, differentiable
    (backward on ``bwd``). Eager calls run the implementation directly (:func:`direct`); traced ones the op
    ``torch.ops.ffpa_attn.attn``."""
    if not direct(q, k, v, attn_mask, rng):
        return torch.ops.ffpa_attn.attn(q, k, v, attn_mask, dropout_p, rng, is_causal, scale, *fwd.op_args(),
                                        *bwd.op_args())
    if _wants_grad(q, k, v, attn_mask):
        return _run(f"{_LIB}::attn", _device_type(q), _Attn.apply, q, k, v, attn_mask, dropout_p, rng, is_causal,
                    scale, fwd, bwd)
    return _run(f"{_LIB}::attn", _device_type(q), _dense_forward, q, k, v, attn_mask, dropout_p, rng, is_causal,
                scale, fwd.backend, fwd.config, fwd.spec)


def run_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      dlse: Optional[Tensor], attn_mask: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
                      is_causal: bool, scale: float, bwd: KernelChoice) -> tuple[Tensor, Tensor, Tensor]:
    """The dense backward on the planner's choice from the caller's ``out`` / ``lse``: ``(dq, dk, dv)``. Directly
    when eager and nothing needs its graph (the op has no autograd formula: inputs that require grad take the op)."""
    tensors = (dout, q, k, v, out, lse, dlse, attn_mask, rng)
    if direct(*tensors) and not _wants_grad(*tensors):
        dq, dk, dv, _ = _run(f"{_LIB}::attn_backward", _device_type(q), _dense_backward, dout, q, k, v, out, lse,
                             dlse, attn_mask, False, dropout_p, rng, is_causal, scale, bwd.backend, bwd.config,
                             bwd.spec)
        return dq, dk, dv
    dq, dk, dv, _ = torch.ops.ffpa_attn.attn_backward(dout, q, k, v, out, lse, dlse, attn_mask, False, dropout_p,
                                                      rng, is_causal, scale, *bwd.op_args())
    return dq, dk, dv




@torch.library.custom_op(f"{_LIB}::attn", mutates_args=())
def attn(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, rng: Optional[Tensor],
    is_causal: bool, scale: float, fwd_backend: str, fwd_kernel: str, fwd_config: str, bwd_backend: str,
    bwd_kernel: str, bwd_config: str,
) -> tuple[Tensor, Tensor]:
    del bwd_backend, bwd_kernel, bwd_config  # used by the autograd formula
    return _dense_forward(q, k, v, attn_mask, dropout_p, rng, is_causal, scale, fwd_backend,
                          from_config(fwd_backend, fwd_config), decode_kernel(fwd_kernel))


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
    dq, dk, dv, dmask = _dense_backward(dout, q, k, v, out, lse, dlse, attn_mask, mask_grad, dropout_p, rng,
                                        is_causal, scale, backend, from_config(backend, config), decode_kernel(kernel))
    return dq, dk, dv, q.new_empty(0) if dmask is None else dmask


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



def _varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float,
                    backend: str, config: Backend, kernel: KernelSpec) -> tuple[Tensor, Tensor]:
    """``(out [T_q, Hq, Dv], lse [Hq, T_q] fp32)`` from backend ``backend``'s kernel module."""
    if q.numel() == 0 or k.shape[0] == 0:
        return empty_result(q, v.shape[-1], (q.shape[1], q.shape[0]))
    return kernel_module(backend).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 dropout_p=dropout_p, rng=rng, causal=causal, scale=scale,
                                                 config=config, kernel=kernel)


def _varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float, backend: str,
                     config: Backend, kernel: KernelSpec) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv)``, each gradient in the layout of its input."""
    if q.numel() == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = kernel_module(backend).varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse=dlse,
        dropout_p=dropout_p, rng=rng, causal=causal, scale=scale, config=config, kernel=kernel)
    return _layout_of(dq, q), _layout_of(dk, k), _layout_of(dv, v)


class _VarlenAttn(torch.autograd.Function):
    """The eager autograd node of a varlen call (``varlen_attn``'s autograd formula, without the op)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, rng, causal, scale, fwd, bwd):
        out, lse = _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, rng, causal, scale, fwd.backend,
                                   fwd.config, fwd.spec)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)
        ctx.meta = (max_q, max_k, dropout_p, causal, scale, bwd)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels' gradients have no graph: a double backward raises, as through the op
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
        max_q, max_k, dropout_p, causal, scale, bwd = ctx.meta
        dout = torch.zeros_like(out) if dout is None else (dout.contiguous() if dout.stride(-1) != 1 else dout)
        dq, dk, dv = _run(f"{_LIB}::varlen_attn_backward", _device_type(q), _varlen_backward, dout, q, k, v, out, lse,
                          dlse, cu_q, cu_k, max_q, max_k, dropout_p, rng, causal, scale, bwd.backend, bwd.config,
                          bwd.spec)
        return (dq, dk, dv) + (None,) * 10


def run_varlen_attn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float,
                    fwd: KernelChoice, bwd: KernelChoice) -> tuple[Tensor, Tensor]:
    """A varlen call on the planner's choices: ``(out [T_q, Hq, Dv], lse [Hq, T_q] fp32)``, differentiable
    (backward on ``bwd``); directly when eager (:func:`direct`), else the op ``torch.ops.ffpa_attn.varlen_attn``."""
    if not direct(q, k, v, cu_seqlens_q, cu_seqlens_k, rng):
        return torch.ops.ffpa_attn.varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               dropout_p, rng, causal, scale, *fwd.op_args(), *bwd.op_args())
    if _wants_grad(q, k, v):
        return _run(f"{_LIB}::varlen_attn", _device_type(q), _VarlenAttn.apply, q, k, v, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k, dropout_p, rng, causal, scale, fwd, bwd)
    return _run(f"{_LIB}::varlen_attn", _device_type(q), _varlen_forward, q, k, v, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, dropout_p, rng, causal, scale, fwd.backend, fwd.config, fwd.spec)


def run_varlen_attn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                             max_seqlen_k: int, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float,
                             bwd: KernelChoice) -> tuple[Tensor, Tensor, Tensor]:
    """The varlen backward on the planner's choice from the caller's ``out`` / ``lse``: ``(dq, dk, dv)``; directly
    as :func:`run_attn_backward` decides."""
    tensors = (dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, rng)
    if direct(*tensors) and not _wants_grad(*tensors):
        return _run(f"{_LIB}::varlen_attn_backward", _device_type(q), _varlen_backward, dout, q, k, v, out, lse, dlse,
                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, rng, causal, scale,
                    bwd.backend, bwd.config, bwd.spec)
    return torch.ops.ffpa_attn.varlen_attn_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, dropout_p, rng, causal, scale,
                                                    *bwd.op_args())


@torch.library.custom_op(f"{_LIB}::varlen_attn", mutates_args=())
def varlen_attn(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float, fwd_backend: str,
    fwd_kernel: str, fwd_config: str, bwd_backend: str, bwd_kernel: str, bwd_config: str,
) -> tuple[Tensor, Tensor]:
    del bwd_backend, bwd_kernel, bwd_config
    return _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, rng, causal,
                           scale, fwd_backend, from_config(fwd_backend, fwd_config), decode_kernel(fwd_kernel))


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
    return _varlen_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, rng, causal, scale, backend, from_config(backend, config),
                            decode_kernel(kernel))


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


def _varlen_fn(backend: str, cfg: Backend, spec: KernelSpec, causal: bool, scale: float):
    """The varlen forward of a plan's second choice (backend, its config, its kernel) as a callable ``(q, k, v, cu_q,
    cu_k, max_q, max_k, **paged)`` (paged: ``seqused_k``, ``block_table``)."""
    mod = kernel_module(backend)

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
    gather = None if not varlen_backend else (varlen_backend, from_config(varlen_backend, varlen_config),
                                              decode_kernel(varlen_kernel))
    return _paged_varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k,
                             causal, scale, max_total, backend, from_config(backend, config), decode_kernel(kernel),
                             gather)


def _paged_varlen_run(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
                      seqused_k: Tensor, block_table: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool, scale: float, max_total: int, backend: str, config: Backend, kernel: KernelSpec,
                      varlen_choice: Optional[tuple[str, Backend, KernelSpec]]) -> tuple[Tensor, Tensor]:
    """The body of :func:`paged_varlen_attn` on decoded choices (``varlen_choice``: the gather route's varlen
    forward, backend / config / kernel, else None), which eager calls run without the op."""
    if q.numel() == 0:
        return empty_result(q, v.shape[-1], (q.shape[1], q.shape[0]))
    gather = {} if varlen_choice is None else {"varlen": _varlen_fn(*varlen_choice, causal, scale),
                                               "max_total": max_total}
    return kernel_module(backend).varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 dropout_p=0.0, rng=None, causal=causal, scale=scale, config=config,
                                                 kernel=kernel, seqused_k=seqused_k, block_table=block_table,
                                                 **gather)


def run_paged_varlen_attn(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
                          seqused_k: Tensor, block_table: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                          causal: bool, scale: float, max_total: int, plan: PagedVarlenPlan) -> tuple[Tensor, Tensor]:
    """The paged varlen forward on the planner's plan (arguments of :func:`paged_varlen_attn`): directly when eager
    (:func:`direct`), else the op ``torch.ops.ffpa_attn.paged_varlen_attn``."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q, max_seqlen_k, causal, scale,
            max_total)
    if direct(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table):
        fwd, vl = plan.forward, plan.varlen
        return _run(f"{_LIB}::paged_varlen_attn", _device_type(q), _paged_varlen_run, *args, fwd.backend, fwd.config,
                    fwd.spec, None if vl is None else (vl.backend, vl.config, vl.spec))
    return torch.ops.ffpa_attn.paged_varlen_attn(*args, *plan.op_args())


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
                 config: Backend, kernel: KernelSpec,
                 varlen_choice: Optional[tuple[str, Backend, KernelSpec]]) -> tuple[Tensor, Tensor]:
    """Run the plan of a KV-cache call: the KV-cache kernel of ``backend``, handed the varlen forward
    ``varlen_choice`` (backend, config, kernel) when the plan has one (the gather route; None otherwise)."""
    b, nq, hq, _ = q.shape
    if q.numel() == 0 and (k is None or k.numel() == 0):  # nothing to write nor to compute
        return q.new_empty(q.shape), q.new_full((b, hq, nq), float("-inf"), dtype=torch.float32)
    varlen = None if varlen_choice is None else _varlen_fn(*varlen_choice, causal, scale)
    out, lse = kernel_module(backend).kvcache_forward(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal=causal,
        scale=scale, config=config, kernel=kernel, max_total=max_total, varlen=varlen)
    return out.contiguous(), lse.contiguous()


def _kvcache_op_run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal,
                    scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel, varlen_config):
    """:func:`_kvcache_run` from the ops' strings (``varlen_backend`` empty: no varlen forward)."""
    varlen = (varlen_backend, from_config(varlen_backend, varlen_config), decode_kernel(varlen_kernel)) \
        if varlen_backend else None
    return _kvcache_run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, causal,
                        scale, max_total, backend, from_config(backend, config), decode_kernel(kernel), varlen)


def run_kvcache_attn(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                     cache_seqlens: Tensor, block_table: Optional[Tensor], cache_batch_idx: Optional[Tensor],
                     cache_leftpad: Optional[Tensor], causal: bool, scale: float, max_total: int,
                     plan: KVCachePlan) -> tuple[Tensor, Tensor]:
    """A KV-cache call on the planner's plan: ``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``, appending ``k / v``
    first when given. Directly when eager and no input requires grad (the ops have no autograd formula), else the
    op ``kvcache_attn`` / ``kvcache_append_attn``."""
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad)
    if direct(*tensors) and not _wants_grad(*tensors):
        kv, vl = plan.kvcache, plan.varlen
        name = f"{_LIB}::kvcache_attn" if k is None else f"{_LIB}::kvcache_append_attn"
        result = _run(name, _device_type(q), _kvcache_run, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                      cache_batch_idx, cache_leftpad, causal, scale, max_total, kv.backend, kv.config, kv.spec,
                      None if vl is None else (vl.backend, vl.config, vl.spec))
        if k is not None:  # what the op does for its mutated arguments
            torch.autograd.graph.increment_version(k_cache)
            torch.autograd.graph.increment_version(v_cache)
        return result
    if k is None:
        return torch.ops.ffpa_attn.kvcache_attn(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx,
                                                cache_leftpad, causal, scale, max_total, *plan.op_args())
    return torch.ops.ffpa_attn.kvcache_append_attn(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                   cache_batch_idx, cache_leftpad, causal, scale, max_total,
                                                   *plan.op_args())


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
    return _kvcache_op_run(q, k_cache, v_cache, None, None, cache_seqlens, block_table, cache_batch_idx,
                           cache_leftpad, causal, scale, max_total, backend, kernel, config, varlen_backend,
                           varlen_kernel, varlen_config)


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
    return _kvcache_op_run(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                           causal, scale, max_total, backend, kernel, config, varlen_backend, varlen_kernel,
                           varlen_config)


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

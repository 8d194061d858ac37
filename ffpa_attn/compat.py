"""Compatibility entry points: the low-level names and op schemas of the public ffpa-attn 0.2.x package.

Callers written against that package's low-level surface (NeMo Automodel's ``attn_implementation="ffpa"``
binding and its context-parallel ring) probe and call these names; with this module they run our kernels
unchanged. They are not the recommended API: new code should call :func:`ffpa_attn.ffpa_attn_fwd` /
:func:`ffpa_attn.ffpa_attn_bwd` / :func:`ffpa_attn.ffpa_attn_varlen_fwd` /
:func:`ffpa_attn.ffpa_attn_varlen_bwd`, which every entry point here wraps.

Torch ops (registered when :mod:`ffpa_attn` is imported; argument order and types as the public package):

* ``_fwd_cute(Tensor q, Tensor k, Tensor v, float softmax_scale, int causal, int return_lse)
  -> (Tensor o, Tensor lse)``: flash layout q ``[B, Nq, Hq, D]``, k/v ``[B, Nkv, Hkv, D]``; o
  ``[B, Nq, Hq, Dv]``, lse ``[B, Hq, Nq]`` fp32 (shape ``[0]`` when ``return_lse == 0``). Differentiable.
* ``_bwd_cute(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale,
  int causal, int grad_kv_storage_dtype_code) -> (Tensor dq, Tensor dk, Tensor dv)``: flash layout, from
  the caller's out/lse (e.g. merged over ring steps); dk/dv have Hkv heads.
* ``_varlen_fwd_cute(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, int window_size_left,
  int window_size_right, float softcap, bool pack_gqa) -> (Tensor out, Tensor lse)``: packed q ``[T_q, Hq, D]``,
  k/v ``[T_k, Hkv, D]``; out ``[T_q, Hq, Dv]``, lse ``[Hq, T_q]`` fp32. Differentiable (through out and lse).
* ``_varlen_bwd_cute(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor cu_seqlens_q,
  Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal,
  int window_size_left, int window_size_right, float softcap, Tensor? dlse) -> (Tensor dq, Tensor dk, Tensor dv)``.

Python functions in SDPA layout (also reachable as ``ffpa_attn.cute.<name>``, the public package's module): :func:`_ffpa_attn_forward_cute`
and :func:`_ffpa_attn_backward_cute`.

Semantics are ours, not a second implementation: the backend is whatever the planner picks for the call
(CuTeDSL on sm90, Triton elsewhere and on CPU under the Triton interpreter, SDPA outside the FFPA range),
despite the ``cute`` in the names; GQA/MQA is always allowed; causal is tail-aligned; rows that see no key
give out = 0 and lse = -inf. Options we do not implement raise NotImplementedError naming the argument: a
sliding window (a window side other than the ``WINDOW_NONE`` sentinel or a negative value), a nonzero
``softcap``, a nonzero ``grad_kv_storage_dtype_code``. ``pack_gqa`` is a layout hint and is ignored.

Autocast: inside an active fp16/bf16 ``torch.autocast`` region each op casts its q/k/v/out/dout inputs of another
dtype to the region's dtype (as torch SDPA's inputs are cast; lse/dlse stay fp32) and runs with autocast off.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .contract import no_window
from .interface import ffpa_attn_bwd, ffpa_attn_fwd, ffpa_attn_varlen_bwd, ffpa_attn_varlen_fwd
from .ops import register_autocast

__all__ = ["WINDOW_NONE", "_ffpa_attn_forward_cute", "_ffpa_attn_backward_cute"]

WINDOW_NONE = -(2**31)
"""The "no window side" sentinel of the varlen ops' integer window arguments (the public package's)."""

_NS = "ffpa_attn"


def _check_options(window_size_left: int, window_size_right: int, softcap: float) -> None:
    window = tuple(None if side == WINDOW_NONE else side for side in (window_size_left, window_size_right))
    if not no_window(window):
        raise NotImplementedError(f"window_size={window!r} (sliding-window attention) is not supported")
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap!r} is not supported")


def _to_bhnd(t: Tensor) -> Tensor:
    """Flash layout ``[B, N, H, D]`` -> SDPA layout ``[B, H, N, D]`` (a view: our entry points take strides)."""
    return t.transpose(1, 2)


def _to_bnhd(t: Tensor) -> Tensor:
    """SDPA layout -> contiguous flash layout (op outputs are fresh, contiguous tensors)."""
    return t.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------- dense

torch.library.define(
    f"{_NS}::_fwd_cute",
    "(Tensor q, Tensor k, Tensor v, float softmax_scale, int causal, int return_lse) -> (Tensor o, Tensor lse)",
)
torch.library.define(
    f"{_NS}::_bwd_cute",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, int causal, "
    "int grad_kv_storage_dtype_code) -> (Tensor dq, Tensor dk, Tensor dv)",
)
register_autocast(f"{_NS}::_fwd_cute", cast=(0, 1, 2))  # q, k, v
register_autocast(f"{_NS}::_bwd_cute", cast=(0, 1, 2, 3, 4))  # dout, q, k, v, out (not lse)


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """Flash-layout forward: ``(o [B, Nq, Hq, Dv], lse [B, Hq, Nq])`` on the planner's backend."""
    out, lse = ffpa_attn_fwd(_to_bhnd(q), _to_bhnd(k), _to_bhnd(v), causal=causal, scale=softmax_scale,
                             enable_gqa=True)
    return _to_bnhd(out), lse.contiguous()


def _dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    softmax_scale: float, causal: bool, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Flash-layout backward from the caller's out/lse (and optional dlse)."""
    dq, dk, dv = ffpa_attn_bwd(_to_bhnd(dout), _to_bhnd(q), _to_bhnd(k), _to_bhnd(v), _to_bhnd(out), lse,
                               causal=causal, scale=softmax_scale, enable_gqa=True, dlse=dlse)
    return _to_bnhd(dq), _to_bnhd(dk), _to_bnhd(dv)


@torch.library.impl(f"{_NS}::_fwd_cute", "CompositeExplicitAutograd")
def _fwd_cute(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: int,
              return_lse: int) -> tuple[Tensor, Tensor]:
    out, lse = _dense_forward(q, k, v, softmax_scale, bool(causal))
    return out, (lse if return_lse else lse.new_empty(0))


@torch.library.register_fake(f"{_NS}::_fwd_cute")
def _fwd_cute_fake(q, k, v, softmax_scale, causal, return_lse):
    b, nq, hq, _ = q.shape
    lse_shape = (b, hq, nq) if return_lse else (0,)
    return q.new_empty(b, nq, hq, v.shape[-1]), q.new_empty(lse_shape, dtype=torch.float32)


def _fwd_cute_setup(ctx, inputs, output):
    q, k, v, softmax_scale, causal, return_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.meta = (softmax_scale, bool(causal))
    ctx.set_materialize_grads(False)


def _fwd_cute_grad(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    softmax_scale, causal = ctx.meta
    if lse.numel() == 0:  # return_lse=0: the lse output is empty, nothing flows through it
        dlse = None
    if dout is None and dlse is None:
        return None, None, None, None, None, None
    if lse.numel() == 0:  # and the backward needs the real lse: recompute it
        _, lse = _dense_forward(q, k, v, softmax_scale, causal)
    dq, dk, dv = _dense_backward(torch.zeros_like(out) if dout is None else dout, q, k, v, out, lse,
                                 softmax_scale, causal, dlse)
    return dq, dk, dv, None, None, None


torch.library.register_autograd(f"{_NS}::_fwd_cute", _fwd_cute_grad, setup_context=_fwd_cute_setup)


@torch.library.impl(f"{_NS}::_bwd_cute", "CompositeExplicitAutograd")
def _bwd_cute(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
              causal: int, grad_kv_storage_dtype_code: int) -> tuple[Tensor, Tensor, Tensor]:
    if grad_kv_storage_dtype_code != 0:
        # our kernels accumulate dK/dV in fp32 and round once: a storage-dtype override has nothing to change
        raise NotImplementedError(
            f"grad_kv_storage_dtype_code={grad_kv_storage_dtype_code} is not supported (only 0: k/v's dtype)")
    return _dense_backward(dout, q, k, v, out, lse, softmax_scale, bool(causal), None)


@torch.library.register_fake(f"{_NS}::_bwd_cute")
def _bwd_cute_fake(dout, q, k, v, out, lse, softmax_scale, causal, grad_kv_storage_dtype_code):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ffpa_attn_forward_cute(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, *,
                            return_lse: bool = True) -> tuple[Tensor, Tensor]:
    """Dense forward in SDPA layout through ``torch.ops.ffpa_attn._fwd_cute`` (compatibility entry point).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]`` (Hq a multiple of Hkv), fp16/bf16.
        softmax_scale: the softmax scale; causal: tail-aligned causal mask.
        return_lse: False gives lse of shape ``[0]``.
    Returns:
        ``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)``; rows that see no key: out 0, lse -inf.
    """
    out, lse = torch.ops.ffpa_attn._fwd_cute(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             float(softmax_scale), int(causal), int(return_lse))
    return out.transpose(1, 2), lse


def _ffpa_attn_backward_cute(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             softmax_scale: float, causal: bool, *,
                             grad_kv_storage_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Dense backward in SDPA layout from the caller's out/lse, through ``torch.ops.ffpa_attn._bwd_cute``
    (compatibility entry point).

    Args:
        grad_out, out: ``[B, Hq, Nq, Dv]``; q ``[B, Hq, Nq, D]``; k, v ``[B, Hkv, Nkv, D]``;
        lse: ``[B, Hq, Nq]`` fp32 (e.g. merged over ring steps).
        grad_kv_storage_dtype: only None (dK/dV in k/v's dtype); anything else raises NotImplementedError.
    Returns:
        ``(dq [B, Hq, Nq, D], dk [B, Hkv, Nkv, D], dv [B, Hkv, Nkv, Dv])``.
    """
    if grad_kv_storage_dtype is not None:
        raise NotImplementedError(f"grad_kv_storage_dtype={grad_kv_storage_dtype} is not supported")
    dq, dk, dv = torch.ops.ffpa_attn._bwd_cute(
        grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        lse, float(softmax_scale), int(causal), 0)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------------------------------------- varlen

torch.library.define(
    f"{_NS}::_varlen_fwd_cute",
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, float softmax_scale, bool causal, int window_size_left, int window_size_right, "
    "float softcap, bool pack_gqa) -> (Tensor out, Tensor lse)",
)
torch.library.define(
    f"{_NS}::_varlen_bwd_cute",
    "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
    "int window_size_left, int window_size_right, float softcap, Tensor? dlse) -> (Tensor dq, Tensor dk, Tensor dv)",
)
register_autocast(f"{_NS}::_varlen_fwd_cute", cast=(0, 1, 2))  # q, k, v
register_autocast(f"{_NS}::_varlen_bwd_cute", cast=(0, 1, 2, 3, 4))  # q, k, v, out, dout (not lse, dlse)


@torch.library.impl(f"{_NS}::_varlen_fwd_cute", "CompositeExplicitAutograd")
def _varlen_fwd_cute(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                     window_size_left: int, window_size_right: int, softcap: float,
                     pack_gqa: bool) -> tuple[Tensor, Tensor]:
    del pack_gqa  # a layout hint of the public package's kernels; the planner decides here
    _check_options(window_size_left, window_size_right, softcap)
    out, lse = ffpa_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal=causal, softmax_scale=softmax_scale, enable_gqa=True)
    return out.contiguous(), lse.contiguous()


@torch.library.register_fake(f"{_NS}::_varlen_fwd_cute")
def _varlen_fwd_cute_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          window_size_left, window_size_right, softcap, pack_gqa):
    _check_options(window_size_left, window_size_right, softcap)
    tq, hq, _ = q.shape
    return q.new_empty(tq, hq, v.shape[-1]), q.new_empty(hq, tq, dtype=torch.float32)


def _varlen_fwd_cute_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, win_l, win_r, softcap, _pack_gqa = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.meta = (max_q, max_k, softmax_scale, causal, win_l, win_r, softcap)
    ctx.set_materialize_grads(False)


def _varlen_fwd_cute_grad(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, softmax_scale, causal, win_l, win_r, softcap = ctx.meta
    if dout is None and dlse is None:
        return (None,) * 13
    dq, dk, dv = torch.ops.ffpa_attn._varlen_bwd_cute(
        q, k, v, out, torch.zeros_like(out) if dout is None else dout, lse, cu_q, cu_k, max_q, max_k,
        softmax_scale, causal, win_l, win_r, softcap, dlse)
    return (dq, dk, dv) + (None,) * 10


torch.library.register_autograd(f"{_NS}::_varlen_fwd_cute", _varlen_fwd_cute_grad,
                                setup_context=_varlen_fwd_cute_setup)


@torch.library.impl(f"{_NS}::_varlen_bwd_cute", "CompositeExplicitAutograd")
def _varlen_bwd_cute(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor,
                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                     softcap: float, dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    _check_options(window_size_left, window_size_right, softcap)
    return ffpa_attn_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, causal=causal, softmax_scale=softmax_scale, enable_gqa=True,
                                dlse=dlse)


@torch.library.register_fake(f"{_NS}::_varlen_bwd_cute")
def _varlen_bwd_cute_fake(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_size_left, window_size_right, softcap, dlse):
    _check_options(window_size_left, window_size_right, softcap)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

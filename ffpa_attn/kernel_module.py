"""The kernel-module protocol: the functions every backend's kernel module offers to :mod:`ffpa_attn.ops`.

Modules: ``ffpa_attn.sdpa``, ``ffpa_attn.triton``, ``ffpa_attn.cuda``, ``ffpa_attn.cute``
(:data:`ffpa_attn.dispatch.capabilities.KERNEL_MODULES`). They are called only by :mod:`ffpa_attn.ops`, on
inputs validated by :mod:`ffpa_attn.contract`, after the planner chose the backend; a module raises
NotImplementedError for a call its backend cannot run (the planner never sends one).

Shapes: dense q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``, out like q, lse ``[B, Hq, Nq]`` fp32; varlen
q ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]``, lse ``[Hq, T_q]`` fp32. dk/dv come back reduced to Hkv. ``dlse``
(optional, like lse) is the gradient reaching lse: the backward uses ``delta = rowsum(dO * O) - dlse``
(:func:`ffpa_attn.common.delta.backward_delta`). lse is the natural log of the scaled scores' sum, -inf for
rows that see no key (their out is 0). ``rng`` is an int64 ``[2]`` (seed, offset) tensor when dropout_p > 0.
``config`` is the backend's (frozen) config object (:mod:`ffpa_attn.config`).
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from torch import Tensor

from .config import Backend


@runtime_checkable
class KernelModule(Protocol):
    """What a kernel module provides (``prepare_backward`` is optional: :class:`PreparesBackward`)."""

    def dense_forward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor], dropout_p: float,
                      rng: Optional[Tensor], causal: bool, scale: float, config: Backend) -> tuple[Tensor, Tensor]:
        """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)``."""
        ...

    def dense_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       dlse: Optional[Tensor], attn_mask: Optional[Tensor], mask_grad: bool, dropout_p: float,
                       rng: Optional[Tensor], causal: bool, scale: float,
                       config: Backend) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(dq, dk [B, Hkv, Nkv, D], dv, dmask or None)``; dmask (the mask's shape) only when ``mask_grad``."""
        ...

    def varlen_forward(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                       *, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float,
                       config: Backend) -> tuple[Tensor, Tensor]:
        """``(out [T_q, Hq, Dv], lse [Hq, T_q] fp32)``; ``cu_*`` int32 cumulative sequence starts."""
        ...

    def varlen_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                        cu_k: Tensor, max_q: int, max_k: int, *, dlse: Optional[Tensor], dropout_p: float,
                        rng: Optional[Tensor], causal: bool, scale: float,
                        config: Backend) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk [T_k, Hkv, D], dv)``."""
        ...


@runtime_checkable
class PreparesBackward(Protocol):
    """The optional hook: called (through :func:`ffpa_attn.ops.prepare_backward`) before a dense or varlen forward
    (varlen: q ``[T_q, Hq, D]``, attn_mask None) whose backward will run on this backend, to start work the
    backward's first call would otherwise wait for (the CuTeDSL module starts compiling its backward kernels)."""

    def prepare_backward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor], dropout_p: float,
                         causal: bool) -> None:
        ...


REQUIRED = ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward")
OPTIONAL = ("prepare_backward",)

__all__ = ["KernelModule", "PreparesBackward", "REQUIRED", "OPTIONAL"]

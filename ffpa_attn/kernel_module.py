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
``config`` is the backend's (frozen) config object (:mod:`ffpa_attn.config`). ``kernel`` is the kernel the
planner chose for this direction (:class:`ffpa_attn.dispatch.planner.Choice`, what ``explain()`` reports): the
module runs exactly that kernel and decides nothing itself; a name it does not have raises ValueError
(:func:`check_kernel`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the CuTeDSL package imports check_kernel in its torch-free compile server
    from torch import Tensor

    from .config import Backend


@runtime_checkable
class KernelModule(Protocol):
    """What a kernel module provides (``prepare_backward`` is optional: :class:`PreparesBackward`)."""

    def dense_forward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor], dropout_p: float,
                      rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                      kernel: str) -> tuple[Tensor, Tensor]:
        """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)``."""
        ...

    def dense_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       dlse: Optional[Tensor], attn_mask: Optional[Tensor], mask_grad: bool, dropout_p: float,
                       rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                       kernel: str) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(dq, dk [B, Hkv, Nkv, D], dv, dmask or None)``; dmask (the mask's shape) only when ``mask_grad``."""
        ...

    def varlen_forward(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                       *, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                       kernel: str) -> tuple[Tensor, Tensor]:
        """``(out [T_q, Hq, Dv], lse [Hq, T_q] fp32)``; ``cu_*`` int32 cumulative sequence starts."""
        ...

    def varlen_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                        cu_k: Tensor, max_q: int, max_k: int, *, dlse: Optional[Tensor], dropout_p: float,
                        rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                        kernel: str) -> tuple[Tensor, Tensor, Tensor]:
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


def check_kernel(backend: str, entry: str, kernel: str, known: Iterable[str]) -> None:
    """ValueError unless ``kernel`` is one of the ``known`` kernels that ``entry`` of ``backend``'s kernel module runs
    (a kernel name from a planner that does not match this module, never a silent substitute)."""
    known = tuple(known)
    if kernel not in known:
        raise ValueError(f"kernel: the {backend} kernel module's {entry} has no kernel {kernel!r} "
                         f"(it runs {', '.join(map(repr, known))})")


REQUIRED = ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward")
OPTIONAL = ("prepare_backward",)

__all__ = ["KernelModule", "PreparesBackward", "REQUIRED", "OPTIONAL", "check_kernel"]

"""One ring step's attention, through the package's low-level entry points (any backend).

A runner knows the tensor layout (dense ``[B, H, N, D]`` or packed ``[T, H, D]``) and turns a
:class:`~ffpa_attn.distributed.schedule.Step` into one forward call (``ffpa_attn_fwd`` /
``ffpa_attn_varlen_fwd``) or one backward call (``ffpa_attn_bwd`` / ``ffpa_attn_varlen_bwd``) on the
selected rows. The ring loop (:mod:`ffpa_attn.distributed.ring`) is the same for both layouts.

Dims: ``q_dim`` is the sequence dim of q / out / dout / dq and of k / v; ``lse_dim`` that of lse. The
loop merges outputs in a "merge view" of out whose sequence dim is ``lse_dim`` (``[B, H, N, D]`` as is;
``[T, H, D]`` seen as ``[H, T, D]``), so out and lse rows line up for :func:`ffpa_attn.common.lse.merge_partials`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..interface import ffpa_attn_bwd, ffpa_attn_fwd, ffpa_attn_varlen_bwd, ffpa_attn_varlen_fwd
from .schedule import Sel, Step


def take(x: torch.Tensor, sel: Sel, dim: int) -> torch.Tensor:
    """Rows ``sel`` of ``x`` along ``dim`` (a view for None / slices, a copy for index tensors)."""
    if sel is None:
        return x
    if isinstance(sel, slice):
        return x.narrow(dim, sel.start, sel.stop - sel.start)
    return x.index_select(dim, sel)


def add_rows_(acc: torch.Tensor, sel: Sel, dim: int, val: torch.Tensor) -> None:
    """``acc[rows sel along dim] += val`` in place."""
    if sel is None:
        acc.add_(val)
    elif isinstance(sel, slice):
        acc.narrow(dim, sel.start, sel.stop - sel.start).add_(val)
    else:
        acc.index_add_(dim, sel, val)


def put_rows_(acc: torch.Tensor, sel: Sel, dim: int, val: torch.Tensor) -> None:
    """``acc[rows sel along dim] = val`` in place."""
    if sel is None:
        acc.copy_(val)
    elif isinstance(sel, slice):
        acc.narrow(dim, sel.start, sel.stop - sel.start).copy_(val)
    else:
        acc.index_copy_(dim, sel, val)


def _rows(lse: torch.Tensor | None, sel: Sel, dim: int) -> torch.Tensor | None:
    """Contiguous rows of an lse-shaped tensor (kernels index lse densely); None stays None."""
    return None if lse is None else take(lse, sel, dim).contiguous()


@dataclass
class DenseRunner:
    """Steps on dense shards q ``[B, Hq, N, D]``, k/v ``[B, Hkv, Nkv, D]``, lse ``[B, Hq, N]``."""

    steps: list[Step]
    scale: float
    enable_gqa: bool
    backend_kwargs: dict = field(default_factory=dict)
    q_dim: int = 2
    lse_dim: int = 2

    @staticmethod
    def merge_view(out: torch.Tensor) -> torch.Tensor:
        return out

    @staticmethod
    def lse_shape(q: torch.Tensor) -> tuple[int, ...]:
        return tuple(q.shape[:-1])

    def forward(self, step: Step, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, n_sel, D], lse [B, Hq, n_sel])`` of the step's selected rows."""
        return ffpa_attn_fwd(take(q, step.q_sel, 2), take(k, step.kv_sel, 2), take(v, step.kv_sel, 2),
                             causal=step.causal, scale=self.scale, enable_gqa=self.enable_gqa,
                             **self.backend_kwargs)

    def backward(self, step: Step, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor,
                 dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of the selected rows, from the globally merged ``out`` / ``lse``."""
        qs, ks = step.q_sel, step.kv_sel
        return ffpa_attn_bwd(take(dout, qs, 2), take(q, qs, 2), take(k, ks, 2), take(v, ks, 2), take(out, qs, 2),
                             _rows(lse, qs, 2), causal=step.causal, scale=self.scale, enable_gqa=self.enable_gqa,
                             dlse=_rows(dlse, qs, 2), **self.backend_kwargs)


@dataclass
class VarlenRunner:
    """Steps on packed shards q ``[T, Hq, D]``, k/v ``[T_k, Hkv, D]``, lse ``[Hq, T]``."""

    steps: list[Step]
    scale: float
    enable_gqa: bool
    backend_kwargs: dict = field(default_factory=dict)
    q_dim: int = 0
    lse_dim: int = 1

    @staticmethod
    def merge_view(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(0, 1)

    @staticmethod
    def lse_shape(q: torch.Tensor) -> tuple[int, ...]:
        return (q.shape[1], q.shape[0])

    def forward(self, step: Step, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [t_sel, Hq, D], lse [Hq, t_sel])`` of the step's selected rows."""
        return ffpa_attn_varlen_fwd(take(q, step.q_sel, 0), take(k, step.kv_sel, 0), take(v, step.kv_sel, 0),
                                    step.cu_q, step.cu_k, step.max_q, step.max_k, causal=step.causal,
                                    softmax_scale=self.scale, enable_gqa=self.enable_gqa, **self.backend_kwargs)

    def backward(self, step: Step, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor,
                 dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of the selected rows, from the globally merged ``out`` / ``lse``."""
        qs, ks = step.q_sel, step.kv_sel
        return ffpa_attn_varlen_bwd(
            take(dout, qs, 0), take(q, qs, 0), take(k, ks, 0), take(v, ks, 0), take(out, qs, 0), _rows(lse, qs, 1),
            step.cu_q, step.cu_k, step.max_q, step.max_k, causal=step.causal, softmax_scale=self.scale,
            enable_gqa=self.enable_gqa, dlse=_rows(dlse, qs, 1), **self.backend_kwargs)

"""The CUDA backend's kernel module: a hand-written split-D forward (mma.sync, cp.async, ldmatrix).

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`) for the dense forward only; the backends
planner routes every backward (and varlen, KV cache, masks, dropout) elsewhere, so the other entry points raise
NotImplementedError. The kernel source (``csrc/ffpa_fwd.cu``) is compiled at first use for the running
GPU's arch (NVRTC, or nvcc) and cached on disk (:mod:`.build`); :mod:`.launch` runs it on torch's current
stream. Importing this package touches neither the CUDA driver nor a compiler.
"""
from __future__ import annotations

import torch

from ..common.tail_split import TailSplit
from ..config import CUDABackend
from ..kernel_module import check_kernel, load_spec

SPEC = load_spec(__name__)  # this backend's description (backend.json)

__all__ = ["dense_forward", "dense_backward", "varlen_forward", "varlen_backward", "kvcache_forward"]


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads rows with unit stride on D; any other strides are fine as they are."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask, dropout_p, rng, causal: bool,
                  scale: float, config, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense forward (kernel ``"fwd"``): q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` -> ``(out [B, Hq, Nq, D],
    lse [B, Hq, Nq])``. The kernel spec's ``rows_per_warp`` and ``tail`` (the last-wave split) are the planner's.

    lse is fp32, natural log of the scaled scores, -inf for rows that see no key (their out is 0).
    """
    del rng
    kernel = check_kernel(SPEC, "dense_forward", kernel)
    if attn_mask is not None:
        raise NotImplementedError("the CUDA backend takes no attn_mask")
    if dropout_p > 0:
        raise NotImplementedError("the CUDA backend has no dropout")
    cfg = config if isinstance(config, CUDABackend) else CUDABackend()
    from . import launch  # lazy: only a real call needs torch.cuda / the driver

    tail = kernel.get("tail")
    return launch.forward(_unit_last(q), _unit_last(k), _unit_last(v), causal=bool(causal), scale=float(scale),
                          acc=cfg.acc, stages=cfg.stages, rows_per_warp=kernel.get("rows_per_warp"),
                          tail=TailSplit(*tail) if tail else None)


def _forward_only(what: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"the CUDA backend is forward-only (dense): no {what}; the planner "
                                  "routes it to another backend")

    fn.__name__ = what
    fn.__doc__ = f"Not implemented: the CUDA backend has no {what}."
    return fn


dense_backward = _forward_only("dense_backward")
varlen_forward = _forward_only("varlen_forward")
varlen_backward = _forward_only("varlen_backward")
kvcache_forward = _forward_only("kvcache_forward")

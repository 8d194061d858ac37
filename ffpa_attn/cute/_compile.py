"""Compile the CuTeDSL kernels once per configuration, on symbolic shapes (imports cutlass).

Kernels are compiled on fake tensors whose batch, head counts, sequence lengths and strides are
runtime values, so one compiled kernel serves every shape of a configuration (:class:`FwdConfig`:
D, dtype, causal, tiles). ``CUTE_DSL_ARCH`` (default ``sm_90a`` here) selects the target, which lets a
CPU-only machine compile and inspect the kernels (``compile_fwd(cfg).artifacts.PTX``).
"""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402
from cutlass.runtime import make_fake_stream  # noqa: E402

from .config import FwdConfig  # noqa: E402
from .fwd_sm90 import FlashFwdSm90SplitD, _dtype  # noqa: E402


def _fake_bhnd(dtype, d: int):
    """A [B, H, N, D] tensor with runtime sizes/strides, unit stride on D, 16-byte aligned rows."""
    b, h, n, dd = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    strides = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 1)
    return make_fake_tensor(dtype, (b, h, n, dd), strides, assumed_align=16)


def compile_fwd(cfg: FwdConfig, keep_artifacts: bool = False):
    """``cute.compile`` the forward kernel of ``cfg``; returns the JIT-compiled function.

    The compiled function takes ``(q, k, v, o, lse, scale_log2, group, stream)`` with q/k/v/o as cute
    tensors ``[B, H, N, D]`` and lse ``[B, Hq, Nq]`` fp32. ``keep_artifacts`` keeps PTX and CUBIN
    (``.artifacts.PTX`` / ``.artifacts.CUBIN``) for inspection.
    """
    dt = _dtype(cfg.dtype)
    q, k, v, o = (_fake_bhnd(dt, cfg.head_dim) for _ in range(4))
    lse = make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    kernel = FlashFwdSm90SplitD(cfg)
    compile_ = cute.compile[cute.KeepPTX, cute.KeepCUBIN] if keep_artifacts else cute.compile
    return compile_(kernel, q, k, v, o, lse, Float32(1.0), Int32(1), make_fake_stream())

"""Compile the CuTeDSL kernels once per configuration, on symbolic shapes (imports cutlass).

Kernels are compiled on fake tensors whose batch, head counts, sequence lengths and strides are
runtime values, so one compiled kernel serves every shape of a configuration (:class:`FwdConfig`:
D, dtype, causal, tiles): only compile-time constants are in a kernel's cache key. The target arch is
passed explicitly (sm_90a), so a CPU-only machine can compile and inspect the kernels
(``compile_fwd(cfg, keep_artifacts=True).artifacts.PTX``).

Every kernel is compiled with TVM-FFI (``--enable-tvm-ffi``): the compiled function takes torch tensors,
Python floats / ints and None (an absent optional tensor) directly, checks their dtypes, ranks, unit
strides and alignment, and launches on torch's current stream of the tensors' device (the stream argument
is the TVM-FFI environment stream, left out of the call). The device code is the same as without it.
"""
from __future__ import annotations

import tempfile

from ._env import prepare_cutlass_import

prepare_cutlass_import()

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402
from cutlass.runtime import make_fake_stream  # noqa: E402

from .config import BwdConfig, FwdConfig, RecomputeFwdConfig  # noqa: E402
from .bwd_dq_sm90 import FlashBwdDqSm90  # noqa: E402
from .bwd_sm90 import FlashBwdSm90SplitD  # noqa: E402
from .fwd_sm90 import FlashFwdSm90SplitD, _dtype  # noqa: E402
from .fwd_sm90_recompute import FlashFwdSm90Recompute  # noqa: E402


def _options(arch: str, keep_artifacts: bool, dump_dir: str | None) -> str:
    """The compiler options: the target arch, TVM-FFI calling, and with ``keep_artifacts`` PTX and CUBIN written
    into ``dump_dir`` (default: a temporary folder)."""
    options = f"--gpu-arch {arch} --enable-tvm-ffi"
    if keep_artifacts:
        dump_dir = dump_dir or tempfile.mkdtemp(prefix="ffpa_cute_artifacts_")
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return options


def _stream():
    """The stream argument: torch's current stream, passed by TVM-FFI at call time (not an argument of the call)."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def _fake_bhnd(dtype, d: int):
    """A [B, H, N, D] tensor with runtime sizes/strides, unit stride on D, 16-byte aligned rows."""
    b, h, n, dd = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    strides = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 1)
    return make_fake_tensor(dtype, (b, h, n, dd), strides, assumed_align=16)


def compile_fwd(cfg: FwdConfig, keep_artifacts: bool = False, arch: str = "sm_90a", dump_dir: str | None = None):
    """``cute.compile`` the forward kernel of ``cfg``; returns the JIT-compiled function.

    The compiled function takes ``(q, k, v, o, lse, scale_log2, group, cta_limit, cu_seqlens_q, cu_seqlens_k,
    items)`` with q/k/v/o torch tensors ``[B, H, N, D]``, lse ``[B, Hq, Nq]`` fp32, ``cta_limit`` the number of
    CTAs (in linear order) that run (the others exit; ``ffpa_attn.common.tail_split``) and the last three None
    unless ``cfg.varlen``; it runs on torch's current stream. ``arch`` is passed to the compiler (it wins
    over ``CUTE_DSL_ARCH`` and over the GPU of this machine). ``keep_artifacts`` keeps PTX and CUBIN
    (``.artifacts.PTX`` / ``.artifacts.CUBIN``) for inspection. A :class:`RecomputeFwdConfig` compiles
    :class:`FlashFwdSm90Recompute` (same call signature), any other :class:`FwdConfig` :class:`FlashFwdSm90SplitD`.
    """
    kernel_cls = FlashFwdSm90Recompute if isinstance(cfg, RecomputeFwdConfig) else FlashFwdSm90SplitD
    dt = _dtype(cfg.dtype)
    q, k, v, o = (_fake_bhnd(dt, cfg.head_dim) for _ in range(4))
    lse = make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    kernel = kernel_cls(cfg)
    args = (kernel, q, k, v, o, lse, Float32(1.0), Int32(1), Int32(1 << 30), _stream()) + _varlen_args(cfg)
    return cute.compile(*args, options=_options(arch, keep_artifacts, dump_dir))


def _fake_rows():
    """A [B, H, N] fp32 tensor (lse / delta) with runtime sizes/strides, unit stride on N."""
    return make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                            (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)


def _varlen_args(cfg: FwdConfig | BwdConfig) -> tuple:
    """The trailing arguments of a varlen kernel (``cfg.varlen``): ``cu_seqlens_q``, ``cu_seqlens_k`` (int32
    ``[B + 1]``) and the kernel's work list (int32 ``[2, slots]``, :func:`.ranges.varlen_work_items`); three Nones
    dense (the compiled function then takes None there)."""
    if not cfg.varlen:
        return (None, None, None)
    cu_q, cu_k = (make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4) for _ in range(2))
    items = make_fake_tensor(Int32, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), 1), assumed_align=4)
    return cu_q, cu_k, items


def compile_bwd(cfg: BwdConfig, keep_artifacts: bool = False, arch: str = "sm_90a", dump_dir: str | None = None):
    """``cute.compile`` the dK/dV kernel (:mod:`.bwd_sm90`) of ``cfg``; returns the JIT-compiled function.

    The compiled function takes ``(q, k, v, do, lse, delta, dk, dv, scale, scale_log2, group, cu_seqlens_q,
    cu_seqlens_k, items)``: q/do ``[B, Hq, Nq, D]``, k/v/dk/dv ``[B, Hkv, Nkv, D]`` (16-bit), lse/delta
    ``[B, Hq, Nq]`` fp32 (dQ: the kernel of :func:`compile_bwd_dq`), the last three None. ``cfg.varlen``: packed
    tensors as ``[1, H, T, D]`` / ``[1, Hq, T_q]`` views and the boundaries and work list last. ``arch``,
    ``keep_artifacts`` and ``dump_dir`` as in :func:`compile_fwd`.
    """
    dt = _dtype(cfg.dtype)
    q, k, v, do, dk, dv = (_fake_bhnd(dt, cfg.head_dim) for _ in range(6))
    kernel = FlashBwdSm90SplitD(cfg)
    args = (kernel, q, k, v, do, _fake_rows(), _fake_rows(), dk, dv, Float32(1.0), Float32(1.0),
            Int32(1), _stream()) + _varlen_args(cfg)
    return cute.compile(*args, options=_options(arch, keep_artifacts, dump_dir))


def compile_bwd_dq(cfg: BwdConfig, keep_artifacts: bool = False, arch: str = "sm_90a", dump_dir: str | None = None):
    """``cute.compile`` the dQ kernel (:mod:`.bwd_dq_sm90`) of ``cfg``.

    The compiled function takes ``(q, k, v, do, lse, delta, dq, scale, scale_log2, group, cu_seqlens_q,
    cu_seqlens_k, items)``: q/do/dq ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit), lse/delta
    ``[B, Hq, Nq]`` fp32; the last three as in :func:`compile_bwd` (the dQ kernel's work list). ``arch``, ``keep_artifacts`` and ``dump_dir`` as in
    :func:`compile_fwd`.
    """
    dt = _dtype(cfg.dtype)
    q, k, v, do, dq = (_fake_bhnd(dt, cfg.head_dim) for _ in range(5))
    args = (FlashBwdDqSm90(cfg), q, k, v, do, _fake_rows(), _fake_rows(), dq, Float32(1.0), Float32(1.0), Int32(1),
            _stream()) + _varlen_args(cfg)
    return cute.compile(*args, options=_options(arch, keep_artifacts, dump_dir))

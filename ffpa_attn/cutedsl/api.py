"""Host side of the CuTeDSL backend: torch tensors in, compiled sm90a kernels launched, tensors out.

The compiled kernels are TVM-FFI functions (:mod:`._compile`): a launch passes the torch tensors, Python scalars and
None for absent optional tensors straight in, and the kernel runs on torch's current stream of the tensors'
device (no per-call tensor descriptors, stream objects or device contexts on the Python side). A kernel found in the
disk cache is loaded without importing cutlass (:mod:`._cache`); cutlass is imported (through :mod:`._compile`)
only when a kernel must be compiled. Inputs are validated by :mod:`ffpa_attn.contract` before they get here (the
kernel-module protocol, :mod:`ffpa_attn.kernel_module`); this module only enforces what the hardware needs (TMA:
unit stride on D, 16-byte aligned base and strides) and copies an input only when its layout cannot be read by TMA.

CUDA graphs: every launch here is capturable (no host sync, outputs from torch's allocator, varlen work lists
built inside the graph, :func:`.ranges.work_items`), once each kernel has run in the process: a kernel is never
compiled or loaded during a capture (RuntimeError naming the warm-up).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..common.device import is_capturing
from ..common.lse import empty_result
from ..common.tail_split import TailSplit, run_tail
from ._build import build_bwd, build_fwd
from ._env import target_arch
from .config import BWD_MAX_STAGES, DEFAULT_TILE_N, BwdConfig, FwdConfig, RecomputeFwdConfig
from .ranges import work_items


_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOG2E = math.log2(math.e)
_NO_LIMIT = 2**31 - 1  # cta_limit: every CTA runs


@functools.lru_cache(maxsize=256)  # frozen configs, built once per request kind (every launch asks for one)
def fwd_config(d: int, dtype: torch.dtype, causal: bool, tile_n: int | None = None,
               q_broadcast: bool = False, varlen: bool = False) -> FwdConfig:
    """The :class:`FwdConfig` of a request (ValueError if the forward kernel cannot take it);
    ``tile_n`` None = :data:`.config.DEFAULT_TILE_N`; ``q_broadcast`` / ``varlen``: see :class:`FwdConfig`."""
    tile_n = DEFAULT_TILE_N if tile_n is None else tile_n
    return FwdConfig(head_dim=d, dtype=_TORCH_DTYPES[dtype], causal=bool(causal), tile_n=tile_n,
                     q_broadcast=q_broadcast, varlen=varlen)


@functools.lru_cache(maxsize=64)
def recompute_fwd_config(d: int, dtype: torch.dtype, causal: bool, tile_n: int | None = None) -> RecomputeFwdConfig:
    """The :class:`RecomputeFwdConfig` of a request (512 < D <= 1024; ValueError otherwise); ``tile_n`` None =
    the largest that leaves the ring its minimum depth."""
    return RecomputeFwdConfig(head_dim=d, dtype=_TORCH_DTYPES[dtype], causal=bool(causal), tile_n=tile_n or 0)


def _fwd_build(cfg: FwdConfig, arch: str):
    """``() -> compiled kernel``: the forward kernel of ``cfg`` (a partial of :func:`._build.build_fwd`, so a
    compile worker process can receive it)."""
    return functools.partial(build_fwd, cfg, arch)


def _kernel(key: Any, build: Any) -> Any:
    """The TVM-FFI function of kernel ``key`` (loaded in this process, else from the disk cache, else compiled by
    ``build(arch)``). RuntimeError during a CUDA-graph capture when it is not loaded yet: loading and a kernel's
    first launch are not capturable work (and a compile takes seconds), so a call runs once before the capture."""
    from . import _cache

    arch = target_arch()
    if not _cache.is_loaded(key, arch) and is_capturing():
        raise RuntimeError(f"the CuTeDSL kernel {key} is not loaded in this process: run the call once before "
                           "capturing a CUDA graph (warm-up), so that its kernels are compiled or loaded and launched")
    return _cache.get_or_compile(key, arch, build(arch))


def get_fwd_kernel(cfg: FwdConfig) -> Any:
    """The compiled forward kernel of ``cfg`` (memory / disk cache, else compiled now)."""
    return _kernel(cfg.key(), functools.partial(_fwd_build, cfg))


def _compile_beside(own_key: Any, other_key: Any, build_other: Any) -> None:
    """When this call needs two kernels and neither is cached, start ``other`` compiling in a compile worker
    (:func:`._cache.compile_in_child`) before this process compiles its own: the first call then waits for the
    slower of the two instead of their sum (:func:`._cache.get_or_compile` of ``other_key`` waits for the child).
    A warm call returns after two dict lookups (no compile server is started)."""
    from . import _cache

    arch = target_arch()
    if _cache.is_loaded(own_key, arch) or _cache.is_loaded(other_key, arch):
        return
    if not _cache.is_cached(own_key, arch) and not _cache.is_cached(other_key, arch):
        _cache.compile_in_child(other_key, arch, build_other)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` that TMA can read: unit stride on the last dim, 16-byte aligned base and strides.

    The TMA descriptor encodes the stride of every mode, so a size-1 mode (whose stride torch leaves
    arbitrary) gets a harmless aligned stride; any other misaligned layout is copied. One pass over the modes
    (every launch runs this for each of its tensors).
    """
    shape, st = t.shape, t.stride()
    align = 16 // t.element_size()
    if st[-1] == 1 and t.data_ptr() % 16 == 0:
        size_one = False
        for i in range(len(shape) - 1):
            if shape[i] <= 1:
                size_one = True
            elif st[i] % align:
                break
        else:
            return _aligned_size_one_strides(t, align) if size_one else t
    t = t.contiguous()
    st = t.stride()
    if not (st[-1] == 1 and t.data_ptr() % 16 == 0
            and all(s % align == 0 for s, n in zip(st[:-1], t.shape[:-1]) if n > 1)):  # pragma: no cover
        raise ValueError(f"tensor of shape {tuple(t.shape)} cannot be read by TMA")  # D % 8 != 0: FwdConfig refuses
    return _aligned_size_one_strides(t, align) if any(n <= 1 for n in t.shape[:-1]) else t


def _aligned_size_one_strides(t: torch.Tensor, align: int) -> torch.Tensor:
    """``t`` with the stride of each size-1 (or empty) mode but the last set to the element count rounded up to
    ``align`` (the same view when they already are)."""
    shape, st = t.shape, t.stride()
    safe = -(-max(t.numel(), 1) // align) * align
    fixed = list(st)
    for i in range(len(shape) - 1):
        if shape[i] <= 1:
            fixed[i] = safe
    strides = tuple(fixed)
    return t if strides == st else t.as_strided(shape, strides)


def _int32(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Boundaries as the kernels index them: int32, contiguous, on ``device`` (the public entries pass them so;
    a copy only for a direct caller's other layout)."""
    if cu.dtype == torch.int32 and cu.device == device and cu.is_contiguous():
        return cu
    return cu.to(device=device, dtype=torch.int32).contiguous()


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                tile_n: int | None = None, tail: TailSplit | None = None,
                recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense forward on validated inputs, exactly as given (the kernel module passes the planner's choices).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; fp16/bf16 on an sm90 device; Hq % Hkv == 0.
        causal: tail-aligned causal (row r sees key k iff ``k <= r + Nkv - Nq``; needs Nkv >= Nq).
        scale: softmax scale.
        tile_n: keys per K/V tile (one of ``config.TILE_N_CHOICES``); None = ``config.DEFAULT_TILE_N``.
        tail: the last-wave split to run (:mod:`ffpa_attn.common.tail_split`; non-causal, one CTA per query
            block, i.e. D <= 512, not with ``recompute``; ValueError otherwise); None = none.
        recompute: 512 < D <= 1024 only (ValueError otherwise): the S-recompute variant
            (:mod:`.fwd_sm90_recompute`: two CTAs per query block without a cluster, each computing the whole
            S and half of O) instead of the 2-CTA cluster kernel; ``tile_n`` then picks from
            ``config.RECOMPUTE_TILE_N_CHOICES``; no tail-wave split.
    Returns:
        ``(out [B, Hq, Nq, D] like q, lse [B, Hq, Nq] fp32)``; rows that see no key: 0 and -inf.
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    cfg = recompute_fwd_config(d, q.dtype, causal, tile_n) if recompute else fwd_config(d, q.dtype, causal, tile_n)
    if q.numel() == 0 or nkv == 0:
        return empty_result(q, d, (b, hq, nq))
    out = torch.empty(b, hq, nq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    if hq > 65535 or b > 65535:  # grid y / z limits (grid x holds the query blocks)
        raise NotImplementedError(f"the CuTeDSL forward launches Hq x B = {hq} x {b} CTA rows; each must be "
                                  f"<= 65535")
    grid = -(-nq // cfg.tile_m) * (2 if recompute else cfg.cluster) * hq * b
    split = tail
    if split is not None:
        if causal or recompute or cfg.cluster != 1:
            raise ValueError("kernel: the last-wave split runs non-causal forwards of the one-CTA kernel only "
                             f"(D <= 512, got D={d}, causal={causal}, recompute={recompute})")
        split.check(b, hq, nq, cfg.tile_m)
    if split:  # the tail's q_broadcast kernel (see _tail_launch) compiles next to the main one
        tail_cfg = fwd_config(d, q.dtype, False, cfg.tile_n, q_broadcast=True)
        _compile_beside(cfg.key(), tail_cfg.key(), _fwd_build(tail_cfg, target_arch()))
    kernel = get_fwd_kernel(cfg)
    k, v = _tma_ready(k), _tma_ready(v)  # the tail split's slices view these too
    kernel(_tma_ready(q), k, v, out, lse, scale * _LOG2E, hq // hkv, split.main_ctas if split else min(grid, _NO_LIMIT),
           None, None, None)
    if split:  # run_tail's q is the tail rows repeated over the S KV slices (stride 0, which TMA cannot take):
        # the q_broadcast variant reads its first entry for every slice (no copy per slice)
        run_tail(q, k, v, out, lse, split, lambda qs, ks, vs: _tail_launch(qs[:1], ks, vs, scale, cfg.tile_n))
    return out, lse


def run_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, causal: bool, scale: float, tile_n: int | None = None,
                       out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (varlen) forward on validated inputs in one launch, exactly as given.

    Args:
        q: ``[T_q, Hq, D]``; k, v: ``[T_k, Hkv, D]``; fp16/bf16 on an sm90 device; Hq % Hkv == 0.
        cu_seqlens_q, cu_seqlens_k: int ``[B + 1]`` on q's device, non-decreasing, last <= T_q / T_k: sequence
            ``b`` is rows ``cu[b]:cu[b + 1]``; lengths may differ between q and k and may be 0.
        causal: tail-aligned per sequence (row r sees key k iff ``k <= r + Nk_b - Nq_b``; rows that see no key,
            e.g. Nq_b > Nk_b or Nk_b = 0: out 0, lse -inf).
        scale: softmax scale.
        tile_n: keys per K/V tile (``config.TILE_N_CHOICES``); None = the dense default.
        out, lse: optional ``[T_q, Hq, D]`` / ``[Hq, T_q]`` fp32 tensors to write in place (unit stride on the last
            dim, 16-byte aligned row strides for out); None = fresh ones.
    Returns:
        ``(out, lse)``; only the rows of the sequences are written (rows outside every sequence keep what they
        held).

    The last, partial tile of a sequence reads the next rows of the packed tensors (the next sequence's): they never
    reach a stored row (queries) or get weight 0 (keys); rows of v past ``cu_seqlens_k[-1]`` must therefore be finite
    (the public entry points require ``cu_seqlens_k[-1] == T_k``).

    No padding and no copy of q/k/v (they are passed as ``[1, H, T, D]`` views); the work list
    (:func:`ffpa_attn.cutedsl.ranges.varlen_work_items`) is built on the device without a host sync, once per
    unchanged boundary tensors (:func:`ffpa_attn.cutedsl.ranges.work_items`).
    """
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    cfg = fwd_config(d, q.dtype, causal, tile_n, varlen=True)
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty(tq, hq, d, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device) if lse is None else lse
    if tq == 0 or hq == 0 or batch <= 0:
        return out, lse
    if tk == 0:  # no row sees a key (and TMA cannot describe an empty tensor): the sequences' rows get 0 / -inf
        rows = torch.arange(tq, device=q.device)
        inside = (rows >= cu_seqlens_q[0]) & (rows < cu_seqlens_q[-1])
        out.masked_fill_(inside[:, None, None], 0.0)
        lse.masked_fill_(inside[None, :], float("-inf"))
        return out, lse
    if hq > 65535:  # grid y holds the heads (grid x the work list)
        raise NotImplementedError(f"the CuTeDSL varlen forward launches Hq = {hq} CTA rows; must be <= 65535")
    cu_q, cu_k = _int32(cu_seqlens_q, q.device), _int32(cu_seqlens_k, q.device)
    items = work_items(cu_q, cu_k, tq, cfg.tile_m, cfg.tile_n, causal)
    kernel = get_fwd_kernel(cfg)
    # [T, H, D] -> [1, H, T, D] views: the kernel's dense layout with one batch entry, rows = packed tokens
    qv, kv, vv = (_tma_ready(t.transpose(0, 1).unsqueeze(0)) for t in (q, k, v))
    ov = out.transpose(0, 1).unsqueeze(0)
    ovt = _tma_ready(ov)
    if out.stride(-1) != 1 or lse.stride(-1) != 1 or ovt.data_ptr() != ov.data_ptr():
        raise ValueError("out needs unit stride on D and 16-byte aligned strides, lse unit stride on T_q")
    kernel(qv, kv, vv, ovt, lse.unsqueeze(0), scale * _LOG2E, hq // hkv, _NO_LIMIT, cu_q, cu_k, items)
    return out, lse


def _tail_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 tile_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split last wave of :func:`run_forward` (the ``launch`` of :func:`ffpa_attn.tail_split.run_tail`): q ``[1,
    1, R, D]`` (the tail rows once), k/v ``[S, 1, L, D]`` -> ``(out [S, 1, R, D], lse [S, 1, R])``."""
    s, rows, d = k.shape[0], q.shape[2], q.shape[3]
    out = torch.empty(s, 1, rows, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(s, 1, rows, dtype=torch.float32, device=q.device)
    launch_q_broadcast(q, k, v, out, lse, scale, tile_n)
    return out, lse


def launch_q_broadcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       scale: float, tile_n: int | None = None) -> None:
    """One non-causal launch of the forward kernel's ``FwdConfig.q_broadcast`` variant: the queries have one
    batch entry that every batch entry of k/v reads (the KV slices of split-KV, the split last wave), so they
    are neither copied nor loaded per slice.

    Args:
        q: ``[1, H, R, D]``; k, v: ``[S, H, L, D]``; fp16/bf16 on an sm90 device (query head h reads KV head h).
        out: ``[S, H, R, D]`` like q, written; lse: ``[S, H, R]`` fp32, written (natural log).
        scale: softmax scale.
        tile_n: keys per K/V tile (``config.TILE_N_CHOICES``); None = ``config.default_tile_n(D, False)``.

    Strided views are fine everywhere (the kernel takes dynamic strides; unit stride on the last mode, and
    q/k/v are copied only where TMA cannot read them, see :func:`_tma_ready`); out/lse must be written in
    place, so they need unit stride on the last mode and 16-byte aligned strides as they are.
    """
    kernel = get_fwd_kernel(fwd_config(q.shape[-1], q.dtype, False, tile_n, q_broadcast=True))
    kernel(_tma_ready(q), _tma_ready(k), _tma_ready(v), out, lse, scale * _LOG2E, 1, _NO_LIMIT, None, None, None)


@functools.lru_cache(maxsize=256)
def bwd_config(d: int, dtype: torch.dtype, causal: bool, varlen: bool = False,
               max_stages: int | None = None) -> BwdConfig:
    """The :class:`BwdConfig` of a request (ValueError if the backward kernels cannot take it); ``varlen``: the
    packed-sequence kernels; ``max_stages``: the dK/dV ring-depth cap (None = as deep as fits)."""
    return BwdConfig(head_dim=d, dtype=_TORCH_DTYPES[dtype], causal=bool(causal), varlen=varlen,
                     max_stages=max_stages or BWD_MAX_STAGES)


def _bwd_build(cfg: BwdConfig, dq: bool, arch: str):
    """``() -> compiled kernel``: the dK/dV kernel of ``cfg``, or with ``dq`` its dQ kernel (picklable, as
    :func:`_fwd_build`)."""
    return functools.partial(build_bwd, cfg, dq, arch)


def get_bwd_kernel(cfg: BwdConfig) -> Any:
    """The compiled dK/dV kernel of ``cfg`` (memory / disk cache, else compiled now)."""
    return _kernel(cfg.key(), functools.partial(_bwd_build, cfg, False))


def get_bwd_dq_kernel(cfg: BwdConfig) -> Any:
    """The compiled dQ kernel of ``cfg`` (memory / disk cache, else compiled now)."""
    return _kernel(cfg.dq_key(), functools.partial(_bwd_build, cfg, True))


def get_bwd_kernels(cfg: BwdConfig) -> tuple[Any, Any]:
    """``(dK/dV kernel, dQ kernel)`` of ``cfg``. When both need compiling, the dQ kernel compiles in a
    compile worker (:func:`_compile_beside`) while this process compiles the dK/dV kernel; kernels that
    :func:`prefetch_backward` started are waited for."""
    _compile_beside(cfg.key(), cfg.dq_key(), _bwd_build(cfg, True, target_arch()))
    return get_bwd_kernel(cfg), get_bwd_dq_kernel(cfg)


_PREFETCHED: set = set()  # the backward configs (and arch) whose kernels prefetch_backward has handled


def prefetch_backward(d: int, dtype: torch.dtype, causal: bool, varlen: bool = False,
                      max_stages: int | None = None) -> None:
    """Start compiling the default backward's kernels of ``(d, dtype, causal)`` (``varlen``: the packed-sequence
    variants) in compile workers, one per
    kernel not cached yet, and return at once (the forward of a call that will need its backward calls this;
    :func:`get_bwd_kernels` then waits for whatever is still compiling). Once per configuration and process
    (later calls return at a set lookup); a no-op when parallel compiles are off
    (``FFPA_ATTN_CUTE_PARALLEL_COMPILE=0`` or no disk cache). Never raises: the backward compiles what is
    missing itself."""
    from . import _cache

    arch = target_arch()
    memo = (d, dtype, bool(causal), varlen, max_stages, arch)
    if memo in _PREFETCHED or not _cache.parallel_compile_enabled():
        return
    _PREFETCHED.add(memo)
    try:
        cfg = bwd_config(d, dtype, causal, varlen=varlen, max_stages=max_stages)
        for key, dq in ((cfg.key(), False), (cfg.dq_key(), True)):
            if not _cache.is_cached(key, arch):  # no cutlass import: a warm cache starts no compile server
                _cache.compile_in_child(key, arch, _bwd_build(cfg, dq, arch))
    except Exception as err:  # noqa: BLE001 - a prefetch is an optimisation, never a failure
        _cache.logger.debug("ffpa_attn.cutedsl: backward prefetch skipped (%s)", err)


def run_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, dlse: torch.Tensor | None = None,
                 max_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense backward on validated inputs, exactly as given: the dK/dV kernel (:mod:`.bwd_sm90`), then the dQ kernel
    (:mod:`.bwd_dq_sm90`); ``max_stages``: the dK/dV ring-depth cap (the planner's ``ring_stages``).

    Args:
        dout, q, out: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; fp16/bf16 on an sm90 device.
        lse: ``[B, Hq, Nq]`` fp32, natural log of the scaled scores (-inf for a row without keys).
        causal: tail-aligned causal (row r sees key k iff ``k <= r + Nkv - Nq``).
        scale: softmax scale.
        dlse: optional ``[B, Hq, Nq]`` gradient reaching lse (``delta = rowsum(dO * O) - dlse``).
    Returns:
        ``(dq like q, dk like k, dv like v)``; dk/dv summed over the query heads of each GQA group inside
        the kernel; every element written once (no atomics, no fp32 buffer: bit-reproducible).
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    cfg = bwd_config(d, q.dtype, causal, max_stages=max_stages)
    dk = torch.empty(b, hkv, nkv, d, dtype=k.dtype, device=k.device)
    dv = torch.empty(b, hkv, nkv, d, dtype=v.dtype, device=v.device)
    if nq == 0 or nkv == 0 or b == 0 or hq == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    if hkv > 65535 or b > 65535:  # grid y / z limits (grid x holds the key blocks)
        raise NotImplementedError(f"the CuTeDSL backward launches Hkv x B = {hkv} x {b} CTA rows; each must be "
                                  f"<= 65535")
    if hq > 65535:  # the dQ kernel's grid: (query blocks, Hq, B)
        raise NotImplementedError(f"the CuTeDSL dQ kernel launches Hq = {hq} CTA rows; must be <= 65535")
    kernel, dq_kernel = get_bwd_kernels(cfg)
    from ..common.delta import backward_delta  # rowsum(dO * O) - dlse in one pass, no fp32 copies of dO / O

    delta = backward_delta(out, dout, dlse)
    lse = lse.float().contiguous()
    dq = torch.empty(b, hq, nq, d, dtype=q.dtype, device=q.device)
    q, k, v, dout = (_tma_ready(t) for t in (q, k, v, dout))
    scale_log2 = scale * _LOG2E
    kernel(q, k, v, dout, lse, delta, dk, dv, scale, scale_log2, hq // hkv, None, None, None)
    dq_kernel(q, k, v, dout, lse, delta, dq, scale, scale_log2, hq // hkv, None, None, None)
    return dq, dk, dv


def _packed_view(t: torch.Tensor, name: str, out: bool = False) -> torch.Tensor:
    """``[T, H, D]`` -> the ``[1, H, T, D]`` view the kernels index (no copy). An input whose layout TMA cannot
    read is copied (:func:`_tma_ready`); an output must already have unit stride on D and a 16-byte aligned base."""
    view = t.unsqueeze(0).transpose(1, 2)
    if not out:
        return _tma_ready(view)
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
        raise ValueError(f"{name} must have unit stride on D and 16-byte aligned rows, got strides {t.stride()}")
    return view


def run_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, causal: bool, scale: float, dlse: torch.Tensor | None = None,
                        dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                        max_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed-sequence (THD) backward on validated inputs, exactly as given:
    one launch of the dK/dV kernel and one of the dQ kernel for the whole batch (``BwdConfig.varlen``).

    Args:
        dout, q, out: ``[T_q, Hq, D]``; k, v: ``[T_k, Hkv, D]``; fp16/bf16 on an sm90 device; Hq % Hkv == 0.
        lse: ``[Hq, T_q]`` fp32 (natural log, -inf for a row without keys); dlse: optional ``[Hq, T_q]``, the
            gradient reaching lse (``delta = rowsum(dO * O) - dlse``; ring attention passes it).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` on q's device, non-decreasing: sequence b is rows
            ``cu[b] .. cu[b+1] - 1`` (its key rows from cu_seqlens_k); lengths may differ between q and k, and be 0.
        max_seqlen_q, max_seqlen_k: unused (the protocol's; the grids come from the work lists, whose size is
            known without reading cu_seqlens: ``T / 64 + B`` slots, the real items first).
        causal: tail-aligned per sequence (row r of sequence b sees key j iff ``j <= r + Nk_b - Nq_b``).
        scale: softmax scale.
        dq, dk, dv: optional outputs (like q / k / v, unit stride on D); only rows of sequences are written.
        max_stages: the dK/dV ring-depth cap (the planner's ``ring_stages``; None = as deep as fits).

    The last, partial 64-row block of a sequence reads the rows that follow it (the next sequence's, or rows past
    ``cu_seqlens[-1]``): they get weight 0, so they must be finite (every real row is; the public entry points
    require ``cu_seqlens[-1] == T``).
    Returns:
        ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])``, dk/dv summed over each GQA group inside the
        kernel (no atomics: bit-reproducible). Rows of a sequence without keys get dq = 0; keys no query sees,
        dk = dv = 0.
    """
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    n_seq = cu_seqlens_q.numel() - 1
    cfg = bwd_config(d, q.dtype, causal, varlen=True, max_stages=max_stages)
    for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if given is not None and (given.shape, given.dtype, given.device) != (like.shape, like.dtype, like.device):
            raise ValueError(f"{name} must be like the input it is the gradient of ({tuple(like.shape)}, {like.dtype}, "
                             f"{like.device}), got {tuple(given.shape)}, {given.dtype}, {given.device}")
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    dq_view, dk_view, dv_view = (_packed_view(t, name, out=True) for t, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")))
    del max_seqlen_q, max_seqlen_k
    if n_seq <= 0 or hq == 0:
        return dq, dk, dv
    if tq == 0 or tk == 0:  # no scores (and TMA cannot describe an empty tensor): the sequences' rows get 0
        for g, cu in ((dq, cu_seqlens_q), (dk, cu_seqlens_k), (dv, cu_seqlens_k)):
            rows = torch.arange(g.shape[0], device=g.device)
            g.masked_fill_(((rows >= cu[0]) & (rows < cu[-1]))[:, None, None], 0.0)
        return dq, dk, dv
    if hq > 65535:  # grid y: heads (the head-dim parts lie along x, beside their block)
        raise NotImplementedError(f"the CuTeDSL varlen backward launches one CTA row per query head; Hq={hq} > 65535")
    kernel, dq_kernel = get_bwd_kernels(cfg)
    from ..common.delta import backward_delta  # rowsum(dO * O) - dlse over the packed rows, [Hq, T_q] fp32

    delta = backward_delta(out, dout, dlse, varlen=True)
    lse = lse.float().contiguous()
    scale_log2 = scale * _LOG2E
    cq, ck, cv, cdo = (_packed_view(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v"), (dout, "dout")))
    clse, cdelta = lse.unsqueeze(0), delta.unsqueeze(0)
    cu_q, cu_k = _int32(cu_seqlens_q, q.device), _int32(cu_seqlens_k, q.device)
    # work lists built on the device (no sync), once per unchanged boundaries: key blocks of every sequence, most
    # query blocks first (dK/dV), query blocks, most key blocks first (dQ)
    items = work_items(cu_q, cu_k, tk, 64, 64, causal, key_stationary=True)
    kernel(cq, ck, cv, cdo, clse, cdelta, dk_view, dv_view, scale, scale_log2, hq // hkv, cu_q, cu_k, items)
    items = work_items(cu_q, cu_k, tq, 64, 64, causal)
    dq_kernel(cq, ck, cv, cdo, clse, cdelta, dq_view, scale, scale_log2, hq // hkv, cu_q, cu_k, items)
    return dq, dk, dv

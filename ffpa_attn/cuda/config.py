"""Tile shapes and launch plans of the CUDA forward kernel (pure Python: no CUDA needed).

The kernel (``csrc/ffpa_fwd.cu``) is a template over :class:`KernelSpec` (what changes the generated code);
the pipeline depth (``stages``) and the number of exchange buffers (``xbufs``) are runtime arguments that
only change the shared-memory layout. :func:`plan_launch` picks all of them for one call and one device.
Every number here mirrors ``FfpaTile`` in the kernel source.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


BLOCK_N = 64  # keys per tile (BC in the kernel)
MAX_STAGES = 4


@dataclass(frozen=True)
class KernelSpec:
    """One compiled instantiation of the kernel.

    Attributes:
        dpad: head dim padded to a multiple of ``32 * wn`` (zero columns live only in shared memory).
        wn: warps sharing 16 query rows, each owning ``dpad / wn`` columns of O (the split of D).
        nw: warps per CTA (8, or 4 on devices with <= ~100 KiB of shared memory per block).
        bf16: bf16 inputs (else fp16).
        acc16: fp16 MMA accumulators (fp16 inputs only), promoted to fp32 after each chunk.
        cw: a warp's columns per streamed chunk; 0 = the kernel's rule (:attr:`chunk_cols`); a forced value
            (32/64/128) is for exploration only and is not part of :func:`instantiations`.
        rm: m16 row tiles per warp: 1 (16 rows per warp, all-reduce of the S partials; the default) or 2
            (32 rows per warp, each K/V fragment feeds two MMAs per row; reduce-scatter of the S partials,
            see the kernel's header). ``rm * dpad / wn <= 256`` keeps O within 128 fp32 registers.
    """

    dpad: int
    wn: int
    nw: int
    bf16: bool
    acc16: bool
    cw: int = 0
    rm: int = 1

    def __post_init__(self) -> None:
        if self.bf16 and self.acc16:
            raise ValueError("there is no bf16 mma with fp16 accumulators")
        if self.rm not in (1, 2) or (self.rm == 2 and (BLOCK_N % self.wn or (BLOCK_N // self.wn) % 8)):
            raise ValueError(f"invalid rows per warp {self}")
        if self.dpad % (32 * self.wn) or self.nw % self.wn or self.rm * self.dpad // self.wn > 256:
            raise ValueError(f"invalid kernel tiling {self}")
        if self.cw not in (0, 32, 64, 128) or (self.cw and (self.dpad // self.wn) % self.cw):
            raise ValueError(f"invalid chunk width cw={self.cw} for {self}")

    # geometry (FfpaTile) --------------------------------------------------------------------------
    @property
    def threads(self) -> int:
        return self.nw * 32

    @property
    def rows_per_warp(self) -> int:
        return 16 * self.rm

    @property
    def block_m(self) -> int:
        """Query rows per CTA (BR)."""
        return 16 * self.rm * (self.nw // self.wn)

    @property
    def chunk_cols(self) -> int:
        """Columns of one streamed K/V chunk (SW = CW * WN)."""
        dw = self.dpad // self.wn
        if self.cw:
            return self.cw * self.wn
        cw = 32
        if not self.acc16:
            for width in (128, 64):
                if dw % width == 0 and width * self.wn <= 256:
                    cw = width
                    break
        return cw * self.wn

    @property
    def q_bytes(self) -> int:
        return self.block_m * self.dpad * 2

    @property
    def chunk_bytes(self) -> int:
        return BLOCK_N * self.chunk_cols * 2

    @property
    def xchg_bytes(self) -> int:
        """One exchange buffer: a (16 rm) x 64 fp32 partial S per warp; rm = 2 adds the per-warp row maxima
        (the P fragments reuse the partials' space)."""
        maxima = self.nw * 16 * self.rm * 4 if self.rm > 1 else 0
        return self.nw * 16 * self.rm * BLOCK_N * 4 + maxima

    def smem_bytes(self, stages: int, xbufs: int) -> int:
        """Dynamic shared memory of a launch: Q tile + K/V ring + exchange buffers."""
        return self.q_bytes + stages * self.chunk_bytes + xbufs * self.xchg_bytes

    # compilation -----------------------------------------------------------------------------------
    def defines(self) -> dict[str, int]:
        """Preprocessor defines that select this instantiation as the ``ffpa_fwd`` entry point."""
        out = {"FFPA_DPAD": self.dpad, "FFPA_WN": self.wn, "FFPA_NW": self.nw,
               "FFPA_BF16": int(self.bf16), "FFPA_ACC16": int(self.acc16)}
        if self.cw:
            out["FFPA_CW"] = self.cw
        if self.rm != 1:
            out["FFPA_RM"] = self.rm
        return out

    @property
    def name(self) -> str:
        dt = "bf16" if self.bf16 else "fp16"
        acc = "acc16" if self.acc16 else "acc32"
        cw = f"_cw{self.cw}" if self.cw else ""
        rm = f"_rm{self.rm}" if self.rm != 1 else ""
        return f"ffpa_fwd_d{self.dpad}_wn{self.wn}_nw{self.nw}_{dt}_{acc}{cw}{rm}"


@dataclass(frozen=True)
class LaunchPlan:
    """A kernel instantiation plus its runtime shared-memory layout."""

    spec: KernelSpec
    stages: int
    xbufs: int

    @property
    def smem_bytes(self) -> int:
        return self.spec.smem_bytes(self.stages, self.xbufs)


def head_dim_tiling(d: int, rm: int = 1) -> tuple[int, int]:
    """``(dpad, wn)`` for head dim ``d`` and ``rm`` row tiles per warp.

    rm = 1: two column groups up to 512, four above (<= 256 O columns per warp);
    rm = 2: four column groups up to 512, eight above (<= 128 O columns per warp of 32 rows).
    """
    if not 256 < d <= 1024:
        raise ValueError(f"the CUDA kernel handles 256 < D <= 1024, got D={d}")
    if rm not in (1, 2):
        raise ValueError(f"rm must be 1 or 2, got {rm}")
    wn = (2 if d <= 512 else 4) * rm
    step = 32 * wn
    return -(-d // step) * step, wn


def default_stages(capability: tuple[int, int]) -> int:
    """cp.async pipeline depth when the config says None: 4 on sm90+, 3 on sm80/86/89."""
    return 4 if capability[0] >= 9 else 3


def arch_name(capability: tuple[int, int]) -> str:
    """The ``-arch`` of a device: ``sm_90a`` on Hopper (arch-specific target), else ``sm_XY``."""
    major, minor = capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def plan_launch(d: int, dtype: torch.dtype, acc: str, stages: int | None, capability: tuple[int, int],
                smem_limit: int, rows_per_warp: int | None = None) -> LaunchPlan:
    """Choose the instantiation and the shared-memory layout for one call.

    Order of preference: 8 warps before 4; the requested (or default) number of stages, lowered (only when
    ``stages`` is None) until it fits; two exchange buffers before one. ``smem_limit`` is the device's
    opt-in shared memory per block. ``rows_per_warp`` (16 or 32, the planner's choice; None = 16) picks the rm = 2
    kernel (8 warps, one exchange buffer) when a layout of it fits, else the 16-row plan.

    Raises:
        ValueError: ``acc`` not in {'f16', 'f32'}, bf16 with acc='f16', a dtype other than fp16/bf16.
        NotImplementedError: an explicit ``stages`` that does not fit this device at this head dim.
    """
    if acc not in ("f16", "f32"):
        raise ValueError(f"acc must be 'f16' or 'f32', got {acc!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the CUDA kernel takes fp16/bf16, got {dtype}")
    bf16 = dtype == torch.bfloat16
    if bf16 and acc == "f16":
        raise ValueError("CUDABackend(acc='f16') needs fp16 inputs: there is no bf16 mma with an f16 "
                         "accumulator; use acc='f32' for bf16")
    if rows_per_warp is None:
        rows_per_warp = 16
    if rows_per_warp not in (16, 32):
        raise ValueError(f"rows_per_warp must be 16 or 32, got {rows_per_warp}")
    if stages is not None and not 1 <= stages <= MAX_STAGES:
        raise ValueError(f"stages must be in 1..{MAX_STAGES}, got {stages}")
    if rows_per_warp == 32:
        dpad2, wn2 = head_dim_tiling(d, 2)
        spec2 = KernelSpec(dpad2, wn2, 8, bf16, acc == "f16", rm=2)
        tries = [stages] if stages is not None else list(range(default_stages(capability), 0, -1))
        for st in tries:
            plan = LaunchPlan(spec2, st, 1)
            if plan.smem_bytes <= smem_limit:
                return plan
    dpad, wn = head_dim_tiling(d)
    if stages is None:
        top = default_stages(capability)
        order = [(8, s) for s in range(top, 1, -1)] + [(4, s) for s in range(top, 1, -1)] + [(8, 1), (4, 1)]
    else:
        order = [(8, stages), (4, stages)]
    for nw, st in order:
        spec = KernelSpec(dpad, wn, nw, bf16, acc == "f16")
        for xbufs in (2, 1):
            plan = LaunchPlan(spec, st, xbufs)
            if plan.smem_bytes <= smem_limit:
                return plan
    need = KernelSpec(dpad, wn, 4, bf16, acc == "f16").smem_bytes(order[-1][1], 1)
    raise NotImplementedError(
        f"CUDABackend(stages={stages}) at D={d} needs at least {need} bytes of shared memory per block; "
        f"this device allows {smem_limit} (use fewer stages or stages=None)")


SUPPORTED_DPADS = tuple(sorted({head_dim_tiling(d)[0] for d in range(257, 1025)}))
SUPPORTED_DPADS_RM2 = tuple(sorted({head_dim_tiling(d, 2)[0] for d in range(257, 1025)}))


def instantiations(arch: str) -> list[KernelSpec]:
    """Every instantiation the runtime can pick on a device of ``arch`` (for the compile check).

    Hopper (227 KiB per block) always fits 8 warps; other families also use 4-warp CTAs on parts with
    ~100 KiB of shared memory per block (sm86/sm89/sm120), so they list both. The 32-rows-per-warp kernels
    (rm = 2, 8 warps only) are listed on every arch: :func:`plan_launch` picks them where they fit.
    """
    nws = (8,) if arch in ("sm_90", "sm_90a") else (8, 4)
    combos = ((False, False), (False, True), (True, False))
    specs = []
    for dpad in SUPPORTED_DPADS:
        wn = 2 if dpad <= 512 else 4
        for nw in nws:
            for bf16, acc16 in combos:
                specs.append(KernelSpec(dpad, wn, nw, bf16, acc16))
    for dpad in SUPPORTED_DPADS_RM2:
        wn = 4 if dpad <= 512 else 8
        for bf16, acc16 in combos:
            specs.append(KernelSpec(dpad, wn, 8, bf16, acc16, rm=2))
    return specs

"""Tile configurations of the split-D backward, the D-slice plan, and the shipped defaults.

A :class:`BwdPlan` is everything that changes the generated backward code (besides dtype and features):
the dK/dV kernel's tiles and D-slice width, and either a dQ kernel config (split launch, deterministic) or
``None`` (dQ added with fp32 atomics by the dK/dV kernel). Plans are picked by :func:`default_plan` from
the head dim and the backend config; the bench (``bench/tune_triton_bwd.py``) times :func:`candidate_plans`.

Register budget (Hopper, 64K x 32-bit registers per SM): a dK/dV program holds ``2 * BN * DS`` fp32
accumulators; BN=64, DS=256 is 128 KiB, half the register file, spread over 8 warps (128 registers per
thread). D is split into slices of a power-of-2 width (Triton tensors need power-of-2 shapes): full ``DS``
slices plus one remainder slice of the next power of 2 above ``D mod DS``, at least :data:`MIN_DOT_K` wide
(masked past D), each slice group one launch; e.g. D=320 with DS=256 is 256 + 64, D=640 is 2 x 256 + 128,
D=264 with DS=128 is 2 x 128 + 16.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


@dataclass(frozen=True)
class DkdvConfig:
    """Tiles of the K/V-stationary kernel: key block BN, query block BM, BK-wide chunks of D for the S/dP
    recompute, dK/dV slice width DS, and ``halves``: hold the slice as two DS/2 halves (smaller dQ
    staging, two N=DS/2 MMAs per update)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    slice_d: int = 256
    halves: bool = True
    num_warps: int = 8
    num_stages: int = 2

    def short(self) -> str:
        return (f"kv[m{self.block_m} n{self.block_n} k{self.block_k} ds{self.slice_d}{'h' if self.halves else ''} "
                f"w{self.num_warps} s{self.num_stages}]")


@dataclass(frozen=True)
class DqConfig:
    """Tiles of the query-stationary dQ kernel (split launch): query block BM, key block BN, BK chunks, slice DS."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    slice_d: int = 256
    num_warps: int = 8
    num_stages: int = 2

    def short(self) -> str:
        return (f"dq[m{self.block_m} n{self.block_n} k{self.block_k} ds{self.slice_d} "
                f"w{self.num_warps} s{self.num_stages}]")


@dataclass(frozen=True)
class BwdPlan:
    """dK/dV kernel config and, for the split launch, the dQ kernel config (None = fused fp32 dQ atomics)."""

    dkdv: DkdvConfig
    dq: DqConfig | None = None
    tma: bool | None = None  # tensor descriptors; None = the backend's enable_tma (auto: sm90+)

    @property
    def split(self) -> bool:
        return self.dq is not None

    def short(self) -> str:
        tma = {None: "", True: " tma", False: " ptr"}[self.tma]
        return self.dkdv.short() + (" + " + self.dq.short() if self.dq is not None else " atomic-dQ") + tma


# Smallest reduction depth tl.dot takes for 16-bit operands (Triton rejects a narrower K at compile time on
# every NVIDIA target). A slice's own columns are the K of its S / dP products, so no slice is narrower.
MIN_DOT_K = 16


def slice_groups(d: int, ds: int) -> list[tuple[int, int, int]]:
    """Split head dim ``d`` into power-of-2 slices: ``[(start, width, count), ...]``.

    Full ``ds``-wide slices first, then one remainder slice of width ``max(MIN_DOT_K, next_pow2(d mod ds))``
    (its columns past ``d`` are masked: D=264 with ds=128 ends in a 16-wide slice holding 8 columns).
    ``ds`` is clamped to ``[MIN_DOT_K, next_pow2(d)]``.
    """
    ds = max(MIN_DOT_K, min(ds, next_pow2(d)))
    full = d // ds
    groups = [(0, ds, full)] if full else []
    rem = d - full * ds
    if rem:
        groups.append((full * ds, max(MIN_DOT_K, next_pow2(rem)), 1))
    return groups


def chunk_width(block_k: int, start: int, width: int) -> int:
    """BK of the slice group ``(start, width, count)``: the columns outside a slice are walked in BK-wide
    chunks that must not straddle a slice start (the kernel skips the slice by adding DS to the chunk
    offset). Full slices start at multiples of ``width``: BK <= width. The remainder slice is the last one
    and its outside columns are ``[0, start)``: BK only has to divide ``start``, so a narrow remainder (16
    columns) still walks them in ``block_k`` chunks instead of 16-wide ones."""
    return max(MIN_DOT_K, min(block_k, (start & -start) or width))


def _fit(cfg, d: int):
    """Clamp the slice width to the head dim (small D) and the chunk width to the slice width."""
    ds = max(MIN_DOT_K, min(cfg.slice_d, next_pow2(d)))
    return dataclasses.replace(cfg, slice_d=ds, block_k=max(MIN_DOT_K, min(cfg.block_k, ds)))


# Interpreter (CPU) tiles: every launch costs the interpreter ~0.3 s of set-up, so one D-slice (one launch)
# covering the whole head dim; the tests force multi-slice plans explicitly.
_INTERP_DKDV = DkdvConfig(block_m=32, block_n=32, block_k=128, slice_d=1024, halves=False, num_warps=4,
                          num_stages=1)
_INTERP_DQ = DqConfig(block_m=32, block_n=32, block_k=128, slice_d=1024, num_warps=4, num_stages=1)

# Shipped GPU defaults per head-dim bucket (upper bound of D): (dK/dV, dQ for the split launch). Fused:
# DS=128 up to D=512 (no spills), DS=256 above (fewer recompute passes); to be replaced by the bench.
_GPU_DEFAULTS: dict[int, tuple[DkdvConfig, DqConfig]] = {
    512: (DkdvConfig(64, 64, 64, 128, False, 8, 3), DqConfig(64, 64, 64, 256, 8, 2)),
    1024: (DkdvConfig(64, 64, 64, 256, False, 8, 2), DqConfig(64, 64, 64, 256, 8, 2)),
}
_SPLIT_DKDV = DkdvConfig(64, 64, 64, 256, False, 8, 2)


def default_plan(d: int, split: bool, on_gpu: bool = True) -> BwdPlan:
    """The shipped plan for head dim ``d``; ``split`` selects the separate (deterministic) dQ kernel."""
    if not on_gpu:
        return BwdPlan(_fit(_INTERP_DKDV, d), _fit(_INTERP_DQ, d) if split else None)
    bucket = next((k for k in sorted(_GPU_DEFAULTS) if d <= k), max(_GPU_DEFAULTS))
    dkdv, dq = _GPU_DEFAULTS[bucket]
    if split:
        return BwdPlan(_fit(_SPLIT_DKDV, d), _fit(dq, d))
    return BwdPlan(_fit(dkdv, d))


def plan_to_config(plan: BwdPlan):
    """The plan as an autotune :class:`~ffpa_attn.triton.autotune.KernelConfig` (flat, JSON-friendly)."""
    from .autotune import KernelConfig

    k, q = plan.dkdv, plan.dq
    opts = {"bk": k.block_k, "ds": k.slice_d, "halves": k.halves,
            "tma": {None: "auto", True: "on", False: "off"}[plan.tma],
            "dq": "" if q is None else "/".join(str(x) for x in dataclasses.astuple(q))}
    return KernelConfig(k.block_m, k.block_n, k.num_warps, k.num_stages, tuple(sorted(opts.items())))


def config_to_plan(cfg) -> BwdPlan:
    """Inverse of :func:`plan_to_config`."""
    dq = cfg.opt("dq", "")
    return BwdPlan(
        DkdvConfig(cfg.block_m, cfg.block_n, int(cfg.opt("bk", 64)), int(cfg.opt("ds", 256)),
                   bool(cfg.opt("halves", False)), cfg.num_warps, cfg.num_stages),
        DqConfig(*(int(x) for x in dq.split("/"))) if dq else None,
        {"auto": None, "on": True, "off": False}[cfg.opt("tma", "auto")])


def fit_plan(plan: BwdPlan, d: int) -> BwdPlan:
    """``plan`` with its widths clamped to head dim ``d``."""
    return BwdPlan(_fit(plan.dkdv, d), None if plan.dq is None else _fit(plan.dq, d), plan.tma)


def candidate_plans(d: int) -> list[BwdPlan]:
    """Plans the bench (``bench/tune_triton_bwd.py``) times for head dim ``d`` on a GPU, best guess first.

    Compile reports (sm90, triton 3.6, TMA, 255 registers max): the fused DS=128 plans (3-4 stages, or
    halves with BK=128) do not spill; fused DS=256 spills ~27 instructions per query block but does 7
    GEMM units of work at D=512 against 11 for DS=128; the split launch (DS=256 dK/dV + DS=256 dQ) does
    not spill in its loops (11 units, deterministic).
    """
    k = DkdvConfig
    atomic128 = BwdPlan(k(64, 64, 64, 128, False, 8, 3))
    atomic128s4 = BwdPlan(k(64, 64, 64, 128, False, 8, 4))
    atomic128h = BwdPlan(k(64, 64, 128, 128, True, 8, 2))
    atomic256 = BwdPlan(k(64, 64, 64, 256, False, 8, 2))
    split = BwdPlan(k(64, 64, 64, 256, False, 8, 2), DqConfig(64, 64, 64, 256, 8, 2))
    split128 = BwdPlan(k(64, 64, 64, 256, False, 8, 2), DqConfig(64, 64, 64, 128, 8, 3))
    ptr = BwdPlan(k(64, 64, 64, 128, False, 8, 3), tma=False)
    m128 = BwdPlan(k(128, 64, 64, 128, False, 8, 2))
    if d <= 512:
        out = [atomic128, split, atomic256, atomic128s4, atomic128h, split128, ptr, m128]
    else:
        out = [atomic256, split, atomic128, atomic128s4, atomic128h, split128, ptr]
    return [fit_plan(p, d) for p in dict.fromkeys(out)]

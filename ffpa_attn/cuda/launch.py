"""Launcher of the CUDA forward: plan, load (per device, once), pack the arguments, launch on torch's stream.

``forward(q, k, v, causal, scale, acc, stages)`` takes validated dense tensors (``[B, H, N, D]``, unit stride
on D) and returns ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)``.
"""
from __future__ import annotations

import ctypes
import math
import struct
import threading
import time
from dataclasses import dataclass

import torch

from ..contract import causal_offset
from ..common import device as hw
from ..common.lse import empty_result
from ..common.tail_split import TailSplit, run_tail
from . import build, driver
from .config import LaunchPlan, arch_name, plan_launch

LOG2E = 1.0 / math.log(2.0)
# FfpaParams in csrc/ffpa_fwd.cu: 5 pointers, 12 int64 strides, 10 int32, 1 float32, cta_limit int32 (184 bytes)
PARAMS = struct.Struct("<5Q12q10ifi")
assert PARAMS.size == 184

_MAX_GRID_YZ = 65535


@dataclass
class LoadedKernel:
    """A kernel loaded into one device's context."""

    func: ctypes.c_void_p
    module: ctypes.c_void_p
    binary: build.Binary
    smem_set: int
    load_seconds: float
    num_regs: int
    local_bytes: int


_KERNELS: dict[tuple[int, str, str], LoadedKernel] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class DeviceInfo:
    capability: tuple[int, int]
    arch: str
    smem_optin: int
    sm_count: int


_DEVICES: dict[int, DeviceInfo] = {}


def device_info(device: torch.device) -> DeviceInfo:
    """The facts of CUDA ``device`` (:mod:`ffpa_attn.common.device`) with the arch the kernel compiles for."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICES:
        cap = hw.capability(device)
        _DEVICES[idx] = DeviceInfo(cap, arch_name(cap), hw.smem_limit(device), hw.sm_count(device))
    return _DEVICES[idx]


def get_kernel(plan: LaunchPlan, device: torch.device) -> LoadedKernel:
    """Compile-or-load the plan's instantiation for ``device`` (cached per device) with enough smem set."""
    info = device_info(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, plan.spec.name, info.arch)
    kern = _KERNELS.get(key)
    if kern is None:
        with _LOCK:
            kern = _KERNELS.get(key)
            if kern is None:
                t0 = time.perf_counter()
                binary = build.get_binary(plan.spec, info.arch)
                with torch.cuda.device(idx):
                    module, func = driver.load_function(binary.cubin, build.ENTRY, idx)
                regs = driver.func_attribute(func, driver.ATTR_NUM_REGS)
                local = driver.func_attribute(func, driver.ATTR_LOCAL_SIZE_BYTES)
                kern = LoadedKernel(func, module, binary, 0, time.perf_counter() - t0, regs, local)
                _KERNELS[key] = kern
    if kern.smem_set < plan.smem_bytes:
        driver.set_max_dynamic_smem(kern.func, plan.smem_bytes)
        kern.smem_set = plan.smem_bytes
    return kern


def _vec16_ok(d: int, *tensors: torch.Tensor) -> bool:
    """16-byte vector loads are legal: D % 8 == 0, 16-byte aligned bases, strides (of dims > 1) % 8 == 0."""
    if d % 8:
        return False
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
            if size > 1 and stride % 8:
                return False
    return True


def make_plan(q: torch.Tensor, acc: str, stages: int | None, rows_per_warp: int | None = None) -> LaunchPlan:
    """The launch plan for ``q``'s device; ``rows_per_warp``: 16 or 32 (None = 16)."""
    info = device_info(q.device)
    return plan_launch(q.shape[-1], q.dtype, acc, stages, info.capability, info.smem_optin, rows_per_warp)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, acc: str = "f32",
            stages: int | None = None, rows_per_warp: int | None = None, tail: TailSplit | None = None,
            plan: LaunchPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel. q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (unit stride on D, Hq % Hkv == 0).

    Returns ``(out [B, Hq, Nq, D] contiguous, lse [B, Hq, Nq] fp32)``. ``rows_per_warp``: 16 or 32 query rows per
    warp (the planner's choice; None = 16). ``tail``: the last-wave split the planner decided
    (:mod:`ffpa_attn.common.tail_split`, non-causal only; ValueError when it was planned for another geometry).
    ``plan`` overrides the launch plan (benchmarks).
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on D")
    if q.numel() == 0 or nkv == 0:
        return empty_result(q, d, (b, hq, nq))
    out = torch.empty(b, hq, nq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    if hq > _MAX_GRID_YZ or b > _MAX_GRID_YZ:
        raise NotImplementedError(f"the CUDA kernel's grid takes at most {_MAX_GRID_YZ} heads and batches, "
                                  f"got B={b}, Hq={hq}")
    if plan is None:
        plan = make_plan(q, acc, stages, rows_per_warp)
    kern = get_kernel(plan, q.device)
    off = causal_offset(nq, nkv) if causal else 0
    grid = (-(-nq // plan.spec.block_m), hq, b)
    split = tail
    if split is not None:
        if causal:
            raise ValueError("kernel: the last-wave split runs non-causal forwards only")
        split.check(b, hq, nq, plan.spec.block_m)
    params = PARAMS.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        nq, nkv, hq, hq // hkv, d, int(bool(causal)), off, plan.stages, plan.xbufs, int(_vec16_ok(d, q, k, v)),
        float(scale) * LOG2E, split.main_ctas if split else min(grid[0] * hq * b, 2**31 - 1))
    with torch.cuda.device(q.device):
        stream = torch.cuda.current_stream(q.device).cuda_stream
        driver.require_context(q.device.index if q.device.index is not None else torch.cuda.current_device())
        driver.launch(kern.func, grid, (plan.spec.threads, 1, 1), plan.smem_bytes, stream, params)
    if split:
        run_tail(q, k, v, out, lse, split,
                 lambda qs, ks, vs: forward(qs, ks, vs, False, scale, acc, stages, plan=plan))
    return out, lse

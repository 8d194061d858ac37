"""What each backend can run, as data: arch, head dims, dtypes, features (:data:`CAPABILITIES`).

Also the availability probes (is the backend installed, does this device fit) and the reasons a backend
cannot run one request. Nothing here imports a kernel module: availability is probed with
``importlib.util.find_spec`` and device properties only, and the CuTeDSL head dims are read from
``cute/_dims.py`` (no cutlass import). What is *faster* where several backends can run lives in
:mod:`ffpa_attn.dispatch.heuristics`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..common.device import interpreter_on
from ..config import Backend, CUDABackend
from ..contract import DenseProblem, VarlenProblem


@dataclass(frozen=True)
class Capability:
    """What one backend's kernels implement.

    Attributes:
        kernel_module: the package ops.py imports (lazily) to run it (the kernel-module protocol).
        forward / backward: directions it has kernels for.
        archs: ``(min, max)`` CUDA compute capability, inclusive (None = any device, as torch SDPA).
        cpu_interpreter: runs CPU tensors under ``TRITON_INTERPRET=1``.
        head_dims: ``(lo, hi)`` inclusive range of D, or None = read from ``cute/_dims.py`` (what was validated;
            also the CuTeDSL varlen directions).
        dtypes: input dtypes (None = any).
        varlen / attn_mask / dropout: features beyond a plain dense call.
        needs: importable modules it needs.
    """

    kernel_module: str
    forward: bool
    backward: bool
    archs: tuple[tuple[int, int], tuple[int, int]] | None
    cpu_interpreter: bool
    head_dims: tuple[int, int] | None
    dtypes: frozenset[torch.dtype] | None
    varlen: bool
    attn_mask: bool
    dropout: bool
    needs: tuple[str, ...] = ()


_FFPA_DTYPES = frozenset({torch.float16, torch.bfloat16})

CAPABILITIES: dict[str, Capability] = {
    "triton": Capability("ffpa_attn.triton", True, True, ((8, 0), (99, 99)), True, (16, 1024), _FFPA_DTYPES,
                         varlen=True, attn_mask=True, dropout=True, needs=("triton",)),
    "cuda": Capability("ffpa_attn.cuda", True, False, ((8, 0), (99, 99)), False, (257, 1024), _FFPA_DTYPES,
                       varlen=False, attn_mask=False, dropout=False, needs=("ffpa_attn.cuda",)),
    "cutedsl": Capability("ffpa_attn.cute", True, True, ((9, 0), (9, 0)), False, None, _FFPA_DTYPES,
                          varlen=False, attn_mask=False, dropout=False, needs=("cutlass", "ffpa_attn.cute")),
    "sdpa": Capability("ffpa_attn.sdpa", True, True, None, True, None, None, varlen=True, attn_mask=True,
                       dropout=True),
}
# kernel package of each backend (imported lazily by ops.py only)
KERNEL_MODULES: dict[str, str] = {name: c.kernel_module for name, c in CAPABILITIES.items()}
TRITON_D_RANGE = CAPABILITIES["triton"].head_dims
CUDA_D_RANGE = CAPABILITIES["cuda"].head_dims


# ------------------------------------------------------------------------------------------ availability


_CAPS: dict[int, tuple[int, int]] = {}
_MODULES: dict[str, bool] = {}


def _cuda_capability(index: int) -> tuple[int, int]:
    # plain dict caches (not functools.lru_cache) so torch.compile traces the planner without warnings
    if index not in _CAPS:
        _CAPS[index] = torch.cuda.get_device_capability(index)
    return _CAPS[index]


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for other devices."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def _module_present(name: str) -> bool:
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            _MODULES[name] = False
    return _MODULES[name]


# Probed at import, not at the first call: a process's first call can be traced by torch.compile, and dynamo
# (torch 2.11) refuses to trace importlib's find_spec, so a fullgraph=True first call failed. find_spec locates a
# module without importing it (importing triton here would fix TRITON_INTERPRET before a CPU caller can set it).
for _name in ("triton", "cutlass", "ffpa_attn.cuda"):
    _module_present(_name)


def backend_available(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device`` at all (:data:`CAPABILITIES`), with the reason when not."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown backend {name!r}")
    cap = device_capability(device)
    if name == "sdpa":
        return True, "torch SDPA runs everywhere"
    c = CAPABILITIES[name]
    (lo, hi) = c.archs
    if name == "triton":
        if not _module_present("triton"):
            return False, "triton is not installed"
        if device.type == "cpu":
            if interpreter_on():
                return True, "CPU tensors under TRITON_INTERPRET=1 (interpreter)"
            return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton backend"
        if cap is None:
            return False, f"device type {device.type!r} is not supported by Triton kernels"
        if cap < lo:
            return False, f"compute capability {cap} < {lo}"
        return True, f"CUDA sm{cap[0]}{cap[1]}"
    if name == "cuda":
        if cap is None:
            return False, "the CUDA backend needs a CUDA device"
        if cap < lo:
            return False, f"compute capability {cap} < {lo}"
        if not _module_present("ffpa_attn.cuda"):
            return False, "the CUDA kernel sources are not part of this build"
        return True, f"CUDA sm{cap[0]}{cap[1]}"
    # cutedsl
    if cap is None:
        return False, "the CuTeDSL backend needs a CUDA device (sm90)"
    if not lo <= cap <= hi:
        return False, f"the CuTeDSL kernels are built for sm90a, device is sm{cap[0]}{cap[1]}"
    if not _module_present("cutlass"):
        return False, "nvidia-cutlass-dsl is not installed (pip install 'ffpa-attn[cute]')"
    if not _module_present("ffpa_attn.cute"):
        return False, "the CuTeDSL kernels are not part of this build"
    return True, "sm90 with nvidia-cutlass-dsl"


# ------------------------------------------------------------------------------------------ features


def _cute_dims() -> tuple[frozenset[int], frozenset[int], frozenset[str]]:
    """(forward head dims, backward head dims, directions with a varlen kernel) the CuTeDSL package really
    supports; a varlen direction takes the same head dims as the dense one.

    Read from ``cute/_dims.py`` without importing cutlass (``cute/__init__.py`` imports it lazily).
    """
    if not _module_present("ffpa_attn.cute._dims"):
        return frozenset(), frozenset(), frozenset()
    from ..cute import _dims  # type: ignore[attr-defined]

    return (frozenset(_dims.SUPPORTED_HEAD_DIMS), frozenset(getattr(_dims, "SUPPORTED_BWD_HEAD_DIMS", ())),
            frozenset(getattr(_dims, "VARLEN_DIRECTIONS", ())))


def _features(name: str, direction: str, prob: DenseProblem | VarlenProblem) -> str | None:
    """The first feature of ``prob`` (varlen, mask, dropout) that backend ``name`` lacks, as a reason."""
    c = CAPABILITIES[name]
    varlen = isinstance(prob, VarlenProblem)
    label = {"cuda": "the CUDA backend", "cutedsl": "the CuTeDSL backend"}.get(name, f"the {name} backend")
    if varlen and name == "cutedsl":
        if direction not in _cute_dims()[2]:
            return f"{label} has no varlen {direction} kernel yet"
    elif varlen and not c.varlen:
        return f"{label} has no varlen kernel"
    if not varlen and prob.mask_kind != "none" and not c.attn_mask:
        return f"{label} takes no attn_mask"
    if prob.dropout_p > 0 and not c.dropout:
        return f"{label} has no dropout"
    return None


def unsupported_reason(name: str, direction: str, prob: DenseProblem | VarlenProblem,
                       cfg: Backend | None) -> str | None:
    """Why backend ``name`` cannot run ``direction`` ("forward"/"backward") of ``prob``; None if it can."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown backend {name!r}")
    c = CAPABILITIES[name]
    if c.dtypes is not None and prob.dtype not in c.dtypes:
        return f"dtype {prob.dtype} (FFPA kernels take fp16/bf16)"
    if prob.dv != prob.d and name != "sdpa":
        return f"value head dim {prob.dv} != query/key head dim {prob.d}"
    if name == "sdpa":
        return None
    if direction == "backward" and not c.backward:
        return "the CUDA backend is forward-only"
    if name == "cutedsl":
        fwd_dims, bwd_dims, _ = _cute_dims()
        dims = fwd_dims if direction == "forward" else bwd_dims
        if prob.d not in dims:
            have = ", ".join(map(str, sorted(dims))) or "none yet"
            return f"head dim D={prob.d} has no CuTeDSL {direction} kernel (built: {have})"
    else:
        lo, hi = c.head_dims
        if not lo <= prob.d <= hi:
            what = "the Triton kernels'" if name == "triton" else "the CUDA kernel's"
            return f"head dim D={prob.d} outside {what} range [{lo}, {hi}]"
    return _features(name, direction, prob)


def check_backend_config(cfg: Backend | None, prob: DenseProblem | VarlenProblem) -> None:
    """Config errors that depend on the inputs (ValueError), e.g. bf16 with CUDABackend(acc='f16')."""
    if isinstance(cfg, CUDABackend) and cfg.acc == "f16" and prob.dtype == torch.bfloat16:
        raise ValueError("CUDABackend(acc='f16') needs fp16 inputs: there is no bf16 mma with an f16 "
                         "accumulator; use acc='f32' for bf16")


__all__ = ["Capability", "CAPABILITIES", "KERNEL_MODULES", "TRITON_D_RANGE", "CUDA_D_RANGE", "device_capability",
           "backend_available", "unsupported_reason", "check_backend_config"]

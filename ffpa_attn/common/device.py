"""Device facts every backend and the planner read, from one place: compute capability, SM count, opt-in shared
memory per block, a file-name-safe GPU name, and whether the Triton interpreter runs the kernels.

Each fact of a CUDA device is read once per device index. The caches are plain dicts (not ``functools.lru_cache``),
so torch.compile traces a caller such as the planner without warnings. Off-GPU (``device`` None or not CUDA) each
function returns the value documented for it, so that interpreter runs plan small grids.
"""
from __future__ import annotations

import os

import torch

# per CUDA device index; filled together by _read_properties
_CAPABILITY: dict[int, tuple[int, int]] = {}
_SM_COUNT: dict[int, int] = {}
_SMEM_OPTIN: dict[int, int] = {}
_NAME: dict[int, str] = {}

# opt-in shared memory per block by compute-capability major, for a torch whose properties lack it
_SMEM_BY_MAJOR = {8: 163 * 1024, 9: 227 * 1024, 10: 227 * 1024, 12: 99 * 1024}
OFF_GPU_SMEM = 227 * 1024
OFF_GPU_SM_COUNT = 4


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (Triton kernels run on the CPU; set it before importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on_gpu(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


def _safe_name(name: str) -> str:
    """``name`` with each run of characters outside ``[A-Za-z0-9_.-]`` replaced by one ``_``, stripped of ``_``.

    A plain loop, not ``re.sub``: the planner reads device facts inside torch.compile'd calls, and when the first
    read of a process happens there dynamo must trace it; it cannot trace the ``re`` module's compiler."""
    parts: list[str] = []
    gap = False
    for ch in name:
        if ch in _NAME_CHARS:
            if gap:
                parts.append("_")
                gap = False
            parts.append(ch)
        else:
            gap = True
    return "".join(parts).strip("_")


def _properties(index: int):
    """torch's properties of CUDA device ``index`` (dynamo folds this call into a constant)."""
    return torch.cuda.get_device_properties(index)


def _read_properties(index: int) -> None:
    props = _properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None) or \
        getattr(props, "max_shared_memory_per_block_optin", None) or _SMEM_BY_MAJOR.get(props.major, 99 * 1024)
    _SMEM_OPTIN[index] = int(smem)
    _SM_COUNT[index] = int(props.multi_processor_count)
    _NAME[index] = _safe_name(props.name)
    _CAPABILITY[index] = (int(props.major), int(props.minor))


def _fact(table: dict, device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in table:
        _read_properties(index)
    return table[index]


def capability(device: torch.device | None) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None for any other device."""
    return _fact(_CAPABILITY, device) if _on_gpu(device) else None


def capability_major(device: torch.device | None) -> int:
    """The major compute capability of a CUDA device (9 on Hopper); 0 for any other device."""
    return _fact(_CAPABILITY, device)[0] if _on_gpu(device) else 0


def sm_count(device: torch.device | None) -> int:
    """Streaming multiprocessors of a CUDA device; :data:`OFF_GPU_SM_COUNT` (4) off-GPU (keeps interpreter grids
    small)."""
    return _fact(_SM_COUNT, device) if _on_gpu(device) else OFF_GPU_SM_COUNT


def smem_limit(device: torch.device | None) -> int:
    """Opt-in shared memory per block in bytes (232448 on H100/H200, 166912 on A100); :data:`OFF_GPU_SMEM`
    (227 KiB) off-GPU."""
    return _fact(_SMEM_OPTIN, device) if _on_gpu(device) else OFF_GPU_SMEM


def gpu_name(device: torch.device | None) -> str:
    """A file-name-safe name of the GPU (``"NVIDIA_H200"``); ``"interpreter"`` / ``"cpu"`` off-GPU."""
    if not _on_gpu(device):
        return "interpreter" if interpreter_on() else "cpu"
    return _fact(_NAME, device)


def is_capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream (never creates a CUDA context; False with a
    torch built without CUDA). Code that would read tensor values on the host, keep device tensors between calls or
    compile asks this first: a capture cannot wait for the device, and its allocations belong to the graph."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # a torch built without CUDA
        return False


__all__ = ["interpreter_on", "capability", "capability_major", "sm_count", "smem_limit", "gpu_name", "is_capturing"]

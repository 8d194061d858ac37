"""Device facts every backend asks: the SM count, and whether the Triton interpreter runs the kernels."""
from __future__ import annotations

import functools
import os

import torch


def interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (Triton kernels run on the CPU; set it before importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_CAPS: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device, None for other devices (a plain dict cache, so that
    torch.compile traces the planner's calls without a graph break)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPS:
        _CAPS[index] = torch.cuda.get_device_capability(index)
    return _CAPS[index]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 off-GPU (keeps interpreter grids small)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["interpreter_on", "capability", "sm_count"]

"""The user-visible warning of an implicit fallback to torch SDPA (the package's one fallback warning class).

:class:`FFPAFallbackWarning` is also what the transformers binding (:mod:`ffpa_attn.integrations.transformers`)
warns with when a layer runs on another attention implementation, so one filter silences both.

A call that names no backend and lands on SDPA although its head dim is in the FFPA range
(256 < D <= 1024) on a CUDA device loses the large-head-dim kernels: typically 3-6x in time. The planner
reports that once per distinct reason with :class:`FFPAFallbackWarning`, naming the reason and what would
fix it. Filter it like any warning::

    import warnings, ffpa_attn
    warnings.filterwarnings("ignore", category=ffpa_attn.FFPAFallbackWarning)

CPU calls never warn: on a CPU there is no fast path to lose (the Triton kernels run there only under
the interpreter, a test mode much slower than SDPA), so SDPA is the right choice and not a loss. Head dims
outside the range never warn either: SDPA is the library's documented path for them.
"""
from __future__ import annotations

import os
import warnings

import torch

from ._version import __distribution__
from .contract import in_ffpa_range

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def install_command(extra: str | None = None) -> str:
    """``pip install '<distribution>[extra]'``: how a user gets an optional part of this package."""
    return f"pip install '{__distribution__}[{extra}]'" if extra else f"pip install {__distribution__}"


_WARNED: set[str] = set()

# (a phrase of the planner's reason, what the user can do about it), first match wins
_FIXES = (
    ("nvidia-cutlass-dsl is not installed", install_command("cute")),
    ("triton is not installed", "pip install 'triton>=3.4'"),
    ("compute capability", "the FFPA kernels need an sm80 or newer GPU (sm90 for the CuTeDSL ones)"),
    ("dropout", "pass backend='triton' (its forward and backward share one dropout RNG)"),
)
_GENERIC_FIX = ("name a backend (e.g. backend='triton') to get an error that says what it lacks, or see "
                "ffpa_attn.explain(...) for the plan")


class FFPAFallbackWarning(UserWarning):
    """Work that could have run on an FFPA kernel ran elsewhere (issued once per reason): an ffpa-attn call with
    256 < D <= 1024 on a CUDA device ran torch SDPA because no backend was named and none could take it, or a
    layer of an ``attn_implementation="ffpa"`` transformers model ran another attention implementation."""


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points the warning at the first frame outside this package (the user's call)."""
    import sys

    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def fix_for(reason: str) -> str:
    """What a user can do about a fallback with this planner ``reason``."""
    return next((fix for phrase, fix in _FIXES if phrase in reason), _GENERIC_FIX)


def warn_sdpa_fallback(device: torch.device, head_dim: int, reason: str) -> bool:
    """Warn once per ``reason`` that an implicit call on ``device`` with ``head_dim`` falls back to SDPA;
    only for CUDA devices and 256 < D <= 1024 (see the module docstring). Returns whether it warned."""
    if device.type != "cuda" or not in_ffpa_range(head_dim) or reason in _WARNED:
        return False
    _WARNED.add(reason)
    warnings.warn(f"ffpa_attn: head dim {head_dim} falls back to torch SDPA (slower, typically 3-6x at this "
                  f"head dim): {reason}. Fix: {fix_for(reason)}.", FFPAFallbackWarning,
                  stacklevel=_caller_stacklevel())
    return True

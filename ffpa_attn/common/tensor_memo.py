"""Values derived from tensors, reused while the same tensor objects are alive and unchanged.

A model builds ``cu_seqlens`` once per batch and passes the same tensors to every layer, forward and backward.
Whatever a call derives from them (the boundary check, which reads them on the host -- a device sync; the
CuTeDSL work lists, a dozen tiny kernels) is the same for every layer, so it is kept here keyed by the tensors'
identity and version counter: another object, or the same one changed in place, is a miss. Inference-mode
tensors have no version counter and are never memoised; nothing is stored while a CUDA graph is being captured
(a tensor made during capture lives in the graph's memory pool).
"""
from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

_MISSING = object()


def _stamp(tensors: Sequence[torch.Tensor]) -> tuple | None:
    """(weak reference, version) of each tensor, or None when one has no version counter (inference mode)."""
    try:
        return tuple((weakref.ref(t), t._version) for t in tensors)
    except (RuntimeError, TypeError):
        return None


def _capturing(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()


class TensorMemo:
    """At most ``capacity`` values, each keyed by tensors (identity + version) and hashable extras; the oldest
    entry goes first, and entries whose tensors died are dropped at the next store."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: list[tuple[tuple, Hashable, Any]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def get(self, tensors: Sequence[torch.Tensor], extra: Hashable, default: Any = None) -> Any:
        """The value stored for these very tensors, unchanged since, with an equal ``extra``; else ``default``."""
        for stamp, ex, value in self._entries:
            if ex == extra and len(stamp) == len(tensors) and all(
                    ref() is t and ver == t._version for (ref, ver), t in zip(stamp, tensors)):
                return value
        return default

    def put(self, tensors: Sequence[torch.Tensor], extra: Hashable, value: Any) -> None:
        """Keep ``value`` for these tensors and ``extra`` (a no-op for inference tensors and during graph
        capture)."""
        stamp = _stamp(tensors)
        if stamp is None or _capturing(tensors):
            return
        live = [e for e in self._entries if all(ref() is not None for ref, _ in e[0])]
        self._entries = (live + [(stamp, extra, value)])[-self.capacity:]

    def get_or_compute(self, tensors: Sequence[torch.Tensor], extra: Hashable, compute: Any) -> Any:
        """``get``, else ``compute()`` stored with ``put`` and returned."""
        value = self.get(tensors, extra, _MISSING)
        if value is _MISSING:
            value = compute()
            self.put(tensors, extra, value)
        return value


__all__ = ["TensorMemo"]

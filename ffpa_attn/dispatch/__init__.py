"""The dispatch: what each backend can run (:mod:`.capabilities`), what measured faster (:mod:`.heuristics`),
and the choice per direction of one call (:mod:`.planner`).

The planner's names are resolved on first use (PEP 562): importing :mod:`.heuristics` alone, as the kernel
packages do for their tuned values (also in the torch-free CuTeDSL compile server), imports neither the planner
nor torch."""
from __future__ import annotations

from typing import Any

__all__ = ["Choice", "Plan", "plan"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

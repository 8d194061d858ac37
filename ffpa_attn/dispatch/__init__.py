"""The dispatch: what each backend can run (:mod:`.registry`, collected from each backend package's own
description), what measured faster (:mod:`.heuristics`, with the wave arithmetic of :mod:`.waves`), and the choice
per direction of one call (:mod:`.planner`).

The planner's names are resolved on first use (PEP 562), so importing :mod:`.registry` or :mod:`.heuristics` alone
imports neither the planner nor the public configs."""
from __future__ import annotations

from typing import Any

__all__ = ["KernelChoice", "Plan", "plan"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

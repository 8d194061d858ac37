"""The dispatch: what each backend can run (:mod:`.capabilities`), what measured faster (:mod:`.heuristics`),
and the choice per direction of one call (:mod:`.planner`)."""
from __future__ import annotations

from .planner import Choice, Plan, plan

__all__ = ["Choice", "Plan", "plan"]

"""The measurement history: one JSON line per measured number, appended after every benchmark run.

``bench/results/<gpu>.json`` holds the latest run only; ``bench/results/history.jsonl`` keeps every run that was
appended to it, one row per (case, implementation, direction, metric), so a plot or a regression check can read
it with ``json.loads`` per line (or ``pandas.read_json(path, lines=True)``) without knowing the run format::

    {"date": "2026-12-01T16:44:57Z", "commit": "73c7744...", "device": "NVIDIA H200",
     "command": "python -m ffpa_attn --out ...", "case": "B1 H32/32 N8192 D512 bf16 causal",
     "impl": "cutedsl", "direction": "fwd", "metric": "tflops", "value": 511.2}

Only measured cells (status ``ok``) give rows. A run is identified by (date, commit, command): appending the
same run twice adds nothing, so re-appending a saved run is safe.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .results import BenchRun, Case

# the metrics a row can carry, in the order they are written
METRICS = ("tflops", "ms", "speedup", "err", "peak_mib", "first_call_s")


def case_key(case: Case) -> str:
    """The case column: the shape plus the causal flag, e.g. ``B1 H32/8 N8192 D512 bf16 causal``."""
    return f"{case.shape()} {'causal' if case.causal else 'full'}"


def _commit(meta: dict[str, Any]) -> str:
    commit = str(meta.get("commit", "unknown"))
    return commit + "-dirty" if meta.get("commit_dirty") else commit


def _round(value: float) -> float:
    """Six significant digits: far below run-to-run noise, and it keeps the file small."""
    return float(f"{value:.6g}")


def history_rows(run: BenchRun) -> list[dict[str, Any]]:
    """The history rows of one run: one per metric of every ``ok`` cell (metrics that are None are left out)."""
    meta = run.meta
    head = {"date": meta.get("date", "unknown"), "commit": _commit(meta),
            "device": meta.get("gpu_name") or meta.get("device", "unknown"), "command": meta.get("command", "")}
    rows = []
    for cell in run.cells:
        if cell.status != "ok":
            continue
        for metric in METRICS:
            value = getattr(cell, metric)
            if value is not None:
                rows.append({**head, "case": case_key(cell.case), "impl": cell.impl,
                             "direction": cell.direction, "metric": metric, "value": _round(value)})
    return rows


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a history file (an absent file has none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_history(run: BenchRun, path: str | Path) -> int:
    """Append ``run``'s rows to the JSON-lines file ``path`` (created with its folder if absent).

    Returns the number of rows written: 0 when a run with the same (date, commit, command) is already there.
    """
    return append_rows(history_rows(run), path)


def append_rows(rows: list[dict[str, Any]], path: str | Path) -> int:
    """Append history ``rows`` of one run (each with the run's date, commit and command) to ``path``; 0 rows
    written when that run is already there."""
    path = Path(path)
    if not rows:
        return 0
    key = (rows[0]["date"], rows[0]["commit"], rows[0]["command"])
    if any((r.get("date"), r.get("commit"), r.get("command")) == key for r in read_history(path)):
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return len(rows)


__all__ = ["METRICS", "append_history", "append_rows", "case_key", "history_rows", "read_history"]

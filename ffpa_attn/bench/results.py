"""The benchmark's data model: one :class:`Case` per problem shape, one :class:`Cell` per
(implementation, case, direction), and the :class:`BenchRun` that holds them with the run's metadata.

Everything here is plain data (JSON round-trips through :meth:`BenchRun.to_json` /
:meth:`BenchRun.from_json`), so the table, Markdown and plot writers can be fed a saved or fake run.

Metrics (docs/design.md):

* forward FLOPs = ``4 * B * Hq * Nq * Nkv * D``, halved when causal;
* forward TFLOPS = FLOPs / t(fwd);
* backward TFLOPS = 2.5 * FLOPs / (t(fwd+bwd) - t(fwd));
* speedup = TFLOPS / TFLOPS of the baseline implementation (SDPA's memory-efficient kernel) on the
  same case and direction.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BASELINE_IMPL = "sdpa-efficient"
STATUSES = ("ok", "n/a", "error", "skipped")
BWD_FLOP_FACTOR = 2.5


@dataclass(frozen=True)
class Case:
    """One problem shape: q ``[b, hq, nq, d]``, k/v ``[b, hkv, nkv, d]``, dtype name ``bf16``/``fp16``."""

    d: int
    causal: bool
    b: int = 1
    hq: int = 32
    hkv: int = 32
    nq: int = 8192
    nkv: int = 8192
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if min(self.d, self.b, self.hq, self.hkv, self.nq, self.nkv) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.hq % self.hkv:
            raise ValueError(f"hq={self.hq} is not a multiple of hkv={self.hkv}")
        if self.causal and self.nkv < self.nq:
            raise ValueError(f"causal needs nkv >= nq (got nq={self.nq}, nkv={self.nkv})")

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA)."""
        return self.hq // self.hkv

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def flops(self) -> float:
        """Forward FLOPs: 4*B*Hq*Nq*Nkv*D, x0.5 when causal."""
        f = 4.0 * self.b * self.hq * self.nq * self.nkv * self.d
        return f * 0.5 if self.causal else f

    def label(self) -> str:
        """Short human label, e.g. ``D=512 causal 32/8``."""
        heads = f" {self.hq}/{self.hkv}" if self.hkv != self.hq else ""
        return f"D={self.d} {'causal' if self.causal else 'full'}{heads}"

    def shape(self) -> str:
        """e.g. ``B1 H32/8 N8192x8192 D512 bf16``."""
        n = f"N{self.nq}" if self.nq == self.nkv else f"N{self.nq}x{self.nkv}"
        return f"B{self.b} H{self.hq}/{self.hkv} {n} D{self.d} {self.dtype}"


def fwd_tflops(case: Case, ms: float) -> float:
    """Forward TFLOPS from the forward time in milliseconds."""
    return case.flops() / (ms * 1e-3) / 1e12


def bwd_tflops(case: Case, bwd_ms: float) -> float:
    """Backward TFLOPS from the backward-only time (t(fwd+bwd) - t(fwd)) in milliseconds."""
    return BWD_FLOP_FACTOR * case.flops() / (bwd_ms * 1e-3) / 1e12


@dataclass
class Cell:
    """One measurement (or the reason there is none).

    Attributes:
        impl: implementation name (``triton``, ``sdpa-efficient``, ...).
        case: the problem shape.
        direction: ``fwd`` or ``bwd``.
        status: ``ok``, ``n/a`` (cannot run this shape; ``note`` says why), ``error`` (it raised; ``note``
            holds the error) or ``skipped`` (deliberately not run, e.g. too slow or out of time budget).
        ms: median time of the direction (for ``bwd``: t(fwd+bwd) - t(fwd)).
        tflops: see the module docstring; speedup: vs the baseline implementation (filled by the run).
        err: worst relative error vs the fp32 reference on the checked slice (``errs`` per tensor).
        peak_mib: peak CUDA memory allocated during one call above what was allocated before it.
        first_call_s: wall time of the first call (includes compilation / autotuning).
        reps: number of timed runs behind the median.
        kernel: what ran (``ffpa_attn.explain`` for our backends).
        note: reason / error text / remark.
        source: in a table merged from several sweeps (:func:`merge_runs`), the index of the sweep that measured
            this cell in ``meta["sources"]``; None in a single run.
    """

    impl: str
    case: Case
    direction: str
    status: str
    ms: float | None = None
    tflops: float | None = None
    speedup: float | None = None
    err: float | None = None
    errs: dict[str, float] = field(default_factory=dict)
    peak_mib: float | None = None
    first_call_s: float | None = None
    reps: int = 0
    kernel: str = ""
    note: str = ""
    source: int | None = None

    def __post_init__(self) -> None:
        if self.direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {self.direction!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = asdict(self.case)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cell":
        d = dict(d)
        d["case"] = Case(**d["case"])
        return cls(**d)


@dataclass
class BenchRun:
    """A whole benchmark run: metadata (command, commit, date, GPU, versions, ...) and its cells."""

    meta: dict[str, Any]
    cells: list[Cell] = field(default_factory=list)
    impls: list[str] = field(default_factory=list)
    baseline: str = BASELINE_IMPL

    def add(self, cell: Cell) -> None:
        if cell.impl not in self.impls:
            self.impls.append(cell.impl)
        self.cells.append(cell)

    def cases(self) -> list[Case]:
        """Distinct cases in first-seen order."""
        seen: dict[Case, None] = {}
        for c in self.cells:
            seen.setdefault(c.case, None)
        return list(seen)

    def cell(self, impl: str, case: Case, direction: str) -> Cell | None:
        for c in self.cells:
            if c.impl == impl and c.case == case and c.direction == direction:
                return c
        return None

    def has_direction(self, direction: str) -> bool:
        return any(c.direction == direction for c in self.cells)

    def on_gpu(self) -> bool:
        """Whether the run measured on a CUDA device (``meta["device"]``; older runs: a GPU in the metadata)."""
        device = self.meta.get("device")
        return device == "cuda" if device else bool(self.meta.get("gpu"))

    def fill_speedups(self) -> None:
        """Set ``speedup`` of every ok cell relative to the baseline implementation's ok cell (GPU runs only: the
        CPU times of a dry run compare interpreters, not kernels)."""
        for c in self.cells:
            if not self.on_gpu():
                c.speedup = None
                continue
            base = self.cell(self.baseline, c.case, c.direction)
            if c.status == "ok" and base is not None and base.status == "ok" and base.tflops and c.tflops:
                c.speedup = c.tflops / base.tflops
            else:
                c.speedup = None

    def to_json(self) -> str:
        data = {"meta": self.meta, "baseline": self.baseline, "impls": self.impls,
                "cells": [c.to_dict() for c in self.cells]}
        return json.dumps(data, indent=1, sort_keys=False, default=str)

    @classmethod
    def from_json(cls, text: str) -> "BenchRun":
        """The run :meth:`to_json` wrote.

        Raises:
            ValueError: the text is not JSON, or not a results object (a ``meta`` object and a ``cells`` list).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a benchmark results file (not JSON: {exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("meta"), dict) \
                or not isinstance(data.get("cells"), list):
            raise ValueError("not a benchmark results file (expected a JSON object with 'meta' and 'cells')")
        cells = [Cell.from_dict(c) for c in data["cells"]]
        return cls(meta=data.get("meta", {}), cells=cells, impls=list(data.get("impls", [])),
                   baseline=data.get("baseline", BASELINE_IMPL))


_SOURCE_KEYS = ("command", "commit", "commit_dirty", "date", "wall_s")


def _sweeps_of(run: BenchRun) -> tuple[list[dict[str, Any]], list[int]]:
    """The sweeps a run holds (one, or a merged table's ``meta["sources"]``) and each cell's index into them."""
    if not run.meta.get("sources"):
        return [{k: run.meta.get(k) for k in _SOURCE_KEYS}], [0] * len(run.cells)
    n = len(run.meta["sources"])
    if any(c.status != "skipped" and (c.source is None or not 0 <= c.source < n) for c in run.cells):
        raise ValueError("a merged table whose cells do not name their sweep cannot be merged again (merge its "
                         "sweeps instead)")
    return ([{k: s.get(k) for k in _SOURCE_KEYS} for s in run.meta["sources"]],
            [-1 if c.source is None else c.source for c in run.cells])


def merge_runs(runs: Sequence[BenchRun]) -> BenchRun:
    """One table from several runs on the same GPU (e.g. a sweep split in parts to fit a time limit).

    A later run's cell replaces an earlier one for the same (implementation, case, direction) unless the later
    cell was only ``skipped`` (a part run with a narrower case list or an exhausted time budget says nothing about
    that cell). The metadata is the first run's, with ``meta["sources"]``: per sweep its command, commit, date and
    wall time and the cases it measured (ok cells that made it into the merged table); each cell's ``source`` is
    its sweep's index there, so the report can say where each number comes from. A merged table can be merged
    again (with newer sweeps): its sweeps stay separate.

    Raises:
        ValueError: no runs, runs from different GPUs (their numbers do not belong in one table), or a merged
            input whose cells do not name their sweep.
    """
    if not runs:
        raise ValueError("merge_runs needs at least one run")
    gpus = {r.meta.get("gpu_name") for r in runs}
    if len(gpus) > 1:
        raise ValueError(f"cannot merge runs from different GPUs: {sorted(map(str, gpus))}")
    sweeps: list[dict[str, Any]] = []
    cells: dict[tuple[str, Case, str], tuple[int, Cell]] = {}
    impls: list[str] = []
    for run in runs:
        own, index = _sweeps_of(run)
        for name in run.impls:
            if name not in impls:
                impls.append(name)
        for c, j in zip(run.cells, index):
            key = (c.impl, c.case, c.direction)
            if key in cells and c.status == "skipped":
                continue
            cells[key] = (len(sweeps) + j if j >= 0 else -1, c)
        sweeps += own
    # keep the sweeps that still own a cell with an outcome, renumbered in their order (a "skipped" cell says
    # nothing, so it names no sweep unless its own sweep stays)
    used = sorted({i for i, c in cells.values() if c.status != "skipped"})
    renumber = {old: new for new, old in enumerate(used)}
    sources = [sweeps[i] | {"cases": []} for i in used]
    merged = BenchRun(meta=dict(runs[0].meta), impls=impls, baseline=runs[0].baseline)
    for i, c in cells.values():
        c = replace(c, source=renumber.get(i))
        merged.cells.append(c)
        if c.status == "ok" and c.case.label() not in sources[c.source]["cases"]:
            sources[c.source]["cases"].append(c.case.label())
    merged.meta["sources"] = sources
    merged.fill_speedups()
    return merged

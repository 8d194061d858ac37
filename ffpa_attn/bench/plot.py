"""PNG plots of a :class:`~ffpa_attn.bench.results.BenchRun`.

:func:`write_plot` draws two figures:

* ``PATH`` (the headline): what a user gets without naming a backend, ``ffpa (default)``, against the SDPA
  baseline and every peer. Top row: TFLOPS vs head dim D; bottom row: speedup over SDPA (the run's baseline,
  1.0 marked); one column per direction (forward, backward).
* ``PATH`` with ``-backends`` before the suffix: TFLOPS of each of our backends named explicitly (Triton,
  CuTeDSL, CUDA) next to the default and the baseline.

One colour per implementation (the legend, outside the axes, has one entry per implementation); line style and
marker encode the case: solid = full, dashed = causal, circle = MHA, square = GQA. An implementation that
failed or could not run is never left out silently: a cell that failed is an ``x`` on the axis at its D, and
the legend entry of an implementation without any measurement says why (``failed: ...``, ``n/a: ...``). A
dry run on the CPU says so in the title. Needs matplotlib (the ``bench`` extra); raises ImportError without it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .impls import DEFAULT_IMPL, OUR_BACKENDS
from .results import BenchRun

DEFAULT_LABEL = "ffpa (default)"
_NOTE_CHARS = 60


def _label(impl: str) -> str:
    return DEFAULT_LABEL if impl == DEFAULT_IMPL else impl


def _status_note(run: BenchRun, impl: str) -> str | None:
    """Why ``impl`` has no measurement at all (None when it has one)."""
    cells = [c for c in run.cells if c.impl == impl]
    if any(c.status == "ok" for c in cells):
        return None
    if impl in run.meta.get("left_out", {}):
        return f"not run: {run.meta['left_out'][impl]}"
    failed = next((c for c in cells if c.status == "error"), None) or next(iter(cells), None)
    if failed is None:
        return "not run"
    word = {"error": "failed", "n/a": "n/a", "skipped": "skipped"}.get(failed.status, failed.status)
    note = " ".join(failed.note.split())
    if "cannot import" in note:
        word, note = "not importable", note.split(":", 1)[-1].strip()
    note = note if len(note) <= _NOTE_CHARS else note[: _NOTE_CHARS - 3] + "..."
    return f"{word}: {note}" if note else word


def legend_entries(run: BenchRun, impls: Sequence[str]) -> list[tuple[str, str, bool]]:
    """``(impl, legend label, has a measurement)`` per implementation; the label of one without any measurement
    says why (``failed: ...``, ``n/a: ...``, ``not importable: ...``, ``not run: ...``)."""
    out = []
    for impl in impls:
        note = _status_note(run, impl)
        out.append((impl, _label(impl) + (f" ({note})" if note else ""), note is None))
    return out


def _ok_points(run: BenchRun, impl: str, direction: str, value) -> dict[tuple[bool, int], list[tuple[int, float]]]:
    """(causal, group) -> sorted [(D, value(cell))] over the ok cells with a value."""
    out: dict[tuple[bool, int], list[tuple[int, float]]] = {}
    for c in run.cells:
        if c.impl == impl and c.direction == direction and c.status == "ok":
            y = value(c)
            if y is not None:
                out.setdefault((c.case.causal, c.case.group), []).append((c.case.d, y))
    return {k: sorted(v) for k, v in out.items()}


def _failed_ds(run: BenchRun, impl: str, direction: str) -> list[int]:
    return sorted({c.case.d for c in run.cells if c.impl == impl and c.direction == direction
                   and c.status == "error"})


def title(run: BenchRun, what: str) -> str:
    """The figure title: device, shape, commit, date; a CPU dry run says so first."""
    m = run.meta
    cases = run.cases()
    shape = ""
    if cases:
        c = cases[0]
        shape = f"B={c.b} Hq={c.hq} Nq={c.nq} Nkv={c.nkv} {c.dtype}"
    commit = str(m.get("commit", "unknown"))
    stamp = ("" if commit == "unknown" else f"commit {commit[:10]}"
             + (" + uncommitted changes" if m.get("commit_dirty") else "") + ", ") + str(m.get("date", "?"))
    if m.get("sources"):  # merged from several sweeps (results.merge_runs): the report lists them
        src = m["sources"]
        commits = sorted({str(s.get("commit", "unknown"))[:10] for s in src})
        dates = sorted({str(s.get("date", "?"))[:10] for s in src})
        stamp = f"{len(src)} sweeps, commits {', '.join(commits)}, {', '.join(dates)}"
    head = f"ffpa-attn {what}: {m.get('gpu_name', '?')}  {shape}  ({stamp})"
    if not run.on_gpu():
        head = ("DRY RUN on the CPU (Triton interpreter, tiny shapes): the times say nothing about speed\n"
                + head)
    return head


def _draw(run: BenchRun, impls: Sequence[str], rows: Sequence[str], path: Path, what: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    directions = [d for d in ("fwd", "bwd") if run.has_direction(d)] or ["fwd"]
    n_entries = len(impls) + 5
    legend_in = 0.22 * -(-n_entries // 2) + 0.3  # inches below the axes for a two-column legend
    fig, axes = plt.subplots(len(rows), len(directions),
                             figsize=(max(11.0, 6.2 * len(directions)), 3.9 * len(rows) + legend_in + 0.6),
                             squeeze=False)
    colours = plt.get_cmap("tab10")
    colour = {impl: colours(i % 10) for i, impl in enumerate(impls)}
    all_d = sorted({c.d for c in run.cases()})
    styles_used: set[tuple[bool, int]] = set()
    any_failed = False
    for col, direction in enumerate(directions):
        for row, kind in enumerate(rows):
            ax = axes[row][col]
            value = (lambda c: c.tflops) if kind == "tflops" else (lambda c: c.speedup)
            drawn = False
            for impl in impls:
                if kind == "speedup" and impl == run.baseline:
                    continue
                for (causal, group), pts in sorted(_ok_points(run, impl, direction, value).items()):
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, linestyle="--" if causal else "-", marker="s" if group > 1 else "o",
                            markersize=4, color=colour[impl], linewidth=1.6 if impl == DEFAULT_IMPL else 1.1)
                    styles_used.add((causal, group))
                    drawn = True
                failed = _failed_ds(run, impl, direction) if kind == "tflops" else []
                if failed:  # on the x axis (data x, axes y), where no measured value can sit
                    ax.plot(failed, [0.03] * len(failed), linestyle="none", marker="x", markersize=7,
                            color=colour[impl], transform=ax.get_xaxis_transform())
                    any_failed = True
            name = "forward" if direction == "fwd" else "backward (2.5x fwd FLOPs)"
            if kind == "tflops":
                ax.set_ylabel("TFLOPS")
                ax.set_title(name, fontsize=10)
            else:
                ax.axhline(1.0, color="grey", linewidth=0.8)
                ax.set_ylabel(f"speedup over {run.baseline}")
                ax.set_title(f"{name}: speedup over SDPA", fontsize=10)
            ax.set_xlabel("head dim D")
            if all_d:
                pad = max(16, (all_d[-1] - all_d[0]) * 0.05)
                ax.set_xlim(all_d[0] - pad, all_d[-1] + pad)
                ax.set_xticks(all_d)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if not drawn:
                why = ("no speedups: a CPU dry run compares no kernels" if kind == "speedup" and not run.on_gpu()
                       else "no measurements")
                ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    handles: list[Any] = []
    for impl, label, measured in legend_entries(run, impls):
        handles.append(Line2D([], [], color=colour[impl], marker="o" if measured else "x",
                              linestyle="-" if measured else "none", label=label))
    style_key = [Line2D([], [], color="black", linestyle="-", label="full"),
                 Line2D([], [], color="black", linestyle="--", label="causal")]
    if any(group > 1 for _, group in styles_used):
        style_key += [Line2D([], [], color="black", marker="o", linestyle="none", label="MHA"),
                      Line2D([], [], color="black", marker="s", linestyle="none", label="GQA")]
    if any_failed:
        style_key.append(Line2D([], [], color="black", marker="x", linestyle="none", label="failed at this D"))
    fig.legend(handles=handles + style_key, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title(run, what), fontsize=9)
    # the legend lives in a bottom margin of its own: the axes never sit under it
    top_in = 0.45 if run.on_gpu() else 0.65
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, legend_in / height, 1, 1 - top_in / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.2)  # long legend labels are never cut
    plt.close(fig)
    return path


def backends_path(path: str | Path) -> Path:
    """Where :func:`write_plot` puts the per-backend figure next to ``path``: ``x.png`` -> ``x-backends.png``."""
    path = Path(path)
    return path.with_name(f"{path.stem}-backends{path.suffix or '.png'}")


def headline_impls(run: BenchRun) -> list[str]:
    """The default, the baseline, then every peer of the run (not our explicitly named backends)."""
    names = [i for i in run.impls if i not in OUR_BACKENDS]
    front = [i for i in (DEFAULT_IMPL, run.baseline) if i in names]
    left_out = [i for i in run.meta.get("left_out", {}) if i not in names]
    return front + [i for i in names if i not in front] + left_out


def backend_impls(run: BenchRun) -> list[str]:
    """Our backends named explicitly, with the default and the baseline for reference."""
    return [i for i in (DEFAULT_IMPL, *OUR_BACKENDS, run.baseline) if i in run.impls]


def write_plot(run: BenchRun, path: str | Path) -> Path:
    """Draw the headline figure to ``path`` and the per-backend figure to :func:`backends_path` (PNG); returns
    ``path``."""
    path = Path(path)
    _draw(run, headline_impls(run), ("tflops", "speedup"), path, "bench, default vs SDPA and peers")
    if backend_impls(run):
        _draw(run, backend_impls(run), ("tflops",), backends_path(path), "bench, each backend named")
    return path

"""PNG plot of a :class:`~ffpa_attn.bench.results.BenchRun`: TFLOPS vs head dim D.

One panel per direction (forward, backward); one colour per implementation; solid lines for full
attention, dashed for causal; circles for MHA cases, squares for GQA cases. Needs matplotlib (the
``bench`` extra); :func:`write_plot` raises ImportError without it.
"""
from __future__ import annotations

from pathlib import Path

from .results import BenchRun


def _series(run: BenchRun, direction: str) -> dict[tuple[str, bool, int], list[tuple[int, float]]]:
    """(impl, causal, group) -> sorted [(D, TFLOPS)] of the ok cells."""
    out: dict[tuple[str, bool, int], list[tuple[int, float]]] = {}
    for c in run.cells:
        if c.direction == direction and c.status == "ok" and c.tflops is not None:
            out.setdefault((c.impl, c.case.causal, c.case.group), []).append((c.case.d, c.tflops))
    return {k: sorted(v) for k, v in out.items()}


def write_plot(run: BenchRun, path: str | Path) -> Path:
    """Draw the plot to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = [d for d in ("fwd", "bwd") if run.has_direction(d)]
    fig, axes = plt.subplots(1, len(directions), figsize=(6.5 * len(directions), 5.5), squeeze=False)
    colours = plt.get_cmap("tab10")
    order = {name: i for i, name in enumerate(run.impls)}
    all_d = sorted({c.d for c in run.cases()})
    for ax, direction in zip(axes[0], directions):
        series = _series(run, direction)
        for (impl, causal, group), pts in sorted(series.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0])):
            xs, ys = zip(*pts)
            label = f"{impl} {'causal' if causal else 'full'}" + (f" GQA {group}" if group > 1 else "")
            ax.plot(xs, ys, linestyle="--" if causal else "-", marker="s" if group > 1 else "o",
                    color=colours(order.get(impl, len(order)) % 10), label=label)
        ax.set_title("forward" if direction == "fwd" else "backward (2.5x fwd FLOPs)")
        ax.set_xlabel("head dim D")
        ax.set_ylabel("TFLOPS")
        if all_d:
            ax.set_xticks(all_d)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if not series:
            ax.text(0.5, 0.5, "no measurements", ha="center", va="center", transform=ax.transAxes)
    # one legend for both panels, below them: label -> handle over all panels
    handles: dict[str, object] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    cases = run.cases()
    shape = ""
    if cases:
        c = cases[0]
        shape = f"B={c.b} Hq={c.hq} Nq={c.nq} Nkv={c.nkv} {c.dtype}"
    fig.suptitle(f"ffpa-attn bench: {run.meta.get('gpu_name', '?')}  {shape}  "
                 f"(commit {str(run.meta.get('commit', 'unknown'))[:10]}, {run.meta.get('date', '?')})", fontsize=9)
    rows = max(1, -(-len(handles) // 4))
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, min(0.45, 0.05 * rows + 0.02), 1, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Text and Markdown reports of a :class:`~ffpa_attn.bench.results.BenchRun`.

Three parts, in both formats:

* summary: one row per case, one column per implementation, ``fwd / bwd`` TFLOPS (``n/a``, ``ERR``,
  ``skip`` where there is no number);
* details: one row per (implementation, case) with a measurement: times, TFLOPS, speedup vs the baseline,
  peak memory, errors vs the reference slice, first-call time, kernel;
* not measured: every n/a / error / skipped cell grouped by implementation and reason.
"""
from __future__ import annotations

from typing import Sequence

from ..testing import TOL
from .results import BenchRun, Case, Cell, DTYPES

METHOD_COMMON = ("TFLOPS = 4·B·Hq·Nq·Nkv·D (×0.5 causal) / t(fwd); backward = 2.5× that / (t(fwd+bwd) − t(fwd)); "
                 "the same random inputs for every implementation; err = ‖x − ref‖/‖x_ref‖ on batch 0, query heads "
                 "of KV head 0, vs the fp32 reference (bwd: worst of dq, dk, dv); ! = above the test suite's "
                 "tolerance for the dtype (ffpa_attn.testing.TOL).")
METHOD_CUDA = ("Times: medians of triton.testing.do_bench (L2 cache cleared before every run, CUDA events) after "
               "warm-up; ×base = speedup vs {base}; peak = max CUDA memory allocated during one call above the inputs. ")
METHOD_CPU = ("Dry run on the CPU: wall-clock medians (time.perf_counter) of tiny shapes, the Triton kernels under "
              "the interpreter: they exercise the pipeline and check correctness, and say nothing about speed (no "
              "speedups, no memory figures). ")


def method(run: BenchRun) -> str:
    """The method footer, true for the device the run used (``meta["device"]``)."""
    if run.on_gpu():
        return METHOD_CUDA.format(base=run.baseline) + METHOD_COMMON
    return METHOD_CPU + METHOD_COMMON


def fmt_tflops(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt_num(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def fmt_err(cell: Cell | None) -> str:
    if cell is None or cell.err is None:
        return "-"
    flag = " !" if cell.err > TOL[DTYPES[cell.case.dtype]] else ""
    return f"{cell.err:.1e}{flag}"


def cell_text(cell: Cell | None) -> str:
    """The summary form of one cell."""
    if cell is None:
        return "-"
    return {"ok": fmt_tflops(cell.tflops), "n/a": "n/a", "error": "ERR", "skipped": "skip"}[cell.status]


def _impls_present(run: BenchRun) -> list[str]:
    have = {c.impl for c in run.cells}
    return [i for i in run.impls if i in have] + sorted(have - set(run.impls))


def summary_table(run: BenchRun) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the TFLOPS summary."""
    bwd = run.has_direction("bwd")
    # every implementation gets a column, also one that never ran (its cells say n/a / ERR / skip; "not
    # measured" says why): a failure never disappears from the table
    impls = _impls_present(run)
    headers = ["D", "causal", "heads", *impls]
    rows = []
    for case in run.cases():
        row = [str(case.d), "yes" if case.causal else "no", f"{case.hq}/{case.hkv}"]
        for impl in impls:
            f = cell_text(run.cell(impl, case, "fwd"))
            row.append(f"{f} / {cell_text(run.cell(impl, case, 'bwd'))}" if bwd else f)
        rows.append(row)
    return headers, rows


def details_table(run: BenchRun) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the per-measurement details."""
    headers = ["impl", "case", "fwd ms", "fwd TFLOPS", "fwd ×base", "bwd ms", "bwd TFLOPS", "bwd ×base",
               "peak MiB fwd/bwd", "err fwd", "err bwd", "first call s fwd/bwd", "kernel / note"]
    bwd = run.has_direction("bwd")
    rows = []
    for case in run.cases():
        for impl in _impls_present(run):
            f, b = run.cell(impl, case, "fwd"), run.cell(impl, case, "bwd")
            if not any(c is not None and c.status == "ok" for c in (f, b)):
                continue
            ok_f = f if f is not None and f.status == "ok" else None
            ok_b = b if b is not None and b.status == "ok" else None
            pair = (ok_f, ok_b) if bwd else (ok_f,)
            peak = "/".join(fmt_num(c.peak_mib if c else None, ".0f") for c in pair)
            first = "/".join(fmt_num(c.first_call_s if c else None, ".2g") for c in pair)
            notes = [ok_f.kernel if ok_f else (ok_b.kernel if ok_b else "")]
            notes += [c.note for c in (ok_f, ok_b) if c is not None and c.note]
            rows.append([
                impl, case.label(),
                fmt_ms(ok_f.ms if ok_f else None), fmt_tflops(ok_f.tflops if ok_f else None),
                fmt_num(ok_f.speedup if ok_f else None, ".2f"),
                fmt_ms(ok_b.ms if ok_b else None), fmt_tflops(ok_b.tflops if ok_b else None),
                fmt_num(ok_b.speedup if ok_b else None, ".2f"),
                peak, fmt_err(ok_f), fmt_err(ok_b), first, "; ".join(n for n in notes if n),
            ])
    return headers, rows


def _case_list(cases: Sequence[Case], all_cases: Sequence[Case]) -> str:
    if len(cases) == len(all_cases) and len(all_cases) > 1:
        return "all cases"
    return ", ".join(c.label() for c in cases)


def not_measured(run: BenchRun) -> list[str]:
    """One line per (implementation, status, reason) over the cells without a measurement."""
    groups: dict[tuple[str, str, str], dict[str, list[Case]]] = {}
    for c in run.cells:
        if c.status == "ok":
            continue
        per_dir = groups.setdefault((c.impl, c.status, c.note), {})
        per_dir.setdefault(c.direction, [])
        if c.case not in per_dir[c.direction]:
            per_dir[c.direction].append(c.case)
    lines = [f"{impl} [not run]: {why}" for impl, why in run.meta.get("left_out", {}).items()]
    all_cases = run.cases()
    for (impl, status, note), per_dir in groups.items():
        dirs = "+".join(per_dir)
        cases = per_dir[next(iter(per_dir))]
        lines.append(f"{impl} [{status}, {dirs}] {_case_list(cases, all_cases)}: {note or 'no reason given'}")
    return lines


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A plain aligned table, or a GitHub Markdown table."""
    if markdown:
        esc = [[str(x).replace("|", "\\|") for x in r] for r in rows]
        out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in esc]
        return "\n".join(out)
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def _describe(run: BenchRun) -> list[str]:
    m = run.meta
    v = m.get("versions", {})
    gpu = m.get("gpu") or {}
    dev = m.get("gpu_name", "?")
    if gpu:
        dev += f" (sm{str(gpu.get('capability', '?')).replace('.', '')}, {gpu.get('sm_count', '?')} SMs)"
    dirty = " (with uncommitted changes)" if m.get("commit_dirty") else ""
    up = m.get("upstream")
    if m.get("sources"):  # a table merged from several sweeps (merge_runs): where each row comes from
        runs = [f"sweep {i + 1}: `{s.get('command', '?')}`; commit {s.get('commit', 'unknown')}"
                f"{' (with uncommitted changes)' if s.get('commit_dirty') else ''}; date {s.get('date', '?')}; "
                f"wall time {s.get('wall_s', '?')} s; cases: {', '.join(s.get('cases') or ['none measured'])}"
                for i, s in enumerate(m["sources"])]
    else:
        runs = [f"command: `{m.get('command', '?')}`",
                f"commit: {m.get('commit', 'unknown')}{dirty}; date: {m.get('date', '?')}; "
                f"wall time: {m.get('wall_s', '?')} s"]
    return [
        *runs,
        f"device: {dev}",
        f"versions: torch {v.get('torch', '?')} (CUDA {v.get('cuda') or '-'}, cuDNN {v.get('cudnn') or '-'}), "
        f"triton {v.get('triton') or '-'}, cutlass-dsl {v.get('cutlass-dsl') or '-'}, "
        f"python {v.get('python', '?')}, ffpa_attn {v.get('ffpa_attn', '?')}",
        *( [f"upstream: public ffpa-attn {up}"] if up else [] ),
    ]


def text_report(run: BenchRun) -> str:
    """What the command prints at the end: details first, the summary last (the end of a long log is
    what a reader sees)."""
    parts: list[str] = []
    h, rows = details_table(run)
    if rows:
        parts += ["details:", render(h, rows), ""]
    missing = not_measured(run)
    if missing:
        parts += ["not measured:", *("  " + line for line in missing), ""]
    parts += [method(run), "", *_describe(run), "",
              "TFLOPS (fwd / bwd):" if run.has_direction("bwd") else "TFLOPS (fwd):", render(*summary_table(run))]
    return "\n".join(parts)


def markdown_report(run: BenchRun) -> str:
    """The Markdown file: metadata (command, commit, date, GPU, versions), tables, method."""
    title = f"# ffpa-attn benchmark: {run.meta.get('gpu_name', '?')}"
    parts = [title, "", *(f"- {x}" for x in _describe(run)), "",
             "## TFLOPS (forward / backward)" if run.has_direction("bwd") else "## TFLOPS (forward)", "",
             render(*summary_table(run), markdown=True)]
    h, rows = details_table(run)
    if rows:
        parts += ["", "## Details", "", render(h, rows, markdown=True)]
    missing = not_measured(run)
    if missing:
        parts += ["", "## Not measured", "", *(f"- {line}" for line in missing)]
    parts += ["", "## Method", "", method(run), ""]
    return "\n".join(parts)

"""The sweep: every implementation on every case, on the same random inputs, in one process.

Per case: fresh random q, k, v, dout (seeded per case, never zeros) and the fp32 reference
(:func:`ffpa_attn.reference.attention`) on a slice — batch 0, query heads ``[0, group)`` and KV head 0 —
forward and gradients. Per implementation and direction (:func:`bench_impl`):

1. a first call, wall-timed (compilation / autotuning happen here), then a wait for compiles it started in the
   background (:func:`_settle`);
2. one call under ``torch.cuda.max_memory_allocated`` (peak memory) whose outputs are checked against the
   reference slice;
3. the adaptive median timing of :func:`ffpa_attn.bench.timing.measure`.

The backward is timed as forward+backward (``torch.autograd.grad``); backward time = that minus the
forward time. A failing implementation never stops the sweep: its cell records the error.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..reference import attention as reference_attention
from ..testing import make_qkv, rel_err
from .impls import Impl, Prepared, Skipped, Unavailable, error_text
from .progress import progress
from .results import BenchRun, Case, Cell, bwd_tflops, fwd_tflops
from .timing import measure, peak_extra_mib, synchronize, wall


@dataclass
class SweepOptions:
    """How to measure.

    Attributes:
        bwd: also time forward+backward and derive the backward.
        max_reps, min_reps, budget_s: see :func:`ffpa_attn.bench.timing.measure`.
        time_budget_s: stop starting new measurements after this many seconds (remaining cells are
            ``skipped``); None = no limit.
        seed: base seed of the inputs (case i uses seed + i).
        show_progress: draw a progress bar on stderr.
    """

    bwd: bool = True
    max_reps: int = 20
    min_reps: int = 5
    budget_s: float = 1.0
    time_budget_s: float | None = None
    seed: int = 0
    show_progress: bool = True


def make_inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Random ``q, k, v`` (requires_grad) and ``dout`` for ``case`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = make_qkv(case.b, case.hq, case.hkv, case.nq, case.nkv, case.d, case.torch_dtype, device,
                       requires_grad=True, generator=gen)
    dout = torch.randn(q.shape, device=device, generator=gen).to(case.torch_dtype)
    return q, k, v, dout


def reference_slice(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    dout: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """fp32 reference for batch 0, query heads [0, group) and their KV head 0.

    Returns ``out [1, group, Nq, D]`` and, when ``dout`` is given, ``dq`` (like out), ``dk``/``dv``
    ``[1, 1, Nkv, D]`` (dk/dv of KV head 0 sum over its whole query group, so the slice is exact).
    """
    g = case.group
    qs = q[:1, :g].detach().float().requires_grad_(dout is not None)
    ks = k[:1, :1].detach().float().requires_grad_(dout is not None)
    vs = v[:1, :1].detach().float().requires_grad_(dout is not None)
    out, _ = reference_attention(qs, ks, vs, is_causal=case.causal)
    ref = {"out": out.detach()}
    if dout is not None:
        dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout[:1, :g].float())
        ref.update(dq=dq, dk=dk, dv=dv)
    return ref


def slice_errors(case: Case, direction: str, result: Any, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative errors of an implementation's output (fwd) or ``(dq, dk, dv)`` (bwd) on the reference slice."""
    g = case.group
    if direction == "fwd":
        return {"out": rel_err(result[:1, :g], ref["out"])}
    dq, dk, dv = result
    return {"dq": rel_err(dq[:1, :g], ref["dq"]), "dk": rel_err(dk[:1, :1], ref["dk"]),
            "dv": rel_err(dv[:1, :1], ref["dv"])}


def _recover(device: torch.device) -> None:
    """Best effort after a failed call: let pending work finish and release cached blocks."""
    if device.type != "cuda":
        return
    try:
        synchronize(device)
    except Exception:  # a broken context raises again here; later cells will record it
        pass
    torch.cuda.empty_cache()


def _settle() -> None:
    """Wait for kernels compiling in the background (a CuTeDSL forward that needs its backward starts the
    backward's compiles in child processes): a timed loop must not share the CPU with a compiler."""
    cache = sys.modules.get("ffpa_attn.cutedsl._cache")
    if cache is not None:
        cache.wait_all()


def _run_direction(impl: Impl, prep: Prepared, case: Case, direction: str, call: Callable[[], Any],
                   ref: dict[str, torch.Tensor], device: torch.device, opts: SweepOptions,
                   fwd_ms: float | None = None) -> Cell:
    try:
        first, first_s = wall(call, device)
        del first
        _settle()
        result, peak = peak_extra_mib(call, device)
        errs = slice_errors(case, direction, result, ref)
        del result
        t = measure(call, device, max_reps=opts.max_reps, min_reps=opts.min_reps, budget_s=opts.budget_s,
                    warmup=0)
    except Exception as exc:  # one implementation failing must not stop the sweep
        _recover(device)
        status, note = impl.failure(exc, direction, case)
        return Cell(impl.name, case, direction, status, kernel=prep.kernel, note=note)
    cell = Cell(impl.name, case, direction, "ok", errs=errs, err=max(errs.values()), peak_mib=peak,
                first_call_s=first_s, reps=t.reps, kernel=prep.kernel, note=prep.note)
    if direction == "fwd":
        cell.ms, cell.tflops = t.median_ms, fwd_tflops(case, t.median_ms)
        return cell
    assert fwd_ms is not None
    cell.ms = t.median_ms - fwd_ms
    note = f"fwd+bwd {t.median_ms:.4g} ms"
    cell.note = f"{prep.note}; {note}" if prep.note else note
    if cell.ms <= 0:
        cell.status, cell.note = "error", f"fwd+bwd ({t.median_ms:.3g} ms) not slower than fwd ({fwd_ms:.3g} ms)"
        cell.ms = None
    else:
        cell.tflops = bwd_tflops(case, cell.ms)
    return cell


def bench_impl(impl: Impl, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
               ref: dict[str, torch.Tensor], device: torch.device, opts: SweepOptions) -> list[Cell]:
    """The fwd (and bwd) cells of one implementation on one case."""
    directions = ["fwd", "bwd"] if opts.bwd else ["fwd"]

    def every(status: str, note: str, kernel: str = "") -> list[Cell]:
        return [Cell(impl.name, case, d, status, kernel=kernel, note=note) for d in directions]

    try:
        prep = impl.prepare(case, q, k, v)
    except Unavailable as exc:
        return every("n/a", str(exc))
    except Skipped as exc:
        return every("skipped", str(exc))
    except Exception as exc:
        _recover(device)
        return every("error", f"while preparing: {error_text(exc)}")
    fwd = _run_direction(impl, prep, case, "fwd", lambda: prep.fn(q, k, v), ref, device, opts)
    cells = [fwd]
    if not opts.bwd:
        return cells
    if fwd.status != "ok":  # no backward without a forward
        status, note = ("n/a", fwd.note) if fwd.status == "n/a" else ("skipped", f"forward {fwd.status}: {fwd.note}")
        cells.append(Cell(impl.name, case, "bwd", status, kernel=prep.kernel, note=note))
    elif prep.bwd_unavailable:
        cells.append(Cell(impl.name, case, "bwd", "n/a", kernel=prep.kernel, note=prep.bwd_unavailable))
    else:
        def fwd_bwd() -> tuple[torch.Tensor, ...]:
            out = prep.fn(q, k, v)
            return torch.autograd.grad(out, (q, k, v), dout)

        cells.append(_run_direction(impl, prep, case, "bwd", fwd_bwd, ref, device, opts, fwd_ms=fwd.ms))
    return cells


def run_sweep(cases: Sequence[Case], impls: Sequence[Impl], device: torch.device, opts: SweepOptions,
              meta: dict[str, Any], checkpoint: Callable[[BenchRun], None] | None = None) -> BenchRun:
    """Time every implementation on every case; returns the run with speedups filled in.

    ``checkpoint(run)`` is called after each case (e.g. to save partial results in case the process is
    killed before the end)."""
    run = BenchRun(meta=dict(meta))
    run.meta["options"] = {k: getattr(opts, k) for k in ("bwd", "max_reps", "min_reps", "budget_s",
                                                          "time_budget_s", "seed")}
    for impl in impls:
        run.impls.append(impl.name)
    start = time.monotonic()
    bar = progress(len(cases) * len(impls), "bench", opts.show_progress)
    live = sys.stderr.isatty()  # redraw on every description change only on a terminal (logs stay short)
    try:
        for i, case in enumerate(cases):
            q, k, v, dout = make_inputs(case, device, opts.seed + i)
            ref = reference_slice(case, q, k, v, dout if opts.bwd else None)
            for impl in impls:
                bar.set_description(f"{impl.name} {case.label()}", refresh=live)
                elapsed = time.monotonic() - start
                if opts.time_budget_s is not None and elapsed > opts.time_budget_s:
                    note = f"time budget of {opts.time_budget_s:.0f} s used up"
                    cells = [Cell(impl.name, case, d, "skipped", note=note)
                             for d in (["fwd", "bwd"] if opts.bwd else ["fwd"])]
                else:
                    cells = bench_impl(impl, case, q, k, v, dout, ref, device, opts)
                for c in cells:
                    run.add(c)
                bar.update(1)
            del q, k, v, dout, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if checkpoint is not None:
                run.meta["wall_s"] = round(time.monotonic() - start, 1)
                run.fill_speedups()
                checkpoint(run)
    finally:
        bar.close()
    run.meta["wall_s"] = round(time.monotonic() - start, 1)
    run.fill_speedups()
    return run

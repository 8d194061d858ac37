"""Timing and memory measurement: :func:`triton.testing.do_bench` (L2 cleared before every run, CUDA events) on a
GPU, ``time.perf_counter`` on the CPU (dry runs).

:func:`measure` runs a callable a budgeted number of times after warm-up and returns the median. The
number of runs adapts to the callable's cost: ``clamp(budget_s / t_estimate, min_reps, max_reps)``, so a
0.3 ms kernel gets ``max_reps`` runs and a 300 ms forward+backward gets ``min_reps``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    """Median and minimum of ``reps`` timed runs, in milliseconds."""

    median_ms: float
    min_ms: float
    reps: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``(fn(), seconds)`` of one synchronized call (for first calls that compile or autotune)."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - t0


def _time_once(fn: Callable[[], Any], device: torch.device) -> float:
    return wall(fn, device)[1] * 1e3


def measure(fn: Callable[[], Any], device: torch.device, *, max_reps: int = 20, min_reps: int = 5,
            budget_s: float = 1.0, warmup: int = 1) -> Timing:
    """Median time of ``fn()`` in ms over an adaptive number of runs.

    On CUDA the runs are timed by :func:`triton.testing.do_bench`, which clears the L2 cache before every run
    (a kernel never finds its inputs left in L2 by the previous repetition) and times each run with CUDA
    events. On the CPU (dry runs only) each run is wall-timed with ``time.perf_counter``.

    Args:
        fn: the work to time (its result is discarded after each run).
        device: where it runs.
        max_reps, min_reps: bounds on the number of timed runs.
        budget_s: target total time of the timed runs (decides the count between the bounds).
        warmup: untimed runs before the estimate.
    """
    if min_reps < 1 or max_reps < min_reps:
        raise ValueError(f"need 1 <= min_reps <= max_reps, got {min_reps}, {max_reps}")
    for _ in range(warmup):
        fn()
    est_ms = max(_time_once(fn, device), 1e-3)
    reps = int(max(min_reps, min(max_reps, budget_s * 1e3 // est_ms)))
    if device.type == "cuda":
        from triton.testing import do_bench

        # do_bench runs fn for about rep ms (its own estimate sets the count) after warmup ms: ask for reps runs
        median, fastest = do_bench(fn, warmup=0, rep=reps * est_ms, quantiles=[0.5, 0.0])
        return Timing(float(median), float(fastest), reps)
    times = [_time_once(fn, device) for _ in range(reps)]
    return Timing(statistics.median(times), min(times), reps)


def peak_extra_mib(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float | None]:
    """``(fn(), MiB)``: peak CUDA memory allocated during the call above what was allocated before it
    (None on the CPU)."""
    if device.type != "cuda":
        return fn(), None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    synchronize(device)
    return result, (torch.cuda.max_memory_allocated(device) - base) / 2**20


def graph_replay_ms(fns: Sequence[Callable[[], Any]], calls: int = 32, reps: int = 7) -> float:
    """Median milliseconds per call of ``fns`` (called round-robin, ``calls`` per graph) replayed from one CUDA
    graph, i.e. without launch overhead (decode-sized kernels); each is run once on a side stream first, as graph
    capture needs. ``reps`` replays, CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)

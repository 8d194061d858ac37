"""KV-cache decode benchmark of the Triton kernels in :mod:`ffpa_attn.triton.kvcache` (meant for
``python -m ffpa_attn bench --decode``; ``python -m ffpa_attn.bench.kvcache`` runs it on its own).

One case is a batch of sequences in a paged (or contiguous) cache and ``Nq`` new queries per sequence. A cell
times one call (attention only, or the append of ``Nq`` new tokens plus the attention with ``append``) as CUDA
graph replays (no launch overhead, as in a serving loop) and reports

* the K/V bytes the call must read (``2 * sum(len_b) * Hkv * D * 2``; partials, q and out not counted) over
  the time, in TB/s;
* that rate against a device copy of the same number of bytes (a buffer of ``kv_bytes / 2`` copied: read +
  write = ``kv_bytes``; eager ``copy_``, CUDA events, in the same run: a copy inside a CUDA graph becomes a
  copy-engine memcpy, slower than an SM-driven copy), i.e. ``copy time / call time``;
* TFLOPS (``4 * sum(len_b) * Hq * Nq * D``) and, optionally, the error of the first sequences against the fp32
  reference.

Inputs rotate over enough cache copies (>= 1 GiB in all, at most 8) that no call finds its K/V in L2. On the CPU
(``device="cpu"``, Triton interpreter) it runs as a dry run: wall-clock times, tiny shapes only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

GiB = 2**30


@dataclass(frozen=True)
class DecodeCase:
    """``batch`` sequences of ``seqlen`` cached keys each (``ragged``: lengths drawn uniformly from
    ``[seqlen / 4, seqlen]``), ``nq`` new queries per sequence, a paged cache of ``page``-key pages (None:
    contiguous), causal (tail-aligned) attention; ``append`` writes ``nq`` new tokens first, in the timed call."""

    batch: int
    hq: int
    hkv: int
    nq: int
    d: int
    seqlen: int
    page: int | None = 64
    dtype: str = "bf16"
    causal: bool = True
    ragged: bool = False
    append: bool = False

    def lens(self, seed: int = 0) -> list[int]:
        if not self.ragged:
            return [self.seqlen] * self.batch
        g = torch.Generator().manual_seed(seed)
        return torch.randint(self.seqlen // 4, self.seqlen + 1, (self.batch,), generator=g).tolist()

    def label(self) -> str:
        layout = f"page{self.page}" if self.page else "contig"
        flags = (" causal" if self.causal else "") + (" +append" if self.append else "")
        return (f"B{self.batch} Hq{self.hq}/Hkv{self.hkv} Nq{self.nq} D{self.d} {'~' if self.ragged else ''}"
                f"{self.seqlen} {layout} {self.dtype}{flags}")


@dataclass
class DecodeCell:
    case: DecodeCase
    config: str
    splits: int
    ms: float | None = None
    kv_bytes: float = 0.0
    tb_s: float | None = None
    copy_ms: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    err: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["case"] = asdict(self.case)
        d["label"] = self.case.label()
        return d


def copy_ms(nbytes: int, device: torch.device, reps: int = 10) -> float:
    """Median ms of an eager device copy that reads and writes ``nbytes`` in all (a ``nbytes / 2`` buffer);
    wall-clock on the CPU."""
    n = max(int(nbytes) // 4, 1)  # two bytes per element, half the bytes in each direction
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            dst.copy_(src)
            times.append((time.perf_counter() - t) * 1e3)
    del src, dst
    return statistics.median(times)


def _time_calls(fns: Sequence[Callable[[], Any]], device: torch.device, calls: int) -> float:
    if device.type == "cuda":
        from .timing import graph_replay_ms

        return graph_replay_ms(fns, calls=calls, reps=5)
    times = []
    for i in range(max(len(fns), 2)):
        t = time.perf_counter()
        fns[i % len(fns)]()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class _Inputs:
    """The caches (``copies`` of them) and queries of one case; lengths and tables on the device."""

    def __init__(self, case: DecodeCase, device: torch.device, seed: int = 0) -> None:
        from ..testing import make_kvcache

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
        self.lens = case.lens(seed)
        n_new = case.nq if case.append else 0
        cap = max(self.lens) + n_new
        self.caches = [make_kvcache(self.lens, case.hkv, case.d, dt, page_size=case.page, capacity=cap,
                                    n_new=n_new, device=device)]
        one = 2 * self.caches[0].k_cache.numel() * self.caches[0].k_cache.element_size()
        copies = 1 if device.type != "cuda" else max(1, min(8, math.ceil(GiB / one)))
        self.caches += [make_kvcache(self.lens, case.hkv, case.d, dt, page_size=case.page, capacity=cap,
                                     n_new=n_new, device=device) for _ in range(copies - 1)]
        self.q = torch.randn(case.batch, case.nq, case.hq, case.d, device=device).to(dt)
        self.k = self.v = None
        if case.append:
            self.k = torch.randn(case.batch, case.nq, case.hkv, case.d, device=device).to(dt)
            self.v = torch.randn_like(self.k)


def run_case(case: DecodeCase, device: torch.device, *, configs: Sequence[Any] | None = None,
             splits: Sequence[int] | None = None, check: bool = True, calls: int = 8,
             inputs: _Inputs | None = None) -> list[DecodeCell]:
    """Time ``case`` for every (config, split count) pair: ``configs`` default to
    :func:`ffpa_attn.triton.kvcache.default_config` and ``splits`` to :func:`~ffpa_attn.triton.kvcache.num_splits`
    of the case (the planner's future choice). A failing cell records its error and the run goes on."""
    from ..common.device import sm_count
    from ..triton import kvcache as kv

    inp = inputs or _Inputs(case, device)
    rows = case.hq // case.hkv * case.nq
    arch = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None
    cfgs = list(configs) if configs else [kv.default_config(case.d, rows, case.page, arch)]
    n_new = case.nq if case.append else 0
    total = sum(n + n_new for n in inp.lens)
    kv_bytes = 2.0 * total * case.hkv * case.d * 2
    flops = 4.0 * total * case.hq * case.nq * case.d
    t_copy = copy_ms(int(min(kv_bytes, 8 * GiB)), device) * kv_bytes / min(kv_bytes, 8 * GiB)
    cells = []
    for cfg in cfgs:
        split_list = list(splits) if splits else [kv.num_splits(case.batch, case.hkv, rows, max(inp.lens) + n_new,
                                                                sm_count(device), cfg=cfg, d=case.d)]
        for s in split_list:
            cell = DecodeCell(case, str(cfg), int(s), kv_bytes=kv_bytes, copy_ms=t_copy)

            def call(c=inp.caches[0], cfg=cfg, s=s):
                return kv.kvcache_forward(inp.q, c.k_cache, c.v_cache, inp.k, inp.v, cache_seqlens=c.cache_seqlens,
                                          block_table=c.block_table, causal=case.causal, cfg=cfg, splits=s,
                                          check_values=False)

            try:
                if check:
                    cell.err = _check(case, inp, call)
                fns = [lambda c=c: call(c) for c in inp.caches]
                cell.ms = _time_calls(fns, device, calls)
                cell.tb_s = kv_bytes / (cell.ms * 1e-3) / 1e12
                cell.pct_copy = 100.0 * t_copy / cell.ms
                cell.tflops = flops / (cell.ms * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001 - one failing cell never stops the run
                cell.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            cells.append(cell)
    return cells


def _check(case: DecodeCase, inp: _Inputs, call: Callable[[], Any], n: int = 2) -> float:
    """Relative error of the first ``n`` sequences against the fp32 reference (on the call's own inputs; with
    append the reference appends to the caches as they were before the call)."""
    from ..reference import kvcache_attention
    from ..testing import rel_err

    c = inp.caches[0]
    n = min(n, case.batch)
    kc, vc = c.k_cache.clone(), c.v_cache.clone()
    out, _ = call()
    kw = {"cache_seqlens": c.cache_seqlens[:n], "block_table": None if c.block_table is None else c.block_table[:n]}
    k = None if inp.k is None else inp.k[:n]
    v = None if inp.v is None else inp.v[:n]
    ref, _ = kvcache_attention(inp.q[:n], kc, vc, k, v, causal=case.causal, **kw)
    c.k_cache.copy_(kc)
    c.v_cache.copy_(vc)
    return rel_err(out[:n], ref)


def decode_report(cells: Sequence[DecodeCell]) -> str:
    """Plain-text table: one row per cell."""
    lines = [f"{'case':<52} {'config':<34} {'S':>4} {'ms':>8} {'TB/s':>6} {'%copy':>6} {'TFLOPS':>7} {'err':>8}"]
    for c in cells:
        if c.ms is None:
            lines.append(f"{c.case.label():<52} {c.config:<34} {c.splits:>4}  n/a  {c.note}")
            continue
        err = "" if c.err is None else f"{c.err:.1e}"
        lines.append(f"{c.case.label():<52} {c.config:<34} {c.splits:>4} {c.ms:8.3f} {c.tb_s:6.2f} "
                     f"{c.pct_copy:6.1f} {c.tflops:7.1f} {err:>8}")
    return "\n".join(lines)


DEFAULT_CASES = tuple(
    DecodeCase(32, 32, 8, nq, 512, n, 64) for n in (4096, 32768) for nq in (1, 4)
)
DRY_RUN_CASES = (DecodeCase(2, 4, 2, 1, 64, 40, 16), DecodeCase(2, 4, 2, 2, 64, 40, None, ragged=True, append=True))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    ap.add_argument("--json", help="write the cells here")
    ap.add_argument("--no-check", action="store_true", help="skip the reference check")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    cells: list[DecodeCell] = []
    for case in (DRY_RUN_CASES if args.dry_run else DEFAULT_CASES):
        cells += run_case(case, device, check=not args.no_check)
        print(decode_report(cells[-1:]).splitlines()[-1], flush=True)
    print(decode_report(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([c.to_dict() for c in cells], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

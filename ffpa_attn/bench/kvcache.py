"""KV-cache benchmark (``python -m ffpa_attn bench --decode``): :func:`ffpa_attn.ffpa_attn_with_kvcache` on paged and
contiguous caches, beside the same attention over the gathered cache.

One case is a batch of sequences in a paged (or contiguous) cache and ``Nq`` new queries per sequence (decode:
Nq = 1; speculative verification: a few; chunked prefill: thousands, with the chunk appended in the timed call).
Implementations (a cell each):

* ``kvcache``: :func:`ffpa_attn.ffpa_attn_with_kvcache` as a serving engine calls it (the planner's route: the decode
  kernel, or for a long chunk the varlen forward over the pages in place or the packed gather + varlen forward; the
  plan is recorded in the cell);
* ``dense``: :func:`ffpa_attn.ffpa_attn_func` over the gathered ``[B, Hkv, N, D]`` K/V (our dense call of the same
  shape: the split-KV kernels for short queries, the causal forward for a chunk);
* ``sdpa``: torch SDPA over the gathered K/V, GQA folded into the query rows (each KV head read once), causal as an
  additive bias of those rows, on CUDA its memory-efficient kernel (:func:`_sdpa_fns`).

Reported per cell: milliseconds per call (CUDA-graph replays for decode cells, so no launch overhead, as in a serving
loop; CUDA events with L2 cleared for chunks), the K/V bytes the call must read (``2 * sum(len_b) * Hkv * D * 2``)
over the time in GB/s and as % of a device copy of the same bytes (eager ``copy_``, same run), TFLOPS (tail-aligned
causal: the keys each query row sees), tokens per second per layer (``B * Nq`` per call) and, with checks on, the
error of the first sequences against the fp32 reference. Dense and SDPA cells need equal lengths (the gathered K/V is
one dense tensor). On the CPU (``device="cpu"``, Triton interpreter) it is a dry run: tiny shapes, wall-clock times.

The serving rows (:data:`SERVING_CASES`, :func:`run_serving_bench`) time the paged varlen call
(``ffpa_attn_varlen_func`` with ``block_table`` / ``seqused_k``) on a chunked prefill and a mixed decode + prefill
batch against the alternatives (see the block above :class:`ServingCase`).
"""
from __future__ import annotations

import contextlib
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

GiB = 2**30
IMPLS = ("kvcache", "dense", "sdpa")
IMPL_LABELS = {"kvcache": "ffpa_attn_with_kvcache", "dense": "ffpa_attn_func (gathered K/V)",
               "sdpa": "torch SDPA (gathered K/V)"}
CHECK_SEQUENCES = 2  # sequences compared with the fp32 reference (1 for chunks: the reference holds all scores)


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

    @property
    def chunk(self) -> bool:
        """A long new chunk (chunked prefill): timed eagerly."""
        return self.nq > 64

    def label(self) -> str:
        layout = f"page{self.page}" if self.page else "contig"
        flags = (" causal" if self.causal else "") + (" +append" if self.append else "")
        return (f"B{self.batch} Hq{self.hq}/Hkv{self.hkv} Nq{self.nq} D{self.d} {'~' if self.ragged else ''}"
                f"{self.seqlen} {layout} {self.dtype}{flags}")

    def shape_label(self) -> str:
        """The label without the cache layout (what the dense and SDPA cells of a shape share)."""
        return self.label().replace(f" page{self.page}" if self.page else " contig", "")


@dataclass
class DecodeCell:
    case: DecodeCase
    impl: str
    plan: str = ""
    ms: float | None = None
    kv_bytes: float = 0.0
    gb_s: float | None = None
    copy_ms: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    tokens_s: float | None = None
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


def _time_calls(fns: Sequence[Callable[[], Any]], device: torch.device, calls: int, graphs: bool) -> float:
    """ms per call: CUDA-graph replays (``graphs``), else CUDA events with L2 cleared (:func:`.timing.measure`);
    wall-clock on the CPU."""
    if device.type == "cuda":
        from .timing import graph_replay_ms, measure

        if graphs:
            return graph_replay_ms(fns, calls=calls, reps=5)
        return measure(fns[0], device, max_reps=10, min_reps=3, budget_s=1.0).median_ms
    times = []
    for i in range(max(len(fns), 2)):
        t = time.perf_counter()
        fns[i % len(fns)]()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def causal_keys(lens: Sequence[int], nq: int, causal: bool) -> float:
    """Key visits of all query rows (sequence of ``L`` keys: ``Nq * L`` non-causal; tail-aligned causal: row r sees
    ``min(L, max(0, L - Nq + r + 1))`` keys)."""
    total = 0.0
    for n in lens:
        if not causal:
            total += nq * n
        else:
            total += sum(min(n, max(0, n - nq + r + 1)) for r in range(nq))
    return total


class _Inputs:
    """The caches (``copies`` of them, rotated so that no call finds its K/V in L2) and queries of one case;
    lengths and tables on the device."""

    def __init__(self, case: DecodeCase, device: torch.device, seed: int = 0) -> None:
        from ..testing import make_kvcache

        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
        self.lens = case.lens(seed)
        self.n_new = case.nq if case.append else 0
        cap = max(self.lens) + self.n_new
        make = lambda: make_kvcache(self.lens, case.hkv, case.d, self.dtype, page_size=case.page,  # noqa: E731
                                    capacity=cap, n_new=self.n_new, device=device)
        self.caches = [make()]
        one = 2 * self.caches[0].k_cache.numel() * self.caches[0].k_cache.element_size()
        copies = 1 if device.type != "cuda" else max(1, min(8, -(-GiB // one)))
        self.caches += [make() for _ in range(copies - 1)]
        self.q = torch.randn(case.batch, case.nq, case.hq, case.d, device=device).to(self.dtype)
        self.k = self.v = None
        if case.append:
            self.k = torch.randn(case.batch, case.nq, case.hkv, case.d, device=device).to(self.dtype)
            self.v = torch.randn_like(self.k)

    def gathered(self, case: DecodeCase) -> tuple[torch.Tensor, torch.Tensor]:
        """The first cache's keys / values as dense ``[B, Hkv, N, D]`` tensors (equal lengths; with ``append`` the
        new tokens included, appended once here)."""
        from ..reference import kvcache_append, kvcache_sequence

        c = self.caches[0]
        kc, vc = c.k_cache, c.v_cache
        if self.k is not None:
            kc, vc = kvcache_append(kc, vc, self.k, self.v, c.cache_seqlens, block_table=c.block_table)
        n = self.lens[0] + self.n_new
        out = []
        for cache in (kc, vc):
            seqs = [kvcache_sequence(cache, b, 0, n, block_table=c.block_table) for b in range(case.batch)]
            out.append(torch.stack(seqs).transpose(1, 2).contiguous())
        return out[0], out[1]


def _kvcache_fns(case: DecodeCase, inp: _Inputs, num_splits: int) -> tuple[list[Callable], str]:
    import ffpa_attn

    c0 = inp.caches[0]
    for c in inp.caches:  # validates each cache's tables once (the timed calls skip it); appends what they append
        ffpa_attn.ffpa_attn_with_kvcache(inp.q, c.k_cache, c.v_cache, inp.k, inp.v, cache_seqlens=c.cache_seqlens,
                                         block_table=c.block_table, causal=case.causal, num_splits=num_splits)
    plan = ffpa_attn.explain_kvcache(inp.q, c0.k_cache, c0.v_cache, inp.k, inp.v, cache_seqlens=c0.cache_seqlens,
                                     block_table=c0.block_table, causal=case.causal, num_splits=num_splits)

    def call(c):
        return ffpa_attn.ffpa_attn_with_kvcache(inp.q, c.k_cache, c.v_cache, inp.k, inp.v,
                                                cache_seqlens=c.cache_seqlens, block_table=c.block_table,
                                                causal=case.causal, num_splits=num_splits, check_values=False)

    return [lambda c=c: call(c) for c in inp.caches], f"{plan.route}: {plan.kvcache.backend}:{plan.kvcache.spec}" + (
        f" + {plan.varlen.backend}:{plan.varlen.spec}" if plan.varlen is not None else "")


def _dense_fns(case: DecodeCase, inp: _Inputs, kd: torch.Tensor, vd: torch.Tensor) -> tuple[list[Callable], str]:
    import ffpa_attn

    qd = inp.q.transpose(1, 2)
    plan = ffpa_attn.explain(qd, kd, vd, is_causal=case.causal, enable_gqa=True)
    fn = lambda: ffpa_attn.ffpa_attn_func(qd, kd, vd, is_causal=case.causal, enable_gqa=True)  # noqa: E731
    return [fn], f"{plan.forward.backend}:{plan.forward.spec}"


def fold_gqa_rows(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """Queries ``[B, Nq, Hq, D]`` (flash-attn layout) -> ``[B, Hkv, group * Nq, D]``: the ``group = Hq / Hkv`` query
    heads of KV head ``j`` (heads ``j * group + g``, :func:`ffpa_attn.contract.kv_head`) become its rows
    ``g * Nq + i``, so one SDPA call reads each KV head once. A copy (q is not in that layout)."""
    b, nq, hq, d = q.shape
    return q.transpose(1, 2).reshape(b, hkv, hq // hkv * nq, d)


def unfold_gqa_rows(out: torch.Tensor, hq: int) -> torch.Tensor:
    """The inverse of :func:`fold_gqa_rows` on an output ``[B, Hkv, group * Nq, D]`` -> ``[B, Hq, Nq, D]``; a reshape,
    not a view: torch's fused SDPA kernels return out in ``[B, N, H, D]`` memory order, which no view regroups."""
    b, hkv, rows, d = out.shape
    return out.reshape(b, hq, rows * hkv // hq, d)


def folded_causal_bias(nq: int, nkv: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tail-aligned causal rule for the rows of :func:`fold_gqa_rows`: an additive ``[group * Nq, Nkv]`` bias
    (0 visible, -inf hidden) in the query dtype, the form torch's memory-efficient kernel takes without converting it
    in every call."""
    from ..contract import causal_mask

    hidden = ~causal_mask(nq, nkv, device)
    return torch.zeros(nq, nkv, dtype=dtype, device=device).masked_fill_(hidden, float("-inf")).repeat(group, 1)


def _sdpa_fns(case: DecodeCase, inp: _Inputs, kd: torch.Tensor, vd: torch.Tensor) -> tuple[list[Callable], str]:
    """torch SDPA with the ``group`` query heads of a KV head folded into its rows (:func:`fold_gqa_rows`), so each KV
    head is read once, as a serving engine calls it at D > 256 (no fused GQA kernel there); causal with Nq > 1 adds
    :func:`folded_causal_bias` (made once, outside the timed call). On CUDA the memory-efficient kernel is pinned: it
    takes the bias at any head dim that is a multiple of 8, where flash stops at D = 256 and the math kernel would
    materialize all ``B * Hq * Nq * Nkv`` fp32 scores of a chunk; a call it refuses fails its cell with torch's
    reasons. The CPU runs torch's default choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..contract import default_scale

    _, nq, hq, d = inp.q.shape
    qf = fold_gqa_rows(inp.q, case.hkv)
    bias = folded_causal_bias(nq, kd.shape[2], hq // case.hkv, qf.dtype, qf.device) \
        if case.causal and nq > 1 else None
    scale = default_scale(d)
    pinned = qf.device.type == "cuda"
    kernels = functools.partial(sdpa_kernel, SDPBackend.EFFICIENT_ATTENTION) if pinned else contextlib.nullcontext

    def fn():
        with kernels():
            out = torch.ops.aten.scaled_dot_product_attention(qf, kd, vd, attn_mask=bias, scale=scale)
        return unfold_gqa_rows(out, hq)

    kernel = "memory-efficient kernel" if pinned else "default kernel"
    return [fn], f"aten.scaled_dot_product_attention ({kernel}, GQA folded into rows)"


def _check(case: DecodeCase, inp: _Inputs, impl: str, fn: Callable[[], Any]) -> float:
    """Relative error of the first sequences against the fp32 reference (on the call's own inputs; with append the
    reference appends to the caches as they were before the call)."""
    from ..reference import kvcache_attention
    from ..testing import rel_err

    c = inp.caches[0]
    n = min(1 if case.chunk else CHECK_SEQUENCES, case.batch)
    appends = inp.k is not None and impl == "kvcache"
    kc, vc = (c.k_cache.clone(), c.v_cache.clone()) if appends else (c.k_cache, c.v_cache)
    out = fn()
    if isinstance(out, tuple):
        out = out[0]
    if impl != "kvcache":  # [B, Hq, Nq, D] -> flash-attn's [B, Nq, Hq, D]
        out = out.transpose(1, 2)
    kw = {"cache_seqlens": c.cache_seqlens[:n], "block_table": None if c.block_table is None else c.block_table[:n]}
    k = None if inp.k is None else inp.k[:n]
    v = None if inp.v is None else inp.v[:n]
    ref, _ = kvcache_attention(inp.q[:n], kc, vc, k, v, causal=case.causal, **kw)
    if appends:
        c.k_cache.copy_(kc)
        c.v_cache.copy_(vc)
    return rel_err(out[:n], ref)


def run_case(case: DecodeCase, device: torch.device, *, impls: Sequence[str] = ("kvcache",), check: bool = True,
             calls: int = 8, num_splits: int = 0, inputs: _Inputs | None = None,
             gathered: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[DecodeCell]:
    """Time ``case`` with each implementation of ``impls`` (:data:`IMPLS`); ``num_splits`` is passed to
    ``ffpa_attn_with_kvcache`` (0: the planner's). A failing cell records its error and the run goes on."""
    inp = inputs or _Inputs(case, device)
    total = sum(n + inp.n_new for n in inp.lens)
    kv_bytes = 2.0 * total * case.hkv * case.d * 2
    keys = causal_keys([n + inp.n_new for n in inp.lens], case.nq, case.causal)
    flops = 4.0 * keys * case.hq * case.d
    t_copy = copy_ms(int(min(kv_bytes, 8 * GiB)), device) * kv_bytes / min(kv_bytes, 8 * GiB)
    cells = []
    for impl in impls:
        cell = DecodeCell(case, impl, kv_bytes=kv_bytes, copy_ms=t_copy)
        try:
            if impl == "kvcache":
                fns, cell.plan = _kvcache_fns(case, inp, num_splits)
            elif case.ragged:
                raise NotImplementedError("ragged lengths: the gathered K/V is not one dense tensor")
            else:
                if gathered is None:
                    gathered = inp.gathered(case)
                fns, cell.plan = (_dense_fns if impl == "dense" else _sdpa_fns)(case, inp, *gathered)
            if check:
                cell.err = _check(case, inp, impl, fns[0])
            cell.ms = _time_calls(fns, device, calls, graphs=not case.chunk)
            cell.gb_s = kv_bytes / (cell.ms * 1e-3) / 1e9
            cell.pct_copy = 100.0 * t_copy / cell.ms
            cell.tflops = flops / (cell.ms * 1e-3) / 1e12
            cell.tokens_s = case.batch * case.nq / (cell.ms * 1e-3)
        except Exception as exc:  # noqa: BLE001 - one failing cell never stops the run
            cell.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        cells.append(cell)
    return cells


def decode_report(cells: Sequence[DecodeCell]) -> str:
    """Plain-text table: one row per cell (the plan in the last column)."""
    lines = [f"{'case':<54} {'impl':<8} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'TFLOPS':>7} {'tok/s':>9} {'err':>8}  plan"]
    for c in cells:
        label = c.case.label() if c.impl == "kvcache" else c.case.shape_label()
        if c.ms is None:
            lines.append(f"{label:<54} {c.impl:<8} {'n/a':>8}  {c.note}")
            continue
        err = "" if c.err is None else f"{c.err:.1e}"
        lines.append(f"{label:<54} {c.impl:<8} {c.ms:8.3f} {c.gb_s:7.0f} {c.pct_copy:6.1f} {c.tflops:7.1f} "
                     f"{c.tokens_s:9.3g} {err:>8}  {c.plan}")
    return "\n".join(lines)


# Serving shape (D = 512 bf16, B = 32, Hq = 32, Hkv = 8): paged (pages of 16 / 64 / 256) and contiguous caches at 4K
# and 32K cached keys, Nq 1 (decode) and 4 (speculative verification); then a chunked-prefill row: 2K new tokens
# appended onto a 30K cache (B = 8).
DECODE_LAYOUTS = (16, 64, 256, None)
DEFAULT_CASES = tuple(
    DecodeCase(32, 32, 8, nq, 512, n, page) for n in (4096, 32768) for nq in (1, 4) for page in DECODE_LAYOUTS
) + (DecodeCase(8, 32, 8, 2048, 512, 30720, 64, append=True),)
# tiny shapes for the CPU (Triton interpreter); D = 264, the FFPA range's smallest, so the dense cells run FFPA too
DRY_RUN_CASES = tuple(DecodeCase(2, 4, 2, nq, 264, 40, page) for nq in (1, 2) for page in (16, None)) + (
    DecodeCase(2, 4, 2, 65, 264, 40, 16, append=True),)


def run_decode_bench(cases: Sequence[DecodeCase], device: torch.device, *, impls: Sequence[str] = IMPLS,
                     check: bool = True, num_splits: int = 0,
                     progress: Callable[[DecodeCell], None] | None = None) -> list[DecodeCell]:
    """Every case with ``ffpa_attn_with_kvcache``, and the gathered-cache implementations once per shape (cases that
    differ only in the cache layout share them)."""
    cells: list[DecodeCell] = []
    shapes_done: set[str] = set()
    for case in cases:
        inp = _Inputs(case, device)
        todo = [i for i in impls if i == "kvcache" or case.shape_label() not in shapes_done]
        shapes_done.add(case.shape_label())
        for cell in run_case(case, device, impls=todo, check=check, num_splits=num_splits, inputs=inp):
            cells.append(cell)
            if progress is not None:
                progress(cell)
        del inp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cells


HISTORY_METRICS = ("ms", "gb_s", "pct_copy", "tflops", "tokens_s", "err")


def history_rows(cells: Sequence[DecodeCell], meta: dict) -> list[dict]:
    """Rows for ``bench/results/history.jsonl`` (the format of :mod:`.history`): one per metric of every measured
    cell; direction ``"kvcache"``."""
    head = {"date": meta.get("date", "unknown"),
            "commit": str(meta.get("commit", "unknown")) + ("-dirty" if meta.get("commit_dirty") else ""),
            "device": meta.get("gpu_name") or meta.get("device", "unknown"), "command": meta.get("command", "")}
    rows = []
    for c in cells:
        if c.ms is None:
            continue
        case = c.case.label() if c.impl == "kvcache" else c.case.shape_label()
        for metric in HISTORY_METRICS:
            value = getattr(c, metric)
            if value is not None:
                rows.append({**head, "case": case, "impl": c.impl, "direction": "kvcache", "metric": metric,
                             "value": float(f"{value:.6g}")})
    return rows


def write_results(cells: Sequence[DecodeCell], meta: dict, json_path: str | None, history: str | None) -> int:
    """Write the run as JSON (``{"meta": ..., "cells": [...]}``) and append its history rows; returns the rows
    appended (0 when the same run is already there)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "cells": [c.to_dict() for c in cells]}, f, indent=1)
    if not history:
        return 0
    from .history import append_rows

    return append_rows(history_rows(cells, meta), history)


# ------------------------------------------------------------------------------------ serving (paged varlen) rows
# A serving engine's step over a paged cache in one varlen call (ffpa_attn_varlen_func with block_table / seqused_k):
# the new tokens are already in the cache, each sequence's queries are its last positions. Two cases:
#
# * paged prefill: B sequences, a chunk of Nq new queries each over its seqlen keys (chunk included), causal, timed as
#   ``auto`` (the planner's route: heuristic ``paged_gather_first``), ``inplace`` (Triton named: its varlen forward
#   reading the pages through the table), ``packed`` (gather_kv's packed copy of the keys + the implicit varlen
#   forward over it: the gather route by hand) and ``dense`` (ffpa_attn_func over the same keys gathered once,
#   outside the timing: the yardstick);
# * mixed batch: decode rows (one query over ragged lengths) and prefill chunks in one call (``auto``, ``inplace``)
#   against the two calls an engine would otherwise make (``separate``: ffpa_attn_with_kvcache for the decode rows,
#   the implicit paged varlen call for the chunks).
#
# Timed eagerly with CUDA events and L2 cleared (:func:`.timing.measure`); TFLOPS count the keys each query row sees
# (tail-aligned causal), GB/s the K/V bytes of the keys the sequences hold.

SERVING_IMPLS = ("auto", "inplace", "packed", "dense", "separate")


@dataclass(frozen=True)
class ServingCase:
    """``kind`` "prefill": ``batch`` chunks of ``nq`` queries over ``seqlen`` keys each; "mixed": ``decode`` decode
    rows over lengths spread over ``[decode_lo, seqlen]`` plus ``batch`` such chunks. Pages of ``page`` keys."""

    kind: str
    batch: int
    hq: int
    hkv: int
    nq: int
    d: int
    seqlen: int
    page: int
    decode: int = 0
    decode_lo: int = 0
    dtype: str = "bf16"

    def label(self) -> str:
        what = (f"{self.batch}x{self.nq}q/{self.seqlen}" if self.kind == "prefill" else
                f"{self.decode}x1q/{self.decode_lo}-{self.seqlen} + {self.batch}x{self.nq}q/{self.seqlen}")
        return f"{self.kind} {what} Hq{self.hq}/Hkv{self.hkv} D{self.d} page{self.page} {self.dtype} causal"

    def impls(self) -> tuple[str, ...]:
        return ("auto", "inplace", "packed", "dense") if self.kind == "prefill" else ("auto", "inplace", "separate")


@dataclass
class ServingCell:
    case: ServingCase
    impl: str
    plan: str = ""
    ms: float | None = None
    gb_s: float | None = None
    tflops: float | None = None
    err: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["case"] = asdict(self.case)
        d["label"] = self.case.label()
        return d


# B = 8 chunks of 2048 queries over 30K cached keys (+ the chunk), pages of 16 / 64 / 256; 32 decode rows over 4K-32K
# keys next to 4 such chunks, pages of 64 (Hq = 32, Hkv = 8, D = 512, bf16)
SERVING_CASES = tuple(ServingCase("prefill", 8, 32, 8, 2048, 512, 30720 + 2048, page) for page in (16, 64, 256)) + (
    ServingCase("mixed", 4, 32, 8, 2048, 512, 30720 + 2048, 64, decode=32, decode_lo=4096),)
SERVING_DRY_RUN_CASES = (ServingCase("prefill", 2, 4, 2, 65, 264, 80, 16),
                         ServingCase("mixed", 2, 4, 2, 65, 264, 80, 16, decode=3, decode_lo=20))


class _ServingInputs:
    """One paged cache holding every sequence's keys (lengths = key counts), the packed queries and boundaries."""

    def __init__(self, case: ServingCase, device: torch.device, seed: int = 0) -> None:
        from ..testing import cu_seqlens, make_kvcache

        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
        g = torch.Generator().manual_seed(seed)
        decode = torch.randint(case.decode_lo, case.seqlen + 1, (case.decode,), generator=g).tolist()
        self.lens_k = decode + [case.seqlen] * case.batch
        self.lens_q = [1] * case.decode + [case.nq] * case.batch
        self.cache = make_kvcache(self.lens_k, case.hkv, case.d, self.dtype, page_size=case.page, device=device)
        self.q = torch.randn(sum(self.lens_q), case.hq, case.d, device=device).to(self.dtype)
        self.cu_q = cu_seqlens(self.lens_q, device=device)
        self.n_decode = case.decode

    def varlen(self, rows: slice | None = None, **backend: object):
        """The paged varlen call over all sequences, or over sequences ``rows`` (a slice of the batch); ``backend``:
        a named backend (``backend="triton"``: in place)."""
        import ffpa_attn

        c, cu_q, q = self.cache, self.cu_q, self.q
        seq, table = c.cache_seqlens, c.block_table
        if rows is not None:
            lo, hi = int(cu_q[rows.start]), int(cu_q[rows.stop])
            q, cu_q = q[lo:hi], cu_q[rows.start:rows.stop + 1] - lo
            seq, table = seq[rows], table[rows]
        max_q = max(self.lens_q[rows] if rows is not None else self.lens_q)
        kw = dict(causal=True, enable_gqa=True, seqused_k=seq, block_table=table, **backend)
        ffpa_attn.ffpa_attn_varlen_func(q, c.k_cache, c.v_cache, cu_q, None, max_q, 0, **kw)  # checks once
        plan = ffpa_attn.explain_varlen(q, c.k_cache, c.v_cache, cu_q, None, max_q, 0, **kw)
        gather = f" + {plan.varlen.backend}:{plan.varlen.spec}" if plan.varlen is not None else ""
        return (lambda: ffpa_attn.ffpa_attn_varlen_func(q, c.k_cache, c.v_cache, cu_q, None, max_q, 0, **kw),
                f"{plan.route}: {plan.forward.backend}:{plan.forward.spec}{gather}")


def _serving_fn(case: ServingCase, inp: _ServingInputs, impl: str) -> tuple[Callable[[], Any], str]:
    import ffpa_attn

    c = inp.cache
    if impl == "auto":
        return inp.varlen()
    if impl == "inplace":
        return inp.varlen(backend="triton")
    if impl == "separate":
        n = inp.n_decode
        chunks, chunk_plan = inp.varlen(slice(n, n + case.batch))
        rows = inp.cu_q[:n].long()
        qd = inp.q[rows].unsqueeze(1)
        seq, table = c.cache_seqlens[:n], c.block_table[:n]
        ffpa_attn.ffpa_attn_with_kvcache(qd, c.k_cache, c.v_cache, cache_seqlens=seq, block_table=table, causal=True)
        plan = ffpa_attn.explain_kvcache(qd, c.k_cache, c.v_cache, cache_seqlens=seq, block_table=table, causal=True)

        def both():
            ffpa_attn.ffpa_attn_with_kvcache(qd, c.k_cache, c.v_cache, cache_seqlens=seq, block_table=table,
                                             causal=True, check_values=False)
            return chunks()

        return both, f"{plan.kvcache.backend}:{plan.kvcache.spec} + {chunk_plan}"
    from ..triton.kvcache import gather_kv

    if impl == "packed":
        total = sum(inp.lens_k)

        def packed():
            kp, vp, cu_k, max_k = gather_kv(c.k_cache, c.v_cache, c.cache_seqlens, block_table=c.block_table,
                                            max_total=total, check_values=False)
            return ffpa_attn.ffpa_attn_varlen_func(inp.q, kp, vp, inp.cu_q, cu_k, case.nq, max_k, causal=True,
                                                   enable_gqa=True)

        kp, vp, cu_k, max_k = gather_kv(c.k_cache, c.v_cache, c.cache_seqlens, block_table=c.block_table)
        plan = ffpa_attn.explain_varlen(inp.q, kp, vp, inp.cu_q, cu_k, case.nq, max_k, causal=True, enable_gqa=True)
        del kp, vp
        return packed, f"triton:gather_kv + {plan.forward.backend}:{plan.forward.spec}"
    # dense: the keys gathered once (equal lengths), outside the timing
    kp, vp, _, _ = gather_kv(c.k_cache, c.v_cache, c.cache_seqlens, block_table=c.block_table)
    kd, vd = (t.view(case.batch, case.seqlen, case.hkv, case.d).transpose(1, 2) for t in (kp, vp))
    qd = inp.q.view(case.batch, case.nq, case.hq, case.d).transpose(1, 2)
    plan = ffpa_attn.explain(qd, kd, vd, is_causal=True, enable_gqa=True)
    return (lambda: ffpa_attn.ffpa_attn_func(qd, kd, vd, is_causal=True, enable_gqa=True),
            f"{plan.forward.backend}:{plan.forward.spec}")


def _serving_err(inp: _ServingInputs, out: torch.Tensor, impl: str) -> float:
    """Relative error of the last sequence (a chunk) against the fp32 reference."""
    from ..reference import paged_varlen_attention
    from ..testing import rel_err

    c, b = inp.cache, len(inp.lens_q) - 1
    lo, hi = int(inp.cu_q[b]), int(inp.cu_q[b + 1])
    if impl == "dense":  # [B, Hq, Nq, D] -> the packed rows
        out = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[-1])
    ref, _ = paged_varlen_attention(inp.q[lo:hi], c.k_cache, c.v_cache, inp.cu_q[b:] - lo, c.cache_seqlens[b:],
                                    c.block_table[b:], causal=True)
    return rel_err(out[lo:hi] if impl != "separate" else out[lo - int(inp.cu_q[inp.n_decode]):], ref)


def run_serving_case(case: ServingCase, device: torch.device, *, check: bool = True) -> list[ServingCell]:
    """Time every implementation of ``case`` (:meth:`ServingCase.impls`); a failing cell records its error."""
    inp = _ServingInputs(case, device)
    kv_bytes = 2.0 * sum(inp.lens_k) * case.hkv * case.d * 2
    keys = sum(causal_keys([k], q, True) for k, q in zip(inp.lens_k, inp.lens_q))
    flops = 4.0 * keys * case.hq * case.d
    cells = []
    for impl in case.impls():
        cell = ServingCell(case, impl)
        try:
            fn, cell.plan = _serving_fn(case, inp, impl)
            if check:
                cell.err = _serving_err(inp, fn(), impl)
            cell.ms = _time_calls([fn], device, 1, graphs=False)
            cell.gb_s = kv_bytes / (cell.ms * 1e-3) / 1e9
            cell.tflops = flops / (cell.ms * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - one failing cell never stops the run
            cell.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        cells.append(cell)
    del inp
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def run_serving_bench(cases: Sequence[ServingCase], device: torch.device, *, check: bool = True,
                      progress: Callable[[ServingCell], None] | None = None) -> list[ServingCell]:
    """Every serving case (:data:`SERVING_CASES`), each implementation a cell."""
    cells: list[ServingCell] = []
    for case in cases:
        for cell in run_serving_case(case, device, check=check):
            cells.append(cell)
            if progress is not None:
                progress(cell)
    return cells


def serving_report(cells: Sequence[ServingCell]) -> str:
    """Plain-text table of the serving rows (the plan in the last column)."""
    lines = [f"{'serving case':<72} {'impl':<9} {'ms':>8} {'GB/s':>7} {'TFLOPS':>7} {'err':>8}  plan"]
    for c in cells:
        if c.ms is None:
            lines.append(f"{c.case.label():<72} {c.impl:<9} {'n/a':>8}  {c.note}")
            continue
        err = "" if c.err is None else f"{c.err:.1e}"
        lines.append(f"{c.case.label():<72} {c.impl:<9} {c.ms:8.3f} {c.gb_s:7.0f} {c.tflops:7.1f} {err:>8}  {c.plan}")
    return "\n".join(lines)


def serving_history_rows(cells: Sequence[ServingCell], meta: dict) -> list[dict]:
    """History rows of the serving cells (direction ``"serving"``; the format of :func:`history_rows`)."""
    head = {"date": meta.get("date", "unknown"),
            "commit": str(meta.get("commit", "unknown")) + ("-dirty" if meta.get("commit_dirty") else ""),
            "device": meta.get("gpu_name") or meta.get("device", "unknown"), "command": meta.get("command", "")}
    return [{**head, "case": c.case.label(), "impl": c.impl, "direction": "serving", "metric": metric,
             "value": float(f"{getattr(c, metric):.6g}")}
            for c in cells if c.ms is not None for metric in ("ms", "gb_s", "tflops", "err")
            if getattr(c, metric) is not None]


__all__ = ["DecodeCase", "DecodeCell", "IMPLS", "DEFAULT_CASES", "DRY_RUN_CASES", "run_case", "run_decode_bench",
           "decode_report", "history_rows", "write_results", "causal_keys", "copy_ms", "ServingCase", "ServingCell",
           "SERVING_CASES", "SERVING_DRY_RUN_CASES", "run_serving_case", "run_serving_bench", "serving_report",
           "serving_history_rows"]

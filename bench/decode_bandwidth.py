"""Split-KV decode forward on one GPU, in one run (~2-3 minutes on an H200):

1. yardsticks, measured in this run: HBM bandwidth of a large (2 GiB -> 2 GiB) device copy counting read +
   write bytes (``dst.copy_(src)`` and a Triton copy kernel, eager, CUDA events, median of many; the
   decode target uses the faster of the two), a read-only pass (a Triton reduction and ``torch.sum``
   over 2 GiB, bytes read; decode only reads, so this is the tighter bound) and a bf16 matmul's TFLOPS
   (to tell compute-bound shapes apart). The old yardstick - the copy captured in a CUDA graph - is
   measured too, for comparison: a graph turns ``copy_`` into a memcpy node served by the copy engines,
   which do not reach the SM-driven copy bandwidth (it measured well below the decode kernels' own K/V reads:
   docs/design.md, "Triton kernels");
2. correctness of the split-KV kernel vs the fp32 reference on a few shapes (default configs);
3. the decode table (bf16, D=512, B=1, Nkv=32768, Hq=32, Hkv in {32, 8, 2}, Nq in {1, 4, 16}): K/V bytes,
   time, K/V TB/s, % of the copy and of the read yardstick, TFLOPS, for torch SDPA, the non-split Triton
   forward (``ffpa_attn.triton.fwd.dense_forward``), the split-KV kernel with its default choice, the
   autotuned production path, and (for the shapes whose first measurement missed 75%) a sweep of forced tile
   configs / split counts; each shape gets a roofline verdict (the TFLOPS that 75% of the copy would need
   against the measured matmul TFLOPS);
4. with ``--crossover``: split-KV vs the non-split kernel at Nq in {16, 64, 128} (the dispatch rule).

Decode times are CUDA-graph replays (launch overhead excluded, as in a serving loop), median of 5 replays of
a graph holding several calls; inputs rotate over enough K/V copies (>= 1 GiB in all, up to 8 copies; L2 is
50 MB on an H200) that no call finds its K/V in L2 (the Hkv=2 rows also print the default timed without
rotation, to show what L2 would add).

    python bench/decode_bandwidth.py                # yardsticks, correctness, table + sweep of missed shapes
    python bench/decode_bandwidth.py --quick        # no forced-config sweep
    python bench/decode_bandwidth.py --sweep-all    # sweep every shape, not only the missed ones
    OUT=/some/dir python bench/decode_bandwidth.py  # also writes $OUT/decode_bandwidth.json
    python bench/decode_bandwidth.py --dry-run      # CPU + Triton interpreter, tiny shapes (checks the script)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import ffpa_attn  # noqa: E402
from ffpa_attn import TritonBackend  # noqa: E402
from ffpa_attn.bench.timing import graph_replay_ms  # noqa: E402
from ffpa_attn.reference import attention  # noqa: E402
from ffpa_attn.testing import rel_err  # noqa: E402
from ffpa_attn.common.device import smem_limit  # noqa: E402
from ffpa_attn.triton import splitkv as decode  # noqa: E402
from ffpa_attn.triton.autotune import KernelConfig  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
GiB = 2**30
# the decode table: B, Hq, Nkv, D, dtype; Hkv x Nq grid
PERF_SHAPE = (1, 32, 32768, 512, torch.bfloat16)
PERF = [(hkv, nq) for hkv in (32, 8, 2) for nq in (1, 4, 16)]
# the shapes whose first measurement stayed below 75% of the copy (bench/results/history.jsonl): these get the
# forced-config sweep
MISSED = {(8, 16), (2, 1), (2, 4), (2, 16)}
CROSS = ((16, 256), (16, 1024), (64, 1024), (64, 8192), (128, 8192))
TARGET = 0.75  # the decode target: K/V bytes / time >= 75% of the copy bandwidth
# best non-split Triton forward at D=512 on an H200 (bench/tune_triton_fwd.py, long Nq, TMA loads; the Triton
# column of dispatch/heuristics.py "cutedsl_forward_dims"): the MMA rate this kernel family reaches at D=512
FWD_D512_TFLOPS = 209.0
SWEEP_BUDGET_S = 120.0  # forced configs are skipped once the run is this old
T0 = time.time()


def _empty_cache() -> None:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def time_graph(fns, target_ms: float = 3.0, reps: int = 5) -> float:
    """Median ms per call of ``fns`` (called round-robin) replayed from a CUDA graph."""
    if DRY:
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e3 / len(fns)
    fns[0]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0) * 1e3 / len(fns), 1e-3)
    n_inner = int(max(len(fns), min(64, target_ms / est)))
    try:
        return graph_replay_ms(fns, calls=n_inner, reps=reps)
    except Exception as e:  # noqa: BLE001 - something in fn cannot be captured: time it eagerly
        torch.cuda.synchronize()
        print(f"    (not capturable: {type(e).__name__}; eager timing)")
        return statistics.median(time_eager(fns[i % len(fns)], reps=1) for i in range(max(reps, len(fns))))


def time_eager(fn, reps: int = 10, warmup: int = 1) -> float:
    """Median ms of ``fn()`` launched eagerly, each call between its own pair of CUDA events."""
    if DRY:
        return time_graph([fn])
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


# ------------------------------------------------------------------------------------------- yardsticks


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] over one BLOCK of a flat tensor per program (1-D grid)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


@triton.jit
def _read_kernel(src, part, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """part[pid] = sum of ITERS consecutive BLOCKs of a flat tensor (fp32): reads n elements, writes
    n / (BLOCK * ITERS) floats."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(part + tl.program_id(0), tl.sum(acc, 0))


def yardsticks() -> dict:
    """Bandwidth (GB/s) and matmul (TFLOPS) yardsticks of this GPU, measured now.

    copy_eager / copy_triton / copy_graph: ``n`` bf16 -> ``n`` bf16 (2 GiB each), read + write bytes;
    read_triton / read_sum: 2 GiB of bf16 read; mm_tflops: a bf16 [8192, 8192] @ [8192, 8192] matmul.
    ``copy`` (the decode target's yardstick) = max(copy_eager, copy_triton); ``read`` = max(read_triton, read_sum).
    """
    n = GiB if not DRY else 2**16
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    rw = 2 * n * src.element_size()
    rd = n * src.element_size()
    reps = 30 if not DRY else 1
    blk = 8192
    iters = 16
    part = torch.empty(triton.cdiv(n, blk * iters), dtype=torch.float32, device=DEV)
    res: dict = {}

    def gbs(nbytes: float, ms: float) -> float:
        return nbytes / ms / 1e6

    res["copy_eager"] = gbs(rw, time_eager(lambda: dst.copy_(src), reps=reps, warmup=3))
    res["copy_triton"] = gbs(rw, time_eager(
        lambda: _copy_kernel[(triton.cdiv(n, blk),)](src, dst, n, BLOCK=blk, num_warps=8), reps=reps, warmup=3))
    assert torch.equal(dst, src), "copy yardstick produced a wrong copy"
    # the copy timed as CUDA-graph replays: the yardstick of the decode rows' graph-replayed kernels
    res["copy_graph"] = gbs(rw, time_graph([lambda: dst.copy_(src)], target_ms=20))
    res["read_triton"] = gbs(rd, time_eager(
        lambda: _read_kernel[(part.numel(),)](src, part, n, BLOCK=blk, ITERS=iters, num_warps=8),
        reps=reps, warmup=3))
    ref_sum = src.float().sum().item() if DRY else None
    if DRY:
        assert abs(part.sum().item() - ref_sum) <= 1e-3 * max(1.0, abs(ref_sum)) + 1.0, "read yardstick wrong"
    res["read_sum"] = gbs(rd, time_eager(lambda: torch.sum(src, dtype=torch.float32), reps=reps, warmup=3))
    src = dst = part = None  # noqa: F841 - free 4 GiB before the next measurements
    _empty_cache()
    m = 8192 if not DRY else 64
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    bm = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    res["mm_tflops"] = 2.0 * m**3 / time_eager(lambda: a @ bm, reps=20 if not DRY else 1, warmup=3) / 1e9
    a = bm = None  # noqa: F841
    _empty_cache()
    res["copy"] = max(res["copy_eager"], res["copy_triton"])
    res["read"] = max(res["read_triton"], res["read_sum"])
    return res


def print_yardsticks(y: dict) -> None:
    print("\n== yardsticks (this run; GB/s, median of 30 eager calls between CUDA events) ==")
    print(f"copy 2 GiB -> 2 GiB, read+write bytes: dst.copy_(src) {y['copy_eager']:7.0f}   Triton copy "
          f"{y['copy_triton']:7.0f}   copy_ in a CUDA graph (old yardstick) {y['copy_graph']:7.0f}")
    print(f"read 2 GiB, bytes read:                Triton reduction {y['read_triton']:6.0f}   torch.sum "
          f"{y['read_sum']:7.0f}")
    print(f"bf16 matmul 8192^3: {y['mm_tflops']:.0f} TFLOPS (best D=512 Triton forward measured on an H200: "
          f"{FWD_D512_TFLOPS:.0f})")
    print(f"-> %copy (the decode target, >= {TARGET:.0%}) uses COPY = {y['copy']:.0f} GB/s "
          f"(the faster copy); %read uses READ = {y['read']:.0f} GB/s (the faster read)")


def make_sets(b, hq, hkv, nq, nkv, d, dtype, min_bytes=GiB):
    """Enough (q, k, v) copies that their K/V exceed L2 (50 MB on an H200) several times over."""
    kv_bytes = 2 * b * hkv * nkv * d * torch.finfo(dtype).bits // 8
    n = 1 if DRY else max(1, min(8, math.ceil(min_bytes / kv_bytes)))
    sets = []
    for _ in range(n):
        q = torch.randn(b, hq, nq, d, device=DEV, dtype=dtype)
        k = torch.randn(b, hkv, nkv, d, device=DEV, dtype=dtype)
        v = torch.randn(b, hkv, nkv, d, device=DEV, dtype=dtype)
        sets.append((q, k, v))
    return sets, kv_bytes


def run_split(q, k, v, causal=False, cfg=None, splits=None):
    return decode.splitkv_launch(q, k, v, attn_mask=None, causal=causal, scale=q.shape[-1] ** -0.5, cfg=cfg,
                                 splits=splits)


def run_auto(q, k, v, causal=False):
    return decode.splitkv_forward(q, k, v, attn_mask=None, causal=causal, scale=q.shape[-1] ** -0.5,
                                  config=TritonBackend())


def run_nonsplit(q, k, v, causal=False):
    from ffpa_attn.triton import fwd

    return fwd.dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                             scale=q.shape[-1] ** -0.5, config=TritonBackend(autotune=False))


def run_cute(q, k, v, tile_n=None):
    """The CuTeDSL forward kernel on packed GQA rows x KV slices (ffpa_attn.cutedsl.splitkv), forced, with the planner's
    slice count; ``tile_n`` None = the planner's (heuristics "cutedsl_splitkv_tile_n")."""
    from ffpa_attn.common.device import sm_count
    from ffpa_attn.cutedsl import splitkv
    from ffpa_attn.dispatch.heuristics import value
    from ffpa_attn.dispatch.waves import splitkv_slices

    b, hq, nq, _ = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    splits = splitkv_slices(b, hkv, hq // hkv * nq, nkv, sm_count(q.device))
    return splitkv.forward(q, k, v, False, q.shape[-1] ** -0.5, splits=splits,
                           tile_n=tile_n or value("cutedsl_splitkv_tile_n"))


def run_dispatch(q, k, v):
    """What a user gets: the public low-level forward with the implicit backend choice."""
    return ffpa_attn.ffpa_attn_fwd(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def have_cute() -> bool:
    import importlib.util

    return (DEV.type == "cuda" and torch.cuda.get_device_capability(DEV)[0] == 9
            and importlib.util.find_spec("cutlass") is not None)


def run_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1])


def describe(cfg: KernelConfig, d: int) -> str:
    bd, bdo, qkc = decode._tile(cfg, d)
    occ = cfg.opt("occ")
    return (f"BM{cfg.block_m}/BN{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}/DO{bdo}/QK{qkc}"
            + (f"/occ{occ}" if occ else ""))


def default_choice(q, k):
    """(config, splits) that splitkv_launch picks by itself."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    rows = hq // hkv * nq
    cfg = decode.default_config(d, rows, q.device)
    return cfg, decode.choose_splits(cfg, b, hkv, rows, nkv, d, q.device)


# ------------------------------------------------------------------------------------------ correctness

CORRECTNESS = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype, mask
    (1, 32, 8, 1, 32768, 512, False, torch.bfloat16, None),
    (1, 32, 2, 16, 32768, 512, True, torch.bfloat16, None),
    (2, 16, 16, 4, 8191, 1024, True, torch.float16, None),
    (1, 8, 1, 48, 5000, 320, True, torch.bfloat16, "bool"),
    (2, 8, 4, 3, 20000, 576, False, torch.float16, "float"),
    (1, 4, 4, 1, 4096, 64, False, torch.bfloat16, None),
]


def correctness(records: list) -> bool:
    ok_all = True
    print("\n== correctness vs fp32 reference (default config / split count) ==")
    print(f"{'shape':<44} {'cfg':<34} {'S':>4} {'rel_err':>9} {'lse_err':>9}  ok")
    for b, hq, hkv, nq, nkv, d, causal, dtype, mk in CORRECTNESS:
        q = torch.randn(b, hq, nq, d, device=DEV, dtype=dtype)
        k = torch.randn(b, hkv, nkv, d, device=DEV, dtype=dtype)
        v = torch.randn(b, hkv, nkv, d, device=DEV, dtype=dtype)
        mask = None
        if mk == "bool":
            mask = torch.rand(b, 1, nq, nkv, device=DEV) > 0.3
        elif mk == "float":
            mask = torch.randn(b, hq, 1, nkv, device=DEV, dtype=dtype)
        cfg, splits = default_choice(q, k)
        name = f"B{b} Hq{hq} Hkv{hkv} Nq{nq} Nkv{nkv} D{d}{' c' if causal else ''}{' ' + mk if mk else ''}"
        try:
            out, lse = decode.splitkv_launch(q, k, v, attn_mask=mask, causal=causal, scale=d ** -0.5)
            ref, ref_lse = attention(q, k, v, attn_mask=mask, is_causal=causal, scale=d ** -0.5)
            err = rel_err(out, ref)
            fin = torch.isfinite(ref_lse)
            lerr = (lse[fin] - ref_lse[fin]).abs().max().item()
            ok = err <= (1e-2 if dtype == torch.bfloat16 else 3e-3) and lerr < 2e-3 and torch.equal(
                torch.isneginf(lse), torch.isneginf(ref_lse))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err, lerr, ok = float("nan"), float("nan"), False
            name += f" ERROR {type(e).__name__}"
        ok_all &= ok
        print(f"{name:<44} {describe(cfg, d):<34} {splits:>4} {err:9.2e} {lerr:9.2e}  {'ok' if ok else 'FAIL'}")
        records.append({"kind": "correctness", "shape": name, "rel_err": err, "lse_err": lerr, "ok": ok})
        del q, k, v
        _empty_cache()
    return ok_all


# ----------------------------------------------------------------------------------------- performance

def forced_variants(d: int, rows: int, base: KernelConfig, splits0: int, nblocks: int) -> list:
    """(label, cfg, splits) forced variants for one shape: the wide autotune set (``mode="max"``), tiles
    sized to the rows per KV head (16 / 32 / 64 rows, K/V re-read from L2 by extra row blocks), ``occ``
    overrides (one program per SM: half the slices and partials; two: more loads in flight), O split over
    two 4-warp programs, and the default at other split counts (``None`` = :func:`decode.choose_splits`).
    Configs over the shared-memory limit are left out."""
    opts = dict(base.options)
    full = {"block_do": opts.get("block_do", 512), "qk_chunk": opts.get("qk_chunk", 512)}

    def kc(bm, bn, nw, st, **o):
        return KernelConfig(bm, bn, nw, st, tuple(sorted({**full, **o}.items())))

    cands = list(decode.candidate_configs(d, rows, DEV, mode="max")[1:])
    if DRY:  # the interpreter: two cheap variants only
        cands = [kc(16, 16, 4, 1), kc(32, 16, 4, 1, occ=2)]
    elif rows <= 16:
        cands += [kc(16, 32, 4, 3), kc(16, 32, 4, 2, occ=2), kc(16, 16, 4, 3, occ=2), kc(16, 16, 4, 4),
                  kc(16, 16, 8, 4, occ=2)]
    elif rows <= 64:
        cands += [kc(32, 32, 4, 2), kc(32, 32, 4, 2, occ=1), kc(32, 32, 4, 3), kc(32, 16, 4, 4),
                  kc(32, 32, 8, 3), kc(16, 32, 8, 3), kc(16, 32, 4, 3), kc(64, 16, 8, 3),
                  kc(64, 32, 4, 2, block_do=256), kc(64, 32, 4, 3, block_do=256)]
    else:
        cands += [kc(64, 16, 8, 3), kc(64, 32, 4, 2, block_do=256), kc(64, 32, 8, 2, qk_chunk=128),
                  kc(32, 32, 4, 3)]
    out, seen = [], {base}
    for c in cands:
        if c in seen:
            continue
        seen.add(c)
        if DEV.type == "cuda" and decode.smem_bytes(c, d, DEV) > smem_limit(DEV):
            continue
        out.append((describe(c, d), c, None))
    seen_s = {splits0}
    for f in (0.5, 2):
        s = max(1, min(int(splits0 * f), nblocks))
        if s not in seen_s:
            seen_s.add(s)
            out.append((f"default @S={s}", base, s))
    return out


def verdict(rf: dict, y: dict) -> dict:
    """Roofline of one shape against this run's yardsticks: the time 75% of the copy allows, the TFLOPS the
    MMAs need to fit in it, and the class: compute-bound (> 80% of the measured matmul), MMA-limited
    (> 80% of the best D=512 Triton forward, FWD_D512_TFLOPS) or bandwidth."""
    t75_us = rf["kv_bytes"] / (TARGET * y["copy"] * 1e9) * 1e6
    need = rf["flops"] / (t75_us * 1e-6) / 1e12
    t_mm_us = rf["flops"] / (y["mm_tflops"] * 1e12) * 1e6
    t_bw_us = rf["kv_bytes"] / (y["read"] * 1e9) * 1e6
    if need > 0.8 * y["mm_tflops"]:
        kind = "compute-bound"  # no flash loop runs its MMAs at > 80% of a large matmul
    elif need > 0.8 * FWD_D512_TFLOPS:
        kind = "MMA-limited"  # within reach of the tensor cores, at/above what this Triton family reached
    else:
        kind = "bandwidth"
    return {"t75_us": t75_us, "need_tflops": need, "t_matmul_us": t_mm_us, "t_read_us": t_bw_us, "kind": kind}


def dump(env: dict, y: dict, records: list) -> None:
    """Write $OUT/decode_bandwidth.json (when OUT is set); called after every shape, so a run cut short by its
    timeout still leaves what it measured."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "decode_bandwidth.json", "w") as f:
            json.dump({"env": env, "yardsticks": y, "records": records}, f, indent=1)


def perf(records: list, y: dict, sweep: bool, sweep_all: bool, env: dict) -> list:
    b, hq, nkv, d, dtype = PERF_SHAPE
    rows_out = []
    print(f"\n== decode: bf16 D={d} B={b} Hq={hq} Nkv={nkv}; COPY = {y['copy']:.0f} GB/s, READ = {y['read']:.0f} "
          f"GB/s, matmul {y['mm_tflops']:.0f} TFLOPS ==")
    print("TB/s = K/V bytes / time; %copy = of COPY (decode target >= 75%); %read = of READ; TFLOPS = "
          "4*Hq*Nq*Nkv*D / time")
    hdr = (f"{'Hkv':>3} {'Nq':>3} {'impl':<46} {'S':>4} {'us':>8} {'TB/s':>6} {'%copy':>6} {'%read':>6} "
           f"{'TFLOPS':>7} {'rel_err':>8}")
    for hkv, nq in PERF:
        sets, kv_bytes = make_sets(b, hq, hkv, nq, nkv, d, dtype)
        rows = hq // hkv * nq
        rf = decode.roofline(b, hq, hkv, nq, nkv, d)
        vd = verdict(rf, y)
        cfg0, s0 = default_choice(*sets[0][:2])
        print(f"\n-- Hkv={hkv} Nq={nq}: rows/KV head {rows}, K/V {kv_bytes / 1e6:.1f} MB (rotating {len(sets)} "
              f"copies, {len(sets) * kv_bytes / 1e6:.0f} MB), {rf['flops'] / 1e9:.1f} GFLOP "
              f"({rf['flop_per_byte']:.0f} FLOP/B); 75% of COPY = {vd['t75_us']:.1f} us, needs "
              f"{vd['need_tflops']:.0f} TFLOPS; floors: read {vd['t_read_us']:.1f} us, matmul-rate MMAs "
              f"{vd['t_matmul_us']:.1f} us -> {vd['kind']}")
        records.append({"kind": "shape", "hkv": hkv, "nq": nq, "rows": rows, "kv_bytes": kv_bytes,
                        "n_sets": len(sets), **rf, **vd})
        print(hdr)

        ref = attention(*sets[0], scale=d ** -0.5)[0]

        def measure(label, fn_of_set, splits=None, cfg=None):
            try:
                out = fn_of_set(*sets[0])
                err = rel_err(out[0] if isinstance(out, tuple) else out, ref)
                ms = time_graph([lambda st=st: fn_of_set(*st) for st in sets])
                gbs = kv_bytes / ms / 1e6
                tflops = rf["flops"] / ms / 1e9
                rec = {"kind": "perf", "hkv": hkv, "nq": nq, "impl": label, "splits": splits, "us": ms * 1e3,
                       "gbs": gbs, "pct_copy": 100 * gbs / y["copy"], "pct_read": 100 * gbs / y["read"],
                       "tflops": tflops, "rel_err": err,
                       "config": cfg.to_dict() if cfg is not None else None}
                print(f"{hkv:>3} {nq:>3} {label:<46} {splits or '':>4} {ms * 1e3:8.1f} {gbs / 1e3:6.2f} "
                      f"{100 * gbs / y['copy']:6.1f} {100 * gbs / y['read']:6.1f} {tflops:7.1f} "
                      f"{err:8.1e}{'' if err <= 1e-2 else '  WRONG'}")
                if not err <= 1e-2:
                    rec["gbs"] = 0.0  # never the "best" when wrong
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                rec = {"kind": "perf", "hkv": hkv, "nq": nq, "impl": label, "error": msg}
                print(f"{hkv:>3} {nq:>3} {label:<46} {'':>4} {'FAILED':>8}  {msg}")
                _sync()
            records.append(rec)
            return rec

        r_sdpa = measure("torch SDPA", run_sdpa)
        r_non = measure("triton non-split (fwd.dense_forward)", run_nonsplit)
        r_def = measure(f"split-KV default {describe(cfg0, d)}", run_split, splits=s0, cfg=cfg0)
        q0, k0, v0 = sets[0]
        if len(sets) > 1 and kv_bytes < 4 * 50e6:  # K/V within a few L2 sizes: show what rotation removes
            ms1 = time_graph([lambda: run_split(q0, k0, v0, cfg=cfg0, splits=s0)])
            print(f"{hkv:>3} {nq:>3}   (sanity) default without rotation, same K/V every call: {ms1 * 1e3:.1f} us "
                  f"= {kv_bytes / ms1 / 1e9:.2f} TB/s (L2 hits; not a result)")
            records.append({"kind": "no_rotation", "hkv": hkv, "nq": nq, "us": ms1 * 1e3})
        eager = time_eager(lambda: run_split(q0, k0, v0))
        records.append({"kind": "perf_eager", "hkv": hkv, "nq": nq, "us": eager * 1e3})
        best = r_def
        if sweep and (sweep_all or (hkv, nq) in MISSED):
            nblocks = -(-nkv // cfg0.block_n)
            for label, cfg, splits in forced_variants(d, rows, cfg0, s0, nblocks):
                if time.time() - T0 > SWEEP_BUDGET_S:
                    print(f"{hkv:>3} {nq:>3}   {label:<44} skipped (time budget)")
                    continue
                sp = splits if splits is not None else decode.choose_splits(cfg, b, hkv, rows, nkv, d, DEV)
                r = measure(f"  {label}", lambda q, k, v, cfg=cfg, sp=sp: run_split(q, k, v, cfg=cfg, splits=sp),
                            splits=sp, cfg=cfg)
                if r.get("gbs", 0) > best.get("gbs", 0):
                    best = r
        # the production path: TritonBackend() autotunes over candidate_configs on its first call
        r_auto = measure("split-KV autotuned (splitkv_forward)", run_auto)
        if r_auto.get("gbs", 0) > best.get("gbs", 0):
            best = r_auto
        if have_cute():
            from ffpa_attn.dispatch.heuristics import cute_tile_n

            r_cute = measure("CuTeDSL split-KV, packed rows (cute.splitkv)", run_cute)
            if r_cute.get("gbs", 0) > best.get("gbs", 0):
                best = r_cute
            if cute_tile_n(d, False) != 64:  # the forward's 80-key tiles at D=512 against the decode tile
                r_cute = measure(f"CuTeDSL split-KV tile_n={cute_tile_n(d, False)}",
                                 lambda q, k, v: run_cute(q, k, v, tile_n=cute_tile_n(d, False)))
                if r_cute.get("gbs", 0) > best.get("gbs", 0):
                    best = r_cute
        r_disp = measure(f"default dispatch: {ffpa_attn.explain(q0, k0, v0, enable_gqa=hq != hkv).forward.kernel}",
                         run_dispatch)
        if r_disp.get("gbs", 0) > best.get("gbs", 0):
            best = r_disp
        rows_out.append((hkv, nq, vd, r_sdpa, r_non, r_def, best, eager * 1e3))
        print(f"{hkv:>3} {nq:>3} best: {best['impl'].strip()} S={best.get('splits')} "
              f"{best.get('gbs', 0) / 1e3:.2f} TB/s = {best.get('pct_copy', 0):.0f}% of COPY, "
              f"{best.get('tflops', 0):.0f} TFLOPS; default launched eagerly (launch overhead in): "
              f"{eager * 1e3:.1f} us",
              flush=True)
        dump(env, y, records)
        sets = ref = None
        _empty_cache()
    return rows_out


def crossover(records: list) -> None:
    b, hq, _, d, dtype = PERF_SHAPE
    print(f"\n== crossover (B={b} Hq={hq} Hkv={hq // 4} D={d}, causal): split-KV default vs non-split, us ==")
    print(f"{'Nq':>4} {'Nkv':>6} {'rule':>12} {'split-KV':>9} {'non-split':>9}")
    from ffpa_attn.dispatch.heuristics import splitkv_sized

    for nq, nkv in CROSS:
        sets, _ = make_sets(b, hq, hq // 4, nq, nkv, d, dtype, min_bytes=128 * 2**20)
        res = []
        for fn in (run_split, run_nonsplit):
            try:
                res.append(time_graph([lambda st=st, fn=fn: fn(*st, causal=True) for st in sets]) * 1e3)
            except Exception as e:  # noqa: BLE001
                print("   ", type(e).__name__, str(e).splitlines()[0][:100] if str(e) else "")
                res.append(float("nan"))
        rule = "splitkv_fwd" if splitkv_sized(nq, nkv) else "fwd"
        print(f"{nq:>4} {nkv:>6} {rule:>12} {res[0]:9.1f} {res[1]:9.1f}")
        records.append({"kind": "crossover", "nq": nq, "nkv": nkv, "rule": rule, "splitkv_us": res[0],
                        "nonsplit_us": res[1]})
        del sets
    _empty_cache()


def summary(table: list, y: dict, ok: bool) -> None:
    print(f"\n== summary: K/V TB/s, % of COPY {y['copy'] / 1e3:.2f} TB/s (criterion: split-KV >= 75%) / % of READ "
          f"{y['read'] / 1e3:.2f} TB/s ==")
    print(f"{'Hkv':>3} {'Nq':>3} {'SDPA':>17} {'non-split':>17} {'split-KV default':>17} {'best':>17} "
          f"{'best TFLOPS':>11} {'need@75%':>8}  {'verdict':<13} best config")

    def cell(r):
        if "gbs" not in r or not r["gbs"]:
            return f"{'fail':>17}"
        return f"{r['gbs'] / 1e3:4.2f} ({r['pct_copy']:3.0f}/{r['pct_read']:3.0f}%)"

    for hkv, nq, vd, rs, rn, rd, rb, eager in table:
        tag = rb["impl"].strip() + (f" S={rb['splits']}" if rb.get("splits") else "")
        met = "MET" if rd.get("pct_copy", 0) >= 100 * TARGET else ("met by best" if rb.get("pct_copy", 0)
                                                                    >= 100 * TARGET else vd["kind"])
        print(f"{hkv:>3} {nq:>3} {cell(rs):>17} {cell(rn):>17} {cell(rd):>17} {cell(rb):>17} "
              f"{rb.get('tflops', 0):11.0f} {vd['need_tflops']:8.0f}  {met:<13} {tag}")
    print("cells: TB/s (%copy/%read); need@75% = TFLOPS the MMAs need to run at 75% of COPY; verdict: MET (default "
          "config), 'met by best' (a forced config), else the roofline class (compute-bound: need > 80% of the "
          f"matmul TFLOPS; MMA-limited: need > 80% of the {FWD_D512_TFLOPS:.0f} TFLOPS the D=512 Triton forward "
          "reached)")
    print(f"correctness: {'all ok' if ok else 'FAILURES'}; wall {time.time() - T0:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="defaults only: no config sweep")
    ap.add_argument("--sweep-all", action="store_true", help="forced-config sweep for every shape")
    ap.add_argument("--crossover", action="store_true", help="also the split-KV vs non-split crossover")
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # the device log keeps what ran if the timeout cuts in
    if DRY:
        global CORRECTNESS, PERF, PERF_SHAPE, CROSS, MISSED
        CORRECTNESS = [(1, 4, 2, 2, 300, 64, True, torch.bfloat16, "bool"),
                       (1, 2, 1, 1, 200, 80, False, torch.float16, "float")]
        PERF_SHAPE, PERF, CROSS, MISSED = (1, 4, 256, 64, torch.bfloat16), [(4, 1), (1, 4)], ((16, 256),), {(1, 4)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    gpu, sms = ("cpu (interpreter)", 0) if DRY else (torch.cuda.get_device_name(0), decode.sm_count(DEV))
    env = {"gpu": gpu, "sms": sms, "torch": torch.__version__,
           "triton": triton.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv)}
    print(json.dumps(env))
    records: list = []
    y = yardsticks()
    print_yardsticks(y)
    records.append({"kind": "yardsticks", **y})
    ok = correctness(records)
    table = perf(records, y, sweep=not args.quick, sweep_all=args.sweep_all, env=env)
    if args.crossover:
        crossover(records)
    summary(table, y, ok)
    dump(env, y, records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

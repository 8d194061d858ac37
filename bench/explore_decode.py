"""Split-KV decode forward on one GPU, in one run (~2-3 minutes on an H200):

1. HBM bandwidth of a large device-to-device copy (the yardstick: read + write bytes / time);
2. correctness of the split-KV kernel vs the fp32 reference on a few shapes (default configs);
3. the issue-11 table (bf16, D=512, B=1, Nkv=32768, Hq=32, Hkv in {32, 8, 2}, Nq in {1, 4, 16}): K/V bytes /
   time for torch SDPA, the non-split Triton forward (``ffpa_attn.triton.fwd.dense_forward``), the split-KV
   kernel with its default choice, and a few forced tile configs / split counts; % = of the copy bandwidth;
4. a small crossover sweep (split-KV vs the non-split kernel at Nq in {16, 64, 128}) for the dispatch rule.

Times are CUDA-graph replays (launch overhead excluded, as in a serving loop), median of 5 replays of a
graph holding several calls; inputs rotate over enough K/V copies that nothing stays in L2 between calls.

    python bench/explore_decode.py                # everything
    python bench/explore_decode.py --quick        # no forced-config sweep, no crossover
    OUT=/some/dir python bench/explore_decode.py  # also writes $OUT/explore_decode.json
    python bench/explore_decode.py --dry-run      # CPU + Triton interpreter, tiny shapes (checks the script)
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

from ffpa_attn import TritonBackend  # noqa: E402
from ffpa_attn.reference import attention  # noqa: E402
from ffpa_attn.testing import rel_err  # noqa: E402
from ffpa_attn.triton import decode  # noqa: E402
from ffpa_attn.triton.autotune import KernelConfig  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
GiB = 2**30
# the issue-11 table: B, Hq, Nkv, D, dtype; Hkv x Nq grid
PERF_SHAPE = (1, 32, 32768, 512, torch.bfloat16)
PERF = [(hkv, nq) for hkv in (32, 8, 2) for nq in (1, 4, 16)]
CROSS = ((16, 256), (16, 1024), (64, 1024), (64, 8192), (128, 8192))


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
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for i in range(n_inner):
                fns[i % len(fns)]()
        g.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - something in fn cannot be captured: time it eagerly
        torch.cuda.synchronize()
        print(f"    (not capturable: {type(e).__name__}; eager timing)")
        return statistics.median(time_eager(fns[i % len(fns)], reps=1) for i in range(max(reps, len(fns))))
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / n_inner)
    del g
    return statistics.median(times)


def time_eager(fn, reps: int = 10) -> float:
    if DRY:
        return time_graph([fn])
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


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting read + write bytes."""
    src = torch.empty(GiB if not DRY else 2**20, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    ms = time_graph([lambda: dst.copy_(src)], target_ms=20)
    nbytes = 2 * src.numel() * src.element_size()
    src = dst = None  # noqa: F841 - free 4 GiB before the next measurements
    _empty_cache()
    return nbytes / ms / 1e6


def make_sets(b, hq, hkv, nq, nkv, d, dtype, min_bytes=384 * 2**20):
    """Enough (q, k, v) copies that their K/V exceed L2 several times over."""
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


def run_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1])


def describe(cfg: KernelConfig, d: int) -> str:
    bd, bdo, qkc = decode._tile(cfg, d)
    return f"BM{cfg.block_m}/BN{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}/DO{bdo}/QK{qkc}"


def default_choice(q, k):
    """(config, splits) that splitkv_launch picks by itself."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    rows = hq // hkv * nq
    cfg = decode.default_config(d, rows, q.device)
    _, bdo, _ = decode._tile(cfg, d)
    per = b * hkv * -(-rows // cfg.block_m) * -(-d // bdo)
    return cfg, decode.num_splits(per, nkv, cfg.block_n, rows, q.device,
                                  occupancy=decode.occupancy(cfg, d, q.device))


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

def sweep_variants(d: int, rows: int, base: KernelConfig, splits0: int, nblocks_fn):
    """(label, cfg, splits) forced variants: the autotuner's candidates, O split over two programs (K read
    twice, through L2), and the default at other split counts."""
    out = []
    for c in decode.candidate_configs(d, rows, DEV)[1:]:
        out.append((describe(c, d), c, None))
    bdo = decode._tile(base, d)[1]
    if bdo >= 32:
        half = base.with_options(block_do=bdo // 2)
        out.append((describe(half, d) + " (O split)", half, None))
    seen = {splits0}
    for f in (0.5, 2, 4):
        s = max(1, min(int(splits0 * f), nblocks_fn(base)))
        if s not in seen:
            seen.add(s)
            out.append((f"default @S={s}", base, s))
    return out


def perf(records: list, bw_copy: float, sweep: bool) -> list:
    b, hq, nkv, d, dtype = PERF_SHAPE
    rows_out = []
    print(f"\n== decode bandwidth: bf16 D={d} B={b} Hq={hq} Nkv={nkv}; copy = {bw_copy:.0f} GB/s ==")
    print(f"{'Hkv':>3} {'Nq':>3} {'impl':<44} {'S':>4} {'us':>9} {'GB/s':>7} {'%copy':>6} {'rel_err':>8}")
    for hkv, nq in PERF:
        sets, kv_bytes = make_sets(b, hq, hkv, nq, nkv, d, dtype)
        rows = hq // hkv * nq
        cfg0, s0 = default_choice(*sets[0][:2])

        ref = attention(*sets[0], scale=d ** -0.5)[0]

        def measure(label, fn_of_set, splits=None, cfg=None):
            try:
                out = fn_of_set(*sets[0])
                err = rel_err(out[0] if isinstance(out, tuple) else out, ref)
                ms = time_graph([lambda st=st: fn_of_set(*st) for st in sets])
                gbs = kv_bytes / ms / 1e6
                rec = {"kind": "perf", "hkv": hkv, "nq": nq, "impl": label, "splits": splits, "us": ms * 1e3,
                       "gbs": gbs, "pct_copy": 100 * gbs / bw_copy, "rel_err": err}
                print(f"{hkv:>3} {nq:>3} {label:<44} {splits or '':>4} {ms * 1e3:9.1f} {gbs:7.0f} "
                      f"{100 * gbs / bw_copy:6.1f} {err:8.1e}{'' if err <= 1e-2 else '  WRONG'}")
                if not err <= 1e-2:
                    rec["gbs"] = 0.0  # never the "best" when wrong
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
                rec = {"kind": "perf", "hkv": hkv, "nq": nq, "impl": label, "error": msg}
                print(f"{hkv:>3} {nq:>3} {label:<44} {'':>4} {'FAILED':>9}  {msg}")
                _sync()
            records.append(rec)
            return rec

        r_sdpa = measure("torch SDPA", run_sdpa)
        r_non = measure("triton non-split (fwd.dense_forward)", run_nonsplit)
        r_def = measure(f"split-KV default {describe(cfg0, d)}", run_split, splits=s0)
        q0, k0, v0 = sets[0]
        eager = time_eager(lambda: run_split(q0, k0, v0))
        records.append({"kind": "perf_eager", "hkv": hkv, "nq": nq, "us": eager * 1e3})
        best = r_def
        if sweep:
            nb = lambda c: -(-nkv // c.block_n)  # noqa: E731
            for label, cfg, splits in sweep_variants(d, rows, cfg0, s0, nb):
                r = measure(f"  {label}", lambda q, k, v, cfg=cfg, splits=splits: run_split(q, k, v, cfg=cfg,
                                                                                            splits=splits),
                            splits=splits, cfg=cfg)
                if r.get("gbs", 0) > best.get("gbs", 0):
                    best = r
        # the production path: TritonBackend() autotunes over candidate_configs on its first call
        r_auto = measure("split-KV autotuned (splitkv_forward)", run_auto)
        if r_auto.get("gbs", 0) > best.get("gbs", 0):
            best = r_auto
        rows_out.append((hkv, nq, r_sdpa, r_non, r_def, best, eager * 1e3))
        sets = ref = None
        _empty_cache()
    return rows_out


def crossover(records: list, bw_copy: float) -> None:
    b, hq, _, d, dtype = PERF_SHAPE
    print(f"\n== crossover (B={b} Hq={hq} Hkv={hq // 4} D={d}, causal): split-KV default vs non-split, us ==")
    print(f"{'Nq':>4} {'Nkv':>6} {'rule':>12} {'split-KV':>9} {'non-split':>9}")
    from ffpa_attn.backends import triton_forward_kernel

    for nq, nkv in CROSS:
        sets, _ = make_sets(b, hq, hq // 4, nq, nkv, d, dtype, min_bytes=128 * 2**20)
        res = []
        for fn in (run_split, run_nonsplit):
            try:
                res.append(time_graph([lambda st=st, fn=fn: fn(*st, causal=True) for st in sets]) * 1e3)
            except Exception as e:  # noqa: BLE001
                print("   ", type(e).__name__, str(e).splitlines()[0][:100] if str(e) else "")
                res.append(float("nan"))
        rule = triton_forward_kernel(nq, nkv)
        print(f"{nq:>4} {nkv:>6} {rule:>12} {res[0]:9.1f} {res[1]:9.1f}")
        records.append({"kind": "crossover", "nq": nq, "nkv": nkv, "rule": rule, "splitkv_us": res[0],
                        "nonsplit_us": res[1]})
        del sets
    _empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="defaults only: no config sweep, no crossover")
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = ap.parse_args()
    if DRY:
        global CORRECTNESS, PERF, PERF_SHAPE, CROSS
        CORRECTNESS = [(1, 4, 2, 2, 300, 64, True, torch.bfloat16, "bool"),
                       (1, 2, 1, 1, 200, 80, False, torch.float16, "float")]
        PERF_SHAPE, PERF, CROSS = (1, 4, 256, 64, torch.bfloat16), [(4, 1), (1, 4)], ((16, 256),)
    t_start = time.time()
    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    gpu, sms = ("cpu (interpreter)", 0) if DRY else (torch.cuda.get_device_name(0), decode.sm_count(DEV))
    env = {"gpu": gpu, "sms": sms, "torch": torch.__version__,
           "triton": triton.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join(["python"] + sys.argv)}
    print(json.dumps(env))
    records: list = []
    bw = copy_bandwidth()
    records.append({"kind": "copy", "gbs": bw})
    ok = correctness(records)
    table = perf(records, bw, sweep=not args.quick)
    if not args.quick:
        crossover(records, bw)

    print(f"\n== summary: K/V GB/s (% of copy {bw:.0f} GB/s); target split-KV >= 75% ==")
    print(f"{'Hkv':>3} {'Nq':>3} {'SDPA':>13} {'non-split':>13} {'split-KV':>13} {'best forced':>13}  "
          f"{'eager us':>8}  best config")
    for hkv, nq, rs, rn, rd, rb, eager in table:
        def cell(r):
            return f"{r['gbs']:5.0f} ({r['pct_copy']:4.1f}%)" if "gbs" in r else f"{'fail':>13}"
        tag = rb["impl"].strip() + (f" S={rb['splits']}" if rb.get("splits") else "")
        print(f"{hkv:>3} {nq:>3} {cell(rs):>13} {cell(rn):>13} {cell(rd):>13} {cell(rb):>13}  {eager:8.1f}  {tag}")
    print(f"correctness: {'all ok' if ok else 'FAILURES'}; wall {time.time() - t_start:.0f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "explore_decode.json", "w") as f:
            json.dump({"env": env, "records": records}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

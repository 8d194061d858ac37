"""Tune the Triton split-D forward on the GPU in one run: correctness, then every candidate config timed.

    python bench/tune_triton_fwd.py                 # everything (~3-4 min on an H200)
    python bench/tune_triton_fwd.py --d 512 --quick # one head dim, fewer configs

Phases:
1. Compile every (D, causal, config) in a process pool (fills Triton's disk cache, so phase 3 only
   loads binaries) and, in the same workers, check each config against the fp32 reference on a
   B=1, H=16, N=1024 problem with the timing run's specialization.
2. Correctness of the public path (``ffpa_attn_func(..., backend=TritonBackend(autotune=False))``) on
   shapes with tails, GQA, causal Nq < Nkv, masks, and varlen, per D, vs the fp32 reference on the GPU.
3. Timing at B=1, H=32, N=8192 bf16 for every D in {320, 384, 512, 640, 768, 1024}, causal and not: every
   candidate config forced (bypassing the autotuner) and torch SDPA, ``triton.testing.do_bench`` medians.
4. Varlen: D=512 causal, 16 sequences summing to 65536 tokens, vs the same batch as dense
   per-sequence calls and SDPA.

Prints a compact table (best config per shape + TFLOPS; TFLOPS = 4 B H Nq Nkv D, x0.5 causal) and, when
``$OUT`` is set, writes ``$OUT/tune_triton_fwd.json`` (every measurement) and ``$OUT/ffpa_fwd.json`` (tuned
defaults in the format of ``ffpa_attn/triton/tuned/ffpa_fwd.json``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIMS = (320, 384, 512, 640, 768, 1024)
B, H, N = 1, 32, 8192


def _tflops(d: int, causal: bool, ms: float, b=B, h=H, nq=N, nkv=N) -> float:
    return 4 * b * h * nq * nkv * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def _candidates(d: int, causal: bool, quick: bool, wide: bool):
    import torch

    from ffpa_attn.triton import fwd

    dev = torch.device("cuda")
    tma = fwd.tma_possible(torch.empty(1, 1, 8, d, device=dev, dtype=torch.bfloat16))
    cands = fwd.candidate_configs(d, causal, dev, "max", tma=tma, ws=None)
    if not wide:  # 16 warps cap a thread at 128 registers: they spilled in every compile report
        cands = [c for c in cands if c.num_warps < 16]
    if tma:  # the plain-pointer path next to it (sm80 path; shows what TMA buys)
        cands += fwd.candidate_configs(d, causal, dev, "fast", tma=False)[:2]
    return cands[:4] if quick else cands


# ----------------------------------------------------------------------------------------- phase 1 (pool)


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_and_check(task):
    """Compile one config at the timing specialization and check it on a small problem (in a worker)."""
    d, causal, cfg_dict = task
    import torch

    from ffpa_attn import reference
    from ffpa_attn import TritonBackend
    from ffpa_attn.testing import rel_err
    from ffpa_attn.triton import fwd
    from ffpa_attn.triton.autotune import KernelConfig

    cfg = KernelConfig.from_dict(cfg_dict)
    t0 = time.time()
    try:
        dev = torch.device("cuda")
        q = torch.empty(B, H, N, d, device=dev, dtype=torch.bfloat16)
        kern = fwd.dense_forward(q, q, q, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                 scale=d ** -0.5, config=TritonBackend(), kernel_config=cfg, warmup=True)
        t_compile = time.time() - t0
        try:
            kern._init_handles()  # loads the binary: registers and spills as the driver reports them
            res = {"regs": int(kern.n_regs), "spills": int(kern.n_spills), "smem": int(kern.metadata.shared)}
        except Exception:  # noqa: BLE001 - older/newer Triton: no resource numbers, not an error
            res = {}
        g = torch.Generator(device=dev).manual_seed(d + causal)
        qs, ks, vs = (torch.randn(1, 16, 1024, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(3))
        out, lse = fwd.dense_forward(qs, ks, vs, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                     scale=d ** -0.5, config=TritonBackend(), kernel_config=cfg)
        ref, ref_lse = reference.attention(qs, ks, vs, is_causal=causal)
        err = rel_err(out, ref)
        lse_err = (lse - ref_lse).abs().max().item()
        return {"d": d, "causal": causal, "config": cfg_dict, "compile_s": round(t_compile, 1), "err": err,
                "lse_err": lse_err, "ok": err <= 1e-2 and lse_err < 1e-2, **res}
    except Exception as e:  # noqa: BLE001
        return {"d": d, "causal": causal, "config": cfg_dict, "error": f"{type(e).__name__}: {e}"[:300],
                "ok": False}


# ----------------------------------------------------------------------------------- phase 2 (public path)


def _public_check_task(d):
    try:
        return _public_checks([d])
    except Exception as e:  # noqa: BLE001
        return [{"d": d, "case": "all", "err": float("inf"), "lse_err": float("inf"), "ok": False,
                 "error": f"{type(e).__name__}: {e}"[:300]}]


def _public_checks(dims):
    import torch

    import ffpa_attn
    from ffpa_attn import reference
    from ffpa_attn import TritonBackend
    from ffpa_attn.testing import rel_err

    be = TritonBackend(autotune=False)
    dev = "cuda"
    rows = []
    for d in dims:
        cases = [  # b, hq, hkv, nq, nkv, causal, dtype, mask
            (2, 8, 2, 1000, 1000, True, torch.bfloat16, None),
            (1, 4, 4, 300, 1537, True, torch.float16, None),
            (1, 4, 1, 777, 777, False, torch.bfloat16, "bool"),
            (2, 2, 2, 513, 640, False, torch.float16, "float"),
        ]
        for b, hq, hkv, nq, nkv, causal, dtype, mk in cases:
            q = torch.randn(b, hq, nq, d, device=dev).to(dtype)
            k = torch.randn(b, hkv, nkv, d, device=dev).to(dtype)
            v = torch.randn(b, hkv, nkv, d, device=dev).to(dtype)
            mask = None
            if mk == "bool":
                mask = torch.rand(b, 1, nq, nkv, device=dev) > 0.2
            elif mk == "float":
                mask = torch.randn(1, hq, 1, nkv, device=dev).to(dtype)
            out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=causal, enable_gqa=hq != hkv, attn_mask=mask,
                                               backend=be)
            ref, ref_lse = reference.attention(q, k, v, attn_mask=mask, is_causal=causal)
            fin = torch.isfinite(ref_lse)
            err = rel_err(out, ref)
            lerr = (lse[fin] - ref_lse[fin]).abs().max().item()
            tol = 1e-2 if dtype == torch.bfloat16 else 3e-3
            rows.append({"d": d, "case": f"b{b} h{hq}/{hkv} {nq}x{nkv} causal={int(causal)} {str(dtype)[6:]} "
                                         f"mask={mk}", "err": err, "lse_err": lerr,
                         "ok": err <= tol and lerr < 1e-2})
        # varlen with lengths 0, 1 and mixed
        lens = [0, 1, 129, 700, 64]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        t = sum(lens)
        q = torch.randn(t, 4, d, device=dev).to(torch.bfloat16)
        k = torch.randn(t, 2, d, device=dev).to(torch.bfloat16)
        v = torch.randn(t, 2, d, device=dev).to(torch.bfloat16)
        out, lse = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                   enable_gqa=True, return_lse=True, backend=be)
        ref, ref_lse = reference.varlen_attention(q, k, v, cu, cu, causal=True)
        fin = torch.isfinite(ref_lse)
        err = rel_err(out, ref)
        lerr = (lse[fin] - ref_lse[fin]).abs().max().item()
        rows.append({"d": d, "case": f"varlen {lens} causal gqa", "err": err, "lse_err": lerr,
                     "ok": err <= 1e-2 and lerr < 1e-2})
    return rows


# ------------------------------------------------------------------------------------------ phase 3 (time)


def _time_all(dims, causals, cands, results_ok, deadline=float("inf")):
    import torch
    import torch.nn.functional as F
    import triton.testing

    from ffpa_attn import TritonBackend
    from ffpa_attn.triton import fwd
    from ffpa_attn.triton.autotune import KernelConfig

    rows = []
    be = TritonBackend()
    for d in dims:
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in causals:
            sd = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                         warmup=25, rep=60, return_mode="median")
            rows.append({"d": d, "causal": causal, "impl": "sdpa", "ms": sd, "tflops": _tflops(d, causal, sd)})
            for i, cd in enumerate(cands[(d, causal)]):
                cfg = KernelConfig.from_dict(cd)
                ok = results_ok.get((d, causal, json.dumps(cd, sort_keys=True)))
                if i >= 2 and time.time() > deadline:
                    rows.append({"d": d, "causal": causal, "impl": "triton", "config": cd, "ms": None,
                                 "skipped": "time budget"})
                    continue
                if ok is not True:
                    rows.append({"d": d, "causal": causal, "impl": "triton", "config": cd, "ms": None,
                                 "skipped": "failed compile/check"})
                    continue

                def run(cfg=cfg):
                    fwd.dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                      scale=d ** -0.5, config=be, kernel_config=cfg)

                try:
                    ms = triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    rows.append({"d": d, "causal": causal, "impl": "triton", "config": cd, "ms": None,
                                 "skipped": f"{type(e).__name__}: {e}"[:200]})
                    continue
                rows.append({"d": d, "causal": causal, "impl": "triton", "config": cd, "ms": ms,
                             "tflops": _tflops(d, causal, ms)})
        q = k = v = None
        torch.cuda.empty_cache()
    return rows


def _time_varlen(best_cfg):
    """D=512 causal: 16 random-length sequences summing to 65536 tokens."""
    import torch
    import torch.nn.functional as F
    import triton.testing

    from ffpa_attn import TritonBackend
    from ffpa_attn.triton import fwd
    from ffpa_attn.triton.autotune import KernelConfig

    d, hq, total, nseq = 512, 32, 65536, 16
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(total // 64 - 1, generator=g)[: nseq - 1].add(1).mul(64).tolist())
    bounds = [0] + cuts + [total]
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = KernelConfig.from_dict(best_cfg) if best_cfg else None
    be = TritonBackend()
    flops = sum(4 * hq * n * n * d * 0.5 for n in lens)

    def varlen():
        fwd.varlen_forward(q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.0, rng=None, causal=True,
                           scale=d ** -0.5, config=be, kernel_config=cfg)

    views = [(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None])
             for a, b in zip(bounds[:-1], bounds[1:])]

    def dense_loop():
        for qs, ks, vs in views:
            fwd.dense_forward(qs, ks, vs, attn_mask=None, dropout_p=0.0, rng=None, causal=True, scale=d ** -0.5,
                              config=be, kernel_config=cfg)

    def sdpa_loop():
        for qs, ks, vs in views:
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    out = {"lens": lens}
    for name, fn in (("varlen", varlen), ("dense_per_seq", dense_loop), ("sdpa_per_seq", sdpa_loop)):
        try:
            ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            out[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
    return out


# ------------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="*", default=list(DIMS), help="head dims")
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1], help="causal settings (0, 1)")
    ap.add_argument("--quick", action="store_true", help="at most 4 configs per shape")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 4), help="compile pool size")
    ap.add_argument("--no-varlen", action="store_true", help="skip the varlen vs per-sequence timing")
    ap.add_argument("--wide", action="store_true", help="also 16-warp configs")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds after start past which each remaining shape times only its first 2 configs")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    t_start = time.time()
    causals = [bool(c) for c in args.causal]
    cands = {(d, c): [cfg.to_dict() for cfg in _candidates(d, c, args.quick, args.wide)]
             for d in args.d for c in causals}
    tasks = [(d, c, cd) for (d, c), lst in cands.items() for cd in lst]
    print(f"[1+2] compiling + checking {len(tasks)} configs and the public path for {len(args.d)} head dims "
          f"with {args.workers} workers ...", flush=True)
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, initializer=_worker_init, maxtasksperchild=8) as pool:
        pub_async = pool.map_async(_public_check_task, args.d, chunksize=1)
        checks = pool.map(_compile_and_check, tasks, chunksize=1)
        public = [r for rows in pub_async.get() for r in rows]
    ok = {(r["d"], r["causal"], json.dumps(r["config"], sort_keys=True)): r["ok"] for r in checks}
    bad = [r for r in checks if not r["ok"]]
    print(f"    configs: {len(checks) - len(bad)} ok, {len(bad)} failed; public path: "
          f"{sum(r['ok'] for r in public)}/{len(public)} ok ({time.time() - t_start:.0f} s)", flush=True)
    for r in bad:
        print(f"    FAIL D={r['d']} causal={int(r['causal'])} {_short(r['config'])}: "
              f"{r.get('error') or 'err=%.2e lse_err=%.2e' % (r['err'], r['lse_err'])}")
    for r in public:
        if not r["ok"]:
            print(f"    FAIL public D={r['d']} {r['case']}: err={r['err']:.2e} lse_err={r['lse_err']:.2e} "
                  f"{r.get('error', '')}")

    print("[3] timing B=1 H=32 N=8192 bf16 ...", flush=True)
    timings = _time_all(args.d, causals, cands, ok, deadline=t_start + args.budget)
    res = {(r["d"], r["causal"], json.dumps(r["config"], sort_keys=True)): r for r in checks}
    for r in timings:
        if r["impl"] == "triton":
            c = res.get((r["d"], r["causal"], json.dumps(r["config"], sort_keys=True)), {})
            r.update({k: c[k] for k in ("regs", "spills", "smem") if k in c})
    n_budget = sum(r.get("skipped") == "time budget" for r in timings)
    if n_budget:
        print(f"    time budget reached: {n_budget} configs not timed (rerun with --d ... for them)")
    best, fastest = {}, {}
    for r in timings:
        if r["impl"] == "triton" and r.get("ms"):
            key = (r["d"], r["causal"])
            if key not in fastest or r["ms"] < fastest[key]["ms"]:
                fastest[key] = r
    for key, f in fastest.items():  # prefer a config without spills when it is within 3% of the fastest
        clean = [r for r in timings if r["impl"] == "triton" and r.get("ms") and (r["d"], r["causal"]) == key
                 and r.get("spills", 0) == 0 and r["ms"] <= f["ms"] * 1.03]
        best[key] = min(clean, key=lambda r: r["ms"]) if clean else f
    varlen = None
    if not args.no_varlen and 512 in args.d and (512, True) in best:
        print("[4] varlen D=512 causal, 16 sequences / 65536 tokens ...", flush=True)
        varlen = _time_varlen(best[(512, True)]["config"])

    # ------------------------------------------------------------------------------------ summary table
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}  ({time.time() - t_start:.0f} s)")
    print(f"{'D':>5} {'causal':>6} {'SDPA':>7} {'best Triton':>11} {'x SDPA':>6}  config (TFLOPS of every config)")
    sdpa = {(r["d"], r["causal"]): r for r in timings if r["impl"] == "sdpa"}
    for d in args.d:
        for c in causals:
            s = sdpa.get((d, c))
            b = best.get((d, c))
            allc = sorted((r for r in timings if r["impl"] == "triton" and r["d"] == d and r["causal"] == c
                           and r.get("ms")), key=lambda r: r["ms"])
            others = " ".join([f"{_short(r['config'])}={r['tflops']:.0f}" for r in allc if r is not b][:5])
            print(f"{d:>5} {int(c):>6} {s['tflops'] if s else float('nan'):>7.1f} "
                  f"{b['tflops'] if b else float('nan'):>11.1f} "
                  f"{(b['tflops'] / s['tflops']) if (b and s) else float('nan'):>6.2f}  "
                  f"{_short(b['config']) if b else '-'} (regs {b.get('regs', '?') if b else '-'}, spills "
                  f"{b.get('spills', '?') if b else '-'})  | {others}")
    if varlen:
        print("varlen D=512 causal 16 seqs/65536 tok: " + ", ".join(
            f"{k} {v['tflops']:.1f} TFLOPS" for k, v in varlen.items() if isinstance(v, dict) and "tflops" in v))
    n_fail = len(bad) + sum(not r["ok"] for r in public)
    print(f"correctness: {len(checks) + len(public) - n_fail} ok, {n_fail} failed")

    tuned = _tuned_json(best)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        Path(out_dir, "tune_triton_fwd.json").write_text(json.dumps(
            {"checks": checks, "public": public, "timings": timings, "varlen": varlen,
             "device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": __import__("triton").__version__}, indent=1, default=str))
        Path(out_dir, "ffpa_fwd.json").write_text(json.dumps(tuned, indent=1, sort_keys=True))
        print(f"wrote {out_dir}/tune_triton_fwd.json and {out_dir}/ffpa_fwd.json (tuned defaults)")
    return 1 if n_fail else 0


def _short(cd: dict) -> str:
    s = f"{cd['block_m']}x{cd['block_n']}w{cd['num_warps']}s{cd['num_stages']}"
    if cd.get("nsplit", 1) > 1:
        s += f"n{cd['nsplit']}"
    if cd.get("tma"):
        s += "T"
    if cd.get("ws"):
        s += "W"
    return s


def _tuned_json(best) -> dict:
    """{gpu: {default key: config}} for the plain problem (bf16 and fp16 share the measured bf16 winner)."""
    from ffpa_attn.common.device import gpu_name
    from ffpa_attn.triton import autotune
    from ffpa_attn.triton.autotune import KernelConfig

    import torch

    gpu = gpu_name(torch.device("cuda"))
    entries = {}
    for (d, causal), r in best.items():
        cfg = KernelConfig.from_dict(r["config"])
        for dt in ("bfloat16", "float16"):
            key = (dt, d, int(causal), 0, 0, 0, 0, int(bool(cfg.opt("tma", False))))
            entries[autotune.key_str(key)] = cfg.to_dict()
    return {gpu: entries}


if __name__ == "__main__":
    sys.exit(main())

"""Explore the Triton split-D backward on the GPU in one run: correctness, then every candidate plan timed.

    python bench/explore_bwd.py                  # everything, ~3-4 min on an H200
    python bench/explore_bwd.py --d 512 --quick  # one head dim, three plans
    python bench/explore_bwd.py --dry-run        # print the work list and exit (no GPU needed)

Phases:
1. (process pool) compile every (D, causal, plan) at the timing run's specialization (B=1, H=32, N a
   multiple of 16), which fills Triton's disk cache so phase 3 only loads binaries, and check each plan's
   dQ/dK/dV on that problem (N=384) against the fp32 reference.
2. (process pool, one task per D) the public path ``ffpa_attn_func(..., backend=TritonBackend())``,
   forward + backward, on shapes with tails, GQA/MQA, causal Nq < Nkv, bool masks with empty rows, a
   float mask with grad, dropout (reference with the kernels' keep-mask), varlen with lengths 0/1, and
   ``deterministic=True`` twice (bitwise equal). Gradients vs the fp32 reference, next to torch's own
   same-dtype SDPA error where SDPA can run the case (the bar is 2x that).
3. Timing at B=1, H=32, N=8192 bf16, D in {320, 384, 512, 640, 768, 1024}, causal and not: every plan
   that passed phase 1, forced, ``triton.testing.do_bench`` medians of the backward alone (from saved
   out/lse), next to torch SDPA's backward (median of fwd+bwd minus median of fwd). Peak memory of
   forward + backward (``torch.cuda.max_memory_allocated`` above the inputs) for the best plan and SDPA.

TFLOPS: backward = 2.5 x 4 B H N^2 D (x0.5 causal). Prints a compact table (best plan + TFLOPS per shape)
and, with ``$OUT`` set, writes ``$OUT/explore_bwd.json`` (every measurement) and
``$OUT/ffpa_bwd_tuned.json`` (best plan per (D, causal)).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIMS = (320, 384, 512, 640, 768, 1024)
B, H, N = 1, 32, 8192
N_CHECK = 384  # phase-1 check length: a multiple of 16 like N, so the same compiled specialization


def bwd_tflops(d: int, causal: bool, ms: float, b: int = B, h: int = H, n: int = N) -> float:
    return 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def plan_to_dict(plan) -> dict:
    return {"dkdv": dataclasses.asdict(plan.dkdv), "dq": None if plan.dq is None else dataclasses.asdict(plan.dq),
            "tma": plan.tma}


def plan_from_dict(d: dict):
    from ffpa_attn.triton.bwd_config import BwdPlan, DkdvConfig, DqConfig

    return BwdPlan(DkdvConfig(**d["dkdv"]), None if d["dq"] is None else DqConfig(**d["dq"]), d["tma"])


def _key(d: int, causal: bool, plan_d: dict) -> str:
    return json.dumps([d, causal, plan_d], sort_keys=True)


# ------------------------------------------------------------------------------------------- workers


def _worker_init():
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    torch.cuda.set_device(0)


def _rel(a, b) -> float:
    from ffpa_attn.testing import rel_err

    return rel_err(a, b)


def _ref_grads(q, k, v, do, mask=None, causal=False, dropout_p=0.0, keep=None):
    """fp32 autograd through the reference: (dq, dk, dv, dmask|None)."""
    import torch

    from ffpa_attn import reference

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    m32 = mask.detach().float().requires_grad_() if (mask is not None and mask.is_floating_point()) else mask
    out, _ = reference.attention(q32, k32, v32, attn_mask=m32, is_causal=causal, dropout_p=dropout_p,
                                 dropout_keep=keep)
    out.backward(do.float())
    dm = m32.grad if (m32 is not None and m32.is_floating_point()) else None
    del torch
    return q32.grad, k32.grad, v32.grad, dm


def _compile_and_check(task):
    """Phase 1: compile a plan at the timing specialization and check it on a B=1, H=32, N=384 problem."""
    d, causal, plan_d = task
    import torch

    from ffpa_attn import reference
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.triton import bwd

    plan = plan_from_dict(plan_d)
    t0 = time.time()
    try:
        g = torch.Generator(device="cuda").manual_seed(d * 2 + causal)
        q, k, v, do = (torch.randn(B, H, N_CHECK, d, device="cuda", generator=g).to(torch.bfloat16)
                       for _ in range(4))
        out, lse = reference.attention(q, k, v, is_causal=causal)
        out = out.to(torch.bfloat16)
        dq, dk, dv, _ = bwd.dense_backward(do, q, k, v, out, lse.float(), dlse=None, attn_mask=None,
                                           mask_grad=False, dropout_p=0.0, rng=None, causal=causal,
                                           scale=d ** -0.5, config=TritonBackend(), plan=plan)
        torch.cuda.synchronize()
        t_first = time.time() - t0
        refs = _ref_grads(q, k, v, do, causal=causal)
        errs = [_rel(x, r) for x, r in zip((dq, dk, dv), refs)]
        return {"d": d, "causal": causal, "plan": plan_d, "short": plan.short(), "compile_s": round(t_first, 1),
                "errs": errs, "ok": max(errs) <= 1e-2}
    except Exception as e:  # noqa: BLE001 - out of resources, compile errors: report and go on
        return {"d": d, "causal": causal, "plan": plan_d, "short": plan.short(),
                "error": f"{type(e).__name__}: {e}"[:400], "ok": False}


def _sdpa_errs(q, k, v, do, refs, mask=None, causal=False):
    """torch's own same-dtype SDPA backward error vs the fp32 reference (None where it cannot run)."""
    import torch
    import torch.nn.functional as F

    from ffpa_attn import reference

    b, hq, nq, _ = q.shape
    bias = reference.scores_bias(b, hq, nq, k.shape[2], mask, causal, q.device, torch.float32)
    if bias is not None and torch.isneginf(bias).all(-1).any():
        return None
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, reference._expand_kv(ks, hq), reference._expand_kv(vs, hq),
                                         attn_mask=None if bias is None else bias.to(q.dtype))
    out.backward(do)
    return [_rel(x, r) for x, r in zip((qs.grad, ks.grad, vs.grad), refs)]


def _public_checks(d):
    """Phase 2 for one head dim: public fwd+bwd on feature cases; rows of {case, errs, base, ok}."""
    import torch

    import ffpa_attn
    from ffpa_attn import reference
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.interface import _draw_rng
    from ffpa_attn.triton.dropout import dense_keep_mask

    dev = "cuda"
    rows = []
    tol = {torch.bfloat16: 1e-2, torch.float16: 3e-3}

    def grads(q, k, v, do, mask=None, **kw):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ms = mask.detach().clone().requires_grad_() if (mask is not None and mask.is_floating_point()) else mask
        out = ffpa_attn.ffpa_attn_func(qs, ks, vs, attn_mask=ms, enable_gqa=q.shape[1] != k.shape[1], **kw)
        out.backward(do)
        return qs.grad, ks.grad, vs.grad, (ms.grad if ms is not None and ms.is_floating_point() else None)

    def record(case, got, refs, dtype, base=None):
        errs = [_rel(x, r) for x, r in zip(got, refs) if r is not None]
        lim = [min(tol[dtype], 2 * bb) if base is not None else tol[dtype] for bb in (base or [0] * len(errs))]
        lim += [tol[dtype]] * (len(errs) - len(lim))
        rows.append({"d": d, "case": case, "errs": errs, "base": base,
                     "ok": all(e <= li for e, li in zip(errs, lim))})

    cases = [  # b, hq, hkv, nq, nkv, causal, dtype, mask kind, split
        (2, 8, 2, 1000, 1000, True, torch.bfloat16, None, False),
        (1, 4, 4, 300, 1537, True, torch.float16, None, True),
        (1, 4, 1, 777, 777, False, torch.bfloat16, "bool", False),
        (2, 2, 2, 513, 640, False, torch.float16, "float", False),
    ]
    for b, hq, hkv, nq, nkv, causal, dtype, mk, split in cases:
        try:
            q = torch.randn(b, hq, nq, d, device=dev).to(dtype)
            k = torch.randn(b, hkv, nkv, d, device=dev).to(dtype)
            v = torch.randn(b, hkv, nkv, d, device=dev).to(dtype)
            do = torch.randn(b, hq, nq, d, device=dev).to(dtype)
            mask = None
            if mk == "bool":
                mask = torch.rand(b, 1, nq, nkv, device=dev) > 0.2
                mask[:, :, 5] = False  # a row that sees no key
            elif mk == "float":
                mask = torch.randn(1, hq, 1, nkv, device=dev).to(dtype)
            got = grads(q, k, v, do, mask=mask, is_causal=causal, backend=TritonBackend(split_launch=split))
            refs = _ref_grads(q, k, v, do, mask=mask, causal=causal)
            base = _sdpa_errs(q, k, v, do, refs[:3], mask=mask, causal=causal)
            record(f"b{b} h{hq}/{hkv} {nq}x{nkv} causal={int(causal)} {str(dtype)[6:]} mask={mk} "
                   f"{'split' if split else 'fused'}", got, refs, dtype, base)
        except Exception as e:  # noqa: BLE001
            rows.append({"d": d, "case": f"{b} {hq}/{hkv} {nq}x{nkv} {mk}", "error": f"{type(e).__name__}: {e}"[:300],
                         "ok": False})
    try:  # dropout: the reference with the kernels' keep-mask
        b, hq, hkv, nq, nkv, p = 1, 4, 2, 512, 700, 0.2
        q = torch.randn(b, hq, nq, d, device=dev).to(torch.bfloat16)
        k = torch.randn(b, hkv, nkv, d, device=dev).to(torch.bfloat16)
        v = torch.randn(b, hkv, nkv, d, device=dev).to(torch.bfloat16)
        do = torch.randn_like(q)
        torch.manual_seed(5)
        got = grads(q, k, v, do, dropout_p=p, is_causal=True, backend="triton")
        torch.manual_seed(5)
        keep = dense_keep_mask(_draw_rng(q.device), b, hq, nq, nkv, p)
        refs = _ref_grads(q, k, v, do, causal=True, dropout_p=p, keep=keep)
        record(f"dropout p={p} gqa causal {nq}x{nkv}", got, refs, torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        rows.append({"d": d, "case": "dropout", "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
    try:  # varlen, lengths 0 and 1, causal GQA, through the packed autograd path
        lens = [0, 1, 129, 700, 64]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        t = sum(lens)
        q = torch.randn(t, 4, d, device=dev).to(torch.bfloat16)
        k = torch.randn(t, 2, d, device=dev).to(torch.bfloat16)
        v = torch.randn(t, 2, d, device=dev).to(torch.bfloat16)
        do = torch.randn_like(q)
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = ffpa_attn.ffpa_attn_varlen_func(qs, ks, vs, cu, cu, max(lens), max(lens), causal=True,
                                              enable_gqa=True, backend="triton")
        out.backward(do)
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        ref, _ = reference.varlen_attention(q32, k32, v32, cu, cu, causal=True)
        ref.backward(do.float())
        record(f"varlen {lens} causal gqa", (qs.grad, ks.grad, vs.grad), (q32.grad, k32.grad, v32.grad),
               torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        rows.append({"d": d, "case": "varlen", "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
    try:  # deterministic: bitwise reproducible, and correct
        q = torch.randn(1, 4, 600, d, device=dev).to(torch.bfloat16)
        k = torch.randn(1, 2, 600, d, device=dev).to(torch.bfloat16)
        v = torch.randn(1, 2, 600, d, device=dev).to(torch.bfloat16)
        do = torch.randn_like(q)
        mask = torch.randn(1, 1, 600, 600, device=dev).to(torch.bfloat16)
        be = TritonBackend(deterministic=True)
        a = grads(q, k, v, do, mask=mask, is_causal=True, backend=be)
        b_ = grads(q, k, v, do, mask=mask, is_causal=True, backend=be)
        same = all(torch.equal(x, y) for x, y in zip(a, b_))
        refs = _ref_grads(q, k, v, do, mask=mask, causal=True)
        record("deterministic x2 (float mask grad, causal, gqa)", a, refs, torch.bfloat16)
        rows[-1]["bitwise_equal"] = same
        rows[-1]["ok"] = rows[-1]["ok"] and same
    except Exception as e:  # noqa: BLE001
        rows.append({"d": d, "case": "deterministic", "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
    return rows


# ---------------------------------------------------------------------------------------- phase 3 (time)


def _bench_ms(fn, reps: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=1, rep=reps, return_mode="median"))


def _peak_extra(fn) -> int:
    """Bytes allocated above the current level at the peak of fn()."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _time_all(dims, causals, plans_ok, deadline, reps, sdpa):
    import torch
    import torch.nn.functional as F

    import ffpa_attn
    from ffpa_attn import reference  # noqa: F401
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.triton import bwd

    rows = []
    be = TritonBackend()
    for d in dims:
        q, k, v, do = (torch.randn(B, H, N, d, device="cuda").to(torch.bfloat16) for _ in range(4))
        for causal in causals:
            out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=causal, backend="triton")
            best = None
            for plan_d in plans_ok.get((d, causal), []):
                plan = plan_from_dict(plan_d)
                if time.time() > deadline and best is not None:
                    rows.append({"d": d, "causal": causal, "impl": "triton", "plan": plan_d, "short": plan.short(),
                                 "skipped": "time budget"})
                    continue

                def run(plan=plan):
                    bwd.dense_backward(do, q, k, v, out, lse, dlse=None, attn_mask=None, mask_grad=False,
                                       dropout_p=0.0, rng=None, causal=causal, scale=d ** -0.5, config=be, plan=plan)

                try:
                    ms = _bench_ms(run, reps)
                    row = {"d": d, "causal": causal, "impl": "triton", "plan": plan_d, "short": plan.short(),
                           "ms": ms, "tflops": bwd_tflops(d, causal, ms)}
                    if best is None or ms < best["ms"]:
                        best = row
                except Exception as e:  # noqa: BLE001
                    row = {"d": d, "causal": causal, "impl": "triton", "plan": plan_d, "short": plan.short(),
                           "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                print(f"  [{time.strftime('%H:%M:%S')}] D={d} causal={int(causal)} {row.get('short')}: "
                      f"{row.get('ms', float('nan')):.2f} ms {row.get('tflops', 0):.0f} TFLOPS "
                      f"{row.get('error', '')}", flush=True)
            if best is not None:  # peak memory of forward + backward with the best plan (public autograd path)
                best["best"] = True
                plan = plan_from_dict(best["plan"])
                orig = bwd._plan_for
                bwd._plan_for = lambda d_, cfg, dev, plan=plan: plan  # noqa: E731
                try:
                    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

                    def fb():
                        o = ffpa_attn.ffpa_attn_func(qg, kg, vg, is_causal=causal, backend="triton")
                        o.backward(do)

                    best["peak_mb"] = _peak_extra(fb) / 2**20
                    del qg, kg, vg
                finally:
                    bwd._plan_for = orig
            if sdpa and time.time() < deadline + 30:
                qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

                def fwd_only():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)

                def fwd_bwd():
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).backward(do)

                t_fb = _bench_ms(fwd_bwd, reps)
                t_f = _bench_ms(fwd_only, reps)
                qs.grad = ks.grad = vs.grad = None
                peak = _peak_extra(fwd_bwd) / 2**20
                ms = t_fb - t_f
                rows.append({"d": d, "causal": causal, "impl": "sdpa", "ms": ms, "tflops": bwd_tflops(d, causal, ms),
                             "fwd_ms": t_f, "peak_mb": peak})
                print(f"  [{time.strftime('%H:%M:%S')}] D={d} causal={int(causal)} sdpa bwd: {ms:.2f} ms "
                      f"{bwd_tflops(d, causal, ms):.0f} TFLOPS, peak {peak:.0f} MB", flush=True)
                del qs, ks, vs
            del out, lse
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ main


def _work_list(dims, causals, quick):
    from ffpa_attn.triton.bwd_config import candidate_plans

    work = {}
    for d in dims:
        plans = candidate_plans(d)
        if quick:
            plans = plans[:3]
        for causal in causals:
            work[(d, causal)] = [plan_to_dict(p) for p in plans]
    return work


def _budget_mb(d: int) -> float:
    """DESIGN budget for fwd+bwd peak above the inputs: out + lse + fp32 dQ + dq, dk, dv (bf16)."""
    elems = B * H * N * d
    return (elems * (2 + 4 + 3 * 2) + B * H * N * 4) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="*", default=list(DIMS))
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--quick", action="store_true", help="three plans per shape")
    ap.add_argument("--budget", type=float, default=225.0, help="seconds; later timings are skipped past it")
    ap.add_argument("--reps", type=int, default=40, help="do_bench rep (ms) per timing")
    ap.add_argument("--workers", type=int, default=0, help="compile pool size (0 = cpu count - 2, max 14)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-checks", action="store_true", help="skip phase 2")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.budget
    causals = [bool(c) for c in args.causal]
    work = _work_list(args.d, causals, args.quick)
    tasks = [(d, c, p) for (d, c), plans in work.items() for p in plans]
    if args.dry_run:
        for d, c, p in tasks:
            print(d, int(c), plan_from_dict(p).short())
        print(f"{len(tasks)} (D, causal, plan) compile+check tasks; phase 2 on D={args.d}")
        return 0

    import torch
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}; "
          f"{len(tasks)} plan tasks", flush=True)
    nw = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    ctx = mp.get_context("spawn")
    results = {"env": {"torch": torch.__version__, "triton": triton.__version__,
                       "gpu": torch.cuda.get_device_name(0), "B": B, "H": H, "N": N}}
    with ctx.Pool(nw, initializer=_worker_init) as pool:
        checks_async = None if args.no_checks else pool.map_async(_public_checks, args.d)
        compiled = pool.map(_compile_and_check, tasks, chunksize=1)
        print(f"[{time.time() - t_start:.0f}s] phase 1: {sum(r['ok'] for r in compiled)}/{len(compiled)} plans "
              f"compiled and correct", flush=True)
        for r in compiled:
            if not r["ok"]:
                print(f"  FAILED D={r['d']} causal={int(r['causal'])} {r['short']}: "
                      f"{r.get('error') or r.get('errs')}", flush=True)
        checks = [] if checks_async is None else [row for rows in checks_async.get() for row in rows]
    print(f"[{time.time() - t_start:.0f}s] phase 2: {sum(r['ok'] for r in checks)}/{len(checks)} public-path "
          f"checks passed", flush=True)
    for r in checks:
        flag = "ok  " if r["ok"] else "FAIL"
        errs = " ".join(f"{e:.2e}" for e in r.get("errs", []))
        base = " ".join(f"{e:.2e}" for e in (r.get("base") or []))
        print(f"  {flag} D={r['d']} {r['case']}: errs {errs} | sdpa {base} {r.get('error', '')}", flush=True)
    results["compile"] = compiled
    results["checks"] = checks
    plans_ok = {}
    for r in compiled:
        if r["ok"]:
            plans_ok.setdefault((r["d"], r["causal"]), []).append(r["plan"])
    timing = _time_all(args.d, causals, plans_ok, deadline, args.reps, not args.no_sdpa)
    results["timing"] = timing
    # ------------------------------------------------------------------------------------------- table
    print(f"\n[{time.time() - t_start:.0f}s] backward, bf16 B={B} H={H} N={N} (TFLOPS = 2.5 x 4BHN^2D, x0.5 causal)")
    print(f"{'D':>5} {'causal':>6} | {'best plan':<64} {'ms':>8} {'TFLOPS':>7} | {'sdpa':>6} {'x':>5} | "
          f"{'peak MB':>8} {'sdpa MB':>8} {'budget':>7}")
    tuned = {}
    for d in args.d:
        for c in causals:
            best = [r for r in timing if r["d"] == d and r["causal"] == c and r.get("best")]
            sd = [r for r in timing if r["d"] == d and r["causal"] == c and r["impl"] == "sdpa"]
            b_ = best[0] if best else None
            s_ = sd[0] if sd else None
            if b_ is not None:
                tuned[f"{d}|{int(c)}"] = b_["plan"]
            print(f"{d:>5} {int(c):>6} | {(b_['short'] if b_ else '-'):<64} "
                  f"{(b_['ms'] if b_ else float('nan')):>8.2f} {(b_['tflops'] if b_ else 0):>7.0f} | "
                  f"{(s_['tflops'] if s_ else 0):>6.0f} "
                  f"{(b_['tflops'] / s_['tflops'] if b_ and s_ else 0):>5.2f} | "
                  f"{(b_.get('peak_mb', 0) if b_ else 0):>8.0f} {(s_['peak_mb'] if s_ else 0):>8.0f} "
                  f"{_budget_mb(d):>7.0f}")
    print(f"\nall plans (TFLOPS):")
    for r in timing:
        if r["impl"] == "triton":
            print(f"  D={r['d']:<5} causal={int(r['causal'])} {r['short']:<70} "
                  f"{r.get('tflops', 0):>6.0f} {r.get('skipped', '') or r.get('error', '')}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "explore_bwd.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(Path(out_dir) / "ffpa_bwd_tuned.json", "w") as f:
            json.dump({results["env"]["gpu"]: tuned}, f, indent=1)
        print(f"wrote {out_dir}/explore_bwd.json and ffpa_bwd_tuned.json")
    print(f"total {time.time() - t_start:.0f}s")
    ok = all(r["ok"] for r in compiled) and all(r["ok"] for r in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

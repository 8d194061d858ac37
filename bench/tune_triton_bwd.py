"""Tune the Triton split-D backward on the GPU in one run: correctness, then every candidate plan timed.

    python bench/tune_triton_bwd.py                  # everything, ~4 min on an H200 (deadline: --budget 210 s)
    python bench/tune_triton_bwd.py --d 512 --quick  # one head dim, three plans
    python bench/tune_triton_bwd.py --dry-run        # print the work list and exit (no GPU needed)
    python bench/tune_triton_bwd.py --smoke --d 512 --quick --causal 1   # the script itself, CPU interpreter

Phases:
1. (process pool) compile every (D, causal, plan) at the timing run's specialization (B=1, H=32, N a
   multiple of 16), distinct kernels first, which fills Triton's disk cache so phase 3 only loads
   binaries, and check each plan's dQ/dK/dV on that problem (N=384) against the fp32 reference.
2. (same pool, one task per (D, case), D in --check-d) the public path ``ffpa_attn_func(...,
   backend=TritonBackend())``, forward + backward, on shapes with tails, GQA/MQA, causal Nq < Nkv, bool
   masks with empty rows, a float mask with grad, dropout (reference with the kernels' keep-mask), varlen
   with lengths 0/1, and ``deterministic=True`` twice (bitwise equal). Gradients vs the fp32 reference,
   next to torch's own same-dtype SDPA error where SDPA can run the case (the bar is 2x that).
3. Timing at B=1, H=32, N=8192 bf16, D in {320, 384, 512, 640, 768, 1024}, causal and not: every plan
   that passed phase 1, forced, median of 3 timed calls (CUDA events) of the backward alone (from saved
   out/lse; round-robin over shapes so a deadline leaves every shape measured), next to torch SDPA's
   backward (fwd+bwd minus fwd). Peak memory of forward + backward (``torch.cuda.max_memory_allocated``
   above the inputs) for the best plan and SDPA, next to the memory budget (out + lse + fp32 dQ + grads).
4. Varlen: D=512 causal, 16 sequences of random lengths summing to 65536 tokens, H=32: the packed
   backward against the same batch as dense per-sequence calls (same plan), TFLOPS over the same work.

TFLOPS: backward = 2.5 x 4 B H N^2 D (x0.5 causal). Prints a compact table (best plan + TFLOPS per shape)
and, with ``$OUT`` set, writes ``$OUT/tune_triton_bwd.json`` (every measurement) and ``$OUT/ffpa_bwd.json``
(the fastest fused and split plan per (D, causal), in the format of ``ffpa_attn/triton/tuned/ffpa_bwd.json``).
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
DEV = "cuda"
VARLEN_D, VARLEN_TOKENS, VARLEN_SEQS = 512, 65536, 16
SMOKE = False  # --smoke: the whole script on CPU under the Triton interpreter, tiny shapes (tests the script)


def _set_smoke() -> None:
    global DEV, SMOKE, H, N, N_CHECK, VARLEN_TOKENS, VARLEN_SEQS
    os.environ["TRITON_INTERPRET"] = "1"
    DEV, SMOKE, H, N, N_CHECK = "cpu", True, 2, 128, 96
    VARLEN_TOKENS, VARLEN_SEQS = 256, 4


def bwd_tflops(d: int, causal: bool, ms: float) -> float:
    return 2.5 * 4 * B * H * N * N * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def plan_to_dict(plan) -> dict:
    return {"dkdv": dataclasses.asdict(plan.dkdv), "dq": None if plan.dq is None else dataclasses.asdict(plan.dq),
            "tma": plan.tma}


def plan_from_dict(d: dict):
    from ffpa_attn.triton.bwd_config import BwdPlan, DkdvConfig, DqConfig

    return BwdPlan(DkdvConfig(**d["dkdv"]), None if d["dq"] is None else DqConfig(**d["dq"]), d["tma"])


def _key(d: int, causal: bool, plan_d: dict) -> str:
    return json.dumps([d, causal, plan_d], sort_keys=True)


# ------------------------------------------------------------------------------------------- workers


def _worker_init(smoke: bool = False):
    if smoke:
        _set_smoke()
        return
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    torch.cuda.set_device(0)


def _compile_and_check(task):
    """Phase 1: compile a plan at the timing specialization and check it on a B=1, H=32, N=384 problem."""
    d, causal, plan_d = task
    import torch

    from ffpa_attn import reference
    from ffpa_attn import TritonBackend
    from ffpa_attn.testing import reference_grads, rel_err
    from ffpa_attn.triton import bwd

    plan = plan_from_dict(plan_d)
    t0 = time.time()
    try:
        g = torch.Generator(device=DEV).manual_seed(d * 2 + causal)
        q, k, v, do = (torch.randn(B, H, N_CHECK, d, device=DEV, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        out, lse = reference.attention(q, k, v, is_causal=causal)
        out = out.to(torch.bfloat16)
        dq, dk, dv, _ = bwd.dense_backward(do, q, k, v, out, lse.float(), dlse=None, attn_mask=None,
                                           mask_grad=False, dropout_p=0.0, rng=None, causal=causal,
                                           scale=d ** -0.5, config=TritonBackend(), plan=plan)
        if not SMOKE:
            torch.cuda.synchronize()
        t_first = time.time() - t0
        refs = reference_grads(q, k, v, do, causal=causal)
        errs = [rel_err(x, r) for x, r in zip((dq, dk, dv), refs)]
        return {"d": d, "causal": causal, "plan": plan_d, "short": plan.short(), "compile_s": round(t_first, 1),
                "errs": errs, "ok": max(errs) <= 1e-2}
    except Exception as e:  # noqa: BLE001 - out of resources, compile errors: report and go on
        return {"d": d, "causal": causal, "plan": plan_d, "short": plan.short(),
                "error": f"{type(e).__name__}: {e}"[:400], "ok": False}


def _varlen_lens(total: int, nseq: int) -> list:
    """Random lengths (fixed seed) summing to ``total``, very short and long ones mixed."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.rand(nseq, generator=g) ** 2 + 0.02
    lens = (w / w.sum() * total).long().clamp(min=1)
    lens[-1] += total - int(lens.sum())
    return lens.tolist()


def _varlen_inputs(total: int, nseq: int, d: int):
    import torch

    lens = _varlen_lens(total, nseq)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v, do = (torch.randn(total, H, d, device=DEV).to(torch.bfloat16) for _ in range(4))
    return lens, cu, q, k, v, do


def _varlen_warm(_=None):
    """Phase 1 extra: compile the varlen backward (default fused plan, H=32, D=512, causal)."""
    try:
        from ffpa_attn import TritonBackend
        from ffpa_attn.triton import bwd
        from ffpa_attn.triton.bwd_config import default_plan

        lens, cu, q, k, v, do = _varlen_inputs(4 * 64, 4, VARLEN_D)
        import ffpa_attn

        out, lse = ffpa_attn.ffpa_attn_varlen_fwd(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                  backend=TritonBackend(autotune=False))
        bwd.varlen_backward(do, q, k, v, out, lse, cu, cu, max(lens), max(lens), dlse=None, dropout_p=0.0,
                            rng=None, causal=True, scale=VARLEN_D ** -0.5, config=TritonBackend(),
                            plan=default_plan(VARLEN_D, False))
        return {"varlen_warm": True, "ok": True}
    except Exception as e:  # noqa: BLE001
        return {"varlen_warm": True, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


def _time_varlen(reps: int) -> list:
    """Varlen backward (16 sequences, 65536 tokens, D=512, causal) against the same batch as
    dense per-sequence calls, same (default fused) plan; TFLOPS over the same total work."""
    import ffpa_attn
    from ffpa_attn import TritonBackend
    from ffpa_attn.triton import bwd
    from ffpa_attn.triton.bwd_config import default_plan

    d = VARLEN_D
    lens, cu, q, k, v, do = _varlen_inputs(VARLEN_TOKENS, VARLEN_SEQS, d)
    be = TritonBackend(autotune=False)
    plan = default_plan(d, False)
    out, lse = ffpa_attn.ffpa_attn_varlen_fwd(q, k, v, cu, cu, max(lens), max(lens), causal=True, backend=be)
    flops = 2.5 * 4 * H * sum(n * n for n in lens) * d * 0.5

    def packed():
        bwd.varlen_backward(do, q, k, v, out, lse, cu, cu, max(lens), max(lens), dlse=None, dropout_p=0.0, rng=None,
                            causal=True, scale=d ** -0.5, config=be, plan=plan)

    views = []
    starts = cu.tolist()
    for i, n in enumerate(lens):
        a = starts[i]
        sl = [t[a:a + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v, do, out)]
        views.append((sl, lse[:, a:a + n].unsqueeze(0)))

    def per_seq():
        for (qs, ks, vs, dos, os_), ls in views:
            bwd.dense_backward(dos, qs, ks, vs, os_, ls, dlse=None, attn_mask=None, mask_grad=False, dropout_p=0.0,
                               rng=None, causal=True, scale=d ** -0.5, config=be, plan=plan)

    rows = []
    for name, fn in (("varlen packed", packed), ("dense per-sequence", per_seq)):
        try:
            ms = _time_ms(fn, reps)
            rows.append({"impl": name, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "lens": lens,
                         "plan": plan.short()})
        except Exception as e:  # noqa: BLE001
            rows.append({"impl": name, "error": f"{type(e).__name__}: {e}"[:300]})
        r = rows[-1]
        print(f"  [{time.strftime('%H:%M:%S')}] {name}: {r.get('ms', float('nan')):.2f} ms "
              f"{r.get('tflops', 0):.0f} TFLOPS {r.get('error', '')}", flush=True)
    return rows


CHECK_CASES = ("gqa-causal", "fp16-cross-split", "mqa-bool-empty-rows", "float-mask-grad", "dropout", "varlen",
               "deterministic")


def _public_check(task):
    """Phase 2, one (D, case): public fwd+bwd vs the fp32 reference; {case, errs, base, ok}."""
    d, case = task
    import torch

    import ffpa_attn
    from ffpa_attn import reference
    from ffpa_attn import TritonBackend
    from ffpa_attn.interface import _draw_rng
    from ffpa_attn.testing import reference_grads, rel_err, sdpa_grad_errors
    from ffpa_attn.triton.dropout import dense_keep_mask

    dev = DEV
    tol = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
    sz = (lambda n: max(16, n // 8)) if SMOKE else (lambda n: n)  # noqa: E731
    row = {"d": d, "case": case}

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev).to(dtype)

    def grads(q, k, v, do, mask=None, **kw):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ms = mask.detach().clone().requires_grad_() if (mask is not None and mask.is_floating_point()) else mask
        kw.setdefault("backend", TritonBackend(autotune=False))
        out = ffpa_attn.ffpa_attn_func(qs, ks, vs, attn_mask=ms, enable_gqa=q.shape[1] != k.shape[1], **kw)
        out.backward(do)
        return qs.grad, ks.grad, vs.grad, (ms.grad if ms is not None and ms.is_floating_point() else None)

    def record(got, refs, dtype, base=None):
        errs = [rel_err(x, r) for x, r in zip(got, refs) if r is not None]
        lim = [min(tol[dtype], 2 * bb) for bb in (base or [])]
        lim += [tol[dtype]] * (len(errs) - len(lim))
        row.update(errs=errs, base=base, ok=all(e <= li for e, li in zip(errs, lim)))

    def dense(b, hq, hkv, nq, nkv, causal, dtype, mk=None, split=False):
        nq, nkv = sz(nq), sz(nkv)
        q, do = rnd(b, hq, nq, d, dtype=dtype), rnd(b, hq, nq, d, dtype=dtype)
        k, v = rnd(b, hkv, nkv, d, dtype=dtype), rnd(b, hkv, nkv, d, dtype=dtype)
        mask = None
        if mk == "bool":
            mask = torch.rand(b, 1, nq, nkv, device=dev) > 0.2
            mask[:, :, 5] = False  # a row that sees no key
        elif mk == "float":
            mask = rnd(1, hq, 1, nkv, dtype=dtype)
        got = grads(q, k, v, do, mask=mask, is_causal=causal,
                    backend=TritonBackend(split_launch=split, autotune=False))
        refs = reference_grads(q, k, v, do, mask=mask, causal=causal)
        record(got, refs, dtype, sdpa_grad_errors(q, k, v, do, refs[:3], mask=mask, causal=causal))
        row["case"] = (f"{case}: b{b} h{hq}/{hkv} {nq}x{nkv} causal={int(causal)} {str(dtype)[6:]} "
                       f"{'split' if split else 'fused'}")

    try:
        if case == "gqa-causal":
            dense(2, 8, 2, 1000, 1000, True, torch.bfloat16)
        elif case == "fp16-cross-split":
            dense(1, 4, 4, 300, 1537, True, torch.float16, split=True)
        elif case == "mqa-bool-empty-rows":
            dense(1, 4, 1, 777, 777, False, torch.bfloat16, mk="bool")
        elif case == "float-mask-grad":
            dense(2, 2, 2, 513, 640, False, torch.float16, mk="float")
        elif case == "dropout":  # the reference with the kernels' keep-mask
            b, hq, hkv, nq, nkv, p = 1, 4, 2, sz(512), sz(700), 0.2
            q, do = rnd(b, hq, nq, d), rnd(b, hq, nq, d)
            k, v = rnd(b, hkv, nkv, d), rnd(b, hkv, nkv, d)
            torch.manual_seed(5)
            got = grads(q, k, v, do, dropout_p=p, is_causal=True)
            torch.manual_seed(5)
            keep = dense_keep_mask(_draw_rng(q.device), b, hq, nq, nkv, p)
            record(got, reference_grads(q, k, v, do, causal=True, dropout_p=p, keep=keep), torch.bfloat16)
            row["case"] = f"dropout p={p} gqa causal {nq}x{nkv}"
        elif case == "varlen":  # lengths 0 and 1, causal GQA, through the packed autograd path
            lens = [0, 1, sz(129), sz(700), sz(64)]
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            t = sum(lens)
            q, do = rnd(t, 4, d), rnd(t, 4, d)
            k, v = rnd(t, 2, d), rnd(t, 2, d)
            qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = ffpa_attn.ffpa_attn_varlen_func(qs, ks, vs, cu, cu, max(lens), max(lens), causal=True,
                                                  enable_gqa=True, backend=TritonBackend(autotune=False))
            out.backward(do)
            q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
            ref, _ = reference.varlen_attention(q32, k32, v32, cu, cu, causal=True)
            ref.backward(do.float())
            record((qs.grad, ks.grad, vs.grad), (q32.grad, k32.grad, v32.grad), torch.bfloat16)
            row["case"] = f"varlen {lens} causal gqa"
        elif case == "deterministic":  # bitwise reproducible, and correct
            n6 = sz(600)
            q, do = rnd(1, 4, n6, d), rnd(1, 4, n6, d)
            k, v = rnd(1, 2, n6, d), rnd(1, 2, n6, d)
            mask = rnd(1, 1, n6, n6)
            be = TritonBackend(deterministic=True, autotune=False)
            a = grads(q, k, v, do, mask=mask, is_causal=True, backend=be)
            b_ = grads(q, k, v, do, mask=mask, is_causal=True, backend=be)
            same = all(torch.equal(x, y) for x, y in zip(a, b_))
            record(a, reference_grads(q, k, v, do, mask=mask, causal=True), torch.bfloat16)
            row.update(case="deterministic x2 (float mask grad, causal, gqa)", bitwise_equal=same,
                       ok=row["ok"] and same)
    except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {e}"[:300], ok=False)
    return row


# ---------------------------------------------------------------------------------------- phase 3 (time)


def _time_ms(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up call (the package's timer: CUDA events;
    perf_counter and a single run in the CPU smoke mode).

    Not ``triton.testing.do_bench``: its five-call estimate costs seconds for 100-500 ms calls."""
    import torch

    from ffpa_attn.bench.timing import measure

    n = 1 if SMOKE else reps
    return measure(fn, torch.device("cpu" if SMOKE else "cuda"), max_reps=n, min_reps=n, warmup=1).median_ms


def _peak_extra(fn) -> int:
    """Bytes allocated above the current level at the peak of fn()."""
    import torch

    if SMOKE:
        fn()
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _log(row: dict) -> None:
    what = row.get("short") or row["impl"]
    val = f"{row['ms']:.2f} ms {row['tflops']:.0f} TFLOPS" if "ms" in row else row.get("error", "")
    extra = f", peak {row['peak_mb']:.0f} MB" if "peak_mb" in row else ""
    print(f"  [{time.strftime('%H:%M:%S')}] D={row['d']} causal={int(row['causal'])} {what}: {val}{extra}",
          flush=True)


def _time_all(dims, causals, plans_ok, deadline, reps, sdpa):
    """Phase 3. Round 0: SDPA and every shape's first plan; then one more plan per shape per round until
    the deadline, so every shape gets numbers even when time runs out. Memory: best plan, at the end."""
    import torch
    import torch.nn.functional as F

    import ffpa_attn
    from ffpa_attn import TritonBackend
    from ffpa_attn.triton import bwd

    be = TritonBackend(autotune=False)  # the forward's tuned default (no autotuning inside the timing)
    data, rows = {}, []
    for d in dims:
        data[d] = tuple(torch.randn(B, H, N, d, device=DEV).to(torch.bfloat16) for _ in range(4))
    shapes = [(d, c) for d in dims for c in causals]
    saved = {}
    for d, c in shapes:
        q, k, v, _ = data[d]
        saved[(d, c)] = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=c, backend=be)
        if sdpa:
            q, k, v, do = data[d]
            qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def fwd_only():
                with torch.no_grad():
                    F.scaled_dot_product_attention(qs, ks, vs, is_causal=c)

            def fwd_bwd():
                qs.grad = ks.grad = vs.grad = None
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=c).backward(do)

            t_fb, t_f = _time_ms(fwd_bwd, 2), _time_ms(fwd_only, 2)
            ms = t_fb - t_f
            row = {"d": d, "causal": c, "impl": "sdpa", "ms": ms, "tflops": bwd_tflops(d, c, ms), "fwd_ms": t_f,
                   "fwd_bwd_ms": t_fb}
            qs.grad = ks.grad = vs.grad = None
            row["peak_mb"] = _peak_extra(fwd_bwd) / 2**20
            rows.append(row)
            _log(row)
            del qs, ks, vs
    n_rounds = max((len(plans_ok.get(s_, [])) for s_ in shapes), default=0)
    for rnd in range(n_rounds):
        for d, c in shapes:
            plans = plans_ok.get((d, c), [])
            if rnd >= len(plans):
                continue
            plan = plan_from_dict(plans[rnd])
            row = {"d": d, "causal": c, "impl": "triton", "plan": plans[rnd], "short": plan.short()}
            if rnd > 0 and time.time() > deadline:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            q, k, v, do = data[d]
            out, lse = saved[(d, c)]

            def run(plan=plan, q=q, k=k, v=v, do=do, out=out, lse=lse, d=d, c=c):
                bwd.dense_backward(do, q, k, v, out, lse, dlse=None, attn_mask=None, mask_grad=False, dropout_p=0.0,
                                   rng=None, causal=c, scale=d ** -0.5, config=be, plan=plan)

            try:
                ms = _time_ms(run, reps)
                row.update(ms=ms, tflops=bwd_tflops(d, c, ms))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            _log(row)
    for d, c in shapes:  # peak memory of forward + backward, best plan, public autograd path
        cands = [r for r in rows if r["d"] == d and r["causal"] == c and r["impl"] == "triton" and "ms" in r]
        if not cands:
            continue
        best = min(cands, key=lambda r: r["ms"])
        best["best"] = True
        plan = plan_from_dict(best["plan"])
        orig = bwd._plan_for
        bwd._plan_for = lambda *a, plan=plan, **kw: plan  # noqa: E731
        try:
            q, k, v, do = data[d]
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

            def fb(leaves=leaves, do=do, c=c):
                ffpa_attn.ffpa_attn_func(*leaves, is_causal=c, backend=be).backward(do)

            best["peak_mb"] = _peak_extra(fb) / 2**20
            leaves.clear()
        except Exception as e:  # noqa: BLE001
            best["peak_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            bwd._plan_for = orig
    return rows


# ------------------------------------------------------------------------------------------------ main


def _signature(d: int, causal: bool, plan) -> tuple:
    """What selects the compiled kernels of a phase-1 task (D only through its slice groups)."""
    from ffpa_attn.triton.bwd_config import slice_groups

    sig = [causal, plan.short()]
    for cfg in (plan.dkdv, plan.dq):
        if cfg is not None:
            sig += [(w, count == 1, start == 0) for start, w, count in slice_groups(d, cfg.slice_d)]
    return tuple(sig)


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


def _tuned_table(timing: list) -> dict:
    """The shipped tuned-defaults format ``{gpu: {"dtype|D|causal|split": KernelConfig dict}}``: the fastest
    fused and the fastest split (deterministic-capable) plan per (D, causal)."""
    import torch

    from ffpa_attn.common.device import gpu_name
    from ffpa_attn.triton import autotune
    from ffpa_attn.triton.bwd_config import plan_to_config

    table = {}
    for r in timing:
        if r["impl"] != "triton" or "ms" not in r:
            continue
        plan = plan_from_dict(r["plan"])
        key = autotune.key_str(("bfloat16", r["d"], int(r["causal"]), int(plan.split)))
        if key not in table or r["ms"] < table[key][0]:
            table[key] = (r["ms"], plan_to_config(plan).to_dict())
    gpu = "interpreter" if SMOKE else gpu_name(torch.device("cuda", 0))
    return {gpu: {k: v for k, (_, v) in sorted(table.items())}}


def _budget_mb(d: int) -> float:
    """Memory budget for fwd+bwd peak above the inputs: out + lse + fp32 dQ + dq, dk, dv (bf16)."""
    elems = B * H * N * d
    return (elems * (2 + 4 + 3 * 2) + B * H * N * 4) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="*", default=list(DIMS))
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--quick", action="store_true", help="three plans per shape")
    ap.add_argument("--budget", type=float, default=210.0,
                    help="seconds from the start; plans after the first per shape are skipped past it")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per measurement (median)")
    ap.add_argument("--workers", type=int, default=0, help="compile pool size (0 = cpu count - 2, max 14)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-varlen", action="store_true", help="skip the varlen vs per-sequence timing")
    ap.add_argument("--no-checks", action="store_true", help="skip phase 2")
    ap.add_argument("--check-d", type=int, nargs="*", default=[320, 512, 1024],
                    help="head dims of the phase-2 public-path checks (remainder slice, DS=128, DS=256 plans)")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes (script test)")
    args = ap.parse_args(argv)
    if args.smoke:
        _set_smoke()
    t_start = time.time()
    deadline = t_start + args.budget
    causals = [bool(c) for c in args.causal]
    work = _work_list(args.d, causals, args.quick)
    tasks = [(d, c, p) for (d, c), plans in work.items() for p in plans]
    if args.dry_run:
        for d, c, p in tasks:
            print(d, int(c), plan_from_dict(p).short())
        print(f"{len(tasks)} (D, causal, plan) compile+check tasks; phase 2 on D={args.check_d}")
        return 0

    import torch
    import triton

    gpu = "cpu-interpreter" if SMOKE else torch.cuda.get_device_name(0)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {gpu}; {len(tasks)} plan tasks", flush=True)
    nw = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    ctx = mp.get_context("spawn")
    results = {"env": {"torch": torch.__version__, "triton": triton.__version__, "gpu": gpu, "B": B, "H": H,
                       "N": N}}
    check_d = [d for d in args.check_d if d in args.d] or args.d[:1]
    seen, first, rest = set(), [], []
    for t in tasks:
        sig = _signature(t[0], t[1], plan_from_dict(t[2]))
        (rest if sig in seen else first).append(t)
        seen.add(sig)
    with ctx.Pool(nw, initializer=_worker_init, initargs=(SMOKE,)) as pool:
        # queue order: distinct kernels (fill the disk cache), the public-path checks, then the plans whose
        # kernels were compiled for another D (cache hits)
        first_async = pool.map_async(_compile_and_check, first, chunksize=1)
        checks_async = None if args.no_checks else pool.map_async(
            _public_check, [(d, c) for c in CHECK_CASES for d in check_d], chunksize=1)
        rest_async = pool.map_async(_compile_and_check, rest, chunksize=1)
        varlen_async = pool.apply_async(_varlen_warm) if VARLEN_D in args.d and not args.no_varlen else None
        compiled = first_async.get() + rest_async.get()
        varlen_ok = varlen_async is not None and varlen_async.get()["ok"]
        if varlen_async is not None and not varlen_ok:
            print(f"  varlen warm-up FAILED: {varlen_async.get().get('error')}", flush=True)
        print(f"[{time.time() - t_start:.0f}s] phase 1: {sum(r['ok'] for r in compiled)}/{len(compiled)} plans "
              f"compiled and correct ({len(first)} distinct compiles)", flush=True)
        for r in compiled:
            if not r["ok"]:
                print(f"  FAILED D={r['d']} causal={int(r['causal'])} {r['short']}: "
                      f"{r.get('error') or r.get('errs')}", flush=True)
        checks = [] if checks_async is None else checks_async.get()
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
    results["varlen"] = _time_varlen(args.reps) if varlen_ok else []
    # ------------------------------------------------------------------------------------------- table
    print(f"\n[{time.time() - t_start:.0f}s] backward, bf16 B={B} H={H} N={N} (TFLOPS = 2.5 x 4BHN^2D, x0.5 causal)")
    print(f"{'D':>5} {'causal':>6} | {'best plan':<64} {'ms':>8} {'TFLOPS':>7} | {'sdpa':>6} {'x':>5} | "
          f"{'peak MB':>8} {'sdpa MB':>8} {'budget':>7}")
    for d in args.d:
        for c in causals:
            best = [r for r in timing if r["d"] == d and r["causal"] == c and r.get("best")]
            sd = [r for r in timing if r["d"] == d and r["causal"] == c and r["impl"] == "sdpa"]
            b_ = best[0] if best else None
            s_ = sd[0] if sd else None
            print(f"{d:>5} {int(c):>6} | {(b_['short'] if b_ else '-'):<64} "
                  f"{(b_['ms'] if b_ else float('nan')):>8.2f} {(b_['tflops'] if b_ else 0):>7.0f} | "
                  f"{(s_['tflops'] if s_ else 0):>6.0f} "
                  f"{(b_['tflops'] / s_['tflops'] if b_ and s_ else 0):>5.2f} | "
                  f"{(b_.get('peak_mb', 0) if b_ else 0):>8.0f} {(s_['peak_mb'] if s_ else 0):>8.0f} "
                  f"{_budget_mb(d):>7.0f}")
    for r in results["varlen"]:
        print(f"varlen D={VARLEN_D} causal, {VARLEN_SEQS} seqs / {VARLEN_TOKENS} tokens, {r['impl']:<20}: "
              f"{r.get('ms', float('nan')):8.2f} ms {r.get('tflops', 0):6.0f} TFLOPS {r.get('error', '')}")
    print("\nall plans (TFLOPS):")
    for r in timing:
        if r["impl"] == "triton":
            print(f"  D={r['d']:<5} causal={int(r['causal'])} {r['short']:<70} "
                  f"{r.get('tflops', 0):>6.0f} {r.get('skipped', '') or r.get('error', '')}")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "tune_triton_bwd.json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(Path(out_dir) / "ffpa_bwd.json", "w") as f:
            json.dump(_tuned_table(timing), f, indent=1, sort_keys=True)
        print(f"wrote {out_dir}/tune_triton_bwd.json and {out_dir}/ffpa_bwd.json (copy the latter to "
              f"ffpa_attn/triton/tuned/ffpa_bwd.json to ship the best plans)")
    print(f"total {time.time() - t_start:.0f}s")
    ok = all(r["ok"] for r in compiled) and all(r["ok"] for r in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

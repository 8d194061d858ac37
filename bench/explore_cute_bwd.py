"""Explore the CuTeDSL sm90a backward kernel on an H200 in one run (~2-2.5 min): correctness, then timing.

    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    python bench/explore_cute_bwd.py                 # the dQ modes checked and timed, Triton, SDPA
    python bench/explore_cute_bwd.py --quick         # fewer shapes, D=512 timing only
    python bench/explore_cute_bwd.py --cluster       # also the experimental cluster variant (off by default)
    compute-sanitizer --tool memcheck python bench/explore_cute_bwd.py --sanitize   # one tiny call

Phases (each result is printed at once and appended to ``$OUT/explore_cute_bwd.json``, so a crash or a
hang still leaves what was measured):

1. correctness, for each dQ mode (``dq_mode`` "atomic": per-thread ``red.global.add.v4.f32``; "tma":
   shared-memory staging + TMA bulk reduce-add; the default mode first, all shapes, then the other one):
   :func:`ffpa_attn.cute.api.run_backward` on growing shapes (one key block, several query
   blocks, tails, causal offsets, GQA/MQA, Nq > Nkv with rows that see no key, D in {264..512}) against
   autograd through the fp32 reference (``ffpa_attn.reference``), inputs ``out``/``lse`` from the
   reference. Prints the relative error of dq, dk and dv separately; on a mismatch also the errors per
   64-key block (dk/dv) / 64-row block (dq) and per 64-column chunk (= per head-dim part and chunk of
   the kernel), and the five largest differences with their indices, so the broken stage can be told.
2. timing at B=1, H=32, N=8192 bf16, in priority order (the run may be cut at any point): the CuTeDSL
   backward at D=512 causal and not (including its torch pre/post-processing: delta, zeroing and
   converting the fp32 dQ buffer) with dq_mode "atomic", "tma" (``dq_box`` 16 and 32 at D=512) and
   compiled without its dQ reductions
   (``_profile_skip_dq``: the bound that a free dQ reduction would give); the same two modes at D=384;
   with ``--cluster`` the EXPERIMENTAL 2-CTA cluster variant (``_experimental_cluster``: correctness on
   a few shapes, then, if all pass, D=512 timing); the Triton
   backward at D=512 (``ffpa_attn.triton.dense_backward``, shipped tuned plan, no autotuning; head 0 of
   its dq/dk/dv compared with the CuTeDSL result) and torch SDPA's backward (autograd, ``fwd+bwd - fwd``).
   TFLOPS = 2.5 x 4 B H Nq Nkv D (x0.5 causal), median of CUDA-event timed runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
RESULTS: dict = {"correctness": [], "timing": []}
BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: 1e-2, FP16: 3e-3}


def save() -> None:
    if OUT is not None:
        (OUT / "explore_cute_bwd.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def log(msg: str) -> None:
    print(msg, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def reference(q, k, v, do, causal, scale):
    from ffpa_attn.reference import attention

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = attention(q32, k32, v32, is_causal=causal, scale=scale)
    (out * do.float()).sum().backward()
    return out.detach().to(q.dtype), lse.detach(), q32.grad, k32.grad, v32.grad


def diagnose(name: str, g: torch.Tensor, r: torch.Tensor, row_axis_name: str) -> dict:
    """Errors per 64-row block and per 64-column chunk, and the largest differences (for a mismatch)."""
    g, r = g.double(), r.double()
    diff = (g - r).nan_to_num(nan=float("inf"))
    n, d = g.shape[2], g.shape[3]
    per_rows = []
    for r0 in range(0, n, 64):
        den = r[:, :, r0:r0 + 64].norm().item()
        per_rows.append(round(diff[:, :, r0:r0 + 64].norm().item() / max(den, 1e-30), 4))
    per_cols = []
    for c0 in range(0, d, 64):
        den = r[..., c0:c0 + 64].norm().item()
        per_cols.append(round(diff[..., c0:c0 + 64].norm().item() / max(den, 1e-30), 4))
    top = []
    flat = diff.abs().flatten()
    for i in flat.topk(min(5, flat.numel())).indices.tolist():
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), diff.shape))
        top.append((idx, round(g[idx].item(), 5), round(r[idx].item(), 5)))
    nan = int((~torch.isfinite(g)).sum().item())
    log(f"    {name}: non-finite {nan}; rel err per 64-{row_axis_name} block {per_rows[:16]}"
        f"{' ...' if len(per_rows) > 16 else ''}")
    log(f"    {name}: rel err per 64-column chunk {per_cols}")
    log(f"    {name}: largest |diff| (b, h, row, col) got/ref: {top}")
    return {"non_finite": nan, "per_rows": per_rows, "per_cols": per_cols, "top": [str(t) for t in top]}


CHECK_SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype -- smallest first
    (1, 1, 1, 64, 64, 512, False, BF16),
    (1, 1, 1, 64, 64, 512, True, BF16),
    (1, 1, 1, 128, 64, 512, False, BF16),
    (1, 1, 1, 64, 128, 512, False, BF16),
    (1, 1, 1, 128, 128, 512, True, FP16),
    (1, 2, 2, 100, 100, 512, False, BF16),
    (1, 4, 2, 130, 300, 512, True, BF16),
    (1, 8, 1, 257, 200, 512, False, BF16),
    (1, 2, 2, 300, 200, 512, True, BF16),
    (1, 2, 2, 500, 700, 320, True, BF16),
    (1, 4, 2, 130, 300, 384, False, FP16),
    (1, 2, 1, 300, 300, 448, True, BF16),
    (1, 2, 2, 190, 260, 264, True, FP16),
    (2, 4, 2, 1024, 1024, 512, True, BF16),
    (1, 2, 2, 2048, 2048, 512, False, BF16),
]


CLUSTER_SHAPES = [  # the experimental 2-CTA cluster variant (D with an even number of 64-column chunks)
    (1, 1, 1, 64, 64, 512, False, BF16),
    (1, 1, 1, 128, 128, 512, True, BF16),
    (1, 4, 2, 130, 300, 512, True, BF16),
    (1, 2, 2, 300, 200, 512, True, FP16),
    (1, 4, 2, 333, 333, 384, False, BF16),
    (2, 4, 2, 1024, 1024, 512, True, BF16),
]


def _mode(dq_mode: str | None) -> str:
    """The dQ mode a run_backward(dq_mode=...) call uses."""
    from ffpa_attn.cute.config import DEFAULT_BWD_DQ_MODE

    return dq_mode or DEFAULT_BWD_DQ_MODE


def check_phase(quick: bool, cluster: bool = False, dq_mode: str | None = None, chain: bool = True) -> int:
    from ffpa_attn.cute.api import run_backward as _run
    from ffpa_attn.testing import make_qkv

    def run_backward(*a, **kw):
        if cluster:
            return _run(*a, _experimental_cluster=True, **kw)
        return _run(*a, dq_mode=dq_mode, **kw)

    shapes = CLUSTER_SHAPES if cluster else (CHECK_SHAPES[:9] if quick else CHECK_SHAPES)
    fails = 0
    for shape in shapes:
        b, hq, hkv, nq, nkv, d, causal, dtype = shape
        tag = (f"{'cluster ' if cluster else ''}{'' if cluster else f'dq={_mode(dq_mode)} '}B{b} Hq{hq} Hkv{hkv} "
               f"Nq{nq} Nkv{nkv} D{d} {'causal' if causal else 'full'} {str(dtype)[6:]}")
        rec: dict = {"shape": tag}
        try:
            torch.manual_seed(0)
            q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
            do = torch.randn_like(q)
            scale = 1.0 / math.sqrt(d)
            out, lse, rdq, rdk, rdv = reference(q, k, v, do, causal, scale)
            t0 = time.perf_counter()
            dq, dk, dv = run_backward(do, q, k, v, out, lse, causal, scale)
            torch.cuda.synchronize()
            rec["first_call_s"] = round(time.perf_counter() - t0, 2)
            errs = {"dq": rel(dq, rdq), "dk": rel(dk, rdk), "dv": rel(dv, rdv)}
            rec.update({n: float(f"{e:.3e}") for n, e in errs.items()})
            ok = all(e <= TOL[dtype] for e in errs.values())
            if causal and nq > nkv:
                ok = ok and bool((dq[:, :, : nq - nkv] == 0).all())
            rec["ok"] = ok
            log(f"[{'PASS' if ok else 'FAIL'}] {tag}: dq {errs['dq']:.2e} dk {errs['dk']:.2e} dv {errs['dv']:.2e}"
                f" (first call {rec['first_call_s']} s)")
            if not ok:
                fails += 1
                rec["diag"] = {"dq": diagnose("dq", dq, rdq, "row"), "dk": diagnose("dk", dk, rdk, "key"),
                               "dv": diagnose("dv", dv, rdv, "key")}
        except Exception as err:  # noqa: BLE001
            fails += 1
            rec["error"] = f"{type(err).__name__}: {err}"
            log(f"[ERROR] {tag}: {rec['error']}")
            traceback.print_exc()
        RESULTS["correctness"].append(rec)
        save()
    if cluster or not chain:
        return fails
    # the real chain: out / lse from the CuTeDSL forward (not the reference) into the backward
    try:
        from ffpa_attn.cute.api import run_forward

        torch.manual_seed(1)
        q, k, v = make_qkv(1, 8, 2, 700, 900, 512, BF16, device="cuda")
        do = torch.randn_like(q)
        _, _, rdq, rdk, rdv = reference(q, k, v, do, True, 0.05)
        out, lse = run_forward(q, k, v, True, 0.05)
        dq, dk, dv = run_backward(do, q, k, v, out, lse, True, 0.05)
        torch.cuda.synchronize()
        errs = {"dq": rel(dq, rdq), "dk": rel(dk, rdk), "dv": rel(dv, rdv)}
        ok = all(e <= TOL[BF16] for e in errs.values())
        fails += 0 if ok else 1
        log(f"[{'PASS' if ok else 'FAIL'}] chain dq={_mode(dq_mode)} cute fwd -> cute bwd B1 Hq8 Hkv2 Nq700 Nkv900 "
            "D512 causal bfloat16: "
            + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
        RESULTS["correctness"].append({"shape": f"chain dq={_mode(dq_mode)} fwd->bwd D512 causal GQA", "ok": ok,
                                       **errs})
    except Exception as err:  # noqa: BLE001
        fails += 1
        log(f"[ERROR] chain: {type(err).__name__}: {err}")
    save()
    return fails


def cuda_time(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` CUDA-event timed calls after one warm-up (the package's timer)."""
    from ffpa_attn.bench.timing import measure

    return measure(fn, torch.device("cuda"), max_reps=reps, min_reps=reps, warmup=1).median_ms


def _inputs(d: int, causal: bool):
    from ffpa_attn.cute.api import run_forward

    b, h, n = TIME_SHAPE
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=BF16) for _ in range(3))
    do = torch.randn_like(q)
    scale = d ** -0.5
    out, lse = run_forward(q, k, v, causal, scale)
    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    return q, k, v, do, out, lse, scale, flops


TIME_SHAPE = (1, 32, 8192)  # B, H, N (Nq = Nkv)


VARIANTS = {  # timed CuTeDSL variants: impl label -> run_backward keyword arguments
    "cutedsl-dq-atomic": {"dq_mode": "atomic"},
    "cutedsl-dq-tma": {"dq_mode": "tma"},  # 64 x 16 fp32 boxes (BwdConfig.dq_box default)
    "cutedsl-dq-tma32": {"dq_mode": "tma", "dq_box": 32},  # 64 x 32 fp32 boxes
    "cutedsl-no-dq-reduce": {"dq_mode": "atomic", "_profile_skip_dq": True},  # dq invalid: the bound
    "cutedsl-dq-separate": {"dq_mode": "separate"},  # dK/dV kernel + query-stationary dQ kernel
    "cutedsl-separate-dkdv-only": {"dq_mode": "separate", "_profile_skip_dq": True},  # dq invalid: kernel 1 alone
    "cutedsl-cluster": {"_experimental_cluster": True},
}


def time_cute(cases, deadline: float, variants) -> None:
    """The CuTeDSL backward on ``cases`` [(D, causal)] at TIME_SHAPE, each of ``variants`` (VARIANTS keys)
    timed back to back on the same inputs; head 0 of dq/dk/dv of every variant but the no-reduction one
    is compared with the first variant's (``*_vs_<first>``: the two dQ modes must agree)."""
    from ffpa_attn.cute.api import run_backward
    from ffpa_attn.cute.config import DEFAULT_BWD_DQ_MODE

    b, h, n = TIME_SHAPE
    for d, causal in cases:
        q, k, v, do, out, lse, scale, flops = _inputs(d, causal)
        first = None
        for impl in variants:
            if time.time() > deadline:
                log("timing: deadline reached")
                return
            kw = VARIANTS[impl]
            rec: dict = {"impl": impl, "D": d, "causal": causal, "B": b, "H": h, "N": n,
                         "default": kw.get("dq_mode") == DEFAULT_BWD_DQ_MODE and len(kw) == 1}
            try:
                g = [t[:, :1].clone() for t in run_backward(do, q, k, v, out, lse, causal, scale, **kw)]
                if first is None:
                    first = (impl, g)
                elif "_profile_skip_dq" not in kw:
                    for i, name in enumerate(("dq", "dk", "dv")):
                        rec[f"{name}_vs_{first[0]}"] = float(f"{rel(g[i], first[1][i]):.3e}")
                del g
                ms = cuda_time(lambda: run_backward(do, q, k, v, out, lse, causal, scale, **kw), 5)
                rec["ms"], rec["tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
            except Exception as err:  # noqa: BLE001
                rec["error"] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            RESULTS["timing"].append(rec)
            save()
            log("timing " + " ".join(f"{k_}={v_}" for k_, v_ in rec.items()))


def timing_phase(deadline: float) -> None:
    """The Triton and SDPA backward at D=512 next to the CuTeDSL one (head 0 of dq/dk/dv compared with
    the CuTeDSL default; compiling Triton may take a while)."""
    import ffpa_attn.triton as ftriton
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.cute.api import run_backward

    for causal in (True, False):
        d = 512
        if time.time() > deadline:
            log("timing: deadline reached")
            return
        q, k, v, do, out, lse, scale, flops = _inputs(d, causal)
        head0 = {}
        try:
            head0[(d, causal)] = [t[:, :1].clone() for t in run_backward(do, q, k, v, out, lse, causal, scale)]
        except Exception as err:  # noqa: BLE001
            log(f"cute head 0: {type(err).__name__}: {err}")
        rec = {"impl": "triton", "D": d, "causal": causal}
        try:
            cfg = TritonBackend(autotune=False)

            def tri():
                return ftriton.dense_backward(do, q, k, v, out, lse, dlse=None, attn_mask=None, mask_grad=False,
                                              dropout_p=0.0, rng=None, causal=causal, scale=scale, config=cfg)

            g = tri()[:3]
            ms = cuda_time(tri, 3)
            rec["ms"], rec["tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
            if (d, causal) in head0:  # the two kernels agree (head 0)
                for i, name in enumerate(("dq", "dk", "dv")):
                    rec[f"cute_{name}_vs_triton"] = float(f"{rel(head0[(d, causal)][i], g[i][:, :1]):.3e}")
            del g
        except Exception as err:  # noqa: BLE001
            rec["error"] = f"{type(err).__name__}: {err}"
        RESULTS["timing"].append(rec)
        save()
        log("timing " + " ".join(f"{k_}={v_}" for k_, v_ in rec.items()))
        if time.time() < deadline:
            rec = {"impl": "sdpa", "D": d, "causal": causal}
            try:
                qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

                def fwd():
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)

                def fwd_bwd():
                    torch.autograd.grad(fwd(), (qs, ks, vs), do)

                ms = cuda_time(fwd_bwd, 3) - cuda_time(fwd, 3)
                rec["ms"], rec["tflops"] = round(ms, 3), round(flops / ms / 1e9, 1)
            except Exception as err:  # noqa: BLE001
                rec["error"] = f"{type(err).__name__}: {err}"
            RESULTS["timing"].append(rec)
            save()
            log("timing " + " ".join(f"{k_}={v_}" for k_, v_ in rec.items()))


def main() -> None:  # noqa: C901
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true", help="one tiny causal GQA call (for compute-sanitizer)")
    ap.add_argument("--budget", type=float, default=130.0, help="seconds before timing stops starting shapes")
    ap.add_argument("--cluster", action="store_true", help="also the experimental 2-CTA cluster variant")
    ap.add_argument("--no-cluster", action="store_true", help="(default; kept for old command lines)")
    ap.add_argument("--dq-modes", default="atomic,tma,separate", help="dQ modes to check and time (comma list)")
    ap.add_argument("--dq-mode", default=None, help="--sanitize: the dQ mode of the call (default: the config's)")
    ap.add_argument("--sanitize-d", type=int, default=320, help="--sanitize: the head dim of the call")
    args = ap.parse_args()
    start = time.time()
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.sanitize:
        from ffpa_attn.cute.api import run_backward
        from ffpa_attn.testing import make_qkv

        q, k, v = make_qkv(1, 2, 1, 70, 130, args.sanitize_d, BF16, device="cuda")
        do = torch.randn_like(q)
        out, lse, rdq, rdk, rdv = reference(q, k, v, do, True, 0.06)
        dq, dk, dv = run_backward(do, q, k, v, out, lse, True, 0.06, dq_mode=args.dq_mode)
        torch.cuda.synchronize()
        log(f"sanitize call done (D={args.sanitize_d}, dq={_mode(args.dq_mode)}): dq {rel(dq, rdq):.2e} "
            f"dk {rel(dk, rdk):.2e} dv {rel(dv, rdv):.2e}")
        return
    from ffpa_attn.cute.config import BWD_DQ_MODES, DEFAULT_BWD_DQ_MODE

    wanted = [m for m in args.dq_modes.split(",") if m in BWD_DQ_MODES]
    modes = [m for m in [DEFAULT_BWD_DQ_MODE] + [m for m in BWD_DQ_MODES if m != DEFAULT_BWD_DQ_MODE] if m in wanted]
    RESULTS["default_dq_mode"] = DEFAULT_BWD_DQ_MODE
    for i, mode in enumerate(modes):
        fails = check_phase(args.quick, dq_mode=mode, chain=True)
        log(f"correctness (dq={mode}): {fails} failing shape(s) ({time.time() - start:.0f} s)")
        RESULTS[f"check_fails_{mode}"] = fails
        if i == 0:
            RESULTS["check_fails"] = fails
        save()
    deadline = start + args.budget
    # priority order (the run may end at any point): both dQ modes and the no-reduction bound at D=512,
    # the two modes at D=384, [the experimental cluster variant], Triton and SDPA
    timed = [f"cutedsl-dq-{m}" for m in BWD_DQ_MODES if m in wanted]
    tma32 = ["cutedsl-dq-tma32"] if "tma" in wanted else []
    sep = ["cutedsl-separate-dkdv-only"] if "separate" in wanted else []
    time_cute([(512, False), (512, True)], deadline, timed + tma32 + ["cutedsl-no-dq-reduce"] + sep)
    if not args.quick:
        time_cute([(384, False), (384, True)], deadline, timed)
    if args.cluster:
        cfails = check_phase(args.quick, cluster=True)
        log(f"correctness (cluster): {cfails} failing shape(s) ({time.time() - start:.0f} s)")
        RESULTS["check_fails_cluster"] = cfails
        save()
        if cfails == 0:
            time_cute([(512, False), (512, True)], deadline, ["cutedsl-cluster"])
    timing_phase(deadline)
    log(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()

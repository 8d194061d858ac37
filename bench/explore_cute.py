"""Explore the CuTeDSL sm90a forward kernel on an H200 in one run (~2-4 min): compile, correctness, timing.

    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    python bench/explore_cute.py                # everything
    python bench/explore_cute.py --quick        # D=512 and 1024 only, fewer shapes
    compute-sanitizer --tool memcheck python bench/explore_cute.py --sanitize   # one tiny call per kernel

Phases (each result is appended to ``$OUT/explore_cute.json`` as soon as it exists, so a crash or a hang
still leaves what was measured; a watchdog ends the process if one phase stalls):

1. compile every kernel variant in a process pool (fills the on-disk cache; per-variant compile seconds
   are the "first call" cost), then time loading each from disk in this process (the "second process").
2. ladder: D=512 (one CTA) and D=1024 (2-CTA cluster) bf16 on growing (Nq, Nkv) -- one KV tile, two,
   many, tails -- full and causal, with errors per head-dim part (= per consumer warpgroup), per 64-row
   block and of lse, so a wrong result points at the broken stage.
3. correctness over D x causal x GQA x Nq != Nkv x tails x dtype vs the fp32 reference
   (``ffpa_attn.reference``), next to torch's own same-dtype SDPA error.
4. timing at B=1, H=32, N=8192 bf16 for D in {320, 384, 448, 512, 576, 768, 1024} (+ GQA 32/8 at D=512,
   + alternative keys-per-tile ``tile_n`` non-causal, to pick the defaults): TFLOPS (4 B H Nq Nkv D, x0.5 causal) of the
   kernel and of torch SDPA (memory-efficient), CUDA-event medians; heads 0 and 31 checked vs fp32.

Calls :func:`ffpa_attn.cute.api.run_forward` directly (bypassing ``SUPPORTED_HEAD_DIMS``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: dict = {"phases": {}}
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def save() -> None:
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "explore_cute.json").write_text(json.dumps(RESULTS, indent=1, default=str))


class Watchdog:
    """os._exit(3) if a phase runs past its deadline (a hung kernel cannot be interrupted otherwise)."""

    def __init__(self) -> None:
        self.timer: threading.Timer | None = None

    def arm(self, phase: str, seconds: float) -> None:
        self.disarm()

        def fire() -> None:
            print(f"\n!!! WATCHDOG: phase {phase!r} exceeded {seconds:.0f} s (hang?) -- exiting", flush=True)
            RESULTS.setdefault("watchdog", []).append(phase)
            save()
            os._exit(3)

        self.timer = threading.Timer(seconds, fire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


WATCHDOG = Watchdog()


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------- phase 1


# alternative keys-per-tile timed next to the default (non-causal bf16), to choose the defaults
TILE_ALTERNATIVES = {320: (96, 128), 384: (80, 96), 448: (80,), 512: (48, 80), 576: (96,), 768: (96,),
                     1024: (48, 80)}


def _compile_one(key):
    """In a pool worker: compile (d, dtype, causal, tile_n) into the disk cache; returns seconds."""
    d, dtype, causal, tile_n = key
    t0 = time.perf_counter()
    try:
        from ffpa_attn.cute.api import get_fwd_kernel
        from ffpa_attn.cute.config import FwdConfig

        t_imp = time.perf_counter() - t0
        t1 = time.perf_counter()
        get_fwd_kernel(FwdConfig(d, dtype, causal, tile_n=tile_n))
        return key, t_imp, time.perf_counter() - t1, None
    except Exception:  # noqa: BLE001
        return key, 0.0, time.perf_counter() - t0, traceback.format_exc()[-2000:]


def phase_compile(variants, workers: int) -> dict:
    import multiprocessing as mp

    from ffpa_attn.cute import _cache
    from ffpa_attn.cute.api import get_fwd_kernel
    from ffpa_attn.cute.config import FwdConfig

    res = {"variants": {}}
    t0 = time.perf_counter()
    try:
        ctx = mp.get_context("spawn")
        with ctx.Pool(min(workers, len(variants))) as pool:
            for key, t_imp, t_comp, err in pool.imap_unordered(_compile_one, variants):
                res["variants"][str(key)] = {"import_s": round(t_imp, 2), "compile_s": round(t_comp, 2),
                                             "error": err}
                log(f"  compiled {key}: {t_comp:.2f} s" + (f"  ERROR\n{err}" if err else ""))
    except Exception:  # noqa: BLE001
        res["pool_error"] = traceback.format_exc()[-2000:]
        log("  process pool failed; compiling in this process\n" + res["pool_error"])
    res["pool_wall_s"] = round(time.perf_counter() - t0, 2)
    # second-process cost: load from disk
    _cache.clear_memory_cache()
    for key in variants:
        t1 = time.perf_counter()
        try:
            d, dtype, causal, tile_n = key
            get_fwd_kernel(FwdConfig(d, dtype, causal, tile_n=tile_n))
            res["variants"].setdefault(str(key), {})["load_s"] = round(time.perf_counter() - t1, 3)
        except Exception:  # noqa: BLE001
            res["variants"].setdefault(str(key), {})["load_error"] = traceback.format_exc()[-2000:]
    return res


# ------------------------------------------------------------------------------------------- helpers


def diagnose(q, k, v, causal, scale, tile_n=None):
    """Run the kernel and compare with the fp32 reference; returns a dict of errors and diagnostics."""
    import torch
    import torch.nn.functional as F

    from ffpa_attn.contract import causal_mask
    from ffpa_attn.cute.api import run_forward
    from ffpa_attn.cute.config import FwdConfig
    from ffpa_attn.reference import _expand_kv, attention
    from ffpa_attn.testing import TOL, rel_err

    d = q.shape[-1]
    cfg = FwdConfig(d, "bfloat16", causal)
    dw, parts = cfg.d_wg, 2 * cfg.cluster
    out, lse = run_forward(q, k, v, causal, scale, tile_n)
    torch.cuda.synchronize()
    ref, ref_lse = attention(q, k, v, is_causal=causal, scale=scale)
    mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    hq = q.shape[1]
    base = F.scaled_dot_product_attention(q, _expand_kv(k, hq), _expand_kv(v, hq), attn_mask=mask, scale=scale)
    err = rel_err(out, ref)
    base_err = rel_err(base, ref)
    lse_err = (lse - ref_lse).abs().max().item() if lse.numel() else 0.0
    res = {"err": err, "sdpa_err": base_err, "lse_maxabs": lse_err,
           "nan_out": int((~torch.isfinite(out.float())).sum()), "nan_lse": int((~torch.isfinite(lse)).sum()),
           # per head-dim part (consumer warpgroup c of cluster rank r owns part 2 r + c)
           "err_parts": [rel_err(out[..., p * dw:(p + 1) * dw], ref[..., p * dw:(p + 1) * dw]) for p in range(parts)]}
    nq = q.shape[2]
    blocks = []
    for r0 in range(0, nq, 64):
        blocks.append(rel_err(out[:, :, r0:r0 + 64], ref[:, :, r0:r0 + 64]))
    res["worst_block"] = int(max(range(len(blocks)), key=lambda i: blocks[i])) if blocks else -1
    res["block_errs"] = [round(x, 5) for x in blocks[:8]] + (["..."] if len(blocks) > 8 else [])
    tol = TOL[q.dtype]
    res["pass"] = bool(err <= max(tol, 2 * base_err) and res["nan_lse"] == 0
                       and lse_err < 2e-3 * max(1.0, ref_lse.abs().max().item()))
    return res


def fmt(tag, r):
    return (f"  {'PASS' if r.get('pass') else 'FAIL'} {tag:<44} err {r['err']:.2e} (sdpa {r['sdpa_err']:.2e}) "
            f"parts {'/'.join(f'{e:.0e}' for e in r['err_parts'])} lse {r['lse_maxabs']:.1e} "
            f"nan {r['nan_out']}/{r['nan_lse']} worst blk {r['worst_block']}")


def run_case(tag, b, hq, hkv, nq, nkv, d, causal, dtype, scale=None, layout="bhnd", tile_n=None):
    import torch

    from ffpa_attn.testing import make_qkv

    torch.manual_seed(hash(tag) % 2**31)
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda", layout=layout)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    try:
        r = diagnose(q, k, v, causal, scale, tile_n)
    except Exception:  # noqa: BLE001
        r = {"pass": False, "exception": traceback.format_exc()[-3000:]}
        log(f"  EXC  {tag}\n{r['exception']}")
        return r
    log(fmt(tag, r))
    return r


# ------------------------------------------------------------------------------------------- phases 2-4


def phase_ladder(quick: bool) -> dict:
    import torch

    res = {}
    ladder = [(64, 64), (64, 128), (128, 320), (64, 1024), (200, 1000), (1000, 1000)]
    if quick:
        ladder = ladder[:4]
    for d, shapes in ((512, ladder), (1024, ladder[:3] + ladder[4:5])):  # one CTA, then a 2-CTA cluster
        for causal in (False, True):
            for nq, nkv in shapes:
                tag = f"ladder D{d} bf16 {'causal' if causal else 'full'} {nq}x{nkv}"
                res[tag] = run_case(tag, 1, 2, 2, nq, nkv, d, causal, torch.bfloat16)
                save()
    return res


def phase_matrix(dims, quick: bool) -> dict:
    import torch

    bf, fp = torch.bfloat16, torch.float16
    cases = []
    for d in dims:
        for causal in (False, True):
            cases.append((f"D{d} {'c' if causal else 'f'} bf16 mha 256x256", 2, 4, 4, 256, 256, d, causal, bf))
            cases.append((f"D{d} {'c' if causal else 'f'} bf16 gqa4 tails 130x517", 1, 8, 2, 130, 517, d, causal,
                          bf))
            if not quick:
                cases.append((f"D{d} {'c' if causal else 'f'} fp16 mqa 77x300", 2, 4, 1, 77, 300, d, causal, fp))
    extra = [("D512 c bf16 bnhd neg-scale 150x260", 2, 4, 2, 150, 260, 512, True, bf, -0.07, "bnhd"),
             ("D512 f bf16 scale0.2 1x513", 1, 3, 3, 1, 513, 512, False, bf, 0.2, "bhnd"),
             ("D512 c bf16 mha 4096x4096", 1, 2, 2, 4096, 4096, 512, True, bf, None, "bhnd")]
    res = {}
    for case in cases:
        res[case[0]] = run_case(*case)
        save()
    for d in dims:
        for tn in TILE_ALTERNATIVES.get(d, ()):
            tag = f"D{d} f bf16 gqa2 tile_n={tn} 200x1000"
            res[tag] = run_case(tag, 1, 4, 2, 200, 1000, d, False, bf, tile_n=tn)
            save()
    for tag, *args, scale, layout in extra:
        res[tag] = run_case(tag, *args, scale=scale, layout=layout)
        save()
    return res


def _time_ms(fn, warmup=2, reps=8) -> float:
    """Median milliseconds of ``reps`` CUDA-event timed calls after ``warmup`` calls (the package's timer)."""
    import torch

    from ffpa_attn.bench.timing import measure

    return measure(fn, torch.device("cuda"), max_reps=reps, min_reps=reps, warmup=warmup).median_ms


def phase_timing(dims) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ffpa_attn.cute.api import run_forward
    from ffpa_attn.reference import attention
    from ffpa_attn.testing import rel_err

    B, H, N = 1, 32, 8192
    res = {}
    configs = [(d, c, H, None) for d in dims for c in (False, True)]
    if 512 in dims:
        configs += [(512, False, 8, None), (512, True, 8, None)]
    configs += [(d, False, H, tn) for d in dims for tn in TILE_ALTERNATIVES.get(d, ())]
    for d, causal, hkv, tile_n in configs:
        tag = f"D{d} {'causal' if causal else 'full'} Hkv{hkv}" + (f" n{tile_n}" if tile_n else "")
        torch.manual_seed(0)
        q = torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, hkv, N, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, hkv, N, d, device="cuda", dtype=torch.bfloat16)
        scale = 1.0 / math.sqrt(d)
        flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
        row = {}
        try:
            ms = _time_ms(lambda: run_forward(q, k, v, causal, scale, tile_n))
            row["cute_ms"], row["cute_tflops"] = ms, flops / ms / 1e9
            out, lse = run_forward(q, k, v, causal, scale, tile_n)
            g = H // hkv
            for h in (0, H - 1):
                ref, _ = attention(q[:, h:h + 1], k[:, h // g:h // g + 1], v[:, h // g:h // g + 1], is_causal=causal,
                                   scale=scale)
                row[f"err_head{h}"] = rel_err(out[:, h:h + 1], ref)
        except Exception:  # noqa: BLE001
            row["cute_error"] = traceback.format_exc()[-2000:]
        if hkv == H and tile_n is None:
            try:
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale),
                                  warmup=1, reps=3)
                row["sdpa_ms"], row["sdpa_tflops"] = ms, flops / ms / 1e9
            except Exception:  # noqa: BLE001
                row["sdpa_error"] = traceback.format_exc()[-500:]
        res[tag] = row
        log(f"  {tag:<28} cute {row.get('cute_tflops', float('nan')):7.1f} TFLOPS ({row.get('cute_ms', 0):.2f} ms)"
            f"  sdpa {row.get('sdpa_tflops', float('nan')):6.1f}  err h0 {row.get('err_head0', float('nan')):.1e}"
            + ("  ERROR" if "cute_error" in row else ""))
        save()
    return res


def sanitize(dims) -> None:
    """One tiny call per kernel variant (for compute-sanitizer)."""
    import torch

    from ffpa_attn.cute.api import run_forward
    from ffpa_attn.testing import make_qkv

    for d in dims:
        for causal in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                q, k, v = make_qkv(1, 2, 1, 70, 130, d, dtype, device="cuda")
                run_forward(q, k, v, causal, 1.0 / math.sqrt(d))
                torch.cuda.synchronize()
                log(f"  sanitize D{d} causal={causal} {dtype}: ran")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--dims", default="320,384,448,512,576,768,1024")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--compile-only", action="store_true", help="phase 1 only (works without a GPU)")
    args = ap.parse_args()
    dims = [512, 1024] if args.quick else [int(x) for x in args.dims.split(",")]
    import tempfile

    import torch

    import cutlass

    # a fresh on-disk cache, so phase 1 measures real compiles (and the loads a second process does)
    os.environ.setdefault("FFPA_ATTN_CACHE_DIR", tempfile.mkdtemp(prefix="ffpa_cute_cache_"))
    gpu = torch.cuda.is_available()
    RESULTS["env"] = {"torch": torch.__version__, "cutlass": cutlass.__version__,
                      "gpu": torch.cuda.get_device_name() if gpu else None,
                      "capability": torch.cuda.get_device_capability() if gpu else None,
                      "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
    log(f"env: {RESULTS['env']}")
    if args.sanitize:
        sanitize(dims)
        return 0
    t_start = time.perf_counter()
    from ffpa_attn.cute.config import DEFAULT_TILE_N

    variants = [(d, dt, c, DEFAULT_TILE_N) for d in dims for dt in ("bfloat16", "float16") for c in (False, True)]
    if not args.quick:
        variants += [(264, "float16", True, DEFAULT_TILE_N), (296, "bfloat16", False, DEFAULT_TILE_N)]
    variants += [(d, "bfloat16", False, tn) for d in dims for tn in TILE_ALTERNATIVES.get(d, ())]
    log(f"phase 1: compile {len(variants)} variants")
    WATCHDOG.arm("compile", 180)
    RESULTS["phases"]["compile"] = phase_compile(variants, args.workers)
    save()
    if args.compile_only:
        WATCHDOG.disarm()
        return 0
    log("phase 2: ladder")
    WATCHDOG.arm("ladder", 60)
    RESULTS["phases"]["ladder"] = phase_ladder(args.quick)
    save()
    log("phase 3: matrix")
    WATCHDOG.arm("matrix", 150)
    RESULTS["phases"]["matrix"] = phase_matrix(dims, args.quick)
    if not args.quick:
        for tag, case in (("D264 c fp16 tails 190x260", (1, 2, 2, 190, 260, 264, True, torch.float16)),
                          ("D296 f bf16 100x100", (1, 2, 2, 100, 100, 296, False, torch.bfloat16))):
            RESULTS["phases"]["matrix"][tag] = run_case(tag, *case)
    save()
    if not args.skip_timing:
        log("phase 4: timing B=1 H=32 N=8192 bf16")
        WATCHDOG.arm("timing", 150)
        RESULTS["phases"]["timing"] = phase_timing(dims)
        save()
    WATCHDOG.disarm()
    allres = {**RESULTS["phases"].get("ladder", {}), **RESULTS["phases"].get("matrix", {})}
    npass = sum(1 for r in allres.values() if r.get("pass"))
    RESULTS["summary"] = {"correct": f"{npass}/{len(allres)}", "wall_s": round(time.perf_counter() - t_start, 1)}
    save()
    log(f"\nSUMMARY: correctness {npass}/{len(allres)} passed; wall {RESULTS['summary']['wall_s']} s")
    log(f"{'config':<28} {'cute TFLOPS':>12} {'sdpa TFLOPS':>12} {'x sdpa':>7}")
    for tag, row in RESULTS["phases"].get("timing", {}).items():
        ct, st = row.get("cute_tflops", float("nan")), row.get("sdpa_tflops", float("nan"))
        log(f"{tag:<28} {ct:12.1f} {st:12.1f} {ct / st if st == st and st else float('nan'):7.2f}")
    return 0 if npass == len(allres) else 1


if __name__ == "__main__":
    sys.exit(main())

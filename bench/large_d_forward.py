"""Time the forwards for 512 < D <= 1024 side by side: the CuTeDSL S-recompute variant (every tile_n that fits),
the default CuTeDSL 2-CTA cluster kernel, the CUDA forward and the Triton forward.

    python bench/large_d_forward.py                          # D 640/768/896/1024, causal and not
    python bench/large_d_forward.py --d 1024 --causal no --impl recompute,cluster

B=1 H=32 N=8192 bf16 by default; ``triton.testing.do_bench`` medians; TFLOPS = 4 B H Nq Nkv D (x0.5 causal).
Every implementation's output is first compared with the CuTeDSL cluster kernel's (max abs difference
printed), so a wrong fast kernel shows up next to its time. Needs an sm90 GPU (exits 2 otherwise).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = ("recompute", "cluster", "cuda", "triton")


def _tflops(b: int, h: int, n: int, d: int, causal: bool, ms: float) -> float:
    return 4 * b * h * n * n * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def _impls(names, d: int, causal: bool, scale: float, tile_ns):
    """(label, fn(q, k, v) -> out) for each requested implementation."""
    import torch

    import ffpa_attn
    from ffpa_attn.cutedsl.api import run_forward
    from ffpa_attn.cutedsl.config import RECOMPUTE_TILE_N_CHOICES, recompute_stages, RECOMPUTE_MIN_STAGES

    out = []
    for name in names:
        if name == "recompute":
            fits = [t for t in RECOMPUTE_TILE_N_CHOICES if recompute_stages(d, t) >= RECOMPUTE_MIN_STAGES]
            for t in (tile_ns or fits):
                out.append((f"cute-recompute n{t}",
                            lambda q, k, v, t=t: run_forward(q, k, v, causal, scale, tile_n=t, recompute=True)[0]))
        elif name == "cluster":  # with the planner's measured tile
            from ffpa_attn.dispatch.heuristics import cute_tile_n

            out.append(("cute-cluster",
                        lambda q, k, v: run_forward(q, k, v, causal, scale, tile_n=cute_tile_n(d, causal))[0]))
        elif name in ("cuda", "triton"):
            def fn(q, k, v, name=name):
                with torch.no_grad():
                    return ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, scale=scale, forward_backend=name)
            out.append((name, fn))
        else:
            raise SystemExit(f"--impl: unknown {name!r}; choose from {IMPLS}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", default="640,768,896,1024", help="head dims, comma-separated (default %(default)s)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--tile-n", default="", help="recompute tile_n values (default: every one that fits)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms of timed runs)")
    args = p.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("large_d_forward: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    dims = [int(x) for x in args.d.split(",") if x]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    names = [x for x in args.impl.split(",") if x]
    tile_ns = [int(x) for x in args.tile_n.split(",") if x]
    b, h, n = args.batch, args.heads, args.seqlen
    print(f"# B={b} H={h} N={n} {args.dtype}; TFLOPS = 4 B H N^2 D (x0.5 causal); do_bench median")
    print(f"{'D':>5} {'causal':>6} {'impl':<22} {'ms':>9} {'TFLOPS':>7} {'max|diff| vs cluster':>21}")
    for d in dims:
        g = torch.Generator(device="cuda").manual_seed(d)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
        scale = 1.0 / math.sqrt(d)
        for causal in causals:
            from ffpa_attn.cutedsl.api import run_forward

            ref = run_forward(q, k, v, causal, scale)[0].float()
            for label, fn in _impls(names, d, causal, scale, tile_ns):
                try:
                    diff = (fn(q, k, v).float() - ref).abs().max().item()
                    ms = do_bench(lambda: fn(q, k, v), rep=args.rep, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - report and go on to the next implementation
                    print(f"{d:>5} {str(causal):>6} {label:<22} ERR {type(exc).__name__}: {exc}"[:300])
                    continue
                print(f"{d:>5} {str(causal):>6} {label:<22} {ms:>9.3f} {_tflops(b, h, n, d, causal, ms):>7.1f} "
                      f"{diff:>21.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

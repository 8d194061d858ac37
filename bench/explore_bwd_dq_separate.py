"""A/B of the CuTeDSL backward's dQ modes at B=1, H=32, N=8192 bf16 (one process, CUDA-event medians).

    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    python bench/explore_bwd_dq_separate.py --dims 320,384,448,512 --modes separate,tma [--dkdv-only]
    python bench/explore_bwd_dq_separate.py --dims 512 --modes "" --stages 0/0,4/0,3/3   # ring-depth sweep

Per (D, causal): each ``dq_mode`` of ``run_backward`` timed on the same inputs (out / lse from the CuTeDSL
forward), head 0 of dq compared with the first mode's; ``--stages``: dq_mode "separate" with capped ring depths
(``_max_stages`` / ``_dq_max_stages``); ``--dkdv-only``: also dq_mode "separate" without its
dQ kernel (``_profile_skip_dq``: the dK/dV kernel alone). TFLOPS = 2.5 x 4 B H N^2 D (x0.5 causal).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    from ffpa_attn.bench.timing import measure
    from ffpa_attn.cute.api import run_backward, run_forward

    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="512")
    ap.add_argument("--modes", default="separate,tma")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--dkdv-only", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tag", default="")
    ap.add_argument("--stages", default="", help="dq_mode separate: 'A/B' ring-depth caps to sweep, e.g. 0/0,4/0,3/3 "
                    "(dK/dV kernel / dQ kernel; 0 = as many as fit)")
    args = ap.parse_args()
    b, h, n = 1, 32, 8192
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            do = torch.randn_like(q)
            scale = d ** -0.5
            out, lse = run_forward(q, k, v, causal, scale)
            flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            variants = [(m, {"dq_mode": m}) for m in args.modes.split(",") if m]
            for caps in filter(None, args.stages.split(",")):
                a, bb = (int(x) for x in caps.split("/"))
                variants.append((f"separate-stages{a}/{bb}", {"dq_mode": "separate", "_max_stages": a or None,
                                                              "_dq_max_stages": bb or None}))
            if args.dkdv_only:
                variants.append(("separate-dkdv-only", {"dq_mode": "separate", "_profile_skip_dq": True}))
            first = None
            for name, kw in variants:
                dq = run_backward(do, q, k, v, out, lse, causal, scale, **kw)[0][:, :1].float()
                note = ""
                if first is None:
                    first = dq
                elif "_profile_skip_dq" not in kw:
                    note = f" dq_vs_first={((dq - first).norm() / first.norm()).item():.2e}"
                del dq
                t = measure(lambda: run_backward(do, q, k, v, out, lse, causal, scale, **kw), torch.device("cuda"),
                            max_reps=args.reps, min_reps=args.reps, warmup=1)
                print(f"{args.tag} D={d} causal={int(causal)} {name:20s} {t.median_ms:8.3f} ms "
                      f"{flops / t.median_ms / 1e9:7.1f} TFLOPS{note}", flush=True)


if __name__ == "__main__":
    main()

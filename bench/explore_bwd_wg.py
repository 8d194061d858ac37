"""Triton backward plans with one warpgroup per 64 rows of every MMA (H200, B=1, H=32, N=8192 bf16).

    python bench/explore_bwd_wg.py [--d 512 384] [--causal 0 1]

The forward measured its 8-warp programs on 64-row tiles far slower than 4-warp ones (BLOCK_M 64, 8 warps:
114 TFLOPS against 275 with 4 warps at D=512, ``bench/explore_fwd_nsplit.py``): with two warpgroups on a
64-row MMA Triton splits the N mode between them. Every shipped backward plan (``bwd_config.candidate_plans``)
runs 8 warps on 64-key blocks. Here the dK/dV kernel gets 128-key blocks on 8 warps (64 keys per warpgroup) or
64-key blocks on 4 warps, with DS=128 slices so the fp32 dK/dV stay at 128 registers per thread, fused (fp32
dQ atomics) and split (a dQ kernel with 128-row or 4-warp tiles), next to the shipped default. Gradients are
compared with the default plan's (relative norm of the difference); TFLOPS = 2.5 x 4 B H N^2 D (x0.5 causal).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def plans():
    from ffpa_attn.triton.bwd_config import BwdPlan, DkdvConfig as K, DqConfig as Q

    return {
        "default": None,
        "kv n128 ds128 w8 s2": BwdPlan(K(64, 128, 64, 128, False, 8, 2)),
        "kv n128 ds128 w8 s3": BwdPlan(K(64, 128, 64, 128, False, 8, 3)),
        "kv m32 n128 ds128 w8 s3": BwdPlan(K(32, 128, 64, 128, False, 8, 3)),
        "kv n64 ds128 w4 s2": BwdPlan(K(64, 64, 64, 128, False, 4, 2)),
        "kv n64 ds128 w4 s3": BwdPlan(K(64, 64, 64, 128, False, 4, 3)),
        "kv n128 ds128 w8 + dq m128 ds128 w8": BwdPlan(K(64, 128, 64, 128, False, 8, 2), Q(128, 64, 64, 128, 8, 2)),
        "kv n64 ds128 w4 + dq m64 ds256 w4": BwdPlan(K(64, 64, 64, 128, False, 4, 2), Q(64, 64, 64, 256, 4, 2)),
        "kv n128 ds128 w8 + dq m64 ds256 w4": BwdPlan(K(64, 128, 64, 128, False, 8, 2), Q(64, 64, 64, 256, 4, 2)),
    }


def main() -> None:
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.bench.timing import measure
    from ffpa_attn.triton import bwd
    from ffpa_attn.triton.bwd_config import fit_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[512, 384])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--plans", default="", help="comma-separated names (default: all)")
    args = ap.parse_args()
    b, h, n = 1, 32, 8192
    names = [p for p in args.plans.split(",") if p] or list(plans())
    for d in args.d:
        for causal in (bool(c) for c in args.causal):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            from ffpa_attn.triton.fwd import dense_forward

            out, lse = dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                     scale=d ** -0.5, config=TritonBackend())
            flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            first = None
            for name in names:
                plan = plans()[name]
                plan = None if plan is None else fit_plan(plan, d)

                def run(plan=plan):
                    return bwd.dense_backward(do, q, k, v, out, lse, dlse=None, attn_mask=None, mask_grad=False,
                                              dropout_p=0.0, rng=None, causal=causal, scale=d ** -0.5,
                                              config=TritonBackend(), plan=plan)[:3]
                try:
                    grads = [g[:, :2].float() for g in run()]
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"D={d} causal={int(causal)} {name:40s} failed: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                note = ""
                if first is None:
                    first = grads
                else:
                    diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(grads, first))
                    note = f" vs default {diff:.1e}"
                t = measure(run, torch.device("cuda"), max_reps=5, min_reps=3, warmup=1)
                print(f"D={d} causal={int(causal)} {name:40s} {t.median_ms:8.2f} ms "
                      f"{flops / t.median_ms / 1e9:6.1f} TFLOPS{note}", flush=True)


if __name__ == "__main__":
    main()

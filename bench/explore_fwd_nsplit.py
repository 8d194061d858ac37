"""Triton forward at D=320..1024 with the output columns split over programs (``nsplit``) on the wgmma path.

    python bench/explore_fwd_nsplit.py [--d 512 1024] [--causal 0 1]

The autotuner's candidate set (``ffpa_attn.triton.fwd.candidate_configs``) only splits the output where one
program's fp32 O does not fit at BLOCK_M=64 with 8 warps, so at D=512 it never tries ``nsplit=2``: each program
then holds a 64 x 256 accumulator on 4 warps (one warpgroup, wgmma m64) and recomputes S (1.5x the MMA work of
the unsplit kernel). Here those configs are forced next to the shipped default (B=1, H=32, N=8192 bf16,
CUDA-event medians; TFLOPS = 4 B H N^2 D, x0.5 causal); heads 0 and 31 are checked against the fp32 reference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FORCED = {  # (block_m, block_n, warps, stages, nsplit); first run (30) in the comment lines
    # run 30: (64,32,4,2,2) 215/208, (64,32,4,3,2) 277/281, (128,32,8,2,2) 262/281, (64,32,8,2,2) 114/114,
    # (64,32,4,2,4) 121/114 TFLOPS non-causal/causal (default 210/212); BN64 at 4 warps / BM128 BN64 do not fit
    512: [(64, 32, 4, 3, 2), (64, 16, 4, 4, 2), (64, 16, 4, 5, 2), (64, 16, 4, 6, 2), (128, 16, 8, 3, 2),
          (128, 16, 8, 4, 2), (128, 32, 8, 2, 2)],
    448: [(64, 32, 4, 3, 2), (64, 16, 4, 5, 2), (128, 32, 8, 2, 2)],
    384: [(64, 32, 4, 3, 2), (64, 32, 4, 4, 2), (64, 64, 4, 2, 2), (128, 32, 8, 3, 2), (64, 16, 4, 6, 2),
          # unsplit on 8 warps: each warpgroup owns 64 rows x 384 columns (192 fp32 registers of O), no S recompute;
          # sm_90a compile (triton 3.9 on CPU): 192 / 192 / 217 KiB, 255 registers, 3-5 spill stores, none in a loop
          (128, 32, 8, 2, 1), (128, 16, 8, 4, 1), (128, 16, 8, 5, 1)],
    320: [(64, 32, 4, 3, 2), (64, 32, 4, 4, 2), (64, 64, 4, 2, 2), (128, 32, 8, 3, 2)],
    # run 30: every nsplit 2 / 4 config with BN >= 32 needs more than 227 KiB at D=1024
    1024: [(64, 16, 4, 2, 4)],
    # nsplit 3: each program owns ceil(D / 3) output columns on one warpgroup, split like D into DV1 + DV2 power-of-two
    # accumulators (768: 256 + 0; 640: 128 + 128, 3 x 256 columns computed, the last program's DV2 all past D).
    # sm_90a compile (tools/compile_report.py, bf16 TMA, non-causal / causal): shared KiB, registers; all <= 227 KiB
    768: [(64, 32, 4, 2, 3),  # 225, 221/227
          (64, 16, 4, 3, 3),  # 193, 212/215
          (64, 16, 4, 4, 3),  # 225, 211/214
          (64, 32, 4, 2, 4)],  # 217, 212/215
    640: [(64, 32, 4, 2, 3),  # 193, 232/239
          (64, 16, 4, 3, 3),  # 165, 208/217
          (64, 32, 4, 2, 2)],  # 201, 255 (5/26 spill stores, none in the KV loop)
}


def main() -> None:
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.bench.timing import measure
    from ffpa_attn.reference import attention
    from ffpa_attn.triton import fwd
    from ffpa_attn.triton.autotune import KernelConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[512, 448, 384, 320, 1024, 768, 640])
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    args = ap.parse_args()
    b, h, n = 1, 32, 8192
    for d in args.d:
        for causal in (bool(c) for c in args.causal):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            refs = {hh: attention(q[:, hh:hh + 1], k[:, hh:hh + 1], v[:, hh:hh + 1], is_causal=causal)[0]
                    for hh in (0, h - 1)}
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            variants = [("default", None)] + [
                (f"BM{bm}/BN{bn}/w{w}/s{s}/split{ns}",
                 KernelConfig(bm, bn, w, s).with_options(nsplit=ns, tma=True)) for bm, bn, w, s, ns in FORCED[d]]
            for name, kc in variants:
                def run(kc=kc):
                    return fwd.dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                             scale=d ** -0.5, config=TritonBackend(), kernel_config=kc)
                try:
                    out = run()[0]
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"D={d} causal={int(causal)} {name:28s} failed: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                err = max(((out[:, hh:hh + 1].float() - r).norm() / r.norm()).item() for hh, r in refs.items())
                del out
                t = measure(run, torch.device("cuda"), max_reps=10, min_reps=5, warmup=1)
                print(f"D={d} causal={int(causal)} {name:28s} {t.median_ms:8.3f} ms "
                      f"{flops / t.median_ms / 1e9:6.1f} TFLOPS err={err:.2e}", flush=True)


if __name__ == "__main__":
    main()

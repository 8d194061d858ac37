"""First-call compile time of the CuTeDSL kernels without a GPU (sm_90a): what a forward whose backward will run
pays on a cold cache. In one fresh process: ``api.prefetch_backward`` (hands the backward's dK/dV and dQ kernels
to compile workers), the forward kernel compiled here, then the backward's kernels collected (waited for and
loaded from the disk cache). Prints the wall time of each step; run it on an empty cache directory:

    rm -rf /tmp/fc-cache && CUTE_DSL_ARCH=sm_90a FFPA_ATTN_CACHE_DIR=/tmp/fc-cache \\
        PYTHONPATH=$PWD python bench/first_compile_cpu.py --d 512 [--causal]
"""
from __future__ import annotations

import argparse
import time

T_START = time.perf_counter()
import torch  # noqa: E402

from ffpa_attn.cute import api  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512,
                        help="head dim of the kernels to compile (one the CuTeDSL backend has; default 512)")
    parser.add_argument("--causal", action="store_true", help="compile the causal kernels (default non-causal)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    args = parser.parse_args()
    dtype, t0 = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype], time.perf_counter()
    api.prefetch_backward(args.d, dtype, args.causal)
    t_prefetch = time.perf_counter() - t0
    api.get_fwd_kernel(api.fwd_config(args.d, dtype, args.causal))
    t_fwd = time.perf_counter() - t0
    cfg = api.bwd_config(args.d, dtype, args.causal)
    api.get_bwd_kernels(cfg, cfg.dq_mode == "separate")
    t_all = time.perf_counter() - t0
    print(f"d={args.d} causal={int(args.causal)} dtype={args.dtype} imports={t0 - T_START:.2f}s prefetch_call={t_prefetch:.2f}s "
          f"forward_ready={t_fwd:.2f}s forward+backward_ready={t_all:.2f}s")


if __name__ == "__main__":
    main()

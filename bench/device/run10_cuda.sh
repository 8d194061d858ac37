#!/usr/bin/env bash
# Device run 10 (H200, ~5 min): CUDA forward, 16 vs 32 rows per warp (issue 7).
#   1. compile every sm_90a instantiation in parallel into the cubin cache (incl. the rm=2 kernels);
#   2. GPU tests of the CUDA backend (16-row default and the 32-row variant through
#      FFPA_ATTN_CUDA_ROWS_PER_WARP=32) against the fp32 reference -> $OUT/test_cuda_gpu.log;
#   3. bench/explore_cuda.py: compile/load, correctness grid, TFLOPS, and the side-by-side rows-per-warp
#      sweep (each variant checked against the reference before it is timed) -> $OUT/explore_cuda.log/.json.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
OUT=${OUT:-/tmp/out_run10}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$OUT/info.log" 2>&1

timeout 120 python3 - > "$OUT/warmup.log" 2>&1 <<'PY'
import time, torch
from ffpa_attn.cuda import build, launch
from ffpa_attn.cuda.config import instantiations
arch = launch.device_info(torch.device("cuda")).arch
t0 = time.perf_counter()
bins = build.warmup(instantiations(arch), arch)
print(f"{len(bins)} {arch} cubins ({sum(not b.from_cache for b in bins)} compiled) in {time.perf_counter() - t0:.1f} s")
PY
echo "warmup rc=$? $(tail -n 1 "$OUT/warmup.log")"

timeout 150 python3 -m pytest -q tests/gpu/test_cuda_gpu.py > "$OUT/test_cuda_gpu.log" 2>&1
echo "test_cuda_gpu rc=$?"

timeout 240 python3 bench/explore_cuda.py > "$OUT/explore_cuda.log" 2>&1
echo "explore_cuda rc=$?"

echo "===== tests"; tail -n 25 "$OUT/test_cuda_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -n 20
echo "===== explore (errors)"; grep -E "FAIL|Error|error" "$OUT/explore_cuda.log" | head -n 20
echo "===== rows per warp"; grep -E "^\[rows\]" "$OUT/explore_cuda.log" | sed -E 's/, [0-9]+ regs.*local,//' | head -n 40
echo "===== summary"; sed -n '/==== summary/,$p' "$OUT/explore_cuda.log" | tail -n 60

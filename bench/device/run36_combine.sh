#!/usr/bin/env bash
# Device run 36 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the split-KV combine with 16 KiB
# tiles on 2 warps (bench/explore_combine.py, run 35): decode GPU tests (Triton and CuTeDSL split paths), then the
# Hkv=2 Nq=4 decode timings (bench/explore_fwd_bound.py --decode).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode_gpu.py tests/gpu/test_cute_splitkv_gpu.py \
  > "$OUT/test_decode_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_decode_gpu.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_decode_gpu.log" | head
timeout 120 python3 bench/explore_fwd_bound.py --variants "" --decode 2>&1 | grep -v -i warn | tee "$OUT/decode.log" | grep -E "^--|split|_kernel"
echo "done ($(( $(date +%s) - t0 )) s)"

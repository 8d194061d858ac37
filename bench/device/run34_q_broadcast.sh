#!/usr/bin/env bash
# Device run 34 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the split-KV path reads the packed
# queries once (FwdConfig.q_broadcast) instead of a copy per KV slice: the CuTeDSL split-KV GPU tests, then the Hkv=2 Nq=4
# decode profile and timings (bench/explore_fwd_bound.py --decode).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_splitkv_gpu.py > "$OUT/test_cute_splitkv_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_splitkv_gpu.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_splitkv_gpu.log" | head
timeout 200 python3 bench/explore_fwd_bound.py --variants "" --decode 2>&1 | grep -v -i warn | tee "$OUT/decode.log" | grep -E "^--|split|_kernel|elementwise"
echo "done ($(( $(date +%s) - t0 )) s)"

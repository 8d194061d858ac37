#!/usr/bin/env bash
# Device run 24 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the CuTeDSL backward with
# dq_mode "separate" as the default (tuned ring cap at D=512): every backward GPU test (default + the "tma" and
# "atomic" modes on the same shapes), compute-sanitizer memcheck of one tiny call of each kernel of the new
# mode, then the project's bench (fwd + fwd+bwd, D 320/384/512, causal both) with SDPA and Triton alongside.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py -k backward > "$OUT/test_cute_bwd.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_bwd.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_bwd.log" | head
t0=$(date +%s)
timeout 90 compute-sanitizer --tool memcheck python3 bench/explore_cute_bwd.py --sanitize --dq-mode separate \
  > "$OUT/sanitize.log" 2>&1
echo "sanitize rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|sanitize call done|Invalid" "$OUT/sanitize.log" | head -5
t0=$(date +%s)
timeout 190 python3 -m ffpa_attn bench --d 320,384,512 --bwd --impl cutedsl,triton,sdpa-efficient --causal both \
  --time-budget 170 --no-progress --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 30 "$OUT/bench.log"

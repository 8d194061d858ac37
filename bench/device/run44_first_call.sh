#!/usr/bin/env bash
# Device run 44 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the backward's cheaper
# epilogue (store_tiles: one test per row and per 8-column group) and the dQ kernel compiled in a forked child.
# First-call wall times on cold caches (parallel compile on / off), then the backward GPU tests (every dq mode: all
# share the epilogue), compute-sanitizer memcheck at D=264 (column clipping) and D=1024, and the backward bench
# (D 512 / 1024, same shapes as the main job) to check the epilogue change costs nothing.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 150 python3 bench/explore_first_call.py --d 512,1024 --serial-too > "$OUT/first_call.log" 2>&1
timeout 60 python3 bench/explore_first_call.py --d 384 --causal >> "$OUT/first_call.log" 2>&1
echo "first call rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/first_call.log" | cut -c1-400
t0=$(date +%s)
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "backward" \
  > "$OUT/test_cute_bwd.log" 2>&1
echo "pytest bwd rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_bwd.log"
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/test_cute_bwd.log" | head -8
for d in 264 1024; do
  t0=$(date +%s)
  timeout 60 compute-sanitizer --tool memcheck python3 bench/explore_cute_bwd.py --sanitize --sanitize-d $d \
    > "$OUT/sanitize_$d.log" 2>&1
  echo "sanitize $d rc=$? ($(( $(date +%s) - t0 )) s)"
  grep -E "ERROR SUMMARY|sanitize call done|Invalid" "$OUT/sanitize_$d.log" | head -5
done
t0=$(date +%s)
timeout 100 python3 -m ffpa_attn bench --d 512,1024 --bwd --impl cutedsl --causal both --time-budget 80 \
  --no-progress --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 12 "$OUT/bench.log"

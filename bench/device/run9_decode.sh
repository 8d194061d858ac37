#!/usr/bin/env bash
# Device run 9 (one H200, ~4 min): issue #11 split-KV decode - GPU + CPU-suite decode tests, then the
# decode exploration (yardsticks measured in the same run, the issue-11 table, forced-config sweep of the
# shapes that missed). Files in $OUT: test_decode.log, explore_decode.log, explore_decode.json.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
export PYTHONUNBUFFERED=1
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null
timeout 150 python3 -m pytest -q tests/gpu/test_decode_gpu.py tests/test_triton_decode.py \
  > "$OUT/test_decode.log" 2>&1; echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"
timeout 200 python3 bench/explore_decode.py > "$OUT/explore_decode.log" 2>&1
echo "explore_decode rc=$? ($(( $(date +%s) - t0 )) s)"
echo "===== tests"; tail -n 15 "$OUT/test_decode.log"
echo "===== yardsticks"; grep -A5 "== yardsticks" "$OUT/explore_decode.log"
echo "===== best per shape"; grep " best: " "$OUT/explore_decode.log"
echo "===== summary"; sed -n '/== summary/,$p' "$OUT/explore_decode.log"
echo "===== log tail (if the summary is missing)"; tail -c 1500 "$OUT/explore_decode.log"

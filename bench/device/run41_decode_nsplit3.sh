#!/usr/bin/env bash
# Device run 41 (H200, warm after run40; carry .device-wheels/2 .device-tools): the issue-11 decode table with this run's
# copy / read yardsticks, SDPA, the non-split kernel and the CuTeDSL split path at its default tile and at tile_n=64
# (bench/explore_decode.py --quick), then the Triton forward with the output split 3 ways at D=640 / 768
# (bench/explore_fwd_nsplit.py).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
OUT=$OUT timeout 240 python3 bench/explore_decode.py --quick > "$OUT/explore_decode.log" 2>&1
echo "decode rc=$? ($(( $(date +%s) - t0 )) s)"; sed -n '/== summary/,$p' "$OUT/explore_decode.log" | head -14
grep -E "CuTeDSL" "$OUT/explore_decode.log" | head -20
t0=$(date +%s)
timeout 200 python3 bench/explore_fwd_nsplit.py --d 768 640 > "$OUT/explore_fwd_nsplit3.log" 2>&1
echo "nsplit rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 30 "$OUT/explore_fwd_nsplit3.log"

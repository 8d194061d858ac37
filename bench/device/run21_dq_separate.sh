#!/usr/bin/env bash
# Device run 21 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): installs the CuTeDSL
# wheels, then the new dq_mode "separate" of the CuTeDSL backward (dK/dV kernel without dQ + the
# query-stationary dQ kernel, ffpa_attn/cute/bwd_dq_sm90.py): smoke + A/B timing against "tma"
# (bench/explore_cute_bwd.py --quick), then the backward GPU tests of every dQ mode.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
OUT=$OUT timeout 200 python3 bench/explore_cute_bwd.py --quick --dq-modes ${MODES:-separate,tma} --budget 120 \
  > "$OUT/explore_cute_bwd.log" 2>&1
echo "explore rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "FAIL|ERROR|timing|correctness" "$OUT/explore_cute_bwd.log" | cut -c1-260
t0=$(date +%s)
timeout ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "${TESTS:-backward}" \
  > "$OUT/test_cute_bwd.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 4 "$OUT/test_cute_bwd.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_bwd.log" | head

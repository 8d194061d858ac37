#!/usr/bin/env bash
# Device run 23 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): ring-depth sweep of
# dq_mode "separate" (dK/dV kernel cap / dQ kernel cap; 0 = as many as fit), bench/explore_bwd_dq_separate.py.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
run() { timeout 150 python3 bench/explore_bwd_dq_separate.py --modes "" "$@" 2>&1 | grep -v Warn | tee -a "$OUT/sweep.log"; }
run --dims 512 --stages 4/0,4/3,4/2
run --dims 384 --causal 0 --stages 0/0,5/0,4/0,3/0,4/4
run --dims 320 --causal 0 --stages 0/0,6/0,4/0,3/0,4/4
run --dims 448 --causal 0 --stages 0/0,4/0,4/4
echo "done ($(( $(date +%s) - t0 )) s)"

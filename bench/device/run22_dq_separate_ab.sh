#!/usr/bin/env bash
# Device run 22 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): dq_mode "separate" vs
# "tma" at D in {320, 384, 448, 512} (bench/explore_bwd_dq_separate.py), then two EXPERIMENTS of the dK/dV
# kernel in that mode at D=512 (trace-time env knobs, disk cache off, one process each): the fused kernels'
# lock-step barriers (FFPA_EXP_SEP_LOCKSTEP=1) and 4 ring slots instead of 5 (FFPA_EXP_BWD_STAGES=4).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 200 python3 bench/explore_bwd_dq_separate.py --dims 512 --dkdv-only --tag base 2>&1 | grep -v Warn | tee "$OUT/ab.log"
FFPA_ATTN_CUTE_DISK_CACHE=0 FFPA_EXP_SEP_LOCKSTEP=1 timeout 100 python3 bench/explore_bwd_dq_separate.py --dims 512 \
  --modes separate --dkdv-only --tag lockstep 2>&1 | grep -v Warn | tee -a "$OUT/ab.log"
FFPA_ATTN_CUTE_DISK_CACHE=0 FFPA_EXP_BWD_STAGES=4 timeout 100 python3 bench/explore_bwd_dq_separate.py --dims 512 \
  --modes separate --dkdv-only --tag stages4 2>&1 | grep -v Warn | tee -a "$OUT/ab.log"
timeout 240 python3 bench/explore_bwd_dq_separate.py --dims 320,384,448 --tag dims 2>&1 | grep -v Warn | tee -a "$OUT/ab.log"
echo "done ($(( $(date +%s) - t0 )) s)"

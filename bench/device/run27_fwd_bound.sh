#!/usr/bin/env bash
# Device run 27 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): what bounds the CuTeDSL
# forward at D=512 (stripped variants, bench/explore_fwd_bound.py) and where the Hkv=2 Nq=4 decode time goes.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 300 python3 bench/explore_fwd_bound.py --decode 2>&1 | grep -v Warn | tee "$OUT/fwd_bound.log"
echo "done rc=$? ($(( $(date +%s) - t0 )) s)"

#!/usr/bin/env bash
# Device run 47 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the bench now waits for the
# backward's background compiles after a first call before it times (run 43's causal forwards at D=384 / 512 were
# timed while those compiles ran: 437 / 457 against 463 / 517 in session 6). Same shapes, CuTeDSL only.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 150 python3 -m ffpa_attn bench --d 384,512 --bwd --impl cutedsl --causal both --time-budget 100 \
  --no-progress --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 12 "$OUT/bench.log"
grep "^| cutedsl" "$OUT/nvidia-h200.md" | cut -c1-140

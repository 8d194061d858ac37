#!/usr/bin/env bash
# Device run 40 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the CuTeDSL backward above
# D=512 (V / dO streamed through ring B next to their partner chunks, 3-4 dK/dV parts, 2 dQ parts): the backward GPU
# tests (all D, the new D > 512 shapes included), the forward's last-wave split and the split-KV tests (the tail now
# goes through the q_broadcast kernel), compute-sanitizer memcheck of one D=1024 call of both kernels, then the
# project's bench (fwd+bwd, D 576/768/1024, causal both) with Triton and SDPA alongside.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 230 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "backward and not other_dq_mode" \
  > "$OUT/test_cute_bwd.log" 2>&1
echo "pytest bwd rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_bwd.log"
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/test_cute_bwd.log" | head -8
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py tests/gpu/test_cute_splitkv_gpu.py \
  -k "tail or split" > "$OUT/test_cute_tail_split.log" 2>&1
echo "pytest tail/split rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_tail_split.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_tail_split.log" | head -5
t0=$(date +%s)
timeout 60 compute-sanitizer --tool memcheck python3 bench/explore_cute_bwd.py --sanitize --sanitize-d 1024 \
  > "$OUT/sanitize_1024.log" 2>&1
echo "sanitize rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|sanitize call done|Invalid" "$OUT/sanitize_1024.log" | head -5
t0=$(date +%s)
timeout 150 python3 -m ffpa_attn bench --d 576,768,1024 --bwd --impl cutedsl,triton,sdpa-efficient --causal both \
  --time-budget 135 --no-progress --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 25 "$OUT/bench.log"

#!/usr/bin/env bash
# Device run 46 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the forward's split last
# wave compiles its q_broadcast kernel in a forked child next to the main kernel. First-call wall times at the
# benchmark shape D=384 (B=1 H=32 N=8192, tail split) and the small D=512 shape (fresh process, second process,
# second process after a warm-up call, new shape in a warm process), then the tail-split and autograd GPU tests.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 150 python3 bench/explore_first_call.py --d 384 --heads 32 --n 8192 > "$OUT/first_call.log" 2>&1
timeout 100 python3 bench/explore_first_call.py --d 512 >> "$OUT/first_call.log" 2>&1
echo "first call rc=$? ($(( $(date +%s) - t0 )) s)"; cut -c1-700 "$OUT/first_call.log"
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "tail_split or autograd" \
  > "$OUT/test_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_gpu.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_gpu.log" | head -8

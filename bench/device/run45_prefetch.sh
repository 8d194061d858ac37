#!/usr/bin/env bash
# Device run 45 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the backward's kernels
# compile in forked children from the forward of a call that needs its backward (prepare_backward hook), the dQ
# kernel in a child at the backward's first call otherwise. First-call wall times on cold caches (fresh process,
# second process, new shape in a warm process; parallel compile on / off at D=1024), then GPU tests of the
# autograd path on a cold cache, the backward protocol, and the transformers binding (interface -> hook).
set -u
. bench/device/cute_env.sh
python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)"; env | grep -E "^PYTHON" | head
t0=$(date +%s)
timeout 120 python3 bench/explore_first_call.py --d 512 > "$OUT/first_call.log" 2>&1
timeout 200 python3 bench/explore_first_call.py --d 1024 --serial-too >> "$OUT/first_call.log" 2>&1
timeout 90 python3 bench/explore_first_call.py --d 384 --causal >> "$OUT/first_call.log" 2>&1
echo "first call rc=$? ($(( $(date +%s) - t0 )) s)"; cut -c1-600 "$OUT/first_call.log"
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py tests/gpu/test_transformers_gpu.py \
  -k "autograd or backward_protocol or deterministic or full_layer or model_logits" > "$OUT/test_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_gpu.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_gpu.log" | head -8

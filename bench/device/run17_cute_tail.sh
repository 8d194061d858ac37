#!/usr/bin/env bash
# Device run 17 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): installs the CuTeDSL
# wheels, then the CuTeDSL GPU tests after (a) the dQ-mode default flip to "tma" and (b) the forward kernel's
# new cta_limit parameter + last-wave split (ffpa_attn/_waves.py): tests/gpu/test_cute_gpu.py (forward,
# backward in both dQ modes, tail split) and tests/gpu/test_cute_splitkv_gpu.py (the decode path launches the
# same kernel), then the A/B bench/explore_tail_split.py for CuTeDSL and CUDA.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
t0=$(date +%s)
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py tests/gpu/test_cute_splitkv_gpu.py \
  > "$OUT/test_cute_all.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 4 "$OUT/test_cute_all.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_all.log" | head
t0=$(date +%s)
timeout 150 python3 bench/explore_tail_split.py --backends cutedsl,cuda --dims 320,384,512 --reps 3 \
  > "$OUT/explore_tail_split.log" 2>&1
echo "explore rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/explore_tail_split.log"

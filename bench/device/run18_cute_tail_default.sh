#!/usr/bin/env bash
# Device run 18 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the CuTeDSL forward's
# tail-split default by head dim (config.TAIL_SPLIT_MIN_HEAD_DIM) -- the tail-split GPU tests only.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "tail_split or test_forward[" \
  > "$OUT/test_cute_tail_default.log" 2>&1
echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR" "$OUT/test_cute_tail_default.log" | tail -20; tail -n 2 "$OUT/test_cute_tail_default.log"

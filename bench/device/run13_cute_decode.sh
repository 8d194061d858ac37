#!/usr/bin/env bash
# Device run 13 (H200, warm after the wheel-staging call; carry .device-wheels/2 .device-tools): the CuTeDSL
# split-KV decode path. Installs the CuTeDSL wheels, runs its GPU tests and the decode GPU tests (the
# Triton default tile changed at 64 rows per KV head), then bench/explore_decode.py --quick (defaults,
# autotuned, CuTeDSL packed split-KV and the default dispatch for the issue-11 shapes).
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 200 python3 -m pytest -q tests/gpu/test_cute_splitkv_gpu.py tests/gpu/test_decode_gpu.py \
  > "$OUT/test_cute_decode.log" 2>&1; echo "pytest rc=$?"
tail -n 12 "$OUT/test_cute_decode.log"
timeout 200 python3 bench/explore_decode.py --quick > "$OUT/explore_decode_cute.log" 2>&1; echo "explore rc=$?"
sed -n '/== yardsticks/,/^-> /p' "$OUT/explore_decode_cute.log"
grep -E "CuTeDSL|default dispatch|split-KV default|best:" "$OUT/explore_decode_cute.log"
sed -n '/== summary/,$p' "$OUT/explore_decode_cute.log"

#!/usr/bin/env bash
# Device run 2 (H200, right after run 1 on the warm machine): CuTeDSL forward, CUDA forward, split-KV decode.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
mkdir -p /tmp/wheels && cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
if ls /tmp/wheels | grep -q "part.00"; then
  bash .device-tools/install_wheels.sh /tmp/wheels > "$OUT/install.log" 2>&1; echo "install rc=$?"
  (export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
   timeout 230 python3 bench/explore_cute.py > "$OUT/explore_cute.log" 2>&1; echo "explore_cute rc=$?")
else
  echo "wheels of run 1 missing (fresh machine): CuTeDSL skipped"; ls /tmp/wheels
fi
timeout 170 python3 bench/explore_cuda.py > "$OUT/explore_cuda.log" 2>&1; echo "explore_cuda rc=$?"
timeout 150 python3 bench/explore_decode.py > "$OUT/explore_decode.log" 2>&1; echo "explore_decode rc=$?"
echo "===== cute"; tail -c 4000 "$OUT/explore_cute.log" 2>/dev/null
echo "===== cuda"; tail -c 4000 "$OUT/explore_cuda.log"
echo "===== decode"; tail -c 3000 "$OUT/explore_decode.log"

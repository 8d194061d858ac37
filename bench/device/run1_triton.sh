#!/usr/bin/env bash
# Device run 1 (H200): Triton forward/backward exploration + ring attention at world size 1.
# Also stages the first half of the CuTeDSL wheels into /tmp/wheels for run 2 (carry .device-wheels/1).
set -u
mkdir -p /tmp/wheels && cp .device-wheels/1/* /tmp/wheels/ 2>/dev/null
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 235 python3 bench/explore_fwd.py --budget 140 > "$OUT/explore_fwd.log" 2>&1; echo "explore_fwd rc=$?"
timeout 235 python3 bench/explore_bwd.py --budget 140 > "$OUT/explore_bwd.log" 2>&1; echo "explore_bwd rc=$?"
NCCL_NVLS_ENABLE=0 timeout 90 torchrun --nproc-per-node=1 tests/gpu/ring_gpu.py > "$OUT/ring_gpu.log" 2>&1; echo "ring rc=$?"
echo "===== fwd"; tail -c 4500 "$OUT/explore_fwd.log"
echo "===== bwd"; tail -c 4500 "$OUT/explore_bwd.log"
echo "===== ring"; tail -c 2000 "$OUT/ring_gpu.log"

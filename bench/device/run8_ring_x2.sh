#!/usr/bin/env bash
# Device run 8 (nvidia-h200-x2): ring attention over NCCL on 2 GPUs (NVLink multicast stays off).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
nvidia-smi -L
timeout 170 torchrun --nproc-per-node=2 tests/gpu/ring_gpu.py --iters 3 > "$OUT/ring_gpu_x2.log" 2>&1; echo "ring x2 rc=$?"
tail -c 3500 "$OUT/ring_gpu_x2.log"

#!/usr/bin/env bash
# Device run 16 (H200, no wheels needed): the last-wave split (ffpa_attn/_waves.py) in the CUDA backend:
# its GPU tests plus a subset of the CUDA grid (the kernel gained a cta_limit parameter), then the A/B timing
# bench/explore_tail_split.py --backends cuda. Outputs: test_cuda_tail.log, explore_tail_split_cuda.log/.json
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 330 python3 -m pytest -q -x tests/gpu/test_cuda_gpu.py -p no:cacheprovider \
  -k "tail_split or default_on_hopper or rm2_causal_gqa_tails or rm2_strided or no_local_memory or test_head_dims" \
  > "$OUT/test_cuda_tail.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 4 "$OUT/test_cuda_tail.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cuda_tail.log" | head
t0=$(date +%s)
timeout 200 python3 bench/explore_tail_split.py --backends cuda > "$OUT/explore_tail_split_cuda.log" 2>&1
echo "explore rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/explore_tail_split_cuda.log"
[ -f "$OUT/explore_tail_split.json" ] && mv "$OUT/explore_tail_split.json" "$OUT/explore_tail_split_cuda.json"

#!/usr/bin/env bash
# Device run 6 (H200, warm after run 5): training-step time of a Gemma-4-shaped model, ffpa vs sdpa, 8K tokens.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
[ -d /tmp/site/nvidia_cutlass_dsl ] && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 230 python3 bench/transformers_step.py --skip-flex > "$OUT/transformers_step.log" 2>&1
echo "transformers_step rc=$?"
tail -c 5000 "$OUT/transformers_step.log"

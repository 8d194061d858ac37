#!/usr/bin/env bash
# Device run 7 (H200, after run 4 staged the first wheel half on this machine; carry .device-wheels/2 .device-tools):
# `check` (now including the implicit default: CuTeDSL forward + Triton backward) and a forward benchmark of the
# CuTeDSL backend next to Triton and SDPA (run 5 could not time it: its bench asked CuTeDSL for a backward).
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
bash .device-tools/install_wheels.sh /tmp/wheels > "$OUT/install.log" 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 150 python3 -m ffpa_attn check > "$OUT/check.log" 2>&1; echo "check rc=$?"
timeout 240 python3 -m ffpa_attn bench --d 320,384,448,512,640,768,1024 --causal both --impl cutedsl,triton,sdpa-efficient \
  --no-progress --json "$OUT/nvidia-h200-fwd-cutedsl.json" --md "$OUT/nvidia-h200-fwd-cutedsl.md" \
  --plot "$OUT/nvidia-h200-fwd-cutedsl.png" > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
grep -E "^(PASS|FAIL|SKIP)|^check:" "$OUT/check.log"
tail -c 2500 "$OUT/bench.log"

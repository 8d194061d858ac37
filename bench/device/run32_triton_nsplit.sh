#!/usr/bin/env bash
# Device run 32 (H200, Triton only): the forward's new H200 defaults (output columns over two programs, nsplit=2, at
# D=384 / 448 / 512): the Triton forward GPU tests, then the project bench, forward, Triton next to SDPA.
set -u
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
t0=$(date +%s)
timeout 260 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_fwd_gpu.py > "$OUT/test_triton_fwd_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_triton_fwd_gpu.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_triton_fwd_gpu.log" | head
timeout 280 python3 -m ffpa_attn bench --d 320,384,448,512 --gqa 1,4 --causal both --impl triton,sdpa-efficient \
  --no-progress --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"
grep -E "triton|sdpa" "$OUT/bench.log" | head -40

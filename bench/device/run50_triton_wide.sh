#!/usr/bin/env bash
# Device run 50 (H200, no staging: Triton only): the wide unsplit Triton forward tile for 256 < D <= 384 (BLOCK_M 128
# on 8 warps, the H200 default at D=384). Compile report under the device's Triton (no spills in the KV loop), the
# forced-config sweep at D=384, the Triton forward GPU tests (new: the wide tile forced at D 264..384 incl. GQA, fp16,
# varlen; the default / masked choice), then the bench at D 320 / 336 / 384 x GQA 1 / 4 next to SDPA.
set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 120 python3 tools/compile_report.py --check --d 384 336 320 > "$OUT/compile_report.log" 2>&1
echo "compile report rc=$? ($(( $(date +%s) - t0 )) s)"; grep -v -i warn "$OUT/compile_report.log" | tail -8
t0=$(date +%s)
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_triton_fwd_gpu.py > "$OUT/test_triton_fwd_gpu.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_triton_fwd_gpu.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_triton_fwd_gpu.log" | head -8
t0=$(date +%s)
timeout 200 python3 -m ffpa_attn bench --d 320,336,384 --gqa 1,4 --causal both --impl triton,sdpa-efficient \
  --time-budget 170 --no-progress --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 16 "$OUT/bench.log"

#!/usr/bin/env bash
# Device run 19 (H200, no wheels needed): the split-KV decode with its combine as a programmatic dependent
# launch (PDL, ffpa_attn/triton/decode.py): the decode GPU tests, then bench/explore_decode.py --quick with
# FFPA_ATTN_PDL=0 and =1 (the Triton paths; CuTeDSL is not installed on this machine).
# Ran once (bench/results/2026-11-29-h200-session3/decode_pdl/): PDL gave nothing measurable (Hkv=2 Nq=1 74 vs
# 75% of the copy, within run-to-run noise), so the PDL code was reverted; kept as the record of that run.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_decode_gpu.py > "$OUT/test_decode_pdl.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 3 "$OUT/test_decode_pdl.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_decode_pdl.log" | head
for p in 0 1; do
  t0=$(date +%s)
  FFPA_ATTN_PDL=$p timeout 120 python3 bench/explore_decode.py --quick > "$OUT/explore_decode_pdl$p.log" 2>&1
  echo "explore PDL=$p rc=$? ($(( $(date +%s) - t0 )) s)"
  [ -f "$OUT/explore_decode.json" ] && mv "$OUT/explore_decode.json" "$OUT/explore_decode_pdl$p.json"
  sed -n '/== summary/,$p' "$OUT/explore_decode_pdl$p.log" | head -14
done

#!/usr/bin/env bash
# Device run 20 (H200, no wheels needed): the split-KV decode autotuner timed with CUDA-graph replays
# (autotune.bench_ms(cuda_graph=True)); before, eager do_bench timed the host's launch overhead and picked
# a 1.7x slower config at Hkv=2 Nq=1 (run 19). Fresh caches; decode GPU tests of the autotuned path, then
# bench/explore_decode.py --quick (its "autotuned" and "default dispatch" rows go through the autotuner).
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache_run20 PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_decode_gpu.py -k "autotune or dispatch" \
  > "$OUT/test_decode_autotune.log" 2>&1
echo "pytest rc=$?"; tail -n 2 "$OUT/test_decode_autotune.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_decode_autotune.log" | head
rm -rf /tmp/ffpa_cache_run20
timeout 150 python3 bench/explore_decode.py --quick > "$OUT/explore_decode_autotune.log" 2>&1
echo "explore rc=$?"; mv "$OUT/explore_decode.json" "$OUT/explore_decode_autotune.json" 2>/dev/null
grep -E "autotuned|default dispatch|split-KV default" "$OUT/explore_decode_autotune.log" | grep -v "^ *[0-9]* *[0-9]* *(sanity)" | head -30
sed -n '/== summary/,$p' "$OUT/explore_decode_autotune.log" | head -13

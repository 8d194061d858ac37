#!/usr/bin/env bash
# Device run 42 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the D > 512 CuTeDSL backward with
# unequal rings (ring B, two streamed chunks per step, deeper) against the equal rings of run 40
# (bench/explore_bwd_stream.py), the new defaults' GPU tests (CuTeDSL backward D > 512, Triton forward at D=768 with the
# output split 3 ways, CuTeDSL split-KV at 64-key tiles and the decode dispatch), then the decode table again.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 230 python3 bench/explore_bwd_stream.py > "$OUT/explore_bwd_stream.log" 2>&1
echo "stream rc=$? ($(( $(date +%s) - t0 )) s)"; cat "$OUT/explore_bwd_stream.log" | grep -v -i warn | tail -12
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "((D1024 or D768 or D576 or D640 or D520 or D896 or D960) and backward and not cluster and not other) or (noncontiguous_scale_dlse and 1024) or (backward_large_causal and 1024) or backward_protocol" \
  > "$OUT/test_cute_bwd_large.log" 2>&1
echo "pytest cute bwd rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 1 "$OUT/test_cute_bwd_large.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_cute_bwd_large.log" | head -5
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_fwd_gpu.py -k 768 > "$OUT/test_triton_fwd_768.log" 2>&1
echo "pytest triton 768 rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 1 "$OUT/test_triton_fwd_768.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_triton_fwd_768.log" | head -5
t0=$(date +%s)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_splitkv_gpu.py tests/gpu/test_decode_gpu.py -k "not autotune" \
  > "$OUT/test_decode.log" 2>&1
echo "pytest decode rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 1 "$OUT/test_decode.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_decode.log" | head -5
t0=$(date +%s)
OUT=$OUT timeout 100 python3 bench/explore_decode.py --quick > "$OUT/explore_decode.log" 2>&1
echo "decode rc=$? ($(( $(date +%s) - t0 )) s)"; sed -n '/== summary/,$p' "$OUT/explore_decode.log" | head -12

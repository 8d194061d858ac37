#!/usr/bin/env bash
# Device run 28 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): the forward's overlapped
# consumer schedule (FwdConfig.overlap, the new default): A/B against the one-S-tile schedule per D / causal /
# tile_n (bench/explore_fwd_overlap.py --ab), then the forward GPU tests under the new default.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
AB="512:0:0:80,512:0:1:64,512:0:1:48,512:1:0:64,512:1:1:64,512:1:1:48"
AB="$AB,384:0:0:96,384:0:1:64,384:0:1:96,384:1:0:64,384:1:1:64"
AB="$AB,320:0:0:128,320:0:1:96,320:0:1:128,320:0:1:64,320:1:0:64,320:1:1:64"
AB="$AB,448:0:0:64,448:0:1:64,1024:0:0:80,1024:0:1:48,1024:0:1:64,1024:1:0:64,1024:1:1:64,768:0:0:96,768:0:1:64"
timeout 330 python3 bench/explore_fwd_overlap.py --variants "" --ab "$AB" 2>&1 | grep -v -i warn | tee "$OUT/ab.log"
echo "ab rc=$? ($(( $(date +%s) - t0 )) s)"
timeout 220 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "not backward" > "$OUT/test_cute_fwd.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 3 "$OUT/test_cute_fwd.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_cute_fwd.log" | head

#!/usr/bin/env bash
# Device run 43 (H200, warm after run4_stage.sh with carry .device-wheels/1 .devcache/upstream; this call carries
# .device-wheels/2 .device-tools): the README's main job `python -m ffpa_attn` (check + the standard sweep: D in
# {320, 384, 512, 640, 768, 1024} x causal, GQA at D=512, forward + backward) with CuTeDSL installed and the public
# ffpa-attn 0.2.4 as a peer. Writes $OUT/<gpu>.json/.md/.png.
set -u
. bench/device/cute_env.sh
[ -d /tmp/upstream/ffpa_attn ] && export FFPA_UPSTREAM_PATH=/tmp/upstream && echo "upstream: /tmp/upstream"
python3 -m ffpa_attn info > "$OUT/info.log" 2>&1
t0=$(date +%s)
timeout 540 python3 -m ffpa_attn --out "$OUT" --time-budget 400 --no-progress > "$OUT/main.log" 2>&1
echo "main rc=$? ($(( $(date +%s) - t0 )) s)"
sed -n '/TFLOPS (fwd \/ bwd)/,$p' "$OUT/main.log" | head -40

#!/usr/bin/env bash
# Device run 5 (H200, warm after run 4; carry .device-wheels/2 .device-tools): the README's
# main job `python -m ffpa_attn` (check + standard benchmark sweep) with the CuTeDSL backend installed and the
# public ffpa-attn 0.2.4 (unpacked wheel) as a peer. Writes $OUT/<gpu>.json/.md/.png.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
if ls /tmp/wheels | grep -q "part.00"; then
  bash .device-tools/install_wheels.sh /tmp/wheels > "$OUT/install.log" 2>&1; echo "install rc=$?"
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
else
  echo "first half of the CuTeDSL wheels missing (fresh machine): running without CuTeDSL"
fi
[ -d /tmp/upstream/ffpa_attn ] && export FFPA_UPSTREAM_PATH=/tmp/upstream
python3 -m ffpa_attn info > "$OUT/info.log" 2>&1
timeout 545 python3 -m ffpa_attn --out "$OUT" --time-budget 455 --no-progress > "$OUT/main.log" 2>&1
echo "main rc=$?"
tail -c 10000 "$OUT/main.log"

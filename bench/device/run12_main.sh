#!/usr/bin/env bash
# Device run 12 (H200, warm right after run 11, which installed the CuTeDSL wheels into /tmp/site; run 11's
# staging call also copied the public ffpa-attn 0.2.4 to /tmp/upstream): the README main job
# `python -m ffpa_attn` (check + the standard sweep, every backend incl. the CuTeDSL forward + backward and the
# public 0.2.4 as a peer). Writes $OUT/nvidia-h200.{json,md,png}, main.log, info.log.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache
if [ -d /tmp/site/nvidia_cutlass_dsl ]; then
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
else
  echo "CuTeDSL wheels missing (fresh machine): running without CuTeDSL"
fi
[ -d /tmp/upstream/ffpa_attn ] && export FFPA_UPSTREAM_PATH=/tmp/upstream
python3 -m ffpa_attn info > "$OUT/info.log" 2>&1
timeout 560 python3 -m ffpa_attn --out "$OUT" --time-budget "${BUDGET:-430}" --no-progress > "$OUT/main.log" 2>&1
echo "main rc=$?"
grep -E "^(PASS|FAIL|SKIP)|^check:" "$OUT/main.log" | grep -v "^PASS" | head -20
grep -cE "^PASS" "$OUT/main.log" | sed "s/^/check PASS lines: /"
tail -c 6000 "$OUT/main.log"

#!/usr/bin/env bash
# Device run 25 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools .devcache/old): the dQ kernel
# with consumer 1's dS as a register A operand (RS wgmma): the default-mode backward GPU tests, then an A/B
# against the committed SS version (1d571ca's bwd_dq_sm90.py, carried in .devcache/old, run from a copy of
# the tree) with bench/explore_bwd_dq_separate.py.
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "backward and not other and not cluster" \
  > "$OUT/test_cute_bwd.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_bwd.log"
grep -E "^(FAILED|ERROR)" "$OUT/test_cute_bwd.log" | head
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r ffpa_attn bench /tmp/old/ && cp .devcache/old/bwd_dq_sm90.py /tmp/old/ffpa_attn/cute/
for i in 1 2; do
  timeout 60 python3 bench/explore_bwd_dq_separate.py --dims 512 --modes separate --tag "rs#$i" 2>&1 | grep -v Warn | tee -a "$OUT/ab.log"
  (cd /tmp/old && PYTHONPATH=/tmp/old:$PYTHONPATH timeout 60 python3 bench/explore_bwd_dq_separate.py --dims 512 --modes separate \
    --tag "ss#$i" 2>&1 | grep -v Warn | tee -a "$OUT/ab.log")
done
echo "done ($(( $(date +%s) - t0 )) s)"

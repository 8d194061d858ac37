#!/usr/bin/env bash
# Device run 48 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): issue 11's last shape.
# The split-KV forward's slice merge (FwdConfig.slice_merge: clusters of 2 / 4 KV slices merge their partials
# through DSMEM before writing) timed beside the unmerged kernel on the issue-11 table, then the GPU tests of the
# split-KV path (new: every merge case), then
# compute-sanitizer memcheck of the merged launches (the forward GPU tests follow in run 49).
# Ran on 31138ab + bench/results/2026-12-01-h200-session8/slice_merge/slice_merge.patch (measured, not merged: no gain).
set -u
. bench/device/cute_env.sh
t0=$(date +%s)
OUT=$OUT timeout 200 python3 bench/explore_decode.py --quick > "$OUT/explore_decode.log" 2>&1
echo "decode rc=$? ($(( $(date +%s) - t0 )) s)"; sed -n '/== summary/,$p' "$OUT/explore_decode.log" | cut -c1-200
grep -E "slice_merge|CuTeDSL split-KV, packed|default dispatch" "$OUT/explore_decode.log" | cut -c1-130
t0=$(date +%s)
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_splitkv_gpu.py > "$OUT/test_splitkv.log" 2>&1
echo "pytest splitkv rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_splitkv.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_splitkv.log" | head -8
t0=$(date +%s)
cat > /tmp/san.py <<'PY'
import torch
from ffpa_attn.cute import splitkv
from ffpa_attn.reference import attention
for merge in (2, 4):
    for (hkv, nq, nkv, s) in [(2, 4, 4096, 8), (2, 1, 777, 4)]:
        q = torch.randn(1, 32, nq, 512, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, hkv, nkv, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o, l = splitkv.forward(q, k, v, False, 512 ** -0.5, splits=s, slice_merge=merge)
        r, _ = attention(q, k, v, scale=512 ** -0.5)
        print("merge", merge, hkv, nq, nkv, s, "max err", (o.float() - r).abs().max().item(), flush=True)
print("sanitize call done")
PY
timeout 120 compute-sanitizer --tool memcheck python3 /tmp/san.py > "$OUT/sanitize.log" 2>&1
echo "sanitize rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|sanitize call done|Invalid|max err" "$OUT/sanitize.log" | head -8

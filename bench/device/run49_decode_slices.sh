#!/usr/bin/env bash
# Device run 49 (H200, warm after run4_stage.sh; carry .device-wheels/2 .device-tools): where the split-KV decode's
# time goes at issue 11's tight shapes and the combine as a programmatic dependent launch (the q_broadcast kernel
# triggers its dependents at its start; the combine waits with griddepcontrol.wait): PDL off / on A/B, the GPU tests
# of the split-KV path (new: the PDL test, eager + CUDA graph), compute-sanitizer memcheck, then the CuTeDSL
# forward GPU tests (the q_broadcast variant also serves the tail-split forward).
# Ran on 31138ab + bench/results/2026-12-01-h200-session8/pdl/pdl.patch (measured, not merged: no gain), with
# bench/explore_decode_slices.py as of 44928ab (its --pdl mode left with the patch).
set -u
. bench/device/cute_env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
t0=$(date +%s)
timeout 150 python3 bench/explore_decode_slices.py --pdl > "$OUT/explore_decode_pdl.log" 2>&1
echo "pdl rc=$? ($(( $(date +%s) - t0 )) s)"; grep -v "^$" "$OUT/explore_decode_pdl.log" | tail -32
t0=$(date +%s)
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_splitkv_gpu.py tests/gpu/test_decode_gpu.py \
  > "$OUT/test_splitkv.log" 2>&1
echo "pytest splitkv+decode rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_splitkv.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_splitkv.log" | head -8
t0=$(date +%s)
cat > /tmp/san.py <<'PY'
import torch
from ffpa_attn.cute import splitkv
from ffpa_attn.reference import attention
for (hkv, nq, nkv, s) in [(2, 4, 4096, 8), (2, 1, 777, 4)]:
    q = torch.randn(1, 32, nq, 512, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, hkv, nkv, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, l = splitkv.forward(q, k, v, False, 512 ** -0.5, splits=s)
    r, _ = attention(q, k, v, scale=512 ** -0.5)
    print(hkv, nq, nkv, s, "max err", (o.float() - r).abs().max().item(), flush=True)
print("sanitize call done")
PY
timeout 90 compute-sanitizer --tool memcheck python3 /tmp/san.py > "$OUT/sanitize.log" 2>&1
echo "sanitize rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|sanitize call done|Invalid|max err" "$OUT/sanitize.log" | head -6
t0=$(date +%s)
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cute_gpu.py -k "tail_split or test_forward" \
  > "$OUT/test_cute_fwd.log" 2>&1
echo "pytest fwd rc=$? ($(( $(date +%s) - t0 )) s)"; tail -n 2 "$OUT/test_cute_fwd.log"
grep -E "^(FAILED|ERROR)|Error" "$OUT/test_cute_fwd.log" | head -8

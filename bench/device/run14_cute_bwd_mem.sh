#!/usr/bin/env bash
# Device run 14 (H200, warm after the wheel-staging call; carry .device-wheels/2 .device-tools): after the
# CuTeDSL backward moved its delta = rowsum(dO*O) - dlse to the shared Triton pass (no fp32 copies of dO/O)
# and the implicit backward started preferring CuTeDSL: its GPU backward tests, then peak memory and time of
# the implicit default fwd+bwd (bf16, B=1, H=32, N=8192) at D=320/512 next to SDPA's.
set -u
export FFPA_ATTN_CACHE_DIR=/tmp/ffpa_cache PYTHONUNBUFFERED=1
cp .device-wheels/2/* /tmp/wheels/ 2>/dev/null
bash .device-tools/install_wheels.sh /tmp/wheels > /tmp/install.log 2>&1; echo "install rc=$?"
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
timeout 150 python3 -m pytest -q -x tests/gpu/test_cute_gpu.py -p no:cacheprovider \
  -k "backward and not other_dq_mode and not agree and not cluster" > "$OUT/test_cute_bwd_3.log" 2>&1
echo "pytest rc=$?"; tail -n 2 "$OUT/test_cute_bwd_3.log"
timeout 120 python3 - <<'PY' 2>&1 | tee "$OUT/mem.log"
import torch, torch.nn.functional as F, ffpa_attn
from ffpa_attn.testing import make_qkv
for d in (320, 512):
    for causal in (False, True):
        q, k, v = make_qkv(1, 32, 32, 8192, 8192, d, torch.bfloat16, device="cuda", requires_grad=True)
        do = torch.randn_like(q)
        res = {}
        for name, fn in (("ffpa default", lambda: ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal)),
                         ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
            fn().backward(do); torch.cuda.synchronize()
            q.grad = k.grad = v.grad = None
            torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
            fn().backward(do); torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            q.grad = k.grad = v.grad = None
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(3):
                fn().backward(do)
                q.grad = k.grad = v.grad = None
            e1.record(); torch.cuda.synchronize()
            res[name] = (peak, e0.elapsed_time(e1) / 3)
        plan = ffpa_attn.explain(q, k, v, is_causal=causal)
        print(f"D={d} causal={causal}: {plan.forward.backend}:{plan.forward.kernel} + {plan.backward.backend}:"
              f"{plan.backward.kernel}; peak fwd+bwd above inputs MiB: ffpa {res['ffpa default'][0]:.0f} vs sdpa "
              f"{res['sdpa'][0]:.0f}; fwd+bwd ms: ffpa {res['ffpa default'][1]:.2f} vs sdpa {res['sdpa'][1]:.2f}")
PY

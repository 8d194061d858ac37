"""CuTeDSL split-KV decode path (packed GQA rows x KV slices on the sm90a forward kernel) on an H200:
out and lse against the fp32 reference, through the module and through the public API's implicit choice.
Skipped without an sm90 GPU and nvidia-cutlass-dsl."""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn.reference import attention
from ffpa_attn.testing import assert_close, assert_lse_close, make_qkv, sm90_with_cutedsl

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_with_cutedsl(), reason="needs an sm90 GPU and nvidia-cutlass-dsl")]


@pytest.mark.parametrize("b,hq,hkv,nq,nkv,d,splits", [
    (1, 32, 8, 16, 32768, 512, None), (1, 32, 2, 4, 32768, 512, None), (1, 32, 2, 16, 8192, 512, None),
    (2, 16, 4, 5, 3001, 384, None),  # a tail slice, batch folded into heads
    (1, 8, 1, 3, 1000, 448, 7), (2, 8, 2, 1, 777, 512, 3), (1, 32, 8, 16, 4096, 320, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_splitkv_module(b, hq, hkv, nq, nkv, d, splits, dtype):
    """splits None: the planner's slice count on this GPU (the module takes the count, the planner owns it)."""
    from ffpa_attn.cutedsl import splitkv

    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    if splits is None:
        spec = ffpa_attn.explain(q, k, v, is_causal=nq == 1, enable_gqa=True, backend="cutedsl").forward.spec
        assert spec.name == "splitkv_fwd_sm90", str(spec)
        splits = spec.get("splits")
    out, lse = splitkv.forward(q, k, v, nq == 1, d ** -0.5, splits=splits)
    ref, ref_lse = attention(q, k, v, scale=d ** -0.5)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, atol=2e-3)


def test_splitkv_transposed_layout():
    from ffpa_attn.cutedsl import splitkv

    q, k, v = make_qkv(2, 16, 4, 8, 2048, 512, torch.bfloat16, device="cuda", layout="bnhd")
    out, lse = splitkv.forward(q, k, v, False, 0.05, splits=8)
    ref, ref_lse = attention(q, k, v, scale=0.05)
    assert_close(out, ref, torch.bfloat16)
    assert_lse_close(lse, ref_lse, atol=2e-3)


@pytest.mark.parametrize("hkv,nq,causal", [(8, 16, False), (2, 4, False), (1, 1, True), (8, 16, True)])
def test_public_api_decode(hkv, nq, causal):
    q, k, v = make_qkv(1, 32, hkv, nq, 16384, 512, torch.bfloat16, device="cuda")
    plan = ffpa_attn.explain(q, k, v, is_causal=causal, enable_gqa=True)
    want = "splitkv_fwd_sm90" if (not causal or nq == 1) else "splitkv_fwd"
    assert plan.forward.kernel == want, str(plan)
    out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=True)
    ref, _ = attention(q, k, v, is_causal=causal)
    assert_close(out, ref, torch.bfloat16)

"""The public package's low-level op names on a GPU (the shapes NeMo Automodel's ffpa binding sends: D = 512,
bf16, GQA, causal): dense through the planner's sm90 choice (CuTeDSL), varlen through its choice (the CuTeDSL
forward and backward),
each against the fp64 reference; plus torch.compile of a caller of ``_fwd_cute``.

    python -m pytest -q tests/gpu/test_compat_gpu.py
"""
import pytest
import torch

import ffpa_attn
from ffpa_attn.reference import attention
from ffpa_attn.testing import (assert_close, assert_grads_close, make_qkv, make_varlen_qkv, reference_fwd_bwd,
                               reference_varlen_fwd_bwd)

pytestmark = pytest.mark.gpu

OPS = torch.ops.ffpa_attn
WIN_NONE = -(2**31)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_ops_vs_reference(causal):
    from ffpa_attn.cute import _ffpa_attn_backward_cute, _ffpa_attn_forward_cute

    q, k, v = make_qkv(2, 8, 2, 1000, 1536, 512, torch.bfloat16, device="cuda", layout="bnhd")
    print(ffpa_attn.explain(q, k, v, is_causal=causal, enable_gqa=True))
    out, lse = _ffpa_attn_forward_cute(q, k, v, 0.05, causal)
    g = torch.randn_like(out)
    ref = reference_fwd_bwd(q, k, v, g, causal=causal, scale=0.05, dtype=torch.float64)
    assert_close(out, ref.out, torch.bfloat16)
    torch.testing.assert_close(lse.double(), ref.lse, atol=2e-2, rtol=1e-3)
    grads = _ffpa_attn_backward_cute(g, q, k, v, out, lse, 0.05, causal)
    assert_grads_close(grads, ref.grads, torch.bfloat16, tol=2e-2)


def test_varlen_ops_vs_reference():
    lens = [300, 0, 700]
    q, k, v, cu, _, mx, _ = make_varlen_qkv(lens, lens, 8, 2, 512, torch.bfloat16, "cuda", requires_grad=True)
    out, lse = OPS._varlen_fwd_cute(q, k, v, cu, cu, mx, mx, 0.05, True, WIN_NONE, WIN_NONE, 0.0, False)
    g = torch.randn_like(out)
    ref = reference_varlen_fwd_bwd(q, k, v, cu, cu, g, causal=True, scale=0.05, dtype=torch.float64)
    assert_close(out, ref.out, torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert_grads_close(grads, ref.grads, torch.bfloat16, tol=2e-2)


def test_compiled_caller_of_fwd_cute():
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_()
               for t in make_qkv(1, 8, 2, 1024, 1024, 512, torch.bfloat16, device="cuda"))

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        out, lse = OPS._fwd_cute(q, k, v, 0.05, 1, 1)
        return out * 2, lse

    out, _ = f(q, k, v)
    out.float().sum().backward()
    ref, _ = attention(*(t.detach().double().transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=0.05,
                       dtype=torch.float64)
    assert_close(out / 2, ref.transpose(1, 2), torch.bfloat16)
    assert torch.isfinite(q.grad).all()

"""GPU twins of tests/test_reliability.py (skipped without CUDA): finite-minimum float masks through every
Triton kernel (split-KV and split-D forward, backward, mask gradient), strided cu_seqlens, and varlen value
checks inside a compiled graph, on the compiled kernels rather than the interpreter.

    python -m pytest -q tests/gpu/test_reliability_gpu.py
"""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import TOL, assert_close, assert_results_close, cu_seqlens, func_fwd_bwd, reference_fwd_bwd

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nq,nkv,kernel", [(4, 4096, "splitkv"), (300, 300, "fwd")])
@pytest.mark.parametrize("d", [320, 512])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9])
def test_finite_minimum_masks(dtype, nq, nkv, kernel, d, fill):
    """Rows masked everywhere by a finite minimum are uniform (the mean of V), rows masked in part ignore
    those keys; forward, backward and the mask gradient against autograd through the fp32 reference."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, nq, d, device=DEV).to(dtype)
    k, v = (torch.randn(2, 2, nkv, d, device=DEV).to(dtype) for _ in range(2))
    do = torch.randn_like(q)
    m = torch.randn(2, 1, nq, nkv, device=DEV)
    m[:, :, 0] = fill
    m[:, :, 1, nkv // 3:] = fill
    pl = ffpa_attn.explain(q, k, v, attn_mask=m, enable_gqa=True, backend="triton")
    assert pl.forward.kernel.startswith(kernel), str(pl)
    ref = reference_fwd_bwd(q, k, v, do, mask=m)
    got = func_fwd_bwd(q, k, v, do, attn_mask=m, backend="triton")
    assert_results_close(got, ref, dtype, tol=2 * TOL[dtype])


def test_varlen_strided_boundaries_and_compiled_checks():
    torch.manual_seed(1)
    lens = [300, 0, 517]
    cu = cu_seqlens(lens, device=DEV)
    strided = torch.stack([cu, cu * 0 - 5], 1).reshape(-1)[::2]
    q, k, v = (torch.randn(817, 4, 384, device=DEV).to(torch.bfloat16) for _ in range(3))
    out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, strided, strided, max(lens), max(lens))
    ref, _ = reference.varlen_attention(q, k, v, cu, cu)
    assert_close(out, ref, torch.bfloat16)
    f = torch.compile(lambda *a: ffpa_attn.ffpa_attn_varlen_func(*a, 517, 64), fullgraph=True)
    with pytest.raises(ValueError, match="max_seqlen_k=64"):
        f(q, k, v, cu, cu)

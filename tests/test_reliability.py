"""Regression tests for inputs that used to give wrong answers or crashes: finite "large negative" masks,
strided boundaries, value checks under torch.compile, mask normalization, TMA alignment under the
interpreter, Python/numpy scalars, and the interpreter's bf16 output rounding.

Shapes are the smallest that reach each kernel (D=264 is the smallest FFPA head dim).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ffpa_attn import (
    TritonBackend,
    explain,
    ffpa_attn_func,
    ffpa_attn_fwd,
    ffpa_attn_varlen_func,
)
from ffpa_attn import reference
from ffpa_attn.testing import (assert_close, assert_results_close, func_fwd_bwd, make_varlen_qkv,
                               reference_fwd_bwd)

D = 264

# CPU tensors through the Triton interpreter (a CUDA host runs tests/gpu/test_reliability_gpu.py instead)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (CPU tensors)")


# ---------------------------------------------------------------------------------- finite-minimum masks


@pytest.mark.parametrize("nkv,kernel", [(256, "splitkv"), (32, "split-D")])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, torch.finfo(torch.bfloat16).min])
def test_finite_minimum_mask_rows_match_reference(nkv, kernel, fill):
    """A row masked everywhere by a finite minimum is uniform over its keys (SDPA's answer: the mean of V),
    in the forward and the backward; a row masked in part ignores those keys. Used to give NaN dK/dV
    (split-KV forward) or a zero row (split-D forward): the mask overflowed to -inf once scaled by log2 e."""
    torch.manual_seed(0)
    dt = torch.float16
    q = torch.randn(1, 1, 3, D, dtype=dt)
    k, v = torch.randn(1, 1, nkv, D, dtype=dt), torch.randn(1, 1, nkv, D, dtype=dt)
    do = torch.randn(1, 1, 3, D, dtype=dt)
    m = torch.zeros(3, nkv)
    m[0] = fill  # fully masked by a finite value
    m[1, : nkv // 2] = fill  # half masked
    pl = explain(q, k, v, attn_mask=m)
    assert (kernel == "splitkv") == pl.forward.kernel.startswith("splitkv"), str(pl)
    ref = reference_fwd_bwd(q, k, v, do, mask=m, mask_grad=False, dtype=torch.float64)
    got = func_fwd_bwd(q, k, v, do, attn_mask=m, mask_grad=False)
    assert_results_close(got, ref, dt)
    torch.testing.assert_close(got.out[0, 0, 0].float(), v[0, 0].float().mean(0), atol=2e-3, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_finite_minimum_mask_with_mask_grad(backend):
    """Same through a float mask that requires grad (dmask), on the Triton and the SDPA backends."""
    torch.manual_seed(1)
    dt = torch.bfloat16
    q = torch.randn(1, 2, 4, D, dtype=dt)
    k, v = torch.randn(1, 2, 48, D, dtype=dt), torch.randn(1, 2, 48, D, dtype=dt)
    do = torch.randn(1, 2, 4, D, dtype=dt)
    m = torch.randn(4, 48)
    m[0] = torch.finfo(torch.float32).min
    m[2, 5:] = torch.finfo(torch.float32).min
    ref = reference_fwd_bwd(q, k, v, do, mask=m, dtype=torch.float64)
    got = func_fwd_bwd(q, k, v, do, attn_mask=m, backend=backend)
    assert_results_close(got, ref, dt, tol={"dmask": 2e-2})  # dmask sums 16-bit P and dS over every query row


def test_minus_inf_rows_give_zero_and_minus_inf_lse():
    """-inf keeps meaning "no key": out 0 and lse -inf (unlike a finite minimum)."""
    q = torch.randn(1, 1, 2, D, dtype=torch.float16)
    k = v = torch.randn(1, 1, 32, D, dtype=torch.float16)
    m = torch.zeros(2, 32)
    m[0] = float("-inf")
    m[1] = torch.finfo(torch.float32).min
    out, lse = ffpa_attn_fwd(q, k, v, attn_mask=m)
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == float("-inf")
    assert torch.isfinite(lse[0, 0, 1]) and out[0, 0, 1].abs().sum() > 0


# ------------------------------------------------------------------------------------- varlen boundaries


def test_strided_cu_seqlens_read_by_value():
    """A non-contiguous cu_seqlens view means its values (it used to be read as if contiguous)."""
    torch.manual_seed(2)
    q, k, v, cu, *_ = make_varlen_qkv([4, 6], [4, 6], 2, 2, D, torch.float16)
    strided = torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32)[::2]
    assert not strided.is_contiguous()
    out = ffpa_attn_varlen_func(q, k, v, strided, strided, 6, 6)
    ref, _ = reference.varlen_attention(q, k, v, cu, cu)
    assert_close(out, ref, torch.float16)


def test_compiled_varlen_checks_max_seqlen():
    """Under torch.compile a max_seqlen shorter than a sequence raises like eager (it used to return rows
    the kernels never wrote)."""
    q, k, v, cu_q, cu_k, _, _ = make_varlen_qkv([3], [40], 2, 2, D, torch.float16)
    q.requires_grad_()
    k.requires_grad_()

    def f(q, k, v, cu_q, cu_k):
        return ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 8)

    with pytest.raises(ValueError, match="max_seqlen_k=8"):
        f(q, k, v, cu_q, cu_k)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="max_seqlen_k=8"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)


def test_compiled_varlen_matches_eager_with_empty_sequences():
    """The checked boundaries flow through a compiled graph unchanged (empty sequences included)."""
    torch.manual_seed(3)
    q, k, v, cu_q, cu_k, _, _ = make_varlen_qkv([2, 0, 3], [5, 4, 0], 2, 2, D, torch.float16)
    f = lambda *a: ffpa_attn_varlen_func(*a, 3, 5)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(got, f(q, k, v, cu_q, cu_k), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------ mask dtypes


@pytest.mark.parametrize("d", [128, D])
@pytest.mark.parametrize("kind", ["bool-1d", "float64", "bfloat16", "float32-2d"])
def test_masks_normalized_for_every_path(d, kind):
    """1-D and low-rank masks, and float masks of another dtype than q, are accepted on the SDPA fallback
    (D=128) like on the Triton path (it used to raise IndexError / "Expected attn_mask dtype")."""
    torch.manual_seed(4)
    q = torch.randn(1, 2, 3, d, dtype=torch.float16)
    k, v = torch.randn(1, 2, 5, d, dtype=torch.float16), torch.randn(1, 2, 5, d, dtype=torch.float16)
    m = {"bool-1d": torch.tensor([True, False, True, True, False]),
         "float64": torch.randn(3, 5, dtype=torch.float64),
         "bfloat16": torch.randn(3, 5).to(torch.bfloat16),
         "float32-2d": torch.randn(3, 5)}[kind]
    out = ffpa_attn_func(q, k, v, attn_mask=m)
    ref, _ = reference.attention(q, k, v, attn_mask=m if m.dtype == torch.bool else m.double(),
                                 dtype=torch.float64)
    assert_close(out, ref, torch.float16)


def test_float64_mask_keeps_finite_minimum_finite():
    """A float64 mask below float32's range stays a finite minimum (uniform row), not -inf (zero row)."""
    q = torch.randn(1, 1, 1, D, dtype=torch.float16)
    k = v = torch.randn(1, 1, 16, D, dtype=torch.float16)
    m = torch.full((1, 16), -1e300, dtype=torch.float64)
    out = ffpa_attn_func(q, k, v, attn_mask=m)
    torch.testing.assert_close(out[0, 0, 0].float(), v[0, 0].float().mean(0), atol=2e-3, rtol=0)


# ------------------------------------------------------------------------------------------------- TMA


@pytest.mark.parametrize("case", ["D300", "strided"])
def test_tma_requested_falls_back_on_unaligned_rows(case):
    """enable_tma=True with rows that tensor descriptors cannot address runs the pointer path under the
    interpreter, like on a GPU (it used to raise "strides must be 16-byte aligned")."""
    torch.manual_seed(5)
    if case == "D300":
        q, k, v = (torch.randn(1, 1, 8, 300, dtype=torch.float16) for _ in range(3))
    else:
        q, k, v = (torch.randn(1, 1, 8, 2 * D, dtype=torch.float16)[..., ::2] for _ in range(3))
    do = torch.randn_like(q)
    ref = reference_fwd_bwd(q, k, v, do, dtype=torch.float64)
    got = func_fwd_bwd(q, k, v, do, backend=TritonBackend(enable_tma=True))
    assert_results_close(got, ref, torch.float16)


# --------------------------------------------------------------------------------------------- scalars


def test_numpy_scalars_accepted_like_sdpa():
    """np.float32 scale / dropout_p and np.int64 lengths are numbers (SDPA accepts them)."""
    torch.manual_seed(6)
    q = torch.randn(1, 1, 4, D, dtype=torch.float16)
    a = ffpa_attn_func(q, q, q, scale=np.float32(0.1), dropout_p=np.float32(0.0))
    b = ffpa_attn_func(q, q, q, scale=float(np.float32(0.1)))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    qv, kv, vv, cu, *_ = make_varlen_qkv([6], [6], 2, 2, D, torch.float16)
    a = ffpa_attn_varlen_func(qv, kv, vv, cu, cu, np.int64(6), np.int64(6), softmax_scale=np.float64(0.2))
    b = ffpa_attn_varlen_func(qv, kv, vv, cu, cu, 6, 6, softmax_scale=0.2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_zero_head_dim_follows_sdpa():
    """D=0: every score is 0, so the output is the mean of V (SDPA's answer); it used to divide by zero."""
    q = torch.randn(1, 1, 2, 0, dtype=torch.float16)
    v = torch.randn(1, 1, 3, 8, dtype=torch.float16)
    out = ffpa_attn_func(q, q.new_zeros(1, 1, 3, 0), v)
    torch.testing.assert_close(out, v.mean(2, keepdim=True).expand(1, 1, 2, 8), atol=1e-3, rtol=0)


# ------------------------------------------------------------------------------------ bf16 output rounding


def _truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (what the interpreter's cast does)."""
    bits = x.float().contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("nkv,kernel", [(256, "splitkv"), (40, "fwd")])
def test_bf16_outputs_round_to_nearest(nkv, kernel):
    """bf16 outputs are rounded to nearest, as on a GPU (the interpreter's cast truncated: every output of
    the split-D forward matched truncation, and split-KV outputs were biased towards zero by ~half an ulp)."""
    torch.manual_seed(7)
    q = torch.randn(1, 2, 4, D, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, nkv, D, dtype=torch.bfloat16), torch.randn(1, 2, nkv, D, dtype=torch.bfloat16)
    assert explain(q, k, v).forward.kernel.startswith(kernel)
    out = ffpa_attn_func(q, k, v).float()
    ref = reference.attention(q, k, v, dtype=torch.float64)[0].float()
    # truncation shrinks every magnitude (mean relative bias ~ -3e-3 in bf16); rounding to nearest does not
    bias = ((out.abs() - ref.abs()) / ref.abs().clamp_min(1e-3)).mean().item()
    assert abs(bias) < 1e-3, bias
    if kernel == "fwd":  # one rounding of an fp32 result: nearly every element is ref's nearest bf16
        rne = (out == ref.to(torch.bfloat16).float()).float().mean().item()
        trunc = (out == _truncate_bf16(ref).float()).float().mean().item()
        assert rne > 0.9 and rne > trunc + 0.2, (rne, trunc)

"""Mixed precision: every entry point under ``torch.autocast`` behaves like torch SDPA (docs/design.md, "Contract").

In an active fp16/bf16 region, floating inputs of another dtype (fp32; bf16 in an fp16 region) run in the region's
dtype, forward and backward, with fp32 gradients for fp32 leaves; lse stays fp32 and a float mask keeps its fp32
bias; outside a region fp32 on the FFPA path is a TypeError naming the fix. The kernels run under the Triton
interpreter on tiny shapes; the reference is the fp32 oracle on the inputs rounded to the region's dtype.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import (assert_close, assert_grads_close, make_qkv, make_varlen_qkv, reference_fwd_bwd,
                               reference_varlen_fwd_bwd)

BF16, FP16 = torch.bfloat16, torch.float16
OPS = torch.ops.ffpa_attn


def _amp(dtype=BF16):
    return torch.autocast("cpu", dtype=dtype)


def _leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _rounded(*tensors, dtype=BF16):
    """The tensors as the region runs them: rounded to its dtype."""
    return tuple(t.detach().to(dtype) for t in tensors)


def _check_dense(out, grads, q, k, v, dout, dtype, causal=False, mask=None):
    """``out`` and the gradients of fp32 leaves q/k/v against the fp32 oracle on inputs rounded to ``dtype``."""
    ref = reference_fwd_bwd(*_rounded(q, k, v, dtype=dtype), dout, mask=mask, causal=causal, mask_grad=False)
    assert out.dtype == dtype and all(g.dtype == torch.float32 for g in grads)
    assert_close(out, ref.out, dtype, "out")
    assert_grads_close(grads, ref.grads, dtype)


# ------------------------------------------------------------------------------------------- dense func


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_func_fp32_inputs_run_in_the_region_dtype(dtype):
    q, k, v = make_qkv(1, 2, 1, 12, 12, 320, torch.float32, requires_grad=True)
    dout = torch.randn(1, 2, 12, 320)
    with _amp(dtype):
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True)
        assert ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True).forward.backend == "triton"
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    _check_dense(out, grads, q, k, v, dout, dtype, causal=True)
    # exactly the explicit cast's call
    same = ffpa_attn.ffpa_attn_func(*(t.detach().to(dtype) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    assert torch.equal(out, same)


def test_rope_mix_and_bf16_in_fp16_region():
    """q/k fp32 (RoPE's fp32 cos/sin) with v in the region's dtype, and bf16 leaves in an fp16 region: all run
    in the region's dtype (as SDPA's inputs), each leaf gets a gradient of its own dtype."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float32)
    q, k = _leaves(q, k)
    v = v.to(BF16).requires_grad_()
    with _amp():
        out = ffpa_attn.ffpa_attn_func(q, k, v)
    out.float().sum().backward()
    assert out.dtype == BF16 and (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, BF16)
    qb, kb, vb = make_qkv(1, 2, 2, 8, 8, 320, BF16, requires_grad=True)
    dout = torch.randn(1, 2, 8, 320)
    with _amp(FP16):
        out = ffpa_attn.ffpa_attn_func(qb, kb, vb)
    grads = torch.autograd.grad(out, (qb, kb, vb), dout.to(FP16))
    ref = reference_fwd_bwd(*_rounded(qb, kb, vb, dtype=FP16), dout)
    assert out.dtype == FP16 and all(g.dtype == BF16 for g in grads)
    assert_close(out, ref.out, FP16)
    assert_grads_close(grads, ref.grads, BF16)  # fp16 gradients rounded to the bf16 leaves


def test_float_mask_keeps_its_fp32_bias():
    """A float mask is added in fp32 where the kernels add it: a per-row offset of 1000 (softmax-invariant) with
    +-1 variations survives, which a bf16 mask (spacing 8 at 1000) would destroy."""
    q, k, v = make_qkv(1, 2, 2, 8, 16, 320, torch.float32, requires_grad=True)
    mask = 1000.0 + torch.randn(1, 1, 8, 16)
    dout = torch.randn(1, 2, 8, 320)
    with _amp():
        out = ffpa_attn.ffpa_attn_func(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(BF16))
    _check_dense(out, grads, q, k, v, dout, BF16, mask=mask)


def test_decode_step_under_autocast():
    """A decode-shaped call (one query, a longer cache) runs the split-KV kernel, whose fp32 merge stays fp32."""
    q, k, v = make_qkv(1, 2, 1, 1, 256, 320, torch.float32)
    with _amp():
        plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True)
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True)
    assert "splitkv" in plan.forward.spec.name
    ref, _ = reference.attention(*_rounded(q, k, v), is_causal=True)
    assert out.dtype == BF16
    assert_close(out, ref, BF16)


def test_outside_autocast_fp32_is_a_type_error_naming_the_fix():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float32)
    for call in (lambda: ffpa_attn.ffpa_attn_func(q, k, v), lambda: ffpa_attn.ffpa_attn_fwd(q, k, v),
                 lambda: ffpa_attn.explain(q, k, v)):
        with pytest.raises(TypeError, match=r"\.to\(torch\.bfloat16\).*torch\.autocast"):
            call()
    with _amp():  # float64 is not cast by autocast (its own rule, SDPA's too): still the FFPA path's TypeError
        with pytest.raises(TypeError, match="float64"):
            ffpa_attn.ffpa_attn_func(q.double(), k.double(), v.double())


def test_memo_sees_the_dtype_after_the_cast():
    """The same fp32 call signature in and out of a region: the memoized plan never crosses over."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float32)
    for _ in range(2):
        with _amp():
            assert ffpa_attn.ffpa_attn_func(q, k, v).dtype == BF16
        with pytest.raises(TypeError, match="float32"):
            ffpa_attn.ffpa_attn_func(q, k, v)


@settings(max_examples=25, deadline=None)
@given(src=st.sampled_from(["float32", "bfloat16", "float16", "rope"]),
       region=st.sampled_from([None, "bfloat16", "float16"]))
def test_dtypes_follow_sdpa(src, region):
    """The dtype a call runs in is the one torch SDPA runs in under the same region (SDPA backend: cheap)."""
    q, k, v = make_qkv(1, 2, 2, 6, 6, 320, torch.float32)
    if src == "rope":
        if region is None:
            return  # mixed dtypes outside a region are a ValueError (SDPA's a RuntimeError)
        v = v.to(BF16)
    else:
        q, k, v = (t.to(getattr(torch, src)) for t in (q, k, v))
    ctx = torch.autocast("cpu", dtype=getattr(torch, region)) if region else torch.autocast("cpu", enabled=False)
    with ctx:
        want = F.scaled_dot_product_attention(q, k, v)
        got = ffpa_attn.ffpa_attn_func(q, k, v, backend="sdpa")
    assert got.dtype == want.dtype
    assert_close(got, want.float(), got.dtype if got.dtype != torch.float32 else torch.float32, tol=1e-2)


# ------------------------------------------------------------------------------------------ low level


def test_low_level_dense_fwd_bwd():
    """fwd: q/k/v cast, lse fp32 (exact: the ops run with autocast off, so the SDPA module's fp32 score matmul is
    not downcast); bwd: dout/out cast like q, lse stays fp32, gradients in the region's dtype."""
    q, k, v = make_qkv(1, 4, 2, 10, 10, 320, torch.float32)
    with _amp():
        out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
    dout = torch.randn(1, 4, 10, 320)
    ref = reference_fwd_bwd(*_rounded(q, k, v), dout.to(BF16), causal=True)
    assert (out.dtype, lse.dtype) == (BF16, torch.float32)
    assert_close(out, ref.out, BF16)
    assert_close(lse, ref.lse, torch.float32, "lse", tol=1e-5)
    with _amp():
        grads = ffpa_attn.ffpa_attn_bwd(dout, q, k, v, out.float(), lse, causal=True, enable_gqa=True)
    assert all(g.dtype == BF16 for g in grads)
    assert_grads_close(grads, ref.grads, BF16)


def test_varlen_func_and_low_level():
    q, k, v, cu, _, _, _ = make_varlen_qkv([5, 7], [5, 7], 2, 1, 320, torch.float32, requires_grad=True)
    dout = torch.randn(12, 2, 320)
    with _amp():
        out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, enable_gqa=True)
        assert ffpa_attn.explain_varlen(q, k, v, cu, cu, 7, 7, causal=True, enable_gqa=True).forward.backend \
            == "triton"
    grads = torch.autograd.grad(out, (q, k, v), dout.to(BF16))
    ref = reference_varlen_fwd_bwd(*_rounded(q, k, v), cu, cu, dout.to(BF16), causal=True)
    assert out.dtype == BF16 and all(g.dtype == torch.float32 for g in grads)
    assert_close(out, ref.out, BF16)
    assert_grads_close(grads, ref.grads, BF16)
    with _amp():
        o, lse = ffpa_attn.ffpa_attn_varlen_fwd(q.detach(), k.detach(), v.detach(), cu, cu, 7, 7, causal=True,
                                                enable_gqa=True)
        low = ffpa_attn.ffpa_attn_varlen_bwd(dout, q.detach(), k.detach(), v.detach(), o.float(), lse, cu, cu, 7, 7,
                                             causal=True, enable_gqa=True)
    assert (o.dtype, lse.dtype) == (BF16, torch.float32)
    assert_close(lse, ref.lse, torch.float32, "lse", tol=1e-4)
    assert all(g.dtype == BF16 for g in low)
    assert_grads_close(low, ref.grads, BF16)


# ------------------------------------------------------------------------------------------ torch.compile


def test_compile_fullgraph_with_autocast_inside():
    q, k, v = make_qkv(1, 2, 1, 8, 8, 320, torch.float32, requires_grad=True)
    dout = torch.randn(1, 2, 8, 320)

    def f(q, k, v):
        with torch.autocast("cpu", dtype=BF16):
            return ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(BF16))
    _check_dense(out, grads, q, k, v, dout, BF16, causal=True)


# ------------------------------------------------------------------------------------------ compat ops


def test_compat_ops_under_autocast():
    """NeMo's binding calls the compatibility ops directly: they cast like SDPA (flash layout [B, N, H, D])."""
    scale = 320 ** -0.5  # the oracle's default
    q, k, v = _leaves(*(t.transpose(1, 2).contiguous() for t in make_qkv(1, 2, 1, 8, 8, 320, torch.float32)))
    dout = torch.randn(1, 8, 2, 320)
    with _amp():
        o, lse = OPS._fwd_cute(q, k, v, scale, 1, 1)
    assert (o.dtype, lse.dtype) == (BF16, torch.float32)
    grads = torch.autograd.grad(o, (q, k, v), dout.to(BF16))
    ref = reference_fwd_bwd(*(t.transpose(1, 2) for t in _rounded(q, k, v, dout)), causal=True)
    assert_close(o.transpose(1, 2), ref.out, BF16)
    assert_close(lse, ref.lse, torch.float32, "lse", tol=1e-4)
    assert all(g.dtype == torch.float32 for g in grads)
    assert_grads_close([g.transpose(1, 2) for g in grads], ref.grads, BF16)
    with _amp():
        low = OPS._bwd_cute(dout, q.detach(), k.detach(), v.detach(), o.float(), lse, scale, 1, 0)
    assert all(g.dtype == BF16 for g in low)
    assert_grads_close([g.transpose(1, 2) for g in low], ref.grads, BF16)


def test_compat_varlen_ops_under_autocast():
    from ffpa_attn.compat import WINDOW_NONE

    q, k, v, cu, _, _, _ = make_varlen_qkv([3, 6], [3, 6], 2, 2, 320, torch.float32, requires_grad=True)
    with _amp():
        o, lse = OPS._varlen_fwd_cute(q, k, v, cu, cu, 6, 6, 0.05, True, WINDOW_NONE, WINDOW_NONE, 0.0, False)
    assert (o.dtype, lse.dtype) == (BF16, torch.float32)
    dout = torch.randn(9, 2, 320)
    grads = torch.autograd.grad(o, (q, k, v), dout.to(BF16))
    ref = reference_varlen_fwd_bwd(*_rounded(q, k, v), cu, cu, dout.to(BF16), causal=True, scale=0.05)
    assert_close(o, ref.out, BF16)
    assert_close(lse, ref.lse, torch.float32, "lse", tol=1e-4)
    assert all(g.dtype == torch.float32 for g in grads)
    assert_grads_close(grads, ref.grads, BF16)
    with _amp():
        low = OPS._varlen_bwd_cute(q.detach(), k.detach(), v.detach(), o.float(), dout, lse, cu, cu, 6, 6, 0.05,
                                   True, WINDOW_NONE, WINDOW_NONE, 0.0, None)
    assert all(g.dtype == BF16 for g in low)
    assert_grads_close(low, ref.grads, BF16)


# ------------------------------------------------------------------------------------------------ ring


@pytest.fixture(scope="module")
def group_of_one():
    """A gloo process group of this process alone, torn down after the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        yield dist.group.WORLD
        dist.destroy_process_group()


def test_ring_casts_at_entry(group_of_one):
    from ffpa_attn.distributed import ring_attn_func, ring_attn_varlen_func

    q, k, v = make_qkv(1, 2, 1, 16, 16, 320, torch.float32, requires_grad=True)
    dout = torch.randn(1, 2, 16, 320)
    with _amp():
        out = ring_attn_func(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
    grads = torch.autograd.grad(out, (q, k, v), dout.to(BF16))
    _check_dense(out, grads, q, k, v, dout, BF16, causal=True)
    qv, kv, vv, cu, _, _, _ = make_varlen_qkv([6, 8], [6, 8], 2, 2, 320, torch.float32)
    with _amp():
        o = ring_attn_varlen_func(qv, kv, vv, cu, causal=True, layout="contiguous", backend="sdpa")
    ref, _ = reference.varlen_attention(*_rounded(qv, kv, vv), cu, causal=True)
    assert o.dtype == BF16
    assert_close(o, ref, BF16)

"""Compatibility entry points (:mod:`ffpa_attn.compat`): the public ffpa-attn package's low-level op names and
schemas, ``ffpa_attn.functional`` and the ``ffpa_attn.cute`` names.

opcheck runs with the planner on SDPA (TRITON_INTERPRET=0 for the call: the op boundary is the same for
every backend, and the interpreter would run each of opcheck's many calls); the correctness tests run on
the planner's CPU choice, the Triton kernels under the interpreter.
"""
import subprocess
import sys

import pytest
import torch

import ffpa_attn
from ffpa_attn.compat import WINDOW_NONE
from ffpa_attn.reference import attention, varlen_attention
from ffpa_attn.testing import assert_close, make_qkv

OPS = torch.ops.ffpa_attn

# the schemas of the public ffpa-attn 0.2.x package's ops (argument names, order and types)
UPSTREAM_SCHEMAS = {
    "_fwd_cute": "(Tensor q, Tensor k, Tensor v, float softmax_scale, int causal, int return_lse) -> "
                 "(Tensor o, Tensor lse)",
    "_bwd_cute": "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
                 "int causal, int grad_kv_storage_dtype_code) -> (Tensor dq, Tensor dk, Tensor dv)",
    "_varlen_fwd_cute": "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                        "int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
                        "int window_size_left, int window_size_right, float softcap, bool pack_gqa) -> "
                        "(Tensor out, Tensor lse)",
    "_varlen_bwd_cute": "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor cu_seqlens_q, "
                        "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
                        "bool causal, int window_size_left, int window_size_right, float softcap, Tensor? dlse) "
                        "-> (Tensor dq, Tensor dk, Tensor dv)",
}


@pytest.fixture
def on_sdpa(monkeypatch):
    """The planner picks SDPA on CPU while this is active (the Triton backend needs the interpreter flag).

    Triton and our Triton kernels are imported first: a ``@triton.jit`` function (triton.language's own
    included) decorated while the flag is off is compiled code that the interpreter cannot call later."""
    from ffpa_attn.ops import kernel_module

    kernel_module("triton")

    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _bnhd(b, hq, hkv, nq, nkv, d, dtype=torch.bfloat16, requires_grad=False):
    """Flash-layout q [B, Nq, Hq, D], k/v [B, Nkv, Hkv, D] (contiguous)."""
    return tuple(t.transpose(1, 2).contiguous().requires_grad_(requires_grad)
                 for t in make_qkv(b, hq, hkv, nq, nkv, d, dtype))


def _packed(lens_q, lens_k, hq, hkv, d, dtype=torch.bfloat16, requires_grad=False):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d).to(dtype).requires_grad_(requires_grad)
    k = torch.randn(int(cu_k[-1]), hkv, d).to(dtype).requires_grad_(requires_grad)
    v = torch.randn(int(cu_k[-1]), hkv, d).to(dtype).requires_grad_(requires_grad)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_schemas_match_the_public_package():
    for name, schema in UPSTREAM_SCHEMAS.items():
        assert str(getattr(OPS, name).default._schema) == f"ffpa_attn::{name}{schema}"


def test_functional_reexports():
    from ffpa_attn.functional import (Backend, CUDABackend, CuTeDSLBackend, SDPABackend,  # noqa: F401
                                      TritonBackend, ffpa_attn_func, ffpa_attn_varlen_func)
    import ffpa_attn.functional as functional

    for name in functional.__all__:
        assert getattr(functional, name) is getattr(ffpa_attn, name)
    assert CuTeDSLBackend is ffpa_attn.CuTeDSLBackend and ffpa_attn_func is ffpa_attn.ffpa_attn_func


def test_cute_names_import_no_kernel_code():
    """``from ffpa_attn.cute import _ffpa_attn_forward_cute`` works and imports no cutlass (fresh process); the kernel
    package ``ffpa_attn.cutedsl`` does not carry the public package's names."""
    code = ("import sys; from ffpa_attn.cute import _ffpa_attn_forward_cute, _ffpa_attn_backward_cute; "
            "import ffpa_attn.compat as c; assert _ffpa_attn_forward_cute is c._ffpa_attn_forward_cute; "
            "assert 'cutlass' not in sys.modules, 'cutlass imported'; import torch; "
            "assert hasattr(torch.ops.ffpa_attn, '_varlen_bwd_cute')")
    subprocess.run([sys.executable, "-c", code], check=True)
    import ffpa_attn.cutedsl

    assert not hasattr(ffpa_attn.cutedsl, "_ffpa_attn_forward_cute")


def test_opcheck_dense(on_sdpa):
    q, k, v = _bnhd(1, 4, 2, 6, 10, 264, requires_grad=True)
    torch.library.opcheck(OPS._fwd_cute, (q, k, v, 0.1, 1, 1))
    torch.library.opcheck(OPS._fwd_cute, (q, k, v, 0.1, 0, 0))
    out, lse = OPS._fwd_cute(q.detach(), k.detach(), v.detach(), 0.1, 1, 1)
    torch.library.opcheck(OPS._bwd_cute, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                          0.1, 1, 0))


def test_opcheck_varlen(on_sdpa):
    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 5], [4, 6], 2, 1, 264, requires_grad=True)
    args = (q, k, v, cu_q, cu_k, mq, mk, 0.07, True, WINDOW_NONE, WINDOW_NONE, 0.0, False)
    torch.library.opcheck(OPS._varlen_fwd_cute, args)
    out, lse = OPS._varlen_fwd_cute(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(OPS._varlen_bwd_cute, (qd, kd, vd, out, torch.randn_like(out), lse, cu_q, cu_k, mq,
                                                     mk, 0.07, True, -1, -1, 0.0, dlse))


def test_dense_forward_backward_vs_reference():
    """SDPA-layout entry points on the planner's CPU backend (Triton, interpreter): GQA, causal Nq < Nkv."""
    from ffpa_attn.cute import _ffpa_attn_backward_cute, _ffpa_attn_forward_cute

    q, k, v = make_qkv(1, 4, 2, 8, 16, 264, torch.float16)
    out, lse = _ffpa_attn_forward_cute(q, k, v, 0.1, True)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = attention(qr, kr, vr, is_causal=True, scale=0.1, dtype=torch.float64)
    assert out.shape == q.shape and lse.shape == (1, 4, 8) and lse.dtype == torch.float32
    assert_close(out, ro, torch.float16)
    torch.testing.assert_close(lse.double(), rl.detach(), atol=1e-3, rtol=1e-3)
    g = torch.randn_like(out)
    grads = _ffpa_attn_backward_cute(g, q, k, v, out, lse, 0.1, True)
    ref = torch.autograd.grad(ro, (qr, kr, vr), g.double())
    for name, a, b in zip("qkv", grads, ref):
        assert a.shape == b.shape
        assert_close(a, b, torch.float16, name=f"d{name}", tol=1e-2)


def test_dense_autograd_and_compile(on_sdpa):
    """``_fwd_cute`` is differentiable through o and lse, also under torch.compile(fullgraph=True)."""
    q, k, v = _bnhd(1, 2, 1, 6, 9, 272, torch.float16, requires_grad=True)

    def f(q, k, v):
        return OPS._fwd_cute(q, k, v, 0.2, 1, 1)

    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        out, lse = fn(q, k, v)
        g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
        grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
        qr, kr, vr = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ro, rl = attention(qr, kr, vr, is_causal=True, scale=0.2, dtype=torch.float64)
        ref = torch.autograd.grad((ro, rl), (qr, kr, vr), (g_out.double().transpose(1, 2), g_lse.double()))
        assert_close(out, ro.transpose(1, 2), torch.float16)
        for name, a, b in zip("qkv", grads, ref):
            assert_close(a, b.transpose(1, 2), torch.float16, name=f"d{name}", tol=1e-2)


def test_dense_rows_without_keys():
    q, k, v = _bnhd(1, 2, 2, 4, 0, 264)
    out, lse = OPS._fwd_cute(q, k, v, 0.1, 0, 1)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)) and lse.shape == (1, 2, 4)


def test_varlen_forward_backward_vs_reference():
    """Packed ops on the planner's CPU backend (Triton, interpreter): GQA, a sequence with no keys (lse -inf;
    a ring's cross chunk), the caller's dlse, and the autograd formula of ``_varlen_fwd_cute``."""
    q, k, v, cu_q, cu_k, mq, mk = _packed([2, 1, 3], [3, 0, 4], 2, 1, 264, torch.float16, requires_grad=True)
    out, lse = OPS._varlen_fwd_cute(q, k, v, cu_q, cu_k, mq, mk, 0.08, False, WINDOW_NONE, WINDOW_NONE, 0.0, True)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = varlen_attention(qr, kr, vr, cu_q, cu_k, softmax_scale=0.08, dtype=torch.float64)
    assert_close(out, ro, torch.float16)
    assert torch.all(torch.isneginf(lse[:, 2:3])) and torch.all(out[2:3] == 0)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    g_lse[:, 2:3] = 0
    ref = torch.autograd.grad((ro, rl), (qr, kr, vr), (g_out.double(), g_lse.double()))
    explicit = OPS._varlen_bwd_cute(q.detach(), k.detach(), v.detach(), out.detach(), g_out, lse.detach(), cu_q,
                                    cu_k, mq, mk, 0.08, False, -1, -1, 0.0, g_lse)
    through_autograd = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    for grads in (explicit, through_autograd):
        for name, a, b in zip("qkv", grads, ref):
            assert_close(a, b, torch.float16, name=f"d{name}", tol=1e-2)


@pytest.mark.parametrize("window", [(WINDOW_NONE, WINDOW_NONE), (-1, -1), (WINDOW_NONE, -1)])
def test_varlen_no_window_spellings(window, on_sdpa):
    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 4], [3, 4], 2, 2, 264)
    out, _ = OPS._varlen_fwd_cute(q, k, v, cu_q, cu_k, mq, mk, 0.1, False, *window, 0.0, False)
    assert_close(out, varlen_attention(q, k, v, cu_q, cu_k, softmax_scale=0.1)[0], torch.bfloat16)


def test_unsupported_options_raise(on_sdpa):
    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 4], [3, 4], 2, 2, 264)
    for window, softcap, match in [((8, 0), 0.0, "window_size"), ((WINDOW_NONE, 0), 0.0, "window_size"),
                                   ((WINDOW_NONE, WINDOW_NONE), 30.0, "softcap")]:
        with pytest.raises(NotImplementedError, match=match):
            OPS._varlen_fwd_cute(q, k, v, cu_q, cu_k, mq, mk, 0.1, False, *window, softcap, False)
        with pytest.raises(NotImplementedError, match=match):
            OPS._varlen_bwd_cute(q, k, v, q, q, torch.zeros(2, 7), cu_q, cu_k, mq, mk, 0.1, False, *window,
                                 softcap, None)
    qd, kd, vd = _bnhd(1, 2, 2, 4, 4, 264)
    out, lse = OPS._fwd_cute(qd, kd, vd, 0.1, 0, 1)
    with pytest.raises(NotImplementedError, match="grad_kv_storage_dtype"):
        OPS._bwd_cute(out, qd, kd, vd, out, lse, 0.1, 0, 1)
    from ffpa_attn.cute import _ffpa_attn_backward_cute

    with pytest.raises(NotImplementedError, match="grad_kv_storage_dtype"):
        _ffpa_attn_backward_cute(out, qd, kd, vd, out, lse, 0.1, False, grad_kv_storage_dtype=torch.float32)


def test_activation_checkpointing(on_sdpa):
    """The forward ops recompute under torch.utils.checkpoint and give the same gradients."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, cu_q, cu_k, mq, mk = _packed([3, 4], [5, 4], 2, 1, 264, requires_grad=True)

    def f(q, k, v):
        out, lse = OPS._varlen_fwd_cute(q, k, v, cu_q, cu_k, mq, mk, 0.1, True, WINDOW_NONE, WINDOW_NONE, 0.0,
                                        False)
        dense, _ = OPS._fwd_cute(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.1, 0, 1)
        return out.float().sum() + lse.sum() + dense.float().square().sum()

    plain = torch.autograd.grad(f(q, k, v), (q, k, v))
    recomputed = torch.autograd.grad(checkpoint(f, q, k, v, use_reentrant=False), (q, k, v))
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b)


def test_compat_ops_can_be_left_unregistered():
    """FFPA_ATTN_COMPAT_OPS=0: a fresh process imports ffpa_attn without defining the public package's op names
    (so that package can be loaded beside ours); the default registers them."""
    import subprocess
    import sys

    code = ("import sys, torch, ffpa_attn; print('ffpa_attn.compat' in sys.modules, "
            "hasattr(torch.ops.ffpa_attn, '_fwd_cute'))")
    for flag, want in (("0", "False False"), ("1", "True True")):
        env = dict(__import__("os").environ, FFPA_ATTN_COMPAT_OPS=flag)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == want.split(), out.stdout + out.stderr

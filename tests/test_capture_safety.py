"""What a CUDA-graph capture records must not read tensor values on the host: every public path runs here, on CPU
(the Triton kernels under the interpreter), while ``torch.cuda.is_current_stream_capturing()`` says True and every
way of reading a tensor on the host (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool`` / ``int`` / ``float`` of a
tensor) and ``torch.cuda.synchronize`` raise. What runs there must still give the reference's answer: the
capture-time variants (no varlen value checks, the SDPA fallback's packed varlen with a block-diagonal mask, no
autotune benchmark) are checked against :mod:`ffpa_attn.reference`. The captures themselves (replays with new
values, every backend) are GPU tests: tests/gpu/test_cuda_graphs_gpu.py.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import TOL, assert_close, make_qkv, reference_grads, rel_err

D = 320  # inside the FFPA range: the Triton kernels run (the SDPA backend takes any D)
F16 = torch.float16
BACKENDS = ("triton", "sdpa", None)  # None: the implicit plan (Triton under the interpreter)
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def capture_pretence():
    """Inside: the current stream is "capturing", and reading a tensor on the host or synchronizing raises."""
    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} during a CUDA-graph capture (a host sync)")
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        mp.setattr(torch.cuda, "synchronize", forbidden("torch.cuda.synchronize"))
        for name in _HOST_READS:
            mp.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
        yield


def test_the_pretence_catches_host_reads():
    """The fixture itself: a read inside raises, the same read outside works (a test that cannot fail is none)."""
    t = torch.ones(2)
    for read in (lambda: t.tolist(), lambda: t.sum().item(), lambda: bool(t.sum()), lambda: t[0:1].cpu(),
                 lambda: int(t[0])):
        with capture_pretence(), pytest.raises(AssertionError, match="capture"):
            read()
        read()
    with capture_pretence():
        assert torch.cuda.is_current_stream_capturing()
        from ffpa_attn.common.device import is_capturing

        assert is_capturing()


def _kw(backend):
    return {} if backend is None else {"backend": backend}


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "implicit")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_forward_backward(backend, causal):
    q, k, v = make_qkv(1, 4, 2, 16, 24, D, F16, requires_grad=True)
    g = torch.randn(1, 4, 16, D, dtype=F16)
    with capture_pretence():
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=True, **_kw(backend))
        grads = _grads(out, (q, k, v), g)
    ref, _ = reference.attention(q, k, v, is_causal=causal)
    assert_close(out, ref, F16)
    for name, a, r in zip("qkv", grads, reference_grads(q, k, v, g, causal=causal)):
        assert_close(a, r, F16, f"d{name}")


@pytest.mark.parametrize("backend", ("triton", "sdpa"))
def test_dense_mask_and_dropout(backend):
    """A bool mask (with a row that sees no key) and dropout, which draws its seed on the device."""
    q, k, v = make_qkv(1, 2, 2, 8, 16, D, F16, requires_grad=True)
    mask = torch.rand(1, 1, 8, 16) > 0.3
    mask[..., 3, :] = False
    with capture_pretence():
        out = ffpa_attn.ffpa_attn_func(q, k, v, attn_mask=mask, backend=backend)
        out.sum().backward()
        torch.manual_seed(1)
        drop = ffpa_attn.ffpa_attn_func(q, k, v, dropout_p=0.3, backend=backend)
    ref, _ = reference.attention(q, k, v, attn_mask=mask)
    assert_close(out, ref, F16)
    assert torch.isfinite(q.grad).all() and torch.isfinite(drop).all()
    torch.manual_seed(1)  # the same draw outside the pretence: the same dropout mask
    assert torch.equal(drop, ffpa_attn.ffpa_attn_func(q, k, v, dropout_p=0.3, backend=backend))


@pytest.mark.parametrize("backend", ("triton", None), ids=lambda b: b or "implicit")
def test_decode_splitkv(backend):
    """A decode-sized call (one query row, many keys): the split-KV forward."""
    q, k, v = make_qkv(1, 4, 1, 1, 272, D, F16)
    assert "splitkv" in str(ffpa_attn.explain(q, k, v, enable_gqa=True, **_kw(backend)))
    with capture_pretence():
        out = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, **_kw(backend))
    assert_close(out, reference.attention(q, k, v)[0], F16)


def _packed(lens_q, lens_k, hq=4, hkv=2, requires_grad=True):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, hq, D).to(F16).requires_grad_(requires_grad)
    k = torch.randn(tk, hkv, D).to(F16).requires_grad_(requires_grad)
    v = torch.randn(tk, hkv, D).to(F16).requires_grad_(requires_grad)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "implicit")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_backward(backend, causal):
    """Sequences of different lengths (one without queries), cross lengths, GQA; no value check reads the
    boundaries, and the SDPA fallback runs the packed rows at once."""
    q, k, v, cu_q, cu_k, mq, mk = _packed([5, 0, 9, 3], [7, 2, 9, 4])
    with capture_pretence():
        out, lse = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, enable_gqa=True,
                                                   return_lse=True, **_kw(backend))
        g = torch.randn_like(out)
        grads = _grads(out, (q, k, v), g)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    assert_close(out, ref, F16)
    assert_close(lse, ref_lse, torch.float32, "lse", tol=1e-4)
    for name, a, r in zip("qkv", grads, _grads(ref, (q, k, v), g.float())):
        assert_close(a, r, F16, f"d{name}")


def test_varlen_dropout_on_sdpa():
    """Varlen dropout on the SDPA backend goes to torch SDPA itself, per sequence in eager calls; during a capture
    over the packed rows (the dropout draw then differs, the rows that see no key still give 0)."""
    q, k, v, cu_q, cu_k, mq, mk = _packed([5, 6], [7, 0])
    with capture_pretence():
        out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.2, enable_gqa=True,
                                              backend="sdpa")
        out.sum().backward()
    assert torch.isfinite(out).all() and out[:5].abs().sum() > 0
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))  # the second sequence has no keys
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("backend", ("triton", "sdpa"))
def test_low_level_entries(backend):
    q, k, v = make_qkv(1, 4, 2, 12, 12, D, F16)
    g = torch.randn(1, 4, 12, D, dtype=F16)
    qp, kp, vp, cu_q, cu_k, mq, mk = _packed([4, 8], [4, 8], requires_grad=False)
    with capture_pretence():
        out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend=backend)
        dq, dk, dv = ffpa_attn.ffpa_attn_bwd(g, q, k, v, out, lse, causal=True, enable_gqa=True, backend=backend)
        vout, vlse = ffpa_attn.ffpa_attn_varlen_fwd(qp, kp, vp, cu_q, cu_k, mq, mk, causal=True, enable_gqa=True,
                                                    backend=backend)
        vg = ffpa_attn.ffpa_attn_varlen_bwd(torch.ones_like(vout), qp, kp, vp, vout, vlse, cu_q, cu_k, mq, mk,
                                            causal=True, enable_gqa=True, backend=backend)
    ref, ref_lse = reference.attention(q, k, v, is_causal=True)
    assert_close(out, ref, F16)
    for name, a, r in zip("qkv", (dq, dk, dv), reference_grads(q, k, v, g, causal=True)):
        assert_close(a, r, F16, f"d{name}")
    assert_close(vout, reference.varlen_attention(qp, kp, vp, cu_q, cu_k, causal=True)[0], F16)
    assert all(torch.isfinite(t).all() for t in vg)


def test_compat_ops():
    """The public package's op names (flash layout), dense and varlen, forward and backward."""
    q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in make_qkv(1, 4, 2, 10, 10, D, F16))
    qp, kp, vp, cu_q, cu_k, mq, mk = _packed([3, 7], [3, 7])
    ops = torch.ops.ffpa_attn
    with capture_pretence():
        o, lse = ops._fwd_cute(q, k, v, D ** -0.5, 1, 1)
        o.sum().backward()
        dq, dk, dv = ops._bwd_cute(torch.ones_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse,
                                   D ** -0.5, 1, 0)
        vo, vl = ops._varlen_fwd_cute(qp, kp, vp, cu_q, cu_k, mq, mk, D ** -0.5, True, -1, -1, 0.0, False)
        vo.sum().backward()
        vg = ops._varlen_bwd_cute(qp.detach(), kp.detach(), vp.detach(), vo.detach(), torch.ones_like(vo), vl,
                                  cu_q, cu_k, mq, mk, D ** -0.5, True, -1, -1, 0.0, None)
    ref, _ = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    assert_close(o, ref.transpose(1, 2), F16)
    assert_close(dq, q.grad, F16, "dq")
    assert_close(vg[0], qp.grad, F16, "varlen dq")


def test_varlen_value_checks_skipped_only_while_capturing(monkeypatch):
    """Eager: a max_seqlen shorter than a sequence is a ValueError (the boundaries are read once); during a capture
    nothing is read (the caller's promise) and with FFPA_ATTN_VARLEN_VALUE_CHECKS=0 neither."""
    q, k, v, cu_q, cu_k, _, _ = _packed([5, 9], [5, 9], requires_grad=False)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 9, enable_gqa=True, backend="sdpa")
    with capture_pretence():
        ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, enable_gqa=True, backend="sdpa")
    monkeypatch.setenv("FFPA_ATTN_VARLEN_VALUE_CHECKS", "0")
    bad = torch.tensor([0, 5, 13], dtype=torch.int32)  # does not end at T_q = 14: unchecked, not an error
    ffpa_attn.ffpa_attn_varlen_func(q, k, v, bad, cu_k, 9, 9, enable_gqa=True, backend="sdpa")
    monkeypatch.setenv("FFPA_ATTN_VARLEN_VALUE_CHECKS", "1")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ffpa_attn.ffpa_attn_varlen_func(q, k, v, bad, cu_k, 9, 9, enable_gqa=True, backend="sdpa")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_varlen_capture_runs_the_eager_formula(causal):
    """The SDPA backend's varlen runs per sequence eagerly and packed with a block-diagonal mask in a capture: both
    compute out from fp32 scores, so they agree to fp32 summation order (a tenth of the dtype's tolerance, the
    GPU test's bound for replay vs eager); torch's fused SDPA in one of them would not (bf16: ~2e-3)."""
    bf16 = torch.bfloat16
    torch.manual_seed(0)
    lens = [48, 160, 96]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens), 4, D).to(bf16).requires_grad_()
    k, v = (torch.randn(sum(lens), 2, D).to(bf16).requires_grad_() for _ in range(2))
    g = torch.randn(sum(lens), 4, D).to(bf16)

    def run():
        out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, enable_gqa=True,
                                              backend="sdpa")
        return (out, *_grads(out, (q, k, v), g))

    eager = run()
    with capture_pretence():
        captured = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager):
        assert rel_err(a, b) <= TOL[bf16] / 10, f"{name}: capture vs eager {rel_err(a, b):.2e}"

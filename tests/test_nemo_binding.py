"""NeMo Automodel's ffpa binding, unmodified, runs our kernels: a stand-in that calls the package exactly the way
that binding and its context-parallel ring do (readiness probe, positional op calls with the public package's
argument order and sentinels, SDPA-layout dense calls, a logaddexp merge of two KV chunks, the backward of
each chunk from the merged out/lse), checked against the fp64 reference. Runs on the planner's CPU choice
(the Triton kernels under the interpreter).
"""
import torch

from ffpa_attn.reference import attention, varlen_attention
from ffpa_attn.testing import assert_close, make_qkv

WIN_NONE = -(2**31)  # the binding's "no window" sentinel for the varlen ops


# ---- the stand-in: the binding's calls, written against the public package's surface only

def binding_ready() -> bool:
    try:
        import ffpa_attn.cute  # noqa: F401

        for name in ("_fwd_cute", "_bwd_cute", "_varlen_fwd_cute", "_varlen_bwd_cute"):
            getattr(torch.ops.ffpa_attn, name)
        from ffpa_attn import ffpa_attn_func  # noqa: F401
        from ffpa_attn.functional import CuTeDSLBackend  # noqa: F401
        return True
    except Exception:
        return False


def dense_fwd(q, k, v, *, scale, causal):
    from ffpa_attn.cute import _ffpa_attn_forward_cute

    return _ffpa_attn_forward_cute(q, k, v, float(scale), bool(causal), return_lse=True)


def dense_bwd(grad_out, q, k, v, out, lse, *, scale, causal):
    from ffpa_attn.cute import _ffpa_attn_backward_cute

    return _ffpa_attn_backward_cute(grad_out, q, k, v, out, lse, float(scale), bool(causal))


def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal):
    return torch.ops.ffpa_attn._varlen_fwd_cute(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k,
                                                int(max_q), int(max_k), float(scale), bool(causal), WIN_NONE,
                                                WIN_NONE, 0.0, False)


def varlen_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, causal):
    return torch.ops.ffpa_attn._varlen_bwd_cute(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                                grad_out.contiguous(), lse.contiguous(), cu_q, cu_k, int(max_q),
                                                int(max_k), float(scale), bool(causal), WIN_NONE, WIN_NONE, 0.0,
                                                None)


def merge(out_acc, lse_acc, out_step, lse_step, packed=False):
    """The ring's -inf-safe online-softmax merge of one more KV chunk (dense: lse ``[B, H, N]`` next to out
    ``[B, H, N, D]``; packed: lse ``[H, T]`` next to out ``[T, H, D]``)."""
    lse = torch.logaddexp(lse_acc, lse_step)
    w = torch.exp(lse_step - lse).nan_to_num(nan=0.0)
    w = (w.transpose(0, 1) if packed else w).unsqueeze(-1)
    return torch.lerp(out_acc.float(), out_step.float(), w).to(out_acc.dtype), lse


# ---- the checks

def test_binding_readiness_probe():
    assert binding_ready()


def test_dense_ring_step():
    """Query shard 1 of 2 (global causal): the earlier KV chunk non-causal, its own chunk causal."""
    s, scale = 5, 0.09
    q, k, v = make_qkv(1, 4, 2, s, 2 * s, 264, torch.float16)
    chunks = [(k[:, :, :s], v[:, :, :s], False), (k[:, :, s:], v[:, :, s:], True)]
    out, lse = dense_fwd(q, *chunks[0][:2], scale=scale, causal=chunks[0][2])
    for kc, vc, causal in chunks[1:]:
        out, lse = merge(out, lse, *dense_fwd(q, kc, vc, scale=scale, causal=causal))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention(qr, kr, vr, is_causal=True, scale=scale, dtype=torch.float64)
    assert_close(out, ref, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-3, rtol=1e-3)

    g = torch.randn_like(out)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dks, dvs = [], []
    for kc, vc, causal in chunks:
        dq_c, dk_c, dv_c = dense_bwd(g, q, kc, vc, out, lse, scale=scale, causal=causal)
        dq += dq_c.float()
        dks.append(dk_c)
        dvs.append(dv_c)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), g.double())
    for name, a, b in zip("qkv", (dq, torch.cat(dks, 2), torch.cat(dvs, 2)), ref_grads):
        assert_close(a, b, torch.float16, name=f"d{name}", tol=1e-2)


def test_varlen_ring_step():
    """Two packed documents; document 2 has no tokens in the earlier KV chunk (its rows there: lse -inf)."""
    scale = 0.07
    lq, lk_prev = [3, 2], [3, 0]  # queries per document; their keys in the earlier chunk (own chunk: lq)
    hq, hkv, d = 2, 1, 264
    q = torch.randn(sum(lq), hq, d).half()
    k_prev, v_prev = (torch.randn(sum(lk_prev), hkv, d).half() for _ in range(2))
    k_own, v_own = (torch.randn(sum(lq), hkv, d).half() for _ in range(2))
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_prev = torch.tensor([0, 3, 3], dtype=torch.int32)
    chunks = [(k_prev, v_prev, cu_prev, 3, False), (k_own, v_own, cu_q, 3, True)]
    out, lse = varlen_fwd(q, k_prev, v_prev, cu_q, cu_prev, 3, 3, scale=scale, causal=False)
    assert torch.all(torch.isneginf(lse[:, 3:])) and torch.all(out[3:] == 0)
    out, lse = merge(out, lse, *varlen_fwd(q, k_own, v_own, cu_q, cu_q, 3, 3, scale=scale, causal=True),
                     packed=True)

    # reference: each document's queries against [its earlier keys, its own keys], tail-aligned causal
    k_all = torch.cat([k_prev[:3], k_own[:3], k_own[3:]])
    v_all = torch.cat([v_prev[:3], v_own[:3], v_own[3:]])
    cu_all = torch.tensor([0, 6, 8], dtype=torch.int32)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k_all, v_all))
    ref, ref_lse = varlen_attention(qr, kr, vr, cu_q, cu_all, causal=True, softmax_scale=scale, dtype=torch.float64)
    assert_close(out, ref, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-3, rtol=1e-3)

    g = torch.randn_like(out)
    dq = torch.zeros_like(q, dtype=torch.float32)
    grads_kv = []
    for kc, vc, cu_k, max_k, causal in chunks:
        dq_c, dk_c, dv_c = varlen_bwd(g, q, kc, vc, out, lse, cu_q, cu_k, 3, max_k, scale=scale, causal=causal)
        dq += dq_c.float()
        grads_kv.append((dk_c, dv_c))
    (dk_prev, dv_prev), (dk_own, dv_own) = grads_kv
    dk = torch.cat([dk_prev[:3], dk_own[:3], dk_own[3:]])
    dv = torch.cat([dv_prev[:3], dv_own[:3], dv_own[3:]])
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), g.double())
    for name, a, b in zip("qkv", (dq, dk, dv), ref_grads):
        assert_close(a, b, torch.float16, name=f"d{name}", tol=1e-2)

"""The oracle itself: checked against independent formulations (fp64 loops, torch SDPA math)."""
import math

import pytest
import torch
import torch.nn.functional as F

from ffpa_attn.contract import causal_mask, causal_offset, kv_head, reduce_to_shape
from ffpa_attn.common.lse import merge_partials
from ffpa_attn.reference import attention, varlen_attention
from ffpa_attn.testing import assert_close, rel_err


def _naive(q, k, v, bias=None, scale=None):
    """Row-by-row fp64 attention with explicit loops over heads (independent of reference.py)."""
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hq, nq, d, dtype=torch.float64)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = kv_head(h, hq, hkv)
            s = q[bi, h].double() @ k[bi, kh].double().T * scale
            if bias is not None:
                s = s + bias[bi, h].double()
            for r in range(nq):
                row = s[r]
                if torch.isinf(row).all():
                    continue
                lse[bi, h, r] = torch.logsumexp(row, 0)
                out[bi, h, r] = torch.softmax(row, 0) @ v[bi, kh].double()
    return out, lse


def test_causal_convention_is_tail_aligned():
    m = causal_mask(3, 5)
    assert causal_offset(3, 5) == 2
    assert m.tolist() == [[True, True, True, False, False],
                          [True, True, True, True, False],
                          [True, True, True, True, True]]


def test_kv_head_mapping():
    assert [kv_head(h, 8, 2) for h in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("nq,nkv", [(5, 9), (9, 9), (1, 7)])
def test_causal_gqa_against_naive(nq, nkv):
    q = torch.randn(2, 4, nq, 24)
    k = torch.randn(2, 2, nkv, 24)
    v = torch.randn(2, 2, nkv, 24)
    out, lse = attention(q, k, v, is_causal=True, dtype=torch.float64)
    bias = torch.zeros(nq, nkv).masked_fill(~causal_mask(nq, nkv), float("-inf")).expand(2, 4, nq, nkv)
    ref, ref_lse = _naive(q, k, v, bias)
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-12


def test_masks_and_fully_masked_rows():
    q, k, v = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    keep = torch.rand(1, 1, 6, 7) > 0.3
    keep[..., 2, :] = False  # a row that sees nothing
    out, lse = attention(q, k, v, attn_mask=keep, dtype=torch.float64)
    assert torch.all(out[:, :, 2] == 0) and torch.all(torch.isneginf(lse[:, :, 2]))
    bias = torch.zeros(1, 1, 6, 7).masked_fill(~keep, float("-inf")).expand(1, 2, 6, 7)
    ref, ref_lse = _naive(q, k, v, bias)
    assert rel_err(out, ref) < 1e-12
    fb = torch.randn(2, 1, 7)  # float bias broadcast [Hq, 1, Nkv] -> [1, Hq, Nq, Nkv]
    out2, _ = attention(q, k, v, attn_mask=fb, scale=0.3, dtype=torch.float64)
    ref2, _ = _naive(q, k, v, fb.expand(1, 2, 6, 7), scale=0.3)
    assert rel_err(out2, ref2) < 1e-12


def test_gradients_finite_with_empty_rows():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[1] = False
    out, lse = attention(q, k, v, attn_mask=keep, dtype=torch.float64)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[0, 0, 1] == 0)
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_matches_torch_sdpa_math():
    q, k, v = torch.randn(2, 3, 33, 40), torch.randn(2, 3, 47, 40), torch.randn(2, 3, 47, 40)
    m = torch.randn(2, 1, 33, 47)
    out, _ = attention(q, k, v, attn_mask=m, scale=0.2)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double(), scale=0.2)
    assert rel_err(out, ref) < 1e-5


def test_dropout_with_explicit_keep_mask():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    keep = torch.rand(1, 2, 8, 8) > 0.25
    out, lse = attention(q, k, v, dropout_p=0.25, dropout_keep=keep, dtype=torch.float64)
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4.0, -1)
    ref = (p * keep / 0.75) @ v.double()
    assert rel_err(out, ref) < 1e-12
    _, lse0 = attention(q, k, v, dtype=torch.float64)
    assert torch.equal(lse, lse0)  # lse is the softmax's, before dropout
    with pytest.raises(ValueError, match="dropout_keep"):
        attention(q, k, v, dropout_p=0.25)


def test_varlen_reference_per_sequence():
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 5, 6]
    cu_q = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11, 17], dtype=torch.int32)
    q, k, v = torch.randn(9, 4, 16), torch.randn(17, 2, 16), torch.randn(17, 2, 16)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=True, dtype=torch.float64)
    assert out.shape == (9, 4, 16) and lse.shape == (4, 9)
    for i in range(4):
        a, b = int(cu_q[i]), int(cu_q[i + 1])
        c, e = int(cu_k[i]), int(cu_k[i + 1])
        if a == b:
            continue
        o, l = attention(q[a:b].transpose(0, 1)[None], k[c:e].transpose(0, 1)[None], v[c:e].transpose(0, 1)[None],
                         is_causal=True, dtype=torch.float64)
        assert rel_err(out[a:b], o[0].transpose(0, 1)) < 1e-12
        assert rel_err(lse[:, a:b], l[0]) < 1e-12
    del lens_q, lens_k


def test_merge_partials_equals_attention_over_union():
    q = torch.randn(1, 2, 6, 16)
    k, v = torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    full, full_lse = attention(q, k, v, dtype=torch.float64)
    o1, l1 = attention(q, k[:, :, :4], v[:, :, :4], dtype=torch.float64)
    o2, l2 = attention(q, k[:, :, 4:], v[:, :, 4:], dtype=torch.float64)
    # a partial that saw nothing (-inf lse, zero out) must not change the result
    o3, l3 = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
    out, lse = merge_partials([o1, o2, o3], [l1, l2, l3])
    assert rel_err(out, full) < 1e-6 and rel_err(lse, full_lse) < 1e-6
    out_e, lse_e = merge_partials([o3, o3], [l3, l3])
    assert torch.all(out_e == 0) and torch.all(torch.isneginf(lse_e))


def test_reduce_to_shape():
    g = torch.randn(2, 3, 4, 5)
    assert torch.allclose(reduce_to_shape(g, (4, 5)), g.sum((0, 1)))
    assert torch.allclose(reduce_to_shape(g, (2, 1, 1, 5)), g.sum((1, 2), keepdim=True))
    assert torch.allclose(reduce_to_shape(g, (3, 1, 5)), g.sum(0).sum(1, keepdim=True))


def test_assert_close_catches_nan_and_errors():
    ref = torch.randn(10)
    with pytest.raises(AssertionError):
        assert_close(ref + 0.1 * ref.norm(), ref, torch.bfloat16)
    bad = ref.clone()
    bad[3] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(bad, ref, torch.bfloat16)


def test_sequence_without_keys():
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16)
    out, lse = attention(q, k, v)
    assert out.shape == (1, 2, 3, 16) and torch.all(out == 0) and torch.all(torch.isneginf(lse))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32)
    o, l = varlen_attention(torch.randn(5, 2, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16), cu_q, cu_k)
    assert torch.all(o[:2] == 0) and torch.all(torch.isneginf(l[:, :2])) and torch.isfinite(l[:, 2:]).all()


def test_sdpa_grad_errors_baseline():
    """torch SDPA's bf16 gradient error against the fp32 reference: small and finite; None when a row sees no key
    (SDPA's gradients are NaN there, no baseline)."""
    from ffpa_attn.testing import reference_grads, sdpa_grad_errors

    q, k, v = (torch.randn(1, 4, 16, 32, dtype=torch.bfloat16) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA 4/2
    dout = torch.randn_like(q)
    refs = reference_grads(q, k, v, dout, causal=True)
    assert refs[3] is None and refs[1].shape == k.shape and refs[0].dtype == torch.float32
    errs = sdpa_grad_errors(q, k, v, dout, refs, causal=True)
    assert errs is not None and len(errs) == 3 and all(0 < e < 2e-2 for e in errs)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    mask[..., 3, :] = False  # row 3 sees nothing
    assert sdpa_grad_errors(q, k, v, dout, refs, mask=mask) is None

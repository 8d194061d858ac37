"""CPU tests of the Triton split-D backward (interpreter): gradients against autograd through the fp32
reference, for every feature of the kernels, and no worse than 2x torch's own same-dtype SDPA backward on
the same inputs. Buffers the backward allocates come back NaN-poisoned (see ``poison``), so an element a
kernel forgets to write fails the comparison."""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn import TritonBackend
from ffpa_attn.interface import _draw_rng
from ffpa_attn.testing import (PoisonTorch, assert_grads_close, func_fwd_bwd, make_qkv, make_varlen_qkv,
                               reference_grads, reference_varlen_fwd_bwd, rel_err, sdpa_grad_errors)
from ffpa_attn.triton import bwd
from ffpa_attn.triton.bwd_config import (MIN_DOT_K, BwdPlan, DkdvConfig, DqConfig, chunk_width, default_plan,
                                         slice_groups)
from ffpa_attn.triton.dropout import dense_keep_mask

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(bwd, "torch", PoisonTorch())


# ------------------------------------------------------------------------------------------------ helpers


def _direct(q, k, v, do, *, causal=False, plan=None, cfg=None, mask=None, mask_grad=False, dlse=None):
    """dense_backward called directly with the reference's out/lse (tests forced plans)."""
    out, lse = reference.attention(q, k, v, attn_mask=mask, is_causal=causal)
    return bwd.dense_backward(do, q, k, v, out.to(q.dtype), lse.float(), dlse=dlse, attn_mask=mask,
                              mask_grad=mask_grad, dropout_p=0.0, rng=None, causal=causal,
                              scale=q.shape[-1] ** -0.5, config=cfg or TritonBackend(), plan=plan)


# ------------------------------------------------------------------------------------------------- plans


def test_slice_groups_are_powers_of_two_and_cover_d():
    assert slice_groups(320, 256) == [(0, 256, 1), (256, 64, 1)]
    assert slice_groups(640, 256) == [(0, 256, 2), (512, 128, 1)]
    assert slice_groups(512, 256) == [(0, 256, 2)]
    assert slice_groups(300, 256) == [(0, 256, 1), (256, 64, 1)]  # 44 columns, masked in a 64 slice
    assert slice_groups(320, 1024) == [(0, 512, 1)]
    # D = 8 mod 128: the 8 leftover columns get a 16-wide slice (tl.dot's minimum K for 16-bit operands)
    assert slice_groups(264, 128) == [(0, 128, 2), (256, 16, 1)]
    assert slice_groups(776, 256) == [(0, 256, 3), (768, 16, 1)]
    for d in (17, 64, 136, 257, 264, 320, 384, 392, 520, 640, 768, 776, 1000, 1024):
        for ds in (64, 128, 256, 512):
            groups = slice_groups(d, ds)
            assert all(w & (w - 1) == 0 and w >= MIN_DOT_K for _, w, _ in groups)
            end = max(s + w * c for s, w, c in groups)
            assert d <= end < d + max(w for _, w, _ in groups)
            assert [s for s, _, _ in groups] == sorted(s for s, _, _ in groups)


def test_chunk_width_never_straddles_a_slice():
    """BK divides every slice start of its group (the kernel skips its own slice by adding DS to a chunk
    offset), is at least MIN_DOT_K, and a narrow remainder slice still walks its outside columns in block_k
    chunks."""
    assert chunk_width(64, 256, 16) == 64  # D=264: remainder at 256, 16 wide
    assert chunk_width(64, 0, 128) == 64 and chunk_width(128, 0, 64) == 64
    assert chunk_width(64, 0, 16) == 16  # D <= 16-ish: one slice, no outside columns
    for d in range(16, 1025, 8):
        for ds in (64, 128, 256):
            for start, width, count in slice_groups(d, ds):
                bk = chunk_width(64, start, width)
                assert bk >= MIN_DOT_K
                assert all((start + i * width) % bk == 0 for i in range(count))


def test_default_plan_modes():
    assert default_plan(512, split=False).dq is None
    assert default_plan(512, split=True).dq is not None
    assert default_plan(64, split=True, on_gpu=True).dkdv.slice_d == 64  # clamped to D


# ------------------------------------------------------------------------------------------------- dense

DENSE_CASES = [
    # d, b, hq, hkv, nq, nkv, causal, dtype, split
    (320, 1, 2, 2, 80, 80, False, BF16, False),   # N tail (BM=32), 256+64 columns
    (512, 1, 2, 1, 48, 100, True, FP16, True),    # causal Nq < Nkv (tail-aligned), GQA, dQ kernel
    (1024, 1, 1, 1, 40, 72, False, BF16, False),  # widest head dim, cross-attention
    (300, 2, 1, 1, 33, 65, True, BF16, True),     # D not a multiple of 64, batch 2
    (384, 1, 4, 1, 20, 20, True, FP16, False),    # MQA (4 query heads on one KV head), causal square
    (64, 1, 2, 2, 50, 90, False, BF16, False),    # small D (the Triton range starts at 16)
]


@pytest.mark.parametrize("d,b,hq,hkv,nq,nkv,causal,dtype,split", DENSE_CASES)
def test_dense_grads(d, b, hq, hkv, nq, nkv, causal, dtype, split):
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype)
    do = torch.randn(b, hq, nq, d).to(dtype)
    refs = reference_grads(q, k, v, do, causal=causal)
    grads = func_fwd_bwd(q, k, v, do, is_causal=causal, backend=TritonBackend(split_launch=split)).grads
    assert grads[1].shape == k.shape and grads[0].dtype == dtype
    assert_grads_close(grads, refs, dtype, baselines=sdpa_grad_errors(q, k, v, do, refs, causal=causal),
                       strict=True)


FORCED = [
    # multi-slice dK/dV (128 + 128 + 64 remainder) held as halves, fused dQ atomics per half
    BwdPlan(DkdvConfig(32, 32, 64, 128, True, 4, 1)),
    # split launch with a 2-slice dQ kernel, non-square tiles, chunks wider than the remainder slice
    BwdPlan(DkdvConfig(32, 64, 128, 256, False, 4, 1), DqConfig(64, 32, 128, 256, 4, 1)),
    # tensor descriptors (the interpreter zero-fills past the sequence and D like TMA)
    BwdPlan(DkdvConfig(32, 32, 64, 128, True, 4, 1), tma=True),
    BwdPlan(DkdvConfig(32, 32, 64, 256, False, 4, 1), DqConfig(32, 32, 64, 128, 4, 1), tma=True),
]


@pytest.mark.parametrize("plan", FORCED, ids=lambda p: p.short())
@pytest.mark.parametrize("causal", [False, True])
def test_forced_plans(plan, causal):
    q, k, v = make_qkv(1, 2, 1, 40, 70, 320, BF16)
    do = torch.randn_like(q)
    dq, dk, dv, dm = _direct(q, k, v, do, causal=causal, plan=plan)
    assert dm is None
    refs = reference_grads(q, k, v, do, causal=causal)
    assert_grads_close((dq, dk, dv), refs, BF16, baselines=sdpa_grad_errors(q, k, v, do, refs, causal=causal),
                       strict=True)


# D = 8 mod 128 with the GPU slice widths: a 16-wide remainder slice holding 8 columns (masked past D) whose
# outside columns are walked in BK=64 chunks; fused dQ atomics and the split dQ kernel, pointers and
# descriptors, causal or a bool mask.
REMAINDER_PLANS = [
    BwdPlan(DkdvConfig(32, 32, 64, 128, False, 4, 1)),
    BwdPlan(DkdvConfig(32, 32, 64, 256, False, 4, 1), DqConfig(32, 32, 64, 128, 4, 1), tma=True),
]


@pytest.mark.parametrize("plan", REMAINDER_PLANS, ids=lambda p: p.short())
@pytest.mark.parametrize("d,causal", [(264, True), (392, False)])
def test_remainder_slice_narrower_than_a_chunk(d, causal, plan):
    q, k, v = make_qkv(1, 2, 1, 24, 40, d, BF16)
    do = torch.randn_like(q)
    mask = None if causal else torch.rand(1, 1, 24, 40) > 0.3
    dq, dk, dv, _ = _direct(q, k, v, do, causal=causal, plan=plan, mask=mask)
    refs = reference_grads(q, k, v, do, causal=causal, mask=mask)
    base = sdpa_grad_errors(q, k, v, do, refs, mask=mask, causal=causal)
    assert_grads_close((dq, dk, dv), refs, BF16, baselines=base, strict=True)


# ------------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("shape", [(2, 2, 24, 40), (1, 1, 24, 40), (40,), (2, 1, 1, 40), (1, 2, 24, 40)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_float_mask_grad(shape, deterministic):
    if deterministic and shape not in ((2, 2, 24, 40), (1, 1, 24, 40)):
        pytest.skip("one broadcast form suffices for the deterministic reduction")
    q, k, v = make_qkv(2, 2, 2, 24, 40, 320, BF16)
    do = torch.randn_like(q)
    mask = (torch.randn(shape) * 2).to(BF16)
    refs = reference_grads(q, k, v, do, mask=mask)
    grads = func_fwd_bwd(q, k, v, do, attn_mask=mask, backend=TritonBackend(deterministic=deterministic)).grads
    assert grads[3].shape == mask.shape and grads[3].dtype == mask.dtype
    assert_grads_close(grads, refs, BF16, baselines=sdpa_grad_errors(q, k, v, do, refs, mask=mask), strict=True)


def test_float_mask_grad_causal_with_neg_inf_row():
    """Causal + a float mask whose first row is all -inf: that row sees nothing -> zero grads, no NaN."""
    q, k, v = make_qkv(1, 2, 1, 24, 40, 384, FP16)
    do = torch.randn_like(q)
    mask = torch.randn(1, 2, 24, 40).to(FP16)
    mask[:, :, 0] = float("-inf")
    refs = reference_grads(q, k, v, do, mask=mask, causal=True)
    grads = func_fwd_bwd(q, k, v, do, attn_mask=mask, is_causal=True, backend="triton").grads
    assert_grads_close(grads, refs, FP16)
    assert torch.count_nonzero(grads[0][:, :, 0]) == 0
    assert torch.count_nonzero(grads[3][:, :, 0]) == 0


def test_bool_mask_with_fully_masked_rows():
    q, k, v = make_qkv(2, 2, 2, 30, 50, 320, BF16)
    do = torch.randn_like(q)
    mask = torch.rand(2, 1, 30, 50) > 0.3
    mask[:, :, 3] = False  # rows that see no key
    mask[1, :, 17] = False
    refs = reference_grads(q, k, v, do, mask=mask)
    grads = func_fwd_bwd(q, k, v, do, attn_mask=mask, backend="triton").grads
    assert_grads_close(grads, refs, BF16)
    assert torch.count_nonzero(grads[0][:, :, 3]) == 0 and torch.count_nonzero(grads[0][1, :, 17]) == 0


# ----------------------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("split,causal", [(False, True), (True, False)])
def test_dropout_grads_use_the_forward_keep_mask(split, causal):
    b, hq, hkv, nq, nkv, d, p = 1, 2, 1, 40, 56, 320, 0.3
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, BF16)
    do = torch.randn_like(q)
    torch.manual_seed(1234)
    grads = func_fwd_bwd(q, k, v, do, dropout_p=p, is_causal=causal,
                         backend=TritonBackend(split_launch=split)).grads
    torch.manual_seed(1234)
    keep = dense_keep_mask(_draw_rng(torch.device("cpu")), b, hq, nq, nkv, p)
    refs = reference_grads(q, k, v, do, causal=causal, dropout_p=p, keep=keep)
    assert_grads_close(grads, refs, BF16)
    # the mask matters: gradients without it are far off
    assert rel_err(grads[2], reference_grads(q, k, v, do, causal=causal)[2]) > 0.1


# ------------------------------------------------------------------------------------ layouts, lse, configs


def test_non_contiguous_inputs_and_dout():
    q, k, v = make_qkv(2, 2, 2, 36, 44, 320, FP16, layout="bnhd")
    assert not q.is_contiguous()
    do = torch.randn(2, 36, 2, 320).to(FP16).transpose(1, 2)
    refs = reference_grads(q, k, v, do)
    grads = func_fwd_bwd(q, k, v, do, backend="triton").grads
    assert_grads_close(grads, refs, FP16, baselines=sdpa_grad_errors(q, k, v, do, refs), strict=True)


def test_dlse_through_low_level_forward():
    """lse is differentiable: delta = rowsum(dO * O) - dlse."""
    q, k, v = make_qkv(1, 2, 1, 30, 50, 512, BF16)
    do = torch.randn_like(q)
    dl = 4 * torch.randn(1, 2, 30)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ffpa_attn.ffpa_attn_fwd(qs, ks, vs, causal=True, enable_gqa=True, backend="triton")
    ((out.float() * do.float()).sum() + (lse * dl).sum()).backward()
    refs = reference_grads(q, k, v, do, causal=True, dlse=dl)
    assert_grads_close((qs.grad, ks.grad, vs.grad), refs, BF16)
    # and the dlse term is not negligible here
    assert rel_err(qs.grad, reference_grads(q, k, v, do, causal=True)[0]) > 0.05


def test_deterministic_is_bitwise_reproducible():
    q, k, v = make_qkv(1, 2, 1, 40, 64, 320, BF16)
    do = torch.randn_like(q)
    mask = torch.randn(1, 1, 40, 64).to(BF16)  # broadcast over heads: reduced without atomics
    cfg = TritonBackend(deterministic=True)
    a = _direct(q, k, v, do, causal=True, cfg=cfg, mask=mask, mask_grad=True)
    b = _direct(q, k, v, do, causal=True, cfg=cfg, mask=mask, mask_grad=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    refs = reference_grads(q, k, v, do, causal=True, mask=mask)
    assert_grads_close(a, refs, BF16)


def test_torch_deterministic_algorithms_turn_deterministic_on(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) a default TritonBackend runs the split (atomic-free)
    backward with the deterministic mask-gradient reduction: the plan and config that reach the launcher
    say so, the gradients equal TritonBackend(deterministic=True)'s bit for bit and match the reference."""
    q, k, v = make_qkv(1, 2, 1, 40, 64, 320, BF16)
    do = torch.randn_like(q)
    mask = torch.randn(1, 1, 40, 64).to(BF16)
    seen = []
    real_run = bwd._run

    def spy(*a, **kw):
        seen.append((kw["cfg"].deterministic, kw["plan"].split))
        return real_run(*a, **kw)

    monkeypatch.setattr(bwd, "_run", spy)
    want = _direct(q, k, v, do, causal=True, cfg=TritonBackend(deterministic=True), mask=mask, mask_grad=True)
    assert seen == [(True, True)]
    seen.clear()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = _direct(q, k, v, do, causal=True, cfg=TritonBackend(), mask=mask, mask_grad=True)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert seen == [(True, True)]
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    assert_grads_close(got, reference_grads(q, k, v, do, causal=True, mask=mask), BF16)
    seen.clear()
    _direct(q, k, v, do, causal=True, cfg=TritonBackend(), mask=mask, mask_grad=True)  # flag off again
    assert seen == [(False, False)]


def test_grad_storage_dtypes():
    q, k, v = make_qkv(1, 2, 2, 40, 40, 320, BF16)
    do = torch.randn_like(q)
    refs = reference_grads(q, k, v, do)
    cfg = TritonBackend(split_launch=True, grad_q_storage_dtype=torch.float32, grad_kv_storage_dtype="float32")
    dq, dk, dv, _ = _direct(q, k, v, do, cfg=cfg)
    assert dq.dtype == dk.dtype == dv.dtype == BF16
    assert_grads_close((dq, dk, dv), refs, BF16)


def test_torch_compile_fullgraph_forward_backward():
    q, k, v = make_qkv(1, 2, 1, 32, 48, 320, BF16, requires_grad=True)
    do = torch.randn_like(q)

    def f(q, k, v):
        return ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="triton")

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    out.backward(do)
    refs = reference_grads(q, k, v, do, causal=True)
    assert_grads_close((q.grad, k.grad, v.grad), refs, BF16)


# ------------------------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize("causal,split,hq,hkv,dtype", [(True, False, 2, 1, BF16), (False, True, 2, 2, FP16)])
def test_varlen_grads(causal, split, hq, hkv, dtype):
    lq = [0, 1, 37, 20, 5]
    lk = [3, 1, 45, 20, 9] if causal else [4, 0, 30, 64, 2]
    q, k, v, cu_q, cu_k, _, _ = make_varlen_qkv(lq, lk, hq, hkv, 320, dtype)
    do = torch.randn_like(q)
    dl = torch.randn(hq, q.shape[0])
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ffpa_attn.ffpa_attn_varlen_func(qs, ks, vs, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                               enable_gqa=hq != hkv, return_lse=True,
                                               backend=TritonBackend(split_launch=split))
    ((out.float() * do.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dl).sum()).backward()
    refs = reference_varlen_fwd_bwd(q, k, v, cu_q, cu_k, do, causal=causal, dlse=dl).grads
    assert_grads_close((qs.grad, ks.grad, vs.grad), refs, dtype)
    # keys of a sequence with no queries get exactly zero gradient
    if not causal:
        assert torch.count_nonzero(ks.grad[:4]) == 0


def test_varlen_dropout_packed_counter():
    lq, lk, hq, p = [7, 0, 30], [12, 5, 30], 2, 0.25
    q, k, v, cu_q, cu_k, _, _ = make_varlen_qkv(lq, lk, hq, hq, 384, BF16)
    do = torch.randn_like(q)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(99)
    out = ffpa_attn.ffpa_attn_varlen_func(qs, ks, vs, cu_q, cu_k, max(lq), max(lk), dropout_p=p, causal=True,
                                          backend="triton")
    out.backward(do)
    torch.manual_seed(99)
    keep = dense_keep_mask(_draw_rng(torch.device("cpu")), 1, hq, sum(lq), sum(lk), p)[0]
    refs = reference_varlen_fwd_bwd(q, k, v, cu_q, cu_k, do, causal=True, dropout_p=p, keep=keep).grads
    assert_grads_close((qs.grad, ks.grad, vs.grad), refs, BF16)


def test_varlen_one_sequence_matches_dense():
    q, k, v = make_qkv(1, 2, 2, 33, 33, 320, BF16)
    do = torch.randn_like(q)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    dense = _direct(q, k, v, do, causal=True)
    ref_out, ref_lse = reference.attention(q, k, v, is_causal=True)
    th = lambda t: t[0].transpose(0, 1).contiguous()  # noqa: E731
    vg = bwd.varlen_backward(th(do), th(q), th(k), th(v), th(ref_out.to(BF16)), ref_lse[0].float(), cu, cu, 33,
                             33, dlse=None, dropout_p=0.0, rng=None, causal=True, scale=320 ** -0.5,
                             config=TritonBackend())
    for a, b_ in zip(dense[:3], vg):
        torch.testing.assert_close(th(a), b_, atol=0, rtol=0)


def test_plan_config_roundtrip():
    from ffpa_attn.triton.bwd_config import candidate_plans, config_to_plan, plan_to_config

    for d in (320, 512, 1024):
        for p in candidate_plans(d) + [default_plan(d, True), default_plan(d, False, on_gpu=False)]:
            c = plan_to_config(p)
            assert config_to_plan(type(c).from_dict(c.to_dict())) == p

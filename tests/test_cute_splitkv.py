"""The CuTeDSL split-KV decode path (ffpa_attn/cutedsl/splitkv.py) on CPU: the dispatch rule, the slicing and
row packing of the views handed to the forward kernel (the kernel itself replaced by the fp32 reference
applied to exactly those views), the tail slice, and the Triton combine of lse-weighted partials (interpreter).
The kernel runs on the H200 in tests/gpu/test_cute_gpu.py."""
import math

import pytest
import torch

import ffpa_attn
from ffpa_attn.common.combine import combine_partials
from ffpa_attn.cutedsl import splitkv
from ffpa_attn.dispatch.waves import splitkv_slices
from ffpa_attn.reference import attention
from ffpa_attn.testing import assert_close, assert_lse_close, make_qkv, pretend_gpu


@pytest.mark.parametrize("nq,nkv,causal,want", [
    (16, 32768, False, "splitkv_fwd_sm90"), (4, 32768, False, "splitkv_fwd_sm90"),
    (1, 32768, True, "splitkv_fwd_sm90"),  # Nq = 1: every key visible
    (1, 32768, False, "splitkv_fwd_sm90"), (16, 32768, True, "fwd_sm90"),  # rows see different prefixes
    (4096, 4096, False, "fwd_sm90")])  # prefill
def test_rule(monkeypatch, nq, nkv, causal, want):
    """Split-KV-sized calls whose rows all see the same keys go to the packed path, whatever the rows per KV head."""
    pretend_gpu(monkeypatch)
    q = torch.empty(1, 8, nq, 512, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, nkv, 512, dtype=torch.bfloat16, device="meta")
    assert ffpa_attn.explain(q, k, k, is_causal=causal, backend="cutedsl").forward.kernel == want


def test_plan_prefers_packed_path(monkeypatch):
    pretend_gpu(monkeypatch)
    for hkv, nq, causal, want in [(8, 16, False, ("cutedsl", "splitkv_fwd_sm90")),
                                  (8, 16, True, ("triton", "splitkv_fwd")),
                                  (32, 1, False, ("cutedsl", "splitkv_fwd_sm90"))]:
        q = torch.empty(1, 32, nq, 512, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, hkv, 4096, 512, dtype=torch.bfloat16, device="meta")
        plan = ffpa_attn.explain(q, k, k, is_causal=causal, enable_gqa=True)
        assert (plan.forward.backend, plan.forward.kernel) == want, str(plan)


def _reference_launch(calls):
    """Stand-in for api.launch_q_broadcast (as splitkv calls it): the fp32 reference on the same views, written
    into the same views (q has one batch entry serving every KV slice: the kernel's ``q_broadcast``)."""

    def launch(q, k, v, out, lse, scale, tile_n=None):
        calls.append((tuple(q.shape), tuple(k.shape)))
        assert q.shape[0] == 1
        o, l = attention(q.expand(k.shape[0], -1, -1, -1), k, v, scale=scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(l)

    return launch


@pytest.mark.parametrize("b,hq,hkv,nq,nkv,splits", [(1, 8, 2, 3, 200, 4), (2, 4, 1, 5, 203, 8), (1, 6, 3, 1, 97, 5),
                                                   (2, 4, 2, 2, 64, 1)])
def test_packed_splitkv_matches_reference(monkeypatch, b, hq, hkv, nq, nkv, splits):
    calls = []
    monkeypatch.setattr(splitkv, "launch_q_broadcast", _reference_launch(calls))
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, 64, torch.bfloat16)
    out, lse = splitkv.forward(q, k, v, nq == 1, 0.2, splits=splits)
    ref, ref_lse = attention(q, k, v, scale=0.2)
    assert_close(out, ref, out.dtype)
    assert_lse_close(lse, ref_lse, atol=1e-4)
    length = nkv // splits
    assert calls[0] == ((1, b * hkv, hq // hkv * nq, 64), (splits, b * hkv, length, 64))
    assert len(calls) == 1 + (nkv % splits > 0)


def test_packed_splitkv_non_foldable_batch_layout(monkeypatch):
    """k/v as transposed views of [B, N, H, D] with B > 1: the batch stride does not fold into the head
    stride, so K/V are copied once (still exact)."""
    monkeypatch.setattr(splitkv, "launch_q_broadcast", _reference_launch([]))
    q, k, v = make_qkv(2, 4, 2, 2, 150, 64, torch.bfloat16, layout="bnhd")
    assert not splitkv._foldable(k)
    out, lse = splitkv.forward(q, k, v, False, 0.125, splits=4)
    ref, ref_lse = attention(q, k, v, scale=0.125)
    assert_close(out, ref, out.dtype)
    assert_lse_close(lse, ref_lse, atol=1e-4)


def test_num_slices():
    assert splitkv_slices(1, 8, 64, 32768, 132) == 16  # 8 CTAs -> 16 slices of 2048 keys
    assert splitkv_slices(1, 2, 256, 32768, 132) == 16  # 2 x 4 row blocks
    assert splitkv_slices(1, 2, 64, 32768, 132) == 64  # 66 wanted, 64 divides Nkv
    assert splitkv_slices(1, 8, 64, 1000, 132) == 2  # >= 256 keys per slice: 3 wanted, 2 divides
    assert splitkv_slices(1, 8, 64, 1001, 132) == 3  # no divisor near: 3 slices + a tail call
    assert splitkv_slices(4, 32, 64, 32768, 132) == 1


def test_combine_partials_lse_weighted(device):
    """Partials of disjoint key slices (one of them empty: lse -inf) merge to the full attention."""
    b, hq, hkv, nq, d = 2, 4, 2, 3, 40
    group, rows = hq // hkv, hq // hkv * nq
    q, k, v = make_qkv(b, hq, hkv, nq, 90, d, torch.float16, device=device)
    bounds = [(0, 30), (30, 30), (30, 75), (75, 90)]
    part_o = torch.empty(b * hkv, len(bounds), rows, d, dtype=torch.float16, device=device)
    part_l = torch.empty(b * hkv, len(bounds), rows, dtype=torch.float32, device=device)
    for s, (lo, hi) in enumerate(bounds):
        if hi > lo:
            o, l = attention(q, k[:, :, lo:hi], v[:, :, lo:hi], scale=d ** -0.5)
        else:
            o = torch.zeros(b, hq, nq, d, device=device)
            l = torch.full((b, hq, nq), float("-inf"), device=device)
        part_o[:, s] = o.reshape(b * hkv, rows, d).to(torch.float16)
        part_l[:, s] = l.reshape(b * hkv, rows)
    out = torch.full((b, hq, nq, d), float("nan"), dtype=torch.float16, device=device)
    lse = torch.full((b, hq, nq), float("nan"), device=device)
    combine_partials(part_o, part_l, out, lse, hkv=hkv, group=group)
    ref, ref_lse = attention(q, k, v, scale=d ** -0.5)
    assert_close(out, ref, out.dtype)
    assert_lse_close(lse, ref_lse, atol=1e-4)
    assert math.isfinite(lse.sum().item())


def test_explicit_cutedsl_decode_explain(monkeypatch):
    pretend_gpu(monkeypatch)
    q, k, v = make_qkv(1, 32, 8, 16, 4096, 512, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, enable_gqa=True, backend="cutedsl")
    assert plan.forward.kernel == "splitkv_fwd_sm90"


@pytest.mark.parametrize("splits,error", [(None, TypeError), (2.0, TypeError), (0, ValueError), (65, ValueError)])
def test_module_requires_the_planners_slice_count(monkeypatch, splits, error):
    """The planner owns the slice count: the module computes none and names the argument when it is missing or out
    of range (Nkv = 64 keys here)."""
    monkeypatch.setattr(splitkv, "launch_q_broadcast", _reference_launch([]))
    q, k, v = make_qkv(1, 4, 2, 2, 64, 64, torch.bfloat16)
    with pytest.raises(error, match="splits"):
        splitkv.forward(q, k, v, False, 0.125, splits=splits)


def test_module_runs_the_planners_slice_count(monkeypatch):
    """The kernel module passes the spec's ``splits`` through: the views handed to the kernel have that many slices."""
    pretend_gpu(monkeypatch)
    calls = []
    monkeypatch.setattr(splitkv, "launch_q_broadcast", _reference_launch(calls))
    q, k, v = make_qkv(1, 8, 2, 4, 4096, 512, torch.bfloat16)
    spec = ffpa_attn.explain(q, k, v, enable_gqa=True, backend="cutedsl").forward.spec
    assert spec.name == "splitkv_fwd_sm90" and spec.get("splits") >= 1, str(spec)
    from ffpa_attn import cutedsl

    out, _ = cutedsl.dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=False, scale=0.05,
                                   config=None, kernel=spec)
    assert calls[0][1][0] == spec.get("splits")
    assert_close(out, attention(q, k, v, scale=0.05)[0], out.dtype)

"""The last-wave split: the planner's rule (ffpa_attn.dispatch.waves), and the split computation itself
(ffpa_attn.common.tail_split) on the CPU with the fp32 reference as the "kernel" of both launches, against the
reference over the whole problem."""
from __future__ import annotations

import pytest
import torch

from ffpa_attn import reference
from ffpa_attn.common.lse import merge_partials, merge_stacked
from ffpa_attn.common.tail_split import TailSplit, run_tail
from ffpa_attn.dispatch.waves import MIN_SLICES, divisor_near, plan_tail_split
from ffpa_attn.testing import make_qkv


def test_plan_h200_d512():
    # B=1 H=32 N=8192, 64-row blocks: 4096 CTAs = 31 waves of 132 + 4 -> the last 4 blocks of head 31 over
    # 32 slices (33 wanted, 32 divides 8192)
    s = plan_tail_split(1, 32, 8192, 8192, 64, 132, causal=False)
    assert s == TailSplit(main_ctas=4092, batch=0, head=31, row0=8192 - 4 * 64, slices=32, block_m=64)


@pytest.mark.parametrize("args,why", [
    ((1, 32, 8192, 8192, 64, 132), "causal"),
    ((1, 33, 8192, 8192, 64, 132), "no partial wave"),  # 33 * 128 = 4224 = 32 waves exactly
    ((1, 1, 4096, 4096, 64, 132), "one partial wave only"),
    ((2, 8, 8192, 8192, 64, 132), "2 * 8 * 128 = 2048 = 15 waves + 68: 132 // 68 = 1 slice"),
    ((1, 32, 8192, 1000, 64, 132), "no divisor of Nkv near the target"),
    ((1, 32, 8192, 512, 64, 132), "slices would be shorter than 256 keys"),
])
def test_plan_declines(args, why):
    assert plan_tail_split(*args, causal=why == "causal") is None, why


def test_plan_tail_spanning_heads_declines():
    # 7 heads x 3 blocks = 21 CTAs on 16 SMs: 1 wave + 5, and 5 tail blocks do not fit one head's 3
    assert plan_tail_split(1, 7, 192, 1024, 64, 16, causal=False, min_slice_keys=64) is None
    # the same tail inside one head (2 x 13 blocks = 26 = 16 + 10; 16 // 10 = 1 slice): declined for slices
    assert plan_tail_split(1, 2, 832, 1024, 64, 16, causal=False, min_slice_keys=64) is None
    # 1 x 9 blocks on 8 SMs: one full wave + 1 tail block over 8 slices of 72 keys
    assert plan_tail_split(1, 1, 576, 576, 64, 8, causal=False, min_slice_keys=64) == TailSplit(8, 0, 0, 512, 8, 64)


def test_a_split_checks_the_geometry_it_was_planned_for():
    """A kernel whose block rows or shape differ from the planner's would run the wrong rows: ValueError."""
    s = plan_tail_split(1, 32, 8192, 8192, 64, 132, causal=False)
    s.check(1, 32, 8192, 64)
    with pytest.raises(ValueError, match="kernel: tail split"):
        s.check(1, 32, 8192, 32)
    with pytest.raises(ValueError, match="kernel: tail split"):
        s.check(1, 16, 8192, 64)


def test_divisor_near():
    assert divisor_near(8192, 33) == 32
    assert divisor_near(1000, 33) == 25
    assert divisor_near(997, 33) is None  # prime


def test_merge_stacked_matches_merge_partials():
    o = torch.randn(5, 2, 7, 16)
    lse = torch.randn(5, 2, 7)
    lse[:, 0, 3] = float("-inf")  # a row no partial saw
    lse[2, 1, :] = float("-inf")  # one empty partial
    a_o, a_l = merge_stacked(o, lse)
    b_o, b_l = merge_partials(list(o), list(lse))
    assert torch.allclose(a_o, b_o, atol=1e-6) and torch.equal(torch.isinf(a_l), torch.isinf(b_l))
    assert torch.allclose(a_l[torch.isfinite(a_l)], b_l[torch.isfinite(b_l)])
    assert (a_o[0, 3] == 0).all() and a_l[0, 3] == float("-inf")


@pytest.mark.parametrize("hq,hkv,layout", [(4, 4, "bhnd"), (4, 2, "bnhd"), (6, 1, "bhnd")])
def test_split_computation_matches_reference(hq, hkv, layout):
    """Main launch = the reference on all rows (then the tail rows poisoned, as the kernel's exited CTAs leave
    them), tail launch = the reference on run_tail's views (stride-0 q repeat, K/V slices)."""
    b, nq, nkv, d = 2, 200, 384, 40
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, torch.float32, device="cpu", layout=layout)
    ref_o, ref_l = reference.attention(q, k, v, scale=0.3)
    split = plan_tail_split(b, hq, nq, nkv, 64, 8, causal=False, min_slice_keys=64)
    # 2 x hq x 4 blocks: 32 -> no tail for hq 4; use a rule-independent split for those
    split = split or TailSplit(main_ctas=0, batch=b - 1, head=hq - 1, row0=128, slices=MIN_SLICES, block_m=64)
    out, lse = ref_o.clone(), ref_l.clone()
    out[split.batch, split.head, split.row0:] = float("nan")
    lse[split.batch, split.head, split.row0:] = float("nan")
    calls = []

    def launch(qs, ks, vs):
        calls.append((qs.shape, ks.shape, qs.stride(0)))
        return reference.attention(qs, ks, vs, scale=0.3)

    run_tail(q, k, v, out, lse, split, launch)
    rows = nq - split.row0
    assert calls == [((split.slices, 1, rows, d), (split.slices, 1, nkv // split.slices, d), 0)]
    assert torch.allclose(out, ref_o, atol=1e-5) and torch.allclose(lse, ref_l, atol=1e-5)

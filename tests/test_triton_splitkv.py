"""Split-KV ("flash decoding") forward on the Triton interpreter: split + combine vs the fp32 reference.

Small shapes, but long enough KV (Nkv ~ 1100) with forced small slices that every call has many splits;
forced split counts that leave empty slices, causal with Nq > 1 (rows see different prefixes), GQA/MQA,
bool/float masks, Nq = 1, exact lse, and the dispatch rule that explain() reports.
"""
import math

import pytest
import torch

import ffpa_attn
from ffpa_attn.dispatch.heuristics import splitkv_sized
from ffpa_attn.contract import MASK_FLOOR
from ffpa_attn.reference import attention
from ffpa_attn.testing import assert_close, assert_fwd_bwd_close, make_qkv
from ffpa_attn.triton import splitkv
from ffpa_attn.triton.autotune import KernelConfig

BF16, FP16 = torch.bfloat16, torch.float16


def cfg(block_m=16, block_n=16, block_do=None, qk_chunk=None):
    opts = tuple((k, v) for k, v in (("block_do", block_do), ("qk_chunk", qk_chunk)) if v is not None)
    return KernelConfig(block_m, block_n, 4, 1, tuple(sorted(opts)))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors: an output or partial the kernels forget shows up."""
    orig = torch.empty

    def nan_empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)


def check(q, k, v, *, attn_mask=None, causal=False, scale=None, kcfg=None, splits=None):
    """Run splitkv_launch and compare out and lse with the fp32 reference; returns (out, lse, ref_lse)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = splitkv.splitkv_launch(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, cfg=kcfg,
                                     splits=splits)
    ref, ref_lse = attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows without a visible key must get lse = -inf"
    assert (out[empty] == 0).all(), "rows without a visible key must get out = 0"
    if (~empty).any():
        assert_close(lse[~empty], ref_lse[~empty], torch.float32, "lse", tol=1e-5)
        assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < 5e-4
    return out, lse, ref_lse


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("d", [64, 80])
def test_split_combine_matches_reference(poisoned_empty, device, dtype, d):
    q, k, v = make_qkv(1, 2, 2, 1, 1100, d, dtype, device=device)
    check(q, k, v, kcfg=cfg(block_n=16), splits=23)


def test_large_head_dim(poisoned_empty, device):
    """D = 512 (FFPA range), whole-D tiles and the variant that splits O over programs + chunked QK^T."""
    q, k, v = make_qkv(1, 2, 1, 2, 600, 512, BF16, device=device)
    check(q, k, v, kcfg=cfg(block_n=32), splits=7)
    check(q, k, v, kcfg=cfg(block_n=32, block_do=128, qk_chunk=128), splits=5)


def test_non_pow2_head_dim_d_split(poisoned_empty, device):
    q, k, v = make_qkv(1, 2, 2, 3, 200, 320, FP16, device=device)
    check(q, k, v, kcfg=cfg(block_n=16, block_do=128, qk_chunk=64), splits=6, causal=True)


@pytest.mark.parametrize("d", [16, 1024])
def test_head_dim_extremes(poisoned_empty, device, d):
    q, k, v = make_qkv(1, 2, 1, 2, 200, d, BF16, device=device)
    check(q, k, v, kcfg=cfg(block_n=16), splits=3, causal=True)


def test_empty_slices_from_split_count(poisoned_empty, device):
    """40 slices of 32 keys over Nkv = 1100: the last 5 slices hold no key."""
    q, k, v = make_qkv(1, 2, 2, 2, 1100, 64, FP16, device=device)
    check(q, k, v, kcfg=cfg(block_n=16), splits=40)


def test_more_splits_than_tiles(poisoned_empty, device):
    q, k, v = make_qkv(1, 1, 1, 1, 100, 32, BF16, device=device)
    check(q, k, v, kcfg=cfg(block_n=16), splits=16)


@pytest.mark.parametrize("nq", [5, 48])
def test_causal_rows_see_different_prefixes(poisoned_empty, device, nq):
    """Tail-aligned causal with slices of 16 keys: for Nq = 48 the last slices are empty for early rows."""
    q, k, v = make_qkv(1, 2, 1, nq, 1100, 64, BF16, device=device)
    check(q, k, v, causal=True, kcfg=cfg(block_m=16 if nq < 16 else 64, block_n=16), splits=69)


def test_causal_nq_equals_nkv_small(poisoned_empty, device):
    q, k, v = make_qkv(1, 1, 1, 40, 40, 32, FP16, device=device)
    check(q, k, v, causal=True, kcfg=cfg(block_n=16), splits=3)


@pytest.mark.parametrize("hq,hkv,nq", [(4, 1, 3), (4, 2, 1), (8, 1, 5)])
def test_gqa_mqa_rows_share_kv(poisoned_empty, device, hq, hkv, nq):
    """Rows = group * Nq per KV head; (8, 1, 5) has 40 rows -> 3 row blocks of 16."""
    q, k, v = make_qkv(2, hq, hkv, nq, 600, 64, BF16, device=device)
    check(q, k, v, kcfg=cfg(block_n=16), splits=9)


def test_bool_mask_broadcast_and_fully_masked_rows(poisoned_empty, device):
    q, k, v = make_qkv(2, 2, 2, 3, 1100, 64, FP16, device=device)
    mask = torch.rand(2, 1, 3, 1100, device=device) > 0.3
    mask[0, 0, 1] = False  # a row that sees nothing: out 0, lse -inf
    mask[1, 0, :, 100:900] = False  # whole slices invisible to every row
    _, lse, _ = check(q, k, v, attn_mask=mask, kcfg=cfg(block_n=16), splits=30)
    assert torch.isneginf(lse[0, :, 1]).all()


def test_bool_mask_with_causal(poisoned_empty, device):
    q, k, v = make_qkv(1, 2, 1, 20, 700, 64, BF16, device=device)
    mask = torch.rand(700, device=device) > 0.5  # [Nkv] broadcast to every row
    check(q, k, v, attn_mask=mask, causal=True, kcfg=cfg(block_m=64, block_n=16), splits=11)


def test_float_mask(poisoned_empty, device):
    q, k, v = make_qkv(1, 4, 2, 2, 1100, 64, BF16, device=device)
    bias = torch.randn(1, 4, 2, 1100, device=device)
    bias[..., 50:500] = float("-inf")
    bias[0, 1, 0] = float("-inf")  # a fully masked row
    check(q, k, v, attn_mask=bias, kcfg=cfg(block_n=16), splits=17)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_float_mask_finfo_min_row(poisoned_empty, device):
    """A row masked with finfo.min (HF style) is a uniform softmax, not an empty row; its lse is
    MASK_FLOOR + log(N) (the floor rule of ffpa_attn.contract), the reference's out and lse elsewhere."""
    q, k, v = make_qkv(1, 1, 1, 2, 300, 32, FP16, device=device)
    bias = torch.zeros(1, 1, 2, 300, device=device)
    bias[..., 0, :] = torch.finfo(torch.float32).min
    bias[..., 1, 10:] = torch.finfo(torch.float32).min
    out, lse = splitkv.splitkv_launch(q, k, v, attn_mask=bias, causal=False, scale=32 ** -0.5, cfg=cfg(block_n=16),
                                     splits=4)
    ref, ref_lse = attention(q, k, v, attn_mask=bias, scale=32 ** -0.5)
    assert_close(out, ref, FP16, "out")
    assert abs(lse[0, 0, 0].item() - (MASK_FLOOR + math.log(300))) < 1e-2
    assert abs(lse[0, 0, 1].item() - ref_lse[0, 0, 1].item()) < 5e-4


def test_strided_inputs(poisoned_empty, device):
    """[B, N, H, D] storage seen as [B, H, N, D] (a model's transpose) and a sliced KV cache."""
    q, k, v = make_qkv(2, 4, 2, 2, 1100, 64, FP16, layout="bnhd", device=device)
    cache_k = torch.randn(2, 2, 1300, 64, device=device).to(FP16)
    check(q, k, v, kcfg=cfg(block_n=32), splits=12)
    check(q, cache_k[:, :, 100:1200], v, kcfg=cfg(block_n=32), splits=12, causal=True)


def test_single_split_writes_output_directly(poisoned_empty, device):
    q, k, v = make_qkv(1, 2, 1, 3, 300, 64, BF16, device=device)
    check(q, k, v, kcfg=cfg(block_n=32), splits=1, causal=True)


def test_default_config_and_split_count(poisoned_empty, device):
    q, k, v = make_qkv(1, 2, 1, 1, 1100, 64, BF16, device=device)
    check(q, k, v, scale=0.3)
    assert splitkv.num_splits(2, 1100, 16, 2, torch.device("cpu")) > 1


def test_num_splits_rule():
    dev = torch.device("cpu")  # 4 "SMs" off-GPU
    assert splitkv.num_splits(1, 32768, 32, 1, dev) == 8  # fills 2 programs x 4 SMs
    assert splitkv.num_splits(64, 32768, 32, 1, dev) == 1  # enough programs already
    assert splitkv.num_splits(1, 100, 32, 1, dev) == 1  # slices never shorter than 4 tiles
    assert splitkv.num_splits(1, 4096, 16, 128, dev) == 4  # partials small next to the slice (>= 64 tiles each)
    assert splitkv.num_splits(1, 4096, 16, 512, dev) == 1


def test_dispatch_through_public_api_and_backward(device):
    """ffpa_attn_func (backend='triton') routes Nq=2 vs Nkv=300 to the split-KV kernel; the ordinary
    backward consumes its lse and gives the reference gradients."""
    q, k, v = make_qkv(1, 4, 2, 2, 300, 64, BF16, requires_grad=True, device=device)
    plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
    assert plan.forward.kernel == "splitkv_fwd"
    out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="triton")
    ref, _ = attention(q, k, v, is_causal=True)
    assert_fwd_bwd_close(out, ref, (q, k, v), BF16)


def test_low_level_fwd_lse(device):
    q, k, v = make_qkv(1, 2, 2, 1, 1100, 64, FP16, device=device)
    out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, backend="triton")
    ref, ref_lse = attention(q, k, v)
    assert_close(out, ref, FP16, "out")
    assert_close(lse, ref_lse, torch.float32, "lse", tol=1e-5)


def test_explain_reports_splitkv(device):
    q, k, v = make_qkv(1, 8, 2, 1, 1100, 512, BF16, device=device)
    plan = ffpa_attn.explain(q, k, v, enable_gqa=True, backend="triton")
    assert plan.forward.kernel == "splitkv_fwd" and "splitkv_fwd" in str(plan), str(plan)
    if device == "cpu":  # implicit choice (on a GPU the CuTeDSL backend may come first)
        plan = ffpa_attn.explain(q, k, v, enable_gqa=True)
        assert plan.forward.backend == "triton" and plan.forward.kernel == "splitkv_fwd", str(plan)
    q2, k2, v2 = make_qkv(1, 2, 2, 256, 1100, 512, BF16, device=device)
    assert ffpa_attn.explain(q2, k2, v2, backend="triton").forward.kernel == "fwd"
    assert ffpa_attn.explain(q, k, v, enable_gqa=True, dropout_p=0.1, backend="triton").forward.kernel == "fwd"


def test_forward_kernel_rule():
    assert splitkv_sized(1, 32768) and splitkv_sized(1, 256) and splitkv_sized(16, 4096) and splitkv_sized(64, 1024)
    assert not splitkv_sized(64, 1023) and not splitkv_sized(1, 255) and not splitkv_sized(65, 32768)


# ------------------------------------------------------------------ decode shapes: split rule, tiles vs rows


def test_occ_option_raises_split_count_and_stays_exact(poisoned_empty, device):
    """A config's ``occ`` option (programs per SM to aim at) drives choose_splits: more slices than the
    default estimate, none of them empty by the rule, and the same result as the reference."""
    q, k, v = make_qkv(1, 2, 1, 1, 1100, 64, BF16, device=device)
    base = cfg(block_n=16)
    dev = torch.device("cpu")  # the rule's arithmetic with 4 "SMs" (on a GPU both counts hit the cap)
    s_base = splitkv.choose_splits(base, 1, 1, 2, 1100, 64, dev)
    wide = base.with_options(occ=8)
    s_wide = splitkv.choose_splits(wide, 1, 1, 2, 1100, 64, dev)
    assert s_wide > s_base >= 1
    # the rule rounds to whole tiles: every slice holds at least one key
    per = -(-(-(-1100 // 16)) // s_wide)
    assert (s_wide - 1) * per * 16 < 1100
    check(q, k, v, kcfg=wide)  # splits=None -> choose_splits(wide)


@pytest.mark.parametrize("block_m,hq,hkv,nq", [(32, 1, 1, 3), (64, 4, 2, 5), (32, 8, 1, 5)])
def test_block_m_larger_than_rows(poisoned_empty, device, block_m, hq, hkv, nq):
    """Row tiles bigger than the rows per KV head (3, 10 rows) and a last row block half full (40 rows in
    blocks of 32), with causal (each row sees another prefix) and forced slices that leave empty ones."""
    q, k, v = make_qkv(1, hq, hkv, nq, 700, 64, BF16, device=device)
    check(q, k, v, causal=True, kcfg=cfg(block_m=block_m, block_n=16), splits=50)  # 50 x 16 keys > 700


def test_rule_split_count_with_empty_slices_per_row(poisoned_empty, device):
    """The rule's split count at a wide occ target (slices of >= 8 x rows keys, so causal alone never
    empties a slice) with a bool mask that hides whole slices from every row and everything from one row:
    partials with m = -inf, l = 0 that the combine must skip, and a row with out 0, lse -inf."""
    q, k, v = make_qkv(1, 1, 1, 48, 1600, 32, FP16, device=device)
    c = cfg(block_m=64, block_n=16).with_options(occ=64)
    s = splitkv.choose_splits(c, 1, 1, 48, 1600, 32, torch.device(device))
    assert s == 4  # 100 tiles, >= 24 tiles (8 x 48 keys) per slice
    mask = torch.ones(1, 1, 48, 1600, dtype=torch.bool, device=device)
    mask[..., 400:1200] = False  # slices 1 and 2 see nothing
    mask[..., 7, :] = False
    _, lse, _ = check(q, k, v, causal=True, attn_mask=mask, kcfg=c)
    assert torch.isneginf(lse[0, 0, 7])


def test_candidate_configs_on_a_simulated_h200(monkeypatch):
    """With sm90 limits (232448 B shared memory, 132 SMs): 64 rows per KV head get the 32-row mma.sync tile
    next to the wgmma default; every candidate fits shared memory and <= 128 accumulator registers per
    thread; "max" is a superset of "fast"; Hkv=8, Nq=16 fills the GPU once."""
    from ffpa_attn.common import device as hw

    monkeypatch.setattr(hw, "smem_limit", lambda device=None: 232448)
    monkeypatch.setattr(hw, "capability_major", lambda device=None: 9)
    monkeypatch.setattr(hw, "sm_count", lambda device: 132)
    dev = torch.device("cuda")
    for rows in (16, 64, 256):
        fast = splitkv.candidate_configs(512, rows, dev)
        wide = splitkv.candidate_configs(512, rows, dev, mode="max")
        assert fast[0] == splitkv.default_config(512, rows, dev) and set(fast) <= set(wide)
        for c in wide:
            assert splitkv.smem_bytes(c, 512, dev) <= 232448 - 8 * 1024 and splitkv.acc_regs(c, 512) <= 128
    fast64 = splitkv.candidate_configs(512, 64, dev)
    assert any(c.block_m == 32 and c.num_warps == 4 for c in fast64)
    base = fast64[0]
    # the measured default at 64 rows per KV head: mma.sync 64x32, 4 warps, 3 stages, O split in 2 x 256 cols
    assert (base.block_m, base.block_n, base.num_warps, base.num_stages) == (64, 32, 4, 3)
    assert dict(base.options)["block_do"] == 256
    s = splitkv.choose_splits(base, 1, 8, 64, 32768, 512, dev)
    programs = s * 8 * -(-64 // base.block_m) * -(-512 // dict(base.options)["block_do"])  # x O column parts
    assert 66 <= programs <= 132 * splitkv.occupancy(base, 512, dev)


def test_roofline_numbers():
    """The decode shape Hkv=2, Nq=16: 512 query rows x 32768 keys x 512 x 4 = 34.4 GFLOP on 134 MB of K/V."""
    r = splitkv.roofline(1, 32, 2, 16, 32768, 512)
    assert r["flops"] == 4 * 32 * 16 * 32768 * 512
    assert r["kv_bytes"] == 2 * 2 * 32768 * 512 * 2
    assert r["flop_per_byte"] == 256

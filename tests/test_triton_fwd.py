"""CPU tests of the Triton split-D forward (interpreter): dense and varlen against the fp32 reference, every
feature of the kernel, plus the autotune cache. Outputs are allocated NaN-poisoned (see ``poison``), so an
element the kernel forgets to write fails the comparison."""
from __future__ import annotations

import json
import math

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn import TritonBackend
from ffpa_attn.common import device as hw
from ffpa_attn.interface import _draw_rng
from ffpa_attn.testing import (PoisonTorch, assert_close, assert_forward_close, assert_lse_close, cu_seqlens,
                               make_qkv, make_varlen_qkv)
from ffpa_attn.triton import autotune, fwd
from ffpa_attn.triton.autotune import KernelConfig
from ffpa_attn.triton.dropout import dense_keep_mask

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(fwd, "torch", PoisonTorch())


def _dense(q, k, v, **kw):
    kw.setdefault("backend", "triton")
    return ffpa_attn.ffpa_attn_fwd(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


# -------------------------------------------------------------------------------------------------- dense

DENSE_CASES = [
    # d, b, hq, hkv, nq, nkv, causal, dtype
    (320, 1, 1, 1, 130, 130, False, BF16),   # D1+D2 = 256+64, N tail
    (512, 1, 2, 1, 64, 200, True, BF16),     # causal Nq < Nkv, GQA
    (1024, 1, 1, 1, 40, 72, False, FP16),    # 512+512
    (300, 2, 2, 2, 33, 77, True, FP16),      # D not a multiple of 64 (256+64 with a masked tail)
    (384, 1, 4, 1, 17, 17, True, BF16),      # MQA, causal square
    (80, 1, 2, 2, 50, 90, False, FP16),      # small explicit D (64+16)
    (16, 1, 2, 2, 33, 40, True, BF16),       # the smallest D the Triton backend takes
    (1000, 1, 1, 1, 20, 40, True, BF16),     # 512+512 with a 24-column masked tail
]


@pytest.mark.parametrize("d,b,hq,hkv,nq,nkv,causal,dtype", DENSE_CASES)
def test_dense_vs_reference(d, b, hq, hkv, nq, nkv, causal, dtype):
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype)
    out, lse = _dense(q, k, v, causal=causal)
    assert out.dtype == dtype
    assert_forward_close(out, lse, q, k, v, causal=causal)


def test_public_func_scale_cross_attention():
    q, k, v = make_qkv(1, 2, 2, 48, 100, 512, BF16)
    out = ffpa_attn.ffpa_attn_func(q, k, v, scale=0.3, backend="triton")
    assert_forward_close(out, None, q, k, v, scale=0.3)


def test_non_contiguous_inputs():
    q, k, v = make_qkv(2, 2, 1, 70, 70, 320, BF16, layout="bnhd")  # transpose(1, 2) views
    assert not q.is_contiguous()
    big = torch.randn(2, 2, 70, 400).to(BF16)
    q2 = big[..., :320]  # sliced head dim: row stride 400
    out, lse = _dense(q2, k, v, causal=True)
    assert_forward_close(out, lse, q2, k, v, causal=True)
    out = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend="triton")
    assert_forward_close(out, None, q, k, v)


MASK_SHAPES = [lambda b, h, nq, nkv: (nq, nkv), lambda b, h, nq, nkv: (1, 1, nq, nkv),
               lambda b, h, nq, nkv: (b, 1, 1, nkv), lambda b, h, nq, nkv: (b, h, nq, nkv)]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape_i", range(4))
def test_masks(kind, shape_i):
    b, hq, nq, nkv, d = 2, 2, 40, 70, 320
    q, k, v = make_qkv(b, hq, hq, nq, nkv, d, FP16)
    shape = MASK_SHAPES[shape_i](b, hq, nq, nkv)
    if kind == "bool":
        mask = torch.rand(shape) > 0.3
    else:
        mask = torch.randn(shape) * 2
        mask = mask.masked_fill(torch.rand(shape) < 0.2, float("-inf")).to(FP16)
    causal = shape_i == 3
    out, lse = _dense(q, k, v, attn_mask=mask, causal=causal)
    assert_forward_close(out, lse, q, k, v, mask=mask, causal=causal)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows(kind):
    b, hq, nq, nkv, d = 1, 2, 20, 50, 384
    q, k, v = make_qkv(b, hq, hq, nq, nkv, d, BF16)
    keep = torch.rand(b, hq, nq, nkv) > 0.5
    keep[0, 0, 3] = False
    keep[0, 1, :5] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    out, lse = _dense(q, k, v, attn_mask=mask)
    assert not torch.isnan(out).any()
    assert (out[0, 0, 3] == 0).all() and (out[0, 1, :5] == 0).all()
    assert torch.isneginf(lse[0, 0, 3]) and torch.isneginf(lse[0, 1, :5]).all()
    assert_forward_close(out, lse, q, k, v, mask=mask)


# ------------------------------------------------------------------------------------------------ dropout


def _keep_from_kernel(seed: int, b: int, hq: int, nq: int, nkv: int, p: float) -> torch.Tensor:
    """Read the kernel's keep-mask: q = 0 gives uniform P = 1/Nkv, V = I gives out[r, j] = keep/(Nkv(1-p))."""
    d = 320
    q = torch.zeros(b, hq, nq, d, dtype=BF16)
    k = torch.randn(b, hq, nkv, d).to(BF16)
    v = torch.eye(nkv, d).expand(b, hq, nkv, d).to(BF16)
    torch.manual_seed(seed)
    out = ffpa_attn.ffpa_attn_func(q, k, v, dropout_p=p, backend="triton")
    return (out[..., :nkv].float() * nkv * (1 - p)) > 0.5


def test_dropout_statistics_and_reproducibility():
    b, hq, nq, nkv, p = 1, 2, 64, 128, 0.3
    keep = _keep_from_kernel(123, b, hq, nq, nkv, p)
    frac = keep.float().mean().item()
    n = keep.numel()
    assert abs(frac - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, frac
    assert torch.equal(keep, _keep_from_kernel(123, b, hq, nq, nkv, p))  # same seed -> same mask
    assert not torch.equal(keep, _keep_from_kernel(124, b, hq, nq, nkv, p))
    torch.manual_seed(123)
    rng = _draw_rng(torch.device("cpu"))
    assert torch.equal(keep, dense_keep_mask(rng, b, hq, nq, nkv, p))  # the shared RNG convention


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_equals_reference_with_keep_mask(causal):
    b, hq, hkv, nq, nkv, d, p = 1, 2, 1, 50, 90, 384, 0.2
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, FP16)
    torch.manual_seed(7)
    out = ffpa_attn.ffpa_attn_func(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=True, backend="triton")
    torch.manual_seed(7)
    keep = dense_keep_mask(_draw_rng(torch.device("cpu")), b, hq, nq, nkv, p)
    ref, _ = reference.attention(q, k, v, is_causal=causal, dropout_p=p, dropout_keep=keep)
    assert_close(out, ref, FP16)


# ----------------------------------------------------------------------------------- forced configurations


@pytest.mark.parametrize("d,cfg,causals", [
    (640, KernelConfig(32, 32, 4, 1, (("nsplit", 2),)), (True,)),   # output columns over 2 programs (256+64 each)
    (1024, KernelConfig(32, 16, 4, 1, (("nsplit", 2),)), (True,)),
    (512, KernelConfig(64, 64, 4, 1, (("nsplit", 1),)), (False, True)),
    # the H200 defaults' shape at D=384 / 512: 64 x D/2 accumulators on one warpgroup (384: 128 + 64 columns)
    (384, KernelConfig(64, 32, 4, 1, (("nsplit", 2),)), (False, True)),
    (512, KernelConfig(64, 32, 4, 1, (("nsplit", 2),)), (False,)),
])
def test_forced_configs(d, cfg, causals):
    q, k, v = make_qkv(1, 2, 2, 40, 70, d, BF16)
    for causal in causals:
        out, lse = fwd.dense_forward(q, k, v, attn_mask=None, dropout_p=0.0, rng=None, causal=causal,
                                     scale=d ** -0.5, config=TritonBackend(), kernel_config=cfg)
        assert_forward_close(out, lse, q, k, v, causal=causal)


def test_tma_path_in_interpreter(monkeypatch):
    """enable_tma=True runs the tensor-descriptor loads (zero fill past N and D) under the interpreter."""
    made = []
    real = fwd._make_descs
    monkeypatch.setattr(fwd, "_make_descs", lambda *a, **kw: made.append(a[-1]) or real(*a, **kw))
    be = TritonBackend(enable_tma=True)
    q, k, v = make_qkv(1, 2, 1, 60, 130, 320, BF16)
    out, lse = _dense(q, k, v, causal=True, backend=be)
    assert_forward_close(out, lse, q, k, v, causal=True)
    qv, kv, vv, cu_q, cu_k, mq, mk = make_varlen_qkv([3, 0, 40], [5, 2, 70], 2, 1, 320, BF16)
    out, lse = ffpa_attn.ffpa_attn_varlen_func(qv, kv, vv, cu_q, cu_k, mq, mk, causal=True, enable_gqa=True,
                                               return_lse=True, backend=be)
    ref, ref_lse = reference.varlen_attention(qv, kv, vv, cu_q, cu_k, causal=True)
    assert_close(out, ref, BF16)
    assert_lse_close(lse, ref_lse)
    assert made == [False, True]  # one dense, one varlen launch through descriptors


# ------------------------------------------------------------------------------------------------- varlen


@pytest.mark.parametrize("lq,lk,hq,hkv,d,causal,dtype", [
    ([5, 0, 1, 77, 40], [5, 0, 1, 77, 40], 2, 2, 512, True, BF16),       # self-attention, lengths 0 and 1
    ([3, 64, 1, 20], [10, 100, 1, 90], 4, 2, 320, True, FP16),           # Nq_i != Nk_i, causal, GQA
    ([33, 0, 70], [50, 9, 1], 2, 1, 300, False, BF16),                   # Nk_i < Nq_i non-causal, MQA
    ([16, 16], [0, 16], 1, 1, 1024, False, FP16),                        # a sequence with no keys
])
def test_varlen_vs_reference(lq, lk, hq, hkv, d, causal, dtype):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_qkv(lq, lk, hq, hkv, d, dtype)
    out, lse = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, enable_gqa=hq != hkv,
                                               return_lse=True, backend="triton")
    ref, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    assert out.shape == q.shape
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)


def test_varlen_one_sequence_equals_dense():
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_qkv([70], [90], 2, 1, 384, BF16)
    out, lse = ffpa_attn.ffpa_attn_varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, causal=True, enable_gqa=True,
                                              backend="triton")
    d_out, d_lse = ffpa_attn.ffpa_attn_fwd(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], causal=True, enable_gqa=True, backend="triton")
    assert torch.equal(out, d_out[0].transpose(0, 1))
    assert torch.equal(lse, d_lse[0])


def test_varlen_dropout_counter_is_packed():
    """Varlen keep-mask = dense keep-mask over the packed [1, Hq, T_q, T_k] grid at each sequence's block."""
    lq, lk, hq, nkv_max, p = [20, 0, 30], [40, 5, 60], 2, 60, 0.25
    d = 320
    tq, tk = sum(lq), sum(lk)
    q = torch.zeros(tq, hq, d, dtype=BF16)
    k = torch.randn(tk, hq, d).to(BF16)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    v = torch.zeros(tk, hq, d, dtype=BF16)
    for s in range(3):  # V rows of each sequence are one-hot at their local index
        for j in range(lk[s]):
            v[cu_k[s] + j, :, j] = 1
    torch.manual_seed(11)
    out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), dropout_p=p, backend="triton")
    torch.manual_seed(11)
    full = dense_keep_mask(_draw_rng(torch.device("cpu")), 1, hq, tq, tk, p)[0]
    for s in (0, 2):
        qs, ks, n = int(cu_q[s]), int(cu_k[s]), lk[s]
        got = out[qs:qs + lq[s], :, :n].float().transpose(0, 1) * n * (1 - p) > 0.5
        assert torch.equal(got, full[:, qs:qs + lq[s], ks:ks + n])
    del nkv_max


# ----------------------------------------------------------------------------------------------- autotune


def test_candidate_configs_fit_shared_memory():
    class Dev:
        type = "cuda"
        index = 0

    for smem in (163 * 1024, 227 * 1024):
        for d in (16, 64, 100, 256, 300, 320, 384, 512, 640, 768, 1000, 1024):
            for tma in (False, True):
                cands = fwd.candidate_configs(d, False, Dev(), tma=tma, smem=smem)
                assert cands, (d, smem)
                for c in cands:
                    assert fwd.smem_estimate(d, c) <= smem - 8 * 1024
                    assert fwd.acc_regs(d, c) <= (fwd.WIDE_ACC_REGS if fwd._wide(d, c) else 128)
                    assert bool(c.opt("tma", False)) == tma


def test_wide_unsplit_tile_first_only_where_it_runs_without_loop_spills():
    """256 < D <= 384 with descriptors and an sm90 shared memory: the wide tile (BLOCK_M 128 on 8 warps, up to 192
    accumulator registers, S computed once) is the first guess for plain calls; never with a mask or dropout (it
    spills in its loop there), without descriptors, on sm80's 163 KiB, or where O needs more (D1 + D2 = 512) or
    fits the ordinary cap (D <= 256)."""
    class Dev:
        type = "cuda"
        index = 0

    def shape(c):
        return (c.block_m, c.block_n, c.num_warps, c.num_stages, c.opt("nsplit"))

    for d, regs in [(264, 136), (320, 160), (336, 192), (384, 192)]:
        first = fwd.candidate_configs(d, False, Dev(), tma=True, smem=227 * 1024)[0]
        assert shape(first) == (128, 32, 8, 2, 1) and fwd.acc_regs(d, first) == regs and fwd._wide(d, first)
    for d, kw in [(384, dict(tma=True, smem=227 * 1024, plain=False)), (384, dict(tma=False, smem=227 * 1024)),
                  (384, dict(tma=True, smem=163 * 1024)), (512, dict(tma=True, smem=227 * 1024)),
                  (256, dict(tma=True, smem=227 * 1024))]:
        assert not any(fwd._wide(d, c) for c in fwd.candidate_configs(d, False, Dev(), **kw)), (d, kw)


def test_select_skips_the_wide_default_for_masked_calls(monkeypatch):
    """With autotuning off, the tuned default of the feature-less problem leads the candidates, except when that
    default is the wide tile and the call has a mask or dropout."""
    from ffpa_attn.triton import autotune

    class Dev:
        type = "cuda"
        index = 0

    wide = KernelConfig(128, 32, 8, 2).with_options(nsplit=1, tma=True)
    monkeypatch.setattr(autotune, "tuned_default", lambda name, gpu, key: wide)
    monkeypatch.setattr(hw, "gpu_name", lambda device: "test-gpu")
    monkeypatch.setattr(hw, "smem_limit", lambda device: 227 * 1024)
    picked = {}
    monkeypatch.setattr(autotune, "pick_config", lambda name, key, cands, *a, **k: picked.setdefault(key, cands[0]))

    class Cfg:
        autotune = False

    for mask_kind, dropout, want_wide in [(0, False, True), (1, False, False), (2, False, False), (0, True, False)]:
        key = fwd._tune_key(384, False, mask_kind, dropout, False, torch.bfloat16, 8192, 8192, 1, True)
        got = fwd._select(384, False, Dev(), Cfg(), key, True, None, None)
        assert fwd._wide(384, got) == want_wide, (mask_kind, dropout, str(got))


def test_fast_candidates_try_the_split_output_where_one_warpgroup_cannot_hold_o():
    """At D=512 on an sm90-sized shared memory the fast set holds the 4 best unsplit guesses and the 2 best
    split ones, the H200's measured winner (BLOCK_M 64 on 4 warps, 3 stages) first among them; at D=256 one
    warpgroup's O fits (128 registers at BLOCK_M=64), so nothing is split."""
    class Dev:
        type = "cuda"
        index = 0

    cands = fwd.candidate_configs(512, False, Dev(), tma=True, smem=227 * 1024)
    kinds = [c.opt("nsplit") for c in cands]
    assert kinds == [1, 1, 1, 1, 2, 2], [str(c) for c in cands]
    first = cands[4]
    assert (first.block_m, first.block_n, first.num_warps, first.num_stages) == (64, 32, 4, 3)
    assert fwd.acc_regs(512, first) == 128
    assert all(c.opt("nsplit") == 1 for c in fwd.candidate_configs(256, False, Dev(), tma=True, smem=227 * 1024))


def test_split_dims():
    assert fwd.split_dims(320) == (256, 64)
    assert fwd.split_dims(384) == (256, 128)
    assert fwd.split_dims(512) == (512, 0)
    assert fwd.split_dims(640) == (512, 128)
    assert fwd.split_dims(1024) == (1024, 0)
    assert fwd.split_dims(300) == (256, 64)
    assert fwd.split_dims(257) == (256, 16)
    assert fwd.output_dims(1024, 2) == (512, 0)
    assert fwd.output_dims(768, 2) == (256, 128)


def test_pick_config_disk_cache_and_tuned_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hw, "gpu_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(autotune, "TUNED_DIR", tmp_path / "tuned")
    autotune.clear_memory_cache()
    cands = [KernelConfig(64, 32, 8, 2), KernelConfig(64, 64, 8, 1), KernelConfig(32, 32, 4, 2)]
    calls = []

    def bench(c):
        calls.append(c)
        if c.block_m == 32:
            raise RuntimeError("out of resources")  # a failing config is skipped
        return 2.0 if c.block_n == 32 else 1.0

    key = ("bf16", 512, 0)
    got = autotune.pick_config("k", key, cands, bench, fingerprint="fp")
    assert got == cands[1] and len(calls) == 3
    assert autotune.pick_config("k", key, cands, bench, fingerprint="fp") == got and len(calls) == 3
    autotune.clear_memory_cache()  # a new process: the disk cache answers
    assert autotune.pick_config("k", key, cands, bench, fingerprint="fp") == got and len(calls) == 3
    files = list(tmp_path.glob("autotune/fp/FakeGPU/k.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())
    # another fingerprint (kernel source changed) misses the disk cache; shipped defaults answer first
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "k.json").write_text(json.dumps(
        {"FakeGPU": {autotune.key_str(key): cands[2].to_dict()}}))
    autotune.clear_memory_cache()
    assert autotune.pick_config("k", key, cands, bench, fingerprint="fp2") == cands[2] and len(calls) == 3
    # autotune=False without any entry: the first candidate
    assert autotune.pick_config("k", ("other",), cands, bench, fingerprint="fp2", autotune=False) == cands[0]
    autotune.clear_memory_cache()



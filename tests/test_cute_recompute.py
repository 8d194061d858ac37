"""CPU checks of the S-recompute CuTeDSL forward for 512 < D <= 1024 (ffpa_attn/cutedsl/fwd_sm90_recompute.py):
the shared-memory / register budget of :class:`RecomputeFwdConfig`, a pure-torch model of the kernel's
column split and per-CTA key ranges against the fp32 reference, and sm_90a compiles (``CUTE_DSL_ARCH=sm_90a``,
no GPU). GPU numerics: tests/gpu/test_cute_recompute_gpu.py.
"""
from __future__ import annotations

import math
import os
import re

import pytest
import torch

from ffpa_attn.cutedsl.config import (FWD_MAX_HEAD_DIM, RECOMPUTE_MIN_STAGES, RECOMPUTE_PARTS, RECOMPUTE_TILE_N_CHOICES,
                                   SMEM_CAPACITY, SMEM_RESERVED, FwdConfig, RecomputeFwdConfig, recompute_stages)
from ffpa_attn.cutedsl import ranges
from ffpa_attn.reference import attention

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

RECOMPUTE_DIMS = tuple(range(520, FWD_MAX_HEAD_DIM + 1, 8))


# ---------------------------------------------------------------------------------------------------------
# budget


@pytest.mark.parametrize("d", RECOMPUTE_DIMS)
def test_recompute_budget(d):
    cfg = RecomputeFwdConfig(d, "bfloat16", True)
    d_wg = cfg.d_wg
    # 4 parts, each with real columns, wgmma N <= 256 and a multiple of 16
    assert RECOMPUTE_PARTS * d_wg >= d > (RECOMPUTE_PARTS - 1) * d_wg and d_wg % 16 == 0 and d_wg <= 256
    # shared memory: all 4 Q parts + the ring; K(j) (4 slots) and V(j-1) (2 slots) held at once
    assert cfg.q_bytes == 64 * 4 * d_wg * 2 and cfg.slot_bytes == cfg.tile_n * d_wg * 2
    assert cfg.stages >= RECOMPUTE_MIN_STAGES == 6
    assert cfg.q_bytes + cfg.stages * cfg.slot_bytes + SMEM_RESERVED <= SMEM_CAPACITY
    assert cfg.smem_bytes == cfg.q_bytes + cfg.stages * cfg.slot_bytes
    assert 64 * cfg.tile_n * 4 <= cfg.slot_bytes and cfg.exchange_fits  # the partial-S exchange
    # the default tile is the largest choice that keeps 6 slots
    bigger = [t for t in RECOMPUTE_TILE_N_CHOICES if t > cfg.tile_n]
    assert all(recompute_stages(d, t) < RECOMPUTE_MIN_STAGES for t in bigger)
    # registers per consumer thread (128 threads): O part, S tile, P tile (16-bit pairs)
    assert 64 * d_wg // 128 <= 128 and 64 * cfg.tile_n // 128 <= 32 and 64 * cfg.tile_n // 256 <= 16
    assert cfg.cluster == 1 and cfg.ctas_per_block == 2


def test_recompute_budget_arithmetic_of_the_plan():
    """The numbers written in config.py's comment block."""
    c = {d: RecomputeFwdConfig(d, "bfloat16", False) for d in (520, 640, 768, 896, 1024)}
    assert [(c[d].tile_n, c[d].stages) for d in c] == [(64, 8), (64, 7), (48, 7), (32, 8), (32, 6)]
    assert c[1024].q_bytes == 128 * 1024 and c[1024].smem_bytes == 224 * 1024
    assert recompute_stages(1024, 48) == 4


def test_recompute_config_rejects_and_keys():
    for d in (512, 264, 1032, 644):
        with pytest.raises(ValueError):
            RecomputeFwdConfig(d, "bfloat16", False)
    with pytest.raises(ValueError, match="tile_n"):
        RecomputeFwdConfig(768, "bfloat16", False, tile_n=80)
    with pytest.raises(ValueError, match="ring slots"):
        RecomputeFwdConfig(1024, "bfloat16", False, tile_n=64)
    with pytest.raises(ValueError, match="q_broadcast"):
        RecomputeFwdConfig(1024, "bfloat16", False, q_broadcast=True)
    cfg = RecomputeFwdConfig(1024, "float16", True)
    assert cfg.key() != FwdConfig(1024, "float16", True).key() and cfg.key()[0] == "fwd_sm90_recompute"
    assert RecomputeFwdConfig(640, "float16", True, tile_n=32).key() != RecomputeFwdConfig(640, "float16", True).key()


def test_backend_option_validated():
    from ffpa_attn.config import CuTeDSLBackend, from_config

    assert CuTeDSLBackend().fwd_recompute is None  # the measured choice
    b = CuTeDSLBackend(fwd_recompute=True)
    assert from_config("cutedsl", b.to_config()).fwd_recompute is True
    with pytest.raises(ValueError, match="fwd_recompute"):
        CuTeDSLBackend(fwd_recompute="yes")


def test_backend_option_planned_only_where_it_acts(monkeypatch):
    """The planner names the variant's kernel for dense 512 < D <= 1024 and refuses the option where it would
    change nothing (D <= 512; the split-KV path), instead of ignoring it."""
    import ffpa_attn
    from ffpa_attn.testing import make_qkv, pretend_gpu

    pretend_gpu(monkeypatch, capability=(9, 0))
    opt = ffpa_attn.CuTeDSLBackend(fwd_recompute=True)
    q, k, v = make_qkv(1, 2, 2, 128, 128, 1024, torch.bfloat16)
    with torch.no_grad():
        assert ffpa_attn.explain(q, k, v, is_causal=True, backend=opt).forward.kernel == "fwd_sm90_recompute"
        cluster = ffpa_attn.CuTeDSLBackend(fwd_recompute=False)
        assert ffpa_attn.explain(q, k, v, backend=cluster).forward.kernel == "fwd_sm90"
        q5, k5, v5 = make_qkv(1, 2, 2, 128, 128, 512, torch.bfloat16)
        with pytest.raises(NotImplementedError, match="fwd_recompute"):
            ffpa_attn.explain(q5, k5, v5, backend=opt)
        q1, k1, v1 = make_qkv(1, 2, 2, 1, 32768, 1024, torch.bfloat16)  # one query row: split-KV
        with pytest.raises(NotImplementedError, match="fwd_recompute"):
            ffpa_attn.explain(q1, k1, v1, backend=opt)


def test_bench_names_the_variant_only_when_asked():
    """``python -m ffpa_attn bench --impl cutedsl-recompute`` times the variant through the public entry point
    with CuTeDSLBackend(fwd_recompute=True); the default sweep leaves it out."""
    from ffpa_attn.bench.impls import default_impl_names, make_impl
    from ffpa_attn.cli import _name_list

    impl = make_impl("cutedsl-recompute")
    assert impl.name == "cutedsl-recompute" and impl.backend == "cutedsl" and impl.config.fwd_recompute is True
    assert make_impl("cutedsl").config == "cutedsl"
    assert "cutedsl-recompute" not in default_impl_names()
    assert _name_list("cutedsl-recompute,cutedsl") == ["cutedsl-recompute", "cutedsl"]


# ---------------------------------------------------------------------------------------------------------
# pure-torch model of the kernel: what each CTA of a query block computes, tile by tile


def _cta_model(q, k, v, causal, scale, cfg, m_block, rank):
    """One CTA of the recompute kernel for query block ``m_block`` of one (batch, head), in fp32.

    q ``[Nq, 4 d_wg]``, k/v ``[Nkv, 4 d_wg]`` (zero-padded like the TMA loads). Mirrors the kernel: key blocks
    ``n_block_max - 1 .. 0`` (descending), masks only on the first ``n_masked`` tiles, consumer c's partial S over
    parts 2c, 2c+1, S = (S_0 + S_1) * scale * log2(e), online softmax in exp2, O over parts 2 rank, 2 rank + 1.
    Returns ``(o [64, 2 d_wg], lse [64], visited key blocks)``; asserts that no key past the visited range and no
    masked element outside the first ``n_masked`` tiles is visible (the key-range and mask-range formulas)."""
    tm, tn, w = cfg.tile_m, cfg.tile_n, cfg.d_wg
    nq, nkv = q.shape[0], k.shape[0]
    # the kernel's own range arithmetic (ffpa_attn/cutedsl/ranges.py, evaluated on DSL values by BlockInfo)
    n_block_min, n_block_max = ranges.key_block_range(m_block, nq, nkv, tm, tn, causal, min, max)
    assert n_block_min == 0  # the kernel walks blocks n_block_max - 1 .. 0
    n_masked = ranges.masked_key_blocks(m_block, nq, nkv, tm, tn, causal, n_block_max, min, max)

    rows = torch.arange(m_block * tm, (m_block + 1) * tm)
    qb = torch.zeros(tm, 4 * w)
    valid = rows < nq
    qb[valid] = q[rows[valid]]
    scale_log2 = scale * math.log2(math.e)
    m = torch.full((tm,), -math.inf)
    l = torch.zeros(tm)
    o = torch.zeros(tm, 2 * w)
    cols_o = slice(2 * rank * w, (2 * rank + 2) * w)

    def visible(keys):
        vis = (keys[None, :] < nkv).expand(tm, -1).clone()
        if causal:
            vis &= keys[None, :] <= rows[:, None] + nkv - nq
        return vis

    # keys past the visited blocks are invisible to every (real) row of the block
    rest = torch.arange(min(max(n_block_max, 0) * tn, nkv), nkv)
    assert not visible(rest)[valid].any(), "key range too short"
    for t in range(max(n_block_max, 0)):
        blk = n_block_max - 1 - t
        keys = torch.arange(blk * tn, (blk + 1) * tn)
        kb = torch.zeros(tn, 4 * w)
        vb = torch.zeros(tn, 4 * w)
        inb = keys < nkv
        kb[inb], vb[inb] = k[keys[inb]], v[keys[inb]]
        partial = [qb[:, 2 * c * w:(2 * c + 2) * w] @ kb[:, 2 * c * w:(2 * c + 2) * w].T for c in (0, 1)]
        s = (partial[0] + partial[1]) * scale_log2
        vis = visible(keys)
        if t < n_masked:
            s = s.masked_fill(~vis, -math.inf)
        else:
            assert vis[valid].all(), f"tile {t} needs a mask but is past n_masked={n_masked}"
        m_new = torch.maximum(m, s.max(dim=1).values)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp2(s - safe[:, None])
        alpha = torch.exp2(m - safe)
        l = l * alpha + p.sum(dim=1)
        o = o * alpha[:, None] + p @ vb[:, cols_o]
        m = m_new
    empty = l == 0
    o = torch.where(empty[:, None], torch.zeros_like(o), o / torch.where(empty, 1.0, l)[:, None])
    lse = torch.where(empty, -math.inf, (m + torch.log2(torch.where(empty, 1.0, l))) * math.log(2.0))
    return o, lse, n_block_max


def recompute_model(q, k, v, causal, scale, cfg):
    """The whole forward as the recompute kernel's CTAs compute it: ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])``,
    O column halves from the two CTAs of each query block (GQA head mapping ``kv = h // (Hq // Hkv)``), lse
    from CTA 0 (checked bit-identical to CTA 1's)."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    w = cfg.d_wg
    pad = (0, 4 * w - d)
    qp, kp, vp = (torch.nn.functional.pad(t.float(), pad) for t in (q, k, v))
    out = torch.zeros(b, hq, nq, 4 * w)
    lse = torch.zeros(b, hq, nq)
    for bi in range(b):
        for h in range(hq):
            kvh = h // (hq // hkv)
            for mb in range(-(-nq // cfg.tile_m)):
                rows = slice(mb * cfg.tile_m, min((mb + 1) * cfg.tile_m, nq))
                n = rows.stop - rows.start
                res = [_cta_model(qp[bi, h], kp[bi, kvh], vp[bi, kvh], causal, scale, cfg, mb, r) for r in (0, 1)]
                assert torch.equal(res[0][1], res[1][1]), "the two CTAs disagree on lse"
                for r in (0, 1):
                    out[bi, h, rows, 2 * r * w:(2 * r + 2) * w] = res[r][0][:n]
                lse[bi, h, rows] = res[0][1][:n]
    return out[..., :d], lse


@pytest.mark.parametrize("shape", [
    # B, Hq, Hkv, Nq, Nkv, D, causal
    (1, 2, 2, 100, 150, 520, False),
    (1, 4, 2, 70, 200, 640, True),     # GQA, Nq < Nkv: tail-aligned diagonal
    (2, 2, 1, 130, 130, 1024, True),   # MQA, square causal, tail blocks
    (1, 2, 2, 90, 97, 768, True),      # tile_n 48
    (1, 1, 1, 64, 40, 896, False),     # Nkv < tile_m; tile_n 32
], ids=lambda s: "-".join(map(str, s)))
def test_column_split_model_matches_reference(shape):
    b, hq, hkv, nq, nkv, d, causal = shape
    g = torch.Generator().manual_seed(d + nq)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nkv, d, generator=g)
    v = torch.randn(b, hkv, nkv, d, generator=g)
    scale = 1.0 / math.sqrt(d)
    cfg = RecomputeFwdConfig(d, "bfloat16", causal)
    out, lse = recompute_model(q, k, v, causal, scale, cfg)
    ref, ref_lse = attention(q.double(), k.double(), v.double(), is_causal=causal, scale=scale)
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-4)


def test_model_detects_a_wrong_column_split():
    """The comparison can fail: O parts taken from the wrong CTA half differ from the reference."""
    q = torch.randn(1, 1, 64, 640)
    cfg = RecomputeFwdConfig(640, "bfloat16", False)
    out, _ = recompute_model(q, q, q, False, 0.05, cfg)
    ref, _ = attention(q, q, q, scale=0.05)
    w = cfg.d_wg
    swapped = torch.cat([out[..., 2 * w:], out[..., :2 * w]], dim=-1)[..., :640]
    assert not torch.allclose(swapped, ref, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# sm_90a compiles (~20-50 s each on a loaded 2-core machine): two in the default run (the largest D causal and a
# small D with the widest tile), the rest with FFPA_TEST_ALL_COMPILES=1 (the GPU tests run every D)

HAS_CUTLASS = True
try:  # pragma: no cover - depends on the environment
    import cutlass  # noqa: F401
    import cutlass.cute as cute  # noqa: F401
except Exception:  # noqa: BLE001
    HAS_CUTLASS = False
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")

_CHEAP = {(1024, True), (640, False)}
_ALL = bool(os.environ.get("FFPA_TEST_ALL_COMPILES"))
_MORE = (pytest.mark.slow, pytest.mark.skipif(not _ALL, reason="set FFPA_TEST_ALL_COMPILES=1 to compile every D"))
_COMPILE_CASES = [pytest.param(d, causal, marks=() if (d, causal) in _CHEAP else _MORE,
                               id=f"D{d}-{'causal' if causal else 'full'}")
                  for d in (520, 640, 768, 896, 1024) for causal in (False, True)]


@needs_cutlass
@pytest.mark.parametrize("d,causal", _COMPILE_CASES)
def test_recompute_compiles_for_sm90a(d, causal, tmp_path):
    from ffpa_attn.cutedsl._compile import compile_fwd

    from test_cute_compile import _ptxas_report

    cfg = RecomputeFwdConfig(d, "bfloat16", causal)
    ptx = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16" in ptx  # S
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.d_wg}k16.f32.bf16.bf16" in ptx  # P.V
    assert "shared::cluster" not in ptx and "mapa" not in ptx  # no DSMEM, no cluster
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", ptx)
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) == 0, report
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 168, report

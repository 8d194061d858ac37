"""CuTeDSL sm90a forward kernel on an H200 (skipped without CUDA / sm90 / nvidia-cutlass-dsl).

Calls :func:`ffpa_attn.cutedsl.api.run_forward` directly, so it tests every head dim the kernel compiles
for, not only those listed in ``SUPPORTED_HEAD_DIMS`` (the backends layer routes only those). Every
check is against the fp32 reference on fresh inputs, with the error of torch's own same-dtype SDPA as
the 2x baseline; outputs are fresh allocations the kernel must fully write (lse NaN-checked too).

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages python -m pytest -q tests/gpu/test_cute_gpu.py
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ffpa_attn.testing import (assert_close, assert_forward_close, assert_grads_close, make_qkv, reference_fwd_bwd,
                               sdpa_grad_errors, shape_id, sm90_with_cutedsl)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not sm90_with_cutedsl(), reason="needs an sm90 GPU and nvidia-cutlass-dsl")]

BF16, FP16 = torch.bfloat16, torch.float16


def check(q, k, v, causal, scale=None, **fwd_kw):
    """run_forward(q, k, v, causal, scale, **fwd_kw) against the fp32 reference; returns (out, lse)."""
    from ffpa_attn.cutedsl.api import run_forward

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, lse = run_forward(q, k, v, causal, scale, **fwd_kw)
    torch.cuda.synchronize()
    assert torch.isfinite(lse).all(), "lse has NaN/inf"
    assert_forward_close(out, lse, q, k, v, causal=causal, scale=scale, baseline=True, lse_atol=2e-3,
                         lse_scaled=True)
    return out, lse


SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype
    (1, 2, 2, 64, 64, 512, False, BF16),
    (1, 2, 2, 128, 128, 512, True, BF16),
    (2, 4, 4, 200, 200, 512, False, FP16),
    (2, 4, 4, 333, 333, 512, True, BF16),
    (1, 8, 2, 100, 777, 512, True, BF16),     # GQA 4, Nq < Nkv, tails
    (1, 8, 1, 257, 1000, 512, False, FP16),   # MQA
    (2, 3, 3, 1, 513, 512, True, BF16),       # one query row
    (1, 2, 2, 1024, 1024, 384, True, BF16),
    (1, 4, 2, 130, 300, 384, False, FP16),
    (1, 2, 2, 500, 700, 320, True, BF16),
    (1, 2, 1, 300, 300, 448, False, BF16),
    (1, 2, 2, 190, 260, 264, True, FP16),     # d_wg = 144: swizzle-32 layouts, zero-padded columns
    (1, 2, 2, 100, 100, 296, False, BF16),    # D not a multiple of 32
    # 2-CTA clusters: each CTA owns half of D, partial S exchanged through DSMEM
    (1, 2, 2, 64, 64, 1024, False, BF16),
    (1, 2, 2, 333, 333, 1024, True, BF16),
    (1, 8, 2, 100, 777, 1024, True, FP16),    # GQA 4, Nq < Nkv, tails
    (2, 4, 4, 200, 250, 768, False, BF16),
    (1, 4, 1, 130, 130, 640, True, BF16),     # MQA
    (1, 2, 2, 257, 300, 576, True, FP16),     # d_wg = 144
    (1, 2, 2, 99, 99, 520, False, BF16),      # last part mostly zero padding
]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward(shape):
    b, hq, hkv, nq, nkv, d, causal, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    check(q, k, v, causal)


def test_noncontiguous_and_scale():
    """[B, N, H, D] storage viewed as [B, H, N, D] (a model's transpose), a negative and a large scale."""
    q, k, v = make_qkv(2, 4, 2, 150, 260, 512, BF16, device="cuda", layout="bnhd")
    check(q, k, v, causal=True, scale=-0.07)
    check(q, k, v, causal=False, scale=0.2)


@pytest.mark.parametrize("d", [512, 1024])
def test_large_causal(d):
    q, k, v = make_qkv(1, 2, 2, 4096, 4096, d, BF16, device="cuda")
    check(q, k, v, causal=True)


def test_empty_and_no_keys():
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 2, 2, 0, 64, 512, BF16, device="cuda")
    out, lse = run_forward(q, k, v, False, 0.05)
    assert out.shape == (1, 2, 0, 512) and lse.shape == (1, 2, 0)
    q, k, v = make_qkv(1, 2, 2, 5, 0, 512, BF16, device="cuda")
    out, lse = run_forward(q, k, v, False, 0.05)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_deterministic_and_second_call_is_cached():
    import time

    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 4, 4, 256, 256, 512, BF16, device="cuda")
    out1, lse1 = run_forward(q, k, v, True, 0.05)
    t0 = time.perf_counter()
    out2, lse2 = run_forward(q, k, v, True, 0.05)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 0.5
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


# ---------------------------------------------------------------------------------------------------------
# backward (ffpa_attn.cutedsl.bwd_sm90; select with ``-k backward``). Small shapes first: with ``-x`` the first
# failure is the most informative one. Every case: fp32 autograd through ffpa_attn.reference, with torch's
# own same-dtype SDPA backward error as the 2x baseline where SDPA can run it (no row without keys).

def check_backward(q, k, v, causal, scale=None, with_dlse=False):
    from ffpa_attn.cutedsl.api import run_backward

    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    do = torch.randn_like(q)
    dlse = torch.randn(q.shape[:3], device=q.device) if with_dlse else None
    ref = reference_fwd_bwd(q, k, v, do, causal=causal, scale=scale, dlse=dlse)
    dq, dk, dv = run_backward(do, q, k, v, ref.out.to(q.dtype), ref.lse, causal, scale, dlse=dlse)
    torch.cuda.synchronize()
    assert dq.dtype == q.dtype and dk.dtype == k.dtype and dv.dtype == v.dtype
    base = None if with_dlse else sdpa_grad_errors(q, k, v, do, ref.grads, causal=causal, scale=scale)
    assert_grads_close((dq, dk, dv), ref.grads, q.dtype, baselines=base)
    return dq, dk, dv


BWD_SHAPES = [  # B, Hq, Hkv, Nq, Nkv, D, causal, dtype -- smallest first
    (1, 1, 1, 64, 64, 512, False, BF16),      # one key block, one query block
    (1, 1, 1, 64, 64, 512, True, BF16),
    (1, 1, 1, 128, 128, 512, False, FP16),    # two query blocks per key block
    (1, 2, 2, 128, 192, 512, True, BF16),     # Nq < Nkv, causal offset
    (1, 2, 2, 100, 100, 512, False, BF16),    # tails (rows and keys)
    (1, 2, 2, 333, 333, 512, True, BF16),
    (1, 4, 2, 130, 300, 512, True, BF16),     # GQA 2
    (1, 8, 2, 100, 777, 512, True, FP16),     # GQA 4, Nq << Nkv
    (1, 8, 1, 257, 200, 512, False, BF16),    # MQA, Nq > Nkv
    (1, 2, 2, 300, 200, 512, True, BF16),     # causal Nq > Nkv: the first 100 rows see no key -> zero grads
    (2, 3, 3, 1, 513, 512, True, BF16),       # one query row
    (2, 4, 4, 200, 200, 512, False, FP16),
    (1, 2, 2, 500, 700, 320, True, BF16),     # D=320: part 1 has a chunk wholly past D
    (1, 4, 2, 130, 300, 384, False, FP16),
    (1, 2, 1, 300, 300, 448, True, BF16),     # D=448: last chunk real, parts 4 + 3 chunks
    (1, 2, 2, 190, 260, 264, True, FP16),     # D=264: 8 real columns in the last chunk
    (1, 2, 2, 100, 150, 296, False, BF16),
    (1, 2, 2, 1024, 1024, 384, True, BF16),
    # D > 512: V / dO streamed next to their partner chunks, 3-4 dK/dV parts, 2 dQ parts
    (1, 1, 1, 64, 64, 1024, False, BF16),
    (1, 2, 2, 128, 192, 1024, True, BF16),    # Nq < Nkv, causal offset
    (1, 4, 2, 130, 300, 768, True, FP16),     # GQA 2, tails
    (1, 2, 2, 333, 333, 576, True, BF16),     # D=576: 3 parts x 3 chunks; dQ part 1 has a chunk past D
    (1, 2, 1, 300, 200, 640, True, BF16),     # causal Nq > Nkv (zero grads); dK/dV part 2 has 2 chunks past D
    (1, 2, 2, 100, 150, 520, False, FP16),    # D=520: 8 real columns in the last chunk
    (2, 3, 3, 1, 513, 896, True, BF16),       # one query row
    (1, 8, 1, 257, 200, 960, False, BF16),    # MQA, Nq > Nkv
]


@pytest.mark.parametrize("shape", BWD_SHAPES, ids=shape_id)
def test_backward(shape):
    b, hq, hkv, nq, nkv, d, causal, dtype = shape
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda")
    dq, dk, dv = check_backward(q, k, v, causal)
    if causal and nq > nkv:  # rows that see no key: exactly zero dq
        assert (dq[:, :, : nq - nkv] == 0).all()


@pytest.mark.parametrize("d", [512, 1024])
def test_backward_noncontiguous_scale_dlse(d):
    """[B, N, H, D] storage viewed as [B, H, N, D], a negative and a large scale, a gradient on lse."""
    q, k, v = make_qkv(2, 4, 2, 150, 260, d, BF16, device="cuda", layout="bnhd")
    check_backward(q, k, v, causal=True, scale=-0.07)
    check_backward(q, k, v, causal=False, scale=0.2)
    check_backward(q, k, v, causal=True, with_dlse=True)


def test_backward_protocol_and_rejects():
    """``ffpa_attn.cutedsl.dense_backward`` returns (dq, dk, dv, None); D > 1024 raises ValueError."""
    import ffpa_attn.cutedsl as cute_mod

    q, k, v = make_qkv(1, 2, 1, 70, 90, 512, BF16, device="cuda")
    do = torch.randn_like(q)
    ref = reference_fwd_bwd(q, k, v, do, causal=True, scale=0.05)
    res = cute_mod.dense_backward(do, q, k, v, ref.out.to(q.dtype), ref.lse, dlse=None, attn_mask=None,
                                  mask_grad=False, dropout_p=0.0, rng=None, causal=True, scale=0.05, config=None,
                                  kernel="bwd_sm90+bwd_dq_sm90")
    assert len(res) == 4 and res[3] is None and res[1].shape == k.shape
    q, k, v = make_qkv(1, 2, 2, 64, 64, 1032, BF16, device="cuda")
    with pytest.raises(ValueError, match="1024"):
        cute_mod.dense_backward(q, q, k, v, q, torch.zeros(1, 2, 64, device="cuda"), dlse=None, attn_mask=None,
                                mask_grad=False, dropout_p=0.0, rng=None, causal=False, scale=0.05, config=None,
                                kernel="bwd_sm90+bwd_dq_sm90")


def test_autograd_on_cold_cache_compiles_backward_in_children(tmp_path, monkeypatch):
    """ffpa_attn_func with inputs that require grad, on an empty kernel cache: the forward starts compiling the
    backward's two kernels in compile workers (children of a compile server, a fresh interpreter with no GPU
    visible; this process has a CUDA context and is never forked), the backward waits for them and loads their
    files; gradients match the reference."""
    from ffpa_attn import ffpa_attn_func
    from ffpa_attn.cutedsl import _cache

    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FFPA_ATTN_CUTE_PARALLEL_COMPILE", raising=False)

    def forbidden(*a, **k):
        raise AssertionError("os.fork called in a process with a CUDA context")

    monkeypatch.setattr(os, "fork", forbidden)
    from ffpa_attn.cache import key_name
    from ffpa_attn.cutedsl import api

    _cache.clear_memory_cache()
    api._PREFETCHED.clear()
    q, k, v = make_qkv(1, 4, 2, 130, 300, 448, BF16, device="cuda")
    do = torch.randn_like(q)
    scale = 1.0 / math.sqrt(448)
    ref = reference_fwd_bwd(q, k, v, do, causal=True, scale=scale)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="cutedsl")
    assert len(_cache.KERNELS.pending()) == 2, _cache.KERNELS.pending()  # dK/dV and dQ kernels compiling in children
    out.backward(do)
    torch.cuda.synchronize()
    assert not _cache.KERNELS.pending()
    cfg = api.bwd_config(448, BF16, True)
    names = {p.stem for p in (tmp_path / "cute").rglob("*.so")}
    assert {key_name(cfg.key()), key_name(cfg.dq_key())} <= names, names
    jobs = _cache.pool().job_records()[-2:]
    assert all(j["ok"] and j["compiled"] for j in jobs), jobs
    assert not _cache.pool().startup_stats().get("torch_imported", True)
    assert_grads_close((q.grad, k.grad, v.grad), ref.grads, q.dtype)
    _cache.clear_memory_cache()


@pytest.mark.parametrize("d", [512, 1024])
def test_backward_large_causal(d):
    """bf16 causal backward at N=8192 (the target shape), B=1, H=2."""
    q, k, v = make_qkv(1, 2, 2, 8192, 8192, d, BF16, device="cuda")
    check_backward(q, k, v, causal=True)


def test_backward_is_deterministic():
    """Every dQ, dK and dV element is written once (no reductions across CTAs): dq, dk, dv bit-identical across
    calls, also with GQA and causal Nq < Nkv."""
    from ffpa_attn.cutedsl.api import run_backward

    q, k, v = make_qkv(1, 8, 2, 300, 700, 512, BF16, device="cuda")
    do = torch.randn_like(q)
    ref = reference_fwd_bwd(q, k, v, do, causal=True, scale=0.05)
    g1 = run_backward(do, q, k, v, ref.out.to(q.dtype), ref.lse, True, 0.05)
    g2 = run_backward(do, q, k, v, ref.out.to(q.dtype), ref.lse, True, 0.05)
    assert_close(g1[0], ref.dq, q.dtype, "dq")
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


# ------------------------------------------------------------------------------- last-wave split (tail_split)


@pytest.mark.parametrize("d,hq,hkv,layout", [(512, 2, 1, "bhnd"), (320, 2, 2, "bnhd"), (384, 10, 5, "bhnd"),
                                             (448, 1, 1, "bhnd")])
def test_forward_tail_split_forced(d, hq, hkv, layout):
    """8 "SMs" (``_sms``): hq x 9 query blocks leave a partial last wave (1 or 2 blocks) that runs over 8 or 4 KV
    slices (cta_limit on the main launch); against the reference and the unsplit launch (main rows bit-equal)."""
    from ffpa_attn.cutedsl.api import run_forward
    from ffpa_attn.dispatch.waves import plan_tail_split

    nq, nkv = 9 * 64, 640
    split = plan_tail_split(1, hq, nq, nkv, 64, 8, causal=False, min_slice_keys=64)
    assert split is not None and split.slices >= 4
    r0 = split.row0
    q, k, v = make_qkv(1, hq, hkv, nq, nkv, d, BF16, device="cuda", layout=layout)
    scale = d ** -0.5
    out, lse = run_forward(q, k, v, False, scale, tail=split)
    full_o, full_l = run_forward(q, k, v, False, scale)
    assert_forward_close(out, lse, q, k, v, scale=scale)
    assert torch.equal(out[0, :-1], full_o[0, :-1]) and torch.equal(out[0, -1, :r0], full_o[0, -1, :r0])
    assert torch.equal(lse[0, :-1], full_l[0, :-1]) and torch.equal(lse[0, -1, :r0], full_l[0, -1, :r0])
    assert (out[0, -1, r0:].float() - full_o[0, -1, r0:].float()).abs().max().item() < 2e-2


def test_forward_tail_split_benchmark_shape():
    """B=1, H=32, N=8192, D=512 non-causal on the real SM count: main rows bit-equal to the unsplit launch, the
    tail head against the reference."""
    import ffpa_attn
    from ffpa_attn.common.tail_split import TailSplit
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 32, 32, 8192, 8192, 512, BF16, device="cuda")
    spec = ffpa_attn.explain(q, k, v, backend="cutedsl").forward.spec  # the planner's split on this GPU
    if spec.get("tail") is None:
        pytest.skip("no partial last wave on this GPU")
    split = TailSplit(*spec.get("tail"))
    out, lse = run_forward(q, k, v, False, 512 ** -0.5, tile_n=spec.get("tile_n"), tail=split)
    full_o, _ = run_forward(q, k, v, False, 512 ** -0.5, tile_n=spec.get("tile_n"))
    r0 = split.row0
    assert torch.equal(out[0, :31], full_o[0, :31]) and torch.equal(out[0, 31, :r0], full_o[0, 31, :r0])
    assert_forward_close(out[:, 31:], lse[:, 31:], q[:, 31:], k[:, 31:], v[:, 31:], scale=512 ** -0.5)  # tail head


def test_forward_through_the_op_runs_the_planned_tail_split():
    """The op runs the planner's split verbatim: the public call equals run_forward with the spec's parameters, bit
    for bit (D=512 on this GPU's SM count, where a partial last wave exists at B=1 H=32 N=8192)."""
    import ffpa_attn
    from ffpa_attn.common.tail_split import TailSplit
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v = make_qkv(1, 32, 32, 8192, 8192, 512, BF16, device="cuda")
    spec = ffpa_attn.explain(q, k, v, backend="cutedsl").forward.spec
    tail = spec.get("tail")
    out = ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl")
    direct = run_forward(q, k, v, False, 512 ** -0.5, tile_n=spec.get("tile_n"),
                         tail=TailSplit(*tail) if tail else None)[0]
    assert torch.equal(out, direct)

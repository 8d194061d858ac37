"""CUDA backend on a GPU: forward (out and lse) against the fp32 reference through the public API, over
D x causal x GQA x tails x acc x stages, plus the backward through the Triton backend; the same grid for the
32-rows-per-warp kernel (rm = 2) selected with the internal knob FFPA_ATTN_CUDA_ROWS_PER_WARP=32.

Run on the H200: ``python -m pytest -q tests/gpu/test_cuda_gpu.py``.
"""
from __future__ import annotations

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn import CUDABackend
from ffpa_attn.testing import (TOL, assert_close, assert_forward_close, assert_results_close, func_fwd_bwd, make_qkv,
                               reference_fwd_bwd, rel_err)

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def rows16(monkeypatch):
    """The grid below runs the 16-rows-per-warp kernel (rm = 1) unless a test asks for ``rows32``; on an
    H200 the planner's default is rm = 2 (heuristics "cuda_rows_per_warp_32"), see
    test_default_on_hopper_is_32_rows."""
    monkeypatch.setenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", "16")


def _poison_allocator(*shapes_dtypes) -> None:
    """Leave NaN in the caching allocator's free blocks of these sizes: outputs that reuse them and miss a
    write show up as NaN."""
    blocks = [torch.full(s, float("nan"), dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    del blocks


def _check_forward(b, hq, hkv, nq, nkv, d, dtype, causal, cfg, layout="bhnd", scale=None):
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype, device="cuda", layout=layout)
    _poison_allocator(((b, hq, nq, d), dtype), ((b, hq, nq), torch.float32))
    out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=causal, scale=scale, enable_gqa=hq != hkv,
                                       forward_backend=cfg)
    err = assert_forward_close(out, lse, q, k, v, causal=causal, scale=scale, baseline=True)
    # the public function returns the same out
    out2 = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, scale=scale, enable_gqa=hq != hkv,
                                    forward_backend=cfg)
    assert torch.equal(out2, out)
    return err


@pytest.mark.parametrize("d", [288, 300, 320, 384, 448, 512, 576, 640, 768, 896, 960, 1024])
@pytest.mark.parametrize("dt,acc", [("bf16", "f32"), ("fp16", "f32"), ("fp16", "f16")])
def test_head_dims_and_accumulators(d, dt, acc):
    _check_forward(1, 2, 2, 200, 200, d, DTYPES[dt], False, CUDABackend(acc=acc))


@pytest.mark.parametrize("d", [320, 512, 640, 1024])
@pytest.mark.parametrize("nq,nkv", [(130, 300), (64, 64), (1, 513), (257, 257), (100, 1000)])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_causal_tail_aligned_with_gqa(d, nq, nkv, dt):
    _check_forward(2, 4, 2, nq, nkv, d, DTYPES[dt], True, CUDABackend())


@pytest.mark.parametrize("d", [512, 1024])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_pipeline_stages(d, stages, causal):
    _check_forward(1, 2, 1, 190, 333, d, torch.bfloat16, causal, CUDABackend(stages=stages))


@pytest.mark.parametrize("nq,nkv", [(1, 1), (65, 1), (3, 70), (129, 64), (64, 127)])
def test_cross_attention_tails(nq, nkv):
    _check_forward(1, 3, 3, nq, nkv, 512, torch.float16, False, CUDABackend())


@pytest.mark.parametrize("d", [320, 512, 1000])
def test_strided_inputs_and_scale(d):
    """[B, N, H, D] storage viewed as [B, H, N, D] (what model code passes), MQA, a custom scale."""
    _check_forward(2, 4, 1, 150, 180, d, torch.bfloat16, True, CUDABackend(), layout="bnhd", scale=0.02)


def test_non_unit_d_stride_is_copied():
    q, k, v = make_qkv(1, 2, 2, 96, 96, 512, torch.float16, device="cuda")
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # D stride != 1
    out = ffpa_attn.ffpa_attn_func(qt, k, v, forward_backend="cuda")
    ref, _ = reference.attention(q, k, v)
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("d,causal,gqa", [(512, True, True), (320, False, False), (1024, True, False)])
def test_backward_through_triton(d, causal, gqa):
    hq, hkv = (4, 2) if gqa else (2, 2)
    q, k, v = make_qkv(1, hq, hkv, 160, 200, d, torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    got = func_fwd_bwd(q, k, v, dout, is_causal=causal, enable_gqa=gqa, forward_backend="cuda",
                       backward_backend="triton")
    assert all(g is not None and g.dtype == torch.bfloat16 for g in got.grads[:3])
    assert_results_close(got, reference_fwd_bwd(q, k, v, dout, causal=causal), torch.bfloat16,
                         tol=2 * TOL[torch.bfloat16])


def test_explicit_plan_reports_cuda():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 512, torch.bfloat16, device="cuda")
    plan = ffpa_attn.explain(q, k, v, forward_backend=CUDABackend(stages=2))
    assert plan.forward.backend == "cuda" and plan.backward.backend == "triton"


def test_kernel_uses_no_local_memory():
    from ffpa_attn.cuda import launch

    q, k, v = make_qkv(1, 2, 2, 64, 64, 512, torch.bfloat16, device="cuda")
    plan = launch.make_plan(q, "f32", None)
    kern = launch.get_kernel(plan, q.device)
    assert kern.local_bytes == 0, f"{plan.spec.name} spills {kern.local_bytes} B/thread"
    assert kern.num_regs <= 255


# ------------------------------------------------- 32 rows per warp (rm = 2, reduce-scatter of S partials)
# Selected through the knob FFPA_ATTN_CUDA_ROWS_PER_WARP=32 (read by the planner), so the public API path
# (validation, GQA, layouts, lse) is the one exercised.


@pytest.fixture
def rows32(monkeypatch):
    monkeypatch.setenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", "32")


def _assert_rm2(q, acc="f32", stages=None):
    """The planner names 32 rows per warp for q's head dim, and the launch plan of that is the rm = 2 kernel."""
    from ffpa_attn.cuda import launch

    rows = ffpa_attn.explain(q, q, q, backend=CUDABackend(acc=acc, stages=stages)).forward.spec.get("rows_per_warp")
    assert rows == 32
    plan = launch.make_plan(q, acc, stages, rows)
    assert plan.spec.rm == 2, plan
    return plan


@pytest.mark.parametrize("d", [300, 320, 384, 448, 512, 576, 640, 768, 1000, 1024])
@pytest.mark.parametrize("dt,acc", [("bf16", "f32"), ("fp16", "f32"), ("fp16", "f16")])
def test_rm2_head_dims_and_accumulators(rows32, d, dt, acc):
    q = torch.empty(1, 1, 1, d, dtype=DTYPES[dt], device="cuda")
    _assert_rm2(q, acc)
    _check_forward(1, 2, 2, 200, 200, d, DTYPES[dt], False, CUDABackend(acc=acc))


@pytest.mark.parametrize("d", [320, 512, 640, 1024])
@pytest.mark.parametrize("nq,nkv", [(130, 300), (64, 64), (1, 513), (257, 257), (100, 1000), (65, 1), (3, 70)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_rm2_causal_gqa_tails(rows32, d, nq, nkv, causal, dt):
    if causal and nkv < nq:
        pytest.skip("causal needs Nkv >= Nq (a ValueError, tested in test_contract.py)")
    _check_forward(2, 4, 2, nq, nkv, d, DTYPES[dt], causal, CUDABackend())


@pytest.mark.parametrize("d", [512, 1024])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("acc", ["f32", "f16"])
def test_rm2_pipeline_stages(rows32, d, stages, causal, acc):
    q = torch.empty(1, 1, 1, d, dtype=torch.float16, device="cuda")
    _assert_rm2(q, acc, stages)
    _check_forward(1, 2, 1, 190, 333, d, torch.float16, causal, CUDABackend(acc=acc, stages=stages))


@pytest.mark.parametrize("d", [320, 512, 1000])
def test_rm2_strided_inputs_and_scale(rows32, d):
    _check_forward(2, 4, 1, 150, 180, d, torch.bfloat16, True, CUDABackend(), layout="bnhd", scale=0.02)


def test_rm2_long_sequence_matches_16_rows(monkeypatch):
    """Many key tiles (running max/rescale path): 32 rows per warp against the reference and 16 rows."""
    q, k, v = make_qkv(1, 2, 2, 1500, 2100, 512, torch.bfloat16, device="cuda")
    outs = {}
    for rows in ("16", "32"):
        monkeypatch.setenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", rows)
        outs[rows] = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, forward_backend=CUDABackend())
    assert_forward_close(*outs["32"], q, k, v, causal=True)
    assert rel_err(outs["32"][0], outs["16"][0]) < 1e-2


@pytest.mark.parametrize("d,acc,dt", [(512, "f32", torch.bfloat16), (1024, "f32", torch.bfloat16),
                                      (512, "f16", torch.float16), (768, "f32", torch.float16)])
def test_rm2_kernel_uses_no_local_memory(rows32, d, acc, dt):
    from ffpa_attn.cuda import launch

    q = torch.empty(1, 1, 1, d, dtype=dt, device="cuda")
    plan = _assert_rm2(q, acc)
    kern = launch.get_kernel(plan, q.device)
    assert kern.local_bytes == 0, f"{plan.spec.name} spills {kern.local_bytes} B/thread"
    assert kern.num_regs <= 255


def test_default_on_hopper_is_32_rows(monkeypatch):
    """Without the knob, an sm_90 device gets the rm = 2 kernel at every head dim (measured faster)."""
    monkeypatch.delenv("FFPA_ATTN_CUDA_ROWS_PER_WARP")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    for d in (320, 512, 640, 1024):
        q = torch.empty(1, 1, 1, d, dtype=torch.bfloat16, device="cuda")
        _assert_rm2(q)
    _check_forward(1, 4, 2, 300, 700, 512, torch.bfloat16, True, CUDABackend())


# ------------------------------------------------------------------------------- last-wave split (tail_split)
# Non-causal launches whose CTA count leaves a short last wave run it as a split-KV launch of the same
# kernel (cta_limit on the main launch, stride-0 q repeat over K/V slices, lse merge).


@pytest.mark.parametrize("rows", ["16", "32"])
@pytest.mark.parametrize("d,hq,hkv,layout", [(512, 2, 1, "bhnd"), (320, 2, 2, "bnhd"), (1024, 2, 1, "bhnd")])
def test_tail_split_forced(monkeypatch, rows, d, hq, hkv, layout):
    """8 "SMs": 2 heads x 9 blocks = 2 waves + 2 tail blocks over 4 slices of 160 keys; against the reference
    and the unsplit launch (the main rows bit-equal)."""
    from ffpa_attn.cuda import launch
    from ffpa_attn.dispatch.waves import plan_tail_split

    rpw = int(rows)
    bm = launch.make_plan(torch.empty(1, 1, 1, d, dtype=torch.bfloat16, device="cuda"), "f32", None,
                          rpw).spec.block_m
    nq, nkv, r0 = 9 * bm, 640, 7 * bm
    q, k, v = make_qkv(1, hq, hkv, nq, nkv, d, torch.bfloat16, device="cuda", layout=layout)
    split = plan_tail_split(1, hq, nq, nkv, bm, 8, causal=False, min_slice_keys=64)
    assert split is not None and split.slices == 4 and split.row0 == r0
    _poison_allocator(((1, hq, nq, d), torch.bfloat16), ((1, hq, nq), torch.float32))
    out, lse = launch.forward(q, k, v, False, d ** -0.5, rows_per_warp=rpw, tail=split)
    full_o, full_l = launch.forward(q, k, v, False, d ** -0.5, rows_per_warp=rpw)
    assert_forward_close(out, lse, q, k, v, scale=d ** -0.5)
    assert torch.equal(out[0, :-1], full_o[0, :-1]) and torch.equal(out[0, -1, :r0], full_o[0, -1, :r0])
    assert torch.equal(lse[0, -1, :r0], full_l[0, -1, :r0]) and torch.equal(lse[0, :-1], full_l[0, :-1])
    assert rel_err(out[0, -1, r0:], full_o[0, -1, r0:]) < 1e-2


def test_tail_split_h200_benchmark_shape():
    """The benchmark shape (B=1, H=32, N=8192, D=512 non-causal) on this GPU's real SM count: the split (when
    the rule takes it) against the unsplit launch and, on the tail head, the reference."""
    import ffpa_attn
    from ffpa_attn.common.tail_split import TailSplit
    from ffpa_attn.cuda import launch

    q, k, v = make_qkv(1, 32, 32, 8192, 8192, 512, torch.bfloat16, device="cuda")
    spec = ffpa_attn.explain(q, k, v, backend="cuda").forward.spec  # the planner's rows and split on this GPU
    if spec.get("tail") is None:
        pytest.skip("no partial last wave on this GPU")
    split = TailSplit(*spec.get("tail"))
    out, lse = launch.forward(q, k, v, False, 512 ** -0.5, rows_per_warp=spec.get("rows_per_warp"), tail=split)
    full_o, full_l = launch.forward(q, k, v, False, 512 ** -0.5, rows_per_warp=spec.get("rows_per_warp"))
    r0 = split.row0
    assert torch.equal(out[0, :31], full_o[0, :31]) and torch.equal(out[0, 31, :r0], full_o[0, 31, :r0])
    assert_forward_close(out[:, 31:], lse[:, 31:], q[:, 31:], k[:, 31:], v[:, 31:], scale=512 ** -0.5)  # tail head
    assert rel_err(out[0, 31, r0:], full_o[0, 31, r0:]) < 1e-2

"""CUDA backend on CPU: config validation through the public API, launch planning, the cubin cache, a compile
of every kernel instantiation for sm_80 and sm_90a with nvcc ``-Xptxas -v`` (no errors, no spills), and the
kernel's index math through its lane-level emulator (tests/emulators/cuda_lanes.py) against the reference.
"""
from __future__ import annotations

import re

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn import CUDABackend
from ffpa_attn.cuda import build, compile_check
from ffpa_attn.cuda.config import (
    SUPPORTED_DPADS,
    KernelSpec,
    LaunchPlan,
    default_stages,
    head_dim_tiling,
    instantiations,
    plan_launch,
)
from ffpa_attn.testing import assert_close, assert_lse_close, make_qkv

from emulators import cuda_lanes

H200_SMEM = 232448  # opt-in shared memory per block (sm90)
A100_SMEM = 166912  # sm80
ADA_SMEM = 101376  # sm86 / sm89

# ------------------------------------------------------------------------------ validation (public API)


@pytest.mark.parametrize("kwargs", [{"acc": "f8"}, {"acc": "fp32"}, {"stages": 0}, {"stages": 5},
                                    {"stages": True}, {"stages": 2.0}])
def test_invalid_config_raises_at_construction(kwargs):
    with pytest.raises(ValueError):
        CUDABackend(**kwargs)


def test_bf16_with_f16_accumulator_is_a_value_error():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.bfloat16)
    with pytest.raises(ValueError, match="acc='f16'"):
        ffpa_attn.ffpa_attn_func(q, k, v, forward_backend=CUDABackend(acc="f16"))
    with pytest.raises(ValueError, match="acc='f16'"):
        ffpa_attn.ffpa_attn_func(q, k, v, backend=CUDABackend(acc="f16"))


@pytest.mark.parametrize("fwd", ["cuda", CUDABackend(acc="f16", stages=2)])
def test_cuda_backend_on_cpu_is_not_silently_replaced(fwd):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float16)
    with pytest.raises(NotImplementedError, match="cuda"):
        ffpa_attn.ffpa_attn_func(q, k, v, forward_backend=fwd)
    with pytest.raises(NotImplementedError, match="cuda"):
        ffpa_attn.explain(q, k, v, forward_backend=fwd)


def test_cuda_backend_rejects_what_it_cannot_do():
    mod = pytest.importorskip("ffpa_attn.cuda")
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float16)
    mask = torch.ones(8, 8, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        mod.dense_forward(q, k, v, attn_mask=mask, dropout_p=0.0, rng=None, causal=False, scale=0.1,
                          config=CUDABackend(), kernel="fwd")
    with pytest.raises(NotImplementedError, match="dropout"):
        mod.dense_forward(q, k, v, attn_mask=None, dropout_p=0.1, rng=None, causal=False, scale=0.1,
                          config=CUDABackend(), kernel="fwd")
    for fn in (mod.dense_backward, mod.varlen_forward, mod.varlen_backward):
        with pytest.raises(NotImplementedError, match="forward-only"):
            fn()


# ------------------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("d", [257, 288, 300, 320, 384, 448, 500, 512, 513, 576, 640, 700, 768, 896, 960, 1000, 1024])
def test_head_dim_tiling(d):
    dpad, wn = head_dim_tiling(d)
    assert dpad >= d and dpad - d < 32 * wn
    assert dpad % (32 * wn) == 0 and dpad // wn <= 256  # <= 128 fp32 O registers per thread
    assert dpad in SUPPORTED_DPADS
    assert wn == (2 if d <= 512 else 4)


@pytest.mark.parametrize("d", [256, 1025, 64])
def test_head_dim_outside_range(d):
    with pytest.raises(ValueError):
        head_dim_tiling(d)


@pytest.mark.parametrize("dtype,acc", [(torch.float16, "f32"), (torch.float16, "f16"), (torch.bfloat16, "f32")])
@pytest.mark.parametrize("cap,limit", [((9, 0), H200_SMEM), ((8, 0), A100_SMEM), ((8, 9), ADA_SMEM)])
def test_default_plan_fits_every_head_dim(dtype, acc, cap, limit):
    for d in range(264, 1025, 8):
        plan = plan_launch(d, dtype, acc, None, cap, limit)
        assert plan.smem_bytes <= limit, (d, plan)
        assert plan.spec in instantiations("sm_90a" if cap == (9, 0) else "sm_80")
        assert plan.spec.bf16 == (dtype == torch.bfloat16) and plan.spec.acc16 == (acc == "f16")
        assert 1 <= plan.stages <= default_stages(cap) and plan.xbufs in (1, 2)


def test_hopper_plans_use_eight_warps_and_deep_pipelines():
    """The 16-rows-per-warp plans (rm = 1; the default off sm_90a, forced here)."""
    for d in (320, 512, 768, 1024):
        plan = plan_launch(d, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=16)
        assert plan.spec.nw == 8 and plan.stages == 4
    p512 = plan_launch(512, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=16)
    assert (p512.spec.block_m, p512.spec.chunk_cols, p512.xbufs, p512.smem_bytes) == (64, 256, 1, 224 * 1024)
    p512s3 = plan_launch(512, torch.bfloat16, "f32", 3, (9, 0), H200_SMEM, rows_per_warp=16)
    assert (p512s3.xbufs, p512s3.smem_bytes) == (2, 224 * 1024)
    p1024 = plan_launch(1024, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=16)
    assert (p1024.spec.block_m, p1024.spec.chunk_cols, p1024.xbufs, p1024.smem_bytes) == (32, 256, 1, 224 * 1024)
    assert plan_launch(384, torch.float16, "f32", None, (8, 0), A100_SMEM).stages == 3
    assert plan_launch(512, torch.float16, "f32", None, (8, 0), A100_SMEM).stages == 2  # 32 KiB chunks


def test_explicit_stages_are_honoured_or_refused():
    for st in (1, 2, 3, 4):
        assert plan_launch(512, torch.float16, "f32", st, (9, 0), H200_SMEM).stages == st
    with pytest.raises(NotImplementedError, match="stages=4"):
        plan_launch(1024, torch.float16, "f32", 4, (8, 9), ADA_SMEM)
    with pytest.raises(ValueError, match="acc='f16'"):
        plan_launch(512, torch.bfloat16, "f16", None, (9, 0), H200_SMEM)
    with pytest.raises(ValueError):
        plan_launch(512, torch.float16, "f64", None, (9, 0), H200_SMEM)
    with pytest.raises(TypeError):
        plan_launch(512, torch.float32, "f32", None, (9, 0), H200_SMEM)


def test_smem_formula_matches_layout():
    spec = KernelSpec(512, 2, 8, True, False)
    # Q 64 x 512 halves + 4 chunks of 64 keys x 256 columns + 2 x (8 warps x 16 x 64 fp32)
    assert LaunchPlan(spec, 4, 2).smem_bytes == 64 * 512 * 2 + 4 * 64 * 256 * 2 + 2 * 8 * 16 * 64 * 4
    assert [KernelSpec(d, w, 8, False, False).chunk_cols for d, w in ((320, 2), (384, 2), (512, 2), (640, 4),
                                                                      (768, 4), (1024, 4))] == [64, 128, 256, 128, 256, 256]
    assert KernelSpec(1024, 4, 8, False, True).chunk_cols == 128  # acc f16 streams 32-column pieces
    with pytest.raises(ValueError):
        KernelSpec(512, 2, 8, True, True)
    forced = KernelSpec(512, 2, 8, True, False, cw=64)  # exploration override of the chunk width
    assert forced.chunk_cols == 128 and forced.defines()["FFPA_CW"] == 64 and forced.name.endswith("_cw64")
    assert "FFPA_CW" not in spec.defines() and forced not in instantiations("sm_90a")
    for bad in (48, 256):
        with pytest.raises(ValueError):
            KernelSpec(512, 2, 8, True, False, cw=bad)
    with pytest.raises(ValueError):
        KernelSpec(640, 4, 8, True, False, cw=64)  # 160 columns per warp do not split into 64s


def test_rows_per_warp_32_plans_and_layout(monkeypatch):
    """rm = 2 (32 rows per warp): tiling, shared memory, the internal knob and the fallback to 16 rows."""
    monkeypatch.delenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", raising=False)
    assert [head_dim_tiling(d, 2) for d in (300, 320, 384, 448, 512, 576, 640, 768, 1000, 1024)] == [
        (384, 4), (384, 4), (384, 4), (512, 4), (512, 4), (768, 8), (768, 8), (768, 8), (1024, 8), (1024, 8)]
    spec = KernelSpec(512, 4, 8, True, False, rm=2)
    assert (spec.block_m, spec.rows_per_warp, spec.chunk_cols) == (64, 32, 256)
    assert spec.defines()["FFPA_RM"] == 2 and spec.name.endswith("_rm2")
    assert "FFPA_RM" not in KernelSpec(512, 2, 8, True, False).defines()
    # Q 64 x 512 + 3 chunks of 64 x 256 + partials (8 warps x 32 x 64 fp32) + row maxima (8 warps x 32 fp32)
    assert LaunchPlan(spec, 3, 1).smem_bytes == 64 * 1024 + 3 * 32 * 1024 + 64 * 1024 + 1024 <= H200_SMEM
    assert LaunchPlan(spec, 4, 1).smem_bytes > H200_SMEM
    for bad in ((512, 2, 8, True, False, 0, 2), (1024, 4, 8, True, False, 0, 2), (512, 4, 8, True, False, 0, 3)):
        with pytest.raises(ValueError):
            KernelSpec(*bad)
    for d, stages in ((320, 4), (512, 3), (640, 3), (1024, 3)):
        p16 = plan_launch(d, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=16)
        assert p16.spec.rm == 1 and p16.spec in instantiations("sm_90a")
        p32 = plan_launch(d, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=32)
        assert p32.spec.rm == 2 and p32.xbufs == 1 and p32.stages == stages
        assert p32.spec in instantiations("sm_90a") and p32.smem_bytes <= H200_SMEM
        # rows per warp is the planner's choice (heuristics "cuda_rows_per_warp_32"); unnamed: 16
        assert plan_launch(d, torch.bfloat16, "f32", None, (9, 0), H200_SMEM) == p16
    assert plan_launch(512, torch.float16, "f16", 2, (9, 0), H200_SMEM, rows_per_warp=32).spec.rm == 2
    # stages=4 at D=512 does not fit with rm = 2: the 16-row plan serves it
    assert plan_launch(512, torch.bfloat16, "f32", 4, (9, 0), H200_SMEM, rows_per_warp=32).spec.rm == 1
    assert plan_launch(512, torch.bfloat16, "f32", None, (8, 9), ADA_SMEM, rows_per_warp=32).spec.rm == 1
    with pytest.raises(ValueError, match="rows_per_warp"):
        plan_launch(768, torch.bfloat16, "f32", None, (9, 0), H200_SMEM, rows_per_warp=24)


def test_params_layout_matches_the_kernel():
    from ffpa_attn.cuda.launch import PARAMS

    src = build.kernel_source()
    m = re.search(r"sizeof\(FfpaParams\) == (\d+)", src)
    assert m and int(m.group(1)) == PARAMS.size == 184


# ------------------------------------------------------------------------------------------ the cache


class _FakeCompiler:
    name = "fake"
    version = "1.0"

    def __init__(self):
        self.calls = 0

    def compile(self, source, options, filename):
        self.calls += 1
        return f"cubin:{len(source)}:{' '.join(options)}".encode(), ""


def test_cubin_cache_roundtrip_and_key(monkeypatch, tmp_path):
    fake = _FakeCompiler()
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "compiler", lambda: fake)
    build.CUBINS.clear_memory()
    spec = KernelSpec(512, 2, 8, True, False)
    first = build.get_binary(spec, "sm_90a")
    assert not first.from_cache and fake.calls == 1 and first.path.parent.parent == tmp_path / "cuda"
    assert first.path.read_bytes() == first.cubin and first.key in first.path.name
    assert b"-arch=sm_90a" in first.cubin and b"-DFFPA_DPAD=512" in first.cubin
    again = build.get_binary(spec, "sm_90a")
    assert again.from_cache and again.cubin == first.cubin and fake.calls == 1
    assert not list((tmp_path / "cuda").rglob(".tmp_*"))  # atomic write left no temp file
    build.CUBINS.clear_memory()  # a new process: the disk answers
    assert build.get_binary(spec, "sm_90a").from_cache and fake.calls == 1
    # anything that changes the binary changes the key
    assert build.get_binary(spec, "sm_80").key != first.key
    assert build.get_binary(KernelSpec(512, 2, 8, False, False), "sm_90a").key != first.key
    monkeypatch.setattr(build, "kernel_source", lambda: build.KERNEL_SOURCE.read_text() + "\n// edit\n")
    assert build.get_binary(spec, "sm_90a").key != first.key
    fake.version = "2.0"
    assert build.cache_key(spec, "sm_90a", "x", fake) != build.cache_key(spec, "sm_90a", "x", _FakeCompiler())
    assert fake.calls == 4


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(build, "_COMPILER", None)
    monkeypatch.setenv("FFPA_ATTN_CUDA_COMPILER", "nvcc")
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(RuntimeError, match="nvidia-cuda-nvrtc"):
        build.compiler()


# ------------------------------------------------------------------------------- compile (nvcc, no GPU)


def test_ptxas_parser():
    log = ("ptxas info    : Compiling entry function 'k1' for 'sm_90a'\nptxas info    : Function properties for k1\n"
           "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 16 barriers\n"
           "ptxas info    : Compiling entry function 'k2' for 'sm_90a'\nptxas info    : Function properties for k2\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 200 registers, used 16 barriers\n")
    rep = compile_check.parse_ptxas(log)
    assert rep["k1"].spills and (rep["k1"].registers, rep["k1"].spill_loads) == (255, 16)
    assert not rep["k2"].spills and rep["k2"].registers == 200


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_every_instantiation_compiles_without_spills(arch):
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    report = compile_check.compile_arch(arch)
    specs = instantiations(arch)
    assert len(report.functions) >= len(specs)
    assert not report.failures(), "register spills:\n" + "\n".join(report.failures())
    for s in specs:
        assert report.functions[s.name].registers <= 255


def test_nvrtc_compiles_the_header_free_source(monkeypatch, tmp_path):
    """NVRTC has no toolkit headers: the source must compile as is (skipped without libnvrtc)."""
    nvrtc = None
    for path in build._nvrtc_candidates():
        try:
            nvrtc = build.NVRTC(path)
            break
        except (OSError, AttributeError, RuntimeError):
            continue
    if nvrtc is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc)")
    for spec in (KernelSpec(640, 4, 8, False, True), KernelSpec(1024, 8, 8, True, False, rm=2)):
        cubin, _ = nvrtc.compile(build.kernel_source(),
                                 build.base_options("sm_90a") + build.define_options(spec), "ffpa_fwd.cu")
        assert cubin[:4] == b"\x7fELF"


# ------------------------------------------------------------------ lane-level model of the kernel (CPU)
# tests/emulators/cuda_lanes.py transcribes csrc/ffpa_fwd.cu at the level of shared-memory bytes and per-lane
# mma/ldmatrix fragments; these tests check the kernel's index math through it against the reference (the GPU
# tests check the kernel itself).


def _check_emulation(spec, stages, xbufs, d, nq, nkv, causal):
    """The emulated kernel ``spec`` on fp16 inputs against the fp32 reference: out within 2e-3 (below fp16's
    tolerance: the emulator rounds only what the kernel rounds), lse within 1e-3."""
    torch.manual_seed(0)
    q, k, v = (t[0, 0] for t in make_qkv(1, 1, 1, nq, nkv, d, torch.float16))
    scale = d ** -0.5
    out, lse = cuda_lanes.emulate(spec, stages, xbufs, q, k, v, causal, scale)
    ref, ref_lse = reference.attention(q[None, None], k[None, None], v[None, None], is_causal=causal, scale=scale)
    assert_close(out, ref[0, 0], torch.float16, tol=2e-3)
    assert_lse_close(lse, ref_lse[0, 0], atol=1e-3)


@pytest.mark.parametrize("d,nq,nkv,causal,nw,stages,xbufs,cw", [
    (320, 40, 70, False, 8, 3, 2, 0),     # WN=2, 32-column pieces, tails in both lengths
    (512, 20, 150, True, 8, 4, 1, 0),     # WN=2, 128-column pieces, causal tail-aligned, single exchange buffer
    (640, 30, 64, True, 8, 2, 2, 0),      # WN=4, 4-way exchange, causal
    (768, 16, 90, False, 4, 1, 1, 0),     # WN=4 with 4 warps (BR=16), one stage
    (1000, 9, 70, True, 8, 3, 2, 32),     # padded D, forced 32-column pieces
])
def test_lane_level_model_matches_reference(d, nq, nkv, causal, nw, stages, xbufs, cw):
    dpad, wn = head_dim_tiling(d)
    _check_emulation(KernelSpec(dpad, wn, nw, False, False, cw), stages, xbufs, d, nq, nkv, causal)


@pytest.mark.parametrize("d,nq,nkv,causal,stages", [
    (320, 40, 70, False, 3),     # rm = 2, WN = 4 (16-key slices), padded D 320 -> 384, tails
    (512, 70, 150, True, 2),     # WN = 4, causal tail-aligned over two row groups and three key tiles
    (1000, 20, 100, True, 1),    # WN = 8 (8-key slices), padded D, one stage
])
def test_lane_level_model_rm2_matches_reference(d, nq, nkv, causal, stages):
    dpad, wn = head_dim_tiling(d, 2)
    _check_emulation(KernelSpec(dpad, wn, 8, False, False, rm=2), stages, 1, d, nq, nkv, causal)

"""CUDA backend on CPU: config validation through the public API, launch planning, the cubin cache, and a
compile of every kernel instantiation for sm_80 and sm_90a with nvcc ``-Xptxas -v`` (no errors, no spills).
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
from ffpa_attn.testing import make_qkv

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
# A numpy transcription of csrc/ffpa_fwd.cu at the level of shared-memory bytes and per-lane mma/ldmatrix
# fragments: the same swizzle, loader, ring-slot schedule, fragment addresses, exchange, masks and
# epilogue. It checks the kernel's index math against the reference on CPU (the GPU tests check the
# kernel itself). fp16, fp32 accumulators.

import numpy as np  # noqa: E402


def _swz(row_bytes, row, col):
    return row * row_bytes + (((col >> 3) ^ (row & 7)) << 4) + ((col & 7) << 1)


class _CTA:
    def __init__(self, spec: KernelSpec, stages: int, xbufs: int):
        self.spec, self.stages, self.xbufs = spec, stages, xbufs
        self.smem = np.zeros(spec.smem_bytes(stages, xbufs), dtype=np.uint8)
        self.sw = spec.chunk_cols
        self.cw = self.sw // spec.wn
        self.nch = spec.dpad // self.sw

    # shared memory ---------------------------------------------------------------------------------
    def st16(self, addr, vals_u16):
        self.smem[addr:addr + 16] = np.asarray(vals_u16, dtype=np.uint16).view(np.uint8)

    def load_tile(self, s_base, g, row0, nrows, col0, d, rows, cols):
        nt = self.spec.threads
        vpr = cols // 8
        for tid in range(nt):
            if nt % vpr == 0:
                rs = nt // vpr
                r0, cv = tid // vpr, tid % vpr
                items = [(r0 + i * rs, cv) for i in range(rows // rs)]
            else:
                items = [((tid + i * nt) // vpr, (tid + i * nt) % vpr) for i in range(rows * vpr // nt)]
            for r, cv in items:
                gr, gc = row0 + r, col0 + cv * 8
                ok = gr < nrows and gc < d
                vals = g[gr, gc:gc + 8] if ok else np.zeros(8, np.uint16)
                self.st16(s_base + _swz(cols * 2, r, cv * 8), vals)

    def ldsm(self, addrs, trans):
        regs = np.zeros((32, 4), dtype=np.uint32)
        for j in range(4):
            m = np.stack([self.smem[a:a + 16].view(np.uint16) for a in addrs[8 * j:8 * j + 8]])  # 8 x 8
            for lane in range(32):
                g, t = lane // 4, lane % 4
                lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
                regs[lane, j] = int(lo) | (int(hi) << 16)
        return regs


def _h(u32, half):
    return ((u32 >> (16 * half)) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)


def _mma(c, a, b0, b1):
    """c [32, 4] f32 += A [16x16] B [16x8] from per-lane fragments (m16n8k16 layouts)."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (r, c0) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[r, c0], A[r, c0 + 1] = _h(a[lane, reg], 0), _h(a[lane, reg], 1)
        B[2 * t, g], B[2 * t + 1, g] = _h(b0[lane], 0), _h(b0[lane], 1)
        B[2 * t + 8, g], B[2 * t + 9, g] = _h(b1[lane], 0), _h(b1[lane], 1)
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def _pack(lo, hi):
    return (np.float16(lo).view(np.uint16).astype(np.uint32) | (np.float16(hi).view(np.uint16).astype(np.uint32) << 16))


def _cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal):
    """The CTA's Q load and its cp.async ring of K/V chunks (K chunks of a tile, then V), as the kernel runs
    them: ``(n_tiles, acquire)`` where ``acquire(g)`` prefetches chunk ``g + stages - 1`` and returns the
    shared-memory address of chunk ``g``."""
    nch, sw, br = cta.nch, cta.sw, spec.block_m
    s_q, s_ring = 0, spec.q_bytes
    n_tiles = -(-nkv // 64)
    if causal:
        n_tiles = min(n_tiles, (q0 + br - 1 + off) // 64 + 1)
    total = n_tiles * 2 * nch

    def load_chunk(gi, slot):
        t, r = gi // (2 * nch), gi % (2 * nch)
        is_v, c = r >= nch, r % nch
        cta.load_tile(s_ring + slot * spec.chunk_bytes, vg if is_v else kg, t * 64, nkv, c * sw, d, 64, sw)

    cta.load_tile(s_q, qg, q0, nq, 0, d, br, spec.dpad)
    state = {"rd": 0, "wr": stages - 1}
    if stages > 1:
        for s in range(stages - 1):
            if s < total:
                load_chunk(s, s)

    def acquire(g):
        if stages == 1:
            load_chunk(g, 0)
            return s_ring
        gn = g + stages - 1
        if gn < total:
            load_chunk(gn, state["wr"])
        state["wr"] = 0 if state["wr"] + 1 == stages else state["wr"] + 1
        base = s_ring + state["rd"] * spec.chunk_bytes
        state["rd"] = 0 if state["rd"] + 1 == stages else state["rd"] + 1
        return base

    return n_tiles, acquire


def _pv_chunks(cta, acquire, g, o, pa, nch, wn_, cw, sw, lanes):
    """O += P V over the ``nch`` V chunks of one key tile, as every warp of the CTA runs it: each ldmatrix'd V
    fragment feeds the MMAs of all ``rm`` row tiles of the warp. o ``[nw, rm, nch, 2 * cw / 16, 32, 4]`` f32,
    pa ``[nw, rm, 4, 32, 4]`` P A-fragments (rm = 1: pass ``o[:, None]`` / ``pa[:, None]``); returns the next
    chunk index ``g``."""
    nw, rm_ = pa.shape[:2]
    for c in range(nch):
        vb = acquire(g)
        g += 1
        for w in range(nw):
            wn = w % wn_
            for kk in range(4):
                for nn in range(cw // 16):
                    bf = cta.ldsm([vb + _swz(sw * 2, kk * 16 + (ln & 7) + ((ln >> 3) & 1) * 8,
                                             wn * cw + nn * 16 + (ln >> 4) * 8) for ln in lanes], True)
                    for rm in range(rm_):
                        _mma(o[w, rm, c, 2 * nn], pa[w, rm, kk], bf[:, 0], bf[:, 1])
                        _mma(o[w, rm, c, 2 * nn + 1], pa[w, rm, kk], bf[:, 2], bf[:, 3])
    return g


def _emulate_cta(spec, stages, xbufs, qg, kg, vg, nq, nkv, d, q0, causal, scale):
    cta = _CTA(spec, stages, xbufs)
    wn_, nw, br, nch, cw, sw = spec.wn, spec.nw, spec.block_m, cta.nch, cta.cw, cta.sw
    dpad = spec.dpad
    lanes = np.arange(32)
    s_q = 0
    x_base = spec.q_bytes + stages * spec.chunk_bytes
    off = nkv - nq if causal else 0
    n_tiles, acquire = _cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal)

    o = np.zeros((nw, nch, cw // 8, 32, 4), np.float32)
    m_r = np.full((nw, 32, 2), -np.inf, np.float32)
    l_r = np.zeros((nw, 32, 2), np.float32)
    g = 0
    xbuf = 0
    log2e = 1.0 / np.log(2.0)
    for t in range(n_tiles):
        s = np.zeros((nw, 8, 32, 4), np.float32)
        for c in range(nch):
            kb = acquire(g)
            g += 1
            for w in range(nw):
                wm, wn = w // wn_, w % wn_
                qcol0 = c * sw + wn * cw
                for kk in range(cw // 16):
                    a = cta.ldsm([s_q + _swz(dpad * 2, wm * 16 + (ln & 15), qcol0 + kk * 16 + (ln >> 4) * 8)
                                  for ln in lanes], False)
                    for nn in range(4):
                        bf = cta.ldsm([kb + _swz(sw * 2, nn * 16 + (ln & 7) + ((ln >> 4) << 3),
                                                 wn * cw + kk * 16 + ((ln >> 3) & 1) * 8) for ln in lanes], False)
                        _mma(s[w, 2 * nn], a, bf[:, 0], bf[:, 1])
                        _mma(s[w, 2 * nn + 1], a, bf[:, 2], bf[:, 3])
        xf = cta.smem[x_base:].view(np.float32)
        xb = xbuf * nw * 1024
        for w in range(nw):  # every warp writes, then (after the named barrier) reads
            for j in range(8):
                idx = xb + w * 1024 + (j * 32 + lanes) * 4
                for e in range(4):
                    xf[idx + e] = s[w, j, :, e]
        summed = np.zeros_like(s)
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            for j in range(8):
                if wn_ == 2:
                    idx = xb + (wm * wn_ + (wn ^ 1)) * 1024 + (j * 32 + lanes) * 4
                    summed[w, j] = s[w, j] + np.stack([xf[idx + e] for e in range(4)], 1)
                else:
                    acc = None
                    for w2 in range(wn_):
                        idx = xb + (wm * wn_ + w2) * 1024 + (j * 32 + lanes) * 4
                        part = np.stack([xf[idx + e] for e in range(4)], 1)
                        acc = part if acc is None else acc + part
                    summed[w, j] = acc
        s = summed
        if xbufs == 2:
            xbuf ^= 1
        k0 = t * 64
        need_mask = (k0 + 64 > nkv) or (causal and k0 + 63 > q0 + off)
        pa = np.zeros((nw, 4, 32, 4), np.uint32)
        for w in range(nw):
            wm = w // wn_
            g8, tq = lanes >> 2, lanes & 3
            row_a = q0 + wm * 16 + g8
            rows = (row_a, row_a + 8)
            x = s[w] * np.float32(scale * log2e)
            if need_mask:
                for i in range(2):
                    lim = np.full(32, nkv - 1)
                    if causal:
                        lim = np.minimum(rows[i] + off, lim)
                    lim_rel = lim - k0 - 2 * tq
                    for j in range(8):
                        for e in (2 * i, 2 * i + 1):
                            x[j, :, e] = np.where(j * 8 + (e & 1) > lim_rel, -np.inf, x[j, :, e])
            for i in range(2):
                mx = np.maximum(m_r[w, :, i], x[:, :, 2 * i:2 * i + 2].max(axis=(0, 2)))
                mx = mx.reshape(8, 4).max(axis=1).repeat(4)  # quad reduction
                mu = np.where(np.isneginf(mx), 0.0, mx).astype(np.float32)
                alpha = np.exp2(m_r[w, :, i] - mu)
                m_r[w, :, i] = mx
                l_r[w, :, i] *= alpha
                o[w, :, :, :, 2 * i:2 * i + 2] *= alpha[None, None, :, None]
                p = np.exp2(x[:, :, 2 * i:2 * i + 2] - mu[None, :, None])
                l_r[w, :, i] += p.sum(axis=(0, 2))
                for j in range(8):
                    pa[w, j >> 1, :, (j & 1) * 2 + i] = _pack(p[j, :, 0], p[j, :, 1])
        g = _pv_chunks(cta, acquire, g, o[:, None], pa[:, None], nch, wn_, cw, sw, lanes)
    out = np.zeros((br, dpad), np.float32)
    lse = np.full(br, -np.inf, np.float32)
    for w in range(nw):
        wm, wn = w // wn_, w % wn_
        g8, tq = lanes >> 2, lanes & 3
        for i in range(2):
            l = l_r[w, :, i].reshape(8, 4).sum(axis=1).repeat(4)
            inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0.0)
            if wn == 0:
                sel = tq == 0
                lse[wm * 16 + 8 * i + g8[sel]] = np.where(l[sel] > 0, (m_r[w, sel, i] + np.log2(np.where(
                    l[sel] > 0, l[sel], 1))) * np.log(2.0), -np.inf)
            for c in range(nch):
                for j in range(cw // 8):
                    col = c * sw + wn * cw + j * 8 + tq * 2
                    out[wm * 16 + 8 * i + g8, col] = o[w, c, j, :, 2 * i] * inv
                    out[wm * 16 + 8 * i + g8, col + 1] = o[w, c, j, :, 2 * i + 1] * inv
    return out, lse


@pytest.mark.parametrize("d,nq,nkv,causal,nw,stages,xbufs,cw", [
    (320, 40, 70, False, 8, 3, 2, 0),     # WN=2, 32-column pieces, tails in both lengths
    (512, 20, 150, True, 8, 4, 1, 0),     # WN=2, 128-column pieces, causal tail-aligned, single exchange buffer
    (640, 30, 64, True, 8, 2, 2, 0),      # WN=4, 4-way exchange, causal
    (768, 16, 90, False, 4, 1, 1, 0),     # WN=4 with 4 warps (BR=16), one stage
    (1000, 9, 70, True, 8, 3, 2, 32),     # padded D, forced 32-column pieces
])
def test_lane_level_model_matches_reference(d, nq, nkv, causal, nw, stages, xbufs, cw):
    torch.manual_seed(0)
    dpad, wn = head_dim_tiling(d)
    spec = KernelSpec(dpad, wn, nw, False, False, cw)
    q = torch.randn(nq, d).half()
    k = torch.randn(nkv, d).half()
    v = torch.randn(nkv, d).half()
    scale = d ** -0.5
    ref, ref_lse = reference.attention(q[None, None], k[None, None], v[None, None], is_causal=causal,
                                                 scale=scale)
    qg, kg, vg = (t.numpy().view(np.uint16) for t in (q, k, v))
    outs, lses = [], []
    for q0 in range(0, nq, spec.block_m):
        o, l = _emulate_cta(spec, stages, xbufs, qg, kg, vg, nq, nkv, d, q0, causal, scale)
        outs.append(o)
        lses.append(l)
    out = torch.from_numpy(np.concatenate(outs)[:nq, :d])
    lse = torch.from_numpy(np.concatenate(lses)[:nq])
    assert_err = (out - ref[0, 0]).norm() / ref[0, 0].norm()
    assert assert_err < 2e-3, assert_err
    assert (lse - ref_lse[0, 0]).abs().max() < 1e-3


def _emulate_cta_rm2(spec, stages, qg, kg, vg, nq, nkv, d, q0, causal, scale):
    """The rm = 2 kernel (32 rows per warp, reduce-scatter exchange) at the same level as
    :func:`_emulate_cta`: partials, slice maxima and P fragments go through the shared-memory bytes at the
    kernel's addresses, one barrier phase at a time (all warps write, then all warps read)."""
    assert spec.rm == 2
    cta = _CTA(spec, stages, 1)
    wn_, nw, br, nch, cw, sw = spec.wn, spec.nw, spec.block_m, cta.nch, cta.cw, cta.sw
    rm_, wr, ks = spec.rm, spec.rows_per_warp, 64 // spec.wn
    nj = ks // 8
    dpad = spec.dpad
    lanes = np.arange(32)
    g8, tq = lanes >> 2, lanes & 3
    s_q = 0
    x_base = spec.q_bytes + stages * spec.chunk_bytes
    x_floats = nw * rm_ * 1024
    off = nkv - nq if causal else 0
    n_tiles, acquire = _cta_ring(cta, spec, stages, qg, kg, vg, nq, nkv, d, q0, off, causal)

    o = np.zeros((nw, rm_, nch, cw // 8, 32, 4), np.float32)
    m_r = np.full((nw, rm_, 2, 32), -np.inf, np.float32)
    l_r = np.zeros((nw, rm_, 2, 32), np.float32)
    g = 0
    log2e = 1.0 / np.log(2.0)
    for t in range(n_tiles):
        s = np.zeros((nw, rm_, 8, 32, 4), np.float32)
        for c in range(nch):
            kb = acquire(g)
            g += 1
            for w in range(nw):
                wm, wn = w // wn_, w % wn_
                qcol0 = c * sw + wn * cw
                for kk in range(cw // 16):
                    a = [cta.ldsm([s_q + _swz(dpad * 2, wm * wr + rm * 16 + (ln & 15),
                                              qcol0 + kk * 16 + (ln >> 4) * 8) for ln in lanes], False)
                         for rm in range(rm_)]
                    for nn in range(4):
                        bf = cta.ldsm([kb + _swz(sw * 2, nn * 16 + (ln & 7) + ((ln >> 4) << 3),
                                                 wn * cw + kk * 16 + ((ln >> 3) & 1) * 8) for ln in lanes], False)
                        for rm in range(rm_):
                            _mma(s[w, rm, 2 * nn], a[rm], bf[:, 0], bf[:, 1])
                            _mma(s[w, rm, 2 * nn + 1], a[rm], bf[:, 2], bf[:, 3])
        xf = cta.smem[x_base:].view(np.float32)
        for w in range(nw):  # partials
            for rm in range(rm_):
                for j in range(8):
                    idx = w * rm_ * 1024 + ((rm * 8 + j) * 32 + lanes) * 4
                    for e in range(4):
                        xf[idx + e] = s[w, rm, j, :, e]
        # barrier A: slice sums, scale, mask, slice maxima
        k0 = t * 64
        need_mask = (k0 + 64 > nkv) or (causal and k0 + 63 > q0 + off)
        sq = np.zeros((nw, rm_, nj, 32, 4), np.float32)
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            for w2 in range(wn_):
                for rm in range(rm_):
                    for jj in range(nj):
                        idx = (wm * wn_ + w2) * rm_ * 1024 + ((rm * 8 + wn * nj + jj) * 32 + lanes) * 4
                        sq[w, rm, jj] += np.stack([xf[idx + e] for e in range(4)], 1)
            sq[w] *= np.float32(scale * log2e)
            for rm in range(rm_):
                for i in range(2):
                    if need_mask:
                        lim = np.full(32, nkv - 1)
                        if causal:
                            lim = np.minimum(q0 + wm * wr + rm * 16 + i * 8 + g8 + off, lim)
                        lim_rel = lim - k0 - wn * ks - 2 * tq
                        for jj in range(nj):
                            for e in (2 * i, 2 * i + 1):
                                sq[w, rm, jj, :, e] = np.where(jj * 8 + (e & 1) > lim_rel, -np.inf,
                                                               sq[w, rm, jj, :, e])
                    mx = sq[w, rm, :, :, 2 * i:2 * i + 2].max(axis=(0, 2)).reshape(8, 4).max(axis=1)
                    xf[x_floats + w * wr + rm * 16 + i * 8 + np.arange(8)] = mx
        # barrier B: group maxima, P slices -> the group's partial space
        for w in range(nw):
            wm, wn = w // wn_, w % wn_
            pbase = x_base + wm * wn_ * rm_ * 1024 * 4
            for rm in range(rm_):
                for i in range(2):
                    mx = m_r[w, rm, i].copy()
                    for w2 in range(wn_):
                        mx = np.maximum(mx, xf[x_floats + (wm * wn_ + w2) * wr + rm * 16 + i * 8 + g8])
                    mu = np.where(np.isneginf(mx), 0.0, mx).astype(np.float32)
                    alpha = np.exp2(m_r[w, rm, i] - mu)
                    m_r[w, rm, i] = mx
                    l_r[w, rm, i] *= alpha
                    o[w, rm, :, :, :, 2 * i:2 * i + 2] *= alpha[None, None, :, None]
                    p = np.exp2(sq[w, rm, :, :, 2 * i:2 * i + 2] - mu[None, :, None])
                    l_r[w, rm, i] += p.sum(axis=(0, 2))
                    for jj in range(nj):
                        j = wn * nj + jj
                        for ln in range(32):
                            addr = pbase + ((rm * 4 + (j >> 1)) * 32 + ln) * 16 + (j & 1) * 8 + i * 4
                            cta.smem[addr:addr + 4] = np.array([int(_pack(p[jj, ln, 0], p[jj, ln, 1]))],
                                                               np.uint32).view(np.uint8)
        # barrier C: every warp reads all of P of its group
        pa = np.zeros((nw, rm_, 4, 32, 4), np.uint32)
        for w in range(nw):
            wm = w // wn_
            pbase = x_base + wm * wn_ * rm_ * 1024 * 4
            for rm in range(rm_):
                for kk in range(4):
                    for ln in range(32):
                        addr = pbase + ((rm * 4 + kk) * 32 + ln) * 16
                        pa[w, rm, kk, ln] = cta.smem[addr:addr + 16].view(np.uint32)
        g = _pv_chunks(cta, acquire, g, o, pa, nch, wn_, cw, sw, lanes)
    # epilogue: slice sums of l through shared memory, fixed order
    xf = cta.smem[x_base:].view(np.float32)
    for w in range(nw):
        for rm in range(rm_):
            for i in range(2):
                xf[w * wr + rm * 16 + i * 8 + np.arange(8)] = l_r[w, rm, i].reshape(8, 4).sum(axis=1)
    out = np.zeros((br, dpad), np.float32)
    lse = np.full(br, -np.inf, np.float32)
    for w in range(nw):
        wm, wn = w // wn_, w % wn_
        for rm in range(rm_):
            for i in range(2):
                l = np.zeros(32, np.float32)
                for w2 in range(wn_):
                    l += xf[(wm * wn_ + w2) * wr + rm * 16 + i * 8 + g8]
                inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0.0)
                r0 = wm * wr + rm * 16 + 8 * i
                if wn == 0:
                    sel = tq == 0
                    lse[r0 + g8[sel]] = np.where(l[sel] > 0, (m_r[w, rm, i, sel] + np.log2(np.where(
                        l[sel] > 0, l[sel], 1))) * np.log(2.0), -np.inf)
                for c in range(nch):
                    for j in range(cw // 8):
                        col = c * sw + wn * cw + j * 8 + tq * 2
                        out[r0 + g8, col] = o[w, rm, c, j, :, 2 * i] * inv
                        out[r0 + g8, col + 1] = o[w, rm, c, j, :, 2 * i + 1] * inv
    return out, lse


@pytest.mark.parametrize("d,nq,nkv,causal,stages", [
    (320, 40, 70, False, 3),     # rm = 2, WN = 4 (16-key slices), padded D 320 -> 384, tails
    (512, 70, 150, True, 2),     # WN = 4, causal tail-aligned over two row groups and three key tiles
    (1000, 20, 100, True, 1),    # WN = 8 (8-key slices), padded D, one stage
])
def test_lane_level_model_rm2_matches_reference(d, nq, nkv, causal, stages):
    torch.manual_seed(0)
    dpad, wn = head_dim_tiling(d, 2)
    spec = KernelSpec(dpad, wn, 8, False, False, rm=2)
    q = torch.randn(nq, d).half()
    k = torch.randn(nkv, d).half()
    v = torch.randn(nkv, d).half()
    scale = d ** -0.5
    ref, ref_lse = reference.attention(q[None, None], k[None, None], v[None, None], is_causal=causal,
                                       scale=scale)
    qg, kg, vg = (t.numpy().view(np.uint16) for t in (q, k, v))
    outs, lses = [], []
    for q0 in range(0, nq, spec.block_m):
        o, l = _emulate_cta_rm2(spec, stages, qg, kg, vg, nq, nkv, d, q0, causal, scale)
        outs.append(o)
        lses.append(l)
    out = torch.from_numpy(np.concatenate(outs)[:nq, :d])
    lse = torch.from_numpy(np.concatenate(lses)[:nq])
    err = (out - ref[0, 0]).norm() / ref[0, 0].norm()
    assert err < 2e-3, err
    assert (lse - ref_lse[0, 0]).abs().max() < 1e-3

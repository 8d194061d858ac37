"""CPU checks of the CuTeDSL (sm90a) backend: budgets, layout assumptions, and that every forward kernel
variant compiles for sm_90a (``CUTE_DSL_ARCH=sm_90a``; no GPU needed). Kernel tests skip without
nvidia-cutlass-dsl; numerical tests against the reference are GPU tests (tests/gpu/test_cute_gpu.py).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ffpa_attn.cutedsl.config import (BWD_HEAD_DIMS, BWD_MAX_HEAD_DIM, BWD_MAX_STAGES, FWD_HEAD_DIMS, FWD_MAX_HEAD_DIM,
                                   MIN_STAGES, SMEM_CAPACITY, BwdConfig, FwdConfig, round_up)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

HAS_CUTLASS = True
try:  # pragma: no cover - depends on the environment
    import cutlass  # noqa: F401
    import cutlass.cute as cute  # noqa: F401  (kernel annotations below are resolved in this module)
except Exception:  # noqa: BLE001
    HAS_CUTLASS = False
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")

VARIANT_DIMS = (264, 320, 384, 448, 512, 576, 768, 1024)


def test_package_import_does_not_import_cutlass():
    code = ("import sys, ffpa_attn, ffpa_attn.cutedsl as c; from ffpa_attn.dispatch import registry; "
            "registry.spec('cutedsl'); assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'; "
            "print(c.SPEC.head_dims)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@needs_cutlass
def test_kernels_use_no_deprecated_cutlass_names():
    """Importing and compiling the forward and the backward kernels raises no DeprecationWarning from this package's
    code (names the next cutlass-dsl minor removes; in a fresh process, so import-time warnings count too)."""
    code = ("import warnings; warnings.filterwarnings('error', category=DeprecationWarning, module=r'ffpa_attn(\\.|$)')\n"
            "from ffpa_attn.cutedsl._compile import compile_bwd, compile_bwd_dq, compile_fwd\n"
            "from ffpa_attn.cutedsl.config import BwdConfig, FwdConfig\n"
            "compile_fwd(FwdConfig(320, 'bfloat16', True)); compile_bwd(BwdConfig(320, 'bfloat16', True))\n"
            "compile_bwd_dq(BwdConfig(320, 'bfloat16', True))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    assert res.returncode == 0, res.stderr[-3000:]


def test_described_dims_are_the_compilable_ones():
    """The backend's description (backend.json: what the planner routes) lists exactly the head dims every forward
    and backward kernel configuration compiles for."""
    from ffpa_attn.cutedsl import SPEC

    described = [d for d in range(1, 2049) if SPEC.head_dim_ok(d)]
    assert described == list(FWD_HEAD_DIMS) == list(BWD_HEAD_DIMS)


@pytest.mark.parametrize("d", FWD_HEAD_DIMS)
def test_fwd_budget(d):
    cfg = FwdConfig(d, "bfloat16", False)
    parts = 2 * cfg.cluster
    assert parts * cfg.d_wg >= d and (parts - 1) * cfg.d_wg < d  # every part holds real columns
    assert cfg.d_wg % 16 == 0 and cfg.d_wg <= 256 and cfg.cluster == (1 if d <= 512 else 2)
    assert MIN_STAGES <= cfg.stages and cfg.smem_bytes + 64 <= SMEM_CAPACITY
    assert cfg.exchange_fits
    assert cfg.slot_bytes == 64 * cfg.d_wg * 2


@pytest.mark.parametrize("d", [256, 260, 300, FWD_MAX_HEAD_DIM + 8, 2048])
def test_fwd_config_rejects(d):
    with pytest.raises(ValueError):
        FwdConfig(d, "bfloat16", False)


def test_round_up():
    assert [round_up(x, 16) for x in (1, 16, 17, 256)] == [16, 16, 32, 256]


@needs_cutlass
@pytest.mark.parametrize("tile_n", [32, 64])  # 32: the S-recompute forward at D = 1024
def test_fragment_orders(tile_n):
    """The kernel converts S (wgmma C fragment) to P (A fragment of the P.V wgmma) register by register,
    and treats S register v as row half (v // 2) % 2: check both facts for every thread at trace time."""
    import cutlass.utils.hopper_helpers as sm90
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    problems = []

    @cute.jit
    def probe(x: cute.Tensor):
        qk = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                         (1, 1, 1), (64, tile_n))
        pv = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                         (1, 1, 1), (64, 256), warpgroup.OperandSource.RMEM)
        ident = cute.make_identity_tensor((64, tile_n))
        for t in cutlass.range_constexpr(128):
            c = qk.get_slice(t).partition_C(ident)
            a = pv.get_slice(t).partition_A(ident)
            if cutlass.const_expr(cute.size(c) != tile_n // 2 or cute.size(a) != tile_n // 2):
                problems.append(("size", t))
            for v in cutlass.range_constexpr(tile_n // 2):
                if cutlass.const_expr(tuple(c[v]) != tuple(a[v])):
                    problems.append(("order", t, v, c[v], a[v]))
                if cutlass.const_expr(c[v][0] != c[0][0] + 8 * ((v // 2) % 2)):
                    problems.append(("row", t, v, c[v]))

    x = cute.runtime.make_fake_compact_tensor(Float32, (16,), assumed_align=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "static loop has 128 iterations": intended, trace-time only
        cute.compile(probe, x)
    assert not problems, problems[:5]


def _ptxas_report(ptx: str, tmp_path) -> str | None:
    """``ptxas -v`` output for the kernel, or None without a ptxas that reads this PTX."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = tmp_path / "k.ptx"
    # the DSL emits PTX ISA 9.x of its bundled toolchain; the local ptxas may be older but reads it
    src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx, count=1, flags=re.M))
    res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return None
    return res.stdout + res.stderr


@needs_cutlass
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", VARIANT_DIMS)
def test_fwd_compiles_for_sm90a(d, dtype, causal, tmp_path):
    from ffpa_attn.cutedsl._compile import compile_fwd

    cfg = FwdConfig(d, dtype, causal)
    fn = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path))
    ptx = fn.artifacts.PTX
    ab = "bf16" if dtype == "bfloat16" else "f16"
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{ab}.{ab}" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.d_wg}k16.f32.{ab}.{ab}" in ptx
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", ptx) and re.search(r"setmaxnreg.dec.sync.aligned.u32\s+40;", ptx)
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx
    if cfg.cluster > 1:  # partial S of the peer CTA through DSMEM, remote mbarrier arrives
        assert "ld.shared::cluster.v4" in ptx and "mbarrier.arrive.release.cluster.shared::cluster" in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
        # cluster variants: ptxas hoists the DSMEM loads of the exchange and spills a few registers
        assert spill <= (0 if cfg.cluster == 1 else 64), report
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        assert regs <= 168, report  # 384 threads per CTA


@needs_cutlass
def test_fwd_partial_last_chunk_above_512_compiles(tmp_path):
    """D = 56 mod 64 above 512 (16 chunks, the last one 56 columns wide): VARIANT_DIMS have a partial last
    chunk only at 264; the dims above 512 are multiples of 64."""
    test_fwd_compiles_for_sm90a(1016, "bfloat16", True, tmp_path)


@needs_cutlass
@pytest.mark.parametrize("d,tile_n", [(320, 128), (384, 96), (512, 48), (512, 80), (1024, 80)])
def test_fwd_tile_n_variants_compile(d, tile_n, tmp_path):
    from ffpa_attn.cutedsl._compile import compile_fwd

    cfg = FwdConfig(d, "bfloat16", True, tile_n=tile_n)
    ptx = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k16.f32.bf16.bf16" in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
        assert spill <= (0 if cfg.cluster == 1 else 64), report


@needs_cutlass
def test_fwd_q_broadcast_variant_compiles(tmp_path):
    """The split-KV path's variant (one q batch entry for every KV slice) is its own cached kernel, compiles for
    sm_90a without spills, and differs from the default only in where Q is loaded from."""
    from ffpa_attn.cutedsl._compile import compile_fwd

    base = FwdConfig(512, "bfloat16", False, tile_n=80)
    cfg = FwdConfig(512, "bfloat16", False, tile_n=80, q_broadcast=True)
    assert cfg.key() != base.key() and cfg.stages == base.stages
    ptx = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    loads = re.findall(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global[^\n]*\{([^}]*)\}", ptx)
    # the two Q parts come first; their batch coordinate (the 4th) is the literal 0 of the broadcast
    zeros = set(re.findall(r"mov\.b32\s+(%r\d+), 0;", ptx))
    assert len(loads) >= 2 and all(c.split(",")[3].strip() in zeros for c in loads[:2]), loads[:2]
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) == 0, report


@needs_cutlass
@pytest.mark.parametrize("d,dtype,causal", [(264, "float16", True), (512, "bfloat16", False), (512, "bfloat16", True),
                                            (1024, "bfloat16", True)])
def test_fwd_varlen_variant_compiles(d, dtype, causal, tmp_path):
    """The packed-sequence forward (FwdConfig.varlen) is its own cached kernel, compiles for sm_90a without
    spills, reads cu_seqlens and the work list from global memory and keeps both stores: TMA for a query block
    inside its sequence, bounded plain stores for a sequence's last, partial block."""
    from ffpa_attn.cutedsl._compile import compile_fwd

    cfg = FwdConfig(d, dtype, causal, varlen=True)
    assert cfg.key() != FwdConfig(d, dtype, causal).key() and cfg.stages == FwdConfig(d, dtype, causal).stages
    ptx = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    ab = "bf16" if dtype == "bfloat16" else "f16"
    assert ".target sm_90a" in ptx and f"wgmma.mma_async.sync.aligned.m64n{cfg.d_wg}k16.f32.{ab}.{ab}" in ptx
    assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx  # TMA store of full blocks
    assert re.search(r"st\.global\.b16", ptx)  # bounded stores of the partial block (and of keyless rows)
    assert re.search(r"ld\.global(\.nc)?\.b32|ld\.global(\.nc)?\.u32|ld\.global(\.nc)?\.s32", ptx)  # cu_seqlens, items
    if cfg.cluster > 1:
        assert "ld.shared::cluster.v4" in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) <= (0 if cfg.cluster == 1 else 64), report
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 168, report


@needs_cutlass
def test_fwd_planned_causal_varlen_tile_compiles(tmp_path):
    """The key tile the planner gives the causal D = 512 packed forward (heuristic ``cutedsl_fwd_causal_tile_n``)
    compiles for sm_90a without spills."""
    from ffpa_attn.cutedsl._compile import compile_fwd
    from ffpa_attn.dispatch.heuristics import cute_tile_n

    cfg = FwdConfig(512, "bfloat16", True, tile_n=cute_tile_n(512, True), varlen=True)
    ptx = compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16.f32.bf16.bf16" in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) == 0, report


_AOT_PROCESS = """
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
import ffpa_attn
from ffpa_attn.cutedsl import _cache, api
from ffpa_attn.cutedsl.config import FwdConfig
cfg = FwdConfig(384, "float16", True)
fn = api.get_fwd_kernel(cfg)
t_loaded = time.perf_counter()
assert api.get_fwd_kernel(cfg) is fn
q = torch.zeros(1, 1, 64, 384, dtype=torch.float16)
try:  # CPU tensors: the loaded function checks its arguments against the compiled signature before any launch
    fn(q, q, q, q, torch.zeros(1, 1, 64), 1.0, 1, 1, None, None, None)
    error = "launched"
except ValueError as err:
    error = str(err)
print(json.dumps({**_cache.KERNELS.counts(), "cutlass": "cutlass" in sys.modules, "error": error,
                  "torch_s": t_torch - t0, "load_s": t_loaded - t_torch}))
"""


def _run_aot_process(env: dict) -> dict:
    import json

    res = subprocess.run([sys.executable, "-c", _AOT_PROCESS], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_cutlass
def test_aot_kernel_loads_without_the_compiler(tmp_path):
    """A kernel compiled with TVM-FFI by one process is exported as a shared object; a second process loads it
    through tvm_ffi.load_module without compiling and without ever importing cutlass, and the loaded function is
    the compiled signature (q, k, v, o, lse, scale_log2, group, cta_limit and the three varlen tensors, None when
    dense) that checks its arguments (CPU tensors: a ValueError naming the device type it needs)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "FFPA_ATTN_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    env.pop("CUTE_DSL_ARCH", None)  # the package must set up the arch itself
    first = _run_aot_process(env)
    assert (first["compiled"], first["loaded"], first["cutlass"]) == (1, 0, True), first
    objects = list((tmp_path / "cute").rglob("*.so"))
    assert len(objects) == 1 and not list((tmp_path / "cute").rglob(".k*")), "no shared object, or temp leftovers"
    second = _run_aot_process(env)
    assert (second["compiled"], second["loaded"]) == (0, 1), second
    assert not second["cutlass"], "the warm process imported the CuTeDSL compiler"
    assert "device_type=cuda" in second["error"] and "mItems: None" in second["error"], second["error"]
    assert "scale_log2: float32" in second["error"] and "cta_limit: int32" in second["error"], second["error"]
    print(f"warm process: import torch {second['torch_s']:.3f} s, then a loaded kernel {second['load_s']:.3f} s")


@needs_cutlass
def test_tvm_ffi_keeps_the_device_code(tmp_path):
    """Compiling with TVM-FFI changes only the host-side launch wrapper: the kernel's PTX is the same text as
    without it (the stream placeholder and option as before TVM-FFI calling)."""
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.runtime import make_fake_stream

    from ffpa_attn.cutedsl import _compile
    from ffpa_attn.cutedsl.fwd_sm90 import FlashFwdSm90SplitD, _dtype

    cfg = FwdConfig(384, "bfloat16", False)
    (tmp_path / "ffi").mkdir()
    (tmp_path / "plain").mkdir()  # the compiler writes into existing folders only
    ffi = _compile.compile_fwd(cfg, keep_artifacts=True, dump_dir=str(tmp_path / "ffi")).artifacts.PTX
    dt = _dtype(cfg.dtype)
    q, k, v, o = (_compile._fake_bhnd(dt, cfg.head_dim) for _ in range(4))
    lse = make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    plain = cute.compile(FlashFwdSm90SplitD(cfg), q, k, v, o, lse, Float32(1.0), Int32(1), Int32(1 << 30),
                         make_fake_stream(), options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {tmp_path / 'plain'}")
    assert ffi == plain.artifacts.PTX


_FIRST_CALL = """
import sys
from ffpa_attn.cache import key_name
from ffpa_attn.cutedsl import _cache, api
from ffpa_attn.cutedsl.config import BwdConfig
import torch
cfg = BwdConfig(320, "bfloat16", False)
if sys.argv[1] == "prefetch":
    api.prefetch_backward(320, torch.bfloat16, False)
    pending = _cache.KERNELS.pending()
    assert len(pending) == 2, pending
    api.prefetch_backward(320, torch.bfloat16, False)  # once per configuration: no second pair of children
    assert _cache.KERNELS.pending() == pending
kernel, dq_kernel = api.get_bwd_kernels(cfg)
assert kernel is not None and dq_kernel is not None and not _cache.KERNELS.pending()
in_children = [r["key"] for r in _cache.pool().job_records() if r["ok"] and r["compiled"]]
print(_cache.KERNELS.counts()["compiled"], len(in_children), key_name(cfg.key()), key_name(cfg.dq_key()))
"""


@needs_cutlass
@pytest.mark.parametrize("mode", ["first-call", "prefetch"])
def test_bwd_kernels_compile_in_children(mode, tmp_path):
    """Cold cache. first-call: the dQ kernel compiles in a compile worker while this process compiles the dK/dV
    kernel (this process compiles only the dK/dV kernel). prefetch (what a forward that needs its backward
    starts): both compile in children and the backward's first call only waits and loads (compiles nothing)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "FFPA_ATTN_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    env.pop("FFPA_ATTN_CUTE_PARALLEL_COMPILE", None)
    run = subprocess.run([sys.executable, "-c", _FIRST_CALL, mode], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    here, in_children, dkdv, dq = run.stdout.split()
    assert (int(here), int(in_children)) == ((1, 1) if mode == "first-call" else (0, 2)), run.stdout
    names = {p.stem for p in (tmp_path / "cute").rglob("*.so")}
    assert {dkdv, dq} <= names, names


def test_prepare_backward_hook_skips_what_the_backend_cannot_run(monkeypatch):
    """The CuTeDSL hook starts nothing for a mask, dropout or a CPU tensor; a module without the hook (Triton)
    and a backend without a kernel module are no-ops."""
    import torch

    from ffpa_attn import cutedsl as cute, ops
    from ffpa_attn.kernel_module import KernelSpec

    started = []
    monkeypatch.setattr("ffpa_attn.cutedsl.api.prefetch_backward", lambda *a, **kw: started.append(a), raising=False)
    q = torch.randn(1, 1, 4, 320)
    spec = KernelSpec("bwd_sm90+bwd_dq_sm90")
    cute.prepare_backward(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), dropout_p=0.0, causal=False,
                          kernel=spec)
    cute.prepare_backward(q, q, q, attn_mask=None, dropout_p=0.1, causal=False, kernel=spec)
    cute.prepare_backward(q, q, q, attn_mask=None, dropout_p=0.0, causal=False, kernel=spec)
    assert started == []
    ops.prepare_backward("triton", KernelSpec("bwd"), q, q, q, None, 0.0, False)
    ops.prepare_backward("none", KernelSpec("none"), q, q, q, None, 0.0, False)


def test_prepare_backward_hook_prefetches_the_varlen_kernels(monkeypatch):
    """A packed q ``[T, H, D]`` (a varlen forward) prefetches the varlen backward's kernels, a dense q the dense ones;
    ffpa_attn_varlen_func calls the hook when a backward will run, and only then."""
    import torch

    import ffpa_attn
    import ffpa_attn.interface as interface
    from ffpa_attn import cutedsl as cute

    class CudaQ:  # what the hook reads of q, on a (pretend) CUDA device
        def __init__(self, *shape):
            self.shape, self.dtype, self.device = shape, torch.bfloat16, torch.device("cuda")

        def dim(self) -> int:
            return len(self.shape)

    started, calls = [], []
    monkeypatch.setattr("ffpa_attn.cutedsl.api.prefetch_backward", lambda *a, **kw: started.append(kw), raising=False)
    from ffpa_attn.kernel_module import KernelSpec

    for q in (CudaQ(5, 2, 320), CudaQ(1, 2, 5, 320)):
        cute.prepare_backward(q, q, q, attn_mask=None, dropout_p=0.0, causal=True,
                              kernel=KernelSpec.of("bwd_sm90+bwd_dq_sm90", ring_stages=4))
    assert started == [{"varlen": True, "max_stages": 4}, {"varlen": False, "max_stages": 4}]
    monkeypatch.setattr(interface, "prepare_backward",
                        lambda backend, kernel, *a: calls.append((backend, a[0].dim())))
    q = torch.randn(5, 2, 320)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    ffpa_attn.ffpa_attn_varlen_func(q, q, q, cu, cu, 3, 3, backend="sdpa")
    assert calls == []  # nothing requires grad
    ffpa_attn.ffpa_attn_varlen_func(q.clone().requires_grad_(), q, q, cu, cu, 3, 3, backend="sdpa")
    assert calls == [("sdpa", 3)]


# ---------------------------------------------------------------------------------------------------------
# backward (ffpa_attn.cutedsl.bwd_sm90)

BWD_VARIANT_DIMS = (264, 320, 384, 448, 512)


RESIDENT_DIMS = [d for d in BWD_HEAD_DIMS if d <= 512]  # K/V (dK/dV kernel) and Q/dO (dQ kernel) resident
STREAM_DIMS = [d for d in BWD_HEAD_DIMS if d > 512]  # V / dO streamed through ring B


@pytest.mark.parametrize("d", BWD_HEAD_DIMS)
def test_bwd_budget(d):
    cfg = BwdConfig(d, "bfloat16", True)
    assert cfg.n_chunks * 64 >= d > (cfg.n_chunks - 1) * 64
    assert cfg.n_parts * cfg.part_chunks >= cfg.n_chunks > (cfg.n_parts - 1) * cfg.part_chunks
    assert cfg.part_chunks <= cfg.stages and cfg.smem_bytes + 1024 <= SMEM_CAPACITY
    assert cfg.part_chunks * 64 <= 256  # dK_p / dV_p: 64 x d_part fp32 = <= 128 registers per thread
    assert cfg.dq_parts * cfg.dq_part_chunks >= cfg.n_chunks and cfg.dq_half_chunks * 64 <= 256
    assert cfg.dq_part_chunks - cfg.dq_half_chunks <= cfg.dq_half_chunks  # consumer 1's dQ chunks <= consumer 0's
    assert cfg.dq_fixed_bytes + (cfg.dq_stages + cfg.dq_stages_b) * cfg.chunk_bytes + 1024 <= SMEM_CAPACITY
    parts = (2, 1) if d <= 512 else (-(-cfg.n_chunks // 4), 2)
    assert cfg.stream == (d > 512) and (cfg.n_parts, cfg.dq_parts) == parts


@pytest.mark.parametrize("d", STREAM_DIMS)
def test_bwd_stream_budget(d):
    """D > 512: ring B carries two chunks per GEMM step (a pair walk holds 4 slots), so it must have at least 4 and
    gets the depth (``BwdConfig.ring_split``); ring A keeps a part's chunks (dK/dV kernel) / 3 slots (dQ kernel)."""
    cfg = BwdConfig(d, "bfloat16", False)
    assert min(cfg.stages_b, cfg.dq_stages_b) >= 4
    assert cfg.stages >= max(cfg.part_chunks, 3) and cfg.dq_stages >= 3
    assert cfg.stages_b >= cfg.stages or cfg.stages_b == BWD_MAX_STAGES
    free = SMEM_CAPACITY - 1024 - cfg.fixed_bytes
    assert cfg.stages + cfg.stages_b == min(free // cfg.chunk_bytes, cfg.stages + BWD_MAX_STAGES)
    assert cfg.fixed_bytes == cfg.n_chunks * cfg.chunk_bytes + 64 * 64 * 4 + 1024  # K only (+ V's placeholder)


def test_bwd_config_rejects():
    for d in (256, 300, BWD_MAX_HEAD_DIM + 8, 2048):
        with pytest.raises(ValueError):
            BwdConfig(d, "bfloat16", False)
    for d, dtype in ((516, "bfloat16"), (512, "float32")):
        with pytest.raises(ValueError):
            BwdConfig(d, dtype, False)


@needs_cutlass
def test_bwd_fragment_orders():
    """The dK/dV kernel reuses the S^T C fragment (m64n64) as the A fragment of the register-sourced
    m64n64 wgmma (P^T, dS^T) and reads the query column of register v from (v % 2, v // 4) (lse/delta
    cache); a transposed view of a tile partitioned like the C fragment swaps each register's coordinates:
    check all three for every thread at trace time."""
    import cutlass.utils.hopper_helpers as sm90
    from cutlass import BFloat16, Float32
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    problems = []

    @cute.jit
    def probe(x: cute.Tensor):
        ss = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                         (1, 1, 1), (64, 64))
        rs = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                         (1, 1, 1), (64, 64), warpgroup.OperandSource.RMEM)
        ident = cute.make_identity_tensor((64, 64))
        ident_t = cute.composition(ident, cute.make_ordered_layout((64, 64), order=(1, 0)))
        for t in cutlass.range_constexpr(128):
            c = ss.get_slice(t).partition_C(ident)
            a = rs.get_slice(t).partition_A(ident)
            ct = ss.get_slice(t).partition_C(ident_t)
            if cutlass.const_expr(cute.size(c) != 32 or cute.size(a) != 32):
                problems.append(("size", t))
            for v in cutlass.range_constexpr(32):
                if cutlass.const_expr(tuple(c[v]) != tuple(a[v])):
                    problems.append(("order", t, v, c[v], a[v]))
                rep = (v % 2) + 4 * (v // 4)
                if cutlass.const_expr(c[v][1] != c[rep][1]):
                    problems.append(("col", t, v, c[v], c[rep]))
                if cutlass.const_expr(tuple(ct[v]) != (c[v][1], c[v][0])):
                    problems.append(("transpose", t, v, c[v], ct[v]))

    x = cute.runtime.make_fake_compact_tensor(Float32, (16,), assumed_align=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe, x)
    assert not problems, problems[:5]


@pytest.mark.parametrize("d", RESIDENT_DIMS)
def test_bwd_resident_budget(d):
    """D <= 512: the dK/dV kernel holds K, V and the P^T exchange (no dS tile) and two equal
    rings as deep as fit, capped by the planner's ring depth where shallower measured faster (heuristics
    "cutedsl_bwd_ring_stages"); the dQ kernel holds Q and dO resident plus two rings; both fit, and the keys tell
    causal from not."""
    from ffpa_attn.dispatch.heuristics import value

    cap = value("cutedsl_bwd_ring_stages").get(-(-d // 64), BWD_MAX_STAGES)
    s = BwdConfig(d, "bfloat16", True, max_stages=cap)
    assert s.fixed_bytes == 2 * s.n_chunks * s.chunk_bytes + 64 * 64 * 4 and s.stages <= BWD_MAX_STAGES
    assert s.stages == s.stages_b == min(cap, (SMEM_CAPACITY - 1024 - s.fixed_bytes) // (2 * s.chunk_bytes))
    if cap < BWD_MAX_STAGES:  # the cap changes the compiled kernel: it is part of its cache key
        assert s.key() != BwdConfig(d, "bfloat16", True).key()
    assert s.part_chunks <= s.stages and s.smem_bytes + 1024 <= SMEM_CAPACITY
    assert s.dq_stages >= 2 and s.dq_fixed_bytes + 2 * s.dq_stages * s.chunk_bytes + 1024 <= SMEM_CAPACITY
    assert s.dq_half_chunks + (s.n_chunks - s.dq_half_chunks) == s.n_chunks and s.dq_half_chunks * 64 <= 256
    full = BwdConfig(d, "bfloat16", False)
    assert s.key() != full.key() and s.dq_key() != full.dq_key()


@needs_cutlass
def test_bwd_dq_fragment_rows():
    """The dQ kernel keeps lse / delta of a thread's two query rows: in the m64n64 C fragment of S = Q K^T
    (rows = queries) register v belongs to the row of register 0 when (v // 2) % 2 == 0, else to the row of
    register 2, and rows never depend on the column; check every thread at trace time, on the kernels' own
    MMAs (``BwdSm90Base._tiled_mmas``)."""
    from cutlass import Float32

    from ffpa_attn.cutedsl.bwd_sm90_common import BwdSm90Base

    kernel = BwdSm90Base(BwdConfig(512, "bfloat16", True))
    problems = []

    @cute.jit
    def probe(x: cute.Tensor):
        ss, _, dq = kernel._tiled_mmas()
        ident = cute.make_identity_tensor((64, 64))
        for t in cutlass.range_constexpr(128):
            c = ss.get_slice(t).partition_C(ident)
            cq = dq.get_slice(t).partition_C(ident)
            for v in cutlass.range_constexpr(32):
                rep = 2 * ((v // 2) % 2)
                if cutlass.const_expr(c[v][0] != c[rep][0]):
                    problems.append(("row", t, v, c[v], c[rep]))
                if cutlass.const_expr(tuple(c[v]) != tuple(cq[v])):  # store_tiles uses the dQ MMA's layout
                    problems.append(("dq layout", t, v, c[v], cq[v]))

    x = cute.runtime.make_fake_compact_tensor(Float32, (16,), assumed_align=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe, x)
    assert not problems, problems[:5]


def _bwd_variants():
    full = [("dq", d, dt, c) for d in BWD_VARIANT_DIMS for dt in ("bfloat16", "float16") for c in (False, True)]
    return full + [("dkdv", 512, "bfloat16", False), ("dkdv", 512, "bfloat16", True), ("dkdv", 320, "float16", True),
                   ("dkdv", 448, "bfloat16", False),
                   # D > 512: V / dO streamed (pair GEMMs), 3-4 dK/dV parts, 2 dQ parts
                   ("dkdv", 1024, "bfloat16", True), ("dq", 1024, "bfloat16", True), ("dkdv", 576, "float16", False),
                   ("dq", 576, "float16", False), ("dkdv", 768, "bfloat16", False), ("dq", 768, "bfloat16", False),
                   # a partial last chunk (56 of 64 columns) on the streamed path (the dims above are multiples of 64)
                   ("dkdv", 1016, "bfloat16", True), ("dq", 1016, "bfloat16", True)]


@needs_cutlass
@pytest.mark.parametrize("kernel,d,dtype,causal", _bwd_variants(),
                         ids=lambda x: str(x) if not isinstance(x, bool) else ("causal" if x else "full"))
def test_bwd_compiles_for_sm90a(kernel, d, dtype, causal, tmp_path):
    """The dK/dV kernel (S^T, dP^T over nc chunks, dV, dK over the part: (2 nc + 2 ncp) x 4
    wgmma k-steps) and the dQ kernel (S, dP over nc chunks, dQ over the CTA's part: (2 nc + part) x 4; one part
    of nc chunks up to D = 512) -- no global atomics, no bulk reductions, no spills."""
    _check_bwd_ptx(BwdConfig(d, dtype, causal), kernel, tmp_path)


def _check_bwd_ptx(cfg: BwdConfig, kernel: str, tmp_path) -> str:
    """Compile one backward kernel and check its PTX / ptxas report (see the callers); returns it."""
    from ffpa_attn.cutedsl._compile import compile_bwd, compile_bwd_dq

    d, dtype = cfg.head_dim, cfg.dtype
    fn = compile_bwd if kernel == "dkdv" else compile_bwd_dq
    ptx = fn(cfg, keep_artifacts=True, dump_dir=str(tmp_path)).artifacts.PTX
    ab = "bf16" if dtype == "bfloat16" else "f16"
    n_wgmma = ptx.count(f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{ab}.{ab}")
    part = 2 * cfg.part_chunks if kernel == "dkdv" else cfg.dq_part_chunks
    want = (2 * cfg.n_chunks + part) * 4
    assert n_wgmma == want, (n_wgmma, want)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+232;", ptx) and re.search(r"setmaxnreg.dec.sync.aligned.u32\s+40;", ptx)
    assert not re.search(r"(atom|red)\.global\.add", ptx) and "cp.reduce.async.bulk" not in ptx
    report = _ptxas_report(ptx, tmp_path)
    if report is not None:
        assert int(re.search(r"(\d+) bytes spill stores", report).group(1)) == 0, report
        assert int(re.search(r"(\d+) bytes stack frame", report).group(1)) == 0, report
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 168, report
    return ptx


@needs_cutlass
@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("d,dtype,causal", [(264, "float16", True), (512, "bfloat16", True),
                                            (512, "bfloat16", False), (1024, "bfloat16", True)],
                         ids=lambda x: str(x) if not isinstance(x, bool) else ("causal" if x else "full"))
def test_bwd_varlen_compiles_for_sm90a(kernel, d, dtype, causal, tmp_path):
    """Packed sequences (``BwdConfig.varlen``): the same GEMMs, no atomics, no spills as the dense kernels, and
    the work item and sequence bounds read first."""
    ptx = _check_bwd_ptx(BwdConfig(d, dtype, causal, varlen=True), kernel, tmp_path)
    # before the warpgroups split, each CTA reads its work item (sequence, block) and the sequence's bounds in
    # cu_seqlens_q / cu_seqlens_k: 6 loads (the dense kernels load nothing there)
    prologue = ptx[:ptx.index("setmaxnreg")]
    assert len(re.findall(r"ld\.global\.", prologue)) == 6, "work item / cu_seqlens not read"


def test_bwd_varlen_config():
    cfg = BwdConfig(512, "bfloat16", True, varlen=True)
    dense = BwdConfig(512, "bfloat16", True)
    assert cfg.key() != dense.key() and cfg.dq_key() != dense.dq_key()
    assert cfg.key()[:-1] == dense.key() and cfg.dq_key()[:-1] == dense.dq_key()  # the dense key + "varlen"

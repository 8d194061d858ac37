"""CI compile checks of the Triton kernels on a CPU-only machine (``tools/compile_report.py``):

* the forward's hot configs compile for sm_90a (Hopper), fit the 227 KiB shared-memory limit and do not
  spill in the KV loop (``--check``);
* every forward and backward kernel the host code launches compiles for sm80 and sm90 at one head dim of
  each tile-shape class of [16, 1024] (``--matrix plain``: the tool first checks that its head dims cover
  every backward tile shape of the range), and every feature variant (masks, mask gradients, dropout,
  varlen, split / deterministic launch, gradient storage dtypes; descriptors on for sm90) at D=512
  (``--matrix all``).

It runs the tool in a subprocess because ``triton.compile`` needs the real JIT, not the interpreter that
``tests/conftest.py`` turns on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ptxas_available() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def _tool(args: list[str], cache: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run([sys.executable, str(ROOT / "tools" / "compile_report.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def matrix_cache(tmp_path_factory):
    """One Triton cache for the matrix runs (the feature run reuses the head-dim sweep's plain kernels)."""
    return tmp_path_factory.mktemp("triton-matrix-cache")


_JOBS = str(min(2, os.cpu_count() or 1))


@pytest.mark.skipif(not _ptxas_available(), reason="triton without the bundled ptxas")
@pytest.mark.parametrize("arch", [80, 90])
def test_every_head_dim_class_compiles(tmp_path, matrix_cache, arch):
    """Forward and backward, plain causal calls, fused and split backward, at MATRIX_DIMS (D = 8 mod 128
    among them: a 16-wide remainder slice, the case tl.dot once rejected)."""
    report = tmp_path / "matrix.json"
    proc = _tool(["--matrix", "plain", "--arch", str(arch), "--jobs", _JOBS, "--json", str(report)], matrix_cache)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "cover every backward tile shape" in proc.stdout
    rows = json.loads(report.read_text())
    assert {r["kernel"] for r in rows} == {"_ffpa_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel",
                                            "_bwd_dq_kernel"}
    narrow = [r for r in rows if r["kernel"] != "_ffpa_fwd_kernel" and r["constexprs"].get("DS") == 16
              and r["d"] == 264]
    assert len(narrow) >= 3, rows  # fused and split dK/dV, and dQ, at the 16-wide remainder
    assert not [r for r in rows if "error" in r]


@pytest.mark.skipif(not _ptxas_available(), reason="triton without the bundled ptxas")
@pytest.mark.parametrize("arch", [80, 90])
def test_every_feature_variant_compiles(tmp_path, matrix_cache, arch):
    report = tmp_path / "matrix.json"
    proc = _tool(["--matrix", "all", "--arch", str(arch), "--jobs", _JOBS, "--json", str(report)], matrix_cache)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = json.loads(report.read_text())
    seen = {(r["kernel"], k, v) for r in rows for k, v in r["constexprs"].items()}
    for kernel in ("_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        for flag in ("MASK_KIND", "DROPOUT", "VARLEN", "USE_TMA", "CAUSAL"):
            values = {1, 2} if flag == "MASK_KIND" else ({int(arch >= 90)} if flag == "USE_TMA" else {0, 1})
            assert {v for kk, k, v in seen if kk == kernel and k == flag} >= values, (kernel, flag)
    assert {v for kk, k, v in seen if kk == "_bwd_dkdv_kernel" and k == "DMASK_ATOMIC"} == {0, 1}
    assert {v for kk, k, v in seen if kk == "_bwd_dkdv_kernel" and k == "DQ_ATOMIC"} == {0, 1}


def _report(tmp_path, arch: int, dims: list[int], causal: list[int]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    report = tmp_path / f"report{arch}.json"
    args = [sys.executable, str(ROOT / "tools" / "compile_report.py"), "--check", "--arch", str(arch),
            "--d", *map(str, dims), "--causal", *map(str, causal), "--json", str(report)]
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.mark.skipif(not _ptxas_available(), reason="triton without the bundled ptxas")
def test_hot_configs_compile_for_sm90_without_spills(tmp_path):
    rows = _report(tmp_path, 90, [384, 512, 1024], [0, 1])  # 384: the wide unsplit tile (BLOCK_M 128, 8 warps)
    assert len(rows) >= 6
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 227 * 1024, r
        assert "tma=True" in r["config"], r  # Hopper reads K/V through tensor descriptors
        assert r["loops"] >= 1, r  # the SASS parse found the KV loop
        assert r["loop_spills"] == 0, r  # no local-memory traffic in the KV loop
        assert r["regs"] > 0, r


@pytest.mark.skipif(not _ptxas_available(), reason="triton without the bundled ptxas")
def test_hot_config_compiles_for_sm80(tmp_path):
    """The plain-pointer path (sm80-class GPUs: 163 KiB of shared memory) compiles and fits too."""
    rows = _report(tmp_path, 80, [384], [1])
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 163 * 1024, r
        assert "tma" not in r["config"], r
        assert r["loops"] >= 1 and r["loop_spills"] == 0, r

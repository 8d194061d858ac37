"""CI check: the Triton forward's hot configs compile for sm_90a (Hopper) on a CPU-only machine,
fit the 227 KiB shared-memory limit and do not spill in the KV loop (``tools/compile_report.py --check``).

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

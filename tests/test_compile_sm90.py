"""CI check of issue 3: the Triton forward's hot configs compile for sm_90a (Hopper) on a CPU-only machine,
fit the 227 KiB shared-memory limit and do not spill (``tools/compile_report.py --check``).

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


@pytest.mark.skipif(not _ptxas_available(), reason="triton without the bundled ptxas")
def test_hot_configs_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    report = tmp_path / "report.json"
    args = [sys.executable, str(ROOT / "tools" / "compile_report.py"), "--check", "--arch", "90",
            "--d", "512", "1024", "--causal", "0", "--json", str(report)]
    proc = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(report.read_text())
    assert len(rows) >= 2
    for r in rows:
        assert "error" not in r, r
        assert r["shared"] <= 227 * 1024, r
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["regs"] > 0, r

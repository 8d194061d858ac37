"""scripts/setup.sh's install order (offline first, then the package index, then what is installed) with a stub
Python that records the pip calls, and scripts/xdist_workers.py's worker count (scripts/test.sh)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# the .venv python of the stub checkout: pip installs succeed or fail as the environment says, and are logged
STUB = r"""#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$*" in
  *"import sysconfig"*) echo "$STUB_SITE" ;;
  "-m pip show"*) exit 1 ;;
  *"--no-index --no-build-isolation --no-deps -e ."*) exit "${STUB_CHECKOUT_RC:-0}" ;;
  *"--no-index"*) exit "${STUB_OFFLINE_RC:-0}" ;;
  "-m pip install"*) exit "${STUB_INDEX_RC:-0}" ;;
esac
exit 0
"""


def _setup(tmp_path: Path, **rcs: int) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """Run a copy of scripts/setup.sh in a stub checkout; (the result, the stub's calls, the .pth it may write)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    bin_ = repo / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "activate").write_text("")
    (bin_ / "python").write_text(STUB)
    (bin_ / "python").chmod((bin_ / "python").stat().st_mode | stat.S_IEXEC)
    site = tmp_path / "site"
    site.mkdir()
    log = tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if k != "FFPA_REQUIRE_NETWORK"}
    env.update(PATH=f"{bin_}:{env['PATH']}", STUB_LOG=str(log), STUB_SITE=str(site),
               **{f"STUB_{k.upper()}": str(v) for k, v in rcs.items() if k != "require_network"})
    if rcs.get("require_network"):
        env["FFPA_REQUIRE_NETWORK"] = "1"
    res = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    calls = [c for c in log.read_text().splitlines() if c.startswith("-m pip install")]
    return res, calls, site / "ffpa_attn_checkout.pth"


def test_setup_installs_offline_when_everything_is_there(tmp_path):
    res, calls, pth = _setup(tmp_path, offline_rc=0)
    assert res.returncode == 0, res.stderr
    assert len(calls) == 1 and "--no-index --no-build-isolation" in calls[0] and "requirements-ci.txt" in calls[0]
    assert not pth.exists() and "setup: installing ffpa-attn-kernels" in res.stdout


def test_setup_uses_the_index_for_what_is_missing(tmp_path):
    res, calls, pth = _setup(tmp_path, offline_rc=1, index_rc=0)
    assert res.returncode == 0, res.stderr
    assert len(calls) == 2 and "--no-index" not in calls[1] and "requirements-ci.txt" in calls[1]
    assert not pth.exists() and "from the package index" in res.stdout


def test_setup_without_an_index_installs_the_checkout_alone(tmp_path):
    res, calls, pth = _setup(tmp_path, offline_rc=1, index_rc=1, checkout_rc=0)
    assert res.returncode == 0, res.stderr
    assert calls[-1].endswith("--no-index --no-build-isolation --no-deps -e .") and not pth.exists()
    assert "no package index" in res.stdout


def test_setup_without_an_index_or_setuptools_puts_the_checkout_on_the_path(tmp_path):
    res, calls, pth = _setup(tmp_path, offline_rc=1, index_rc=1, checkout_rc=1)
    assert res.returncode == 0, res.stderr
    assert pth.read_text().strip() == str((tmp_path / "repo").resolve())


def test_setup_requiring_the_network_fails_when_the_index_does(tmp_path):
    res, calls, pth = _setup(tmp_path, offline_rc=1, index_rc=1, require_network=True)
    assert res.returncode == 1 and "FFPA_REQUIRE_NETWORK=1" in res.stdout
    assert len(calls) == 2 and not pth.exists()


def _workers_module():
    spec = importlib.util.spec_from_file_location("xdist_workers", ROOT / "scripts" / "xdist_workers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("env,free,cpus,want", [
    (None, None, 2, 2),  # no GPU: the CPU default
    (None, 79 * GIB, 16, 3), (None, 140 * GIB, 16, 7),  # an 80 GB H100, a 141 GB H200 (free memory)
    (None, 140 * GIB, 4, 4),  # never more than the CPUs
    (None, 5 * GIB, 16, 1),  # at least one
    ("8", 79 * GIB, 16, 8), ("0", None, 2, 0)])  # the variable wins
def test_worker_count(env, free, cpus, want):
    assert _workers_module().workers(env, free, cpus) == want


@pytest.mark.parametrize("env", ["two", "-1"])
def test_worker_count_refuses_a_bad_variable(env):
    with pytest.raises(SystemExit, match="FFPA_TEST_WORKERS"):
        _workers_module().workers(env, None, 2)


def test_memory_heavy_tests_share_one_xdist_group():
    """Tests marked gpu_memory_heavy (a marked test, a marked module) get the group that test.sh's --dist loadgroup
    sends to one worker: xdist names it in the node ids."""
    assert "--dist loadgroup" in (ROOT / "scripts" / "test.sh").read_text()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the GPU tests only collected and skipped, on any machine
    res = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", "-k", "test_64bit_offsets or test_full_layer_prefill_forward_backward or "
                          "test_strided_cache", "tests/gpu/test_decode_gpu.py", "tests/gpu/test_transformers_gpu.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ids = {line.split()[-1] for line in res.stdout.splitlines() if "::" in line and line.split()}
    assert "tests/gpu/test_decode_gpu.py::test_64bit_offsets@gpu-memory-heavy" in ids, res.stdout
    assert any(i.endswith("test_full_layer_prefill_forward_backward@gpu-memory-heavy") for i in ids), res.stdout
    assert "tests/gpu/test_decode_gpu.py::test_strided_cache" in ids, res.stdout  # unmarked: no group

"""The published metadata says true things: dependency floors the kernels really need, no development-machine
caps, one version source, and a ``--version`` flag."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ffpa_attn

ROOT = Path(ffpa_attn.__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _project() -> dict:
    if not PYPROJECT.exists():  # an installed wheel: no pyproject next to the package
        pytest.skip("no pyproject.toml beside the package")
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _floor(requirements: list[str], name: str) -> tuple[int, ...]:
    req = next(r for r in requirements if re.match(rf"{name}\b", r))
    m = re.search(r">=\s*([0-9.]+)", req)
    assert m, req
    return tuple(int(x) for x in m.group(1).split("."))


def test_installed_triton_has_the_apis_the_floor_promises():
    """triton's floor is the first release with tl.range(warp_specialize=), tl.make_tensor_descriptor and
    triton.tools.tensor_descriptor (all 3.4.0; 3.3.1 fails to compile the forward). The installed triton
    satisfies the floor and has all three, so the floor is not below what the kernels use."""
    import triton
    import triton.language as tl

    floor = _floor(_project()["dependencies"], "triton")
    installed = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    assert installed >= floor[:2], (triton.__version__, floor)
    assert floor[:2] >= (3, 4), floor  # 3.3 lacks warp_specialize and public tensor descriptors
    assert "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    assert hasattr(tl, "make_tensor_descriptor")
    assert hasattr(importlib.import_module("triton.tools.tensor_descriptor"), "TensorDescriptor")


def test_metadata_has_no_development_caps_or_ci_extra():
    project = _project()
    torch_req = next(r for r in project["dependencies"] if r.startswith("torch"))
    assert "<" not in torch_req, torch_req  # the local-wheel cap lives in scripts/constraints.txt
    extras = project["optional-dependencies"]
    assert "ci" not in extras
    assert extras["cute"] == ["nvidia-cutlass-dsl>=4.8.1"]
    assert any(r.startswith("nvidia-cutlass-dsl[cu13]") for r in extras["cute-cu13"])
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert project["dynamic"] == ["version"] and "version" not in project


def test_version_flag():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "ffpa_attn", "--version"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"ffpa-attn {ffpa_attn.__version__}"

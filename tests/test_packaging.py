"""The published metadata says true things: a distribution name of its own, dependency floors the kernels really
need and pip can resolve together, a cap on the CuTeDSL minor CI compile-checks, no development-machine caps, one
version source, project URLs, a ``--version`` flag, and an sdist that holds every file its tests read.

The test marked ``network`` builds the wheel and asks pip to resolve it with the oldest torch the metadata allows
(PyPI must be reachable: it skips when it is not, unless ``FFPA_REQUIRE_NETWORK=1``, which CI sets).
``scripts/check_floor.py`` (a step of ``.ci/run``) goes further: it installs that torch and runs the check.
"""
from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
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


def test_metadata_floors_caps_and_urls():
    project = _project()
    deps = project["dependencies"]
    torch_req = next(r for r in deps if r.startswith("torch"))
    assert "<" not in torch_req, torch_req  # the local-wheel cap lives in scripts/constraints.txt
    # PyPI's torch 2.5 / 2.6 / 2.7 pin triton 3.1 / 3.2 / 3.3: torch 2.8 is the first that installs with triton 3.4
    assert _floor(deps, "torch")[:2] == (2, 8) and _floor(deps, "triton")[:2] == (3, 4)
    extras = project["optional-dependencies"]
    assert "ci" not in extras
    # CuTeDSL changes between minor releases: capped below the next minor of the one CI compile-checks; its kernels
    # are called through TVM-FFI, so both extras bring it
    ffi = ["apache-tvm-ffi>=0.1.15,<0.2", "torch-c-dlpack-ext>=0.1.5"]
    assert extras["cute"] == ["nvidia-cutlass-dsl>=4.8.1,<4.9", *ffi]
    assert extras["cute-cu13"] == ["nvidia-cutlass-dsl[cu13]>=4.8.1,<4.9", *ffi]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert project["dynamic"] == ["version"] and "version" not in project
    urls = project["urls"]
    assert set(urls) == {"Homepage", "Repository", "Issues", "Changelog"}
    assert all(u.startswith("https://") for u in urls.values()), urls


def test_installed_cutlass_dsl_is_inside_the_cap():
    """The cap names the minor the CuTeDSL compile checks run against: the installed one (when present)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    assert tuple(int(x) for x in installed.split(".")[:2]) == (4, 8), installed


def test_distribution_name_is_not_the_public_packages():
    """The public ffpa-attn on PyPI installs an ffpa_attn folder too: ours is published under another name, and
    the code's copy of that name (install hints, --version, the commit stamp) agrees with pyproject."""
    assert _project()["name"] == ffpa_attn.__distribution__ == "ffpa-attn-kernels"
    assert ffpa_attn.__distribution__ != "ffpa-attn"
    assert _project()["scripts"] == {"ffpa-attn": "ffpa_attn.cli:main"}
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"^pip install (\S+)", readme, flags=re.M)
    assert installs and all(ffpa_attn.__distribution__ in i or i.startswith(('-e', '"-e')) for i in installs), installs
    assert "pip uninstall ffpa-attn" in readme


def test_version_flag():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "ffpa_attn", "--version"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{ffpa_attn.__distribution__} {ffpa_attn.__version__}"


# --------------------------------------------------------------------------------------------- building


def _floor_script():
    """scripts/check_floor.py (the CI step), whose project-file listing and source copy the builds here share."""
    path = ROOT / "scripts" / "check_floor.py"
    spec = importlib.util.spec_from_file_location("check_floor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _project_files() -> list[str]:
    return _floor_script().project_files(ROOT)


def _source_copy(dest: Path) -> Path:
    return _floor_script().source_copy(dest, ROOT)


def _build_sdist(tmp_path: Path) -> Path:
    """The sdist, built by the installed setuptools (PEP 517 hook, no network)."""
    import setuptools

    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build requirement (>= 77)")
    src = _source_copy(tmp_path / "src")
    out = tmp_path / "sdist"
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out / r.stdout.strip().splitlines()[-1]


def _literal(node: ast.AST) -> str | None:
    """A path piece written in the source: a string, or an f-string as a glob (``f"{name}.py"`` -> ``*.py``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def _division_chain(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _division_chain(node.left) + _division_chain(node.right)
    return [node]


def paths_tests_read(tests_dir: Path, top_level: set[str]) -> set[str]:
    """Globs (relative to the project root) of the files the test modules name: ``ROOT / "bench" / f"{x}.py"``
    chains of literal pieces after a root expression, and literal strings like ``"bench/x.py"``, whose first
    piece is a top-level entry of the project."""
    found: set[str] = set()
    for path in sorted(tests_dir.rglob("*.py")):
        tree = ast.parse(path.read_text())
        inner = {id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                 for side in (node.left, node.right) if isinstance(side, ast.BinOp) and isinstance(side.op, ast.Div)}
        for node in ast.walk(tree):
            pieces: list[str] = []
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and id(node) not in inner:
                for part in _division_chain(node):
                    piece = _literal(part)
                    if piece is None and pieces:
                        break  # a computed piece after the literal ones ends the path
                    if piece is not None:
                        pieces.append(piece)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"[\w.-]+(/[\w.*-]+)+", node.value):
                pieces = [node.value]
            if pieces and pieces[0].split("/")[0] in top_level:
                found.add("/".join(pieces))
    return found


def test_sdist_holds_every_file_the_tests_read(tmp_path):
    """Every project file a test names (a bench/ script it runs, tools/, docs/, README, ...) is in the sdist, so
    the suite runs from the unpacked sdist."""
    files = _project_files()
    top_level = {f.split("/")[0] for f in files}
    wanted = paths_tests_read(ROOT / "tests", top_level)
    assert {"bench/*.py", "tools/compile_report.py", "README.md", "docs/design.md"} <= wanted, sorted(wanted)
    sdist = _build_sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        shipped = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name}
    missing = {}
    for pattern in sorted(wanted):
        matched = [f for f in files if fnmatch.fnmatch(f, pattern) or f.startswith(pattern.rstrip("/") + "/")]
        lost = [f for f in matched if f not in shipped]
        if lost:
            missing[pattern] = lost
    assert not missing, f"files the tests read are not in {sdist.name}: {missing}"
    assert not any(f.startswith("bench/results/") for f in shipped)  # measurements stay in the repository


def test_the_scanner_finds_path_expressions(tmp_path):
    """The scan above sees the forms the tests use (so it cannot pass by finding nothing)."""
    (tmp_path / "test_x.py").write_text(
        'ROOT = None\nname = "a"\n'
        'p = ROOT / "bench" / f"{name}.py"\nq = str(ROOT / "tools" / "report.py")\n'
        'r = ROOT / "docs" / name / "x.md"\ns = "scripts/setup.sh"\nt = tmp / "other" / "x"\n')
    assert paths_tests_read(tmp_path, {"bench", "tools", "docs", "scripts"}) == {
        "bench/*.py", "tools/report.py", "docs", "scripts/setup.sh"}


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/torch/", timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def _pip(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.network
def test_wheel_resolves_with_the_oldest_torch_it_allows(tmp_path):
    """``pip wheel --no-deps .``, then ``pip install --dry-run --ignore-installed torch==<floor> <wheel>``: pip finds
    a triton that satisfies both (torch's pin and our floor); the torch release before the floor does not resolve."""
    if not _pypi_reachable():
        if os.environ.get("FFPA_REQUIRE_NETWORK") == "1":
            pytest.fail("PyPI is not reachable and FFPA_REQUIRE_NETWORK=1")
        pytest.skip("PyPI is not reachable")
    deps = _project()["dependencies"]
    torch_floor, triton_floor = _floor(deps, "torch"), _floor(deps, "triton")
    assert ".".join(map(str, torch_floor)) == _floor_script().dependency_floor("torch", ROOT)
    src = _source_copy(tmp_path / "src")
    r = _pip("wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(src))
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp_path / "dist").glob("*.whl"))
    assert wheel.name.startswith(ffpa_attn.__distribution__.replace("-", "_") + "-")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Name: {ffpa_attn.__distribution__}" in meta and "Requires-Dist: torch>=2.8" in meta
    assert meta.count("Project-URL:") == 4
    # without PEP 658 metadata on the index pip would download every wheel whole (GBs for torch): read ranges
    fast = ["--use-feature=fast-deps"] if "fast-deps" in _pip("install", "--help").stdout else []
    floor = ".".join(map(str, torch_floor))
    report = tmp_path / "report.json"
    r = _pip("install", "--dry-run", "--ignore-installed", "--quiet", *fast, "--report", str(report),
             f"torch=={floor}", str(wheel))
    assert r.returncode == 0, r.stdout + r.stderr
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"].split("+")[0] in (floor, floor + ".0"), chosen["torch"]
    assert tuple(int(x) for x in chosen["triton"].split(".")[:2]) >= triton_floor[:2], chosen["triton"]
    assert chosen[ffpa_attn.__distribution__] == ffpa_attn.__version__
    before = f"torch=={torch_floor[0]}.{torch_floor[1] - 1}.*"  # the release line before the floor
    r = _pip("install", "--dry-run", "--ignore-installed", "--quiet", *fast, before, str(wheel))
    assert r.returncode != 0 and "ResolutionImpossible" in r.stdout + r.stderr, r.stdout + r.stderr


def test_floor_script_reads_the_floors(monkeypatch):
    """scripts/check_floor.py installs the torch floor pyproject names (also on Python 3.10, without tomllib)."""
    script = _floor_script()
    deps = _project()["dependencies"]
    expected = ".".join(map(str, _floor(deps, "torch")))
    assert script.dependency_floor("torch", ROOT) == expected
    monkeypatch.setitem(sys.modules, "tomllib", None)  # import tomllib raises ImportError
    assert script.dependency_floor("torch", ROOT) == expected
    assert script.dependency_floor("triton", ROOT) == ".".join(map(str, _floor(deps, "triton")))

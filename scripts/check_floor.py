#!/usr/bin/env python3
"""The package on the oldest torch its metadata allows: a CI step (``.ci/run``), no GPU, PyPI needed.

In a throwaway virtual environment: build the wheel (``pip wheel --no-deps``, from a copy of the source tree),
``pip install torch==<floor> <wheel>`` (pip has to find a triton that both torch's pin and our floor accept), then
run ``python -m ffpa_attn --version`` and ``python -m ffpa_attn check`` (the Triton kernels under the interpreter
against the fp32 reference) from outside the checkout. Exit status: 0 when all of it worked.

The floors come from pyproject.toml; ``--torch`` checks another version. PyPI's Linux torch wheels are CUDA builds
that also run on a CPU: the environment takes ~6 GB and ~2-3 minutes to install; it is deleted afterwards.
``tests/test_packaging.py`` imports :func:`project_files` / :func:`source_copy` from here.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# build outputs and local environments: never part of the project's files
NOT_SOURCE = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".devcache", ".device-wheels",
              ".device-tools", "out"}
# the interpreters of triton < 3.7 call int() on 1-element arrays, which numpy >= 2.4 refuses (GPU runs are not
# affected); the torch floor pins such a triton
INTERPRETER_NUMPY = "numpy<2.4"


def project_files(root: Path = ROOT) -> list[str]:
    """The project's files relative to ``root``: what git tracks or would track in a checkout, else (an unpacked
    sdist) every file but build outputs and environments."""
    top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout
        return sorted(f for f in out.split("\0") if f and (root / f).is_file())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in NOT_SOURCE and not d.endswith(".egg-info")]
        files += [str((Path(dirpath) / f).relative_to(root)) for f in filenames if not f.endswith((".pyc", ".pyo"))]
    return sorted(files)


def source_copy(dest: Path, root: Path = ROOT) -> Path:
    """A copy of the project at ``dest`` to build from (a build writes egg-info and build folders into its source
    tree, and the checkout stays clean)."""
    for rel in project_files(root):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
    return dest


def dependency_floor(name: str, root: Path = ROOT) -> str:
    """The ``>=`` version of dependency ``name`` in pyproject.toml's ``[project] dependencies``."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # 3.10: the dependency list is one line of quoted requirements
        deps = re.findall(r'"([^"]+)"', re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1))
    else:
        deps = tomllib.loads(text)["project"]["dependencies"]
    req = next(r for r in deps if re.match(rf"{re.escape(name)}\b", r))
    m = re.search(r">=\s*([0-9.]+)", req)
    if m is None:
        raise SystemExit(f"check_floor: {name} has no >= floor in pyproject.toml ({req!r})")
    return m.group(1)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", default=None, help="torch version to install (default: the floor in pyproject)")
    parser.add_argument("--keep", metavar="DIR", default=None, help="work in DIR and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    torch_version = args.torch or dependency_floor("torch")
    start = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ffpa-floor-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        venv = work / "venv"
        _run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
        src = source_copy(work / "src")
        _run([*pip, "wheel", "--no-deps", "--quiet", "-w", str(work / "dist"), str(src)])
        wheel = str(next((work / "dist").glob("*.whl")))
        _run([*pip, "install", "--quiet", f"torch=={torch_version}", wheel, INTERPRETER_NUMPY])
        # outside the checkout, without PYTHONPATH: the installed wheel is what runs
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
        env["FFPA_ATTN_CACHE_DIR"] = str(work / "cache")
        _run([py, "-c", "import ffpa_attn, torch, triton, sys; print('ffpa_attn', ffpa_attn.__version__, 'from', "
                        "ffpa_attn.__file__, '| torch', torch.__version__, '| triton', triton.__version__); "
                        f"sys.exit(0 if ffpa_attn.__file__.startswith({str(venv)!r}) else 1)"], cwd=work, env=env)
        _run([py, "-m", "ffpa_attn", "--version"], cwd=work, env=env)
        _run([py, "-m", "ffpa_attn", "check"], cwd=work, env=env)
    except subprocess.CalledProcessError as exc:
        print(f"check_floor: FAILED on torch {torch_version}: {' '.join(map(str, exc.cmd))} exited {exc.returncode}",
              file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"check_floor: torch {torch_version} OK ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

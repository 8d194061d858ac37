"""The environment a run happens in: package versions, GPU properties, git commit, backend availability.

Used by ``python -m ffpa_attn info`` and stamped into every benchmark result. Nothing here imports
triton or a kernel module (versions come from package metadata), so ``info`` on a CPU-only machine does
not decide the Triton interpreter mode for the process.
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from ..config import BACKEND_CLASSES
from ..dispatch.registry import available as backend_available

# distribution names whose versions we report
PACKAGES = {
    "torch": "torch",
    "triton": "triton",
    "cutlass-dsl": "nvidia-cutlass-dsl",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "tqdm": "tqdm",
}
COMMIT_ENV = "FFPA_GIT_COMMIT"


def dist_version(dist: str) -> str | None:
    """Installed version of distribution ``dist`` (None if absent)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """python, ffpa_attn, torch (+ CUDA, cuDNN), triton, cutlass-dsl, ... versions."""
    from .._version import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "ffpa_attn": __version__}
    for key, dist in PACKAGES.items():
        out[key] = dist_version(dist)
    # nvidia-cutlass-dsl is a metapackage over its libraries; an install of the libraries alone is still one
    out["cutlass-dsl"] = out["cutlass-dsl"] or dist_version("nvidia-cutlass-dsl-libs-base")
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out["cudnn"] = str(cudnn) if cudnn else None
    return out


def gpu_info(index: int = 0) -> dict[str, Any] | None:
    """Name, compute capability, SM count, shared memory and memory of CUDA device ``index`` (None without)."""
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(index)
    smem_block = getattr(p, "shared_memory_per_block_optin", None)
    smem_sm = getattr(p, "shared_memory_per_multiprocessor", None)
    return {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "smem_per_block_optin_kib": smem_block // 1024 if smem_block else None,
        "smem_per_sm_kib": smem_sm // 1024 if smem_sm else None,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "device_count": torch.cuda.device_count(),
    }


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


PUBLIC_DISTRIBUTION = "ffpa-attn"  # the public package on PyPI: it installs an ffpa_attn folder too


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def _is_this_project(root: Path) -> bool:
    """Whether ``root/pyproject.toml`` is this project's (its distribution name in ``[project]``)."""
    from .._version import __distribution__

    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return False
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return bool(section and re.search(rf'^name\s*=\s*["\']{re.escape(__distribution__)}["\']\s*$', section.group(1), re.M))


def repo_root(package_dir: Path | None = None) -> Path | None:
    """The git checkout of ffpa-attn this package (``package_dir``, default: this ``ffpa_attn``) is imported
    from, or None.

    Only when the package directory's parent is the top level of a git work tree whose ``pyproject.toml`` names
    this project: an installed copy that happens to sit inside some other repository (a virtual environment in a
    user's project, a vendored copy) has no commit of ours to report.
    """
    pkg = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parents[1]
    root = pkg.resolve().parent
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        return None
    return root if _is_this_project(root) else None


def git_commit(package_dir: Path | None = None) -> tuple[str, bool | None]:
    """``(hash, dirty)`` of the ffpa-attn checkout holding this package (:func:`repo_root` of ``package_dir``).

    ``FFPA_GIT_COMMIT`` overrides (for copies of the tree without ``.git``, e.g. on a remote GPU host;
    dirty is then unknown: None). ``("unknown", None)`` when the package is not imported from its own checkout.
    Dirty means tracked files differ in content from the commit (file-mode changes, which copies of a tree
    often bring, do not count; untracked files neither).
    """
    forced = os.environ.get(COMMIT_ENV, "").strip()
    if forced:
        return forced, None
    root = repo_root(package_dir)
    if root is None:
        return "unknown", None
    head = _git(root, "rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return "unknown", None
    status = _git(root, "-c", "core.fileMode=false", "status", "--porcelain", "--untracked-files=no")
    dirty = bool(status.stdout.strip()) if status is not None and status.returncode == 0 else None
    return head.stdout.strip(), dirty


def backend_report(device: torch.device) -> list[tuple[str, bool, str]]:
    """``(name, available, reason)`` for every backend on ``device``."""
    return [(name, *backend_available(name, device)) for name in BACKEND_CLASSES]


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_meta(command: str, device: torch.device) -> dict[str, Any]:
    """Metadata stamped into a benchmark result: command, commit, date, device, versions, env."""
    commit, dirty = git_commit()
    gpu = gpu_info(device.index or 0) if device.type == "cuda" else None
    return {
        "command": command,
        "commit": commit,
        "commit_dirty": dirty,
        "date": now_utc(),
        "device": device.type,
        "gpu": gpu,
        "gpu_name": gpu["name"] if gpu else "CPU",
        "versions": versions(),
        "env": {k: os.environ[k] for k in ("TRITON_INTERPRET", "FFPA_UPSTREAM_PATH", "CUDA_VISIBLE_DEVICES")
                if k in os.environ},
        "host": platform.node(),
    }


def conflicting_install() -> str | None:
    """A warning when the environment also holds the distribution ``ffpa-attn`` (the public package, or this
    package installed under its former name): it writes the same ``ffpa_attn`` folder, so the two overwrite each
    other's files. None when it is absent."""
    from .._version import __distribution__

    other = dist_version(PUBLIC_DISTRIBUTION)
    if other is None:
        return None
    return (f"the distribution {PUBLIC_DISTRIBUTION} {other} is installed in this environment too and installs the "
            f"same ffpa_attn package: pip uninstall {PUBLIC_DISTRIBUTION} {__distribution__}, then "
            f"pip install {__distribution__}")


def info_lines(device: torch.device | None = None) -> list[str]:
    """The report of ``python -m ffpa_attn info``."""
    from .._version import __distribution__

    device = default_device() if device is None else device
    v = versions()
    installed = dist_version(__distribution__)
    lines = [f"ffpa_attn   {v['ffpa_attn']}  ({Path(__file__).resolve().parents[1]})",
             f"distribution {__distribution__}: "
             + (f"{installed} installed" if installed else "not installed (imported from a source tree)"),
             f"python      {v['python']}",
             f"torch       {v['torch']}  (CUDA {v['cuda'] or 'none'}, cuDNN {v['cudnn'] or 'none'})",
             f"triton      {v['triton'] or 'not installed'}",
             f"cutlass-dsl {v['cutlass-dsl'] or 'not installed'}",
             f"bench extras: matplotlib {v['matplotlib'] or 'not installed'}, tqdm {v['tqdm'] or 'not installed'}"]
    gpu = gpu_info(device.index or 0) if device.type == "cuda" else None
    if gpu is None:
        lines.append("GPU         none found (CPU only)")
    else:
        lines.append(f"GPU         {gpu['name']}  sm{gpu['capability'].replace('.', '')}, {gpu['sm_count']} SMs, "
                     f"smem {gpu['smem_per_block_optin_kib']} KiB/block (opt-in), {gpu['smem_per_sm_kib']} KiB/SM, "
                     f"{gpu['memory_gib']} GiB, {gpu['device_count']} device(s)")
    lines.append(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}")
    commit, dirty = git_commit()
    if commit == "unknown" and repo_root() is None and not os.environ.get(COMMIT_ENV):
        lines.append("commit      none (not imported from a git checkout of ffpa-attn)")
    else:
        lines.append(f"commit      {commit}{' (uncommitted changes)' if dirty else ''}")
    conflict = conflicting_install()
    if conflict:
        lines.append(f"WARNING     {conflict}")
    lines.append(f"backends on {device}:")
    for name, ok, why in backend_report(device):
        lines.append(f"  {name:<8} {'yes' if ok else 'no ':<4} {why}")
    return lines

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
from ..dispatch.capabilities import backend_available

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
    from .. import __version__

    out: dict[str, str | None] = {"python": platform.python_version(), "ffpa_attn": __version__}
    for key, dist in PACKAGES.items():
        out[key] = dist_version(dist)
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


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def git_commit() -> tuple[str, bool | None]:
    """``(hash, dirty)`` of the checkout holding this package.

    ``FFPA_GIT_COMMIT`` overrides (for copies of the tree without ``.git``, e.g. on a remote GPU host;
    dirty is then unknown: None). Falls back to ``("unknown", None)``.
    """
    forced = os.environ.get(COMMIT_ENV, "").strip()
    if forced:
        return forced, None
    root = repo_root()
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown", None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return head.stdout.strip(), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


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


def info_lines(device: torch.device | None = None) -> list[str]:
    """The report of ``python -m ffpa_attn info``."""
    device = default_device() if device is None else device
    v = versions()
    lines = [f"ffpa_attn   {v['ffpa_attn']}  ({Path(__file__).resolve().parents[1]})",
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
    lines.append(f"commit      {commit}{' (uncommitted changes)' if dirty else ''}")
    lines.append(f"backends on {device}:")
    for name, ok, why in backend_report(device):
        lines.append(f"  {name:<8} {'yes' if ok else 'no ':<4} {why}")
    return lines

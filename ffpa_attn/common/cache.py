"""The on-disk cache every compiled-kernel cache uses (Triton autotune results, CuTeDSL kernels, CUDA cubins).

* root: ``$FFPA_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ffpa_attn``, else ``~/.cache/ffpa_attn``; each cache
  has its own folder under it (``autotune/``, ``cute/``, ``cuda/``);
* :func:`source_fingerprint`: a short hash of source files and version strings, naming a folder or key so
  that editing a kernel or upgrading a compiler never loads a stale entry;
* :class:`FileLock`: an exclusive ``flock`` on a lock file (concurrent processes do not write one entry twice);
* :func:`atomic_write`: temp file + rename, so a reader never sees a partial file.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterable

from .env import env_str


def cache_root() -> Path:
    """``$FFPA_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ffpa_attn``, else ``~/.cache/ffpa_attn`` (not created)."""
    root = env_str("FFPA_ATTN_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ffpa_attn"


def source_fingerprint(paths: Iterable[str | os.PathLike], extra: str = "", length: int = 24) -> str:
    """Hex digest (``length`` chars) of ``extra`` plus each file's name and bytes (a missing file: its path)."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        path = Path(p)
        h.update(path.name.encode())
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(str(p).encode())
    return h.hexdigest()[:length]


class FileLock:
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created if missing) across processes."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1

    def __enter__(self) -> "FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


__all__ = ["cache_root", "source_fingerprint", "FileLock", "atomic_write"]

"""The cache root, its layout, and the file primitives every cache writes with (stdlib only: no torch, no backend).

Layout: one folder per cache kind under :func:`cache_root` (:func:`kind_dir`): ``autotune/`` (Triton autotune
results, JSON), ``cute/`` (CuTeDSL kernels, shared objects), ``cuda/`` (cubins); under it, one folder per
:func:`source_fingerprint` of what produced the entries, so editing a kernel or upgrading a compiler never loads a
stale entry (old folders are left for the user to delete).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

from ..common.env import env_str

logger = logging.getLogger("ffpa_attn")

_KIND = re.compile(r"[a-z][a-z0-9_]*")


def cache_root() -> Path:
    """``$FFPA_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ffpa_attn``, else ``~/.cache/ffpa_attn`` (not created)."""
    root = env_str("FFPA_ATTN_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ffpa_attn"


def kind_dir(kind: str) -> Path:
    """The folder of one cache kind (``"autotune"``, ``"cute"``, ``"cuda"``) under :func:`cache_root` (not
    created); ``kind`` is a lower-case identifier, so no cache can reach outside the root."""
    if not _KIND.fullmatch(kind):
        raise ValueError(f"cache kind must be a lower-case identifier, got {kind!r}")
    return cache_root() / kind


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
    """``with FileLock(path):`` holds an exclusive lock on ``path`` (created if missing) across processes.

    ``flock`` locks belong to the open file, so a process that dies (a killed compile worker) frees its locks."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1

    def __enter__(self) -> "FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename (a reader never sees a
    partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when it is missing, unreadable or not an object (a cache is never a
    failure)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def update_json(path: Path, entries: dict[str, Any]) -> bool:
    """Merge ``entries`` into the JSON object in ``path``: read, merge and atomic write under the file's lock, so
    concurrent writers keep every entry. False (logged) when the disk refuses: a read-only home must not break
    a caller."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_suffix(".lock")):
            data = read_json(path)
            data.update(entries)
            atomic_write(path, json.dumps(data, indent=1, sort_keys=True).encode())
        return True
    except OSError as err:
        logger.debug("ffpa_attn.cache: cannot write %s (%s)", path, err)
        return False


__all__ = ["cache_root", "kind_dir", "source_fingerprint", "FileLock", "atomic_write", "read_json", "update_json"]

"""A cache of compiled artifacts (kernels, cubins) in memory and on disk, with compiles handed to a compile server.

Lookup order for ``(key, fingerprint)`` of one :class:`ArtifactCache` (one cache kind): this process's dict, then
a compile job of this process for it (:meth:`ArtifactCache.submit`: waited for), then the file
``<kind>/<fingerprint>/<key name><suffix>`` under the cache root (written by an earlier process or a compile job),
then ``build()`` (whose result is written for the next process). The fingerprint names what produced the artifact
(sources, compiler versions, target arch), so a change never loads a stale file. A lock per key (a thread lock in
this process, a file lock across processes) keeps two compiles of one key from running at once. A cache is never a
failure: a disk that refuses, a file that does not load, a write that fails all fall back to compiling (the error
of ``build()`` itself is the caller's).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import pickle
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

from .disk import FileLock, atomic_write, kind_dir
from .pool import JOB_TIMEOUT_S, CompilePool

logger = logging.getLogger("ffpa_attn")

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def key_name(key: Hashable) -> str:
    """The file stem of ``key``: a short file-safe string key as it is, any other key ``k`` + a hash of its repr
    (keys are tuples of str / int / bool, whose repr is the same in every process)."""
    if isinstance(key, str) and _SAFE_NAME.fullmatch(key):
        return key
    return "k" + hashlib.sha256(repr(key).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Format:
    """How one kind of artifact is stored: ``save(artifact, path)`` writes it (atomically: a reader never sees a
    partial file), ``load(path)`` reads it back. Module-level functions, so the format pickles into a compile job."""

    suffix: str
    save: Callable[[Any, Path], None]
    load: Callable[[Path], Any]


def _save_pickle(artifact: Any, path: Path) -> None:
    atomic_write(path, pickle.dumps(artifact, protocol=pickle.HIGHEST_PROTOCOL))


def _load_pickle(path: Path) -> Any:
    return pickle.loads(path.read_bytes())


def _save_bytes(artifact: bytes, path: Path) -> None:
    atomic_write(path, bytes(artifact))


def _load_bytes(path: Path) -> bytes:
    return path.read_bytes()


PICKLE = Format(".pkl", _save_pickle, _load_pickle)


def bytes_format(suffix: str) -> Format:
    """Artifacts that are bytes (a cubin), stored as they are in ``*<suffix>`` files."""
    return Format(suffix, _save_bytes, _load_bytes)


@dataclass(frozen=True)
class Store:
    """Where one cache kind keeps its artifacts on disk, and in which :class:`Format` (picklable)."""

    kind: str
    format: Format

    def path(self, key: Hashable, fingerprint: str) -> Path:
        """``<cache root>/<kind>/<fingerprint>/<key name><suffix>`` (not created)."""
        return kind_dir(self.kind) / fingerprint / (key_name(key) + self.format.suffix)


def build_to_disk(store: Store, key: Hashable, fingerprint: str, build: Callable[[], Any]) -> bool:
    """A compile job (runs in a compile worker): make sure the artifact of ``key`` is on disk; True when it
    compiled it, False when the file was there already. Raises when the disk refuses or the write fails (the job
    then failed, and the caller compiles the artifact itself)."""
    path = store.path(key, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_suffix(".lock")):
        if path.exists():
            return False
        store.format.save(build(), path)
    return True


class ArtifactCache:
    """The compiled artifacts of one cache kind (:class:`Store`), in memory and on disk.

    Args:
        store: the kind's folder and file format.
        disk: ``() -> bool``: whether the disk cache is on (read at each lookup); off: memory only, and no
            compile jobs (a job hands its artifact over through the disk).
        pool: ``() -> CompilePool``: the pool :meth:`submit` hands jobs to (none: no compile jobs).
    """

    def __init__(self, store: Store, disk: Callable[[], bool] = lambda: True,
                 pool: Callable[[], CompilePool] | None = None) -> None:
        self.store = store
        self.disk_enabled = disk
        self.pool = pool
        self._memory: dict[tuple[str, Hashable], Any] = {}
        self._pending: dict[tuple[str, Hashable], int] = {}  # a compile job not waited for yet
        self._key_locks: dict[tuple[str, Hashable], threading.Lock] = {}
        self._counts = {"compiled": 0, "loaded": 0}  # builds run in this process; artifacts read from disk
        self._lock = threading.Lock()  # guards the dicts above

    def _key_lock(self, mkey: tuple[str, Hashable]) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(mkey, threading.Lock())

    def get_or_compile(self, key: Hashable, fingerprint: str, build: Callable[[], Any]) -> Any:
        """The artifact of ``key`` (memory, a pending compile job, disk, then ``build()``)."""
        mkey = (fingerprint, key)
        hit = self._memory.get(mkey)
        if hit is not None:
            return hit
        with self._key_lock(mkey):
            hit = self._memory.get(mkey)
            if hit is not None:
                return hit
            with self._lock:
                job = self._pending.pop(mkey, None)
            if job is not None and self.pool is not None:  # a worker compiles it: wait, then (normally) load it
                self.pool().wait(job, JOB_TIMEOUT_S)
            artifact = self._from_disk_or_build(key, fingerprint, build) if self.disk_enabled() else self._build(build)
            self._memory[mkey] = artifact
            return artifact

    def _build(self, build: Callable[[], Any]) -> Any:
        artifact = build()
        with self._lock:
            self._counts["compiled"] += 1
        return artifact

    def counts(self) -> dict[str, int]:
        """``compiled``: artifacts this process built, ``loaded``: artifacts it read from disk (benchmarks and
        tests tell a cold call from a warm one with these)."""
        with self._lock:
            return dict(self._counts)

    def _from_disk_or_build(self, key: Hashable, fingerprint: str, build: Callable[[], Any]) -> Any:
        with contextlib.ExitStack() as held:
            try:
                path = self.store.path(key, fingerprint)
                path.parent.mkdir(parents=True, exist_ok=True)
                held.enter_context(FileLock(path.with_suffix(".lock")))
            except OSError as err:  # a read-only or full disk: compile in memory
                logger.debug("ffpa_attn.cache: disk cache unavailable (%s); compiling in memory", err)
                return self._build(build)
            if path.exists():
                try:
                    artifact = self.store.format.load(path)
                    with self._lock:
                        self._counts["loaded"] += 1
                    return artifact
                except Exception as err:  # noqa: BLE001 - a corrupt or incompatible file: rebuild it
                    logger.debug("ffpa_attn.cache: cannot load %s (%s); recompiling", path, err)
            artifact = self._build(build)
            try:
                self.store.format.save(artifact, path)
            except Exception as err:  # noqa: BLE001 - the artifact is built; only the cache write failed
                logger.debug("ffpa_attn.cache: cannot write %s (%s)", path, err)
            return artifact

    def is_cached(self, key: Hashable, fingerprint: str) -> bool:
        """Whether ``key`` is in memory, on disk or being compiled by a job of this process (no load, no
        compile)."""
        mkey = (fingerprint, key)
        if mkey in self._memory or mkey in self._pending:
            return True
        try:
            return self.disk_enabled() and self.store.path(key, fingerprint).exists()
        except OSError:
            return False

    def submit(self, key: Hashable, fingerprint: str, build: Callable[[], Any]) -> int | None:
        """Have a compile worker write the artifact of ``key`` to disk (:func:`build_to_disk`; the per-key file
        lock orders it with any other process); returns the job id (the pending one when ``key`` was handed over
        already), or None when there is no pool, the disk cache is off, the pool is busy or ``build`` does not
        pickle (the artifact is then compiled here when it is needed). :meth:`get_or_compile` of ``key`` waits for
        the job before it looks at the disk."""
        if self.pool is None or not self.disk_enabled():
            return None
        self._reap_finished()
        mkey = (fingerprint, key)
        with self._lock:
            if mkey in self._pending:  # handed over already and not finished: never compile one key twice
                return self._pending[mkey]
        job = self.pool().submit(key, functools.partial(build_to_disk, self.store, key, fingerprint, build))
        if job is not None:
            with self._lock:
                self._pending[mkey] = job
        return job

    def pending(self) -> dict[tuple[str, Hashable], int]:
        """``{(fingerprint, key): job id}`` of the compile jobs not waited for yet."""
        with self._lock:
            return dict(self._pending)

    def _reap_finished(self) -> None:
        """Forget the jobs that have finished (their artifacts are on disk, or get_or_compile compiles them)."""
        if self.pool is None:
            return
        pool = self.pool()
        with self._lock:
            for mkey, job in list(self._pending.items()):
                if pool.done(job):
                    self._pending.pop(mkey, None)

    def wait_all(self) -> None:
        """Wait for every compile job of this cache (benchmarks: no compile competes with a timed loop)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                _, job = self._pending.popitem()
            if self.pool is not None:
                self.pool().wait(job, JOB_TIMEOUT_S)

    def clear_memory(self) -> None:
        """Forget the artifacts held in this process (the disk cache stays)."""
        with self._lock:
            self._memory.clear()


__all__ = ["ArtifactCache", "Format", "Store", "PICKLE", "bytes_format", "build_to_disk", "key_name"]

"""In-memory and on-disk cache of compiled CuTeDSL kernels.

Lookup order for a configuration key: this process's dict, then an object file exported by an earlier
process under the cache root (:func:`ffpa_attn.common.cache.cache_root`) ``/cute/<fingerprint>/``, then
``compile_fn()`` (whose result is exported for the next process). The fingerprint hashes the sources of
this package plus the Python, cutlass-dsl and ffpa-attn versions and the target arch, so editing a kernel
or upgrading a dependency never loads a stale binary. A per-key file lock keeps concurrent processes
from writing the same file; any disk error falls back to compiling (a cache is never a failure).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

from ..common.cache import FileLock, cache_root, source_fingerprint
from ..common.env import env_flag

logger = logging.getLogger("ffpa_attn")

_MEMORY: dict[Hashable, Any] = {}
_LOCK = threading.Lock()
_PENDING: dict[Hashable, int] = {}  # (arch, key) -> id of a compile_pool job not waited for yet


def disk_cache_enabled() -> bool:
    return env_flag("FFPA_ATTN_CUTE_DISK_CACHE")


@functools.lru_cache(maxsize=None)
def fingerprint(arch: str) -> str:
    """Hash of this package's sources, the toolchain versions and ``arch``."""
    from ._env import prepare_cutlass_import

    prepare_cutlass_import()
    import cutlass

    from .._version import __version__

    here = Path(__file__).resolve().parent
    return source_fingerprint(sorted(here.glob("*.py")), length=24,
                              extra=f"py{sys.version_info.major}.{sys.version_info.minor}|cutlass={cutlass.__version__}|"
                                    f"ffpa_attn={__version__}|{arch}")


def _key_name(key: Hashable) -> str:
    return "k" + hashlib.sha256(repr(key).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def _preload_runtime() -> None:
    """Load the CuTeDSL runtime libraries with RTLD_GLOBAL: an exported object resolves symbols such as
    ``_cudaLibraryLoadData`` against them, and ``load_module`` alone does not make them global."""
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load(path: Path, name: str) -> Any:
    import cutlass.cute as cute

    _preload_runtime()
    module = cute.runtime.load_module(str(path))
    fn = getattr(module, name)
    fn._ffpa_module = module  # keep the loaded module alive with the function
    return fn


def get_or_compile(key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> Any:
    """The compiled function for ``key`` (memory, then disk, then ``compile_fn()``)."""
    mkey = (arch, key)
    fn = _MEMORY.get(mkey)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _MEMORY.get(mkey)
        if fn is not None:
            return fn
        job = _PENDING.pop(mkey, None)
        if job is not None:  # a worker compiles it: wait, then (normally) load its file
            wait_child(job)
        fn = _disk_get_or_compile(key, arch, compile_fn) if disk_cache_enabled() else compile_fn()
        _MEMORY[mkey] = fn
        return fn


def _disk_get_or_compile(key: Hashable, arch: str, compile_fn: Callable[[], Any], load: bool = True) -> Any:
    """The kernel from the disk cache, else compiled and exported; ``load=False`` (a compile worker): only make
    sure the file exists (returns None when it already did)."""
    name = _key_name(key)
    try:
        folder = cache_root() / "cute" / fingerprint(arch)
        folder.mkdir(parents=True, exist_ok=True)
        obj = folder / f"{name}.o"
        with FileLock(folder / f"{name}.lock"):
            if obj.exists():
                if not load:
                    return None
                try:
                    return _load(obj, name)
                except Exception as err:  # corrupt or incompatible file: rebuild it
                    logger.debug("ffpa_attn.cute: cannot load %s (%s); recompiling", obj, err)
            fn = compile_fn()
            _export(fn, folder, name, obj)
            return fn
    except OSError as err:
        logger.debug("ffpa_attn.cute: disk cache unavailable (%s); compiling in memory", err)
        return compile_fn() if load else None


def _export(fn: Any, folder: Path, name: str, obj: Path) -> None:
    """Write ``fn`` as ``obj`` (through a private temp folder, renamed into place)."""
    tmp = folder / f".{name}.{os.getpid()}"
    try:
        tmp.mkdir(exist_ok=True)
        fn.export_to_c(str(tmp), name, function_prefix=name)
        os.replace(tmp / f"{name}.o", obj)
    except Exception as err:  # the kernel is compiled; only the cache write failed
        logger.debug("ffpa_attn.cute: cannot export %s (%s)", obj, err)
    finally:
        if tmp.exists():
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()


def is_cached(key: Hashable, arch: str) -> bool:
    """Whether ``key`` is compiled in this process, exported on disk or being compiled by a worker for this
    process (no load, no compile)."""
    if (arch, key) in _MEMORY or (arch, key) in _PENDING:
        return True
    try:
        return disk_cache_enabled() and (cache_root() / "cute" / fingerprint(arch) / f"{_key_name(key)}.o").exists()
    except OSError:
        return False


def parallel_compile_enabled() -> bool:
    """``FFPA_ATTN_CUTE_PARALLEL_COMPILE`` (default on): compile further kernels of a call in compile worker
    processes (:mod:`.compile_pool`); needs the disk cache (a worker hands its kernel over through it)."""
    return env_flag("FFPA_ATTN_CUTE_PARALLEL_COMPILE") and disk_cache_enabled()


def compile_in_child(key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> int | None:
    """Have the compile server (:mod:`.compile_pool`: a separate interpreter that never had a CUDA context, which
    forks a child per job) compile ``key`` into the disk cache (the per-key file lock orders it with any other
    process); returns the job id (the pending one when ``key`` was handed over already), or None when parallel
    compiles are off, ``FFPA_ATTN_CUTE_COMPILE_WORKERS`` jobs are compiling already or ``compile_fn`` does not
    pickle (the kernel is then compiled here when it is needed). The job is remembered: :func:`get_or_compile`
    of ``key`` waits for it before it looks at the disk."""
    if not parallel_compile_enabled():
        return None
    from .compile_pool import pool

    _reap_finished()
    if (arch, key) in _PENDING:  # handed over already and not finished: never compile one key twice
        return _PENDING[(arch, key)]
    job = pool().submit(key, arch, compile_fn)
    if job is not None:
        _PENDING[(arch, key)] = job
    return job


def wait_all() -> None:
    """Wait for every compile job of this process (benchmarks: no compile competes with a timed loop)."""
    for mkey in list(_PENDING):
        job = _PENDING.pop(mkey, None)
        if job is not None:
            wait_child(job)


def _reap_finished() -> None:
    """Forget the jobs that have finished (their kernels are on disk, or get_or_compile compiles them)."""
    from .compile_pool import pool

    for mkey, job in list(_PENDING.items()):
        if pool().done(job):
            _PENDING.pop(mkey, None)


def wait_child(job: int, timeout_s: float = 600.0) -> bool:
    """Wait for a :func:`compile_in_child` job; True when its kernel is in the disk cache. A worker that runs past
    ``timeout_s`` is killed (its file lock goes with it), and the caller then compiles the kernel itself."""
    from .compile_pool import pool

    return pool().wait(job, timeout_s)


def clear_memory_cache() -> None:
    """Forget compiled kernels of this process (the disk cache stays)."""
    _MEMORY.clear()

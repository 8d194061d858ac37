"""CuTeDSL's use of :mod:`ffpa_attn.cache`: compiled kernels in memory, as object files under the cache root's
``cutedsl/<fingerprint>/``, and compiled in compile workers where a call needs several.

What is CuTeDSL's own: a kernel is exported to an object file and loaded back with the runtime libraries preloaded,
the fingerprint hashes the sources of this package plus the Python, cutlass-dsl and ffpa-attn versions and the
target arch, the compile server pre-imports the compiler (:mod:`._compile`) and starts with the caller's
``CUTE_DSL_*`` / ``CUTLASS_*`` configuration, and the CuTeDSL switches (disk cache, parallel compiles, worker
count).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Hashable

from ..cache import ArtifactCache, CompilePool, Format, Store, get_pool, source_fingerprint
from ..common.env import env_flag, env_int

logger = logging.getLogger("ffpa_attn")

# variables the compile server reads at start-up (the compiler's configuration): a change restarts the server
_STARTUP_ENV_PREFIXES = ("CUTE_DSL_", "CUTLASS_")
# imported once by the compile server: what unpickling a job needs, and the compiler (cutlass and the kernels)
_PRELOAD = ("ffpa_attn.cutedsl._cache", "ffpa_attn.cutedsl._build", "ffpa_attn.cutedsl._compile")


def disk_cache_enabled() -> bool:
    return env_flag("FFPA_ATTN_CUTE_DISK_CACHE")


def parallel_compile_enabled() -> bool:
    """``FFPA_ATTN_CUTE_PARALLEL_COMPILE`` (default on): compile further kernels of a call in compile workers;
    needs the disk cache (a worker hands its kernel over through it)."""
    return env_flag("FFPA_ATTN_CUTE_PARALLEL_COMPILE") and disk_cache_enabled()


def max_workers() -> int:
    """``FFPA_ATTN_CUTE_COMPILE_WORKERS``, at least 1: the most kernels compiling in workers at once."""
    return max(1, env_int("FFPA_ATTN_CUTE_COMPILE_WORKERS"))


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


@functools.lru_cache(maxsize=None)
def _preload_runtime() -> None:
    """Load the CuTeDSL runtime libraries with RTLD_GLOBAL: an exported object resolves symbols such as
    ``_cudaLibraryLoadData`` against them, and ``load_module`` alone does not make them global."""
    import ctypes

    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load(path: Path) -> Any:
    """The compiled function exported as ``path`` (its symbols are prefixed with the file's stem)."""
    import cutlass.cute as cute

    _preload_runtime()
    module = cute.runtime.load_module(str(path))
    fn = getattr(module, path.stem)
    fn._ffpa_module = module  # keep the loaded module alive with the function
    return fn


def _export(fn: Any, path: Path) -> None:
    """Write the compiled function ``fn`` as the object file ``path`` (through a private temp folder, renamed into
    place, so a reader never sees a partial file)."""
    name = path.stem
    tmp = path.parent / f".{name}.{os.getpid()}"
    try:
        tmp.mkdir(exist_ok=True)
        fn.export_to_c(str(tmp), name, function_prefix=name)
        os.replace(tmp / f"{name}.o", path)
    finally:
        if tmp.exists():
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()


def _compiler_env() -> dict[str, str]:
    """The compiler's start-up configuration the compile server gets: the caller's ``CUTE_DSL_*`` / ``CUTLASS_*``,
    with ``CUTE_DSL_ARCH`` defaulted as :func:`._env.prepare_cutlass_import` does for the first import of cutlass
    (the server's import is its process's first; the caller's may not have happened yet)."""
    from ._env import target_arch

    env = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_ENV_PREFIXES)}
    env.setdefault("CUTE_DSL_ARCH", target_arch())
    return env


def pool() -> CompilePool:
    """This process's CuTeDSL compile pool (its server starts at ``prestart`` or the first job)."""
    return get_pool("cute", preload=_PRELOAD, startup_env=_compiler_env, max_workers=max_workers)


KERNELS = ArtifactCache(Store("cute", Format(".o", _export, _load)), disk=disk_cache_enabled, pool=pool)


def get_or_compile(key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> Any:
    """The compiled function for ``key`` (memory, a pending compile job, disk, then ``compile_fn()``)."""
    return KERNELS.get_or_compile(key, fingerprint(arch), compile_fn)


def is_cached(key: Hashable, arch: str) -> bool:
    """Whether ``key`` is compiled in this process, exported on disk or being compiled by a worker for this
    process (no load, no compile; imports cutlass for the fingerprint)."""
    return KERNELS.is_cached(key, fingerprint(arch))


def compile_in_child(key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> int | None:
    """Have a compile worker compile ``key`` into the disk cache (:meth:`ArtifactCache.submit`); None when parallel
    compiles are off, ``FFPA_ATTN_CUTE_COMPILE_WORKERS`` jobs are compiling already or ``compile_fn`` does not
    pickle (the kernel is then compiled here when it is needed)."""
    if not parallel_compile_enabled():
        return None
    return KERNELS.submit(key, fingerprint(arch), compile_fn)


def wait_all() -> None:
    """Wait for every compile job of this process (benchmarks: no compile competes with a timed loop)."""
    KERNELS.wait_all()


def clear_memory_cache() -> None:
    """Forget compiled kernels of this process (the disk cache stays)."""
    KERNELS.clear_memory()

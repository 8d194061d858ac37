"""CuTeDSL's use of :mod:`ffpa_attn.cache`: compiled kernels in memory, as shared objects under the cache root's
``cute/<fingerprint>/``, and compiled in compile workers where a call needs several.

What is CuTeDSL's own:

* kernels are compiled with TVM-FFI (``--enable-tvm-ffi``, :mod:`._compile`) and called through it: torch tensors
  and Python scalars go straight into the compiled function, which takes the stream from torch's current one;
* a compiled kernel is exported as an object file (``export_to_c``) and linked here into a shared object against
  the CuTeDSL runtime and TVM-FFI libraries, with their folders as rpath (:func:`_export`). A later process loads
  it with ``tvm_ffi.load_module`` (:func:`_load`) and never imports the CuTeDSL compiler (cutlass): a warm first
  call pays a ``dlopen``, not the compiler's import;
* the fingerprint hashes the sources of this package plus the Python, cutlass-dsl, TVM-FFI and ffpa-attn versions
  and the target arch, read from package metadata (no cutlass import);
* the compile server pre-imports the compiler (:mod:`._compile`) and starts with the caller's ``CUTE_DSL_*`` /
  ``CUTLASS_*`` configuration; the CuTeDSL switches (disk cache, parallel compiles, worker count).

Linking needs a C compiler driver (``$CC``, else ``cc`` / ``gcc`` / ``clang`` on ``PATH``; Triton needs one too).
Without one a kernel still runs in the process that compiled it; only the disk cache is lost (logged at debug
level).
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

from ..cache import ArtifactCache, CompilePool, Format, Store, get_pool, source_fingerprint
from ..common.env import env_flag, env_int

logger = logging.getLogger("ffpa_attn")

# variables the compile server reads at start-up (the compiler's configuration): a change restarts the server
_STARTUP_ENV_PREFIXES = ("CUTE_DSL_", "CUTLASS_")
# imported once by the compile server: TVM-FFI without torch (._server, first), what unpickling a job needs, and the
# compiler (cutlass and the kernels)
_PRELOAD = ("ffpa_attn.cutedsl._server", "ffpa_attn.cutedsl._cache", "ffpa_attn.cutedsl._build",
            "ffpa_attn.cutedsl._compile")
_TVM_FFI_MISSING = ("the CuTeDSL backend calls its kernels through TVM-FFI, which is not installed: "
                    "pip install 'ffpa-attn-kernels[cute]' (or pip install apache-tvm-ffi)")


def disk_cache_enabled() -> bool:
    return env_flag("FFPA_ATTN_CUTE_DISK_CACHE")


def parallel_compile_enabled() -> bool:
    """``FFPA_ATTN_CUTE_PARALLEL_COMPILE`` (default on): compile further kernels of a call in compile workers;
    needs the disk cache (a worker hands its kernel over through it)."""
    return env_flag("FFPA_ATTN_CUTE_PARALLEL_COMPILE") and disk_cache_enabled()


def max_workers() -> int:
    """``FFPA_ATTN_CUTE_COMPILE_WORKERS``, at least 1: the most kernels compiling in workers at once."""
    return max(1, env_int("FFPA_ATTN_CUTE_COMPILE_WORKERS"))


def require_tvm_ffi() -> Any:
    """The ``tvm_ffi`` module; ImportError naming the install when it is missing."""
    try:
        import tvm_ffi
    except ImportError as err:
        raise ImportError(_TVM_FFI_MISSING) from err
    return tvm_ffi


def _version(distribution: str, module: str) -> str:
    """The installed version of ``distribution`` from its metadata; a source tree without metadata imports
    ``module`` for its ``__version__``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        if module == "cutlass":
            from ._env import prepare_cutlass_import

            prepare_cutlass_import()
        return str(getattr(__import__(module), "__version__", "unknown"))


@functools.lru_cache(maxsize=None)
def fingerprint(arch: str) -> str:
    """Hash of this package's sources, the toolchain versions and ``arch`` (no cutlass import)."""
    from .._version import __version__

    here = Path(__file__).resolve().parent
    versions = (f"py{sys.version_info.major}.{sys.version_info.minor}|"
                f"cutlass={_version('nvidia-cutlass-dsl', 'cutlass')}|tvm_ffi={_version('apache-tvm-ffi', 'tvm_ffi')}|"
                f"ffpa_attn={__version__}|{arch}")
    return source_fingerprint(sorted(here.glob("*.py")), length=24, extra=versions)


# ----------------------------------------------------------------------------------------- the AOT format


def _symbol(path: Path) -> str:
    """The exported function's name in the shared object ``path`` (a C identifier from the file's stem; one name
    per kernel, so no two loaded objects define the same symbol)."""
    return "ffpa_" + re.sub(r"\W", "_", path.stem)


def _linker() -> list[str]:
    """The C compiler driver that links the shared objects: ``$CC``, else ``cc`` / ``gcc`` / ``clang``."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise RuntimeError("no C compiler driver to link CuTeDSL kernels into shared objects (set CC, or install cc)")


def link_shared(obj: Path, out: Path, libraries: list[str]) -> None:
    """Link the object file ``obj`` into the shared object ``out`` against ``libraries`` (paths), with their folders
    as rpath (the loader then finds them in any process, without ``LD_LIBRARY_PATH``)."""
    libs = [str(Path(lib).resolve()) for lib in libraries if Path(lib).exists()]
    rpaths = [f"-Wl,-rpath,{d}" for d in dict.fromkeys(str(Path(lib).parent) for lib in libs)]
    cmd = [*_linker(), "-shared", "-o", str(out), str(obj), *libs, *rpaths]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"linking {obj.name} failed ({' '.join(cmd)}): {res.stderr.strip()[-2000:]}")


def _export(fn: Any, path: Path) -> None:
    """Write the compiled TVM-FFI function ``fn`` as the shared object ``path``: its object file linked against the
    runtime libraries the DSL names (through a private temp folder, renamed into place, so a reader never sees a
    partial file)."""
    import cutlass.cute as cute

    tmp = path.parent / f".{path.stem}.{os.getpid()}.{threading.get_ident()}"
    try:
        tmp.mkdir(exist_ok=True)
        obj, shared = tmp / "kernel.o", tmp / "kernel.so"
        fn.export_to_c(str(obj), function_name=_symbol(path))
        link_shared(obj, shared, cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))
        os.replace(shared, path)
    finally:
        if tmp.exists():
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()


_MODULES: dict[str, Any] = {}  # loaded shared objects by path, kept for the lifetime of their functions


def _load(path: Path) -> Any:
    """The TVM-FFI function in the shared object ``path`` (``tvm_ffi.load_module``; no cutlass import)."""
    tvm_ffi = require_tvm_ffi()
    module = tvm_ffi.load_module(str(path))
    _MODULES[str(path)] = module
    return module[_symbol(path)]


AOT_FORMAT = Format(".so", _export, _load)


def pool() -> CompilePool:
    """This process's CuTeDSL compile pool (its server starts with the first job)."""
    return get_pool("cute", preload=_PRELOAD, startup_env=_compiler_env, max_workers=max_workers)


def _compiler_env() -> dict[str, str]:
    """The compiler's start-up configuration the compile server gets: the caller's ``CUTE_DSL_*`` / ``CUTLASS_*``,
    with ``CUTE_DSL_ARCH`` defaulted as :func:`._env.prepare_cutlass_import` does for the first import of cutlass
    (the server's import is its process's first; the caller's may not have happened yet)."""
    from ._env import target_arch

    env = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_ENV_PREFIXES)}
    env.setdefault("CUTE_DSL_ARCH", target_arch())
    return env


KERNELS = ArtifactCache(Store("cute", AOT_FORMAT), disk=disk_cache_enabled, pool=pool)
_CALLABLE: dict[tuple[Hashable, str], Any] = {}  # (key, arch) -> the function a launch calls


def _callable(artifact: Any) -> Any:
    """The plain TVM-FFI function of an artifact: a loaded one is one already; one compiled in this process is the
    DSL's wrapper, whose keyword-argument layer a launch (every argument positional) does not need."""
    inner = getattr(artifact, "__tvm_ffi_object__", None)
    return inner() if inner is not None else artifact


def get_or_compile(key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> Any:
    """The compiled function for ``key`` (memory, a pending compile job, disk, then ``compile_fn()``), called with
    every argument positional: tensors, Python scalars, None for an absent optional tensor."""
    fn = _CALLABLE.get((key, arch))
    if fn is None:
        fn = _CALLABLE[(key, arch)] = _callable(KERNELS.get_or_compile(key, fingerprint(arch), compile_fn))
    return fn


def is_loaded(key: Hashable, arch: str) -> bool:
    """Whether ``key`` is loaded in this process (its next :func:`get_or_compile` neither loads nor compiles)."""
    return (key, arch) in _CALLABLE


def is_cached(key: Hashable, arch: str) -> bool:
    """Whether ``key`` is compiled in this process, exported on disk or being compiled by a worker for this
    process (no load, no compile, no cutlass import)."""
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
    _CALLABLE.clear()
    KERNELS.clear_memory()

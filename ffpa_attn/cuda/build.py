"""Compile the kernel source to a cubin at first use and cache it on disk (no build step for the user).

Compilers, in order (``FFPA_ATTN_CUDA_COMPILER=nvrtc|nvcc`` forces one):

* NVRTC through ctypes: ``libnvrtc`` from the ``nvidia-cuda-nvrtc`` wheel that CUDA builds of torch bring
  (found with ``cuda.pathfinder`` when installed, else by looking under ``nvidia/*/lib`` on ``sys.path``),
  or ``CUDA_HOME``;
* ``nvcc -cubin`` when NVRTC is not found.

Cache (:class:`ffpa_attn.cache.ArtifactCache`): ``cuda/<fingerprint>/<name>_<arch>_<key>.cubin`` under the cache
root; the fingerprint hashes the kernel source and the compiler with its version, the key also the arch and the
instantiation's defines, so editing the source or upgrading the compiler never loads a stale binary. A lock per
entry keeps threads and concurrent processes from compiling it twice; files are written atomically (temp +
rename), so no process reads a partial file.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..cache import ArtifactCache, Store, bytes_format, kind_dir, source_fingerprint
from ..common.env import env_str
from .config import KernelSpec

CSRC = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC / "ffpa_fwd.cu"
ENTRY = "ffpa_fwd"
_CACHE_FORMAT = 1
CUBINS = ArtifactCache(Store("cuda", bytes_format(".cubin")))


def cache_dir() -> Path:
    """Folder of the cubin cache (created on demand): ``cuda/`` under :func:`ffpa_attn.cache.cache_root`."""
    return kind_dir("cuda")


def kernel_source() -> str:
    return KERNEL_SOURCE.read_text()


def base_options(arch: str) -> list[str]:
    """Flags shared by NVRTC and nvcc (besides the defines)."""
    return [f"-arch={arch}", "-std=c++17"]


def define_options(spec: KernelSpec) -> list[str]:
    return [f"-D{k}={v}" for k, v in sorted(spec.defines().items())]


# ------------------------------------------------------------------------------------------------ NVRTC


def _nvrtc_candidates() -> list[str]:
    found: list[str] = []
    try:  # cuda-python's own locator, when present
        from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found]

        found.append(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # noqa: BLE001 - any failure just means "not this way"
        pass
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            found += sorted(glob.glob(os.path.join(entry, sub, "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    found.append("libnvrtc.so")
    seen, out = set(), []
    for f in found:
        if f and f not in seen and "builtins" not in f and ".alt." not in f:
            seen.add(f)
            out.append(f)
    return out


class NVRTC:
    """Minimal ctypes binding of the NVRTC C API (create, compile, log, cubin)."""

    name = "nvrtc"

    def __init__(self, path: str) -> None:
        self.path = path
        # libnvrtc dlopens libnvrtc-builtins by soname at compile time: load the one next to it first
        # (a wheel's lib folder is not on the loader's search path)
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, res: int, what: str, log: str = "") -> None:
        if res != 0:
            msg = self.lib.nvrtcGetErrorString(res).decode() if hasattr(self.lib, "nvrtcGetErrorString") else res
            raise RuntimeError(f"{what} failed: {msg}" + (f"\n{log}" if log else ""))

    def compile(self, source: str, options: list[str], filename: str) -> tuple[bytes, str]:
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0,
                                                None, None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            res = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            self._check(res, f"NVRTC compile of {filename} ({' '.join(options)})", log)
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


class NVCC:
    """``nvcc -cubin`` in a subprocess (fallback; also what the CPU compile check uses)."""

    name = "nvcc"

    def __init__(self, path: str) -> None:
        self.path = path
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        self.version = out.strip().splitlines()[-1]

    def compile(self, source: str, options: list[str], filename: str, extra: list[str] | None = None
                ) -> tuple[bytes, str]:
        with tempfile.TemporaryDirectory(prefix="ffpa_nvcc_") as tmp:
            src = os.path.join(tmp, filename)
            out = os.path.join(tmp, "out.cubin")
            Path(src).write_text(source)
            cmd = [self.path, "-cubin", *options, *(extra or []), "-o", out, src]
            res = subprocess.run(cmd, capture_output=True, text=True)
            log = res.stdout + res.stderr
            if res.returncode != 0:
                raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{log}")
            return Path(out).read_bytes(), log


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


_COMPILER: NVRTC | NVCC | None = None


def compiler() -> NVRTC | NVCC:
    """The compiler this process uses (found once)."""
    global _COMPILER
    if _COMPILER is not None:
        return _COMPILER
    want = env_str("FFPA_ATTN_CUDA_COMPILER").lower()
    errors = []
    if want in ("", "nvrtc"):
        for path in _nvrtc_candidates():
            try:
                _COMPILER = NVRTC(path)
                return _COMPILER
            except (OSError, AttributeError, RuntimeError) as exc:
                errors.append(f"{path}: {exc}")
    if want in ("", "nvcc"):
        nvcc = find_nvcc()
        if nvcc:
            _COMPILER = NVCC(nvcc)
            return _COMPILER
        errors.append("nvcc: not found")
    raise RuntimeError("the CUDA backend found no compiler: install the nvidia-cuda-nvrtc wheel "
                       "(pip install nvidia-cuda-nvrtc) or a CUDA toolkit; tried:\n  " + "\n  ".join(errors))


# ------------------------------------------------------------------------------------------------ cache


@dataclass(frozen=True)
class Binary:
    """A compiled instantiation: the cubin and where it came from."""

    cubin: bytes
    key: str
    path: Path
    from_cache: bool
    compiler: str


def toolchain_fingerprint(source: str, comp: NVRTC | NVCC) -> str:
    """Names the cache folder of the binaries of ``source`` built by ``comp`` (its name and version)."""
    blob = json.dumps({"format": _CACHE_FORMAT, "source": hashlib.sha256(source.encode()).hexdigest(),
                       "compiler": comp.name, "version": comp.version}, sort_keys=True)
    return source_fingerprint((), extra=blob, length=16)


def cache_key(spec: KernelSpec, arch: str, source: str, comp: NVRTC | NVCC) -> str:
    """Hash of everything the cubin of ``spec`` depends on: the toolchain fingerprint, the arch, the defines."""
    blob = json.dumps({"toolchain": toolchain_fingerprint(source, comp), "arch": arch, "defines": spec.defines()},
                      sort_keys=True)
    return source_fingerprint((), extra=blob, length=40)


def get_binary(spec: KernelSpec, arch: str) -> Binary:
    """The cubin of ``spec`` for ``arch``: from memory or the disk cache, else compiled and stored."""
    comp = compiler()
    source = kernel_source()
    key = cache_key(spec, arch, source, comp)
    fingerprint = toolchain_fingerprint(source, comp)
    name = f"{spec.name}_{arch}_{key}"
    compiled = []

    def build() -> bytes:
        compiled.append(True)
        return comp.compile(source, base_options(arch) + define_options(spec), "ffpa_fwd.cu")[0]

    cubin = CUBINS.get_or_compile(name, fingerprint, build)
    return Binary(cubin, key, CUBINS.store.path(name, fingerprint), not compiled, comp.name)


def warmup(specs: list[KernelSpec], arch: str, workers: int | None = None) -> list[Binary]:
    """Compile (or find in the cache) several instantiations in parallel threads (NVRTC releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    compiler()  # find it once, outside the threads
    workers = workers or min(len(specs), os.cpu_count() or 1) or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda s: get_binary(s, arch), specs))

"""Kernel-config selection for the Triton kernels: candidate sets, shared-memory pruning, and a cache that
makes autotuning a once-per-machine cost.

A kernel module describes its tunables as :class:`KernelConfig` objects and asks :func:`pick_config` for
the one to launch. Lookup order for ``(kernel_name, key)`` on the current GPU:

1. the in-process memory cache;
2. the on-disk cache ``autotune/<fingerprint>/<gpu>/<kernel_name>.json`` under the cache root
   (:mod:`ffpa_attn.cache`; the GPU name comes from :mod:`ffpa_attn.common.device`) — written by an earlier
   process, so a second process pays nothing;
3. the shipped tuned defaults ``ffpa_attn/triton/tuned/<kernel_name>.json`` (``{gpu: {key: config}}``);
4. with ``autotune=True``: benchmark every candidate with ``bench_fn`` (a config that fails to compile or
   launch, e.g. out of shared memory, scores ``inf``) and store the winner in 1 and 2; with
   ``autotune=False``: the first candidate (the caller orders candidates best-guess first). During a CUDA-graph
   capture (a benchmark synchronizes, which a capture cannot) the first candidate too, not remembered: the next
   eager call decides as usual.

``mode="max"`` skips step 3 and keeps its own cache entries (a wider search should not be answered by the
fast set's result). The fingerprint hashes the kernel sources the caller names, so editing a kernel
invalidates its tuning. Keys are tuples of str/int/bool; callers bucket sequence lengths (see
:func:`bucket`) so the key depends only on what changes the best config.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..cache import kind_dir, read_json, update_json
from ..cache import source_fingerprint as _source_fingerprint
from ..common import device as hw

logger = logging.getLogger("ffpa_attn")

TUNED_DIR = Path(__file__).with_name("tuned")
_MEMORY: dict[tuple, "KernelConfig"] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tile sizes, warps, pipeline stages and kernel-specific switches.

    ``options`` holds extra constexpr switches as sorted ``(name, value)`` pairs (e.g. ``("tma", True)``),
    so configs stay hashable and serialize to flat JSON.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    options: tuple[tuple[str, int | bool | str], ...] = field(default=())

    def opt(self, name: str, default=None):
        """The value of option ``name`` (``default`` when absent)."""
        for k, v in self.options:
            if k == name:
                return v
        return default

    def to_dict(self) -> dict:
        d = {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
             "num_stages": self.num_stages}
        d.update(dict(self.options))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KernelConfig":
        base = ("block_m", "block_n", "num_warps", "num_stages")
        opts = tuple(sorted((k, v) for k, v in d.items() if k not in base))
        return cls(int(d["block_m"]), int(d["block_n"]), int(d["num_warps"]), int(d["num_stages"]), opts)

    def with_options(self, **opts) -> "KernelConfig":
        merged = dict(self.options)
        merged.update(opts)
        return dataclasses.replace(self, options=tuple(sorted(merged.items())))

    def __str__(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.options)
        return f"BM{self.block_m}/BN{self.block_n}/w{self.num_warps}/s{self.num_stages}{extra}"


def bucket(n: int, lo: int = 64, hi: int = 16384) -> int:
    """Sequence-length bucket: the next power of two, clamped to ``[lo, hi]``."""
    n = max(int(n), 1)
    return min(max(1 << (n - 1).bit_length(), lo), hi)


# ----------------------------------------------------------------------------------------- fingerprints


@functools.lru_cache(maxsize=None)
def source_fingerprint(*paths: str) -> str:
    """A short hash of the given source files plus the Triton version (names the cache folder)."""
    import triton

    return _source_fingerprint(paths, extra=f"triton={triton.__version__}", length=16)


def cache_dir() -> Path:
    """Folder of the autotune cache: ``autotune/`` under :func:`ffpa_attn.cache.cache_root`."""
    return kind_dir("autotune")


def key_str(key: Iterable) -> str:
    """The JSON-file spelling of a key tuple: ``"a|b|c"``."""
    return "|".join(str(k) for k in key)


def _disk_path(kernel_name: str, gpu: str, fingerprint: str) -> Path:
    return cache_dir() / fingerprint / gpu / f"{kernel_name}.json"


@functools.lru_cache(maxsize=None)
def tuned_defaults(kernel_name: str) -> dict:
    """The shipped ``tuned/<kernel_name>.json``: ``{gpu: {key_str: config dict}}`` (empty if absent)."""
    return read_json(TUNED_DIR / f"{kernel_name}.json")


def tuned_default(kernel_name: str, gpu: str, key: Iterable) -> KernelConfig | None:
    entry = tuned_defaults(kernel_name).get(gpu, {}).get(key_str(key))
    return KernelConfig.from_dict(entry) if entry else None


# ------------------------------------------------------------------------------------------------- pick


def pick_config(
    kernel_name: str,
    key: tuple,
    configs: Sequence[KernelConfig],
    bench_fn: Callable[[KernelConfig], float] | None,
    *,
    device: torch.device | None = None,
    fingerprint: str = "",
    autotune: bool = True,
    mode: str = "fast",
    default_key: tuple | None = None,
) -> KernelConfig:
    """The config to launch ``kernel_name`` with for ``key`` (see the module docstring for the order).

    Args:
        kernel_name: a stable name (also the tuned-defaults file name), e.g. ``"ffpa_fwd"``.
        key: tuple of str/int/bool describing the problem bucket (never raw batch/sequence sizes).
        configs: candidates, already pruned for this device, best guess first. Must be non-empty.
        bench_fn: ``config -> milliseconds`` (runs the kernel on the real inputs); ``None`` disables tuning.
        device: the tensors' device (selects GPU name, memory/disk cache).
        fingerprint: from :func:`source_fingerprint` of the kernel sources.
        autotune: benchmark on a miss (else fall back to the tuned default / first candidate).
        mode: ``"fast"`` or ``"max"`` (the caller passes the matching candidate set).
        default_key: the key of the shipped tuned defaults (e.g. ``key`` without its sequence-length
            buckets, so one measured shape serves every length); default ``key``.
    """
    if not configs:
        raise ValueError(f"{kernel_name}: no candidate configs for key {key}")
    gpu = hw.gpu_name(device)
    mkey = (kernel_name, gpu, fingerprint, mode, tuple(key))
    hit = _MEMORY.get(mkey)
    if hit is not None:
        return hit
    skey = key_str((mode, *key))
    disk = _disk_path(kernel_name, gpu, fingerprint) if gpu not in ("cpu", "interpreter") else None
    if disk is not None:
        entry = read_json(disk).get(skey)
        if entry:
            cfg = KernelConfig.from_dict(entry)
            _MEMORY[mkey] = cfg
            return cfg
    if mode != "max":
        cfg = tuned_default(kernel_name, gpu, key if default_key is None else default_key)
        if cfg is not None:
            _MEMORY[mkey] = cfg
            return cfg
    if hw.is_capturing():  # no benchmark inside a capture, and no memory entry a later eager call would keep
        return configs[0]
    if not autotune or bench_fn is None or len(configs) == 1:
        cfg = configs[0]
        _MEMORY[mkey] = cfg
        return cfg
    with _LOCK:
        hit = _MEMORY.get(mkey)
        if hit is not None:
            return hit
        timings = []
        for c in configs:
            try:
                ms = float(bench_fn(c))
            except Exception as e:  # noqa: BLE001 - out of resources, compile errors: skip the config
                logger.debug("ffpa_attn autotune %s %s: %s failed: %s", kernel_name, key, c, e)
                ms = math.inf
            timings.append(ms)
            logger.debug("ffpa_attn autotune %s %s: %s %.4f ms", kernel_name, key, c, ms)
        best_i = min(range(len(configs)), key=lambda i: timings[i])
        if not math.isfinite(timings[best_i]):
            raise RuntimeError(f"{kernel_name}: every candidate config failed for key {key}")
        cfg = configs[best_i]
        _MEMORY[mkey] = cfg
        if disk is not None:
            update_json(disk, {skey: cfg.to_dict()})  # concurrent tuners keep each other's entries
        return cfg


def bench_ms(fn: Callable[[], object], warmup: int = 3, rep: int = 10, cuda_graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the GPU (``triton.testing.do_bench``); 0 on CPU (no timing).

    ``cuda_graph``: time replays of a CUDA graph of ``fn`` (``do_bench_cudagraph``), i.e. without the
    host's launch overhead. For calls of tens of microseconds (decode) the eager timing measures the Python
    side of the launch, not the kernel, and ranks configs at random (an autotuned decode step once picked a
    config 1.7x slower than the default)."""
    if not torch.cuda.is_available():
        fn()
        return 0.0
    import triton.testing

    if cuda_graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def clear_memory_cache() -> None:
    """Forget in-process choices (tests; forcing a re-read of the disk cache)."""
    _MEMORY.clear()
    tuned_defaults.cache_clear()

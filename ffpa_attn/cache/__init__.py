"""Every on-disk cache of ffpa-attn and the machinery that fills them, for all backends.

* :mod:`.disk`: the cache root (``$FFPA_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/ffpa_attn``, else
  ``~/.cache/ffpa_attn``) with one folder per cache kind (``autotune/``: Triton autotune results, ``cute/``: CuTeDSL
  kernels, ``cuda/``: cubins), source fingerprints, file locks, atomic writes, JSON result files;
* :mod:`.artifacts`: :class:`ArtifactCache`, compiled artifacts in memory and on disk keyed by (kind, key,
  fingerprint), with a lock per key; a cache is never a failure;
* :mod:`.pool`: :class:`CompilePool`, a torch-free compile server that forks a child per compile job, so that a
  call needing several artifacts compiles them in parallel without forking a process that holds a CUDA context.

A backend supplies only its specifics (how an artifact is written and loaded, what its fingerprint hashes, which
modules the compile server pre-imports). This package imports no backend package and no torch (the compile server
imports it).
"""
from __future__ import annotations

from .artifacts import PICKLE, ArtifactCache, Format, Store, build_to_disk, bytes_format, key_name
from .disk import FileLock, atomic_write, cache_root, kind_dir, read_json, source_fingerprint, update_json
from .pool import JOB_TIMEOUT_S, CompilePool, get_pool

__all__ = ["ArtifactCache", "Format", "Store", "PICKLE", "bytes_format", "build_to_disk", "key_name", "FileLock",
           "atomic_write", "cache_root", "kind_dir", "read_json", "source_fingerprint", "update_json",
           "JOB_TIMEOUT_S", "CompilePool", "get_pool"]

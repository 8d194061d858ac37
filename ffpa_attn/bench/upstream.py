"""Load the public ffpa-attn package (e.g. 0.2.4) as a peer under another module name.

Both projects are called ``ffpa_attn``; the public one is imported from the directory named by the
environment variable ``FFPA_UPSTREAM_PATH`` (an unpacked wheel: a folder holding ``ffpa_attn/``, or the
``ffpa_attn`` package folder itself) under the alias ``ffpa_attn_upstream``, so ``sys.modules['ffpa_attn']``
stays ours. Its library code imports its own modules relatively, so the alias carries through; its torch
ops live under names (``_fwd_triton``, ``_fwd_cute``, ...) that collide with our compatibility ops
(:mod:`ffpa_attn.compat`): a process that loads it must import ours with ``FFPA_ATTN_COMPAT_OPS=0``; :func:`load`
says so instead of failing inside the public package's import.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ENV_VAR = "FFPA_UPSTREAM_PATH"
ALIAS = "ffpa_attn_upstream"

_cache: dict[str, ModuleType | Exception] = {}


def upstream_path() -> Path | None:
    """The package folder named by ``FFPA_UPSTREAM_PATH``, or None when unset."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    p = Path(raw).expanduser()
    if (p / "ffpa_attn" / "__init__.py").is_file():
        return p / "ffpa_attn"
    return p


def load(path: Path | None = None, alias: str = ALIAS) -> ModuleType:
    """Import the package at ``path`` (default: :func:`upstream_path`) as ``alias`` (cached).

    Raises:
        FileNotFoundError: no ``__init__.py`` there.
        Exception: whatever the package raises while importing.
    """
    path = upstream_path() if path is None else path
    if path is None:
        raise FileNotFoundError(f"{ENV_VAR} is not set")
    key = f"{alias}:{path.resolve()}"
    hit = _cache.get(key)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None:
        return hit
    init = path / "__init__.py"
    try:
        if not init.is_file():
            raise FileNotFoundError(f"{init} does not exist ({ENV_VAR} should name an unpacked wheel)")
        spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(path)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[alias] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException as exc:
            for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
                del sys.modules[name]
            if "ffpa_attn.compat" in sys.modules and isinstance(exc, Exception):
                raise RuntimeError(
                    f"{exc} -- the public ffpa-attn package defines torch ops named like our compatibility ops "
                    "(ffpa_attn::_fwd_cute, ...): import ours with FFPA_ATTN_COMPAT_OPS=0 in this process") from exc
            raise
    except Exception as exc:  # remembered: one failed import per process is enough
        _cache[key] = exc
        raise
    _cache[key] = mod
    return mod


def version(mod: ModuleType) -> str:
    return str(getattr(mod, "__version__", "unknown"))

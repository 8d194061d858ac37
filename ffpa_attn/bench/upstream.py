"""Load the public ffpa-attn package (e.g. 0.2.4) as a peer under another module name.

Both projects are called ``ffpa_attn``; the public one is imported from the directory named by the
environment variable ``FFPA_UPSTREAM_PATH`` (a ``pip install --target`` folder or an unpacked wheel: a folder
holding ``ffpa_attn/``, or the ``ffpa_attn`` package folder itself) under the alias ``ffpa_attn_upstream``, so
``sys.modules['ffpa_attn']`` stays ours. Its library code imports its own modules relatively, so the alias carries
through; its torch ops live under names (``_fwd_triton``, ``_fwd_cute``, ...) that collide with our compatibility ops
(:mod:`ffpa_attn.compat`): a process that loads it must import ours with ``FFPA_ATTN_COMPAT_OPS=0``; :func:`load`
says so instead of failing inside the public package's import.

Its dependencies (``quack`` of quack-kernels, imported by its CuTeDSL kernels on their first call) may be installed
beside it: ``pip install --target DIR ffpa-attn==0.2.4 quack-kernels==0.6.4 --no-deps`` leaves ``DIR/ffpa_attn``
next to ``DIR/quack``. :func:`load` appends ``DIR`` (:func:`dependency_folder`) to ``sys.path`` of the process,
after the environment's own folders: a module the environment has (torch, triton, cutlass) is still imported from
the environment, one copy per process, and only the ones it lacks come from ``DIR`` (the public package's own
``ffpa_attn`` folder there never shadows ours: ours is imported first). multiprocessing children started with spawn
get the parent's ``sys.path``.
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


def dependency_folder(path: Path) -> Path:
    """The folder that holds the package folder ``path``: ``DIR`` of ``pip install --target DIR``, where the
    dependencies installed beside the package live."""
    return path.resolve().parent


def _append_to_path(folder: Path) -> bool:
    """Append ``folder`` to ``sys.path`` unless it is there; whether it was appended."""
    entry = str(folder)
    if entry in sys.path:
        return False
    sys.path.append(entry)
    return True


def missing_dependency(exc: ModuleNotFoundError, path: Path | None = None) -> ModuleNotFoundError:
    """``exc`` (a module the public package imports is missing) with where it was looked for and how to stage it;
    ``path``: the package folder (default: :func:`upstream_path`)."""
    path = upstream_path() if path is None else path
    where = "" if path is None else f" nor in {dependency_folder(path)}"
    stage = "DIR" if path is None else str(dependency_folder(path))
    return ModuleNotFoundError(f"{exc}: not in this environment{where} (stage it beside the public ffpa-attn: pip "
                               f"install --target {stage} --no-deps <package>)", name=exc.name)


def load(path: Path | None = None, alias: str = ALIAS) -> ModuleType:
    """Import the package at ``path`` (default: :func:`upstream_path`) as ``alias`` (cached), with the folder holding
    it at the end of ``sys.path`` for the dependencies installed beside it (kept there after a successful import: the
    package imports some of them on first use).

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
            raise FileNotFoundError(f"{init} does not exist ({ENV_VAR} should name the folder holding the public "
                                    "ffpa_attn package)")
        spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(path)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[alias] = mod
        deps = dependency_folder(path)
        appended = _append_to_path(deps)
        try:
            spec.loader.exec_module(mod)
        except BaseException as exc:
            for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
                del sys.modules[name]
            if appended:
                sys.path.remove(str(deps))
            if isinstance(exc, ModuleNotFoundError):
                raise missing_dependency(exc, path) from exc
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

"""The compile functions handed to compile workers (:mod:`ffpa_attn.cache.pool`): module-level, so a
``functools.partial`` of one pickles; torch-free and cutlass-free at import, so a worker that unpickles one imports
only the compiler it then runs."""
from __future__ import annotations

from typing import Any

from .config import BwdConfig, FwdConfig


def build_fwd(cfg: FwdConfig, arch: str) -> Any:
    """The compiled forward kernel of ``cfg`` for ``arch``."""
    from ._compile import compile_fwd

    return compile_fwd(cfg, arch=arch)


def build_bwd(cfg: BwdConfig, dq: bool, arch: str) -> Any:
    """The compiled dK/dV kernel of ``cfg`` for ``arch``, or with ``dq`` its dQ kernel."""
    from ._compile import compile_bwd, compile_bwd_dq

    return (compile_bwd_dq if dq else compile_bwd)(cfg, arch=arch)

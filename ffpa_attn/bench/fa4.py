"""FlashAttention-4's CuTeDSL sm90 forward as vLLM ships it (head dim 512 included), loaded as a benchmark peer.

vLLM's wheel carries FlashAttention-4's CuTeDSL kernels as Python files under ``vllm/vllm_flash_attn/cute/``, with an
sm90 path for head dim 512 that upstream flash-attn does not have. The benchmark imports that package from folders
named by the environment variable ``FFPA_FA4_PATH`` (``os.pathsep``-separated: the folder holding the extracted
``vllm/`` tree, then the folders its dependencies were installed into, e.g. ``pip install --target DIR
quack-kernels``), without installing vllm; ``bench/README.md`` shows how to stage it. Forward only; layouts
``[B, S, H, D]`` (dense) and ``[T, H, D]`` (packed); the first call of each shape compiles.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

ENV_VAR = "FFPA_FA4_PATH"
MODULE = "vllm.vllm_flash_attn.cute.interface"

_cache: dict[str, ModuleType | Exception] = {}


def fa4_paths() -> list[Path]:
    """The folders named by ``FFPA_FA4_PATH`` (empty when unset)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


def load() -> ModuleType:
    """The FA4 CuTeDSL interface module (cached, a failure too): the folders of ``FFPA_FA4_PATH`` go to the front of
    ``sys.path`` first.

    Raises:
        FileNotFoundError: ``FFPA_FA4_PATH`` unset, or no ``vllm/vllm_flash_attn/cute`` under its first folder.
        Exception: whatever the import raises (a missing dependency names itself).
    """
    paths = fa4_paths()
    if not paths:
        raise FileNotFoundError(f"{ENV_VAR} is not set")
    key = os.pathsep.join(str(p) for p in paths)
    hit = _cache.get(key)
    if isinstance(hit, Exception):
        raise hit
    if hit is not None:
        return hit
    try:
        if not (paths[0] / "vllm" / "vllm_flash_attn" / "cute").is_dir():
            raise FileNotFoundError(f"{paths[0]} holds no vllm/vllm_flash_attn/cute ({ENV_VAR}: the extracted "
                                    "vllm tree first, then the folders of its dependencies)")
        for p in reversed(paths):
            if str(p) not in sys.path:
                sys.path.insert(0, str(p))
        mod = importlib.import_module(MODULE)
    except Exception as exc:  # remembered: one failed import per process is enough
        _cache[key] = exc
        raise
    _cache[key] = mod
    return mod


def _out(res: Any) -> torch.Tensor:
    """The output of an FA4 call (it returns ``(out, lse)``)."""
    return res[0] if isinstance(res, (tuple, list)) else res


def dense_forward(causal: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(q [B, Hq, N, D], k [B, Hkv, N, D], v) -> out [B, Hq, N, D]`` through FA4's ``flash_attn_func`` (its
    ``[B, S, H, D]`` layout as transposed views; causal bottom-right aligned, as ours)."""
    mod = load()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        res = mod.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return _out(res).transpose(1, 2)

    return fn


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   max_q: int, max_k: int, causal: bool) -> Callable[[], torch.Tensor]:
    """``() -> out [T_q, Hq, D]``: FA4's ``flash_attn_varlen_func`` on packed ``[T, H, D]`` inputs."""
    mod = load()
    return lambda: _out(mod.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                   max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal))

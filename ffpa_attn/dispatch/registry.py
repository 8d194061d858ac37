"""The registry of backends: every backend package's own description, collected and frozen.

Each backend package ships ``backend.json`` (:class:`ffpa_attn.kernel_module.BackendSpec`: devices, head dims, the
kernels of each entry point, features). This module reads those files -- it never imports a kernel package, so a
missing optional dependency is a reason, not an ImportError -- and answers the two questions the planner asks of
any backend, by the same rules for every backend (no rule names a backend):

* :func:`available`: can it run on this device at all (its modules installed, the device kind and arch it needs);
* :func:`unsupported`: can it run this direction of this request (head dim, a kernel for the layout, features).

What is *faster* where several backends can run a request is :mod:`.heuristics`.
"""
from __future__ import annotations

import importlib.util
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from ..common import device as device_facts
from ..kernel_module import BackendSpec, load_spec

if TYPE_CHECKING:
    import torch

    from ..contract import DenseProblem, KVCacheProblem, VarlenProblem

# the backend packages, in the order the registry lists them
BACKEND_PACKAGES = ("ffpa_attn.triton", "ffpa_attn.cutedsl", "ffpa_attn.cuda", "ffpa_attn.sdpa")


def _collect() -> Mapping[str, BackendSpec]:
    specs = {}
    for package in BACKEND_PACKAGES:
        try:
            spec = load_spec(package)
        except FileNotFoundError:  # a build without that backend's package
            continue
        specs[spec.name] = spec
    return MappingProxyType(specs)


REGISTRY: Mapping[str, BackendSpec] = _collect()

_MODULES: dict[str, bool] = {}


def module_present(name: str) -> bool:
    """Whether module ``name`` can be imported, found without importing it (plain dict cache, traced by
    torch.compile as a constant)."""
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            _MODULES[name] = False
    return _MODULES[name]


# Probed at import, not at the first call: a process's first call can be traced by torch.compile, and dynamo
# refuses to trace importlib's find_spec. find_spec locates a module without importing it (importing triton here
# would fix TRITON_INTERPRET before a CPU caller can set it).
for _spec in REGISTRY.values():
    for _req in _spec.requires:
        module_present(_req.module)


def spec(name: str) -> BackendSpec:
    """The description of backend ``name`` (ValueError naming the known ones)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(REGISTRY)}") from None


def install_hint(extra: str | None) -> str:
    """The pip command that installs an optional part of this package."""
    from ..fallback import install_command

    return install_command(extra)


def available(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device`` at all, with the reason either way."""
    s = spec(name)
    for req in s.requires:
        if not module_present(req.module):
            hint = f" ({install_hint(req.extra)})" if req.extra else ""
            return False, f"{req.package} is not installed{hint}"
    if device.type == "cpu":
        if s.cpu == "any":
            return True, "runs CPU tensors"
        if s.cpu == "interpreter":
            if device_facts.interpreter_on():
                return True, "CPU tensors under TRITON_INTERPRET=1 (interpreter)"
            return False, f"CPU tensors need TRITON_INTERPRET=1 for {s.label}"
        return False, f"{s.label} needs a CUDA device"
    if device.type != "cuda" or s.cuda_archs is None:
        return False, f"device type {device.type!r} is not supported by {s.label}"
    cap = device_facts.capability(device)
    lo, hi = s.cuda_archs
    if not lo <= cap <= hi:
        want = f"sm{lo[0]}{lo[1]}" + ("" if lo == hi else " or newer" if hi[0] >= 99 else f"..sm{hi[0]}{hi[1]}")
        note = f": {s.cuda_archs_note}" if s.cuda_archs_note else ""
        return False, f"compute capability {cap}: {s.label} needs {want}{note}"
    return True, f"CUDA sm{cap[0]}{cap[1]}"


# how messages name the layouts of the entry points (kernel_module.ENTRY_LAYOUT)
LAYOUT_NAMES = {"dense": "dense", "varlen": "varlen", "kvcache": "KV-cache"}


def layout_of(prob: DenseProblem | VarlenProblem | KVCacheProblem) -> str:
    """The layout of a validated problem: "dense", "varlen" or "kvcache" (which entry point runs it)."""
    from ..contract import KVCacheProblem, VarlenProblem

    if isinstance(prob, KVCacheProblem):
        return "kvcache"
    return "varlen" if isinstance(prob, VarlenProblem) else "dense"


def unsupported(name: str, direction: str, prob: DenseProblem | VarlenProblem | KVCacheProblem) -> str | None:
    """Why backend ``name`` cannot run ``direction`` ("forward" / "backward") of ``prob``, as a reason for explain()
    and for the error of a named backend; None when it can. Reads the backend's description only."""
    s = spec(name)
    layout = layout_of(prob)
    if not s.runs(direction, layout):
        if not any(s.runs(direction, other) for other in LAYOUT_NAMES if other != layout):
            return f"{s.label} has no {direction} kernel"
        return f"{s.label} has no {LAYOUT_NAMES[layout]} {direction} kernel"
    if s.dtypes is not None and str(prob.dtype).removeprefix("torch.") not in s.dtypes:
        return f"dtype {prob.dtype}: {s.label} takes {' / '.join(sorted(s.dtypes))}"
    if prob.dv != prob.d and "value_head_dim" not in s.features:
        return f"value head dim {prob.dv} != query/key head dim {prob.d} ({s.label} needs them equal)"
    if not s.head_dim_ok(prob.d):
        return f"head dim D={prob.d} outside {s.label}'s {s.head_dims_text()}"
    if layout == "dense" and prob.mask_kind != "none" and "attn_mask" not in s.features:
        return f"{s.label} takes no attn_mask"
    if prob.dropout_p > 0 and "dropout" not in s.features:
        return f"{s.label} has no dropout"
    if layout == "varlen" and getattr(prob, "page", None) is not None and "paged_kv" not in s.features:
        return f"{s.label}'s varlen forward does not read paged K/V (block_table)"
    if layout == "varlen" and getattr(prob, "seqused_k", False) and "seqused_k" not in s.features:
        return f"{s.label}'s varlen forward takes no seqused_k"
    return None


def kernel_package(name: str) -> str:
    """The package :mod:`ffpa_attn.ops` imports to run backend ``name``."""
    return spec(name).kernel_module


__all__ = ["BACKEND_PACKAGES", "REGISTRY", "spec", "available", "unsupported", "module_present", "kernel_package",
           "install_hint", "LAYOUT_NAMES", "layout_of"]

"""Compatibility names: the backend configs and the dispatch, as one module (what earlier code imports).

The code lives in :mod:`ffpa_attn.config` (public configs), :mod:`ffpa_attn.dispatch.capabilities` (what each
backend can run), :mod:`ffpa_attn.dispatch.heuristics` (what measured faster) and
:mod:`ffpa_attn.dispatch.planner` (the choice per direction). Patch those modules, not this one.
"""
from __future__ import annotations

from .config import (  # noqa: F401
    BACKEND_CLASSES,
    Backend,
    BackendLike,
    CUDABackend,
    CuTeDSLBackend,
    SDPABackend,
    TritonBackend,
    as_backend,
    from_config,
    grad_storage_dtype,
    resolve_backends,
)
from .dispatch.capabilities import (  # noqa: F401
    CAPABILITIES,
    CUDA_D_RANGE,
    KERNEL_MODULES,
    TRITON_D_RANGE,
    Capability,
    _cute_dims,
    backend_available,
    check_backend_config,
    device_capability,
    unsupported_reason,
)
from .dispatch.heuristics import (  # noqa: F401
    CUDA_PREFERRED_HEAD_DIMS,
    HEURISTICS,
    cuda_preferred,
    cute_forward_kernel,
    cute_preferred_dims,
    triton_forward_kernel,
)
from .dispatch.planner import Choice, Plan, check_dtype_ffpa, plan  # noqa: F401

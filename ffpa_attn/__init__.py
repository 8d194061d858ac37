"""ffpa-attn: exact attention kernels for large head dims (256 < D <= 1024), forward and backward.

Public API (see README.md and docs/design.md): :func:`ffpa_attn_func` (SDPA's signature),
:func:`ffpa_attn_varlen_func` (flash-attn's varlen signature), :func:`ffpa_attn_with_kvcache` (flash-attn's
KV-cache signature: paged / contiguous caches, decode and chunked prefill), the backend configs, the low-level
forward/backward entry points for callers that merge partial results, and :func:`explain`.
:mod:`ffpa_attn.compat` registers the public ffpa-attn package's low-level op names (compatibility only;
``FFPA_ATTN_COMPAT_OPS=0`` skips that).
Importing this package needs no GPU and imports no kernel module.
"""
from ._version import __distribution__, __version__
from .config import Backend, CUDABackend, CuTeDSLBackend, SDPABackend, TritonBackend
from .fallback import FFPAFallbackWarning
from .interface import (
    explain,
    explain_kvcache,
    explain_varlen,
    ffpa_attn_bwd,
    ffpa_attn_func,
    ffpa_attn_fwd,
    ffpa_attn_varlen_bwd,
    ffpa_attn_varlen_func,
    ffpa_attn_varlen_fwd,
    ffpa_attn_with_kvcache,
)
from .common.env import env_flag as _env_flag

# The public ffpa-attn package defines the same op names: FFPA_ATTN_COMPAT_OPS=0 leaves them unregistered so
# that package can be imported beside ours in one process (the benchmark's peer columns do this).
if _env_flag("FFPA_ATTN_COMPAT_OPS"):
    from . import compat  # noqa: F401,E402  (registers the public package's low-level op names)

__all__ = [
    "Backend",
    "CUDABackend",
    "CuTeDSLBackend",
    "FFPAFallbackWarning",
    "SDPABackend",
    "TritonBackend",
    "explain",
    "explain_kvcache",
    "explain_varlen",
    "ffpa_attn_bwd",
    "ffpa_attn_func",
    "ffpa_attn_fwd",
    "ffpa_attn_varlen_bwd",
    "ffpa_attn_varlen_func",
    "ffpa_attn_varlen_fwd",
    "ffpa_attn_with_kvcache",
    "__version__",
]

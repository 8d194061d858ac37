"""The public ffpa-attn package's ``ffpa_attn.functional`` import path: the same objects as :mod:`ffpa_attn`.

Code written against that package imports the backend classes from here
(``from ffpa_attn.functional import CuTeDSLBackend``); every name is a re-export, not a second definition.
"""
from .config import Backend, CUDABackend, CuTeDSLBackend, SDPABackend, TritonBackend
from .interface import (
    ffpa_attn_bwd,
    ffpa_attn_func,
    ffpa_attn_fwd,
    ffpa_attn_varlen_bwd,
    ffpa_attn_varlen_func,
    ffpa_attn_varlen_fwd,
)

__all__ = [
    "Backend",
    "CUDABackend",
    "CuTeDSLBackend",
    "SDPABackend",
    "TritonBackend",
    "ffpa_attn_bwd",
    "ffpa_attn_func",
    "ffpa_attn_fwd",
    "ffpa_attn_varlen_bwd",
    "ffpa_attn_varlen_func",
    "ffpa_attn_varlen_fwd",
]

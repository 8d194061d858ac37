"""The public ffpa-attn package's ``ffpa_attn.cute`` names, for code written against that package (NVIDIA NeMo
Automodel's binding probes ``import ffpa_attn.cute`` and calls ``_ffpa_attn_forward_cute`` /
``_ffpa_attn_backward_cute``). Compatibility entry points only: they run on whichever backend the planner picks
(:mod:`ffpa_attn.compat`). This package's CuTeDSL kernels are :mod:`ffpa_attn.cutedsl`."""
from __future__ import annotations

from .compat import _ffpa_attn_backward_cute, _ffpa_attn_forward_cute

__all__ = ["_ffpa_attn_forward_cute", "_ffpa_attn_backward_cute"]

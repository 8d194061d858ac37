"""Placeholder until the split-D backward kernels land (delegates to the SDPA module's math)."""
from ..sdpa import dense_backward, varlen_backward  # noqa: F401

"""Placeholder until the split-D forward kernel lands (delegates to the SDPA module's math)."""
from ..sdpa import dense_forward, varlen_forward  # noqa: F401

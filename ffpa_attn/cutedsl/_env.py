"""Set up the CuTeDSL environment before cutlass is first imported (no cutlass import here)."""
from __future__ import annotations

import os
import sys

from ..common.env import REGISTRY, env_str

TARGET_ARCH = REGISTRY["FFPA_ATTN_CUTE_ARCH"].default  # "sm_90a"


def target_arch() -> str:
    """The arch the kernels are compiled for: sm_90a (the only one they are written for);
    ``FFPA_ATTN_CUTE_ARCH`` overrides it for compile experiments."""
    return env_str("FFPA_ATTN_CUTE_ARCH")


def prepare_cutlass_import() -> None:
    """Make ``CUTE_DSL_ARCH`` default to the target arch when this package is the first to import cutlass.

    cutlass reads it once, at import. Without a GPU it would default to another arch, and although
    every compile passes ``--gpu-arch`` explicitly, exporting a compiled kernel to an object file (the
    disk cache) follows the import-time arch. An explicit ``CUTE_DSL_ARCH`` and an earlier import of
    cutlass by someone else are left alone.
    """
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", target_arch())

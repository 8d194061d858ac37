"""Imported first by the CuTeDSL compile server (:data:`._cache._PRELOAD`), never by a process that runs kernels.

The kernels compile with TVM-FFI, whose import also imports torch when it can (for a stream helper and a fast DLPack
exchange that compiling does not use): 1.2-1.4 CPU-seconds in every compile job's child. The server never needs
torch (it sees no GPU and only compiles), so torch is made unimportable in it before TVM-FFI is imported once here,
and every job's child inherits both.
"""
from __future__ import annotations

import sys

if "torch" not in sys.modules:
    sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" raises ImportError in this process

try:
    import tvm_ffi  # noqa: F401  (imported once; a job that needs it and lacks it reports the real error)
except ImportError:
    pass

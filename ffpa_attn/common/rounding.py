"""Round-to-nearest fp32 -> bf16 stores under the Triton interpreter (shared by every Triton kernel)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_cast(x, dt: tl.constexpr, INTERP: tl.constexpr):
    """fp32 -> ``dt`` with round-to-nearest-even, the rounding a GPU store gets. The interpreter truncates
    fp32 -> bf16, so under INTERP the rounding is done on the bits first (the truncating cast is then exact)
    and CPU runs measure the outputs users get."""
    if INTERP:
        if dt == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)

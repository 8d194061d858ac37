"""Tile configuration and shared-memory / register budget of the sm90a forward kernel (no cutlass import).

The forward kernel (:mod:`ffpa_attn.cute.fwd_sm90`) gives each CTA ``tile_m = 64`` query rows and three
warpgroups: a TMA producer and two consumers. Consumer ``c`` owns the head-dim half
``[c * d_half, (c + 1) * d_half)`` of Q, K, V and O, where ``d_half = roundup(ceil(D / 2), 16) <= 256``
(so ``2 * d_half >= D``; the columns past D are zero-filled by the TMA bounds check and never stored).

Budget at D = 512 (bf16/fp16, tile_n = 64, d_half = 256):

* shared memory: Q resident, 64 x 512 x 2 B = 64 KiB (two 32 KiB halves); a ring of ``stages`` slots of
  64 x 256 x 2 B = 32 KiB each, shared by K and V halves (the K half of tile j for consumer c, ...).
  5 slots = 160 KiB; total 224 KiB + mbarriers <= 227 KiB (232448 B, the sm90 opt-in maximum). The
  partial-S exchange (64 x 64 fp32 = 16 KiB per consumer) reuses the consumer's own K slot of the tile
  once its QK^T has completed, so it costs no extra shared memory. The O epilogue reuses the
  consumer's own Q half.
* registers per consumer thread (setmaxnreg 240): O accumulator 64 x 256 fp32 / 128 threads = 128,
  S accumulator 64 x 64 fp32 / 128 = 32, P (bf16, A operand of P.V) 16, row max/sum/scale 6, the rest
  addresses and loop state; the producer warpgroup runs at 24 (128 x 24 + 256 x 240 = 64512 <= 65536).
* per K/V tile and consumer: S_c = Q_c K_c^T (m64 n64 k d_half, 16 wgmma k-steps, A and B from
  shared memory), exchange partials, S = S_0 + S_1 (identical in both consumers), online softmax in
  fp32, O_c += P V_c (m64 n d_half k64, P from registers). Both consumers do equal MMA work and
  nothing is computed twice; the QK^T of tile j+1 is issued before the P.V of tile j so the
  exchange + softmax of j+1 overlaps the tensor cores running P.V of j.
"""
from __future__ import annotations

from dataclasses import dataclass

SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm90 (227 KiB)
SMEM_RESERVED = 1024  # mbarriers + alignment slack
MAX_STAGES = 8
MIN_STAGES = 4  # K(j+1) and V(j) are held at the same time: 2 items x 2 halves
FWD_MAX_HEAD_DIM = 512  # the two-consumer column split needs d_half <= 256 (wgmma N <= 256)
FWD_MIN_HEAD_DIM = 257


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time configuration of one forward kernel variant.

    Attributes:
        head_dim: D of q/k/v (257..512).
        dtype: "bfloat16" or "float16".
        causal: tail-aligned causal masking compiled in.
        tile_m: query rows per CTA (one wgmma M of 64 per consumer).
        tile_n: keys per K/V tile.
    """

    head_dim: int
    dtype: str
    causal: bool
    tile_m: int = 64
    tile_n: int = 64

    def __post_init__(self) -> None:
        if not FWD_MIN_HEAD_DIM <= self.head_dim <= FWD_MAX_HEAD_DIM:
            raise ValueError(f"the sm90 forward kernel takes {FWD_MIN_HEAD_DIM} <= D <= {FWD_MAX_HEAD_DIM}, "
                             f"got {self.head_dim}")
        if self.head_dim % 8:
            raise ValueError(f"TMA needs 16-byte row strides: D must be a multiple of 8, got {self.head_dim}")
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")
        if (self.tile_m, self.tile_n) != (64, 64):
            raise ValueError("only tile_m = tile_n = 64 is implemented")
        if self.stages < MIN_STAGES:
            raise ValueError(f"D={self.head_dim}: only {self.stages} ring slots fit in shared memory")

    @property
    def d_half(self) -> int:
        """Head-dim columns per consumer warpgroup (multiple of 16, <= 256)."""
        return round_up((self.head_dim + 1) // 2, 16)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one ring slot: tile_n x d_half elements of 2 bytes."""
        return self.tile_n * self.d_half * 2

    @property
    def q_bytes(self) -> int:
        return self.tile_m * 2 * self.d_half * 2

    @property
    def stages(self) -> int:
        """Ring slots that fit next to the resident Q tile."""
        free = SMEM_CAPACITY - SMEM_RESERVED - self.q_bytes
        return min(MAX_STAGES, free // self.slot_bytes)

    @property
    def smem_bytes(self) -> int:
        return self.q_bytes + self.stages * self.slot_bytes

    @property
    def exchange_fits(self) -> bool:
        """The 64 x 64 fp32 partial-S exchange must fit in one ring slot."""
        return self.slot_bytes >= self.tile_m * self.tile_n * 4

    def key(self) -> tuple:
        return ("fwd_sm90", self.head_dim, self.dtype, self.causal, self.tile_m, self.tile_n, self.stages)


FWD_HEAD_DIMS = tuple(range(264, FWD_MAX_HEAD_DIM + 1, 8))  # every D the forward kernel compiles for

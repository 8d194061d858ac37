"""Tile configuration and shared-memory / register budget of the sm90a forward kernel (no cutlass import).

The forward kernel (:mod:`ffpa_attn.cute.fwd_sm90`) gives ``tile_m = 64`` query rows of one (batch, head)
to ``cluster`` CTAs (1 for D <= 512, 2 for 512 < D <= 1024) of three warpgroups each: a TMA producer and
two consumers. The head dim is cut into ``2 * cluster`` column parts of ``d_wg`` columns
(``d_wg = roundup(ceil(D / (2 * cluster)), 16) <= 256``); consumer c of cluster rank r owns part
``2 r + c`` of Q, K, V and O. Columns past D are zero-filled by the TMA bounds check and never stored.

Budget at D = 512 (cluster 1) and D = 1024 (cluster 2, per CTA), bf16/fp16, tile_n = 64, d_wg = 256:

* shared memory per CTA: the CTA's Q parts resident, 64 x 512 x 2 B = 64 KiB; a ring of ``stages``
  slots of 64 x 256 x 2 B = 32 KiB, holding K and V parts in the order the consumers use them.
  5 slots = 160 KiB; total 224 KiB + mbarriers <= 227 KiB (232448 B, the sm90 opt-in maximum).
  The partial-S exchange (64 x 64 fp32 = 16 KiB per consumer) reuses the consumer's own K slot of
  the tile once its QK^T has completed, so it costs no extra shared memory; the O epilogue reuses the
  consumer's own Q part.
* registers per consumer thread (setmaxnreg 232): O accumulator 64 x 256 fp32 / 128 threads = 128,
  S accumulator 64 x 64 fp32 / 128 = 32, P (16-bit A operand of P.V) 16, row max/sum/scale 6, the rest
  addresses and loop state; the producer warpgroup runs at 40 (128 x 40 + 256 x 232 = 64512 <= 65536;
  at 24 the producer of the cluster variants spilled its TMA coordinates). ptxas: 168 registers at
  launch (384 threads); no spills for D <= 512, <= 64 bytes for the cluster variants (ptxas hoists
  the DSMEM loads of the exchange)
  (tests/test_cute_compile.py checks both).
* per K/V tile and consumer: S_p = Q_p K_p^T (m64 n64 k d_wg, wgmma with both operands in shared
  memory, fp32), the partials of all 2 * cluster consumers summed in a fixed order (so every consumer
  holds bit-identical S, P, m and l), online softmax in fp32, O_p += P V_p (m64 n d_wg k64, P from
  registers). All consumers do equal MMA work and nothing is computed twice; the QK^T of tile j+1 is
  issued before the P.V of tile j, so the exchange + softmax of j+1 overlaps the tensor cores running
  P.V of j. With a cluster the two remote partials are read from the peer CTA's shared memory (DSMEM).
"""
from __future__ import annotations

from dataclasses import dataclass

SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm90 (227 KiB)
SMEM_RESERVED = 1024  # mbarriers + alignment slack
MAX_STAGES = 8
MIN_STAGES = 4  # K(j+1) and V(j) are held at the same time: 2 items x 2 parts
FWD_MIN_HEAD_DIM = 257
FWD_MAX_HEAD_DIM = 1024
SINGLE_CTA_MAX_HEAD_DIM = 512  # two consumers x d_wg <= 256 (wgmma N <= 256); above: a 2-CTA cluster
# keys per K/V tile: a multiple of 16 (the P.V k-step); larger tiles cut the shared-memory traffic of
# QK^T per FLOP (its A operand, Q, is re-read per tile) but cost S/P registers and ring depth
TILE_N_CHOICES = (48, 64, 80, 96, 112, 128)
DEFAULT_TILE_N = 64
# keys per tile measured fastest on an H200 (non-causal bf16, B=1 H=32 N=8192; 2026-11-29): D=320 416 vs 370
# TFLOPS at 64, 384 427 vs 408, 512 451 vs 435, 768 146 vs 133, 1024 175 vs 166. Causal keeps 64 (not timed).
TUNED_TILE_N = {320: 128, 384: 96, 512: 80, 768: 96, 1024: 80}


def default_tile_n(head_dim: int, causal: bool) -> int:
    """The tile_n used when the caller does not force one."""
    return DEFAULT_TILE_N if causal else TUNED_TILE_N.get(head_dim, DEFAULT_TILE_N)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time configuration of one forward kernel variant.

    Attributes:
        head_dim: D of q/k/v (257..1024, a multiple of 8: TMA needs 16-byte row strides).
        dtype: "bfloat16" or "float16".
        causal: tail-aligned causal masking compiled in.
        tile_m: query rows per CTA (one wgmma M of 64 per consumer).
        tile_n: keys per K/V tile.
    """

    head_dim: int
    dtype: str
    causal: bool
    tile_m: int = 64
    tile_n: int = DEFAULT_TILE_N

    def __post_init__(self) -> None:
        if not FWD_MIN_HEAD_DIM <= self.head_dim <= FWD_MAX_HEAD_DIM:
            raise ValueError(f"the sm90 forward kernel takes {FWD_MIN_HEAD_DIM} <= D <= {FWD_MAX_HEAD_DIM}, "
                             f"got {self.head_dim}")
        if self.head_dim % 8:
            raise ValueError(f"TMA needs 16-byte row strides: D must be a multiple of 8, got {self.head_dim}")
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.tile_m != 64:
            raise ValueError(f"tile_m must be 64 (one wgmma M per consumer), got {self.tile_m}")
        if self.tile_n not in TILE_N_CHOICES:
            raise ValueError(f"tile_n must be one of {TILE_N_CHOICES}, got {self.tile_n}")
        if self.stages < MIN_STAGES:
            raise ValueError(f"D={self.head_dim}, tile_n={self.tile_n}: only {self.stages} ring slots fit in "
                             f"shared memory (need {MIN_STAGES})")
        if not self.exchange_fits:
            raise ValueError(f"D={self.head_dim}, tile_n={self.tile_n}: the partial-S exchange does not fit a slot")

    @property
    def cluster(self) -> int:
        """CTAs per query block (a cluster along grid x): 1 for D <= 512, else 2."""
        return 1 if self.head_dim <= SINGLE_CTA_MAX_HEAD_DIM else 2

    @property
    def d_wg(self) -> int:
        """Head-dim columns per consumer warpgroup (multiple of 16, <= 256)."""
        parts = 2 * self.cluster
        return round_up(-(-self.head_dim // parts), 16)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one ring slot: tile_n x d_wg elements of 2 bytes."""
        return self.tile_n * self.d_wg * 2

    @property
    def q_bytes(self) -> int:
        """Bytes of the CTA's resident Q (its two column parts)."""
        return self.tile_m * 2 * self.d_wg * 2

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
        """The tile_m x tile_n fp32 partial-S exchange must fit in one ring slot."""
        return self.slot_bytes >= self.tile_m * self.tile_n * 4

    def key(self) -> tuple:
        return ("fwd_sm90", self.head_dim, self.dtype, self.causal, self.tile_m, self.tile_n, self.stages,
                self.cluster)


FWD_HEAD_DIMS = tuple(range(264, FWD_MAX_HEAD_DIM + 1, 8))  # every D the forward kernel compiles for

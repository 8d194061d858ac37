"""Tile configuration and shared-memory / register budget of the sm90a forward kernel (no cutlass import).

The forward kernel (:mod:`ffpa_attn.cutedsl.fwd_sm90`) gives ``tile_m = 64`` query rows of one (batch, head)
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
DEFAULT_TILE_N = 64  # what a direct caller gets; the planner passes the measured tile (its KernelSpec's tile_n)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _check_tma_operands(head_dim: int, dtype: str) -> None:
    """What every kernel here needs of its operands: 16-byte TMA row strides and a 16-bit dtype."""
    if head_dim % 8:
        raise ValueError(f"TMA needs 16-byte row strides: D must be a multiple of 8, got {head_dim}")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float16', got {dtype!r}")


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time configuration of one forward kernel variant.

    Attributes:
        head_dim: D of q/k/v (257..1024, a multiple of 8: TMA needs 16-byte row strides).
        dtype: "bfloat16" or "float16".
        causal: tail-aligned causal masking compiled in.
        tile_m: query rows per CTA (one wgmma M of 64 per consumer).
        tile_n: keys per K/V tile.
        q_broadcast: q has batch size 1 and serves every batch entry of k / v, o and lse (the grid's batch
            mode comes from k): the split-KV path (:mod:`ffpa_attn.cutedsl.splitkv`) passes its KV slices as
            the batch mode and the packed queries once, instead of a copy per slice.
        varlen: packed sequences (``cu_seqlens``): q/k/v/o are ``[1, H, T, D]`` views of ``[T, H, D]``, the grid
            walks a device-built work list (:mod:`ffpa_attn.cutedsl.tile_scheduler`), stores are bounded by each
            sequence.
    """

    head_dim: int
    dtype: str
    causal: bool
    tile_m: int = 64
    tile_n: int = DEFAULT_TILE_N
    q_broadcast: bool = False
    varlen: bool = False

    def __post_init__(self) -> None:
        if self.varlen and self.q_broadcast:
            raise ValueError("q_broadcast (split-KV slices) and varlen are exclusive")
        if not FWD_MIN_HEAD_DIM <= self.head_dim <= FWD_MAX_HEAD_DIM:
            raise ValueError(f"the sm90 forward kernel takes {FWD_MIN_HEAD_DIM} <= D <= {FWD_MAX_HEAD_DIM}, "
                             f"got {self.head_dim}")
        _check_tma_operands(self.head_dim, self.dtype)
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
        key = ("fwd_sm90", self.head_dim, self.dtype, self.causal, self.tile_m, self.tile_n, self.stages,
               self.cluster)
        return key + ("q_broadcast",) * self.q_broadcast + ("varlen",) * self.varlen


FWD_HEAD_DIMS = tuple(range(264, FWD_MAX_HEAD_DIM + 1, 8))  # every D the forward kernel compiles for

BWD_MIN_HEAD_DIM = 257
BWD_MAX_HEAD_DIM = 1024
# up to this D both kernels keep both stationary operands resident (dK/dV kernel: K and V; dQ kernel: Q and dO);
# above, the second one (V; dO) is streamed through ring B next to its partner chunk (dO; V) and the head dim is
# cut into more parts (docs/design.md, "CuTeDSL kernels")
BWD_RESIDENT_MAX_HEAD_DIM = 512
BWD_CHUNK = 64  # head-dim columns per TMA box / ring slot
BWD_PART_MAX_CHUNKS = 4  # dK_p / dV_p of one consumer: 64 x 256 fp32 = 128 registers per thread
BWD_STREAM_MIN_STAGES = 4  # ring B of a streamed operand: two chunks per step, the previous step's two held
BWD_TILE = 64  # keys per CTA = query rows per step
BWD_MAX_STAGES = 8


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time configuration of the two backward kernels: the key-stationary dK/dV kernel
    (:mod:`ffpa_attn.cutedsl.bwd_sm90`) and the query-stationary dQ kernel (:mod:`ffpa_attn.cutedsl.bwd_dq_sm90`).

    dK/dV kernel: one CTA per (64-key block, head-dim part of ``n_parts``, kv head, batch) owns dK and dV of its
    part (``part_chunks`` chunks of 64 columns) in fp32 registers and loops over the query heads of its GQA
    group and the query blocks that see its keys; S^T and dP^T are computed over the full head dim by
    every part (recompute). Columns past D are zero-filled by TMA (a chunk wholly past D is loaded
    from the last real chunk) and never stored. It computes no dQ (no dS tile, no fp32 dQ buffer): the dQ
    kernel (``dq_fixed_bytes``, ``dq_stages``) recomputes S and dP and writes dQ once per element (no
    reductions, deterministic): 9 GEMM units instead of the 7 of a kernel that reduces dQ into fp32 memory,
    but no reduce traffic.

    D > 512 (``stream``): K and V of a key block (2 x 128 KiB at D = 1024) no
    longer fit next to the rings, so the dK/dV kernel keeps K resident and streams V through ring B
    next to dO (ring B per step: V_0, dO_0, V_1, dO_1, ..., then the part's Q chunks; dP^T = sum_c V_c
    dO_c^T reads both operands from the ring), and the dQ kernel keeps Q resident and streams dO next
    to V. Parts: ``ceil(nc / 4)`` of <= 4 chunks for the dK/dV kernel (D = 1024: 4 CTAs per key block,
    each recomputing S^T and dP^T over the full D: 10 GEMM units where 5 are useful), 2 of <= 8 chunks
    for the dQ kernel (5 units where 1 is useful). Budget at D = 1024: dK/dV kernel K 128 KiB + P^T
    16 KiB + ring A 4 x 8 KiB + ring B 6 x 8 KiB = 224 KiB (+ V's 1 KiB placeholder); dQ kernel Q 128 KiB
    + P 16 KiB + dS 8 KiB + ring A 3 x 8 KiB + ring B 6 x 8 KiB = 224 KiB (+ 1 KiB); registers as at
    D = 512 (each consumer holds 4 chunks of 64 x 64 fp32).

    Budget of the dK/dV kernel at D = 512 (``n_chunks`` 8, ``part_chunks`` 4, bf16/fp16):

    * shared memory: K and V of the key block resident, 2 x 64 x 512 x 2 B = 128 KiB; the P^T exchange
      64 x 64 fp32 = 16 KiB; two rings (A: Q chunks then the
      part's dO chunks, for consumer 0; B: dO chunks then the part's Q chunks, for consumer 1) of ``stages`` =
      4 slots of 64 x 64 x 2 B = 8 KiB each (``max_stages`` = 4, the planner's measured choice; 5 fit): 64 KiB.
      Total 208 KiB + mbarriers <= 227 KiB. D = 448: 6 stages, D = 384: 7, D <= 320: 8.
    * registers per consumer thread (setmaxnreg 232): dV_p or dK_p 64 x 256 fp32 / 128 threads = 128;
      S^T or dP^T 32; P^T / dS^T as 16-bit A fragment 16; lse or delta of the thread's 16 query columns 16;
      P^T read back 32 (consumer 1). The producer warpgroup runs at 40 (128 x 40 + 256 x 232 = 64512 <= 65536).
    * the rings cannot deadlock when ``part_chunks <= stages`` (each consumer's part GEMM must find its
      chunks loaded without waiting for the other consumer).

    Attributes:
        head_dim: D (257..1024, a multiple of 8: TMA needs 16-byte row strides).
        dtype: "bfloat16" or "float16".
        causal: tail-aligned causal masking compiled in.
        varlen: packed sequences (``cu_seqlens``): the kernels read each sequence's offset and length from the
            cumulative lengths and clip every store to the sequence.
        max_stages: cap on the dK/dV kernel's ring depth up to D = 512 (the planner passes the depth measured
            fastest where a shallower ring won; default: as deep as fits).
    """

    head_dim: int
    dtype: str
    causal: bool
    varlen: bool = False
    max_stages: int = BWD_MAX_STAGES

    def __post_init__(self) -> None:
        if not BWD_MIN_HEAD_DIM <= self.head_dim <= BWD_MAX_HEAD_DIM:
            raise ValueError(f"the sm90 backward kernel takes {BWD_MIN_HEAD_DIM} <= D <= {BWD_MAX_HEAD_DIM}, "
                             f"got {self.head_dim}")
        _check_tma_operands(self.head_dim, self.dtype)
        if not 1 <= self.max_stages <= BWD_MAX_STAGES:
            raise ValueError(f"max_stages must be in 1..{BWD_MAX_STAGES}, got {self.max_stages}")

    @property
    def n_chunks(self) -> int:
        """64-column chunks of the head dim (the last one zero-padded past D)."""
        return -(-self.head_dim // BWD_CHUNK)

    @property
    def stream(self) -> bool:
        """D > 512: V (dK/dV kernel) and dO (dQ kernel) are streamed with their partner chunks, not resident."""
        return self.head_dim > BWD_RESIDENT_MAX_HEAD_DIM

    @property
    def n_parts(self) -> int:
        """Head-dim parts of the dK/dV kernel (CTAs per key block): 2 up to D = 512, else ``ceil(nc / 4)``."""
        return 2 if not self.stream else -(-self.n_chunks // BWD_PART_MAX_CHUNKS)

    @property
    def part_chunks(self) -> int:
        """Chunks per head-dim part (the last part may include chunks wholly past D)."""
        return -(-self.n_chunks // self.n_parts)

    @property
    def d_part(self) -> int:
        return self.part_chunks * BWD_CHUNK

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one 64 x 64 16-bit chunk (a TMA box, a ring slot)."""
        return BWD_TILE * BWD_CHUNK * 2

    @property
    def fixed_bytes(self) -> int:
        """dK/dV kernel: K and V resident (``stream``: K only, V's aligned placeholder 1 KiB) and the P^T exchange
        (fp32)."""
        tile_f32 = BWD_TILE * BWD_TILE * 4
        if self.stream:
            return self.n_chunks * self.chunk_bytes + tile_f32 + 1024
        return 2 * self.n_chunks * self.chunk_bytes + tile_f32

    def ring_split(self, fixed: int, cap: int, a_min: int) -> tuple[int, int]:
        """(ring A, ring B) slots of one kernel in the shared memory left next to its ``fixed`` bytes, at most
        ``cap`` each. Up to D = 512: two equal rings. D > 512 (``stream``): ring B streams two chunks per GEMM
        step and ring A one, and a pair walk holds 4 slots of B (the pair in flight and the one loading), so B's
        depth is its prefetch: B as deep as ``cap`` allows while A keeps ``a_min``, then A takes the rest."""
        slots = (SMEM_CAPACITY - SMEM_RESERVED - fixed) // self.chunk_bytes
        if not self.stream:
            n = min(cap, slots // 2)
            return n, n
        a = min(max(a_min, slots - cap), cap)
        return a, min(cap, slots - a)

    def _rings(self) -> tuple[int, int]:
        cap = BWD_MAX_STAGES if self.stream else self.max_stages
        # stream: ring A must hold a part's chunks (see the class docstring); 3: one chunk of prefetch
        return self.ring_split(self.fixed_bytes, cap, max(self.part_chunks, 3))

    @property
    def stages(self) -> int:
        """Slots of ring A of the dK/dV kernel (D <= 512: of each ring, the two being equal) that fit next to the
        fixed buffers, capped by ``max_stages`` (D <= 512) and ``BWD_MAX_STAGES``; D > 512:
        :meth:`ring_split`."""
        return self._rings()[0]

    @property
    def stages_b(self) -> int:
        """Slots of ring B (equal to ``stages`` up to D = 512)."""
        return self._rings()[1]

    @property
    def smem_bytes(self) -> int:
        return self.fixed_bytes + (self.stages + self.stages_b) * self.chunk_bytes

    @property
    def dq_fixed_bytes(self) -> int:
        """The dQ kernel (:mod:`.bwd_dq_sm90`): Q and dO of the query block resident
        (``stream``: Q only, dO's aligned placeholder 1 KiB), the P exchange (fp32) and dS (16-bit)."""
        resident = (1 if self.stream else 2) * self.n_chunks * self.chunk_bytes + (1024 if self.stream else 0)
        return resident + BWD_TILE * BWD_TILE * 4 + BWD_TILE * BWD_TILE * 2

    def _dq_rings(self) -> tuple[int, int]:
        return self.ring_split(self.dq_fixed_bytes, BWD_MAX_STAGES, 3)

    @property
    def dq_stages(self) -> int:
        """Slots of ring A of the dQ kernel (D <= 512: of each of its two rings of 64 x 64 chunks; D > 512:
        :meth:`ring_split`)."""
        return self._dq_rings()[0]

    @property
    def dq_stages_b(self) -> int:
        """Slots of ring B of the dQ kernel."""
        return self._dq_rings()[1]

    @property
    def dq_parts(self) -> int:
        """CTAs per query block of the dQ kernel (each owns <= 8 dQ chunks: 2 x 128 registers per consumer
        thread): 1 up to D = 512, else 2."""
        return 2 if self.stream else 1

    @property
    def dq_part_chunks(self) -> int:
        """dQ chunks per CTA of the dQ kernel."""
        return -(-self.n_chunks // self.dq_parts)

    @property
    def dq_half_chunks(self) -> int:
        """dQ chunks of the dQ kernel's consumer 0 (consumer 1 takes the rest of the part)."""
        return -(-self.dq_part_chunks // 2)

    def key(self) -> tuple:
        """Cache key of the dK/dV kernel."""
        key = ("bwd_sm90", self.head_dim, self.dtype, self.causal, self.stages)
        key = key + (self.stages_b,) if self.stream else key
        return key + ("varlen",) if self.varlen else key

    def dq_key(self) -> tuple:
        """Cache key of the dQ kernel."""
        key = ("bwd_dq_sm90", self.head_dim, self.dtype, self.causal, self.dq_stages)
        key = key + (self.dq_stages_b,) if self.stream else key
        return key + ("varlen",) if self.varlen else key


BWD_HEAD_DIMS = tuple(range(264, BWD_MAX_HEAD_DIM + 1, 8))  # every D the backward kernel compiles for


# ---------------------------------------------------------------------------------------------------------
# forward by S recompute, 512 < D <= 1024 (ffpa_attn/cutedsl/fwd_sm90_recompute.py)
#
# Two CTAs per 64-row query block, no cluster. The head dim is cut into 4 parts of d_wg = roundup(D / 4, 16)
# columns; CTA h (= grid x % 2) owns O parts 2h, 2h+1 (consumer c: part 2h + c, 64 x d_wg fp32 = 128
# registers per thread at D = 1024, as in the D = 512 kernel) and computes the whole S itself: consumer c
# accumulates the partial S over Q/K parts 2c, 2c+1 and the two partials meet in the CTA's shared memory
# (named barrier), so nothing crosses CTAs. GEMM work per tile: S over D + P.V over D / 2 = 3 units of
# 64 x tile_n x D/2 where 2 are useful (67%).
#
# Shared memory (227 KiB = 232448 B, 1 KiB kept for mbarriers):
#   Q resident, all 4 parts:       64 x 4 d_wg x 2 B = 512 d_wg   (D = 1024: 128 KiB)
#   ring slot (tile_n x d_wg):     2 tile_n d_wg                  (tile_n = 32, D = 1024: 16 KiB)
#   per tile: K item = 4 slots (every part), V item = 2 slots (this CTA's parts); the consumers hold K(j)
#   and V(j-1) at once, so the ring needs >= 6 slots (RECOMPUTE_MIN_STAGES).
#   D = 1024: 128 KiB + 6 x 16 KiB = 224 KiB at tile_n = 32 (6 slots: no slack); tile_n = 48 leaves
#   99 KiB / 24 KiB = 4 slots < 6. D = 896: tile_n 32 -> 8 slots; D = 768: tile_n 48 -> 7; D <= 704:
#   tile_n 64 -> >= 6 (D = 640: 7, D = 520: 8).
#   Q streamed from L2 instead (not built): per 64 keys the CTA would refill Q (128 KiB) + K (128 KiB)
#   + its V (64 KiB) = 320 KiB of shared memory for 12.6 MFLOP of MMA; at the D = 512 kernel's rate
#   (~480 TFLOPS on 132 SMs, 3.6 TFLOPS per SM: 3.5 us per 64 keys) that is ~12 TB/s of L2 traffic over the
#   chip, against ~7.4 TB/s for resident Q at tile_n = 32 (K 128 KiB + V 64 KiB per 64 keys; the CTA pair
#   reads the same K lines at about the same time, so half of them should hit L2). Resident Q also keeps
#   the exchange and the ring protocol of the D = 512 kernel; its cost is the n32 QK^T, which re-reads Q
#   from shared memory per 32 keys (wgmma SS m64n32k16: 3 KiB per 64 KFLOP = 16 clocks at peak, i.e. ~2/3
#   of the tensor rate at 128 B/clk of shared memory), and a ring with no slack at D = 1024 (6 slots:
#   K(j+1) waits for K(j)'s release after the exchange).
#   The partial-S exchange (64 x tile_n fp32 = 256 tile_n B) reuses the consumer's first K slot
#   (2 tile_n d_wg B, d_wg >= 144 > 128), the O epilogue the consumer's first Q part.
# Registers per consumer thread: O 64 x d_wg / 128 <= 128, S 64 x tile_n / 128 <= 32, P <= 16 (as at
# D = 512 with tile_n = 64).
RECOMPUTE_MIN_HEAD_DIM = SINGLE_CTA_MAX_HEAD_DIM + 8
RECOMPUTE_TILE_N_CHOICES = (32, 48, 64)
RECOMPUTE_MIN_STAGES = 6  # K(j+1): 4 slots, V(j): 2 slots
RECOMPUTE_MAX_STAGES = 8
RECOMPUTE_PARTS = 4  # head-dim parts: 2 CTAs x 2 consumers


def recompute_d_wg(head_dim: int) -> int:
    """Head-dim columns per part of the recompute forward (multiple of 16, <= 256)."""
    return round_up(-(-head_dim // RECOMPUTE_PARTS), 16)


def recompute_stages(head_dim: int, tile_n: int) -> int:
    """Ring slots that fit next to the resident Q of the recompute forward (capped at RECOMPUTE_MAX_STAGES)."""
    d_wg = recompute_d_wg(head_dim)
    free = SMEM_CAPACITY - SMEM_RESERVED - 64 * RECOMPUTE_PARTS * d_wg * 2
    return min(RECOMPUTE_MAX_STAGES, free // (tile_n * d_wg * 2))


def default_recompute_tile_n(head_dim: int) -> int:
    """The largest tile_n whose ring keeps RECOMPUTE_MIN_STAGES slots (fewer keys per tile re-read Q from
    shared memory more often per FLOP; fewer slots leave no room to load K(j+1) while V(j) is in use)."""
    for tile_n in sorted(RECOMPUTE_TILE_N_CHOICES, reverse=True):
        if recompute_stages(head_dim, tile_n) >= RECOMPUTE_MIN_STAGES:
            return tile_n
    raise ValueError(f"D={head_dim}: no tile_n of {RECOMPUTE_TILE_N_CHOICES} leaves {RECOMPUTE_MIN_STAGES} ring slots")


@dataclass(frozen=True)
class RecomputeFwdConfig(FwdConfig):
    """Compile-time configuration of the S-recompute forward (:mod:`ffpa_attn.cutedsl.fwd_sm90_recompute`),
    512 < D <= 1024 (a multiple of 8); see the budget comment above. ``tile_n`` 0 = the largest of
    ``RECOMPUTE_TILE_N_CHOICES`` that leaves ``RECOMPUTE_MIN_STAGES`` ring slots. No ``q_broadcast``, no
    ``varlen``."""

    tile_n: int = 0

    def __post_init__(self) -> None:
        if not RECOMPUTE_MIN_HEAD_DIM <= self.head_dim <= FWD_MAX_HEAD_DIM:
            raise ValueError(f"the S-recompute forward takes {RECOMPUTE_MIN_HEAD_DIM} <= D <= {FWD_MAX_HEAD_DIM}, "
                             f"got {self.head_dim}")
        _check_tma_operands(self.head_dim, self.dtype)
        if self.tile_m != 64:
            raise ValueError(f"tile_m must be 64 (one wgmma M per consumer), got {self.tile_m}")
        if self.q_broadcast or self.varlen:
            raise ValueError("the S-recompute forward has no q_broadcast / varlen variant")
        if self.tile_n == 0:
            object.__setattr__(self, "tile_n", default_recompute_tile_n(self.head_dim))
        if self.tile_n not in RECOMPUTE_TILE_N_CHOICES:
            raise ValueError(f"tile_n must be one of {RECOMPUTE_TILE_N_CHOICES}, got {self.tile_n}")
        if self.stages < RECOMPUTE_MIN_STAGES:
            raise ValueError(f"D={self.head_dim}, tile_n={self.tile_n}: only {self.stages} ring slots fit next to "
                             f"the resident Q (need {RECOMPUTE_MIN_STAGES})")
        if not self.exchange_fits:  # pragma: no cover - d_wg >= 144 > 128 for every D here
            raise ValueError(f"D={self.head_dim}, tile_n={self.tile_n}: the partial-S exchange does not fit a slot")

    @property
    def cluster(self) -> int:
        """No cluster: the two CTAs of a query block share nothing."""
        return 1

    @property
    def ctas_per_block(self) -> int:
        return 2

    @property
    def d_wg(self) -> int:
        return recompute_d_wg(self.head_dim)

    @property
    def q_bytes(self) -> int:
        """Bytes of the CTA's resident Q: all 4 parts."""
        return self.tile_m * RECOMPUTE_PARTS * self.d_wg * 2

    @property
    def stages(self) -> int:
        return recompute_stages(self.head_dim, self.tile_n)

    def key(self) -> tuple:
        return ("fwd_sm90_recompute", self.head_dim, self.dtype, self.causal, self.tile_m, self.tile_n, self.stages)

"""Tile and split arithmetic of the KV-cache decode kernel (:mod:`ffpa_attn.triton.kvcache`): pure integer functions
of the call's shape and the device's facts (no torch, no triton), evaluated by the planner once per call signature
and recorded in the :class:`ffpa_attn.kernel_module.KernelSpec` the kernel runs (``kvcache_fwd[block_m=16;
block_n=16;...;splits=2]``). The measured choices they encode are listed with their provenance in
:mod:`.heuristics` (``kvcache_tiles``, ``kvcache_splits``).

The kernel: one program per (O column slice, row block, KV slice, sequence x KV head), ``R = group * Nq`` packed
query rows per KV head, fp32 partials merged by the shared combine when a sequence is cut into several KV slices.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_SPLITS = 256  # KV slices per sequence at most (the combine kernel's bound)
# opt-in shared memory per block by compute-capability major, for callers without a device (benchmarks, tests)
SMEM_BY_ARCH = {8: 166912, 9: 232448, 10: 232448, 12: 101376}


def pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= max(n, lo) (Triton tensors have power-of-two shapes)."""
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


@dataclass(frozen=True)
class KVTiles:
    """One launch configuration of the decode kernel: ``block_m`` packed query rows per program, ``block_n``-key
    K/V tiles in ``num_stages`` pipeline stages on ``num_warps`` warps, O's columns in slices of ``block_do``,
    page ids fetched one tile ahead when ``pf``."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_do: int
    pf: int = 1

    def params(self) -> dict:
        """The spec parameters (:meth:`ffpa_attn.kernel_module.KernelSpec.of` keywords)."""
        return {"block_m": self.block_m, "block_n": self.block_n, "warps": self.num_warps,
                "stages": self.num_stages, "block_do": self.block_do, "pf": self.pf}

    @staticmethod
    def from_params(get) -> "KVTiles":
        """The tiles recorded in a spec (``get``: its :meth:`~ffpa_attn.kernel_module.KernelSpec.get`)."""
        return KVTiles(int(get("block_m")), int(get("block_n")), int(get("warps")), int(get("stages")),
                       int(get("block_do")), int(get("pf", 1)))


def smem_bytes(t: KVTiles, d: int, elt: int = 2) -> int:
    """Shared memory of the decode kernel: the resident Q tile plus the K^T / V tile buffers, ``num_stages - 1`` of
    them for the mma.sync tiles (block_m < 64: what Triton 3.6-3.9 allocate for sm80 / sm90, the compiler's own
    number in tests/test_kvcache_triton.py), ``num_stages`` for the 64-row wgmma tiles on sm90."""
    block_d = pow2(d)
    bufs = max(t.num_stages - (t.block_m < 64), 1)
    return bufs * t.block_n * (block_d + min(t.block_do, block_d)) * elt + t.block_m * block_d * elt


def acc_regs(t: KVTiles, d: int) -> int:
    """fp32 O-accumulator registers per thread."""
    return t.block_m * min(t.block_do, pow2(d)) // (32 * t.num_warps)


def tiles(d: int, rows: int, arch: int | None, smem_limit: int | None = None) -> KVTiles:
    """The tiles for head dim ``d`` and ``rows = group * Nq`` query rows per KV head on a GPU of compute-capability
    major ``arch`` (None: the Triton interpreter). The page size does not change the tile: a tile inside one page
    loads one page id, a tile over several pages one id per key row.

    block_m: the rows rounded up to 16 / 32 / 64, at most 64 KiB of resident Q (more rows: several row blocks, the
    later ones reading the K/V tiles from L2). 16-row tiles up to D = 512 run on 4 warps, others on 8; O's columns
    split over programs (block_do) where the fp32 accumulator would pass 64 registers per thread (every warp of a
    mma.sync QK^T also holds the Q operand of its rows, ~128 registers at D = 512). K/V tiles of 16 keys (32 at
    D <= 256) in four pipeline stages (three buffers) where they fit: at D = 512 a program takes 112 KiB of shared
    memory and ~190 registers, two programs share an SM, and each keeps 96 KiB of K/V loads in flight. Above
    D = 512 (padded D 1024) 32-key tiles on 8 warps with a single buffer (heuristic ``kvcache_tiles``).
    """
    block_d = pow2(d)
    block_m = max(16, min(16 if rows <= 16 else (32 if rows <= 32 else 64), 32768 // block_d))
    if arch is None:  # interpreter: the smallest tiles run fastest on numpy
        return KVTiles(block_m, 16, 4, 1, block_d)
    num_warps = 4 if block_m == 16 and block_d <= 512 else 8
    block_do = block_d
    while block_m * block_do > 64 * 32 * num_warps:
        block_do //= 2
    limit = (smem_limit or SMEM_BY_ARCH.get(arch, 101376)) - 8 * 1024
    if block_d > 512:  # 32-key tiles on 8 warps, even with one buffer, beat 16-key pipelines here
        choices = ((32, 2), (16, 3), (16, 2))
    else:
        bn = 32 if block_d <= 256 else 16
        choices = ((bn, 4), (bn, 3), (bn, 2))
    for bn, stages in choices:
        t = KVTiles(block_m, bn, num_warps, stages, block_do)
        if smem_bytes(t, d) <= limit:
            return t
    return KVTiles(block_m, 16, num_warps, 1, block_do)


def occupancy(t: KVTiles, d: int, smem_limit: int = SMEM_BY_ARCH[9]) -> int:
    """Programs of ``t`` one SM holds (1..4): by shared memory (:func:`smem_bytes` plus 1 KiB reserved per program)
    and by registers at Triton's cap of 255 per thread (4 warps: 2, 8 warps: 1)."""
    by_smem = (smem_limit + 1024) // (smem_bytes(t, d) + 1024)
    by_regs = 65536 // (255 * 32 * t.num_warps) if t.num_warps <= 8 else 1
    return max(1, min(4, by_smem, by_regs))


def num_splits(batch: int, hkv: int, rows: int, max_len: int, sm_count: int, *, tiles: KVTiles, d: int,
               smem_limit: int = SMEM_BY_ARCH[9]) -> int:
    """KV slices per sequence (heuristic ``kvcache_splits``), from the shape alone: ``max_len`` is the longest
    sequence the call may see (the planner passes the cache's capacity: lengths live on the device).

    About two waves of programs (``2 * occupancy * sm_count``, rounded down to whole slice counts so the last
    wave is not a sliver): the kernel hands a sequence a share of the ``S`` programs in proportion to its length,
    so with ragged lengths every program still gets about the same number of keys, and a second wave evens out
    what is left. Never slices shorter than 4 tiles or ``8 * rows`` keys of a ``max_len`` sequence: the fp32
    partials (``rows x D`` per slice, written and read back) then stay below ~25% of the slice's K/V bytes.
    """
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    per_split = max(1, batch * hkv * cdiv(rows, tiles.block_m) * cdiv(d, min(tiles.block_do, pow2(d))))
    n_tiles = cdiv(max(int(max_len), 1), tiles.block_n)
    min_tiles = max(4, cdiv(8 * rows, tiles.block_n))
    cap = max(1, min(MAX_SPLITS, n_tiles // min_tiles))
    want = (2 * occupancy(tiles, d, smem_limit) * max(int(sm_count), 1)) // per_split
    return max(1, min(want, cap))


__all__ = ["MAX_SPLITS", "SMEM_BY_ARCH", "KVTiles", "pow2", "smem_bytes", "acc_regs", "tiles", "occupancy",
           "num_splits"]

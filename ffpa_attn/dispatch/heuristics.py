"""Every "measured faster" choice of the dispatch, in one table (:data:`HEURISTICS`), each with its provenance, and
the functions that turn it into a complete kernel choice.

Correctness lives elsewhere (:mod:`.registry`: what each backend *can* run); an entry here only picks among
backends, kernels or parameters that all give the right answer, so changing one changes speed, never results. Each
entry names what it decides, its value, and one line of provenance: device, date, numbers (TFLOPS unless said;
B=1 H=32 N=8192 bf16 unless said).

The table stays in one place rather than beside each backend: the choices compare backends with each other (the
forward order, split-KV first) as often as they tune one backend, and a newcomer finds every measured number in one
file. Kernel packages never read it: the planner evaluates it once per call (:func:`select_kernel`, with the
call's :class:`Facts`) and hands the kernel its tile sizes, last-wave split and split-KV slices in the
:class:`ffpa_attn.kernel_module.KernelSpec` it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..common.env import env_flag, env_str
from ..kernel_module import KernelSpec
from .kvcache import KVTiles
from .kvcache import num_splits as kv_num_splits
from .kvcache import tiles as kv_tiles
from .waves import plan_tail_split, splitkv_slices

if TYPE_CHECKING:
    import torch

    from ..config import Backend
    from ..contract import DenseProblem, KVCacheProblem, VarlenProblem


@dataclass(frozen=True)
class Heuristic:
    """One measured choice: what it decides, the value, where the numbers come from."""

    decides: str
    value: Any
    provenance: str


HEURISTICS: dict[str, Heuristic] = {h.decides: h for h in (
    Heuristic("cuda_forward_first", {(9, 0): frozenset({768, 896, 1024})},
              "H200 2026-11-29, 32 rows per warp: D=768 CUDA 185 vs CuTeDSL 133 / Triton 109; D=1024 197 vs 178 / 117; "
              "2026-12-02 (bench/large_d_forward.py): D=896 CUDA 175 / 173 vs Triton 55 / 57, D=640 CUDA 154 / 152 "
              "loses to Triton 189 / 214 (non-causal / causal); after the S-recompute forward where that runs"),
    Heuristic("cutedsl_fwd_recompute_first", {(9, 0): frozenset(range(520, 1025, 8))},
              "H200 2026-12-02 (bench/large_d_forward.py, non-causal / causal): S-recompute vs the next fastest "
              "forward: D=640 282 / 281 vs Triton 189 / 214; 768 276 / 279 vs CUDA 186 / 183; 896 231 / 237 vs "
              "CUDA 175 / 173; 1024 250 / 261 vs CUDA 200 / 197 (the 2-CTA cluster 113-176); the D between use the "
              "same kernel with the largest tile that fits (64 keys up to 704, 48 to 768, 32 above)"),
    Heuristic("cutedsl_forward_dims", frozenset(range(328, 513, 8)) | {768, 1024},
              "H200 2026-11-29: D=384 CuTeDSL 408 vs Triton 209, 512 435 vs 209, 768 133 vs 109, 1024 166 vs 117; "
              "D=320 Triton's 128-row tiles win 456 vs 370"),
    Heuristic("triton_splitkv_rule", (64, 16),
              "split-KV when Nq <= 64 and Nkv >= 16 * max(Nq, 16): below that the split-D grid (B x H x Nq/64 "
              "programs) cannot stream the KV cache at full bandwidth (H200 2026-11-29, bench/decode_bandwidth.py)"),
    Heuristic("cutedsl_splitkv_first", True,
              "H200 2026-12-01, D=512 Nkv=32768, Hkv 32/8/2 x Nq 1/4/16: CuTeDSL split-KV +1% to +5% over Triton "
              "split-KV at 1-16 rows per KV head, up to 2.5x where Triton is MMA-bound"),
    Heuristic("cutedsl_splitkv_tile_n", 64,
              "H200 2026-12-01, D=512, Nkv=32768, nine decode shapes: 64-key tiles (5 ring slots) 1-5% faster than "
              "the forward's tuned 80 (4 slots): a slice is a short memory-bound stream, where ring depth beats tile "
              "width"),
    Heuristic("cutedsl_backward_first", True,
              "H200 2026-11-29 / 2026-12-01 (non-causal / causal): D=320 184/170 vs Triton 147/163, 384 215/198 vs "
              "145/149, 512 230/224 vs 133/142, 576 167/159 vs 108/108, 768 161/161 vs 112/121, 1024 134 vs 98"),
    Heuristic("cutedsl_fwd_tile_n", {320: 128, 384: 96, 512: 80, 768: 96, 1024: 80},
              "H200 2026-11-29 non-causal: D=320 416 vs 370 at 64 keys, 384 427 vs 408, 512 451 vs 435, "
              "768 146 vs 133, 1024 175 vs 166; causal keeps 64 (not timed)"),
    Heuristic("cutedsl_fwd_causal_tile_n", {512: 80},
              "H100 2026-12-07 (bench/kernel_ab.py, 3 interleaved rounds) causal D=512: 80 keys 479.5 vs 457.0 at "
              "64 (MHA), 458.0 vs 440.6 (GQA 32/8); packed 8 sequences causal 428.5 vs 430.2 (equal); other D keep 64 "
              "(not timed)"),
    Heuristic("cutedsl_tail_split_min_d", 384,
              "H200 2026-11-29 last-wave split A/B (one-CTA forward, D <= 512): D=384 +2.2%, 512 +2.0%, 320 -0.9%"),
    Heuristic("cuda_tail_split_archs", frozenset({(9, 0)}),
              "H200 2026-11-29 last-wave split A/B of the CUDA forward: +1 to +2.5% at every D; other archs not "
              "measured (off)"),
    Heuristic("cutedsl_bwd_ring_stages", {8: 4},
              "H200 2026-12-01 dK/dV kernel ring depth by 64-column chunk count (next to the dQ kernel), D=512: "
              "5 -> 4 slots 279 -> 293, causal 268 -> 296; D=320 / 384 / 448: the deepest ring won"),
    Heuristic("kvcache_tiles", "16-key K/V tiles, 4 stages, 4 warps up to D = 512; 32-key tiles on 8 warps above",
              "H200 2026-12-05 (ffpa_attn/bench/kvcache.py, B=32 Hq=32 Hkv=8 D=512, pages 16 / 64 / 256, 4K-32K keys, "
              "Nq 1 and 4): the decode kernel reads K/V at 94-104% of a device copy of the same bytes with 16-key "
              "tiles in 4 stages on 4 warps (two programs per SM), faster than 32-key tiles on 8 warps (one program "
              "per SM) and 16-key tiles on 8 warps at every page size; above D = 512 32-key tiles on 8 warps with "
              "one buffer beat the 16-key pipelines (dispatch/kvcache.py:tiles)"),
    Heuristic("kvcache_splits", "about two waves of programs, slices of >= 4 tiles and >= 8 * rows keys",
              "design rule of the length-balanced split-KV decode kernel (dispatch/kvcache.py:num_splits): two waves "
              "even out ragged lengths, the minimum slice keeps the fp32 partials below ~25% of the K/V bytes; the "
              "H200 rows of kvcache_tiles ran with it"),
    Heuristic("kvcache_gather_min_nq", 65,
              "rule of thumb, not yet measured: from 65 new queries per sequence (more than one 64-row query tile "
              "of the dense kernels, the split-KV bound of triton_splitkv_rule) the KV-cache call packs the cached "
              "keys (a copy: 2x the K/V bytes) and runs the varlen forward, whose 64-row wgmma / TMA tiles out-run "
              "the decode kernel's 16..64-row mma.sync tiles once R = group * Nq rows per KV head make the call "
              "compute-bound (R >= ~200 FLOP per K/V byte on an H200); below it the decode kernel reads the cache "
              "in place"),
    Heuristic("paged_gather_first", True,
              "rule of thumb, not yet measured: a varlen forward over paged K/V (ffpa_attn_varlen_func with "
              "block_table, a KV-cache chunk) runs in place, through the block table, when the implicit varlen "
              "order's first backend reads pages; when that backend reads none (CuTeDSL on sm90 at "
              "cutedsl_forward_dims: 484 vs Triton 277 TFLOPS dense at D = 512, H200 2026-12-01) the keys are "
              "packed for it (3x the K/V bytes, small next to a compute-bound chunk's MMA time) rather than run in "
              "place on the slower backend; `bench --decode` has the paged-prefill rows (in place vs packed)"),
    Heuristic("cuda_rows_per_warp_32", frozenset({(9, 0)}),
              "H200 2026-11-29, 16 -> 32 rows per warp at every padded D the kernel has: D=320 140 -> 156, "
              "384 182 -> 188, 512 221 -> 249, 640 123 -> 154, 768 157 -> 185, 1024 168 -> 197; other archs not "
              "measured (16)"),
)}


def value(decides: str) -> Any:
    """The value of heuristic ``decides`` (KeyError for an unknown name)."""
    return HEURISTICS[decides].value


# ------------------------------------------------------------------------------------------ per-call facts


@dataclass(frozen=True)
class Facts:
    """What the rules need to know about one call beyond its problem, computed once per plan.

    Attributes:
        capability: the CUDA device's (major, minor), None off-GPU.
        sms: streaming multiprocessors (a small number off-GPU, keeping interpreter grids small).
        splitkv: a dense call sized for split-KV (:func:`splitkv_sized`).
        paged_gather: a call over paged K/V takes the packed route (the planner's :func:`paged_route` decision): the
            KV-cache or varlen kernel that reads the pages gathers them for the chosen varlen forward.
    """

    capability: tuple[int, int] | None
    sms: int
    splitkv: bool
    paged_gather: bool = False  # a paged call packs its keys for another varlen forward (:func:`paged_route`)


def splitkv_sized(nq: int, nkv: int) -> bool:
    """Few query rows against a long KV sequence (heuristic ``triton_splitkv_rule``): Nq <= 64 and Nkv >= 16 *
    max(Nq, 16) (256 keys for a decode step, 1024 at Nq = 64). There the split-D grid has one program per (batch,
    head, query block) -- too few to stream the KV at full bandwidth -- and a split-KV kernel shares one K/V read
    per GQA group and spreads the KV over the GPU."""
    max_nq, ratio = value("triton_splitkv_rule")
    return nq <= max_nq and nkv >= ratio * max(nq, 16)


def facts(prob: DenseProblem | VarlenProblem) -> Facts:
    from ..common.device import capability, sm_count
    from ..contract import VarlenProblem

    from ..contract import KVCacheProblem

    dense = not isinstance(prob, (VarlenProblem, KVCacheProblem))
    return Facts(capability(prob.device), sm_count(prob.device),
                 dense and prob.dropout_p == 0 and splitkv_sized(prob.nq, prob.nkv))


# ------------------------------------------------------------------------------------------ backend order


def _on(decides: str, f: Facts) -> Any:
    """The per-arch value of heuristic ``decides`` on this call's device (empty where not measured)."""
    return value(decides).get(f.capability, frozenset()) if f.capability is not None else frozenset()


def _among(d: Any, dims: frozenset[int]) -> bool:
    """``d in dims`` for a head dim that may be symbolic under torch.compile (int() specializes on it: a head
    dim never varies between calls of one layer)."""
    return bool(dims) and int(d) in dims


def _cute_packs_rows(prob: DenseProblem, f: Facts) -> bool:
    """The CuTeDSL split-KV forward packs a KV head's rows into one block: exact only when every row sees the same
    keys (not causal, or Nq == 1)."""
    return f.splitkv and (not prob.causal or prob.nq == 1)


def recompute_preferred(prob: DenseProblem | VarlenProblem, f: Facts) -> bool:
    """Whether a CuTeDSL dense forward of this problem runs the S-recompute kernel by measurement (the dense calls
    that would otherwise take the 2-CTA cluster kernel, at the head dims measured faster on this arch)."""
    from ..contract import VarlenProblem

    if isinstance(prob, VarlenProblem) or _cute_packs_rows(prob, f):
        return False
    return _among(prob.d, _on("cutedsl_fwd_recompute_first", f))


def cuda_preferred(prob: DenseProblem | VarlenProblem, f: Facts) -> bool:
    """Whether the CUDA forward measured faster than the kernels after it for this dense problem on this arch."""
    from ..contract import VarlenProblem

    return not isinstance(prob, VarlenProblem) and _among(prob.d, _on("cuda_forward_first", f))


def forward_order(prob: DenseProblem | VarlenProblem, f: Facts) -> list[str]:
    """Backends the implicit forward tries, fastest first (the first that is available and can run the call wins)."""
    if f.splitkv:  # short queries: the split-KV kernels fill the GPU
        if value("cutedsl_splitkv_first") and _cute_packs_rows(prob, f):
            return ["cutedsl", "triton", "sdpa"]
        return ["triton", "cutedsl", "sdpa"]
    if recompute_preferred(prob, f):  # without the cute extra: CUDA next where it measured faster than Triton
        return ["cutedsl", "cuda", "triton", "sdpa"] if cuda_preferred(prob, f) else ["cutedsl", "triton", "sdpa"]
    if cuda_preferred(prob, f):
        return ["cuda", "cutedsl", "triton", "sdpa"]
    return ["cutedsl", "triton", "sdpa"]


def implicit_skip(name: str, direction: str, prob: DenseProblem | VarlenProblem, f: Facts) -> str | None:
    """Why the implicit path passes over backend ``name`` although it could run the call (it measured slower),
    else None."""
    if name == "cutedsl" and direction == "forward" and not recompute_preferred(prob, f) and \
            not _among(prob.d, value("cutedsl_forward_dims")):
        return f"the Triton forward measured faster at D={prob.d}"
    return None


def backward_order() -> list[str]:
    """Backends the implicit backward tries when the forward's backend has no backward, fastest first (masks and
    dropout, which the CuTeDSL kernels lack, end up on Triton)."""
    return ["cutedsl", "triton", "sdpa"] if value("cutedsl_backward_first") else ["triton", "sdpa"]


# ------------------------------------------------------------------------------------------ kernel choice


class Unsupported(Exception):
    """A named config that cannot apply to this call (the planner turns it into NotImplementedError)."""


def _tail(b: int, hq: int, nq: int, nkv: int, block_m: int, prob: DenseProblem, f: Facts) -> tuple | None:
    if not env_flag("FFPA_ATTN_TAIL_SPLIT"):
        return None
    split = plan_tail_split(b, hq, nq, nkv, block_m, f.sms, causal=prob.causal)
    return split.as_param() if split else None


# ------------------------------------------------------------------------------------------ KV cache


def paged_route(fastest_reads_pages: bool) -> str:
    """How a varlen forward over paged K/V runs (heuristic ``paged_gather_first``): ``"in place"`` (a kernel reads
    the pages through the block table) when the implicit varlen order's first backend for the same call over packed
    keys reads pages itself, else ``"gather"`` (the pages packed, then that backend's varlen forward)."""
    return "in place" if fastest_reads_pages or not value("paged_gather_first") else "gather"


def kvcache_route(prob: KVCacheProblem, f: Facts) -> str:
    """How a KV-cache call runs (heuristic ``kvcache_gather_min_nq``): ``"decode"`` (the split-KV kernel reads the
    cache in place) for up to 64 new queries per sequence; longer chunks over a paged cache without
    ``cache_leftpad`` whose varlen forward reads the pages (``not f.paged_gather``, :func:`paged_route`):
    ``"paged varlen"``; other chunks ``"gather+varlen"`` (the cached keys packed, then the varlen forward)."""
    if prob.nq < value("kvcache_gather_min_nq"):
        return "decode"
    if prob.page is not None and not prob.has_leftpad and not f.paged_gather:
        return "paged varlen"
    return "gather+varlen"


def kvcache_order(prob: KVCacheProblem, f: Facts) -> list[str]:
    """Backends the implicit KV-cache call tries (the first whose description lists a KV-cache kernel and can run
    it wins; none else lists one, and there is no SDPA fallback: a call none can run raises)."""
    return ["triton"]


def kvcache_tiles(prob: KVCacheProblem, f: Facts) -> KVTiles:
    """The decode kernel's tiles on this device (heuristic ``kvcache_tiles``; interpreter tiles off-GPU)."""
    from ..common.device import smem_limit

    arch = None if f.capability is None else f.capability[0]
    return kv_tiles(prob.d, prob.rows, arch, smem_limit(prob.device) if arch is not None else None)


def kvcache_splits(prob: KVCacheProblem, tiles: KVTiles, f: Facts) -> int:
    """KV slices per sequence: the caller's ``num_splits`` when it asked for some, else heuristic ``kvcache_splits``
    over the cache's capacity (lengths live on the device)."""
    from ..common.device import smem_limit

    if prob.num_splits > 0:
        return prob.num_splits
    return kv_num_splits(prob.batch, prob.hkv, prob.rows, prob.capacity, f.sms, tiles=tiles, d=prob.d,
                         smem_limit=smem_limit(prob.device))


def _triton_kvcache(prob: KVCacheProblem, f: Facts) -> KernelSpec:
    route = kvcache_route(prob, f)
    if route != "decode":
        if prob.num_splits > 0:
            raise Unsupported(f"num_splits={prob.num_splits} applies to the split-KV decode kernel, which serves up "
                              f"to {value('kvcache_gather_min_nq') - 1} new queries per sequence; this call "
                              f"(Nq={prob.nq}) runs the varlen forward: pass num_splits=0")
        return KernelSpec("kvcache_paged" if route == "paged varlen" else "kvcache_gather")
    tiles = kvcache_tiles(prob, f)
    return KernelSpec.of("kvcache_fwd", splits=kvcache_splits(prob, tiles, f), **tiles.params())


def _triton(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None, f: Facts) -> KernelSpec:
    from ..contract import KVCacheProblem, VarlenProblem

    if isinstance(prob, KVCacheProblem):
        return _triton_kvcache(prob, f)
    varlen = isinstance(prob, VarlenProblem)
    if direction == "backward":
        return KernelSpec("varlen_bwd" if varlen else "bwd")
    if varlen:
        # paged K/V on the packed route: this kernel module gathers the pages for another backend's varlen forward
        return KernelSpec("varlen_gather" if prob.page is not None and f.paged_gather else "varlen_fwd")
    # tiles and the split count of split-KV come from Triton's autotuner (a measurement made at run time on this
    # GPU, cached on disk): the config names whether to tune
    return KernelSpec("splitkv_fwd" if f.splitkv else "fwd")


def cute_tile_n(d: int, causal: bool) -> int:
    """Keys per K/V tile of the CuTeDSL one-CTA / cluster / varlen forward (heuristics ``cutedsl_fwd_tile_n`` and
    ``cutedsl_fwd_causal_tile_n``)."""
    return value("cutedsl_fwd_causal_tile_n" if causal else "cutedsl_fwd_tile_n").get(d, 64)


def _cutedsl(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None, f: Facts) -> KernelSpec:
    from ..contract import VarlenProblem

    varlen = isinstance(prob, VarlenProblem)
    if direction == "backward":
        stages = value("cutedsl_bwd_ring_stages").get(-(-prob.d // 64)) if prob.d <= 512 else None
        return KernelSpec.of("varlen_bwd_sm90+varlen_bwd_dq_sm90" if varlen else "bwd_sm90+bwd_dq_sm90",
                             ring_stages=stages)
    want = getattr(cfg, "fwd_recompute", None)
    if varlen or _cute_packs_rows(prob, f) or prob.d <= 512:
        if want:
            where = "varlen" if varlen else ("split-KV" if _cute_packs_rows(prob, f) else f"D={prob.d}")
            raise Unsupported(f"fwd_recompute=True has no effect on this call ({where}): the S-recompute forward "
                              "replaces the 2-CTA cluster forward of dense calls with 512 < D <= 1024")
        if varlen:
            return KernelSpec.of("varlen_fwd_sm90", tile_n=cute_tile_n(prob.d, prob.causal))
        if _cute_packs_rows(prob, f):
            rows = prob.hq // prob.hkv * prob.nq
            return KernelSpec.of("splitkv_fwd_sm90", tile_n=value("cutedsl_splitkv_tile_n"),
                                 splits=splitkv_slices(prob.batch, prob.hkv, rows, prob.nkv, f.sms))
    elif want is True or (want is None and recompute_preferred(prob, f)):
        return KernelSpec("fwd_sm90_recompute")
    tail = None
    if prob.d <= 512 and prob.d >= value("cutedsl_tail_split_min_d"):  # one CTA (64 rows) per query block
        tail = _tail(prob.batch, prob.hq, prob.nq, prob.nkv, 64, prob, f)
    return KernelSpec.of("fwd_sm90", tile_n=cute_tile_n(prob.d, prob.causal), tail=tail)


def cuda_rows_per_warp(f: Facts) -> int:
    """Query rows per warp of the CUDA forward: ``FFPA_ATTN_CUDA_ROWS_PER_WARP`` (benchmarks), else 32 on the archs
    where it measured faster (heuristic ``cuda_rows_per_warp_32``), else 16."""
    env = env_str("FFPA_ATTN_CUDA_ROWS_PER_WARP")
    if env:
        if env not in ("16", "32"):
            raise ValueError(f"FFPA_ATTN_CUDA_ROWS_PER_WARP must be 16 or 32, got {env!r}")
        return int(env)
    return 32 if f.capability in value("cuda_rows_per_warp_32") else 16


def _cuda(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None, f: Facts) -> KernelSpec:
    rows = cuda_rows_per_warp(f)
    tail = None
    if f.capability in value("cuda_tail_split_archs"):
        # the 8-warp CTAs sm90 always fits: 64 query rows up to D = 512, 32 above (both row modes)
        tail = _tail(prob.batch, prob.hq, prob.nq, prob.nkv, 64 if prob.d <= 512 else 32, prob, f)
    return KernelSpec.of("fwd", rows_per_warp=rows, tail=tail)


def _sdpa(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None, f: Facts) -> KernelSpec:
    return KernelSpec("math_bwd" if direction == "backward" else "sdpa_fwd")


# each backend's kernel choice (the measured parts of it; what a backend can run at all is its description)
SELECTORS: dict[str, Callable[[str, Any, Any, Facts], KernelSpec]] = {
    "triton": _triton, "cutedsl": _cutedsl, "cuda": _cuda, "sdpa": _sdpa}


def select_kernel(name: str, direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None,
                  f: Facts) -> KernelSpec:
    """The kernel and its parameters that backend ``name`` runs for ``direction`` of ``prob`` (raises
    :class:`Unsupported` for a named config that cannot apply)."""
    return SELECTORS[name](direction, prob, cfg, f)


def markdown_table() -> str:
    """The table as markdown (for docs/design.md's "Dispatch heuristics")."""
    rows = ["| Decides | Value | Provenance |", "| --- | --- | --- |"]
    for h in HEURISTICS.values():
        v = sorted(h.value) if isinstance(h.value, (set, frozenset)) and len(h.value) < 8 else h.value
        if isinstance(h.value, frozenset) and len(h.value) >= 8:
            v = f"{min(h.value)}..{max(h.value)} ({len(h.value)} dims)"
        rows.append(f"| `{h.decides}` | `{v}` | {h.provenance} |")
    return "\n".join(rows)


__all__ = ["Heuristic", "HEURISTICS", "value", "Facts", "facts", "splitkv_sized", "recompute_preferred",
           "cuda_preferred", "forward_order", "implicit_skip", "backward_order", "Unsupported", "select_kernel",
           "SELECTORS", "cute_tile_n", "cuda_rows_per_warp", "markdown_table", "kvcache_route", "kvcache_order",
           "kvcache_tiles", "kvcache_splits", "paged_route"]

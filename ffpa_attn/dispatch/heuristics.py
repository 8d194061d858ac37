"""Every "measured faster" choice of the dispatch, in one table (:data:`HEURISTICS`), each with its provenance.

Correctness lives elsewhere (:mod:`.capabilities`: what each backend *can* run); an entry here only picks among
backends or kernels that all give the right answer, so changing one changes speed, never results. Each entry
names what it decides, its value, and one line of provenance: device, date, numbers (TFLOPS unless said;
B=1 H=32 N=8192 bf16 unless said). Kernel packages read their tuned values from here too (tile widths, ring
depths, dQ mode, tail split), so a newcomer finds every tuned number in this file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# contract and capabilities import torch: imported inside the functions that need them, so that a kernel package
# reading its tuned values here (cute/config.py, also in the torch-free CuTeDSL compile server) imports no torch
if TYPE_CHECKING:
    from ..contract import DenseProblem, VarlenProblem


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
              "same kernel with the tile of cute/config.py (64 keys up to 704, 48 to 768, 32 above)"),
    Heuristic("cutedsl_forward_dims", frozenset(range(328, 513, 8)) | {768, 1024},
              "H200 2026-11-29: D=384 CuTeDSL 408 vs Triton 209, 512 435 vs 209, 768 133 vs 109, 1024 166 vs 117; "
              "D=320 Triton's 128-row tiles win 456 vs 370"),
    Heuristic("triton_splitkv_rule", (64, 16),
              "split-KV when Nq <= 64 and Nkv >= 16 * max(Nq, 16): below that the split-D grid (B x H x Nq/64 "
              "programs) cannot stream the KV cache at full bandwidth (H200 2026-11-29, bench/decode_bandwidth.py)"),
    Heuristic("cutedsl_splitkv_first", True,
              "H200 2026-12-01, D=512 Nkv=32768, Hkv 32/8/2 x Nq 1/4/16: CuTeDSL split-KV +1% to +5% over Triton "
              "split-KV at 1-16 rows per KV head, up to 2.5x where Triton is MMA-bound"),
    Heuristic("cutedsl_backward_first", True,
              "H200 2026-11-29 / 2026-12-01 (non-causal / causal): D=320 184/170 vs Triton 147/163, 384 215/198 vs "
              "145/149, 512 230/224 vs 133/142, 576 167/159 vs 108/108, 768 161/161 vs 112/121, 1024 134 vs 98"),
    Heuristic("cutedsl_fwd_tile_n", {320: 128, 384: 96, 512: 80, 768: 96, 1024: 80},
              "H200 2026-11-29 non-causal: D=320 416 vs 370 at 64 keys, 384 427 vs 408, 512 451 vs 435, "
              "768 146 vs 133, 1024 175 vs 166; causal keeps 64 (not timed)"),
    Heuristic("cutedsl_tail_split_min_d", 384,
              "H200 2026-11-29 last-wave split A/B: D=384 +2.2%, 512 +2.0%, 320 -0.9%"),
    Heuristic("cutedsl_bwd_ring_stages", {8: 4},
              "H200 2026-12-01 dK/dV kernel ring depth (next to the dQ kernel), D=512: 5 -> 4 slots 279 -> 293, "
              "causal 268 -> 296; D=320 / 384 / 448: the deepest ring won"),
    Heuristic("cuda_rows_per_warp_32", frozenset(("sm_90a", dp) for dp in (384, 512, 768, 1024)),
              "H200 2026-11-29, 16 -> 32 rows per warp: D=320 140 -> 156, 384 182 -> 188, 512 221 -> 249, "
              "640 123 -> 154, 768 157 -> 185, 1024 168 -> 197; other archs not measured (16)"),
)}


def value(decides: str) -> Any:
    """The value of heuristic ``decides`` (KeyError for an unknown name)."""
    return HEURISTICS[decides].value


CUDA_PREFERRED_HEAD_DIMS: dict[tuple[int, int], frozenset[int]] = value("cuda_forward_first")


def cuda_preferred(prob: DenseProblem | VarlenProblem) -> bool:
    """Whether the implicit default tries the CUDA forward first for this (dense) problem."""
    from ..contract import VarlenProblem
    from . import capabilities as caps

    if isinstance(prob, VarlenProblem) or prob.device.type != "cuda":
        return False
    return prob.d in CUDA_PREFERRED_HEAD_DIMS.get(caps.device_capability(prob.device), frozenset())


def recompute_preferred(prob: DenseProblem | VarlenProblem) -> bool:
    """Whether the implicit CuTeDSL forward of this problem is the S-recompute kernel (dense calls that would
    otherwise take the 2-CTA cluster kernel, at the measured head dims of this GPU)."""
    from ..contract import VarlenProblem
    from . import capabilities as caps

    if isinstance(prob, VarlenProblem) or prob.device.type != "cuda":
        return False
    dims = value("cutedsl_fwd_recompute_first").get(caps.device_capability(prob.device), frozenset())
    return prob.d in dims and cute_forward_kernel(prob.nq, prob.nkv, prob.causal) == "fwd_sm90"


def cute_preferred_dims() -> frozenset[int]:
    """Head dims where the implicit default prefers the CuTeDSL forward (supported there and measured faster)."""
    from . import capabilities as caps

    return frozenset(value("cutedsl_forward_dims")) & caps._cute_dims()[0]


def triton_forward_kernel(nq: int, nkv: int, varlen: bool = False, dropout: bool = False) -> str:
    """Which Triton forward kernel serves a call: split-KV ("flash decoding") for few query rows against a
    long KV sequence, else the split-D kernel.

    Split-KV when Nq <= 64 and the KV is at least 16 tiles of the query length (Nkv >= 16 * max(Nq, 16):
    256 keys for a decode step, 1024 at Nq = 64): there the split-D kernel has one program per (batch,
    head, query block) - too few to stream the KV cache at full bandwidth - and reads each KV head once
    per query head of a GQA group; split-KV shares one K/V read per group and spreads the KV over the
    GPU (with one split it is a single launch, so short caches lose nothing). Dropout and varlen use the
    split-D kernels.
    """
    max_nq, ratio = value("triton_splitkv_rule")
    if not varlen and not dropout and nq <= max_nq and nkv >= ratio * max(nq, 16):
        return "splitkv_fwd"
    return "varlen_fwd" if varlen else "fwd"


def cute_forward_kernel(nq: int, nkv: int, causal: bool) -> str:
    """Which CuTeDSL forward kernel serves a dense call: ``"splitkv_fwd_sm90"`` (the forward kernel on packed
    GQA rows x KV slices, :mod:`ffpa_attn.cute.splitkv`) for split-KV-sized calls (:func:`triton_forward_kernel`)
    where every row sees the same keys (not causal, or Nq == 1); else ``"fwd_sm90"``."""
    if triton_forward_kernel(nq, nkv) == "splitkv_fwd" and (not causal or nq == 1):
        return "splitkv_fwd_sm90"
    return "fwd_sm90"


def forward_order(prob: DenseProblem | VarlenProblem) -> list[str]:
    """Backends the implicit forward tries, fastest first (the first that can run the call wins)."""
    from ..contract import DenseProblem

    order = ["cutedsl", "triton", "sdpa"]
    if isinstance(prob, DenseProblem) and \
            triton_forward_kernel(prob.nq, prob.nkv, dropout=prob.dropout_p > 0) == "splitkv_fwd":
        order = ["triton", "cutedsl", "sdpa"]  # short queries: the split-KV kernel fills the GPU
        if value("cutedsl_splitkv_first") and cute_forward_kernel(prob.nq, prob.nkv, prob.causal) == "splitkv_fwd_sm90":
            order = ["cutedsl", "triton", "sdpa"]
    elif recompute_preferred(prob):  # without the cute extra: CUDA next where it measured faster than Triton
        order = ["cutedsl", "cuda", "triton", "sdpa"] if cuda_preferred(prob) else ["cutedsl", "triton", "sdpa"]
    elif cuda_preferred(prob):
        order = ["cuda", *order]
    return order


def backward_order() -> list[str]:
    """Backends the implicit backward tries (when the forward's backend has no say), fastest first; masks,
    dropout (the forward's RNG) end up on Triton, which has them; varlen goes to the CuTeDSL backward wherever
    the dense backward of the same D does (cute/_dims.py VARLEN_DIRECTIONS)."""
    return ["cutedsl", "triton", "sdpa"] if value("cutedsl_backward_first") else ["triton", "sdpa"]


def markdown_table() -> str:
    """The table as markdown (for docs/design.md's "Dispatch heuristics")."""
    rows = ["| Decides | Value | Provenance |", "| --- | --- | --- |"]
    for h in HEURISTICS.values():
        v = sorted(h.value) if isinstance(h.value, (set, frozenset)) and len(h.value) < 8 else h.value
        if isinstance(h.value, frozenset) and len(h.value) >= 8:
            v = f"{min(h.value)}..{max(h.value)} ({len(h.value)} dims)"
        rows.append(f"| `{h.decides}` | `{v}` | {h.provenance} |")
    return "\n".join(rows)


__all__ = ["Heuristic", "HEURISTICS", "value", "CUDA_PREFERRED_HEAD_DIMS", "cuda_preferred", "cute_preferred_dims",
           "recompute_preferred",
           "triton_forward_kernel", "cute_forward_kernel", "forward_order", "backward_order", "markdown_table"]

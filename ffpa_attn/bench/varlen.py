"""Varlen (packed-sequence) forward benchmark: ``python -m ffpa_attn bench --varlen``.

One case is a set of sequences packed into ``[T, H, D]`` (``cu_seqlens``), timed as

* ``cutedsl``, ``triton``: ``ffpa_attn_varlen_func`` with the backend named (one launch for the whole batch);
* ``cutedsl-dense``: the dense CuTeDSL forward of about the same work in one sequence (B=1, N with
  ``N * N`` (or the causal pair count) closest to the varlen case's) -- the speed the varlen path should reach;
* ``cutedsl-seq-loop``: the dense CuTeDSL forward called once per sequence at that sequence's own shape (inputs
  copied to ``[1, H, N_i, D]`` outside the timed call): exactly the same per-sequence work as the varlen call, so
  varlen / this is the packing's efficiency (launch gaps between the calls included);
* ``sdpa-loop``: torch SDPA called once per sequence (what a user writes without a varlen kernel);
* ``upstream-cutedsl``: the public ffpa-attn package's ``ffpa_attn_varlen_func`` (:mod:`.upstream`, when
  ``FFPA_UPSTREAM_PATH`` is set);
* ``fa4-sm90``: FlashAttention-4's CuTeDSL sm90 varlen forward as vLLM ships it (:mod:`.fa4`, D = 512, when
  ``FFPA_FA4_PATH`` is set).

TFLOPS count the work of each sequence exactly: ``4 * Hq * D * pairs_i`` summed over sequences, ``pairs_i`` the
(query, key) pairs the sequence's mask keeps (tail-aligned causal: ``sum_r min(Nk, max(0, r + Nk - Nq + 1))``),
so causal and non-causal, short and long sequences are comparable. Forward only; out is checked against the
fp32 reference (``ffpa_attn.reference.varlen_attention``) on the first query head group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..contract import causal_mask
from ..testing import rel_err
from . import fa4, upstream
from .timing import measure

# 8 sequences of mixed lengths, 16K tokens: one long document, a few medium, several short
DEFAULT_LENS = (6144, 3072, 2048, 1536, 1280, 1024, 768, 512)
DRY_RUN_LENS = (40, 1, 23)
VARLEN_IMPLS = ("cutedsl", "triton", "cutedsl-dense", "cutedsl-seq-loop", "sdpa-loop", "upstream-cutedsl", "fa4-sm90")
# the backend each implementation names (checked first, so a cell that cannot run here says why in a few words)
VARLEN_BACKENDS = {"cutedsl": "cutedsl", "triton": "triton", "cutedsl-dense": "cutedsl", "cutedsl-seq-loop": "cutedsl"}


def mask_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs one sequence's mask keeps (tail-aligned causal: row r sees k <= r + Nk - Nq)."""
    if not causal:
        return nq * nk
    # row r (< Nq) sees max(0, r + Nk - Nq + 1) keys (never more than Nk): an arithmetic series from row lo on
    lo = max(0, nq - nk)
    n = nq - lo
    return n * (lo + nk - nq + 1) + n * (n - 1) // 2


@dataclass(frozen=True)
class VarlenCase:
    """Packed sequences with per-sequence query / key lengths (keys default to the queries')."""

    d: int
    causal: bool
    hq: int
    hkv: int
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...] = field(default=())
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not self.lens_k:
            object.__setattr__(self, "lens_k", self.lens_q)
        if len(self.lens_k) != len(self.lens_q):
            raise ValueError("lens_q and lens_k need one entry per sequence")

    def flops(self) -> float:
        """Forward FLOPs, exact per sequence: ``4 * Hq * D * pairs``."""
        return 4.0 * self.hq * self.d * sum(mask_pairs(a, b, self.causal) for a, b in zip(self.lens_q, self.lens_k))

    def dense_n(self) -> int:
        """Length of the one dense sequence with about the same work (a multiple of 64, at least 64)."""
        pairs = sum(mask_pairs(a, b, self.causal) for a, b in zip(self.lens_q, self.lens_k))
        n = math.sqrt(2 * pairs) if self.causal else math.sqrt(pairs)
        return max(64, int(round(n / 64)) * 64)

    def label(self) -> str:
        heads = f" {self.hq}/{self.hkv}" if self.hq != self.hkv else f" H{self.hq}"
        return (f"D={self.d} {'causal' if self.causal else 'full'}{heads} {len(self.lens_q)} seqs "
                f"{sum(self.lens_q)} tok {self.dtype}")


@dataclass
class VarlenCell:
    impl: str
    ms: float | None = None
    tflops: float | None = None
    err: float | None = None
    note: str = ""


def _inputs(case: VarlenCase, device: torch.device, seed: int):
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    g = torch.Generator(device=device).manual_seed(seed)
    tq, tk = sum(case.lens_q), sum(case.lens_k)
    q = torch.randn(tq, case.hq, case.d, device=device, generator=g).to(dt)
    k = torch.randn(tk, case.hkv, case.d, device=device, generator=g).to(dt)
    v = torch.randn(tk, case.hkv, case.d, device=device, generator=g).to(dt)

    def cu(lens: Sequence[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(list(lens)).cumsum(0).tolist()], dtype=torch.int32, device=device)

    return q, k, v, cu(case.lens_q), cu(case.lens_k)


def _calls(case: VarlenCase, q, k, v, cu_q, cu_k) -> dict[str, Callable[[], Any]]:
    from ..interface import ffpa_attn_func, ffpa_attn_varlen_func

    gqa = case.hq != case.hkv
    max_q, max_k = max(case.lens_q, default=0), max(case.lens_k, default=0)

    def varlen(backend: str) -> Callable[[], Any]:
        return lambda: ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, enable_gqa=gqa,
                                             backend=backend)

    n = case.dense_n()
    dq = torch.randn(1, case.hq, n, case.d, device=q.device).to(q.dtype)
    dk = torch.randn(1, case.hkv, n, case.d, device=q.device).to(q.dtype)
    dv = torch.randn(1, case.hkv, n, case.d, device=q.device).to(q.dtype)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    seqs = [(q[cq[i]:cq[i + 1]].transpose(0, 1).unsqueeze(0), k[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0),
             v[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0)) for i in range(len(cq) - 1) if cq[i + 1] > cq[i]]

    dense_seqs = [tuple(t.contiguous() for t in s) for s in seqs]

    def cute_seq_loop() -> None:
        for qs, ks, vs in dense_seqs:
            ffpa_attn_func(qs, ks, vs, is_causal=case.causal, enable_gqa=gqa, backend="cutedsl")

    def sdpa_loop() -> torch.Tensor:
        out = torch.empty_like(q)
        for (a, b), (qs, ks, vs) in zip([(cq[i], cq[i + 1]) for i in range(len(cq) - 1) if cq[i + 1] > cq[i]], seqs):
            mask, is_causal = None, case.causal and qs.shape[2] == ks.shape[2]  # SDPA's causal is top-left aligned
            if case.causal and not is_causal:  # tail-aligned, as ours
                mask = causal_mask(qs.shape[2], ks.shape[2], q.device)
            out[a:b] = torch.ops.aten.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)[0].transpose(0, 1)
        return out

    def upstream_cutedsl() -> Any:
        mod = upstream.load()
        return mod.ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=case.causal, enable_gqa=gqa)

    def fa4_sm90() -> Any:
        return fa4.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, case.causal)()

    return {
        "cutedsl": varlen("cutedsl"),
        "triton": varlen("triton"),
        "cutedsl-dense": lambda: ffpa_attn_func(dq, dk, dv, is_causal=case.causal, enable_gqa=gqa, backend="cutedsl"),
        "cutedsl-seq-loop": cute_seq_loop,
        "sdpa-loop": sdpa_loop,
        "upstream-cutedsl": upstream_cutedsl,
        "fa4-sm90": fa4_sm90,
    }


def peer_unavailable(name: str, case: VarlenCase, device: torch.device) -> str | None:
    """Why the peer ``name`` (``upstream-cutedsl``, ``fa4-sm90``) cannot run ``case`` here, else None (ours: None)."""
    if name == "upstream-cutedsl" and upstream.upstream_path() is None:
        return f"{upstream.ENV_VAR} (the public ffpa-attn to compare with) is not set"
    if name == "fa4-sm90":
        if not fa4.fa4_paths():
            return f"{fa4.ENV_VAR} (FA4's sm90 forward as vLLM ships it) is not set"
        if case.d != 512:
            return f"FA4's sm90 forward runs head dim 512 above 256, not {case.d}"
    if name in ("upstream-cutedsl", "fa4-sm90") and device.type != "cuda":
        return "needs a CUDA device"
    return None


def run_varlen_bench(cases: Sequence[VarlenCase], impls: Sequence[str], device: torch.device, *, max_reps: int,
                     min_reps: int, budget_s: float, seed: int = 0) -> list[tuple[VarlenCase, list[VarlenCell]]]:
    """Time every implementation on every case (forward). A failing implementation records its error."""
    from ..dispatch.registry import available as backend_available
    from ..reference import varlen_attention

    results = []
    for i, case in enumerate(cases):
        q, k, v, cu_q, cu_k = _inputs(case, device, seed + i)
        g = case.hq // case.hkv
        ref, _ = varlen_attention(q[:, :g].float(), k[:, :1].float(), v[:, :1].float(), cu_q, cu_k, causal=case.causal)
        cells = []
        for name, call in _calls(case, q, k, v, cu_q, cu_k).items():
            if name not in impls:
                continue
            cell = VarlenCell(name)
            ok, why = backend_available(VARLEN_BACKENDS[name], device) if name in VARLEN_BACKENDS else (True, "")
            peer_why = peer_unavailable(name, case, device)
            if peer_why is not None:
                ok, why = False, peer_why
            if not ok:
                cell.note = why
                cells.append(cell)
                continue
            try:
                out = call()
                if name not in ("cutedsl-dense", "cutedsl-seq-loop"):
                    cell.err = rel_err(out[:, :g], ref)
                t = measure(call, device, max_reps=max_reps, min_reps=min_reps, budget_s=budget_s)
                cell.ms = t.median_ms
                flops = case.flops()
                if name == "cutedsl-dense":
                    n = case.dense_n()
                    flops = 4.0 * case.hq * case.d * mask_pairs(n, n, case.causal)
                cell.tflops = flops / (cell.ms * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001 - one failing implementation never stops the run
                cell.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            cells.append(cell)
        results.append((case, cells))
    return results


def varlen_report(results: Sequence[tuple[VarlenCase, Sequence[VarlenCell]]]) -> str:
    """Plain-text table: one row per case, ``TFLOPS (ms)`` per implementation, errors of the varlen outputs."""
    lines = []
    for case, cells in results:
        lines.append(f"{case.label()}  lens_q={list(case.lens_q)}"
                     + (f" lens_k={list(case.lens_k)}" if case.lens_k != case.lens_q else "")
                     + f"  dense-equivalent N={case.dense_n()}")
        for c in cells:
            if c.ms is None:
                lines.append(f"  {c.impl:<14} n/a  {c.note}")
            else:
                err = "" if c.err is None else f"  err {c.err:.2e}"
                lines.append(f"  {c.impl:<14} {c.tflops:8.1f} TFLOPS  {c.ms:9.3f} ms{err}")
    return "\n".join(lines)


def default_cases(d_list: Sequence[int], causal: Sequence[bool], hq: int, hkv: int, dtype: str,
                  lens: Sequence[int] = DEFAULT_LENS) -> list[VarlenCase]:
    return [VarlenCase(d=d, causal=c, hq=hq, hkv=hkv, lens_q=tuple(lens), dtype=dtype) for d in d_list for c in causal]

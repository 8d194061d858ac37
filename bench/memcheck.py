"""One forward + backward call per kernel family, small enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck python bench/memcheck.py --family cute-varlen --d 512
    compute-sanitizer --tool memcheck python bench/memcheck.py --family cute-recompute --d 1024
    compute-sanitizer --tool memcheck python bench/memcheck.py --family all

Families: triton-dense, triton-varlen, cute-dense, cute-recompute (the S-recompute forward of 512 < D <= 1024, with
the CuTeDSL backward), cute-varlen, cuda-dense. The varlen families pack sequences of
mixed lengths (an empty one, a length-1 one, lengths that are no multiple of any tile) and surround the packed
outputs' rows with sentinel values: after the call every gradient / output row outside a sequence must still
hold its sentinel, and rows inside must be finite. A family whose backend is unavailable prints SKIP with the
reason. Exit code 1 if a check fails (the sanitizer's own report is separate: read its ERROR SUMMARY).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ffpa_attn import CuTeDSLBackend, explain, ffpa_attn_func, ffpa_attn_varlen_func

FAMILIES = ("triton-dense", "triton-varlen", "cute-dense", "cute-recompute", "cute-varlen", "cuda-dense")
SENTINEL = 7.0


def _dense(backend: str | CuTeDSLBackend, d: int, causal: bool, dtype: torch.dtype) -> str:
    fwd_only = backend == "cuda"
    q = torch.randn(1, 4, 200, d, device="cuda", dtype=dtype, requires_grad=not fwd_only)
    k = torch.randn(1, 2, 333, d, device="cuda", dtype=dtype, requires_grad=not fwd_only)
    v = torch.randn_like(k, requires_grad=not fwd_only)
    kw = {"forward_backend": backend} if fwd_only else {"backend": backend}
    out = ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=True, **kw)
    if not fwd_only:
        out.float().square().sum().backward()
        grads = (q.grad, k.grad, v.grad)
    else:
        grads = ()
    torch.cuda.synchronize()
    bad = [n for n, t in zip(("out", "dq", "dk", "dv"), (out, *grads)) if not torch.isfinite(t).all()]
    return "non-finite " + ",".join(bad) if bad else ""


def _guarded(rows: int, h: int, d: int, dtype: torch.dtype, gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sentinel-filled buffer with ``gap`` guard rows before and after; returns (buffer, packed view)."""
    buf = torch.full((rows + 2 * gap, h, d), SENTINEL, device="cuda", dtype=dtype)
    return buf, buf[gap:gap + rows]


def _varlen(backend: str, d: int, causal: bool, dtype: torch.dtype) -> str:
    lens_q = [0, 1, 77, 300, 129, 5]
    lens_k = [3, 1, 77, 450, 200, 5] if causal else [0, 2, 64, 300, 131, 9]
    hq, hkv, gap = 4, 2, 64
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    # inputs live inside sentinel-filled buffers too, so a read past a sequence sees large values
    qb, q = _guarded(tq, hq, d, dtype, gap)
    kb, k = _guarded(tk, hkv, d, dtype, gap)
    vb, v = _guarded(tk, hkv, d, dtype, gap)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    # cutedsl: its varlen forward, and the backward the implicit default picks (the CuTeDSL one where
    # backend description lists a varlen backward kernel, else Triton's)
    kw = {"forward_backend": backend} if backend == "cutedsl" else {"backend": backend}
    out = ffpa_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, enable_gqa=True, **kw)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    problems = []
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in leaves))):
        if not torch.isfinite(t).all():
            problems.append(f"{name} non-finite")
    # the kernels must not have written the guard rows of the input buffers (they only read them)
    for name, b, n in (("q", qb, tq), ("k", kb, tk), ("v", vb, tk)):
        if not ((b[:gap] == SENTINEL).all() and (b[gap + n:] == SENTINEL).all()):
            problems.append(f"{name} guard rows changed")
    return "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="all", help=f"one of {', '.join(FAMILIES)} or all")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("memcheck: no CUDA GPU found", file=sys.stderr)
        return 2
    fams = FAMILIES if a.family == "all" else tuple(a.family.split(","))
    dtype = getattr(torch, a.dtype)
    failed = 0
    for fam in fams:
        backend, kind = {"triton": "triton", "cute": "cutedsl", "cuda": "cuda"}[fam.split("-")[0]], fam.split("-")[1]
        if kind == "recompute":  # a named config: the planner refuses it (NotImplementedError) at D <= 512
            backend, kind = CuTeDSLBackend(fwd_recompute=True), "dense"
        for causal in (False, True):
            tag = f"{fam} D={a.d} causal={causal}"
            try:
                msg = (_dense if kind == "dense" else _varlen)(backend, a.d, causal, dtype)
            except NotImplementedError as exc:
                print(f"SKIP {tag}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - printed and counted
                msg = f"{type(exc).__name__}: {exc}"
            failed += bool(msg)
            print(f"{'FAIL' if msg else 'ok  '} {tag} {msg}", flush=True)
    probe = torch.empty(1, 1, 8, a.d, device="cuda", dtype=dtype)
    print(explain(probe, probe, probe))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

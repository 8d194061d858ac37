"""One call per kernel family, small enough to run under compute-sanitizer:

    compute-sanitizer --tool memcheck python bench/memcheck.py --family cute-varlen --d 512
    compute-sanitizer --tool memcheck python bench/memcheck.py --family cute-recompute --d 1024
    compute-sanitizer --tool memcheck python bench/memcheck.py --family kvcache-decode,triton-splitkv --d 1024
    compute-sanitizer --tool memcheck python bench/memcheck.py --family all

Families (forward + backward unless said): triton-dense, triton-varlen, triton-splitkv (forward), cute-dense,
cute-recompute (the S-recompute forward of 512 < D <= 1024, with the CuTeDSL backward), cute-varlen, cute-splitkv
(forward), cuda-dense (forward), and the KV-cache kernels (forward): kvcache-decode (the decode route over a paged
cache), kvcache-append (the decode route writing new tokens first), kvcache-paged (a chunk of new queries: append,
then the varlen forward reading the pages in place), kvcache-gather (the same chunk with ``cache_leftpad``, the
route that packs the cached keys first). ``--d`` picks the head dim (512, 1024, ...).

The varlen families pack sequences of mixed lengths (an empty one, a length-1 one, lengths that are no multiple of
any tile) and surround the packed outputs' rows with sentinel values: after the call every gradient / output row
outside a sequence must still hold its sentinel, and rows inside must be finite. The KV-cache families fill every
cache slot outside the sequences (spare pages, page tails) with the sentinel: afterwards the caches must equal
what the reference append leaves (no stray write) and the output the fp32 reference (a stray read of a sentinel
slot shows there). The split-KV families check that the planner picked the split-KV kernel (ragged last slice) and
compare with the fp32 reference. A family whose backend is unavailable prints SKIP with the reason. Exit code 1 if
a check fails (the sanitizer's own report is separate: read its ERROR SUMMARY).
"""
from __future__ import annotations

import argparse
import sys

import torch

from ffpa_attn import (CuTeDSLBackend, explain, explain_kvcache, ffpa_attn_fwd, ffpa_attn_func, ffpa_attn_varlen_func,
                       ffpa_attn_with_kvcache)
from ffpa_attn.reference import attention, kvcache_append, kvcache_attention
from ffpa_attn.testing import TOL, make_kvcache, rel_err

SENTINEL = 7.0
SPLITKV_KERNELS = {"triton": "splitkv_fwd", "cutedsl": "splitkv_fwd_sm90"}
KVCACHE_ROUTES = {"decode": "decode", "append": "decode", "paged": "paged varlen", "gather": "gather+varlen"}


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


def _splitkv(backend: str, d: int, causal: bool, dtype: torch.dtype, device: str = "cuda") -> str:
    """The split-KV forward of ``backend``: 4 query rows (1 when causal: the packed CuTeDSL path needs every row to
    see the same keys) of 8 heads against 2 KV heads of 3001 keys (no split count divides it: a ragged last slice)."""
    nq = 1 if causal else 4
    q = torch.randn(2, 8, nq, d, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, 3001, d, device=device, dtype=dtype) for _ in range(2))
    plan = explain(q, k, v, is_causal=causal, enable_gqa=True, backend=backend).forward
    if plan.kernel != SPLITKV_KERNELS[backend]:
        return f"the planner chose {plan.backend}:{plan.spec}, not {SPLITKV_KERNELS[backend]}"
    out, lse = ffpa_attn_fwd(q, k, v, causal=causal, enable_gqa=True, backend=backend)
    _sync(device)
    ref, _ = attention(q, k, v, is_causal=causal)
    problems = [f"{n} non-finite" for n, t in (("out", out), ("lse", lse)) if not torch.isfinite(t).all()]
    if rel_err(out, ref) > TOL[dtype]:
        problems.append(f"out off the reference by {rel_err(out, ref):.2e}")
    return "; ".join(problems)


def _sentinel_outside(cache, lens: list[int], n_new: int) -> None:
    """Fill every slot of a paged cache that holds no key of a sequence (after the append) with the sentinel."""
    page = cache.page_size
    live = torch.zeros(cache.k_cache.shape[:2], dtype=torch.bool, device=cache.k_cache.device)
    table = cache.block_table.long()
    for b, n in enumerate(lens):
        pos = torch.arange(n + n_new, device=live.device)
        live[table[b, pos // page], pos % page] = True
    for t in (cache.k_cache, cache.v_cache):
        t[~live] = SENTINEL


def _kvcache(route: str, d: int, causal: bool, dtype: torch.dtype, device: str = "cuda") -> str:
    """``ffpa_attn_with_kvcache`` over a paged cache (pages of 16, spare pages) of 4 sequences of mixed lengths:
    ``decode`` 2 queries, ``append`` 3 new tokens written first, ``paged`` 80 new tokens (the chunk read in place),
    ``gather`` the same with a zero ``cache_leftpad`` (the packed route). The caches afterwards must equal the
    reference append's, the output the fp32 reference's."""
    lens, hq, hkv = [1, 77, 300, 129], 4, 2
    nq = {"decode": 2, "append": 3, "paged": 80, "gather": 80}[route]
    n_new = 0 if route == "decode" else nq
    cache = make_kvcache(lens, hkv, d, dtype, page_size=16, n_new=n_new, spare_blocks=3, device=device)
    _sentinel_outside(cache, lens, n_new)
    q = torch.randn(len(lens), nq, hq, d, device=device, dtype=dtype)
    k = v = None
    if n_new:
        k, v = (torch.randn(len(lens), n_new, hkv, d, device=device, dtype=dtype) for _ in range(2))
    kw = {"cache_seqlens": cache.cache_seqlens, "block_table": cache.block_table, "causal": causal}
    if route == "gather":
        kw["cache_leftpad"] = torch.zeros(len(lens), dtype=torch.int32, device=device)
    plan = explain_kvcache(q, cache.k_cache, cache.v_cache, k, v, **kw)
    if plan.route != KVCACHE_ROUTES[route]:
        return f"the planner chose the {plan.route} route, not {KVCACHE_ROUTES[route]}"
    ref, _ = kvcache_attention(q, cache.k_cache, cache.v_cache, k, v, **kw)
    want = (cache.k_cache.clone(), cache.v_cache.clone()) if k is None else \
        kvcache_append(cache.k_cache, cache.v_cache, k, v, cache.cache_seqlens, block_table=cache.block_table)
    out = ffpa_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k, v, **kw)
    _sync(device)
    problems = ["out non-finite"] if not torch.isfinite(out).all() else []
    if rel_err(out, ref) > TOL[dtype]:
        problems.append(f"out off the reference by {rel_err(out, ref):.2e} (a read outside the sequences?)")
    for name, got, exp in (("k_cache", cache.k_cache, want[0]), ("v_cache", cache.v_cache, want[1])):
        if not torch.equal(got, exp):
            problems.append(f"{name}: slots other than the appended ones changed")
    return "; ".join(problems)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# family -> (runner, its first argument: the backend, or the KV-cache route)
FAMILIES = {
    "triton-dense": (_dense, "triton"), "triton-varlen": (_varlen, "triton"), "triton-splitkv": (_splitkv, "triton"),
    "cute-dense": (_dense, "cutedsl"),
    # a named config: the planner refuses it (NotImplementedError) at D <= 512
    "cute-recompute": (_dense, CuTeDSLBackend(fwd_recompute=True)),
    "cute-varlen": (_varlen, "cutedsl"), "cute-splitkv": (_splitkv, "cutedsl"),
    "cuda-dense": (_dense, "cuda"),
    "kvcache-decode": (_kvcache, "decode"), "kvcache-append": (_kvcache, "append"),
    "kvcache-paged": (_kvcache, "paged"), "kvcache-gather": (_kvcache, "gather"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="all", help=f"comma-separated, of {', '.join(FAMILIES)}; or all")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    a = ap.parse_args(argv)
    fams = tuple(FAMILIES) if a.family == "all" else tuple(a.family.split(","))
    unknown = [f for f in fams if f not in FAMILIES]
    if unknown:
        ap.error(f"--family: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(FAMILIES)} or all")
    if not torch.cuda.is_available():
        print("memcheck: no CUDA GPU found", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    failed = 0
    for fam in fams:
        run, arg = FAMILIES[fam]
        for causal in (False, True):
            tag = f"{fam} D={a.d} causal={causal}"
            try:
                msg = run(arg, a.d, causal, dtype)
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

"""Per-call host cost of small attention calls: how long the host takes to issue one call when the GPU work is
too small to hide it (a GPU run; no CPU mode).

Each path runs ``--calls`` times back to back after a warm-up; printed per call: the launch loop's time (host) and
the time until the GPU finished (wall). When the two agree the calls are host-bound, and the host time is what a
model pays per layer at this size. Paths: the public entries with each backend named (varlen and dense, forward
and forward + backward) beside torch SDPA; ``--parts`` adds pieces of the CuTeDSL varlen forward (the planner,
the boundary op, the device-built work list, the kernel launch without the public entry).

    python bench/host_overhead.py
    python bench/host_overhead.py --lens 128,128,128,128,128,128,128,128 --d 512 --hq 8 --hkv 2 --parts
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

IMPLS = ("cutedsl", "triton")


def per_call_ms(fn: Callable[[], object], calls: int, warmup: int = 15) -> tuple[float, float]:
    """(host ms, wall ms) per call of ``fn`` over ``calls`` back-to-back calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return host / calls * 1e3, wall / calls * 1e3


def paths(lens: list[int], d: int, hq: int, hkv: int, causal: bool, impls: list[str],
          parts: bool) -> dict[str, Callable[[], object]]:
    """The timed calls by name; inputs ``[T, H, D]`` packed (varlen) and ``[1, H, T, D]`` (dense, one sequence of
    all the tokens), bf16."""
    import ffpa_attn

    dev, t = torch.device("cuda"), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    qd, kd, vd = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v))
    mx, gqa = max(lens), hq != hkv

    def varlen(backend: str, bwd: bool) -> Callable[[], object]:
        def call() -> None:
            o = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal, enable_gqa=gqa,
                                                backend=backend)
            if bwd:
                o.sum().backward()
        return call

    def dense(backend: str, bwd: bool) -> Callable[[], object]:
        def call() -> None:
            o = ffpa_attn.ffpa_attn_func(qd, kd, vd, is_causal=causal, enable_gqa=gqa, backend=backend)
            if bwd:
                o.sum().backward()
        return call

    out: dict[str, Callable[[], object]] = {}
    for bwd in (False, True):
        for kind, make in (("varlen", varlen), ("dense", dense)):
            for backend in impls:
                out[f"{kind} {'fwd+bwd' if bwd else 'fwd'} {backend}"] = make(backend, bwd)
    out["dense fwd torch sdpa"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal,
                                                                         enable_gqa=gqa)
    if parts:
        from ffpa_attn.cutedsl import api as cute_api
        from ffpa_attn.cutedsl.ranges import varlen_work_items
        from ffpa_attn.interface import _plan_varlen

        qn, kn, vn = q.detach(), k.detach(), v.detach()
        scale = d ** -0.5
        out["part: varlen fwd cutedsl, no grad"] = lambda: ffpa_attn.ffpa_attn_varlen_func(
            qn, kn, vn, cu, cu, mx, mx, causal=causal, enable_gqa=gqa, backend="cutedsl")
        out["part: plan (validate + boundary op)"] = lambda: _plan_varlen(
            qn, kn, vn, cu, cu, mx, mx, 0.0, None, causal, gqa, {"backend": "cutedsl"})
        out["part: boundary op"] = lambda: torch.ops.ffpa_attn.varlen_boundaries(cu, cu, t, t, mx, mx, causal)
        out["part: cute run_varlen_forward"] = lambda: cute_api.run_varlen_forward(qn, kn, vn, cu, cu, causal, scale)
        out["part: cute work list"] = lambda: varlen_work_items(cu, cu, t, 64, 64, causal)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="128,128,128,128,128,128,128,128", help="packed sequence lengths")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--impl", default=",".join(IMPLS), help=f"backends, comma-separated ({', '.join(IMPLS)})")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--parts", action="store_true", help="also time pieces of the CuTeDSL varlen forward")
    a = ap.parse_args(argv)
    impls = [x for x in a.impl.split(",") if x]
    bad = [x for x in impls if x not in IMPLS]
    if bad or not impls:
        ap.error(f"--impl: unknown backends {bad or impls}; choose from {', '.join(IMPLS)}")
    lens = [int(x) for x in a.lens.split(",") if x]
    if not lens or min(lens) < 1:
        ap.error("--lens: positive sequence lengths, comma-separated")
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{len(lens)} seqs {sum(lens)} tokens D={a.d} {a.hq}/{a.hkv} heads bf16 "
          f"{'non-causal' if a.non_causal else 'causal'}; per call over {a.calls} calls:")
    for name, fn in paths(lens, a.d, a.hq, a.hkv, not a.non_causal, impls, a.parts).items():
        try:
            host, wall = per_call_ms(fn, a.calls)
            print(f"  {name:<38} host {host:7.3f} ms  wall {wall:7.3f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"  {name:<38} n/a  {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-call host cost of small attention calls, beside torch SDPA's, and the CUDA-graph replay of each.

When the GPU work of a call is too small to hide the host's, the host time per call is what a model pays per layer
(or what a CUDA graph removes). One run prints, per path (dense / varlen, forward / forward + backward, each backend
named, and torch SDPA's dense call of the same shape beside them), microseconds per call:

* ``host``: the Python loop issuing ``--calls`` calls back to back, divided by the calls (the launch cost);
* ``wall``: until the GPU finished them (equal to ``host`` when the calls are host-bound);
* ``graph``: the same call replayed from a CUDA graph (GPU time per call, CUDA events; ``--no-graphs`` skips);
* ``x sdpa``: ``host`` over torch SDPA's ``host`` of the same direction.

Paths are measured interleaved (``--rounds`` rounds, each path once per round), so a drifting machine shifts all
of them alike; the least disturbed round counts (the minimum, as ``timeit`` reports: on a shared CPU the other
rounds measure the neighbours). Inputs: ``[T, H, D]`` packed for varlen and ``[1, H, T, D]`` dense (one
sequence of all the tokens), bf16; the backward is ``torch.autograd.grad`` with a fixed ``dout`` (no ``.grad``
accumulation, so eager and graph run the same work). ``--json PATH`` writes one JSON line per number in the format of
``bench/results/history.jsonl`` (append it there). ``--parts`` adds pieces of the CuTeDSL varlen forward.

``--cpu``: the public call on small CPU tensors (there the implicit plan ends in torch SDPA) against torch SDPA
itself, forward and forward + backward, implicit and ``backend="sdpa"``, interleaved in one process; the target is
at most 2x SDPA's time for each.

    python bench/host_overhead.py                                   # GPU: 8 x 128 tokens, D 512, 8/2 heads, causal
    python bench/host_overhead.py --impl cutedsl,triton --json /tmp/host.jsonl --parts
    python bench/host_overhead.py --cpu [--d 512 --lens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

IMPLS = ("cutedsl", "triton", "sdpa", "implicit")
SDPA = "torch-sdpa"


def timed(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(host us, wall us) per call of ``calls`` back-to-back calls of ``fn`` (after ``sync``)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    sync()
    wall = time.perf_counter() - t0
    return host / calls * 1e6, wall / calls * 1e6


def graph_us(fn: Callable[[], object], calls: int = 16) -> float:
    """GPU microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (no launch cost left)."""
    from ffpa_attn.bench.timing import graph_replay_ms

    return graph_replay_ms([fn], calls=calls) * 1e3


def measure(paths: dict[str, Callable[[], object]], calls: int, rounds: int, sync: Callable[[], None],
            warmup: int = 10) -> dict[str, tuple[float, float]]:
    """(host us, wall us) per call of each path in its least disturbed round (minimum), the paths interleaved over
    ``rounds`` rounds; a path that raises is reported as its exception."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    broken: dict[str, Exception] = {}
    for name, fn in paths.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:  # noqa: BLE001 - report and go on
            broken[name] = exc
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for name, fn in paths.items():
            if name not in broken:
                results[name].append(timed(fn, per_round, sync))
    out = {}
    for name in paths:
        if name in broken:
            out[name] = broken[name]
        else:
            out[name] = min(results[name])  # the round with the least host time, with its wall time
    return out


def _grad_call(fn: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...], dout: torch.Tensor):
    def call():
        return torch.autograd.grad(fn(), inputs, dout)
    return call


def gpu_paths(lens: list[int], d: int, hq: int, hkv: int, causal: bool, impls: list[str],
              parts: bool) -> dict[tuple[str, str, str], Callable[[], object]]:
    """The timed calls by (kind, direction, impl)."""
    import ffpa_attn

    dev, t = torch.device("cuda"), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    qd, kd, vd = (x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for x in (q, k, v))
    doutd = dout.transpose(0, 1).unsqueeze(0).contiguous()
    mx, gqa = max(lens), hq != hkv
    out: dict[tuple[str, str, str], Callable[[], object]] = {}
    for impl in impls:
        kw = {} if impl == "implicit" else {"backend": impl}

        def varlen(kw=kw):
            return ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal, enable_gqa=gqa, **kw)

        def dense(kw=kw):
            return ffpa_attn.ffpa_attn_func(qd, kd, vd, is_causal=causal, enable_gqa=gqa, **kw)

        out[("varlen", "fwd", impl)] = varlen
        out[("varlen", "fwd+bwd", impl)] = _grad_call(varlen, (q, k, v), dout)
        out[("dense", "fwd", impl)] = dense
        out[("dense", "fwd+bwd", impl)] = _grad_call(dense, (qd, kd, vd), doutd)

    def sdpa():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=gqa)

    out[("dense", "fwd", SDPA)] = sdpa
    out[("dense", "fwd+bwd", SDPA)] = _grad_call(sdpa, (qd, kd, vd), doutd)
    if parts:
        from ffpa_attn.cutedsl import api as cute_api
        from ffpa_attn.cutedsl.ranges import varlen_work_items, work_items
        from ffpa_attn.interface import _plan_varlen

        qn, kn, vn = q.detach(), k.detach(), v.detach()
        scale = d ** -0.5
        out[("part", "fwd", "plan (validate, boundaries)")] = lambda: _plan_varlen(
            qn, kn, vn, cu, cu, mx, mx, 0.0, None, causal, gqa, {"backend": "cutedsl"}, False)
        out[("part", "fwd", "cute run_varlen_forward")] = lambda: cute_api.run_varlen_forward(qn, kn, vn, cu, cu,
                                                                                             causal, scale)
        out[("part", "fwd", "cute work list, kept")] = lambda: work_items(cu, cu, t, 64, 64, causal)
        out[("part", "fwd", "cute work list, built")] = lambda: varlen_work_items(cu, cu, t, 64, 64, causal)
    return out


def cpu_paths(lens: list[int], d: int, hq: int, hkv: int, causal: bool) -> dict[tuple[str, str, str], Callable]:
    """The public dense call on CPU tensors (implicit and ``backend="sdpa"``) and torch SDPA, fwd and fwd+bwd."""
    import ffpa_attn

    n = sum(lens)
    q, k, v = (torch.randn(1, h, n, d, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, n, d, dtype=torch.bfloat16)
    gqa = hq != hkv
    calls = {
        SDPA: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
        "implicit": lambda: ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa),
        "sdpa": lambda: ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa, backend="sdpa"),
    }
    out: dict[tuple[str, str, str], Callable] = {}
    for direction in ("fwd", "fwd+bwd"):
        for impl, fn in calls.items():
            out[("dense", direction, impl)] = fn if direction == "fwd" else _grad_call(fn, (q, k, v), dout)
    return out


def history_rows(results: dict, graphs: dict, case: str, device: str, command: str) -> list[dict]:
    """One row per number in the format of bench/results/history.jsonl (metrics host_us, wall_us, graph_us)."""
    from ffpa_attn.bench.env import git_commit, now_utc

    commit, dirty = git_commit()
    head = {"date": now_utc(), "commit": commit + ("-dirty" if dirty else ""), "device": device, "command": command}
    rows = []
    for (kind, direction, impl), res in results.items():
        if isinstance(res, Exception):
            continue
        values = {"host_us": res[0], "wall_us": res[1]}
        if isinstance(graphs.get((kind, direction, impl)), float):
            values["graph_us"] = graphs[(kind, direction, impl)]
        for metric, value in values.items():
            rows.append({**head, "case": f"{kind} {case}", "impl": impl, "direction": direction, "metric": metric,
                         "value": float(f"{value:.6g}")})
    return rows


def report(results: dict, graphs: dict) -> None:
    base = {direction: res[0] for (kind, direction, impl), res in results.items()
            if impl == SDPA and not isinstance(res, Exception)}
    print(f"  {'path':<34} {'host us':>9} {'wall us':>9} {'graph us':>9} {'x sdpa':>7}")
    for (kind, direction, impl), res in results.items():
        name = f"{kind} {direction} {impl}"
        if isinstance(res, Exception):
            print(f"  {name:<34} n/a  {type(res).__name__}: {str(res)[:140]}", flush=True)
            continue
        g = graphs.get((kind, direction, impl))
        gtxt = f"{g:9.1f}" if isinstance(g, float) else f"{'-' if g is None else 'n/a':>9}"
        ratio = f"{res[0] / base[direction]:7.2f}" if direction in base and kind != "part" else f"{'':>7}"
        print(f"  {name:<34} {res[0]:9.1f} {res[1]:9.1f} {gtxt} {ratio}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default=None, help="packed sequence lengths (GPU default 8 x 128; --cpu default 128)")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)} (GPU mode)")
    ap.add_argument("--calls", type=int, default=400, help="calls per path, over all rounds")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay column")
    ap.add_argument("--parts", action="store_true", help="also time pieces of the CuTeDSL varlen forward")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors: the public call against torch SDPA")
    ap.add_argument("--json", default=None, metavar="PATH", help="write history.jsonl rows to PATH")
    a = ap.parse_args(argv)
    causal = not a.non_causal
    lens = [int(x) for x in (a.lens or ("128" if a.cpu else ",".join(["128"] * 8))).split(",") if x]
    if not lens or min(lens) < 1:
        ap.error("--lens: positive sequence lengths, comma-separated")
    command = "python bench/host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.cpu:
        import ffpa_attn

        probe = torch.empty(1, a.hq, sum(lens), a.d, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(1, a.hkv, sum(lens), a.d, dtype=torch.bfloat16)
        plan = ffpa_attn.explain(probe, kv, kv, is_causal=causal, enable_gqa=a.hq != a.hkv)
        print(f"implicit plan on CPU{' (TRITON_INTERPRET is set)' if os.environ.get('TRITON_INTERPRET') else ''}: "
              f"forward {plan.forward}; backward {plan.backward}")
        results = measure(cpu_paths(lens, a.d, a.hq, a.hkv, causal), a.calls, a.rounds, lambda: None)
        graphs: dict = {}
        device = "cpu"
        case = f"B1 H{a.hq}/{a.hkv} N{sum(lens)} D{a.d} bf16 {'causal' if causal else 'full'} cpu"
    else:
        impls = [x for x in a.impl.split(",") if x]
        bad = [x for x in impls if x not in IMPLS]
        if bad or not impls:
            ap.error(f"--impl: unknown {bad or impls}; choose from {', '.join(IMPLS)}")
        if not torch.cuda.is_available():
            print("host_overhead.py needs a CUDA GPU (or --cpu)", file=sys.stderr)
            return 2
        paths = gpu_paths(lens, a.d, a.hq, a.hkv, causal, impls, a.parts)
        results = measure(paths, a.calls, a.rounds, torch.cuda.synchronize)
        graphs = {}
        if not a.no_graphs:
            for key, fn in paths.items():
                if key[0] == "part" or isinstance(results[key], Exception):
                    continue
                try:
                    graphs[key] = graph_us(fn)
                except Exception as exc:  # noqa: BLE001 - a path that does not capture is reported, not fatal
                    graphs[key] = exc
                    print(f"  (graph of {' '.join(key)}: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
        device = torch.cuda.get_device_name()
        case = f"{len(lens)}x{round(sum(lens) / len(lens))} H{a.hq}/{a.hkv} D{a.d} bf16 {'causal' if causal else 'full'}"
    print(f"{device}: {case}; per call, best of {a.rounds} interleaved rounds ({a.calls} calls per path):")
    report(results, graphs)
    if a.json:
        rows = history_rows(results, graphs, case, device, command)
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {len(rows)} rows to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

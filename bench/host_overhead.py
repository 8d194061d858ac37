"""Per-call host cost of small attention calls, beside torch SDPA's, and the CUDA-graph replay of each.

When the GPU work of a call is too small to hide the host's, the host time per call is what a model pays per layer
(or what a CUDA graph removes). One run prints, per path (dense / varlen, forward / forward + backward, each backend
named, the implicit plan, a decode step, and torch SDPA's calls beside them), microseconds per call:

* ``host``: the Python loop issuing ``--calls`` calls back to back, divided by the calls (the launch cost);
* ``wall``: until the GPU finished them (equal to ``host`` when the calls are host-bound);
* ``graph``: the same call replayed from a CUDA graph (GPU time per call, CUDA events; ``--no-graphs`` skips);
* ``x sdpa``: ``host`` over torch SDPA's ``host`` of the same kind and direction (same shape);
* ``x tiny``: ``host`` over the host time of torch SDPA at a tiny shape (``[1, Hq, 16, D]``, host-bound), the
  yardstick of the targets.

Then each target with its measured value: dense forward <= 3x the tiny torch SDPA forward; dense forward + backward
<= torch SDPA's forward + backward (same shape); varlen forward <= 60 us; decode step <= 60 us with the value checks
on. The decode step is ``ffpa_attn_with_kvcache`` (B=1, ``--hq`` / ``--hkv`` heads, 256 cached keys in pages of 16,
causal) with its lengths marked changed before every call (``increment_version``, as a decode loop's in-place
advance does), so the value checks read them each call; once more with ``check_values=False``; beside torch SDPA of
the one query row over the same keys.

Paths are measured interleaved (``--rounds`` rounds, each path once per round), so a drifting machine shifts all
of them alike; the least disturbed round counts (the minimum, as ``timeit`` reports: on a shared CPU the other
rounds measure the neighbours). Inputs: ``[T, H, D]`` packed for varlen and ``[1, H, T, D]`` dense (one
sequence of all the tokens), bf16; the backward is ``torch.autograd.grad`` with a fixed ``dout`` (no ``.grad``
accumulation, so eager and graph run the same work). ``--json PATH`` writes one JSON line per number in the format of
``bench/results/history.jsonl`` (append it there). ``--parts`` adds pieces: the plans (memo hits), the CuTeDSL
varlen and dense forwards' launch functions and work lists, and the decode step's value checks and kernel call.

``--cpu``: the public call on tiny CPU tensors (default ``[1, 8, 4, 512]`` queries, 2 KV heads; there the implicit
plan ends in torch SDPA) against torch SDPA itself, forward and forward + backward, implicit and ``backend="sdpa"``,
interleaved in one process, on one intra-op thread; the target is at most 2x SDPA's time for each.

``--cpu --parts``: the host path part by part without a GPU: the Triton backend's plans (``TRITON_INTERPRET=1`` is
set) with every kernel replaced by a stand-in that only allocates its outputs, so what is timed is validation, the
plan memo, the value checks, the autograd node and the allocations of the dense forward, the varlen forward and the
decode step (everything but the launch), and beside them the same call through ``torch.ops.ffpa_attn`` (what a
traced call runs).

    python bench/host_overhead.py                                   # GPU: 8 x 128 tokens, D 512, 8/2 heads, causal
    python bench/host_overhead.py --impl cutedsl,triton --json /tmp/host.jsonl --parts
    python bench/host_overhead.py --cpu [--d 512 --lens 4]
    python bench/host_overhead.py --cpu --parts
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

IMPLS = ("cutedsl", "triton", "sdpa", "implicit")
SDPA = "torch-sdpa"
SDPA_TINY = "torch-sdpa tiny"  # [1, Hq, TINY_TOKENS, D]: torch SDPA's host cost, the GPU work negligible
TINY_TOKENS = 16
UNCHECKED = "implicit check_values=False"
DECODE_CACHED, DECODE_PAGE = 256, 16

# (kind, direction) -> (limit, the path it divides by; None: the limit is in microseconds)
GPU_TARGETS = {("dense", "fwd"): (3.0, ("dense", "fwd", SDPA_TINY)),
               ("dense", "fwd+bwd"): (1.0, ("dense", "fwd+bwd", SDPA)),
               ("varlen", "fwd"): (60.0, None),
               ("decode", "fwd"): (60.0, None)}
CPU_TARGETS = {("dense", "fwd"): (2.0, ("dense", "fwd", SDPA)),
               ("dense", "fwd+bwd"): (2.0, ("dense", "fwd+bwd", SDPA))}


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
    qt, kt, vt = (x[:, :, :TINY_TOKENS].detach().clone().requires_grad_() for x in (qd, kd, vd))
    doutt = doutd[:, :, :TINY_TOKENS].clone()

    def sdpa_tiny():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

    out[("dense", "fwd", SDPA_TINY)] = sdpa_tiny
    out[("dense", "fwd+bwd", SDPA_TINY)] = _grad_call(sdpa_tiny, (qt, kt, vt), doutt)
    x = decode_inputs(dev, d, hq, hkv) if "implicit" in impls else None
    if x is not None:
        out.update(decode_paths(x))
    if parts:
        from ffpa_attn import ops
        from ffpa_attn.contract import check_kvcache_values
        from ffpa_attn.cutedsl import api as cute_api
        from ffpa_attn.cutedsl.ranges import varlen_work_items, work_items
        from ffpa_attn.interface import _plan_dense, _plan_kvcache, _plan_varlen

        qn, kn, vn = q.detach(), k.detach(), v.detach()
        qdn, kdn, vdn = qd.detach(), kd.detach(), vd.detach()
        scale = d ** -0.5
        out[("part", "fwd", "plan (validate, boundaries)")] = lambda: _plan_varlen(
            qn, kn, vn, cu, cu, mx, mx, 0.0, None, causal, gqa, {"backend": "cutedsl"}, False)
        out[("part", "fwd", "cute run_varlen_forward")] = lambda: cute_api.run_varlen_forward(qn, kn, vn, cu, cu,
                                                                                             causal, scale)
        out[("part", "fwd", "cute work list, kept")] = lambda: work_items(cu, cu, t, 64, 64, causal)
        out[("part", "fwd", "cute work list, built")] = lambda: varlen_work_items(cu, cu, t, 64, 64, causal)
        out[("part", "fwd", "dense plan (validate, memo hit)")] = lambda: _plan_dense(
            qdn, kdn, vdn, None, 0.0, causal, None, gqa, {"backend": "cutedsl"}, False)
        out[("part", "fwd", "cute run_forward (dense)")] = lambda: cute_api.run_forward(qdn, kdn, vdn, causal, scale)
        if x is not None:
            plan_args = (x["q"], x["k_cache"], x["v_cache"], None, None, None, None, x["cache_seqlens"], None, None,
                         x["block_table"], None, True, (-1, -1), 0.0, True, None, 0, False, {})
            dprob, dpl, _ = _plan_kvcache(*plan_args)
            out[("part", "fwd", "decode plan (validate, memo hit)")] = lambda: _plan_kvcache(*plan_args)
            out[("part", "fwd", "decode value checks (copy to host, sync)")] = lambda: check_kvcache_values(
                x["k_cache"], x["cache_seqlens"], x["block_table"], None, None, 1, 0)
            out[("part", "fwd", "decode kernel call (run_kvcache_attn)")] = lambda: ops.run_kvcache_attn(
                x["q"], x["k_cache"], x["v_cache"], None, None, x["cache_seqlens"], x["block_table"], None, None,
                True, dprob.scale, 0, dpl)
    return out


def decode_inputs(dev: torch.device, d: int, hq: int, hkv: int) -> dict[str, torch.Tensor]:
    """A decode step's tensors: B=1, one query row, :data:`DECODE_CACHED` keys in pages of :data:`DECODE_PAGE`."""
    blocks = DECODE_CACHED // DECODE_PAGE + 1
    k_cache, v_cache = (torch.randn(blocks, DECODE_PAGE, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    return {"q": torch.randn(1, 1, hq, d, device=dev, dtype=torch.bfloat16), "k_cache": k_cache, "v_cache": v_cache,
            "cache_seqlens": torch.tensor([DECODE_CACHED], dtype=torch.int32, device=dev),
            "block_table": torch.arange(blocks, dtype=torch.int32, device=dev).unsqueeze(0)}


def decode_paths(x: dict[str, torch.Tensor]) -> dict[tuple[str, str, str], Callable[[], object]]:
    """The decode step of :func:`decode_inputs`: the public call with its lengths marked changed each call (value
    checks on) and with ``check_values=False``, and torch SDPA over the same keys."""
    import ffpa_attn

    def step(**kw):
        torch.autograd.graph.increment_version(x["cache_seqlens"])  # new lengths, as a decode loop's advance
        return ffpa_attn.ffpa_attn_with_kvcache(causal=True, **x, **kw)

    _, page, hkv, d = x["k_cache"].shape
    kd, vd = (c[:DECODE_CACHED // page].reshape(1, DECODE_CACHED, hkv, d).transpose(1, 2).contiguous()
              for c in (x["k_cache"], x["v_cache"]))
    qs = x["q"].transpose(1, 2)
    gqa = qs.shape[1] != hkv
    return {("decode", "fwd", "implicit"): step,
            ("decode", "fwd", UNCHECKED): lambda: step(check_values=False),
            ("decode", "fwd", SDPA): lambda: F.scaled_dot_product_attention(qs, kd, vd, enable_gqa=gqa)}


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


class StandIn:
    """A kernel module whose kernels only allocate their outputs (the protocol of :mod:`ffpa_attn.kernel_module`):
    timing a public call with it times the host path without the launch."""

    @staticmethod
    def dense_forward(q, k, v, **kw):
        b, h, n, _ = q.shape
        return q.new_empty(b, h, n, v.shape[-1]), q.new_empty(b, h, n, dtype=torch.float32)

    @staticmethod
    def dense_backward(dout, q, k, v, out, lse, **kw):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    @staticmethod
    def varlen_forward(q, k, v, *args, **kw):
        t, h, _ = q.shape
        return q.new_empty(t, h, v.shape[-1]), q.new_empty(h, t, dtype=torch.float32)

    @staticmethod
    def varlen_backward(dout, q, k, v, *args, **kw):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @staticmethod
    def kvcache_forward(q, *args, **kw):
        b, n, h, _ = q.shape
        return q.new_empty(q.shape), q.new_empty(b, h, n, dtype=torch.float32)


@contextlib.contextmanager
def stand_in_kernels():
    """Every kernel module replaced by :class:`StandIn`, and the Triton interpreter's flag set (the Triton backend
    plans for CPU tensors; no kernel reaches the interpreter), for the duration of the block."""
    from ffpa_attn import ops

    real, flag = ops.kernel_module, os.environ.get("TRITON_INTERPRET")
    ops.kernel_module = lambda name: StandIn
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        ops.kernel_module = real
        if flag is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = flag


def cpu_parts(d: int, hq: int, hkv: int, causal: bool) -> dict[tuple[str, str, str], Callable]:
    """The host path part by part on CPU tensors: the Triton backend's plans, to be timed inside
    :func:`stand_in_kernels`. Dense: ``[1, hq, 16, d]``; varlen: two sequences of 8; decode: as
    :func:`decode_paths`. Each part is the function the public call runs for it, on the call's own arguments; torch
    SDPA is not beside them (on CPU its bf16 kernels are compute-bound even at these shapes)."""
    import ffpa_attn
    from ffpa_attn import interface, ops
    from ffpa_attn.contract import check_kvcache_values

    kw, gqa, n = {"backend": "triton"}, hq != hkv, TINY_TOKENS
    q, k, v = (torch.randn(1, h, n, d, dtype=torch.bfloat16, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(1, hq, n, d, dtype=torch.bfloat16)
    prob, pl, _ = interface._plan_dense(q, k, v, None, 0.0, causal, None, gqa, kw, True)
    fa = ffpa_attn.ffpa_attn_func
    out: dict[tuple[str, str, str], Callable] = {
        ("part", "fwd", "dense: public call"): lambda: fa(q, k, v, is_causal=causal, enable_gqa=gqa, **kw),
        ("part", "fwd", "dense: autocast cast, grad question"):
            lambda: (ops.autocast_inputs(q, k, v), interface._needs_backward(q, k, v, None)),
        ("part", "fwd", "dense: validation + plan (memo hit)"):
            lambda: interface._plan_dense(q, k, v, None, 0.0, causal, None, gqa, kw, True),
        ("part", "fwd", "dense: autograd node + kernel call"):
            lambda: ops.run_attn(q, k, v, None, 0.0, None, causal, prob.scale, pl.forward, pl.backward),
        ("part", "fwd", "dense: stand-in kernel (2 allocations)"): lambda: StandIn.dense_forward(q, k, v),
        ("part", "fwd", "dense: through torch.ops (traced path)"):
            lambda: torch.ops.ffpa_attn.attn(q, k, v, None, 0.0, None, causal, prob.scale, *pl.forward.op_args(),
                                             *pl.backward.op_args()),
        ("part", "fwd+bwd", "dense: public call"):
            _grad_call(lambda: fa(q, k, v, is_causal=causal, enable_gqa=gqa, **kw), (q, k, v), dout),
    }
    qv, kv, vv = (torch.randn(2 * 8, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    _, vpl, _, _ = interface._plan_varlen(qv, kv, vv, cu, cu, 8, 8, 0.0, None, causal, gqa, kw, False)
    out[("part", "fwd", "varlen: public call")] = lambda: ffpa_attn.ffpa_attn_varlen_func(
        qv, kv, vv, cu, cu, 8, 8, causal=causal, enable_gqa=gqa, **kw)
    out[("part", "fwd", "varlen: validation + plan + boundaries")] = lambda: interface._plan_varlen(
        qv, kv, vv, cu, cu, 8, 8, 0.0, None, causal, gqa, kw, False)
    out[("part", "fwd", "varlen: kernel call")] = lambda: ops.run_varlen_attn(
        qv, kv, vv, cu, cu, 8, 8, 0.0, None, causal, prob.scale, vpl.forward, vpl.backward)
    x = decode_inputs(torch.device("cpu"), d, hq, hkv)
    decode = decode_paths(x)
    out[("part", "fwd", "decode: public call, lengths re-read")] = decode[("decode", "fwd", "implicit")]
    out[("part", "fwd", "decode: public call, check_values=False")] = decode[("decode", "fwd", UNCHECKED)]
    qd, kc, vc, seq, table = x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"], x["block_table"]
    plan_args = (qd, kc, vc, None, None, None, None, seq, None, None, table, None, True, (-1, -1), 0.0, True, None, 0,
                 False, {})
    dprob, dpl, _ = interface._plan_kvcache(*plan_args)
    out[("part", "fwd", "decode: validation + plan (memo hit)")] = lambda: interface._plan_kvcache(*plan_args)
    out[("part", "fwd", "decode: value checks (host copy + checks)")] = lambda: check_kvcache_values(
        kc, seq, table, None, None, 1, 0)
    out[("part", "fwd", "decode: kernel call")] = lambda: ops.run_kvcache_attn(
        qd, kc, vc, None, None, seq, table, None, None, True, dprob.scale, 0, dpl)
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


def _host(res: object) -> float | None:
    return None if isinstance(res, Exception) or res is None else res[0]


def report(results: dict, graphs: dict) -> None:
    base = {(kind, direction): res[0] for (kind, direction, impl), res in results.items()
            if impl == SDPA and _host(res) is not None}
    tiny = {direction: _host(results.get(("dense", direction, SDPA_TINY))) for direction in ("fwd", "fwd+bwd")}
    print(f"  {'path':<50} {'host us':>9} {'wall us':>9} {'graph us':>9} {'x sdpa':>7} {'x tiny':>7}")
    for (kind, direction, impl), res in results.items():
        name = f"{kind} {direction} {impl}"
        if isinstance(res, Exception):
            print(f"  {name:<50} n/a  {type(res).__name__}: {str(res)[:140]}", flush=True)
            continue
        g = graphs.get((kind, direction, impl))
        gtxt = f"{g:9.1f}" if isinstance(g, float) else f"{'-' if g is None else 'n/a':>9}"
        ratio = f"{res[0] / base[(kind, direction)]:7.2f}" if (kind, direction) in base and kind != "part" \
            else f"{'':>7}"
        small = f"{res[0] / tiny[direction]:7.2f}" if tiny.get(direction) and kind == "dense" else f"{'':>7}"
        print(f"  {name:<50} {res[0]:9.1f} {res[1]:9.1f} {gtxt} {ratio} {small}", flush=True)


def target_lines(results: dict, targets: dict) -> list[str]:
    """One line per timed path that a target covers: the measured value against its limit."""
    lines = []
    for (kind, direction, impl), res in results.items():
        if (kind, direction) not in targets or impl.startswith(SDPA) or _host(res) is None:
            continue
        limit, against = targets[(kind, direction)]
        if against is None:
            value, text = res[0], f"{res[0]:.1f} us (target <= {limit:g} us)"
        else:
            ref = _host(results.get(against))
            if ref is None:
                continue
            value = res[0] / ref
            text = f"{value:.2f}x {' '.join(against)} (target <= {limit:g}x)"
        lines.append(f"  {kind} {direction} {impl}: {text} {'met' if value <= limit else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default=None, help="packed sequence lengths (GPU default 8 x 128; --cpu default 4)")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--impl", default=",".join(IMPLS), help=f"comma-separated, of {', '.join(IMPLS)} (GPU mode)")
    ap.add_argument("--calls", type=int, default=400, help="calls per path, over all rounds")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay column")
    ap.add_argument("--parts", action="store_true",
                    help="GPU: also time pieces of the CuTeDSL varlen forward; --cpu: the host path part by part")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors: the public call against torch SDPA")
    ap.add_argument("--json", default=None, metavar="PATH", help="write history.jsonl rows to PATH")
    a = ap.parse_args(argv)
    causal = not a.non_causal
    lens = [int(x) for x in (a.lens or ("4" if a.cpu else ",".join(["128"] * 8))).split(",") if x]
    if not lens or min(lens) < 1:
        ap.error("--lens: positive sequence lengths, comma-separated")
    command = "python bench/host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    graphs: dict = {}
    if a.cpu and a.parts:
        print("the host path on CPU, part by part: Triton plans, kernels replaced by stand-ins that allocate outputs")
        with stand_in_kernels():
            results = measure(cpu_parts(a.d, a.hq, a.hkv, causal), a.calls, a.rounds, lambda: None)
        targets: dict = {}
        device = "cpu"
        case = f"parts H{a.hq}/{a.hkv} D{a.d} bf16 {'causal' if causal else 'full'} cpu"
    elif a.cpu:
        import ffpa_attn

        # one intra-op thread: the host cost of a call, not the thread pool's wake-ups (on a shared CPU those
        # dominate a tiny bf16 SDPA and vary by several times between rounds)
        torch.set_num_threads(1)

        probe = torch.empty(1, a.hq, sum(lens), a.d, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(1, a.hkv, sum(lens), a.d, dtype=torch.bfloat16)
        plan = ffpa_attn.explain(probe, kv, kv, is_causal=causal, enable_gqa=a.hq != a.hkv)
        print(f"implicit plan on CPU{' (TRITON_INTERPRET is set)' if os.environ.get('TRITON_INTERPRET') else ''}: "
              f"forward {plan.forward}; backward {plan.backward}")
        results = measure(cpu_paths(lens, a.d, a.hq, a.hkv, causal), a.calls, a.rounds, lambda: None)
        targets = CPU_TARGETS
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
        if not a.no_graphs:
            for key, fn in paths.items():
                if key[0] == "part" or isinstance(results[key], Exception):
                    continue
                try:
                    graphs[key] = graph_us(fn)
                except Exception as exc:  # noqa: BLE001 - a path that does not capture is reported, not fatal
                    graphs[key] = exc
                    print(f"  (graph of {' '.join(key)}: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
        targets = GPU_TARGETS
        device = torch.cuda.get_device_name()
        case = f"{len(lens)}x{round(sum(lens) / len(lens))} H{a.hq}/{a.hkv} D{a.d} bf16 {'causal' if causal else 'full'}"
    print(f"{device}: {case}; per call, best of {a.rounds} interleaved rounds ({a.calls} calls per path):")
    report(results, graphs)
    lines = target_lines(results, targets)
    if lines:
        print("targets:")
        print("\n".join(lines))
    if a.json:
        rows = history_rows(results, graphs, case, device, command)
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"wrote {len(rows)} rows to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

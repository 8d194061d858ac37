"""Ring attention on GPUs (NCCL): correctness against the fp32 reference, then timings, in one run.

    torchrun --nproc-per-node=N tests/gpu/ring_gpu.py            # N GPUs of one host (N=1 works too)
    python tests/gpu/ring_gpu.py                                  # world size 1 without torchrun
    torchrun --nproc-per-node=2 tests/gpu/ring_gpu.py --cpu       # CPU/gloo smoke test of this script

1. Correctness: dense and varlen, zigzag and contiguous, causal and not, GQA, bf16/fp16, D in {384, 512,
   1024}. Every rank builds the same global inputs (same seed), runs the ring on its shard (forward and
   backward, loss on out and sometimes lse); rank 0 gathers out/lse/dq/dk/dv and compares them with the
   fp32 reference (``ffpa_attn.reference``, autograd) on the global sequence. Pass: relative error within
   the dtype tolerance or within 2x the error of single-GPU attention (``ffpa_attn_fwd``, same backend)
   on the same global inputs.
2. Timing (zigzag, causal and not; default B=1, H=8, N_local=8192, D=512): the ring's forward and
   forward+backward, one step's compute alone (diagonal, zigzag off-diagonal half block, full block) and
   one ring hop's transfer alone (K/V in the forward; K/V plus the fp32 dK/dV in the backward). With
   hidden communication the ring takes about the sum of its steps' compute ("sum steps").

NCCL_NVLS_ENABLE is forced to 0 (no NVLink multicast). Prints one table per section on rank 0; exits 1 if a
correctness case fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ["NCCL_NVLS_ENABLE"] = "0"  # must be set before NCCL initializes

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ffpa_attn import TritonBackend, explain, ffpa_attn_fwd, ffpa_attn_varlen_fwd  # noqa: E402
from ffpa_attn.distributed import (  # noqa: E402
    gather,
    gather_varlen,
    ring_attn_func,
    ring_attn_varlen_func,
    shard,
    shard_varlen,
)
from ffpa_attn.distributed.comm import RingComm  # noqa: E402
from ffpa_attn.testing import TOL, cu_seqlens, reference_fwd_bwd, reference_varlen_fwd_bwd, rel_err  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16


def _setup(cpu: bool) -> torch.device:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if cpu:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(1)
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=300))
    return dev


def _cases(world: int, cpu: bool) -> list[dict]:
    """Correctness cases; local lengths fixed so the per-rank work is the same for every world size."""
    w2 = 2 * world
    if cpu:  # tiny shapes for the script's own CPU smoke test
        return [dict(name="cpu_dense_zigzag_causal_gqa", kind="dense", layout="zigzag", causal=True, b=1, hq=2,
                     hkv=1, n_local=16, d=320, dtype=BF16, lse_grad=True),
                dict(name="cpu_varlen_contig_causal", kind="varlen", layout="contiguous", causal=True, hq=2, hkv=2,
                     seqlens=_split(16 * world, [5, 1, 23]), d=320, dtype=BF16)]
    return [
        dict(name="dense zigzag causal", kind="dense", layout="zigzag", causal=True, b=1, hq=4, hkv=4, n_local=1024,
             d=512, dtype=BF16),
        dict(name="dense zigzag causal gqa lse", kind="dense", layout="zigzag", causal=True, b=1, hq=8, hkv=2,
             n_local=1024, d=512, dtype=BF16, lse_grad=True),
        dict(name="dense contig causal fp16 d384", kind="dense", layout="contiguous", causal=True, b=1, hq=4, hkv=4,
             n_local=1024, d=384, dtype=FP16),
        dict(name="dense zigzag full mqa d1024", kind="dense", layout="zigzag", causal=False, b=1, hq=4, hkv=1,
             n_local=512, d=1024, dtype=BF16),
        dict(name="dense contig full b2 n768", kind="dense", layout="contiguous", causal=False, b=2, hq=2, hkv=2,
             n_local=768, d=512, dtype=BF16),
        dict(name="varlen zigzag causal gqa", kind="varlen", layout="zigzag", causal=True, hq=8, hkv=2,
             seqlens=[w2 * 100, w2 * 3, 0, w2 * 260, w2 * 149], d=512, dtype=BF16),
        dict(name="varlen contig causal", kind="varlen", layout="contiguous", causal=True, hq=4, hkv=4,
             seqlens=_split(1024 * world, [37, 1000, 1, 513, 250]), d=512, dtype=BF16, lse_grad=True),
        dict(name="varlen contig full gqa", kind="varlen", layout="contiguous", causal=False, hq=4, hkv=2,
             seqlens=_split(1024 * world, [700, 64, 999]), d=512, dtype=BF16),
    ]


def _split(total: int, pattern: list[int]) -> list[int]:
    """Sequence lengths cycling through ``pattern`` and summing to ``total`` (sequences cross rank borders)."""
    lens, i = [], 0
    while sum(lens) < total:
        lens.append(min(pattern[i % len(pattern)], total - sum(lens)))
        i += 1
    return lens


def _run_case(case: dict, rank: int, world: int, dev: torch.device, seed: int, backend: dict) -> dict | None:
    """Ring forward + backward on this rank's shard; on rank 0 the errors vs the reference (else None)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    dt, layout, causal = case["dtype"], case["layout"], case["causal"]
    gqa = case["hq"] != case["hkv"]
    if case["kind"] == "dense":
        b, n = case["b"], case["n_local"] * world
        shape = lambda h: (b, h, n, case["d"])  # noqa: E731
        sh = lambda t, dim=2: shard(t, rank, world, layout, dim)  # noqa: E731
        gat = lambda t, dim=2: gather(t, layout=layout, dim=dim)  # noqa: E731
        lse_shape, lse_dim = (b, case["hq"], n), 2
    else:
        cu = cu_seqlens(case["seqlens"], device=dev)
        n = int(cu[-1])
        shape = lambda h: (n, h, case["d"])  # noqa: E731
        sh = lambda t, dim=0: shard_varlen(t, cu, rank, world, layout, dim)  # noqa: E731
        gat = lambda t, dim=0: gather_varlen(t, cu, layout=layout, dim=dim)  # noqa: E731
        lse_shape, lse_dim = (case["hq"], n), 1
    q = torch.randn(shape(case["hq"]), generator=gen, device=dev).to(dt)
    k = torch.randn(shape(case["hkv"]), generator=gen, device=dev).to(dt)
    v = torch.randn(shape(case["hkv"]), generator=gen, device=dev).to(dt)
    g_out = torch.randn(shape(case["hq"]), generator=gen, device=dev)
    g_lse = torch.randn(lse_shape, generator=gen, device=dev) if case.get("lse_grad") else None

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    if case["kind"] == "dense":
        out_l, lse_l = ring_attn_func(ql, kl, vl, causal=causal, enable_gqa=gqa, layout=layout, return_lse=True,
                                      **backend)
    else:
        out_l, lse_l = ring_attn_varlen_func(ql, kl, vl, cu, causal=causal, enable_gqa=gqa, layout=layout,
                                             return_lse=True, **backend)
    loss = (out_l.float() * sh(g_out)).sum()
    if g_lse is not None:
        loss = loss + (lse_l * sh(g_lse, lse_dim)).sum()
    loss.backward()
    got = {"out": gat(out_l.detach()), "lse": gat(lse_l.detach(), lse_dim), "dq": gat(ql.grad), "dk": gat(kl.grad),
           "dv": gat(vl.grad)}
    if rank != 0:
        return None

    def losses(o, lse):
        return (o.float() * g_out).sum() + (0 if g_lse is None else (lse.float() * g_lse).sum())

    # fp32 reference and single-GPU attention (same backend) on the global sequence
    if case["kind"] == "dense":
        ref = reference_fwd_bwd(q, k, v, g_out, causal=causal, dlse=g_lse)._asdict()
    else:
        ref = reference_varlen_fwd_bwd(q, k, v, cu, cu, g_out, causal=causal, dlse=g_lse)._asdict()
    sp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if case["kind"] == "dense":
        bo, bl = ffpa_attn_fwd(*sp, causal=causal, enable_gqa=gqa, **backend)
    else:
        mx = max(case["seqlens"])
        bo, bl = ffpa_attn_varlen_fwd(*sp, cu, None, mx, mx, causal=causal, enable_gqa=gqa, **backend)
    losses(bo, bl).backward()
    base = {"out": bo, "lse": bl, "dq": sp[0].grad, "dk": sp[1].grad, "dv": sp[2].grad}
    res = {}
    for key in got:
        tol = 1e-5 if key == "lse" else TOL[dt]
        err, berr = rel_err(got[key], ref[key]), rel_err(base[key], ref[key])
        res[key] = (err, berr, err <= max(tol, 2 * berr))
    return res


def _bench(fn, dev: torch.device, iters: int) -> float:
    """Median-free simple timing: ms per call, the max over ranks, after one untimed warm-up call."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    t0 = time.perf_counter()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(dev)
        ms = start.elapsed_time(end) / iters
    else:
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / iters
    t = torch.tensor([ms], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timings(args, rank: int, world: int, dev: torch.device, backend: dict) -> list[tuple]:
    b, h, hkv, n, d, iters = args.batch, args.heads, args.kv_heads, args.n_local, args.dim, args.iters
    dt = BF16
    q = torch.randn(b, h, n, d, device=dev, dtype=dt)
    k = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
    v = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
    gqa = h != hkv
    rows = []
    c = n // 2
    # one step alone: the diagonal (causal n x n) and an off-diagonal zigzag block (n x n/2)
    diag = _bench(lambda: ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=gqa, **backend), dev, iters)
    half = _bench(lambda: ffpa_attn_fwd(q, k[:, :, :c], v[:, :, :c], enable_gqa=gqa, **backend), dev, iters)
    full = _bench(lambda: ffpa_attn_fwd(q, k, v, enable_gqa=gqa, **backend), dev, iters)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)

    def step_fb(n_kv: int, causal: bool = False):
        o, _ = ffpa_attn_fwd(qg, kg[:, :, :n_kv], vg[:, :, :n_kv], causal=causal, enable_gqa=gqa, **backend)
        o.backward(g)

    diag_fb = _bench(lambda: step_fb(n, True), dev, iters)
    half_fb = _bench(lambda: step_fb(c), dev, iters)
    full_fb = _bench(lambda: step_fb(n), dev, iters)
    # one ring hop alone: K/V (forward) and K/V + fp32 dK/dV (backward)
    comm = RingComm()
    kv = torch.cat([k.reshape(-1), v.reshape(-1)])
    dkv = torch.zeros(kv.numel(), dtype=torch.float32, device=dev)
    hop_kv = _bench(lambda: comm.start(kv, 0).wait(), dev, iters) if world > 1 else float("nan")
    hop_bwd = _bench(lambda: (comm.start(kv, 0).wait(), comm.start(dkv, 1).wait()), dev, iters) \
        if world > 1 else float("nan")
    kv_mb = kv.numel() * kv.element_size() / 1e6
    for causal in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        fwd = _bench(lambda: ring_attn_func(qr, kr, vr, causal=causal, enable_gqa=gqa, **backend), dev, iters)

        def fb():
            ring_attn_func(qr, kr, vr, causal=causal, enable_gqa=gqa, **backend).backward(g)

        fwdbwd = _bench(fb, dev, iters)
        ng = n * world
        flops = 4 * b * h * ng * ng * d * (0.5 if causal else 1.0) / world  # per rank
        # the ring's time if every hop hid behind compute: the sum of its steps' compute
        ideal_f = diag + (world - 1) * half if causal else world * full
        ideal_fb = diag_fb + (world - 1) * half_fb if causal else world * full_fb
        rows.append((causal, fwd, fwdbwd, flops / fwd / 1e9, 3.5 * flops / fwdbwd / 1e9, ideal_f, ideal_fb))
    if rank == 0:
        print(f"\n== timing: world {world}, B={b} Hq={h} Hkv={hkv} N_local={n} (N_global={n * world}) D={d} bf16, "
              f"zigzag; {iters} iters, max over ranks", flush=True)
        print(f"one step alone, fwd | fwd+bwd ms: diagonal causal n x n {diag:.2f} | {diag_fb:.2f}; zigzag "
              f"off-diagonal n x n/2 {half:.2f} | {half_fb:.2f}; full n x n {full:.2f} | {full_fb:.2f}")
        print(f"one hop alone: K/V {kv_mb:.0f} MB {hop_kv:.2f} ms ({kv_mb / hop_kv:.0f} GB/s) | "
              f"backward hop K/V + fp32 dK/dV {3 * kv_mb:.0f} MB {hop_bwd:.2f} ms")
        print(f"{'causal':>6} | {'ring fwd ms':>11} | {'fwd+bwd ms':>10} | {'fwd TFLOPS':>10} | {'f+b TFLOPS':>10} | "
              f"{'sum steps fwd':>13} | {'sum steps f+b':>13}")
        for r in rows:
            print(f"{str(r[0]):>6} | {r[1]:11.2f} | {r[2]:10.2f} | {r[3]:10.1f} | {r[4]:10.1f} | {r[5]:13.2f} | "
                  f"{r[6]:13.2f}")
        print("(TFLOPS per GPU: 4*B*H*N_global^2*D (x0.5 causal) / world, fwd+bwd counts 3.5x; 'sum steps' = the "
              "steps' compute measured alone = the ring's time if every hop hid behind compute)")
        if args.json:
            keys = ("causal", "fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwdbwd_tflops", "sum_steps_fwd_ms",
                    "sum_steps_fwdbwd_ms")
            with open(args.json, "w") as f:
                json.dump({"world": world, "batch": b, "heads": h, "kv_heads": hkv, "n_local": n,
                           "n_global": n * world, "dim": d, "iters": iters, "hop_kv_ms": hop_kv,
                           "hop_bwd_ms": hop_bwd, "device": torch.cuda.get_device_name(dev)
                           if dev.type == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
                           "rows": [dict(zip(keys, r)) for r in rows]}, f, indent=1)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, help="backend name passed to every step (default: implicit)")
    ap.add_argument("--no-autotune", action="store_true",
                    help="TritonBackend(autotune=False) for every step (shipped/first configs; no tuning time)")
    ap.add_argument("--cpu", action="store_true", help="gloo + SDPA on CPU: a smoke test of this script")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--n-local", type=int, default=8192)
    ap.add_argument("--n-global", type=int, default=None,
                    help="global tokens for the timing section (N_local = N_global / world; overrides --n-local)")
    ap.add_argument("--json", default=None, help="rank 0 writes the timing rows here (for bench/ring_scaling.py)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    args = ap.parse_args()
    if args.n_global is not None:
        args.n_local = args.n_global // int(os.environ.get("WORLD_SIZE", "1"))
    t_start = time.perf_counter()
    dev = _setup(args.cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = {"backend": args.backend} if args.backend else ({"backend": "sdpa"} if args.cpu else {})
    if args.no_autotune:
        backend = {"backend": TritonBackend(autotune=False)}
    if args.cpu:
        args.heads, args.kv_heads, args.iters = 2, 2, 2
        if args.n_global is None:
            args.n_local = 64
    if rank == 0:
        probe = torch.empty(1, 1, 1024, 512, dtype=BF16, device=dev)
        print(f"ring_gpu: world {world}, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
              f"torch {torch.__version__}, backend {backend or 'implicit'}, NCCL_NVLS_ENABLE="
              f"{os.environ['NCCL_NVLS_ENABLE']}\nplan at D=512: {explain(probe, probe, probe, **backend)}".replace(
                  "\n", "\n  "), flush=True)
    failed = 0
    table = []
    for i, case in enumerate([] if args.skip_correctness else _cases(world, args.cpu)):
        t0 = time.perf_counter()
        try:
            res = _run_case(case, rank, world, dev, 1234 + i, backend)
            msg = None
        except Exception:
            res, msg = None, traceback.format_exc()
        ok = torch.tensor([0 if msg else 1], device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if msg:
            print(f"[rank {rank}] {case['name']} raised:\n{msg}", flush=True)
        if rank == 0:
            good = bool(ok.item()) and res is not None and all(r[2] for r in res.values())
            failed += not good
            table.append((case["name"], res, good, time.perf_counter() - t0))
            print(f"  {case['name']}: {'PASS' if good else 'FAIL'} ({table[-1][3]:.1f} s)", flush=True)
    if rank == 0:
        print(f"\n== correctness vs fp32 reference (world {world}): ring err / single-GPU err per tensor")
        print(f"{'case':32} | {'out':>17} | {'lse':>17} | {'dq':>17} | {'dk':>17} | {'dv':>17} | {'s':>5} | ok")
        for name, res, good, secs in table:
            cells = [f"{res[k][0]:.1e} / {res[k][1]:.1e}" if res else "error" for k in ("out", "lse", "dq", "dk", "dv")]
            print(f"{name:32} | " + " | ".join(f"{c:>17}" for c in cells) + f" | {secs:5.1f} | "
                  f"{'PASS' if good else 'FAIL'}")
        print(f"correctness: {len(table) - failed}/{len(table)} passed", flush=True)
    if not args.skip_timing:
        _timings(args, rank, world, dev, backend)
    if rank == 0:
        print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    bad = torch.tensor([failed], device=dev)
    dist.broadcast(bad, 0)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad.item() else 0


if __name__ == "__main__":
    sys.exit(main())

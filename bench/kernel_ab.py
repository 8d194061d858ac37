"""Interleaved A/B of CuTeDSL kernel parameters that are open questions in dispatch/heuristics.py (a GPU run).

Each experiment runs every variant on the same inputs (B=1, H=32, N=8192 bf16 unless said), checks each output
against the first variant's (rel err < 1e-2: a variant changes speed, never results), then times ``--rounds``
interleaved rounds (ffpa_attn.bench.timing.measure, L2 cleared) and keeps each variant's median:

* ``fwd-causal-tile``: the one-CTA forward at D=512, causal, 64- against 80-key tiles (the non-causal forward
  measured 80 faster; causal kept 64 untimed);
* ``bwd-ring``: the dK/dV kernel's ring depth at D=512, 4 against 5 slots (4 measured faster with the 1 KiB dS
  placeholder that the kernel no longer reserves);
* ``recompute-tile``: the S-recompute forward at D=768 / 1024, every key tile whose ring keeps its minimum depth;
* ``recompute-sweep``: the same at D = 640, 768, 896, 1024, non-causal and causal;
* ``varlen-tile``: the packed forward (8 sequences, 16K tokens, GQA 32/8, causal) at D=512, 64 against 80 keys.

    python bench/kernel_ab.py [--only fwd-causal-tile,bwd-ring] [--rounds 5] [--json PATH]

``--json``: one history.jsonl row per variant (metric tflops), for bench/results/history.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ffpa_attn.bench.env import git_commit  # noqa: E402
from ffpa_attn.bench.timing import measure  # noqa: E402
from ffpa_attn.testing import make_qkv, rel_err  # noqa: E402

BF16 = torch.bfloat16
Variant = tuple[str, Callable[[], torch.Tensor]]


def _dense(d: int, causal: bool, hkv: int = 32, n: int = 8192):
    q, k, v = make_qkv(1, 32, hkv, n, n, d, BF16, device="cuda")
    return q, k, v, 4 * 32 * n * n * d * (0.5 if causal else 1.0)


def fwd_causal_tile() -> tuple[list[Variant], float, str]:
    from ffpa_attn.cutedsl.api import run_forward

    q, k, v, flops = _dense(512, True)
    return ([(f"tile_n={t}", lambda t=t: run_forward(q, k, v, True, 512 ** -0.5, tile_n=t)[0]) for t in (64, 80)],
            flops, "B1 H32/32 N8192 D512 bf16 causal fwd")


def bwd_ring() -> tuple[list[Variant], float, str]:
    from ffpa_attn.cutedsl.api import run_backward, run_forward

    q, k, v, flops = _dense(512, True)
    out, lse = run_forward(q, k, v, True, 512 ** -0.5)
    do = torch.randn_like(q)
    return ([(f"ring={s}", lambda s=s: run_backward(do, q, k, v, out, lse, True, 512 ** -0.5, max_stages=s)[1])
             for s in (4, 5)], 2.5 * flops, "B1 H32/32 N8192 D512 bf16 causal bwd (dk compared)")


def recompute_tile(d: int, causal: bool = False) -> tuple[list[Variant], float, str]:
    from ffpa_attn.cutedsl.api import run_forward
    from ffpa_attn.cutedsl.config import RECOMPUTE_MIN_STAGES, RECOMPUTE_TILE_N_CHOICES, recompute_stages

    q, k, v, flops = _dense(d, causal)
    tiles = [t for t in RECOMPUTE_TILE_N_CHOICES if recompute_stages(d, t) >= RECOMPUTE_MIN_STAGES]
    return ([(f"tile_n={t}", lambda t=t: run_forward(q, k, v, causal, d ** -0.5, tile_n=t, recompute=True)[0])
             for t in tiles], flops,
            f"B1 H32/32 N8192 D{d} bf16 {'causal' if causal else 'non-causal'} fwd (S-recompute)")


def varlen_tile() -> tuple[list[Variant], float, str]:
    from ffpa_attn.cutedsl.api import run_varlen_forward

    lens = [6144, 3072, 2048, 1536, 1280, 1024, 768, 512]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda")
    t = sum(lens)
    q = torch.randn(t, 32, 512, dtype=BF16, device="cuda")
    k, v = (torch.randn(t, 8, 512, dtype=BF16, device="cuda") for _ in range(2))
    flops = sum(4 * 32 * n * n * 512 * 0.5 for n in lens)
    return ([(f"tile_n={tn}", lambda tn=tn: run_varlen_forward(q, k, v, cu, cu, True, 512 ** -0.5, tile_n=tn)[0])
             for tn in (64, 80)], flops, "varlen 8 seqs 16K tokens H32/8 D512 bf16 causal fwd")


EXPERIMENTS = {"fwd-causal-tile": [fwd_causal_tile], "bwd-ring": [bwd_ring],
               "recompute-tile": [lambda: recompute_tile(768), lambda: recompute_tile(1024)],
               "recompute-sweep": [lambda d=d, c=c: recompute_tile(d, c) for d in (640, 768, 896, 1024)
                                   for c in (False, True)],
               "varlen-tile": [varlen_tile]}


def run(build: Callable[[], tuple[list[Variant], float, str]], rounds: int) -> list[dict]:
    variants, flops, case = build()
    ref = variants[0][1]()
    for name, fn in variants[1:]:
        err = rel_err(fn(), ref)
        assert err < 1e-2, f"{case}: {name} differs from {variants[0][0]}: rel err {err:.2e}"
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, fn in variants:
            times[name].append(measure(fn, torch.device("cuda"), max_reps=30, min_reps=10, budget_s=1.0).median_ms)
    rows = []
    for name, _ in variants:
        ms = statistics.median(times[name])
        rows.append({"case": case, "variant": name, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{case:<60} {name:<12} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOPS", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated, of {', '.join(EXPERIMENTS)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH", help="write history.jsonl rows here")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(EXPERIMENTS))
    if unknown:
        ap.error(f"--only: unknown {unknown}; choose from {sorted(EXPERIMENTS)}")
    if not torch.cuda.is_available():
        print("kernel_ab.py times CuTeDSL kernels: it needs an sm90 GPU", file=sys.stderr)
        return 2
    rows = [r for n in names for build in EXPERIMENTS[n] for r in run(build, args.rounds)]
    if args.json:
        stamp = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit()[0],
                 "device": torch.cuda.get_device_name(), "command": "python bench/kernel_ab.py " + " ".join(sys.argv[1:])}
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**stamp, "case": r["case"], "impl": f"cutedsl {r['variant']}", "direction": "",
                                    "metric": "tflops", "value": round(r["tflops"], 2)}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

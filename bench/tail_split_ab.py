"""A/B of the last-wave split of non-causal forwards (docs/design.md, "Dispatch heuristics"): forward TFLOPS
with FFPA_ATTN_TAIL_SPLIT=0 and =1, interleaved, per backend (CUDA, and CuTeDSL when installed) at B=1, H=32,
N=8192 bf16, non-causal.

    python bench/tail_split_ab.py [--dims 320,384,512,640,768,1024] [--backends cuda,cutedsl] [--reps 3]

Each (backend, D): out with and without the split must agree (rel err < 1e-2; only the tail rows differ);
then ``--reps`` rounds of (off, on) medians from ffpa_attn.bench.timing.measure, the median of each kept.
JSON to $OUT/tail_split_ab.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ffpa_attn  # noqa: E402
from ffpa_attn import CUDABackend, CuTeDSLBackend  # noqa: E402
from ffpa_attn.dispatch.registry import available as backend_available  # noqa: E402
from ffpa_attn.bench.timing import measure  # noqa: E402
from ffpa_attn.testing import make_qkv, rel_err  # noqa: E402

BACKENDS = {"cuda": CUDABackend, "cutedsl": CuTeDSLBackend}


def run(backend: str, d: int, reps: int, n: int = 8192, h: int = 32) -> dict:
    q, k, v = make_qkv(1, h, h, n, n, d, torch.bfloat16, device="cuda")
    cfg = BACKENDS[backend]()

    def fwd():
        return ffpa_attn.ffpa_attn_fwd(q, k, v, causal=False, forward_backend=cfg)

    flops = 4 * h * n * n * d
    res = {"backend": backend, "d": d}
    outs = {}
    for flag in ("0", "1"):
        os.environ["FFPA_ATTN_TAIL_SPLIT"] = flag
        outs[flag] = fwd()[0]
    res["rel_err_on_vs_off"] = rel_err(outs["1"], outs["0"])
    assert res["rel_err_on_vs_off"] < 1e-2, res
    times = {"0": [], "1": []}
    for _ in range(reps):
        for flag in ("0", "1"):
            os.environ["FFPA_ATTN_TAIL_SPLIT"] = flag
            times[flag].append(measure(fwd, q.device, max_reps=30, min_reps=10, budget_s=1.5).median_ms)
    os.environ["FFPA_ATTN_TAIL_SPLIT"] = "1"
    for flag, name in (("0", "off"), ("1", "on")):
        ms = statistics.median(times[flag])
        res[f"ms_{name}"], res[f"tflops_{name}"] = ms, flops / ms / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="320,384,512,640,768,1024", help="comma-separated head dims")
    ap.add_argument("--backends", default="cuda,cutedsl", help="comma-separated backends (cuda, cutedsl)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of (off, on) medians per (backend, D)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; B=1 H=32 N=8192 bf16 non-causal, TFLOPS split off -> on")
    records = []
    for backend in args.backends.split(","):
        ok, why = backend_available(backend, torch.device("cuda"))
        if not ok:
            print(f"{backend}: not available ({why}), skipped")
            continue
        for d in (int(x) for x in args.dims.split(",")):
            try:
                r = run(backend, d, args.reps)
            except Exception as e:  # a backend that does not take this D
                print(f"{backend:8s} D={d:5d}  skipped: {type(e).__name__}: {str(e)[:120]}")
                continue
            records.append(r)
            print(f"{backend:8s} D={d:5d}  {r['tflops_off']:7.1f} -> {r['tflops_on']:7.1f} TFLOPS "
                  f"({r['ms_off']:.3f} -> {r['ms_on']:.3f} ms, {r['tflops_on'] / r['tflops_off'] - 1:+.1%}); "
                  f"rel err on vs off {r['rel_err_on_vs_off']:.1e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tail_split_ab.json"), "w") as f:
            json.dump({"sms": sms, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()

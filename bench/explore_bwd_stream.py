"""CuTeDSL backward above D=512 (V / dO streamed through ring B next to their partner chunks): ring splits.

    python bench/explore_bwd_stream.py [--d 576 768 1024] [--causal 0 1]

For each D, the backward (``ffpa_attn.cute.api.run_backward``: the dK/dV kernel + the dQ kernel) at B=1, H=32,
N=8192 bf16 with the default ring split (``BwdConfig.ring_split``: ring B, which streams two chunks per GEMM
step, as deep as it gets) and with forced splits (``_ring_a`` / ``_dq_ring_a``: slots of ring A), plus the dK/dV
kernel alone (``_profile_skip_dq``). CUDA-event medians; TFLOPS = 2.5 x 4 B H N^2 D (x0.5 causal) / t. Every
variant's gradients must equal the default's bit for bit (ring depth does not change the accumulation order).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# D -> forced (ring_a, dq_ring_a) splits next to the default; None = the config's own for that kernel
FORCED = {  # (7, 6) at 768 and (5, 4) at 1024: the equal rings of the first version (run 40)
    576: [(4, 4)],
    640: [(6, 5)],
    768: [(7, 6)],
    896: [(5, 5)],
    1024: [(5, 4), (4, 4)],
}


def main() -> None:
    from ffpa_attn.bench.timing import measure
    from ffpa_attn.cute.api import bwd_config, run_backward

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="*", default=[1024, 768, 896])
    ap.add_argument("--causal", type=int, nargs="*", default=[0])
    args = ap.parse_args()
    b, h, n = 1, 32, 8192
    dev = torch.device("cuda")
    for d in args.d:
        for causal in (bool(c) for c in args.causal):
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
            out = torch.randn_like(q)
            lse = torch.randn(b, h, n, device=dev) + 10.0
            scale = d ** -0.5
            flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            base = None
            for split in [None] + FORCED.get(d, []):
                ra, dra = split if split else (None, None)
                cfg = bwd_config(d, q.dtype, causal, ring_a=ra, dq_ring_a=dra)
                name = (f"A{cfg.stages}/B{cfg.stages_b} dq A{cfg.dq_stages}/B{cfg.dq_stages_b}"
                        + ("" if split else " (default)"))
                try:
                    def run(ra=ra, dra=dra, skip=False):
                        return run_backward(do, q, k, v, out, lse, causal, scale, _ring_a=ra, _dq_ring_a=dra,
                                            _profile_skip_dq=skip)
                    g = run()
                    same = "" if base is None else (" same" if all(torch.equal(x, y) for x, y in zip(g, base))
                                                    else " DIFFERENT")
                    base = g if base is None else base
                    t = measure(run, dev, max_reps=10, min_reps=3, budget_s=1.5).median_ms
                    t_kv = measure(lambda: run(skip=True), dev, max_reps=10, min_reps=3, budget_s=1.0).median_ms
                    print(f"D={d} causal={int(causal)} {name:<32} {t:8.2f} ms {flops / t / 1e9:7.1f} TFLOPS "
                          f"(dK/dV kernel {t_kv:.2f} ms, dQ kernel ~{t - t_kv:.2f} ms){same}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"D={d} causal={int(causal)} {name:<32} FAILED {type(e).__name__}: {str(e)[:120]}",
                          flush=True)
            del q, k, v, do, out, lse, base
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

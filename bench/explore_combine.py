"""The split-KV combine kernel (``ffpa_attn.common.combine._combine_kernel``) alone, per tile shape (H200).

    python bench/explore_combine.py

Shape of the CuTeDSL split path at Hkv=2, Nq=4, Hq=32, D=512 (64 KV slices; partials [2, 64, 64, 512] bf16 +
lse): the kernel took 9.6 us of a 51.6 us decode step (bench/results/2026-12-01-h200-session5/q_broadcast),
about 0.9 TB/s of partial reads. Times the shipped tiles and alternatives (BLOCK_DC columns per program,
warps), CUDA-graph replays of 50 launches (launch overhead excluded), and checks each against the shipped one.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    from ffpa_attn.bench.timing import graph_replay_ms
    from ffpa_attn.common import combine as decode

    torch.manual_seed(0)
    for bh, splits, rows, d, dtype in ((2, 64, 64, 512, torch.bfloat16), (2, 64, 16, 512, torch.float32),
                                      (8, 16, 64, 512, torch.bfloat16)):
        op = torch.randn(bh, splits, rows, d, device="cuda", dtype=dtype)
        lp = torch.randn(bh, splits, rows, device="cuda") * 3
        nq = rows // 16  # rows = group * nq with group 16: out [B=1, Hq=bh*16, Nq=rows/16, D]
        out = torch.empty(1, bh * 16, nq, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(1, bh * 16, nq, device="cuda")
        nbytes = op.numel() * op.element_size()
        ref = None
        for block_dc in (32, 64, 128, 256, 512):
            for warps in (1, 2, 4, 8):
                block_s = min(decode.pow2(splits), 64)
                if block_s * block_dc > 16384:
                    continue
                n_dc = -(-d // block_dc)

                def launch():
                    decode._combine_kernel[(n_dc * bh * rows,)](
                        op, lp, lp, out, lse, bh, rows, d, splits, n_dc,
                        out.stride(0), 16 * out.stride(1), out.stride(-2), out.stride(-1), lse.stride(0),
                        16 * lse.stride(1), lse.stride(-1), BLOCK_S=block_s, BLOCK_DC=block_dc, LSE_ONLY=True,
                        num_warps=warps)
                try:
                    launch()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    print(f"  DC{block_dc} w{warps}: {type(e).__name__}", flush=True)
                    continue
                if ref is None:
                    ref = out.float().clone()
                err = (out.float() - ref).abs().max().item()
                us = graph_replay_ms([launch], calls=50, reps=5) * 1e3
                print(f"bh{bh} S{splits} R{rows} {str(dtype)[6:]:8s} DC{block_dc:4d} w{warps}: {us:6.2f} us "
                      f"{nbytes / us / 1e6:6.2f} TB/s  maxdiff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()

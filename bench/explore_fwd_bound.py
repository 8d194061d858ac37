"""What bounds the CuTeDSL forward at D=512 (H200, B=1, H=32, N=8192 bf16, non-causal), and the decode split.

    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    python bench/explore_fwd_bound.py [--variants base,no-exchange,...] [--decode]

Part 1 (timing only; the stripped variants compute garbage): the forward kernel and subclasses of it with one
piece of the consumer's per-tile work removed, compiled through ``_compile.compile_fwd(kernel_cls=...)`` and
timed on the same inputs (CUDA-event medians, TFLOPS = 4 B H N^2 D):

* ``base``: the kernel as shipped;
* ``no-exchange``: the partial-S exchange keeps its named barrier but stores and loads nothing;
* ``no-softmax``: no row max / exp2 / row sums (P = the scaled S, row scale 1);
* ``no-cuda``: both of the above (what is left: the two GEMMs, the ring and the barriers);
* ``no-pv``: the P.V GEMM is not issued (its V slot is still waited for and released);
* ``no-qk``: the QK^T GEMM is not issued (its K slot is still waited for);
* ``...@T``: the same at ``tile_n = T``.

If the GEMM-only variants run near the tensor peak and ``base`` does not, the consumers' CUDA-core work between
the GEMMs is on the critical path; if they do not either, the GEMMs themselves (operand traffic) are.
(H200 2026-12-01, bench/results/2026-12-01-h200-session5/fwd_bound: base 477, no-exchange 522, no-softmax 495,
no-cuda 559, at tile_n=64: base 478, no-cuda 696 TFLOPS. A schedule that issues S(t+1) before softmax(t), to hide
that work, measured slower at every D: session5/overlap.)

Part 2 (``--decode``): Hkv=2, Nq=4, D=512, Nkv=32768 (issue 11): kernel-level profile (torch.profiler) of the
CuTeDSL split-KV path and of the Triton split-KV path, then CUDA-graph timings of the CuTeDSL path per split
count, K/V rotated over 8 copies so that no call finds its K/V in L2.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def variant_classes():
    from cutlass import Float32
    import cutlass
    import cutlass.cute as cute

    from ffpa_attn.cute.fwd_sm90 import _BAR_EXCHANGE, _WG, FlashFwdSm90SplitD

    class NoExchange(FlashFwdSm90SplitD):
        @cute.jit
        def exchange(self, acc_S, sX, sX_peer, ring, state, mbar_x, x_phase, c, tid, rank, scale_log2):
            cute.arch.barrier(barrier_id=_BAR_EXCHANGE, number_of_threads=2 * _WG)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = acc_S[i] * scale_log2
            cute.arch.fence_proxy("async.shared", space="cta")
            self.release_item(ring, state, rank)

    class NoSoftmax(FlashFwdSm90SplitD):
        @cute.jit
        def online_softmax(self, acc_S, row_max, row_sum, row_scale):
            for h in cutlass.range_constexpr(2):
                row_scale[h] = Float32(1.0)
                row_max[h] = Float32(0.0)
                row_sum[h] = Float32(1.0)

    class NoCuda(NoExchange):
        online_softmax = NoSoftmax.online_softmax

    class NoPV(FlashFwdSm90SplitD):
        @cute.jit
        def pv_gemm(self, tiled_mma, acc_O, tOrP, tOrV, ring, state, c, accumulate):
            self.wait_half(ring, state, c)
            cute.arch.fence_proxy("async.shared", space="cta")

    class NoQK(FlashFwdSm90SplitD):
        @cute.jit
        def qk_gemm(self, tiled_mma, acc_S, tSrQ, tSrK, ring, state, c):
            self.wait_half(ring, state, c)

    return {"base": FlashFwdSm90SplitD, "no-exchange": NoExchange, "no-softmax": NoSoftmax, "no-cuda": NoCuda,
            "no-pv": NoPV, "no-qk": NoQK}


def part1(names: list[str]) -> None:
    from ffpa_attn.bench.timing import measure
    from ffpa_attn.cute._compile import compile_fwd
    from ffpa_attn.cute.api import _cute_tensor
    from ffpa_attn.cute.config import FwdConfig
    import cuda.bindings.driver as cuda

    classes = variant_classes()
    b, h, n, d = 1, 32, 8192, 512
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
    flops = 4 * b * h * n * n * d
    args = [_cute_tensor(t, 16) for t in (q, k, v, out)] + [_cute_tensor(lse, 4)]
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    for name in names:
        base, _, tn = name.partition("@")
        cfg = FwdConfig(head_dim=d, dtype="bfloat16", causal=False, tile_n=int(tn) if tn else 80)
        t0 = time.time()
        try:
            kernel = compile_fwd(cfg, kernel_cls=classes[base])
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:18s} compile failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        ct = time.time() - t0
        run = lambda: kernel(*args, d ** -0.5 * math.log2(math.e), 1, 2**31 - 1, stream)  # noqa: E731
        t = measure(run, torch.device("cuda"), max_reps=20, min_reps=10, warmup=2)
        note = ""
        if base == "base":
            from ffpa_attn.reference import attention
            ref = attention(q[:, :1], k[:, :1], v[:, :1])[0]
            note = f" err(head 0)={((out[:, :1].float() - ref).norm() / ref.norm()).item():.2e}"
        print(f"{name:18s} tile_n={cfg.tile_n:3d} stages={cfg.stages} {t.median_ms:7.3f} ms "
              f"{flops / t.median_ms / 1e9:6.1f} TFLOPS (compile {ct:.0f} s){note}", flush=True)


def part2() -> None:
    from ffpa_attn.cute import splitkv
    from ffpa_attn.backends import TritonBackend
    from ffpa_attn.bench.timing import graph_replay_ms
    from ffpa_attn.triton import splitkv as decode

    b, hq, hkv, nq, nkv, d = 1, 32, 2, 4, 32768, 512
    torch.manual_seed(0)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
    kvs = [(torch.randn(b, hkv, nkv, d, device="cuda", dtype=torch.bfloat16),
            torch.randn(b, hkv, nkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(8)]
    scale = d ** -0.5
    kv_bytes = 2 * b * hkv * nkv * d * 2
    from torch.profiler import ProfilerActivity, profile

    for label, fn in (("cute split", lambda k, v: splitkv.forward(q, k, v, False, scale)),
                      ("triton split", lambda k, v: decode.splitkv_forward(q, k, v, attn_mask=None, causal=False,
                                                                            scale=scale, config=TritonBackend()))):
        for k, v in kvs:
            fn(k, v)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for k, v in kvs:
                fn(k, v)
            torch.cuda.synchronize()
        print(f"\n-- {label}: kernels over 8 calls (K/V {kv_bytes / 1e6:.0f} MB per call)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))

    def graph_ms(fn) -> float:
        return graph_replay_ms([lambda k=k, v=v: fn(k, v) for k, v in kvs])

    print("\n-- CUDA-graph medians, Hkv=2 Nq=4 (K/V TB/s)")
    for splits in (None, 32, 64, 128, 132, 256):
        ms = graph_ms(lambda k, v, s=splits: splitkv.forward(q, k, v, False, scale, splits=s))
        print(f"cute split S={splits}: {ms * 1e3:7.1f} us {kv_bytes / ms / 1e9:5.2f} TB/s", flush=True)
    ms = graph_ms(lambda k, v: decode.splitkv_forward(q, k, v, attn_mask=None, causal=False, scale=scale,
                                                      config=TritonBackend()))
    print(f"triton split: {ms * 1e3:7.1f} us {kv_bytes / ms / 1e9:5.2f} TB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="base,no-exchange,no-softmax,no-cuda,no-pv,no-qk,base@64,no-cuda@64")
    ap.add_argument("--decode", action="store_true")
    args = ap.parse_args()
    if args.variants:
        part1(args.variants.split(","))
    if args.decode:
        part2()


if __name__ == "__main__":
    main()

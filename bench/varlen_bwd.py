"""Varlen (packed-sequence) backward timing: the CuTeDSL varlen backward beside the Triton varlen backward and the
dense CuTeDSL backward of about the same work (a GPU run; no CPU mode).

Cases as in ``python -m ffpa_attn bench --varlen`` (:class:`ffpa_attn.bench.varlen.VarlenCase`): sequences packed
into ``[T, H, D]``; each backward gets the same ``out`` / ``lse`` (one forward) and ``dout``, through the low-level
``ffpa_attn_varlen_bwd`` with the backend named (dense: ``ffpa_attn_bwd`` on ``B=1, N = case.dense_n()``).
TFLOPS = 2.5 x the forward FLOPs counted exactly per sequence (``VarlenCase.flops``); the CuTeDSL gradients are
compared with the Triton ones (relative error, a sanity check; the GPU tests compare with the reference).

    python bench/varlen_bwd.py --d 512 --causal --hq 32 --hkv 8
    python bench/varlen_bwd.py --d 512 --lens 16384,64,64,64 --causal
"""
from __future__ import annotations

import argparse

import torch

from ffpa_attn import ffpa_attn_bwd, ffpa_attn_fwd, ffpa_attn_varlen_bwd, ffpa_attn_varlen_fwd
from ffpa_attn.bench.results import BWD_FLOP_FACTOR
from ffpa_attn.bench.timing import measure
from ffpa_attn.bench.varlen import DEFAULT_LENS, VarlenCase, _inputs, mask_pairs
from ffpa_attn.testing import rel_err


def run(case: VarlenCase, device: torch.device, budget_s: float) -> list[str]:
    q, k, v, cu_q, cu_k = _inputs(case, device, 0)
    gqa = case.hq != case.hkv
    max_q, max_k = max(case.lens_q), max(case.lens_k)
    kw = dict(causal=case.causal, enable_gqa=gqa)
    out, lse = ffpa_attn_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    dout = torch.randn_like(out)
    lines, grads = [case.label() + f"  lens_q={list(case.lens_q)}"], {}
    flops = BWD_FLOP_FACTOR * case.flops()
    for backend in ("cutedsl", "triton"):
        def call(b=backend):
            return ffpa_attn_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, backend=b, **kw)

        try:
            grads[backend] = call()
            ms = measure(call, device, max_reps=20, min_reps=3, budget_s=budget_s).median_ms
            lines.append(f"  varlen {backend:<8} {flops / (ms * 1e-3) / 1e12:7.1f} TFLOPS  {ms:8.3f} ms")
        except Exception as exc:  # noqa: BLE001 - report and go on
            lines.append(f"  varlen {backend:<8} n/a  {type(exc).__name__}: {str(exc)[:160]}")
    if len(grads) == 2:
        errs = [rel_err(a, b.to(a.dtype)) for a, b in zip(grads["cutedsl"], grads["triton"])]
        lines.append("  cutedsl vs triton (rel err dq, dk, dv): " + ", ".join(f"{e:.2e}" for e in errs))
    n = case.dense_n()
    dq, dk, dv = (torch.randn(1, h, n, case.d, device=device, dtype=q.dtype) for h in (case.hq, case.hkv, case.hkv))
    dout_d = torch.randn_like(dq)
    out_d, lse_d = ffpa_attn_fwd(dq, dk, dv, causal=case.causal, enable_gqa=gqa, backend="cutedsl")
    ms = measure(lambda: ffpa_attn_bwd(dout_d, dq, dk, dv, out_d, lse_d, causal=case.causal, enable_gqa=gqa,
                                       backend="cutedsl"), device, max_reps=20, min_reps=3, budget_s=budget_s).median_ms
    dense_flops = BWD_FLOP_FACTOR * 4.0 * case.hq * case.d * mask_pairs(n, n, case.causal)
    lines.append(f"  dense  cutedsl  {dense_flops / (ms * 1e-3) / 1e12:7.1f} TFLOPS  {ms:8.3f} ms  (B=1 N={n})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[512])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--lens", default=",".join(map(str, DEFAULT_LENS)), help="query (= key) lengths, comma-separated")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--budget-s", type=float, default=1.0)
    a = ap.parse_args()
    lens = tuple(int(x) for x in a.lens.split(","))
    for d in a.d:
        case = VarlenCase(d=d, causal=a.causal, hq=a.hq, hkv=a.hkv, lens_q=lens, dtype=a.dtype)
        print("\n".join(run(case, torch.device("cuda"), a.budget_s)), flush=True)


if __name__ == "__main__":
    main()

"""Gradient precision with peaky logits: our backward backends next to torch's own same-dtype SDPA.

For each logit spread (the standard deviation of q.k * scale, set by scaling q), each backward backend and
each gradient, prints the relative Frobenius error ``||g - g_ref|| / ||g_ref||`` against the fp32 reference
(ffpa_attn.reference.attention under fp32 autograd), beside the error of torch's SDPA run in the same dtype
on the same inputs. A ratio near 1 means our kernel is as precise as torch's own computation; the tests bound
it by ``ffpa_attn.testing.assert_close``'s factor.

    python bench/grad_precision.py                       # CUDA: D=512, bf16, causal and not
    python bench/grad_precision.py --d 512,1024 --std 1,10,25,60 --backends triton,cutedsl,sdpa
    python bench/grad_precision.py --json out.json

On a CPU (no GPU) it runs the Triton kernels under TRITON_INTERPRET=1 on a tiny shape.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__" and not os.environ.get("TRITON_INTERPRET"):
    try:
        import torch as _t

        if not _t.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported
    except ImportError:
        pass

import torch

from ffpa_attn import ffpa_attn_func
from ffpa_attn.reference import attention
from ffpa_attn.testing import rel_err


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def measure(d: int, dtype: torch.dtype, causal: bool, std: float, backends: list[str], *, b: int, hq: int,
            hkv: int, n: int, device: str, seed: int) -> list[dict]:
    """Rows ``{d, causal, std, backend, tensor, err, sdpa_err, ratio}`` for one input draw."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, n, d, device=device, generator=g) * std  # q.k * D^-0.5 has std ~= std
    k = torch.randn(b, hkv, n, d, device=device, generator=g)
    v = torch.randn(b, hkv, n, d, device=device, generator=g)
    dout = torch.randn(b, hq, n, d, device=device, generator=g)
    gqa = hq != hkv

    def ref_fn(q_, k_, v_):
        return attention(q_, k_, v_, is_causal=causal)[0]

    ref = _grads(ref_fn, q, k, v, dout)
    ql, kl, vl, dl = (t.to(dtype) for t in (q, k, v, dout))

    def sdpa_fn(q_, k_, v_):
        # tail-aligned causal == top-left here (Nq == Nkv); the aten op keeps a monkey-patched F.sdpa out
        return torch.ops.aten.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)

    base = _grads(sdpa_fn, ql, kl, vl, dl)
    rows = []
    for name in backends:
        def ours(q_, k_, v_, name=name):
            return ffpa_attn_func(q_, k_, v_, is_causal=causal, enable_gqa=gqa, backend=name)

        try:
            got = _grads(ours, ql, kl, vl, dl)
        except Exception as exc:  # noqa: BLE001 - reported, never silently dropped
            rows.append({"d": d, "causal": causal, "std": std, "backend": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for i, tname in enumerate(("out", "dq", "dk", "dv")):
            err, berr = rel_err(got[i], ref[i]), rel_err(base[i], ref[i])
            rows.append({"d": d, "causal": causal, "std": std, "backend": name, "tensor": tname,
                         "err": err, "sdpa_err": berr, "ratio": err / berr if berr > 0 else float("inf")})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", default="512", help="head dims, comma-separated (default 512)")
    p.add_argument("--std", default="1,10,25,60", help="logit standard deviations (default 1,10,25,60)")
    p.add_argument("--backends", default="triton,cutedsl,sdpa", help="backward backends to run")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--causal", default="both", choices=("yes", "no", "both"))
    p.add_argument("--n", type=int, default=None, help="sequence length (default 1024 on CUDA, 32 on CPU)")
    p.add_argument("--heads", default="8,2", help="Hq,Hkv (default 8,2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = a.n or (1024 if device == "cuda" else 32)
    hq, hkv = (int(x) for x in a.heads.split(","))
    dtype = getattr(torch, a.dtype)
    causals = {"yes": [True], "no": [False], "both": [False, True]}[a.causal]
    backends = [x for x in a.backends.split(",") if x]
    if device == "cpu":
        backends = [x for x in backends if x in ("triton", "sdpa")]
    rows: list[dict] = []
    print(f"device={device} dtype={a.dtype} B=1 Hq={hq} Hkv={hkv} N={n}; relative error vs fp32 reference "
          f"(ours / torch same-dtype SDPA = ratio)")
    for d in (int(x) for x in a.d.split(",")):
        for causal in causals:
            for std in (float(x) for x in a.std.split(",")):
                for r in measure(d, dtype, causal, std, backends, b=1, hq=hq, hkv=hkv, n=n, device=device,
                                 seed=a.seed):
                    rows.append(r)
                    if "error" in r:
                        print(f"D={d} causal={causal} std={std:g} {r['backend']}: FAILED {r['error']}")
                    else:
                        print(f"D={d} causal={causal} std={std:g} {r['backend']:8s} {r['tensor']:3s} "
                              f"{r['err']:.3e} / {r['sdpa_err']:.3e} = {r['ratio']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "dtype": a.dtype, "n": n, "heads": [hq, hkv], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

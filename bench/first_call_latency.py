"""First-call wall time of the CuTeDSL backend on a cold cache (target: <= 5 s for a new shape, <= 0.5 s in a
second process).

Every measurement runs in a fresh Python process with empty ffpa-attn and Triton caches (its own temporary
``FFPA_ATTN_CACHE_DIR`` / ``TRITON_CACHE_DIR``), so it pays everything a user's first call pays: the forward
kernel's compile (and the process's one-time imports: cutlass), then the backward's
two kernels (compiling in compile worker processes since the forward started, :mod:`ffpa_attn.cache.pool`;
``--serial-too`` also measures with ``FFPA_ATTN_CUTE_PARALLEL_COMPILE=0``, every kernel compiled in the calling
process) and Triton's small delta kernel. A second process on the same (now warm) cache measures the load path, and
"new_shape_in_warm_process" a process that already ran attention at another head dim (cold cache for this
one): the first call of a new shape; "second_process_after_warmup" the same on the warm cache (the kernels' load
path without the process's one-time imports). ``import_torch_s``: the ``import torch`` itself; ``after_import_torch_s``:
from there to the end of the first forward (the package import, CUDA start-up, inputs, the kernels loaded and run:
what a fresh process on a warm cache waits beyond torch; target <= 1 s), ``cutlass_imported``: whether the process
imported the CuTeDSL compiler (a warm second process does not), ``compiler_stack_imported``: which of
``torch._dynamo``, ``torch._inductor`` and ``sympy`` the process imported by the end of its eager forward + backward
(none: eager calls bypass torch's op machinery, whose first call imports them). Times are wall seconds of one synchronized call each; a process
that runs past ``--timeout`` seconds (default 900: a cold first call compiles three kernels) is reported as an
error entry, not an exception. The compile alone, without a GPU: ``bench/first_compile_cpu.py``.

    python bench/first_call_latency.py --d 512,1024 [--causal] [--heads 2 --n 1024] [--serial-too] [--profile]
        [--timeout 900]

``--cpu-load`` (no GPU needed): the load path alone. One process compiles the kernels a forward + backward of each
``--d`` needs into an empty cache (sm_90a); then fresh processes on that warm cache time ``import torch`` and, from
there, the package import plus the three kernels loaded as TVM-FFI functions (shared objects, ``dlopen``), and
check that the CuTeDSL compiler (cutlass) was never imported. The target: the first call of a cached shape within
1 s of ``import torch``.

    CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD python bench/first_call_latency.py --cpu-load --d 512 [--causal]

``--cpu-first-call`` (no GPU needed): fresh processes time their first eager forward and backward on CPU tensors
through the SDPA backend's kernel module (``ffpa_attn_fwd(..., backend="sdpa")``, which returns the lse) and report
which of torch's compiler modules the process imported: the host path's one-time cost without any compile.

    python bench/first_call_latency.py --cpu-first-call [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
t_import = time.perf_counter()
import torch
t_torch = time.perf_counter()
from ffpa_attn import ffpa_attn_func
d, causal, heads, n = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[5]), int(sys.argv[6])
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
           for _ in range(3))
profile, warm = sys.argv[3] == "1", sys.argv[4] == "1"
if warm:  # the process has run attention before (another head dim, forward + backward): imports, CUDA and Triton
    # set-up are done (a backward too, so the backward column does not include the process's first Triton launch)
    w = torch.randn(1, 1, 128, 320 if d != 320 else 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ffpa_attn_func(w, w, w, backend="cutedsl").sum().backward()
if profile:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
torch.cuda.synchronize()
t0 = time.perf_counter()
out = ffpa_attn_func(q, k, v, is_causal=causal, backend="cutedsl")
torch.cuda.synchronize()
t1 = time.perf_counter()
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
t2 = time.perf_counter()
if profile:
    prof.disable()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
print(json.dumps({"fwd_s": round(t1 - t0, 3), "bwd_s": round(t2 - t1, 3), "import_torch_s": round(t_torch - t_import, 3),
                  "after_import_torch_s": round(t1 - t_torch, 3), "cutlass_imported": "cutlass" in sys.modules,
                  "compiler_stack_imported": sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy")
                                                    if m in sys.modules)}))
"""


def run(d: int, causal: bool, parallel: bool, cache: str, profile: bool = False, warm: bool = False,
        shape: tuple[int, int] = (2, 1024), timeout: float = 900.0) -> dict:
    env = {**os.environ, "FFPA_ATTN_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
           "FFPA_ATTN_CUTE_PARALLEL_COMPILE": "1" if parallel else "0"}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, str(d), "1" if causal else "0", "1" if profile else "0",
                               "1" if warm else "0", str(shape[0]), str(shape[1])],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    if profile:
        print(proc.stderr[-12000:], flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


LOAD_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
from ffpa_attn.cutedsl import _cache, api
d, causal = int(sys.argv[1]), sys.argv[2] == "1"
fwd = api.get_fwd_kernel(api.fwd_config(d, torch.bfloat16, causal))
t_fwd = time.perf_counter()
bwd = api.get_bwd_kernels(api.bwd_config(d, torch.bfloat16, causal))
t_all = time.perf_counter()
_cache.wait_all()
print(json.dumps({"import_torch_s": round(t_torch - t0, 3), "forward_loaded_s": round(t_fwd - t_torch, 3),
                  "all_loaded_s": round(t_all - t_torch, 3), "cutlass_imported": "cutlass" in sys.modules,
                  **_cache.KERNELS.counts()}))
"""


def cpu_load(d: int, causal: bool, repeats: int, timeout: float) -> dict:
    """Compile the forward + backward kernels of ``d`` into an empty cache, then time ``repeats`` fresh processes
    that load them (see ``--cpu-load``)."""
    repo = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="ffpa_load_") as cache:
        env = {**os.environ, "FFPA_ATTN_CACHE_DIR": cache, "PYTHONPATH": os.pathsep.join([repo, os.environ.get(
            "PYTHONPATH", "")])}
        env.setdefault("CUTE_DSL_ARCH", "sm_90a")
        runs = []
        for i in range(repeats + 1):
            proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(d), "1" if causal else "0"],
                                  capture_output=True, text=True, env=env, timeout=timeout)
            if proc.returncode != 0:
                return {"d": d, "error": proc.stderr[-1500:]}
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs[0], runs[1:]
    return {"d": d, "causal": causal, "cold_compiled": cold["compiled"], "cold_all_ready_s": cold["all_loaded_s"],
            "warm": warm, "warm_all_loaded_s_min": min(r["all_loaded_s"] for r in warm),
            "warm_cutlass_imported": any(r["cutlass_imported"] for r in warm)}


EAGER_CHILD = """
import json, sys, time
import torch
import ffpa_attn
q, k, v = (torch.randn(1, h, 16, 512, dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
t0 = time.perf_counter()
out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
t1 = time.perf_counter()
(out.float().sum() + lse.sum()).backward()
t2 = time.perf_counter()
print(json.dumps({"fwd_s": round(t1 - t0, 3), "bwd_s": round(t2 - t1, 3),
                  "compiler_stack_imported": sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy")
                                                    if m in sys.modules)}))
"""


def cpu_first_call(repeats: int, timeout: float) -> dict:
    """``repeats`` fresh processes timing their first eager forward and backward on CPU (see ``--cpu-first-call``)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    runs = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", EAGER_CHILD], capture_output=True, text=True, env=env,
                              timeout=timeout)
        if proc.returncode != 0:
            return {"error": proc.stderr[-1500:]}
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"shape": "q [1, 8, 16, 512], k/v [1, 2, 16, 512] bf16, causal, backend sdpa", "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", default="512,1024")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--heads", type=int, default=2, help="B=1, this many heads (query = KV)")
    ap.add_argument("--n", type=int, default=1024, help="sequence length (Nq = Nkv)")
    ap.add_argument("--serial-too", action="store_true", help="also measure with the parallel compile off")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the cold and the second process")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds one measured process may run (default 900: a cold first call compiles three kernels)")
    ap.add_argument("--cpu-load", action="store_true",
                    help="no GPU: time fresh processes loading cached kernels (see the module docstring)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="--cpu-load: warm processes per head dim; --cpu-first-call: processes (default 3)")
    ap.add_argument("--cpu-first-call", action="store_true",
                    help="no GPU: a fresh process's first eager forward + backward (see the module docstring)")
    args = ap.parse_args()
    if args.cpu_first_call:
        print(json.dumps(cpu_first_call(args.repeat, args.timeout)), flush=True)
        return
    if args.cpu_load:
        for d in (int(x) for x in args.d.split(",")):
            print(json.dumps(cpu_load(d, args.causal, args.repeat, args.timeout)), flush=True)
        return
    modes = [True, False] if args.serial_too else [True]
    shape = (args.heads, args.n)
    for d in (int(x) for x in args.d.split(",")):
        for parallel in modes:
            with tempfile.TemporaryDirectory(prefix="ffpa_first_call_") as cache:
                cold = run(d, args.causal, parallel, cache, args.profile, shape=shape, timeout=args.timeout)
                second = run(d, args.causal, parallel, cache, args.profile, shape=shape, timeout=args.timeout)
                second_warm = run(d, args.causal, parallel, cache, warm=True, shape=shape, timeout=args.timeout)
            with tempfile.TemporaryDirectory(prefix="ffpa_first_call_") as cache:
                new_shape = run(d, args.causal, parallel, cache, warm=True, shape=shape, timeout=args.timeout)
            print(json.dumps({"d": d, "causal": args.causal, "shape": f"B1 H{shape[0]} N{shape[1]}",
                              "parallel_compile": parallel, "cold_process": cold, "second_process": second,
                              "second_process_after_warmup": second_warm,
                              "new_shape_in_warm_process": new_shape}), flush=True)


if __name__ == "__main__":
    main()

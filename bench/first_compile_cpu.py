"""First-call compile time of the CuTeDSL kernels without a GPU (sm_90a): what a forward whose backward will run
pays on a cold cache, per way of compiling. One JSON line per variant, each measured in a fresh process on its
own empty cache directory:

* ``pool``: compile workers (:mod:`ffpa_attn.cache.pool`): ``api.prefetch_backward`` hands the
  backward's dK/dV and dQ kernels over, the forward kernel compiles in the measured process, then the
  backward's kernels are collected (waited for and loaded from the disk cache);
* ``serial``: the same calls with ``FFPA_ATTN_CUTE_PARALLEL_COMPILE=0``: every kernel compiles in the measured
  process, one after the other;
* ``fork``: the same calls on another copy of the package (``--fork-ref DIR``: a folder holding an
  ``ffpa_attn`` package, e.g. the version that compiled in ``os.fork()`` children of the calling process).

Each line has wall seconds of each step (``imports_s``, ``forward_ready_s``, ``backward_ready_s``,
``total_s`` = forward + backward ready, the first-call figure), and CPU seconds, which a loaded machine
distorts much less than wall time: ``cpu_caller_s`` (the measured process; ``cpu_caller_imports_s`` /
``_prefetch_s`` / ``_forward_s`` for the steps), ``cpu_children_s`` (every process
it started and waited for: compile workers, their server), ``caller_compiles`` (kernels compiled in the measured
process) and, for ``pool``, the compile server's start-up and each job (``jobs``: ``cpu_s``, ``wall_s``,
``queued_s`` = submission to start, ``compiled``). Run it from the repository root where ``import cutlass``
works (no GPU needed):

    CUTE_DSL_ARCH=sm_90a PYTHONPATH=$PWD python bench/first_compile_cpu.py --d 512 \\
        [--causal] [--variants pool,serial,fork --fork-ref DIR] [--repeat 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(d: int, causal: bool, dtype_name: str) -> dict:
    """One cold first call in this process (imports included); the ffpa_attn found first on sys.path."""
    import resource

    t_start = time.perf_counter()
    import torch

    from ffpa_attn.cutedsl import _cache, api

    compiles = []
    if not hasattr(_cache, "KERNELS"):  # a package copy without ffpa_attn.cache (the fork reference)
        export = _cache._export

        def counting_export(fn, *where):  # runs after each compile in this process (not in children)
            compiles.append(where)
            return export(fn, *where)

        _cache._export = counting_export
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    t0, c0 = time.perf_counter(), time.process_time()
    api.prefetch_backward(d, dtype, causal)
    t_prefetch, c_prefetch = time.perf_counter(), time.process_time()
    api.get_fwd_kernel(api.fwd_config(d, dtype, causal))
    t_fwd, c_fwd = time.perf_counter(), time.process_time()
    cfg = api.bwd_config(d, dtype, causal)
    api.get_bwd_kernels(cfg)
    t_all = time.perf_counter()
    cpu_caller = time.process_time()
    _cache.wait_all()
    caller_compiles = _cache.KERNELS.counts()["compiled"] if hasattr(_cache, "KERNELS") else len(compiles)
    result = {"d": d, "causal": causal, "dtype": dtype_name, "imports_s": round(t0 - t_start, 2),
              "prefetch_call_s": round(t_prefetch - t0, 2), "forward_ready_s": round(t_fwd - t0, 2),
              "backward_ready_s": round(t_all - t_fwd, 2), "total_s": round(t_all - t0, 2),
              "cpu_caller_s": round(cpu_caller, 2), "cpu_caller_imports_s": round(c0, 2),
              "cpu_caller_prefetch_s": round(c_prefetch - c0, 2), "cpu_caller_forward_s": round(c_fwd - c_prefetch, 2),
              "caller_compiles": caller_compiles}
    if hasattr(_cache, "pool"):  # a package copy without compile workers (the fork reference) has none
        pool = _cache.pool()
        result["server_startup"] = pool.startup_stats()
        result["jobs"] = pool.job_records()
        pool.shutdown()  # its processes are waited for: their CPU time lands in RUSAGE_CHILDREN
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_children_s"] = round(children.ru_utime + children.ru_stime, 2)
    import ffpa_attn

    result["package"] = os.path.dirname(ffpa_attn.__file__)
    return result


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    """``variant`` measured in a fresh process on an empty cache directory."""
    env = dict(os.environ)
    root = str(REPO)
    if variant == "serial":
        env["FFPA_ATTN_CUTE_PARALLEL_COMPILE"] = "0"
    elif variant == "fork":
        root = str(Path(args.fork_ref).resolve())
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    with tempfile.TemporaryDirectory(prefix="ffpa_first_compile_") as cache:
        env["FFPA_ATTN_CACHE_DIR"] = cache
        cmd = [sys.executable, __file__, "--measure", "--d", str(args.d), "--dtype", args.dtype]
        proc = subprocess.run(cmd + (["--causal"] if args.causal else []), capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    if proc.returncode != 0:
        return {"variant": variant, "error": proc.stderr[-2000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if variant == "fork" and Path(result["package"]).resolve() != Path(root, "ffpa_attn").resolve():
        result["error"] = f"imported {result['package']}, not the reference under {root}"
    return {"variant": variant, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512,
                        help="head dim of the kernels to compile (one the CuTeDSL backend has; default 512)")
    parser.add_argument("--causal", action="store_true", help="compile the causal kernels (default non-causal)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="input dtype (default bf16)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated: pool, serial, fork (default pool,serial; fork too with --fork-ref)")
    parser.add_argument("--fork-ref", default=None, help="folder holding the ffpa_attn package of the fork variant")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over the variants (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement (default 1800)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the measured child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.d, args.causal, args.dtype)), flush=True)
        return
    variants = (args.variants or ("pool,serial,fork" if args.fork_ref else "pool,serial")).split(",")
    unknown = set(variants) - {"pool", "serial", "fork"}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}: pick from pool, serial, fork")
    if "fork" in variants and not args.fork_ref:
        parser.error("the fork variant needs --fork-ref")
    for _ in range(args.repeat):
        for variant in variants:
            print(json.dumps(run_variant(variant, args)), flush=True)


if __name__ == "__main__":
    main()

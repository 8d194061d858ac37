"""Compile the FFPA Triton forward kernel for a GPU target without a GPU and report its resources.

For every (D, causal, config) it runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
(Hopper, sm_90a) and reads from the compiled cubin: shared memory (the compiler's number), registers per
thread, spill stores/loads and local memory (``cuobjdump --dump-resource-usage``). A config that spills in
its hot loop loses a large factor; one above the shared-memory limit cannot launch.

    python tools/compile_report.py                       # shipped candidate configs, D in {320..1024}
    python tools/compile_report.py --d 512 --causal 1 --arch 80 --all
    python tools/compile_report.py --json out.json

Runs on CPU (ptxas ships with Triton). Do not set TRITON_INTERPRET for this tool.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
import triton  # noqa: E402

from ffpa_attn.triton import fwd  # noqa: E402
from ffpa_attn.triton.autotune import KernelConfig  # noqa: E402

SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REPORT_DIMS = (320, 384, 512, 640, 768, 1024)

# argument names of the kernel that are pointers / fp32 scalars / head-dim strides (== 1 when contiguous)
_PTRS = ("Q", "K", "V", "O", "LSE", "MASK", "RNG", "CU_Q", "CU_K")
_UNIT_STRIDES = ("sqd", "skd", "svd", "sod")


def _signature(dtype: str, mask_kind: int, dropout: bool, varlen: bool, tma_blocks: dict | None):
    fn = fwd._ffpa_fwd_kernel
    sig, attrs = {}, {}
    ptr_types = {"Q": dtype, "K": dtype, "V": dtype, "O": dtype, "LSE": "fp32",
                 "MASK": {0: dtype, 1: "u8", 2: dtype}[mask_kind], "RNG": "i64", "CU_Q": "i32", "CU_K": "i32"}
    for i, name in enumerate(fn.arg_names):
        p = fn.params[i]
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in ("KD1", "KD2", "VD1", "VD2"):
            if tma_blocks:
                sig[name] = f"tensordesc<{dtype}[{','.join(map(str, tma_blocks[name]))}]>"
            else:
                sig[name] = "*" + dtype
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _PTRS:
            sig[name] = "*" + ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _UNIT_STRIDES:
            sig[name] = "constexpr"
        elif name in ("qk_scale", "p_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s") and name not in ("smn",) and not name.startswith("sl"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(d: int, causal: bool, cfg: KernelConfig, arch: int = 90, dtype: str = "bf16",
                mask_kind: int = 0, dropout: bool = False, varlen: bool = False, group: int = 1) -> dict:
    """Compile one specialization; returns shared bytes, registers, spills and local memory."""
    d1, d2 = fwd.split_dims(d)
    nsplit = cfg.opt("nsplit", 1)
    dv1, dv2 = fwd.output_dims(d, nsplit)
    tma = bool(cfg.opt("tma", False))
    tma_blocks = None
    if tma:
        def blk(w):
            w = w or 16
            return [cfg.block_n, 1, w] if varlen else [1, 1, cfg.block_n, w]
        tma_blocks = {"KD1": blk(d1), "KD2": blk(d2), "VD1": blk(dv1), "VD2": blk(dv2)}
    sig, attrs = _signature(dtype, mask_kind, dropout, varlen, tma_blocks)
    consts = dict(HEAD_DIM=d, D1=d1, D2=d2, DV1=dv1, DV2=dv2, NSPLIT=nsplit, GROUP=group, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, IS_CAUSAL=causal, MASK_KIND=mask_kind, HAS_DROPOUT=dropout,
                  IS_VARLEN=varlen, DOT_F32=False, USE_TMA=tma, WARP_SPEC=bool(cfg.opt("ws", False)))
    consts.update({n: 1 for n in _UNIT_STRIDES})
    src = ASTSource(fn=fwd._ffpa_fwd_kernel, signature=sig, constexprs=consts, attrs=attrs)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    res = {"d": d, "causal": causal, "config": str(cfg), "arch": arch, "shared": int(k.metadata.shared),
           "compile_s": round(time.time() - t0, 1)}
    res.update(_resource_usage(k.asm["cubin"]))
    res["smem_ok"] = res["shared"] <= SMEM_LIMIT.get(arch, 99 * 1024)
    return res


def _resource_usage(cubin: bytes) -> dict:
    """REG / LOCAL / spill numbers of a cubin via cuobjdump (ships with Triton) and the PTX-free SASS."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    stl = len(re.findall(r"\bSTL(\.\w+)*\b", sass))
    ldl = len(re.findall(r"\bLDL(\.\w+)*\b", sass))
    return {"regs": int(reg.group(1)) if reg else -1, "local": int(local.group(1)) if local else -1,
            "spill_stores": stl, "spill_loads": ldl}


def hot_configs(d: int, arch: int) -> list[KernelConfig]:
    """What a GPU of ``arch`` launches without a tuning run: shipped tuned defaults for D (any GPU name),
    else the first 'fast' candidate (with tensor descriptors on sm90+)."""
    from ffpa_attn.triton import autotune

    tma = arch >= 90
    shipped = []
    for per_gpu in autotune.tuned_defaults(fwd.KERNEL_NAME).values():
        for key, cfg in per_gpu.items():
            parts = key.split("|")
            if int(parts[1]) == d and bool(int(parts[7])) == tma:
                c = KernelConfig.from_dict(cfg)
                if c not in shipped:
                    shipped.append(c)
    return shipped or gpu_candidates(d, arch, tma)[:1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="*", default=list(REPORT_DIMS))
    ap.add_argument("--causal", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--all", action="store_true", help="every 'fast' candidate (default: the first 3 per D)")
    ap.add_argument("--check", action="store_true",
                    help="hot configs only (tuned defaults / first candidate); exit 1 if one exceeds the "
                         "shared-memory limit or spills")
    ap.add_argument("--no-tma", action="store_true", help="plain-pointer configs (the sm80 path)")
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    tma = args.arch >= 90 and not args.no_tma
    rows = []
    failed = 0
    print(f"{'D':>5} {'causal':>6} {'config':<34} {'smem KiB':>8} {'regs':>5} {'local':>5} {'STL':>4} {'LDL':>4} "
          f"{'ok':>3} {'s':>5}")
    for d in args.d:
        if args.check:
            cands = hot_configs(d, args.arch)
        else:
            cands = gpu_candidates(d, args.arch, tma)
            cands = cands if args.all else cands[:3]
        for causal in args.causal:
            for cfg in cands:
                try:
                    r = compile_one(d, bool(causal), cfg, arch=args.arch)
                except Exception as e:  # noqa: BLE001
                    r = {"d": d, "causal": bool(causal), "config": str(cfg), "error": str(e).splitlines()[0][:80]}
                    print(f"{d:>5} {causal:>6} {str(cfg):<34} ERROR {r['error']}", flush=True)
                    rows.append(r)
                    failed += 1
                    continue
                rows.append(r)
                ok = r["smem_ok"] and r["spill_stores"] == 0
                failed += not ok
                print(f"{d:>5} {causal:>6} {r['config']:<34} {r['shared'] / 1024:>8.1f} {r['regs']:>5} "
                      f"{r['local']:>5} {r['spill_stores']:>4} {r['spill_loads']:>4} {'yes' if ok else 'NO':>3} "
                      f"{r['compile_s']:>5}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows) - failed} ok, {failed} over the shared-memory limit, spilling or failing to compile")
    return 1 if (args.check and failed) else 0


def gpu_candidates(d: int, arch: int, tma: bool = True) -> list[KernelConfig]:
    """The candidate list a GPU of ``arch`` would get (its shared-memory limit, no device needed)."""
    class _Dev:  # minimal stand-in for a CUDA device in candidate_configs
        type = "cuda"
        index = 0

    from ffpa_attn.triton import autotune

    orig = autotune.smem_limit
    autotune.smem_limit = lambda device=None: SMEM_LIMIT.get(arch, 99 * 1024)
    try:
        return fwd.candidate_configs(d, False, _Dev(), tma=tma and arch >= 90)
    finally:
        autotune.smem_limit = orig


if __name__ == "__main__":
    sys.exit(main())

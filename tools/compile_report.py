"""Compile the FFPA Triton forward kernel for a GPU target without a GPU and report its resources.

For every (D, causal, config) it runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
(Hopper, sm_90a) and reads from the compiled cubin: shared memory (the compiler's number), registers per
thread, local memory, and spill instructions (STL/LDL in the SASS), also counted inside loop bodies only.
A config that spills in its hot loop loses a large factor (``--check`` fails on it); one above the
shared-memory limit cannot launch.

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
    """Registers, local memory and spill instructions of a cubin (cuobjdump ships with Triton).

    ``loop_spills`` counts STL/LDL inside a loop body (between a backward branch and its target): the
    hot-loop spills that cost bandwidth every iteration; spills outside loops (prologue/epilogue) are cheap.
    """
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    spills, back, exits = [], [], []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if not m:
            continue
        addr, ins = int(m.group(1), 16), m.group(2)
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        if re.match(r"(STL|LDL)\b", op):
            spills.append((addr, op))
        if op.startswith("EXIT"):
            exits.append(addr)
        br = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", ins)
        if br and int(br.group(1), 16) < addr - 0x100:
            back.append((int(br.group(1), 16), addr))
    # loop back-edges: backward branches over more than a few instructions (short ones are mbarrier
    # spin-waits) that sit before the last EXIT (after it, out-of-line blocks jump back into the body)
    last_exit = max(exits) if exits else float("inf")
    loops = [(lo, hi) for lo, hi in back if hi < last_exit]
    in_loop = [a for a, _ in spills if any(lo <= a <= hi for lo, hi in loops)]
    return {"regs": int(reg.group(1)) if reg else -1, "local": int(local.group(1)) if local else -1,
            "spill_stores": sum(op.startswith("STL") for _, op in spills),
            "spill_loads": sum(op.startswith("LDL") for _, op in spills),
            "loop_spills": len(in_loop), "loops": len(loops)}


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
          f"{'loop':>4} {'ok':>3} {'s':>5}")
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
                ok = r["smem_ok"] and r["loop_spills"] == 0
                failed += not ok
                print(f"{d:>5} {causal:>6} {r['config']:<34} {r['shared'] / 1024:>8.1f} {r['regs']:>5} "
                      f"{r['local']:>5} {r['spill_stores']:>4} {r['spill_loads']:>4} {r['loop_spills']:>4} "
                      f"{'yes' if ok else 'NO':>3} {r['compile_s']:>5}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{len(rows) - failed} ok, {failed} over the shared-memory limit, spilling in a loop or failing to "
          f"compile (STL/LDL: spill instructions anywhere; loop: inside a loop body)")
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

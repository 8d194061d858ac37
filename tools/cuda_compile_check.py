"""Compile every CUDA-backend kernel instantiation with nvcc -Xptxas -v; print registers and spills.

    python tools/cuda_compile_check.py                  # sm_80 and sm_90a
    python tools/cuda_compile_check.py --arch sm_90a --split 2

Exit status 1 on a compile error or any register spill (the CI test does the same check).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ffpa_attn.cuda.compile_check import compile_arch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="sm_80, sm_90a, ... (repeatable; default both)")
    ap.add_argument("--split", type=int, default=1, help="nvcc --split-compile threads")
    args = ap.parse_args()
    failed = False
    for arch in args.arch or ["sm_80", "sm_90a"]:
        try:
            rep = compile_arch(arch, split=args.split)
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"{arch}: {exc}")
            failed = True
            continue
        print(f"== {arch}: {len(rep.functions)} kernels in {rep.seconds:.0f} s")
        for f in sorted(rep.functions.values(), key=lambda f: f.name):
            flag = "  SPILL" if f.spills else ""
            print(f"  {f.name:40s} {f.registers:4d} regs  stack {f.stack:4d}  spill st/ld "
                  f"{f.spill_stores}/{f.spill_loads}{flag}")
        failed |= bool(rep.failures())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every kernel instantiation with nvcc ``-Xptxas -v`` and report registers and spills (no GPU).

Used by ``tests/test_cuda_backend.py`` and ``tools/cuda_compile_check.py``: one translation unit per arch
that includes the kernel source and defines one ``extern "C"`` entry point per :class:`KernelSpec`, so the
front end runs once and ptxas reports each function. A spill (stores or loads to local memory) in any
instantiation is a failure: the O accumulators must stay in registers.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

from .build import KERNEL_SOURCE, base_options, find_nvcc
from .config import KernelSpec, instantiations


@dataclass(frozen=True)
class FunctionReport:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass(frozen=True)
class ArchReport:
    arch: str
    functions: dict[str, FunctionReport]
    seconds: float
    log: str

    def failures(self) -> list[str]:
        return [f"{f.name}: {f.spill_stores} B spill stores, {f.spill_loads} B spill loads, {f.registers} regs"
                for f in self.functions.values() if f.spills]


def translation_unit(specs: list[KernelSpec]) -> str:
    lines = [f'#include "{KERNEL_SOURCE}"']
    for s in specs:
        lines.append(f"FFPA_DEFINE_KERNEL_RM({s.name}, {s.dpad}, {s.wn}, {s.nw}, {int(s.bf16)}, {int(s.acc16)}, "
                     f"{s.cw}, {s.rm})")
    return "\n".join(lines) + "\n"


_FUNC = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                   r"(\d+) bytes spill loads")
_REGS = re.compile(r"Compiling entry function '(\S+)' for '[^']+'\s*\n.*?Used (\d+) registers", re.S)


def parse_ptxas(log: str) -> dict[str, FunctionReport]:
    regs: dict[str, int] = {}
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", log):
        m = re.search(r"Compiling entry function '(\S+)'", block)
        r = re.search(r"Used (\d+) registers", block)
        if m and r:
            regs[m.group(1)] = int(r.group(1))
    out = {}
    for m in _FUNC.finditer(log):
        name = m.group(1)
        out[name] = FunctionReport(name, regs.get(name, -1), int(m.group(3)), int(m.group(4)), int(m.group(2)))
    return out


def compile_arch(arch: str, specs: list[KernelSpec] | None = None, nvcc: str | None = None,
                 split: int = 1) -> ArchReport:
    """Compile ``specs`` (default: every instantiation of ``arch``) in one nvcc call; RuntimeError on errors."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    specs = instantiations(arch) if specs is None else specs
    with tempfile.TemporaryDirectory(prefix="ffpa_cc_") as tmp:
        src = os.path.join(tmp, "all.cu")
        with open(src, "w") as f:
            f.write(translation_unit(specs))
        cmd = [nvcc, "-cubin", *base_options(arch), "-Xptxas", "-v", "-o", os.path.join(tmp, "all.cubin"), src]
        if split > 1:
            cmd[1:1] = [f"--split-compile={split}"]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        secs = time.perf_counter() - t0
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for {arch} ({' '.join(cmd)}):\n{log[-6000:]}")
    funcs = parse_ptxas(log)
    missing = [s.name for s in specs if s.name not in funcs]
    if missing:
        raise RuntimeError(f"ptxas reported no properties for {missing}:\n{log[-3000:]}")
    return ArchReport(arch, funcs, secs, log)

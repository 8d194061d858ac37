"""Compile the FFPA Triton kernels for a GPU target without a GPU: the forward's resources, and (``--matrix``)
every forward / backward kernel variant the host code launches.

For every (D, causal, config) it runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
(Hopper, sm_90a) and reads from the compiled cubin: shared memory (the compiler's number), registers per
thread, local memory, and spill instructions (STL/LDL in the SASS), also counted inside loop bodies only.
A config that spills in its hot loop loses a large factor (``--check`` fails on it); one above the
shared-memory limit cannot launch.

    python tools/compile_report.py                       # shipped candidate configs, D in {320..1024}
    python tools/compile_report.py --d 512 --causal 1 --arch 80 --all
    python tools/compile_report.py --json out.json
    python tools/compile_report.py --matrix plain --arch 80 --jobs 2   # every fwd/bwd kernel, MATRIX_DIMS
    python tools/compile_report.py --matrix all --arch 90              # every feature variant, FEATURE_DIM

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
    ap.add_argument("--matrix", choices=_MATRIX_FEATURES, default=None,
                    help="compile every forward/backward kernel variant the host code launches at --d (default "
                         "MATRIX_DIMS, after checking they cover every backward tile shape) for --arch: 'plain' "
                         "(no mask/dropout/varlen) or 'all' (default D: FEATURE_DIM); exit 1 on a failure")
    ap.add_argument("--jobs", type=int, default=1, help="--matrix: parallel compile processes")
    args = ap.parse_args(argv)
    if args.matrix:
        given = "--d" in (argv if argv is not None else sys.argv)
        dims = args.d if given else (MATRIX_DIMS if args.matrix == "plain" else (FEATURE_DIM,))
        t0 = time.time()
        if args.matrix == "plain" and not given:
            missing = uncovered_shapes(dims, args.arch)
            if missing:
                print(f"MATRIX_DIMS miss the backward tile shapes of D = {sorted(missing)[:20]} "
                      f"(e.g. {next(iter(missing.values()))})")
                return 1
            print(f"MATRIX_DIMS cover every backward tile shape of D in [16, 1024] ({time.time() - t0:.0f} s)")
        rows = compile_matrix(dims, args.arch, args.matrix, jobs=args.jobs, log=lambda m: print(m, flush=True))
        bad = [r for r in rows if "error" in r]
        print(f"{len(rows) - len(bad)} of {len(rows)} kernel specializations compiled for sm{args.arch} "
              f"({sum(r['compile_s'] for r in rows):.0f} s CPU, {time.time() - t0:.0f} s wall)")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 1 if bad else 0
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


def gpu_candidates(d: int, arch: int, tma: bool = True, plain: bool = True) -> list[KernelConfig]:
    """The candidate list a GPU of ``arch`` would get (its shared-memory limit, no device needed)."""
    class _Dev:  # minimal stand-in for a CUDA device in candidate_configs
        type = "cuda"
        index = 0

    from ffpa_attn.common import device as hw

    orig = hw.smem_limit
    hw.smem_limit = lambda device=None: SMEM_LIMIT.get(arch, 99 * 1024)
    try:
        return fwd.candidate_configs(d, False, _Dev(), tma=tma and arch >= 90, plain=plain)
    finally:
        hw.smem_limit = orig


# ------------------------------------------------------------------------------------------ compile matrix
# ``--matrix``: every Triton forward and backward kernel variant the host code can launch, compiled for one
# target. The launches are captured from the real host code (``fwd.dense_forward`` / ``varlen_forward``,
# ``bwd.dense_backward`` / ``varlen_backward``) running on meta tensors with the kernels swapped for
# recorders, then specialized the way Triton's JIT does (its own binder: 1-valued ints become constants,
# 16-divisible ints and pointers get divisibility hints) and compiled. Identical specializations compile once:
# the backward kernels take D at run time, so head dims that share slice widths share kernels.

# Why these head dims: the backward's generated code depends on D only through the tile shapes of its plans
# (fused DS=128 up to D=512, DS=256 above and for the split launch; a remainder slice of max(16,
# next_pow2(D mod DS)) columns: none / 16 / 32 / 64 / 128; the shipped tuned tiles at 384; small D clamping the
# slice to 16 / 32 / 64) and on D mod 8 (tensor descriptors need 16-byte rows) / mod 16 (divisibility hints).
# ``--matrix`` first checks that these dims produce every backward (kernel, tile shape) key any D in
# [16, 1024] produces (:func:`uncovered_shapes`): 264 / 392 / 520 / 776 are the D = 8 mod 128 cases (16-wide
# remainder of DS=128 and 256), 416 / 800 / 832 / 896 / 1016 the 32 / 64 / 128 remainders, 384 the tuned tile,
# 1024 no remainder, 16 / 32 / 64 the small-D clamps; D mod 16 classes 0, 8 and odd (265: pointer path, no
# divisibility hints). The forward (D1 + D2 split) is compiled at the same dims.
MATRIX_DIMS = (16, 32, 64, 264, 265, 384, 392, 416, 520, 776, 800, 832, 896, 1016, 1024)
# Every feature variant at one D whose plans have a single slice group (so each variant costs one kernel per
# launch): the features switch code on the [BM, BN] score tiles, the D-sweep covers the tile widths and the
# pointer path on sm90 (D=265); the pointer path's feature code is compiled for sm80.
FEATURE_DIM = 512
_MATRIX_FEATURES = ("plain", "all")


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kw)`` records the call instead of launching."""

    def __init__(self, fn, sink: list):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *args, **kw: self.sink.append((self.fn, args, kw))


def record_launches(call) -> list[tuple]:
    """``(JITFunction, args, kwargs)`` of every kernel launch ``call()`` makes (nothing runs: meta tensors)."""
    from ffpa_attn.common import delta
    from ffpa_attn.triton import bwd as bwd_mod

    sink: list = []
    mods = [(fwd, "_ffpa_fwd_kernel"), (bwd_mod, "_bwd_dkdv_kernel"), (bwd_mod, "_bwd_dq_kernel"),
            (delta, "_bwd_preprocess_kernel")]
    saved = [(m, n, getattr(m, n)) for m, n in mods]
    try:
        for m, n, fn in saved:
            setattr(m, n, _Recorder(fn, sink))
        call()
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
    return sink


def specialize(fn, args: tuple, kwargs: dict, arch: int):
    """(ASTSource, options dict) exactly as Triton's JIT builds them for a launch on ``arch``."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def _fwd_config(d: int, arch: int, plain: bool, tma: bool) -> KernelConfig:
    """The forward config a GPU of ``arch`` runs without a tuning run: the shipped tuned default of the
    feature-less problem (not the wide tile for masked / dropout calls), else the first candidate."""
    for c in hot_configs(d, arch):
        if bool(c.opt("tma", False)) == tma and (plain or not fwd._wide(d, c)):
            return c
    return gpu_candidates(d, arch, tma, plain=plain)[0]


def matrix_calls(d: int, arch: int, features: str = "all") -> list[tuple[str, object]]:
    """``(label, call)`` for every forward/backward variant at head dim ``d`` on ``arch``: each call runs the
    real host code on meta tensors.

    ``features="plain"`` (the head-dim sweep): causal calls without mask, dropout or varlen, the forward and
    the fused and split backward, tensor descriptors where the target and D allow them (sm90, D % 8 == 0).
    ``"all"``: causal and not, plus bool / float masks with mask gradients (atomic and deterministic), dropout, varlen, GQA, fp16, fp32 gradient
    storage. The features switch code on the [BM, BN] score tiles only, never the D-dependent tile widths,
    so they are compiled at one head dim (:data:`FEATURE_DIM`)."""
    import torch

    from ffpa_attn import TritonBackend
    from ffpa_attn.triton import bwd as bwd_mod
    from ffpa_attn.triton.bwd_config import BwdPlan, default_plan, fit_plan

    meta = torch.device("meta")
    b, n = 1, 128
    tmas = (arch >= 90 and d % 8 == 0,)  # what the host picks by default (the sweep's D=265: pointers on sm90)

    def dense(dtype, hq, hkv):
        q = torch.empty(b, hq, n, d, dtype=dtype, device=meta)
        k = torch.empty(b, hkv, n, d, dtype=dtype, device=meta)
        return q, k, torch.empty_like(k)

    rng = torch.empty(2, dtype=torch.int64, device=meta)
    out = []

    def fwd_call(causal, mask=None, p=0.0, dtype=torch.bfloat16, varlen=False, group=1, tma=tmas[0]):
        cfg = _fwd_config(d, arch, mask is None and p == 0.0, tma and d % 8 == 0)
        if varlen:
            q = torch.empty(2 * n, 2 * group, d, dtype=dtype, device=meta)
            k = torch.empty(2 * n, 2, d, dtype=dtype, device=meta)
            cu = torch.empty(3, dtype=torch.int32, device=meta)
            return lambda: fwd.varlen_forward(q, k, torch.empty_like(k), cu, cu, n, n, dropout_p=p, rng=rng,
                                              causal=causal, scale=1.0, config=None, kernel_config=cfg)
        q, k, v = dense(dtype, 2 * group, 2)
        return lambda: fwd.dense_forward(q, k, v, attn_mask=mask, dropout_p=p, rng=rng, causal=causal, scale=1.0,
                                         config=None, kernel_config=cfg)

    def bwd_call(plan, causal, cfg=TritonBackend(), mask=None, mask_grad=False, p=0.0, dtype=torch.bfloat16,
                 varlen=False, group=1):
        plan = fit_plan(plan, d)
        if varlen:
            q = torch.empty(2 * n, 2 * group, d, dtype=dtype, device=meta)
            k = torch.empty(2 * n, 2, d, dtype=dtype, device=meta)
            lse = torch.empty(2 * group, 2 * n, dtype=torch.float32, device=meta)
            cu = torch.empty(3, dtype=torch.int32, device=meta)
            return lambda: bwd_mod.varlen_backward(q, q, k, torch.empty_like(k), q, lse, cu, cu, n, n, dlse=None,
                                                   dropout_p=p, rng=rng, causal=causal, scale=1.0, config=cfg,
                                                   plan=plan)
        q, k, v = dense(dtype, 2 * group, 2)
        lse = torch.empty(b, 2 * group, n, dtype=torch.float32, device=meta)
        return lambda: bwd_mod.dense_backward(q, q, k, v, q, lse, dlse=None, attn_mask=mask, mask_grad=mask_grad,
                                              dropout_p=p, rng=rng, causal=causal, scale=1.0, config=cfg,
                                              plan=plan)

    def plans(split):
        """What the backward planner runs at d: the shipped tuned plan for (bf16, d, causal, split) if any
        (any GPU), else default_plan; tensor descriptors as the host would pick them."""
        from ffpa_attn.triton import autotune

        found = []
        for per_gpu in autotune.tuned_defaults(bwd_mod.KERNEL_NAME).values():
            for key, c in per_gpu.items():
                parts = key.split("|")
                if int(parts[1]) == d and bool(int(parts[3])) == split:
                    found.append(bwd_mod.config_to_plan(autotune.KernelConfig.from_dict(c)))
        found = list(dict.fromkeys(found)) or [default_plan(d, split)]
        return [BwdPlan(p.dkdv, p.dq, tma) for p in found for tma in tmas]

    for causal in ((True,) if features == "plain" else (False, True)):
        out.append((f"fwd causal={causal}", fwd_call(causal)))
        for split in (False, True):
            for plan in plans(split):
                out.append((f"bwd causal={causal} {plan.short()}", bwd_call(plan, causal)))
    if features == "plain":
        return out
    bool_mask = torch.empty(b, 1, n, n, dtype=torch.bool, device=meta)
    bias_bcast = torch.empty(1, 1, n, n, dtype=torch.bfloat16, device=meta)  # broadcast: atomic d(mask)
    bias_full = torch.empty(b, 2, n, n, dtype=torch.bfloat16, device=meta)
    out += [
        ("fwd bool mask", fwd_call(False, mask=bool_mask)),
        ("fwd float mask causal dropout", fwd_call(True, mask=bias_full, p=0.1)),
        ("fwd varlen causal dropout", fwd_call(True, p=0.1, varlen=True)),
        ("fwd varlen gqa fp16", fwd_call(False, varlen=True, group=2, dtype=torch.float16)),
        ("fwd gqa fp16", fwd_call(True, group=2, dtype=torch.float16)),
    ]
    for split in (False, True):
        for plan in plans(split):
            tag = plan.short()
            out += [
                (f"bwd bool mask gqa fp16 {tag}",
                 bwd_call(plan, False, mask=bool_mask, group=2, dtype=torch.float16)),
                (f"bwd float mask grad (broadcast) dropout {tag}",
                 bwd_call(plan, True, mask=bias_bcast, mask_grad=True, p=0.1)),
                (f"bwd float mask grad (full) fp32 dq/dkv storage {tag}",
                 bwd_call(plan, False, mask=bias_full, mask_grad=True,
                          cfg=TritonBackend(grad_q_storage_dtype=torch.float32,
                                            grad_kv_storage_dtype=torch.float32))),
                (f"bwd varlen causal dropout gqa {tag}", bwd_call(plan, True, p=0.1, varlen=True, group=2)),
                (f"bwd varlen {tag}", bwd_call(plan, False, varlen=True)),
            ]
    # deterministic: split launch and the broadcast mask's gradient through a full buffer (no atomics)
    for plan in plans(True):
        out.append((f"bwd deterministic float mask grad {plan.short()}",
                    bwd_call(plan, True, cfg=TritonBackend(deterministic=True), mask=bias_bcast, mask_grad=True)))
    return out


def shape_keys(d: int, arch: int) -> set:
    """What the code generated for the head-dim sweep (:func:`matrix_calls` ``"plain"``) at ``d`` depends on,
    with D itself abstracted: kernel, constexprs (the forward's HEAD_DIM reduced to whether it fills D1 + D2
    and the output slices, i.e. which D masks are live), warps, stages, and whether D is a multiple of 16
    (the row strides' divisibility hints). Head dims with equal keys generate the same code up to constants;
    nothing is compiled."""
    keys = set()
    for _label, call in matrix_calls(d, arch, "plain"):
        for fn, _args, kw in record_launches(call):
            consts = {k: v for k, v in kw.items() if k.isupper()}
            warps, stages = kw.get("num_warps"), kw.get("num_stages")
            if "HEAD_DIM" in consts:  # the forward: its D-dependent widths (its tile config is picked per D
                # from the candidate list, whose compiles tools/compile_report.py --check covers)
                hd = consts["HEAD_DIM"]
                consts = {k: consts[k] for k in ("D1", "D2", "DV1", "DV2", "NSPLIT", "USE_TMA")}
                consts["HEAD_DIM"] = (hd == consts["D1"] + consts["D2"],
                                      hd == consts["NSPLIT"] * (consts["DV1"] + consts["DV2"]))
                warps = stages = None
            keys.add((fn.__name__, tuple(sorted(consts.items())), warps, stages, d % 16 == 0))
    return keys


def uncovered_shapes(dims, arch: int, lo: int = 16, hi: int = 1024) -> dict[int, set]:
    """Head dims in [lo, hi] whose backward (kernel, tile shape) keys (:func:`shape_keys` without the D-class
    flags) no head dim of ``dims`` produces: ``{d: missing keys}`` (empty when ``dims`` cover the range)."""
    def bwd_shapes(d):
        return {(k[0], tuple(c for c in k[1] if c[0] != "USE_TMA"), k[2], k[3]) for k in shape_keys(d, arch)
                if k[0] != "_ffpa_fwd_kernel"}

    have = set().union(*(bwd_shapes(d) for d in dims))
    missing = {}
    for d in range(lo, hi + 1):
        extra = bwd_shapes(d) - have
        if extra:
            missing[d] = extra
    return missing


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (ptxas runs as a child)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


_TASKS: list = []  # (src, options, arch) of compile_matrix, read by forked workers


def _compile_task(i: int) -> tuple[float, str | None]:
    src, opts, arch = _TASKS[i]
    t0 = _cpu_s()
    try:
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"
    return round(_cpu_s() - t0, 2), err


def compile_matrix(dims, arch: int, features: str = "all", jobs: int = 1, log=print) -> list[dict]:
    """Compile every distinct kernel specialization of :func:`matrix_calls` for ``dims`` on ``arch`` (``jobs``
    forked workers). Returns one row per specialization: kernel, the first variant that launched it, its
    constexprs, compile CPU seconds (ptxas included) and an ``error`` line when it failed."""
    seen: set = set()
    rows: list[dict] = []
    _TASKS.clear()
    for d in dims:
        for label, call in matrix_calls(d, arch, features):
            for fn, args, kw in record_launches(call):
                src, opts = specialize(fn, args, kw, arch)
                key = src.hash() + repr(sorted((k, str(v)) for k, v in opts.items()))
                if key in seen:
                    continue
                seen.add(key)
                shown = {k: (int(v) if isinstance(v, bool) else v) for k, v in kw.items()
                         if k.isupper() and k not in ("INTERP", "DOT_F32")}
                rows.append({"kernel": fn.__name__, "d": d, "arch": arch, "variant": label, "constexprs": shown,
                             "num_warps": opts.get("num_warps"), "num_stages": opts.get("num_stages")})
                _TASKS.append((src, opts, arch))
    if jobs > 1:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as ex:
            results = ex.map(_compile_task, range(len(_TASKS)))
    else:
        results = map(_compile_task, range(len(_TASKS)))
    for row, (secs, err) in zip(rows, results):
        row["compile_s"] = secs
        if err:
            row["error"] = err
        brief = " ".join(f"{k}={v}" for k, v in row["constexprs"].items())
        log(f"{'FAIL' if err else 'ok':4} {secs:5.1f}s D={row['d']:<5} {row['kernel']:23} {row['variant']} | "
            f"{brief}" + (f"\n     {err}" if err else ""))
    _TASKS.clear()
    return rows


if __name__ == "__main__":
    sys.exit(main())

"""Command line of ffpa-attn: ``python -m ffpa_attn [--version] [check | bench | info | report]`` (also
``ffpa-attn``).

* no subcommand: ``check``, then on a GPU the standard ``bench`` sweep (D in {320, 384, 512, 640, 768,
  1024}, causal and not, plus GQA at D=512, forward and backward); ``--out DIR`` writes
  ``DIR/<gpu>.md/.json/.png``. On a CPU-only machine only the check runs. Exit code: the check's.
* ``check``: every available backend against the fp32 reference (forward + gradients); exit 1 on any
  failure. Without a GPU it sets ``TRITON_INTERPRET=1`` (before triton is imported: this module imports
  no kernel) and runs the Triton kernels on tiny shapes.
* ``bench``: times our backends and the peers on the same inputs; prints a table, writes JSON /
  Markdown / PNG on request. Without a GPU it exits with code 2 and a message unless ``--dry-run`` (tiny
  shapes on the CPU under the Triton interpreter, to exercise the pipeline). Exit 0 once it ran, even if
  some implementation failed (its cells say why).
* ``info``: versions, GPU, and which backends are available (and why not).
* ``report RESULTS.json [...]``: re-print saved runs (several on one GPU merged) and re-write Markdown / PNG.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from . import __version__

STANDARD_D = (320, 384, 512, 640, 768, 1024)
STANDARD_SEQLEN = 8192
STANDARD_HEADS = 32
STANDARD_GQA_D = 512  # the GQA cases of the standard sweep (Gemma-style D=512 global layers)
STANDARD_GQA = 4
STANDARD_TIME_BUDGET_S = 450.0  # check + sweep; the last measurement started may run past it
STANDARD_MIN_BENCH_S = 60.0
DRY_RUN = {"d": [320, 512], "seqlen": 64, "heads": 2, "reps": 2}
EXIT_NO_GPU = 2


def _int_list(text: str) -> list[int]:
    """``"320,512"`` -> [320, 512] (positive ints)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(x < 1 for x in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _name_list(text: str) -> list[str]:
    from .bench.impls import IMPL_NAMES, VARIANT_IMPLS
    from .bench.varlen import VARLEN_IMPLS

    known = (*IMPL_NAMES, *VARIANT_IMPLS, *(n for n in VARLEN_IMPLS if n not in IMPL_NAMES))
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(bad) or repr(text)}; "
                                         f"choose from {', '.join((*IMPL_NAMES, *VARIANT_IMPLS))} "
                                         f"(--varlen: {', '.join(VARLEN_IMPLS)})")
    return names


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="write DIR/<gpu>.json, .md and .png")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--md", metavar="PATH", help="write the Markdown report")
    p.add_argument("--plot", metavar="PATH", help="write the PNG plot (needs matplotlib)")
    _add_history_arg(p)


def _add_history_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--append-history", metavar="PATH",
                   help="append one JSON line per measured number to PATH (e.g. bench/results/history.jsonl)")


def append_history(run, path: str | None) -> None:
    """Append ``run`` to the history file ``path`` when one was given (``ffpa_attn.bench.history``)."""
    if not path:
        return
    from .bench.history import append_history as append

    print(f"appended {append(run, path)} rows to {path}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ffpa_attn",
        description="ffpa-attn self-check, benchmark and environment report. Without a subcommand: check, "
                    "then (on a GPU) the standard benchmark sweep.")
    parser.add_argument("--version", action="version", version=f"ffpa-attn {__version__}")
    parser.add_argument("--out", metavar="DIR", help="(no subcommand) write the sweep to DIR/<gpu>.json/.md/.png")
    parser.add_argument("--time-budget", type=_positive_float, default=STANDARD_TIME_BUDGET_S, metavar="S",
                        help="(no subcommand) stop starting measurements S seconds after the start, check included "
                             "(default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_history_arg(parser)
    sub = parser.add_subparsers(dest="cmd", metavar="{check,bench,info,report}")

    pc = sub.add_parser("check", help="run each available backend against the fp32 reference")
    pc.add_argument("--backend", type=lambda s: [x for x in s.split(",") if x], metavar="NAMES",
                    help="comma-separated backends to check (default: all available)")

    pb = sub.add_parser("bench", help="time our backends and the peers on the same inputs",
                        description="Time our backends and the peers (torch SDPA backends, FlexAttention, the "
                                    "public ffpa-attn via FFPA_UPSTREAM_PATH) on the same random inputs. "
                                    "Exits 2 without a GPU unless --dry-run.")
    pb.add_argument("--d", type=_int_list, default=None, metavar="D,D,..",
                    help=f"head dims (default {','.join(map(str, STANDARD_D))})")
    pb.add_argument("--seqlen", type=_positive_int, default=None, help=f"query length (default {STANDARD_SEQLEN})")
    pb.add_argument("--seqlen-kv", type=_positive_int, default=None, help="key/value length (default: --seqlen)")
    pb.add_argument("--batch", type=_positive_int, default=1)
    pb.add_argument("--heads", type=_positive_int, default=None, help=f"query heads (default {STANDARD_HEADS})")
    pb.add_argument("--kv-heads", type=_positive_int, default=None, help="key/value heads (instead of --gqa)")
    pb.add_argument("--gqa", type=_int_list, default=None, metavar="G,G,..",
                    help="query heads per KV head; a list sweeps them (default 1)")
    pb.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    pb.add_argument("--bwd", action="store_true", help="also time forward+backward")
    pb.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    pb.add_argument("--impl", type=_name_list, default=None, metavar="NAMES",
                    help="comma-separated implementations (default: all; upstream-* need FFPA_UPSTREAM_PATH)")
    pb.add_argument("--reps", type=_positive_int, default=None, help="most timed runs per measurement (default 20)")
    pb.add_argument("--min-reps", type=_positive_int, default=None, help="fewest timed runs (default 5)")
    pb.add_argument("--budget", type=_positive_float, default=1.0, metavar="S",
                    help="target seconds of timed runs per measurement (default %(default)s)")
    pb.add_argument("--time-budget", type=_positive_float, default=None, metavar="S",
                    help="stop starting measurements after S seconds (remaining cells: skipped)")
    pb.add_argument("--seed", type=int, default=0)
    pb.add_argument("--no-progress", action="store_true", help="no progress bar")
    pb.add_argument("--varlen", action="store_true",
                    help="packed-sequence forward instead: ffpa_attn_varlen_func on CuTeDSL and Triton, the dense "
                         "CuTeDSL call of the same work and torch SDPA looped over the sequences (default D=512, "
                         "32/8 heads, 8 sequences of 16K tokens; TFLOPS counted per sequence)")
    pb.add_argument("--varlen-lens", type=_int_list, default=None, metavar="N,N,..",
                    help="--varlen: the sequence lengths (default 6144,3072,2048,1536,1280,1024,768,512)")
    pb.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU (Triton interpreter): exercises the whole pipeline, times nothing "
                         "meaningful")
    _add_output_args(pb)

    sub.add_parser("info", help="versions, GPU, backend availability")

    pr = sub.add_parser("report", help="re-print a saved JSON run and re-write its Markdown / plot",
                        description="Re-print saved JSON sweeps and re-write their Markdown / plot. Several sweeps "
                                    "on one GPU are merged into one table (a later sweep's measured cells replace an "
                                    "earlier sweep's; the report lists each sweep and the cases it contributes).")
    pr.add_argument("results", metavar="RESULTS.json", nargs="+")
    pr.add_argument("--json", metavar="PATH", help="write the (merged) run as JSON")
    pr.add_argument("--md", metavar="PATH")
    pr.add_argument("--plot", metavar="PATH")
    _add_history_arg(pr)
    return parser


def use_interpreter_without_gpu() -> bool:
    """Without CUDA, turn the Triton interpreter on (must precede the first import of a kernel module)."""
    if torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET", "") != "1":
        if "triton" in sys.modules:
            print("warning: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    return True


# --------------------------------------------------------------------------------------------- commands


def cmd_info() -> int:
    from .bench.env import info_lines

    print("\n".join(info_lines()))
    return 0


def cmd_check(backends: Sequence[str] | None = None) -> int:
    use_interpreter_without_gpu()
    from .bench.check import run_check
    from .bench.env import default_device

    if backends is not None:
        from .config import BACKEND_CLASSES

        bad = [b for b in backends if b not in BACKEND_CLASSES]
        if bad:
            print(f"check: unknown backend(s) {', '.join(bad)}; choose from {', '.join(BACKEND_CLASSES)}",
                  file=sys.stderr)
            return 2
    return run_check(default_device(), backends)


def _cases(d_list: Sequence[int], causal: Sequence[bool], gqa: Sequence[int], *, batch: int, heads: int,
           nq: int, nkv: int, dtype: str, kv_heads: int | None = None) -> list:
    from .bench.results import Case

    out = []
    for d, c, g in itertools.product(d_list, causal, gqa):
        hkv = kv_heads if kv_heads is not None else heads // g
        out.append(Case(d=d, causal=c, b=batch, hq=heads, hkv=hkv, nq=nq, nkv=nkv, dtype=dtype))
    return out


def standard_cases() -> list:
    """The main job's sweep: 6 head dims x causal/full (MHA) + GQA 4 at D=512 x causal/full."""
    common = dict(batch=1, heads=STANDARD_HEADS, nq=STANDARD_SEQLEN, nkv=STANDARD_SEQLEN, dtype="bf16")
    return (_cases(STANDARD_D, (False, True), (1,), **common)
            + _cases((STANDARD_GQA_D,), (False, True), (STANDARD_GQA,), **common))


def bench_cases(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    """Cases of ``bench`` from its arguments (``parser.error`` on inconsistent ones)."""
    dry = args.dry_run
    d_list = args.d or (DRY_RUN["d"] if dry else list(STANDARD_D))
    nq = args.seqlen or (DRY_RUN["seqlen"] if dry else STANDARD_SEQLEN)
    nkv = args.seqlen_kv or nq
    heads = args.heads or (DRY_RUN["heads"] if dry else STANDARD_HEADS)
    if args.kv_heads is not None and args.gqa is not None:
        parser.error("give --gqa or --kv-heads, not both")
    if args.kv_heads is not None and heads % args.kv_heads:
        parser.error(f"--heads {heads} is not a multiple of --kv-heads {args.kv_heads}")
    gqa = args.gqa or [1]
    for g in gqa:
        if heads % g:
            parser.error(f"--heads {heads} is not a multiple of the GQA group {g}")
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    if True in causal and nkv < nq:
        parser.error(f"causal needs --seqlen-kv >= --seqlen (got {nkv} < {nq})")
    return _cases(d_list, causal, gqa, batch=args.batch, heads=heads, nq=nq, nkv=nkv, dtype=args.dtype,
                  kv_heads=args.kv_heads)


def _command_line(argv: Sequence[str]) -> str:
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    head = "ffpa-attn" if prog == "ffpa-attn" else "python -m ffpa_attn"
    return f"{head} {shlex.join(list(argv))}".rstrip()


def _output_paths(args: argparse.Namespace, slug: str) -> dict[str, Path | None]:
    paths: dict[str, Path | None] = {k: (Path(getattr(args, k)) if getattr(args, k, None) else None)
                                     for k in ("json", "md", "plot")}
    out = getattr(args, "out", None)
    if out:
        ext = {"json": "json", "md": "md", "plot": "png"}
        for k in paths:
            if paths[k] is None:
                paths[k] = Path(out) / f"{slug}.{ext[k]}"
    return paths


def write_outputs(run, paths: dict[str, Path | None], quiet: bool = False) -> None:
    """Write the JSON / Markdown / PNG files that were asked for (a missing matplotlib only warns)."""
    from .bench.report import markdown_report

    for key, path in paths.items():
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if key == "json":
            path.write_text(run.to_json() + "\n")
        elif key == "md":
            path.write_text(markdown_report(run))
        else:
            try:
                from .bench.plot import write_plot

                write_plot(run, path)
            except ImportError as exc:
                print(f"no plot written ({exc}); pip install matplotlib", file=sys.stderr)
                continue
        if not quiet:
            print(f"wrote {path}")


def _run_bench(cases: list, impl_names: Sequence[str] | None, opts, command: str, paths: dict,
               device: torch.device, history: str | None = None) -> int:
    from .bench import upstream
    from .bench.env import run_meta
    from .bench.impls import left_out_by_default, make_impls
    from .bench.report import text_report
    from .bench.runner import run_sweep

    impls = make_impls(impl_names)
    meta = run_meta(command, device)
    if impl_names is None:  # say which peers a default run leaves out, and why
        meta["left_out"] = left_out_by_default()
    print(f"bench: {len(cases)} cases x {len(impls)} implementations on {meta['gpu_name']} "
          f"({'fwd+bwd' if opts.bwd else 'fwd'}); first calls compile/autotune", flush=True)
    partial = {k: p for k, p in paths.items() if k != "plot"}

    def checkpoint(r) -> None:  # partial JSON / Markdown after each case, quietly
        if any(partial.values()):
            write_outputs(r, partial, quiet=True)

    run = run_sweep(cases, impls, device, opts, meta, checkpoint=checkpoint)
    mod = sys.modules.get(upstream.ALIAS)
    if mod is not None:
        run.meta["upstream"] = f"{upstream.version(mod)} from {upstream.upstream_path()}"
    print(text_report(run))
    write_outputs(run, paths)
    append_history(run, history)
    return 0


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    from .bench.env import default_device, gpu_slug
    from .bench.runner import SweepOptions

    if args.varlen:
        # the packed-sequence table is forward-only, printed, and sized by --varlen-lens: refuse what it would ignore
        ignored = [flag for flag, given in (
            ("--append-history", args.append_history), ("--out", args.out), ("--json", args.json), ("--md", args.md),
            ("--plot", args.plot), ("--bwd", args.bwd), ("--time-budget", args.time_budget is not None),
            ("--seqlen", args.seqlen is not None), ("--seqlen-kv", args.seqlen_kv is not None),
            ("--batch", args.batch != 1), ("--gqa with several values", args.gqa and len(args.gqa) > 1)) if given]
        if ignored:
            parser.error(f"bench --varlen (a forward-only table, printed, not saved; shapes from --varlen-lens) "
                         f"does not take {', '.join(ignored)}")
        return cmd_bench_varlen(args, parser)
    if args.varlen_lens:
        parser.error("--varlen-lens needs --varlen")
    cases = bench_cases(args, parser)
    if args.min_reps is not None and args.reps is not None and args.min_reps > args.reps:
        parser.error(f"--min-reps {args.min_reps} > --reps {args.reps}")
    if args.dry_run:
        use_interpreter_without_gpu()
        device = torch.device("cpu")
        max_reps = args.reps or DRY_RUN["reps"]
        min_reps = min(args.min_reps or 1, max_reps)
        budget = min(args.budget, 0.1)
    else:
        if not torch.cuda.is_available():
            print("bench needs a CUDA GPU and none was found; `python -m ffpa_attn check` runs the kernels "
                  "on the CPU, `bench --dry-run` exercises the benchmark pipeline on tiny CPU shapes.",
                  file=sys.stderr)
            return EXIT_NO_GPU
        device = default_device()
        max_reps = args.reps or 20
        min_reps = min(args.min_reps or 5, max_reps)
        budget = args.budget
    opts = SweepOptions(bwd=args.bwd, max_reps=max_reps, min_reps=min_reps, budget_s=budget,
                        time_budget_s=args.time_budget, seed=args.seed, show_progress=not args.no_progress)
    slug = gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu-dry-run"
    return _run_bench(cases, args.impl, opts, _command_line(argv), _output_paths(args, slug), device,
                      args.append_history)


def cmd_bench_varlen(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``bench --varlen``: the packed-sequence forward (:mod:`ffpa_attn.bench.varlen`); prints a table."""
    if args.dry_run:
        use_interpreter_without_gpu()
    from .bench.varlen import DEFAULT_LENS, DRY_RUN_LENS, VARLEN_IMPLS, default_cases, run_varlen_bench, varlen_report

    dry = args.dry_run
    heads = args.heads or (DRY_RUN["heads"] if dry else STANDARD_HEADS)
    kv_heads = args.kv_heads or heads // (args.gqa[0] if args.gqa else (1 if dry else STANDARD_GQA))
    if heads % kv_heads:
        parser.error(f"--heads {heads} is not a multiple of the KV heads {kv_heads}")
    d_list = args.d or ([DRY_RUN["d"][-1]] if dry else [STANDARD_GQA_D])
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    lens = args.varlen_lens or (DRY_RUN_LENS if dry else DEFAULT_LENS)
    cases = default_cases(d_list, causal, heads, kv_heads, args.dtype, lens)
    impls = args.impl or list(VARLEN_IMPLS)
    if dry:
        device = torch.device("cpu")
        reps = dict(max_reps=args.reps or DRY_RUN["reps"], min_reps=1, budget_s=0.1)
    else:
        if not torch.cuda.is_available():
            print("bench needs a CUDA GPU and none was found; `bench --varlen --dry-run` exercises the pipeline on "
                  "the CPU.", file=sys.stderr)
            return EXIT_NO_GPU
        from .bench.env import default_device

        device = default_device()
        reps = dict(max_reps=args.reps or 20, min_reps=min(args.min_reps or 5, args.reps or 20), budget_s=args.budget)
    print(f"bench --varlen: {len(cases)} cases x {len(impls)} implementations on {device} (forward)", flush=True)
    print(varlen_report(run_varlen_bench(cases, impls, device, seed=args.seed, **reps)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.report import text_report
    from .bench.results import BenchRun, merge_runs

    runs = []
    for name in args.results:
        try:
            runs.append(BenchRun.from_json(Path(name).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"report: cannot read {name}: {exc}", file=sys.stderr)
            return 2
    if len(runs) > 1:
        if args.append_history:  # each run's rows belong to its own command / commit: append them one by one
            print("report: --append-history takes one RESULTS.json (append each run on its own)", file=sys.stderr)
            return 2
        try:
            run = merge_runs(runs)
        except ValueError as exc:
            print(f"report: {exc}", file=sys.stderr)
            return 2
    else:
        run = runs[0]
    print(text_report(run))
    write_outputs(run, {"json": Path(args.json) if args.json else None, "md": Path(args.md) if args.md else None,
                        "plot": Path(args.plot) if args.plot else None})
    append_history(run, args.append_history)
    return 0


def cmd_default(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """check, then the standard sweep on a GPU (``--time-budget`` covers both)."""
    start = time.monotonic()
    code = cmd_check()
    if not torch.cuda.is_available():
        print("\nNo CUDA GPU found: only the check ran (the benchmark needs a GPU).")
        return code
    from .bench.env import default_device, gpu_slug
    from .bench.runner import SweepOptions

    print()
    device = default_device()
    left = max(STANDARD_MIN_BENCH_S, args.time_budget - (time.monotonic() - start))
    opts = SweepOptions(bwd=True, max_reps=20, min_reps=5, budget_s=1.0, time_budget_s=left,
                        show_progress=not args.no_progress)
    paths = _output_paths(argparse.Namespace(out=args.out), gpu_slug(torch.cuda.get_device_name(device)))
    _run_bench(standard_cases(), None, opts, _command_line(argv), paths, device, args.append_history)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ffpa_attn`` and the ``ffpa-attn`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "info":
        return cmd_info()
    if args.cmd == "check":
        return cmd_check(args.backend)
    if args.cmd == "bench":
        return cmd_bench(args, parser, argv)
    if args.cmd == "report":
        return cmd_report(args)
    return cmd_default(args, argv)

"""Command line of ffpa-attn: ``python -m ffpa_attn [--version] [check | bench | info | report | explain]`` (also
``ffpa-attn``, the console script).

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
* ``report RESULTS.json [...]``: re-print saved runs (several on one GPU merged) and re-write Markdown / PNG;
  exit 2 for a file that is not a results file of ``bench``.
* ``explain``: the plan (:func:`ffpa_attn.explain` / :func:`ffpa_attn.explain_varlen`) of one call described by
  shape flags, on this machine's device, without allocating the inputs.
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

from ._version import __distribution__, __version__

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
    from .bench.kvcache import IMPLS as DECODE_IMPLS
    from .bench.varlen import VARLEN_IMPLS

    decode = (*DECODE_IMPLS, "serving")  # serving: the paged varlen rows of --decode
    known = (*IMPL_NAMES, *VARIANT_IMPLS, *(n for n in (*VARLEN_IMPLS, *decode) if n not in IMPL_NAMES))
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown implementation(s) {', '.join(bad) or repr(text)}; "
                                         f"choose from {', '.join((*IMPL_NAMES, *VARIANT_IMPLS))} "
                                         f"(--varlen: {', '.join(VARLEN_IMPLS)}; --decode: {', '.join(decode)})")
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


CONSOLE_SCRIPT = "ffpa-attn"  # pyproject.toml's [project.scripts] name


def prog_name() -> str:
    """How the user started the CLI: ``ffpa-attn`` (the console script) or ``python -m ffpa_attn``."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return CONSOLE_SCRIPT if prog == CONSOLE_SCRIPT else "python -m ffpa_attn"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog_name(),
        description=f"{__distribution__} (imports as ffpa_attn) self-check, benchmark and environment report. "
                    "Without a subcommand: check, then (on a GPU) the standard benchmark sweep.")
    parser.add_argument("--version", action="version", version=f"{__distribution__} {__version__}")
    parser.add_argument("--out", metavar="DIR", help="(no subcommand) write the sweep to DIR/<gpu>.json/.md/.png")
    parser.add_argument("--time-budget", type=_positive_float, default=STANDARD_TIME_BUDGET_S, metavar="S",
                        help="(no subcommand) stop starting measurements S seconds after the start, check included "
                             "(default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_history_arg(parser)
    sub = parser.add_subparsers(dest="cmd", metavar="{check,bench,info,report,explain}")

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
    pb.add_argument("--decode", action="store_true",
                    help="KV-cache attention instead: ffpa_attn_with_kvcache on paged (pages of 16 / 64 / 256) and "
                         "contiguous caches at D=512 bf16, B=32, 32/8 heads, 4K and 32K cached keys, Nq 1 and 4, plus "
                         "a chunked-prefill row (2K new tokens onto a 30K cache), beside ffpa_attn_func and torch "
                         "SDPA over the gathered cache (--impl kvcache,dense,sdpa); GB/s, %% of a device copy, "
                         "TFLOPS, tokens/s per layer; then the serving rows (--impl serving): the paged varlen call "
                         "over B=8 chunks of 2K queries on 32K keys (pages 16 / 64 / 256): planner's route, Triton in "
                         "place, packed by hand, dense forward; and a mixed batch (32 decode rows over 4K-32K keys + "
                         "4 chunks) in one call against the decode and chunk calls apart")
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
    _add_explain_parser(sub)
    return parser


def _add_explain_parser(sub) -> None:
    pe = sub.add_parser("explain", help="which backend and kernel a call of this shape runs here, and why",
                        description="Print ffpa_attn.explain(...) (or explain_varlen with --varlen-lens) for a call "
                                    "of the given shape on this machine's default device (--device to choose). The "
                                    "inputs are never allocated (one element, broadcast): the plan depends on "
                                    "shapes, dtype, device and options only.")
    pe.add_argument("--batch", type=_positive_int, default=1, help="batch size (dense; default %(default)s)")
    pe.add_argument("--hq", "--heads", dest="hq", type=_positive_int, default=STANDARD_HEADS,
                    help="query heads (default %(default)s)")
    pe.add_argument("--hkv", "--kv-heads", dest="hkv", type=_positive_int, default=None,
                    help="key/value heads (default: --hq; fewer means GQA)")
    pe.add_argument("--gqa", type=_positive_int, default=None, metavar="G",
                    help="query heads per key/value head (instead of --hkv)")
    pe.add_argument("--seqlen", type=_positive_int, default=STANDARD_SEQLEN,
                    help="query length (dense; default %(default)s)")
    pe.add_argument("--seqlen-kv", type=_positive_int, default=None, help="key/value length (default: --seqlen)")
    pe.add_argument("--d", type=_positive_int, default=STANDARD_GQA_D, help="head dim (default %(default)s)")
    pe.add_argument("--dv", type=_positive_int, default=None, help="value head dim (default: --d)")
    pe.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    pe.add_argument("--causal", nargs="?", const="yes", default="no", choices=("yes", "no"),
                    help="causal, tail-aligned (--causal or --causal yes)")
    pe.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout_p (default %(default)s)")
    pe.add_argument("--mask", choices=("none", "bool", "float"), default="none",
                    help="an attn_mask of this kind, [B, Hq, Nq, Nkv] (dense only)")
    pe.add_argument("--backend", default=None, help="backend= (triton, cutedsl, cuda, sdpa)")
    pe.add_argument("--forward-backend", default=None, help="forward_backend=")
    pe.add_argument("--backward-backend", default=None, help="backward_backend=")
    pe.add_argument("--no-grad", action="store_true",
                    help="inference: no input requires grad (default: the inputs require grad, as in training)")
    pe.add_argument("--varlen-lens", type=_int_list, default=None, metavar="N,N,..",
                    help="packed sequences of these query lengths: explains ffpa_attn_varlen_func")
    pe.add_argument("--varlen-lens-kv", type=_int_list, default=None, metavar="N,N,..",
                    help="their key lengths (default: --varlen-lens)")
    pe.add_argument("--device", default=None, help="device of the inputs (default: cuda when present, else cpu)")


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
    return f"{prog_name()} {shlex.join(list(argv))}".rstrip()


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

    if args.decode:
        ignored = [flag for flag, given in (
            ("--varlen", args.varlen), ("--out", args.out), ("--md", args.md), ("--plot", args.plot),
            ("--bwd", args.bwd), ("--time-budget", args.time_budget is not None), ("--d", args.d),
            ("--seqlen", args.seqlen is not None), ("--seqlen-kv", args.seqlen_kv is not None),
            ("--batch", args.batch != 1), ("--heads", args.heads), ("--kv-heads", args.kv_heads), ("--gqa", args.gqa),
            ("--causal", args.causal != "both"), ("--dtype", args.dtype != "bf16"), ("--varlen-lens", args.varlen_lens),
            ("--reps", args.reps), ("--min-reps", args.min_reps)) if given]
        if ignored:
            parser.error(f"bench --decode (fixed serving shapes; --json / --append-history / --impl / --dry-run) does "
                         f"not take {', '.join(ignored)}")
        return cmd_bench_decode(args, parser, argv)
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


def cmd_bench_decode(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """``bench --decode``: the KV-cache table (:mod:`ffpa_attn.bench.kvcache`); prints it, writes ``--json`` and
    appends ``--append-history``."""
    if args.dry_run:
        use_interpreter_without_gpu()
    from .bench.env import default_device, run_meta
    from .bench.kvcache import DEFAULT_CASES, DRY_RUN_CASES, IMPLS, decode_report, run_decode_bench, write_results

    impls = args.impl or [*IMPLS, "serving"]
    unknown = [i for i in impls if i not in (*IMPLS, "serving")]
    if unknown:
        parser.error(f"bench --decode: unknown --impl {', '.join(unknown)} (known: {', '.join(IMPLS)}, serving)")
    serving = "serving" in impls
    impls = [i for i in impls if i != "serving"]
    if args.dry_run:
        device, cases = torch.device("cpu"), DRY_RUN_CASES
    else:
        if not torch.cuda.is_available():
            print("bench needs a CUDA GPU and none was found; `bench --decode --dry-run` exercises the pipeline on "
                  "the CPU.", file=sys.stderr)
            return EXIT_NO_GPU
        device, cases = default_device(), DEFAULT_CASES
    print(f"bench --decode: {len(cases)} cases x {len(impls)} implementations on {device}", flush=True)
    cells = run_decode_bench(cases, device, impls=impls,
                             progress=lambda cell: print(decode_report([cell]).splitlines()[-1], flush=True)
                             ) if impls else []
    print(decode_report(cells))
    meta = run_meta(_command_line(argv), device)
    serving_cells = _bench_serving(device) if serving else []
    write_results(cells, meta, args.json, None)
    rows = 0
    if args.append_history:  # one append per run (append_rows skips a run already in the file)
        from .bench.history import append_rows
        from .bench.kvcache import history_rows, serving_history_rows

        rows = append_rows(history_rows(cells, meta) + serving_history_rows(serving_cells, meta), args.append_history)
    if serving_cells and args.json:
        _add_to_json(args.json, "serving", [c.to_dict() for c in serving_cells])
    if args.json:
        print(f"wrote {args.json}")
    if args.append_history:
        print(f"appended {rows} rows to {args.append_history}")
    return 0


def _bench_serving(device: torch.device) -> list:
    """The serving rows of ``bench --decode`` (:data:`ffpa_attn.bench.kvcache.SERVING_CASES`: paged prefill and a
    mixed decode + prefill batch through the paged varlen call), printed; returns the cells."""
    from .bench.kvcache import SERVING_CASES, SERVING_DRY_RUN_CASES, run_serving_bench, serving_report

    cases = SERVING_DRY_RUN_CASES if device.type == "cpu" else SERVING_CASES
    print(f"serving rows: {len(cases)} cases on {device}", flush=True)
    cells = run_serving_bench(cases, device,
                              progress=lambda cell: print(serving_report([cell]).splitlines()[-1], flush=True))
    print(serving_report(cells))
    return cells


def _add_to_json(path: str, key: str, value: object) -> None:
    """Add ``key`` to the JSON object written at ``path``."""
    import json

    with open(path) as f:
        data = json.load(f)
    data[key] = value
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def cmd_report(args: argparse.Namespace) -> int:
    from .bench.report import text_report
    from .bench.results import BenchRun, merge_runs

    runs = []
    for name in args.results:
        try:
            run = BenchRun.from_json(Path(name).read_text())
        except OSError as exc:
            print(f"report: cannot read {name}: {exc}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError) as exc:  # not text, no JSON, or JSON of another shape
            why = str(exc) if "results file" in str(exc) else \
                f"not a benchmark results file ({type(exc).__name__}: {exc})"
            print(f"report: {name}: {why} (`{prog_name()} bench --json` writes them)", file=sys.stderr)
            return 2
        if not run.cells:  # e.g. a JSON file of something else: an empty table would look like a result
            print(f"report: {name} holds no measurements (not a results file of `{prog_name()} bench`)",
                  file=sys.stderr)
            return 2
        runs.append(run)
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


_EXPLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _placeholder(shape: Sequence[int], dtype: torch.dtype, device: torch.device, grad: bool) -> torch.Tensor:
    """A tensor of ``shape`` backed by one element (a broadcast view): enough for planning, no allocation."""
    return torch.empty((), dtype=dtype, device=device, requires_grad=grad).expand(*shape)


def _call_line(func: str, shapes: str, kwargs: dict, grad: bool) -> str:
    """``func(shapes, key=value, ...)`` as the explained call reads, and whether its inputs require grad."""
    args = ", ".join([shapes, *(f"{k}={v!r}" for k, v in kwargs.items())])
    return f"{func}({args})" + ("  [inputs require grad]" if grad else "  [no grad]")


def cmd_explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``explain``: print the plan of the call the flags describe (exit 1 with the error the call would raise)."""
    from .bench.env import default_device
    from .interface import explain, explain_varlen

    try:
        device = torch.device(args.device) if args.device else default_device()
    except RuntimeError as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU found")
    dtype = _EXPLAIN_DTYPES[args.dtype]
    if args.gqa is not None and args.hkv is not None:
        parser.error("give --gqa or --hkv, not both")
    if args.gqa is not None and args.hq % args.gqa:
        parser.error(f"--hq {args.hq} is not a multiple of the GQA group {args.gqa}")
    hkv = args.hq // args.gqa if args.gqa else (args.hkv or args.hq)
    causal = args.causal == "yes"
    dv = args.dv or args.d
    dims = f"{args.d}" if dv == args.d else f"{args.d}/{dv}"  # the k / v head dims as the call line shows them
    grad = not args.no_grad
    kwargs: dict = {k: getattr(args, k) for k in ("backend", "forward_backend", "backward_backend")
                    if getattr(args, k) is not None}
    if args.varlen_lens_kv and not args.varlen_lens:
        parser.error("--varlen-lens-kv needs --varlen-lens")
    try:
        if args.varlen_lens:
            if args.mask != "none":
                parser.error("--mask is for dense calls (ffpa_attn_varlen_func takes no attn_mask)")
            lens_q = args.varlen_lens
            lens_k = args.varlen_lens_kv or lens_q
            if len(lens_k) != len(lens_q):
                parser.error(f"--varlen-lens-kv needs one length per sequence ({len(lens_q)}), got {len(lens_k)}")
            cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=device)
            q = _placeholder((sum(lens_q), args.hq, args.d), dtype, device, grad)
            k = _placeholder((sum(lens_k), hkv, args.d), dtype, device, grad)
            v = _placeholder((sum(lens_k), hkv, dv), dtype, device, grad)
            kwargs.update(causal=causal, enable_gqa=args.hq != hkv, dropout_p=args.dropout)
            print(_call_line("ffpa_attn_varlen_func",
                             f"q [{sum(lens_q)}, {args.hq}, {args.d}], k/v [{sum(lens_k)}, {hkv}, {dims}] "
                             f"{args.dtype} on {device}, lens_q={lens_q}"
                             + (f", lens_k={lens_k}" if lens_k != lens_q else ""), kwargs, grad))
            plan = explain_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kwargs)
        else:
            nkv = args.seqlen_kv or args.seqlen
            q = _placeholder((args.batch, args.hq, args.seqlen, args.d), dtype, device, grad)
            k = _placeholder((args.batch, hkv, nkv, args.d), dtype, device, grad)
            v = _placeholder((args.batch, hkv, nkv, dv), dtype, device, grad)
            mask = None
            if args.mask != "none":
                mask = _placeholder((args.batch, args.hq, args.seqlen, nkv),
                                    torch.bool if args.mask == "bool" else dtype, device, False)
            kwargs.update(is_causal=causal, enable_gqa=args.hq != hkv, dropout_p=args.dropout)
            print(_call_line("ffpa_attn_func",
                             f"q [{args.batch}, {args.hq}, {args.seqlen}, {args.d}], k/v [{args.batch}, {hkv}, {nkv}, "
                             f"{dims}] {args.dtype} on {device}"
                             + (f", attn_mask {args.mask}" if mask is not None else ""), kwargs, grad))
            plan = explain(q, k, v, attn_mask=mask, **kwargs)
    except (TypeError, ValueError, NotImplementedError) as exc:
        print(f"explain: this call raises {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(plan)
    if not torch.cuda.is_available():
        print(f"(no CUDA GPU here: this is the plan for {device.type} tensors; run explain on the GPU machine for "
              "its plan)")
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
    if args.cmd == "explain":
        return cmd_explain(args, parser)
    return cmd_default(args, argv)

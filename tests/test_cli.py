"""`python -m ffpa_attn` (check / bench / info / report) and the benchmark harness behind it.

CPU: info and check as subprocesses (check runs the Triton kernels under the interpreter, with
TRITON_INTERPRET unset in its environment so the CLI has to set it), the writers on a fake result set,
argument errors, bench without a GPU, a tiny `bench --dry-run` whose correctness column is checked
against the reference, the runner's failure handling and the upstream loader. GPU: the real check and a
small real bench.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ffpa_attn
from ffpa_attn import cli
from ffpa_attn.bench import check as check_mod
from ffpa_attn.bench import upstream
from ffpa_attn.bench.impls import (
    IMPL_NAMES,
    FFPAImpl,
    FlexImpl,
    Impl,
    Prepared,
    SDPAImpl,
    Unavailable,
    UpstreamImpl,
    default_impl_names,
    error_text,
    make_impl,
)
from ffpa_attn.bench.report import (
    details_table,
    fmt_err,
    markdown_report,
    not_measured,
    summary_table,
    text_report,
)
from ffpa_attn.bench.history import METRICS, append_history, history_rows, read_history
from ffpa_attn.bench.results import BenchRun, Case, Cell, bwd_tflops, fwd_tflops
from ffpa_attn.bench.runner import SweepOptions, run_sweep
from ffpa_attn.bench.timing import measure
from ffpa_attn.testing import TOL, assert_close, make_qkv

ROOT = Path(ffpa_attn.__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")


def _run_module(*args: str, unset_interpret: bool = True, timeout: int = 600,
                extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if unset_interpret:
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "ffpa_attn", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------ subprocesses


def test_info_subprocess():
    r = _run_module("info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for word in ("python", "torch", "triton", "cutlass-dsl", "GPU", "TRITON_INTERPRET", "commit"):
        assert word in out, (word, out)
    backends = out.split("backends on", 1)[1].splitlines()[1:]
    assert sorted(x.split()[0] for x in backends) == ["cuda", "cutedsl", "sdpa", "triton"]
    assert all(x.split()[1] in ("yes", "no") and len(x.split()) > 2 for x in backends), backends
    if not HAS_CUDA:
        assert "none found" in out
        # info must not switch the interpreter on by itself: triton is reported unavailable with the reason
        assert "need TRITON_INTERPRET=1" in out


def test_import_does_not_import_triton():
    """The CLI decides TRITON_INTERPRET after importing the package: neither may import triton."""
    code = "import sys, ffpa_attn, ffpa_attn.cli, ffpa_attn.bench.runner, ffpa_attn.bench.check; " \
           "print('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.skipif(HAS_CUDA, reason="the CPU (interpreter) mode of check")
def test_check_subprocess_cpu_runs_interpreter():
    r = _run_module("check")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "No CUDA GPU found" in out and "TRITON_INTERPRET=1" in out
    passes = [x for x in out.splitlines() if x.startswith("PASS")]
    assert len(passes) == len(check_mod.CPU_CASES), out
    assert all("triton:fwd" in x and "triton:bwd" in x for x in passes), out
    assert "D320" in out and "D512" in out and "H2/1" in out and "causal" in out
    assert f"check: {len(check_mod.CPU_CASES)} passed, 0 failed" in out


@pytest.mark.gpu
def test_check_subprocess_gpu():
    r = _run_module("check", unset_interpret=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS  triton" in r.stdout


# ------------------------------------------------------------------------------------- check in-process

def _sdpa_case() -> check_mod.CheckCase:
    # the SDPA backend runs fp16/bf16 on the CPU too; tiny cross-attention, tail-aligned causal, GQA
    return check_mod.CheckCase(1, 2, 1, 24, 40, 320, True, torch.bfloat16)


def test_check_passes_with_a_correct_backend():
    lines: list[str] = []
    code = check_mod.run_check(CPU, backends=["sdpa"], cases=[_sdpa_case()], print_fn=lines.append)
    assert code == 0, "\n".join(lines)
    assert any(x.startswith("PASS  sdpa") for x in lines), lines


@pytest.mark.parametrize("kind", ["not_causal", "nan", "raises", "wrong_grad"])
def test_check_fails_on_a_wrong_backend(kind):
    def wrong(q, k, v, causal, gqa, kwargs):
        if kind == "raises":
            raise RuntimeError("kernel exploded")
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=(causal if kind != "not_causal" else False),
                                       enable_gqa=gqa, **kwargs)
        if kind == "nan":
            out = out.clone()
            out[0, 0, 0, 0] = float("nan")
        if kind == "wrong_grad":  # right values, gradient scaled by 3 through a custom function
            out = out + 2 * (out - out.detach())
        return out

    lines: list[str] = []
    code = check_mod.run_check(CPU, backends=["sdpa"], cases=[_sdpa_case()], print_fn=lines.append, call=wrong)
    text = "\n".join(lines)
    assert code == 1, text
    assert any(x.startswith("FAIL  sdpa") for x in lines), text
    if kind == "raises":
        assert "kernel exploded" in text
    if kind == "wrong_grad":
        fail = next(x for x in lines if x.startswith("FAIL"))
        assert "out " in fail and "dq " in fail


def test_check_with_nothing_available_fails():
    lines: list[str] = []
    code = check_mod.run_check(CPU, backends=["cuda", "cutedsl"], cases=[_sdpa_case()], print_fn=lines.append)
    assert code == 1
    assert any("SKIP  cuda" in x and "not available" in x for x in lines)
    assert "nothing was checked" in lines[-1]


def test_check_names_the_numpy_that_breaks_an_older_triton_interpreter(monkeypatch):
    """triton < 3.7's interpreter fails under numpy >= 2.4 with a cryptic TypeError: check says so first."""
    problem = check_mod.interpreter_numpy_problem
    assert "pip install 'numpy<2.4'" in problem("3.4.0", "2.4.6")
    assert problem("3.6.0", "2.3.5") is None and problem("3.7.1", "2.4.6") is None and problem(None, "2.4") is None
    versions = {"triton": "3.4.0", "numpy": "2.4.6"}
    monkeypatch.setattr(check_mod, "dist_version", versions.get)
    lines: list[str] = []
    check_mod.run_check(CPU, backends=["sdpa"], cases=[_sdpa_case()], print_fn=lines.append)
    assert any(x.startswith("warning: triton 3.4.0's interpreter fails under numpy 2.4.6") for x in lines), lines


def test_check_skips_a_shape_the_backend_cannot_run():
    # D=1100 is outside the Triton kernels' range: a SKIP with explain's reason, nothing run
    case = check_mod.CheckCase(1, 1, 1, 8, 8, 1100, False, torch.bfloat16)
    r = check_mod.check_one("triton", case, CPU)
    assert r.status == "SKIP" and "D=1100" in r.message, r


# ------------------------------------------------------------------------------------------ fake results


def _fake_run() -> BenchRun:
    meta = {"command": "python -m ffpa_attn bench --bwd", "commit": "0123456789abcdef", "commit_dirty": False,
            "date": "2026-11-29T00:00:00Z", "gpu_name": "NVIDIA H200",
            "gpu": {"name": "NVIDIA H200", "capability": "9.0", "sm_count": 132},
            "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "cudnn": "91900",
                         "python": "3.12.3", "ffpa_attn": "0.1.0", "cutlass-dsl": None}}
    run = BenchRun(meta=meta)
    for d in (320, 512):
        for causal in (False, True):
            case = Case(d=d, causal=causal, hq=32, hkv=8 if d == 512 else 32)
            tri_f = 300.0 + d / 10 + (0 if causal else 20)
            run.add(Cell("triton", case, "fwd", "ok", ms=10.0, tflops=tri_f, err=2.1e-3, errs={"out": 2.1e-3},
                         peak_mib=64.0, first_call_s=3.2, reps=20, kernel="fwd triton:fwd, bwd triton:bwd"))
            run.add(Cell("triton", case, "bwd", "ok", ms=30.0, tflops=150.0, err=3.0e-3 if d == 320 else 0.5,
                         errs={"dq": 3e-3, "dk": 2e-3, "dv": 1e-3}, peak_mib=512.0, first_call_s=9.0, reps=7,
                         kernel="fwd triton:fwd, bwd triton:bwd", note="fwd+bwd 40 ms"))
            run.add(Cell("sdpa-efficient", case, "fwd", "ok", ms=30.0, tflops=135.0, err=2.2e-3, reps=20))
            run.add(Cell("sdpa-efficient", case, "bwd", "ok", ms=90.0, tflops=46.0, err=2.5e-3, reps=5))
            for direction in ("fwd", "bwd"):
                run.add(Cell("flex", case, direction, "n/a",
                             note="forward does not compile/run: OutOfResources: shared memory 262144 > 232448"))
                run.add(Cell("sdpa-math", case, direction, "skipped", note="math materializes 2.1e9 scores"))
            run.add(Cell("upstream-triton", case, "fwd", "error", note="RuntimeError: boom"))
            run.add(Cell("upstream-triton", case, "bwd", "skipped", note="forward error: RuntimeError: boom"))
    run.fill_speedups()
    return run


def test_metrics_formulas():
    case = Case(d=512, causal=True, b=2, hq=32, hkv=8, nq=1024, nkv=2048)
    assert case.flops() == 0.5 * 4 * 2 * 32 * 1024 * 2048 * 512
    assert fwd_tflops(case, 2.0) == pytest.approx(case.flops() / 2e-3 / 1e12)
    assert bwd_tflops(case, 5.0) == pytest.approx(2.5 * case.flops() / 5e-3 / 1e12)
    assert Case(d=512, causal=False).flops() == 4 * 32 * 8192 * 8192 * 512
    with pytest.raises(ValueError):
        Case(d=512, causal=True, nq=10, nkv=5)
    with pytest.raises(ValueError):
        Case(d=512, causal=False, hq=6, hkv=4)


def test_speedups_and_summary_table():
    run = _fake_run()
    c = run.cells[0]
    base = run.cell("sdpa-efficient", c.case, "fwd")
    assert c.speedup == pytest.approx(c.tflops / base.tflops)
    assert run.cell("flex", c.case, "fwd").speedup is None
    headers, rows = summary_table(run)
    assert headers[:3] == ["D", "causal", "heads"]
    # every implementation is a column, also one that never ran: a failure never leaves the table
    assert headers[3:] == ["triton", "sdpa-efficient", "flex", "sdpa-math", "upstream-triton"]
    assert rows[0] == ["320", "no", "32/32", "352 / 150", "135 / 46.0", "n/a / n/a", "skip / skip", "ERR / skip"]
    assert rows[3][:3] == ["512", "yes", "32/8"]


def test_details_and_not_measured():
    run = _fake_run()
    headers, rows = details_table(run)
    assert {r[0] for r in rows} == {"triton", "sdpa-efficient"}
    tri = next(r for r in rows if r[0] == "triton" and r[1] == "D=512 causal 32/8")
    assert tri[headers.index("fwd ×base")] == f"{(300 + 51.2) / 135:.2f}"
    assert tri[headers.index("err bwd")].endswith("!")  # 0.5 is above the bf16 tolerance
    assert not tri[headers.index("err fwd")].endswith("!")
    assert tri[headers.index("peak MiB fwd/bwd")] == "64/512"
    lines = not_measured(run)
    flex = next(x for x in lines if x.startswith("flex"))
    assert "all cases" in flex and "OutOfResources" in flex and "[n/a, fwd+bwd]" in flex
    assert any(x.startswith("upstream-triton [error, fwd]") and "boom" in x for x in lines)
    assert any(x.startswith("sdpa-math [skipped") for x in lines)


def test_text_report_ends_with_summary():
    text = text_report(_fake_run())
    lines = text.splitlines()
    start = lines.index("TFLOPS (fwd / bwd):")
    assert lines[start + 1].split()[:3] == ["D", "causal", "heads"]
    assert len(lines) - start == 3 + 4  # title, header, rule, one row per case: the summary comes last
    assert "NVIDIA H200" in text and "0123456789abcdef" in text and "sdpa-efficient" in text


def test_markdown_report_content():
    md = markdown_report(_fake_run())
    for s in ("# ffpa-attn benchmark: NVIDIA H200", "`python -m ffpa_attn bench --bwd`", "0123456789abcdef",
              "2026-11-29T00:00:00Z", "torch 2.11.0+cu130", "triton 3.6.0", "sm90, 132 SMs",
              "| D | causal | heads | triton | sdpa-efficient | flex | sdpa-math | upstream-triton |",
              "| 320 | no | 32/32 | 352 / 150 | 135 / 46.0 | n/a / n/a | skip / skip | ERR / skip |", "## Not measured",
              "OutOfResources",
              "## Method", "2.5×"):
        assert s in md, s


def test_json_round_trip(tmp_path):
    run = _fake_run()
    again = BenchRun.from_json(run.to_json())
    assert again.meta == run.meta and again.impls == run.impls
    assert [c.to_dict() for c in again.cells] == [c.to_dict() for c in run.cells]
    data = json.loads(run.to_json())
    assert data["cells"][0]["case"]["d"] == 320 and data["baseline"] == "sdpa-efficient"


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from ffpa_attn.bench.plot import write_plot

    path = write_plot(_fake_run(), tmp_path / "sub" / "plot.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_subcommand_rewrites_outputs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    src = tmp_path / "run.json"
    src.write_text(_fake_run().to_json())
    code = cli.main(["report", str(src), "--md", str(tmp_path / "r.md"), "--plot", str(tmp_path / "r.png")])
    assert code == 0
    out = capsys.readouterr().out
    assert "TFLOPS (fwd / bwd):" in out
    assert (tmp_path / "r.md").read_text().startswith("# ffpa-attn benchmark: NVIDIA H200")
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert cli.main(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err  # an I/O error says so


def test_history_rows_and_idempotent_append(tmp_path):
    """One row per metric of every measured cell (n/a, error, skipped give none); the same run twice adds nothing,
    another run (new date) is appended after it."""
    run = _fake_run()
    rows = history_rows(run)
    ok = [c for c in run.cells if c.status == "ok"]
    assert len(rows) == sum(sum(getattr(c, m) is not None for m in METRICS) for c in ok)
    assert {r["impl"] for r in rows} == {"triton", "sdpa-efficient"}
    row = next(r for r in rows if r["impl"] == "triton" and r["direction"] == "fwd" and r["metric"] == "tflops"
               and r["case"] == "B1 H32/8 N8192 D512 bf16 causal")
    assert row == {"date": "2026-11-29T00:00:00Z", "commit": "0123456789abcdef", "device": "NVIDIA H200",
                   "command": "python -m ffpa_attn bench --bwd", "case": "B1 H32/8 N8192 D512 bf16 causal",
                   "impl": "triton", "direction": "fwd", "metric": "tflops", "value": 351.2}
    path = tmp_path / "sub" / "history.jsonl"
    assert append_history(run, path) == len(rows)
    assert append_history(run, path) == 0
    run.meta["date"] = "2026-11-30T00:00:00Z"
    assert append_history(run, path) == len(rows)
    back = read_history(path)
    assert len(back) == 2 * len(rows) and back[0] == rows[0] and back[-1]["date"] == "2026-11-30T00:00:00Z"


def test_report_and_bench_append_history(tmp_path, capsys):
    """`report RUN.json --append-history` backfills a saved run; `bench --append-history` appends its own."""
    src, hist = tmp_path / "run.json", tmp_path / "history.jsonl"
    src.write_text(_fake_run().to_json())
    assert cli.main(["report", str(src), "--append-history", str(hist)]) == 0
    assert read_history(hist) == history_rows(_fake_run())
    hist2 = tmp_path / "h2.jsonl"
    argv = ["bench", "--dry-run", "--d", "320", "--seqlen", "16", "--causal", "no", "--reps", "1", "--no-progress",
            "--impl", "sdpa-math", "--append-history", str(hist2)]
    assert cli.main(argv) == 0
    rows = read_history(hist2)
    assert {(r["impl"], r["direction"]) for r in rows} == {("sdpa-math", "fwd")}
    assert all(" N16 D320 bf16 full" in r["case"] and "--dry-run" in r["command"] for r in rows)
    assert {"tflops", "ms", "err"} <= {r["metric"] for r in rows}
    assert "appended" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the varlen table is not a BenchRun: refused, not silently dropped
        cli.main(["bench", "--varlen", "--dry-run", "--append-history", str(hist2)])
    assert "--append-history" in capsys.readouterr().err


def test_out_dir_names_files_by_gpu(tmp_path):
    ns = argparse.Namespace(out=str(tmp_path), json=None, md=str(tmp_path / "x.md"), plot=None)
    paths = cli._output_paths(ns, "nvidia-h200")
    assert paths == {"json": tmp_path / "nvidia-h200.json", "md": tmp_path / "x.md",
                     "plot": tmp_path / "nvidia-h200.png"}


def test_fmt_err_flags_tolerance():
    case = Case(d=512, causal=False, dtype="fp16")
    assert fmt_err(Cell("x", case, "fwd", "ok", err=TOL[torch.float16] * 0.5)) == "1.5e-03"
    assert fmt_err(Cell("x", case, "fwd", "ok", err=TOL[torch.float16] * 2)).endswith(" !")


# ---------------------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("argv, message", [
    (["bench", "--d", "abc"], "expected comma-separated positive integers"),
    (["bench", "--d", "512,-1"], "expected comma-separated positive integers"),
    (["bench", "--seqlen", "0"], "expected a positive integer"),
    (["bench", "--causal", "maybe"], "invalid choice"),
    (["bench", "--dtype", "fp32"], "invalid choice"),
    (["bench", "--impl", "triton,bogus"], "unknown implementation(s) bogus"),
    (["bench", "--heads", "32", "--gqa", "3"], "--heads 32 is not a multiple of the GQA group 3"),
    (["bench", "--heads", "32", "--kv-heads", "5"], "--heads 32 is not a multiple of --kv-heads 5"),
    (["bench", "--gqa", "2", "--kv-heads", "4"], "give --gqa or --kv-heads, not both"),
    (["bench", "--seqlen", "100", "--seqlen-kv", "50"], "causal needs --seqlen-kv >= --seqlen"),
    (["bench", "--reps", "2", "--min-reps", "5"], "--min-reps 5 > --reps 2"),
    (["frobnicate"], "invalid choice"),
])
def test_argument_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_check_unknown_backend(capsys):
    assert cli.main(["check", "--backend", "tpu"]) == 2
    assert "unknown backend(s) tpu" in capsys.readouterr().err


def test_impl_names_cover_every_implementation(monkeypatch):
    for name in IMPL_NAMES:
        assert make_impl(name).name == name
    with pytest.raises(ValueError, match="unknown implementation"):
        make_impl("nope")
    monkeypatch.delenv(upstream.ENV_VAR, raising=False)
    assert not any(n.startswith("upstream-") for n in default_impl_names())
    monkeypatch.setenv(upstream.ENV_VAR, "/nonexistent")
    assert "upstream-triton" in default_impl_names()


def test_standard_sweep_cases():
    cases = cli.standard_cases()
    assert {c.d for c in cases} == {320, 384, 512, 640, 768, 1024}
    assert {c.causal for c in cases} == {False, True}
    gqa = [c for c in cases if c.hkv != c.hq]
    assert gqa and all(c.d == 512 and c.hq == 32 and c.hkv == 8 for c in gqa)
    assert all(c.nq == c.nkv == 8192 and c.dtype == "bf16" for c in cases)
    assert len(cases) == 14


# ---------------------------------------------------------------------------------------- bench on a CPU


@pytest.mark.skipif(HAS_CUDA, reason="bench's no-GPU exit")
def test_bench_without_gpu_exits_2(capsys):
    assert cli.main(["bench", "--d", "512"]) == cli.EXIT_NO_GPU
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--dry-run" in err


@pytest.mark.skipif(HAS_CUDA, reason="the no-subcommand CPU path")
def test_default_command_on_cpu_runs_only_check(monkeypatch, capsys):
    called = []
    monkeypatch.setattr(cli, "cmd_check", lambda backends=None: called.append(backends) or 0)
    assert cli.main([]) == 0
    assert called == [None]
    assert "No CUDA GPU found: only the check ran" in capsys.readouterr().out
    monkeypatch.setattr(cli, "cmd_check", lambda backends=None: 1)
    assert cli.main([]) == 1


def test_default_command_passes_history_to_the_sweep(monkeypatch):
    """The main job (no subcommand) on a GPU hands --append-history to the sweep (GPU and sweep faked)."""
    from ffpa_attn.bench import env

    seen = {}
    monkeypatch.setattr(cli, "cmd_check", lambda backends=None: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(env, "default_device", lambda: CPU)
    monkeypatch.setattr(cli, "_run_bench", lambda cases, impls, opts, command, paths, device, history=None:
                        seen.update(history=history, paths=paths) or 0)
    assert cli.main(["--out", "res", "--append-history", "res/history.jsonl"]) == 0
    assert seen["history"] == "res/history.jsonl"
    assert seen["paths"]["json"] == Path("res") / "nvidia-h200.json"


def test_bench_dry_run_end_to_end(tmp_path, capsys):
    """The whole pipeline on CPU: our Triton kernels (interpreter) and SDPA math are measured and their
    correctness column is checked against the fp32 reference; refusing peers are n/a with a reason."""
    j, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    argv = ["bench", "--dry-run", "--d", "320", "--seqlen", "32", "--seqlen-kv", "48", "--causal", "yes",
            "--gqa", "2", "--bwd", "--reps", "1", "--no-progress",
            "--impl", "triton,sdpa-math,sdpa-efficient,flex,cuda", "--json", str(j), "--md", str(md)]
    have_mpl = True
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        have_mpl = False
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "TFLOPS (fwd / bwd):" in out
    run = BenchRun.from_json(j.read_text())
    case = Case(d=320, causal=True, b=1, hq=2, hkv=1, nq=32, nkv=48, dtype="bf16")
    assert run.cases() == [case]
    for impl in ("triton", "sdpa-math"):
        for direction in ("fwd", "bwd"):
            c = run.cell(impl, case, direction)
            if impl == "sdpa-math" and direction == "bwd" and c.status == "error":
                # one timed run each on a loaded CPU: math's tiny fwd+bwd may time below its fwd
                assert "not slower than fwd" in c.note, c
                continue
            assert c is not None and c.status == "ok", (impl, direction, c)
            assert c.ms > 0 and c.reps >= 1 and c.first_call_s > 0
            flops = case.flops() * (2.5 if direction == "bwd" else 1.0)
            assert c.tflops == pytest.approx(flops / (c.ms * 1e-3) / 1e12)
            assert set(c.errs) == ({"out"} if direction == "fwd" else {"dq", "dk", "dv"})
            assert 0 < c.err <= TOL[torch.bfloat16], (impl, direction, c.errs)
    assert "triton:fwd" in run.cell("triton", case, "fwd").kernel
    assert run.cell("sdpa-efficient", case, "fwd").status == "n/a"
    assert run.cell("sdpa-efficient", case, "fwd").note
    assert run.cell("flex", case, "bwd").status == "n/a"
    assert run.cell("cuda", case, "fwd").status == "n/a" and "CUDA" in run.cell("cuda", case, "fwd").note
    assert run.meta["command"].endswith(" ".join(argv)) and "--dry-run" in run.meta["command"]
    assert run.meta["commit"] and run.meta["versions"]["torch"] == torch.__version__
    text = md.read_text()
    assert "--dry-run" in text and "| 320 | yes | 2/1 |" in text
    if have_mpl:
        assert png.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------------------- runner pieces


class _Wrapped(Impl):
    """Test double: SDPA (math, CPU) with an optional defect."""

    def __init__(self, name: str, defect: str = "") -> None:
        self.name, self.defect = name, defect

    def prepare(self, case, q, k, v):
        if self.defect == "unavailable":
            raise Unavailable("not on this machine")

        def fn(q, k, v):
            if self.defect == "raises":
                raise RuntimeError("kernel exploded")
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal,
                                                                   enable_gqa=case.group > 1)
            return out * 1.5 if self.defect == "wrong" else out

        return Prepared(fn, kernel="sdpa")


def test_runner_survives_failures_and_flags_wrong_results():
    # N=256: fwd+bwd several times the forward (at N=64 the two sub-millisecond medians could swap on a loaded
    # CPU and the runner then rightly flags the backward); medians of 7 runs
    case = Case(d=64, causal=True, b=1, hq=2, hkv=1, nq=256, nkv=256, dtype="bf16")
    impls = [_Wrapped("good"), _Wrapped("boom", "raises"), _Wrapped("gone", "unavailable"),
             _Wrapped("wrong", "wrong")]
    opts = SweepOptions(bwd=True, max_reps=7, min_reps=7, budget_s=0.01, show_progress=False)
    run = run_sweep([case], impls, CPU, opts, {"command": "test"})
    good = run.cell("good", case, "fwd")
    assert good.status == "ok" and good.err < TOL[torch.bfloat16]
    assert run.cell("good", case, "bwd").status == "ok"
    boom = run.cell("boom", case, "fwd")
    assert boom.status == "error" and "kernel exploded" in boom.note
    assert run.cell("boom", case, "bwd").status == "skipped"
    assert run.cell("gone", case, "fwd").status == "n/a" and run.cell("gone", case, "fwd").note == "not on this machine"
    wrong = run.cell("wrong", case, "fwd")
    assert wrong.status == "ok" and wrong.err > 0.3  # measured, and the error column shows it
    assert fmt_err(wrong).endswith("!")


def test_runner_time_budget_skips():
    case = Case(d=64, causal=False, b=1, hq=1, hkv=1, nq=8, nkv=8, dtype="bf16")
    opts = SweepOptions(bwd=False, max_reps=1, min_reps=1, budget_s=0.01, time_budget_s=1e-9, show_progress=False)
    run = run_sweep([case], [_Wrapped("good")], CPU, opts, {})
    c = run.cell("good", case, "fwd")
    assert c.status == "skipped" and "time budget" in c.note


def test_sdpa_impl_reports_refusal_reason():
    case = Case(d=320, causal=True, b=1, hq=2, hkv=1, nq=8, nkv=8, dtype="bf16")
    q = torch.randn(1, 2, 8, 320, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 8, 320, dtype=torch.bfloat16)
    with pytest.raises(Unavailable) as exc:
        SDPAImpl("sdpa-cudnn").prepare(case, q, k, k)  # no cuDNN on a CPU tensor
    assert str(exc.value)
    prep = SDPAImpl("sdpa-math").prepare(case, q, k, k)
    assert prep.fn(q, k, k).shape == q.shape


def test_flex_failure_is_na_and_not_retried():
    flex = FlexImpl()
    case = Case(d=512, causal=False)
    status, note = flex.failure(RuntimeError("out of resource: shared memory"), "fwd", case)
    assert status == "n/a" and "shared memory" in note
    if HAS_CUDA:
        q = torch.empty(1, 1, 1, 512, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(Unavailable, match="not retried"):
            flex.prepare(Case(d=512, causal=True), q, q, q)


def test_error_text_uses_innermost_cause():
    try:
        try:
            raise ValueError("inner   problem\n  details")
        except ValueError as e:
            raise RuntimeError("wrapper") from e
    except RuntimeError as exc:
        assert error_text(exc) == "ValueError: inner problem details"


def test_measure_bounds():
    calls = []
    t = measure(lambda: calls.append(1), CPU, max_reps=4, min_reps=2, budget_s=10.0, warmup=1)
    assert t.reps == 4 and len(calls) == 1 + 1 + 4 and 0 <= t.min_ms <= t.median_ms
    with pytest.raises(ValueError):
        measure(lambda: None, CPU, max_reps=1, min_reps=2)


def test_upstream_loaded_under_alias(tmp_path, monkeypatch):
    pkg = tmp_path / "wheel" / "ffpa_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .impl import ffpa_attn_func\n__version__ = '9.9.9'\n")
    (pkg / "impl.py").write_text("def ffpa_attn_func(q, k, v, **kw):\n    return ('upstream', kw)\n")
    monkeypatch.setenv(upstream.ENV_VAR, str(tmp_path / "wheel"))
    alias = "ffpa_attn_upstream_test"
    try:
        mod = upstream.load(alias=alias)
        assert upstream.version(mod) == "9.9.9"
        assert mod.ffpa_attn_func(1, 2, 3, backend="triton") == ("upstream", {"backend": "triton"})
        assert sys.modules["ffpa_attn"] is ffpa_attn  # ours is untouched
        assert f"{alias}.impl" in sys.modules
    finally:
        for name in [n for n in sys.modules if n.startswith(alias)]:
            del sys.modules[name]
    with pytest.raises(FileNotFoundError):
        upstream.load(tmp_path / "empty", alias=alias + "_missing")


def _fake_target(root, init: str):
    """A ``pip install --target`` folder: the public package (``ffpa_attn/`` with ``init``) beside a dependency."""
    pkg = root / "ffpa_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (root / "fake_quack_dep.py").write_text("VALUE = 'from beside the package'\n")
    return root


def test_upstream_finds_dependencies_installed_beside_it(tmp_path, monkeypatch):
    """Imported at load and lazily on a later call (as its CuTeDSL kernels import quack), from the folder holding
    the package, which goes after the environment's own folders."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    root = _fake_target(tmp_path / "target", "import fake_quack_dep\n__version__ = '0.2.4'\n"
                                             "def ffpa_attn_func(*a, **kw):\n"
                                             "    from fake_quack_dep import VALUE\n    return VALUE\n")
    monkeypatch.setenv(upstream.ENV_VAR, str(root))
    alias = "ffpa_attn_upstream_deps_test"
    try:
        mod = upstream.load(alias=alias)
        assert mod.ffpa_attn_func() == "from beside the package"
        assert sys.path[-1] == str(root.resolve()) and sys.modules["ffpa_attn"] is ffpa_attn
        assert upstream.load(root / "ffpa_attn", alias=alias) is mod and sys.path.count(str(root.resolve())) == 1
    finally:
        for name in [n for n in sys.modules if n.startswith(alias) or n == "fake_quack_dep"]:
            del sys.modules[name]


def test_upstream_missing_dependency_says_where_to_stage_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    root = _fake_target(tmp_path / "target", "import fake_dep_not_installed_anywhere\n")
    before = list(sys.path)
    with pytest.raises(ModuleNotFoundError, match="fake_dep_not_installed_anywhere") as info:
        upstream.load(root / "ffpa_attn", alias="ffpa_attn_upstream_missing_dep_test")
    assert f"pip install --target {root.resolve()} --no-deps" in str(info.value)
    assert info.value.name == "fake_dep_not_installed_anywhere" and sys.path == before
    # a dependency imported on the first kernel call: the bench cell says the same
    monkeypatch.setenv(upstream.ENV_VAR, str(root))
    status, note = UpstreamImpl("cutedsl").failure(ModuleNotFoundError("No module named 'quack'", name="quack"),
                                                   "fwd", Case(d=512, causal=False, b=1, hq=1, hkv=1, nq=8, nkv=8))
    assert status == "error" and "quack" in note and f"--target {root.resolve()}" in note


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_bench_gpu_small(tmp_path):
    j = tmp_path / "r.json"
    argv = ["bench", "--d", "320,512", "--seqlen", "1024", "--heads", "4", "--gqa", "2", "--bwd", "--reps", "3",
            "--impl", "triton,sdpa-efficient,sdpa-flash,sdpa-math", "--no-progress", "--json", str(j)]
    assert cli.main(argv) == 0
    run = BenchRun.from_json(j.read_text())
    for case in run.cases():
        for impl in ("triton", "sdpa-efficient", "sdpa-math"):
            for direction in ("fwd", "bwd"):
                c = run.cell(impl, case, direction)
                assert c.status == "ok" and c.err <= TOL[torch.bfloat16] and c.peak_mib > 0, c
        assert run.cell("sdpa-flash", case, "fwd").status == "n/a"  # flash stops at D=256
        assert run.cell("triton", case, "fwd").speedup is not None


def test_runner_checkpoints_after_each_case():
    cases = [Case(d=64, causal=c, b=1, hq=1, hkv=1, nq=8, nkv=8, dtype="bf16") for c in (False, True)]
    seen: list[int] = []
    opts = SweepOptions(bwd=False, max_reps=1, min_reps=1, budget_s=0.01, show_progress=False)
    run = run_sweep(cases, [_Wrapped("good")], CPU, opts, {}, checkpoint=lambda r: seen.append(len(r.cells)))
    assert seen == [1, 2] and len(run.cells) == 2


def _pretend_forward_only(monkeypatch, module, name="cutedsl"):
    """Make backend ``name`` 'available' whose backward cannot run: backend=name raises, and
    forward_backend=name plans the triton forward (what the interpreter can execute) with the default backward."""
    import ffpa_attn.bench.impls as impls_mod

    real_explain = ffpa_attn.explain

    def fake_explain(q, k, v, **kw):
        if kw.get("backend") == name:
            raise NotImplementedError(f"backend {name!r} cannot run this backward: none built")
        if kw.get("forward_backend") == name:
            kw["forward_backend"] = "triton"
        return real_explain(q, k, v, **kw)

    def fake_func(q, k, v, **kw):
        if kw.get("forward_backend") == name:
            kw["forward_backend"] = "triton"
        return ffpa_attn.ffpa_attn_func(q, k, v, **kw)

    monkeypatch.setattr(module, "explain", fake_explain)
    if module is impls_mod:
        monkeypatch.setattr(module, "backend_available", lambda b, d: (True, "pretend"))
        monkeypatch.setattr(module, "ffpa_attn_func", fake_func)
    return fake_func


def test_bench_times_the_forward_of_a_backend_without_backward(monkeypatch):
    import ffpa_attn.bench.impls as impls_mod

    _pretend_forward_only(monkeypatch, impls_mod)
    case = Case(d=320, causal=True, b=1, hq=2, hkv=1, nq=32, nkv=32, dtype="bf16")
    q, k, v = (torch.randn(1, h, 32, 320, dtype=torch.bfloat16) for h in (2, 1, 1))
    prep = FFPAImpl("cutedsl").prepare(case, q, k, v)
    assert prep.bwd_unavailable and "no cutedsl backward" in prep.bwd_unavailable
    out = prep.fn(q, k, v)
    ref, _ = ffpa_attn.reference.attention(q, k, v, is_causal=True)
    assert ffpa_attn.testing.rel_err(out, ref) < TOL[torch.bfloat16]


def test_check_covers_forward_only_backend_and_default(monkeypatch):
    fake_func = _pretend_forward_only(monkeypatch, check_mod)
    case = check_mod.CheckCase(b=1, hq=2, hkv=1, nq=24, nkv=40, d=320, causal=True, dtype=torch.bfloat16)
    r = check_mod.check_one("cutedsl", case, CPU, call=lambda q, k, v, c, g, kw: fake_func(
        q, k, v, is_causal=c, enable_gqa=g, **kw))
    assert r.status == "PASS", r.message
    assert "bwd triton" in r.plan  # gradients through the default backward
    r = check_mod.check_one("default", case, CPU)
    assert r.status == "PASS", r.message


def test_varlen_bench_counts_each_sequences_pairs():
    """bench --varlen TFLOPS: 4 * Hq * D * the pairs each sequence's mask keeps (tail-aligned causal), by brute
    force; the dense-equivalent length has about the same work."""
    from ffpa_attn.bench.varlen import VarlenCase, mask_pairs

    for nq, nk in [(0, 5), (5, 0), (1, 1), (7, 7), (3, 10), (10, 3), (64, 200)]:
        for causal in (False, True):
            want = sum(1 for r in range(nq) for k in range(nk) if not causal or k <= r + nk - nq)
            assert mask_pairs(nq, nk, causal) == want, (nq, nk, causal)
    case = VarlenCase(d=512, causal=True, hq=4, hkv=2, lens_q=(100, 0, 7), lens_k=(300, 5, 7))
    assert case.flops() == 4.0 * 4 * 512 * (mask_pairs(100, 300, True) + mask_pairs(7, 7, True))
    big = VarlenCase(d=512, causal=True, hq=4, hkv=2, lens_q=(8192, 4096, 4096))
    n = big.dense_n()
    assert abs(mask_pairs(n, n, True) / sum(mask_pairs(x, x, True) for x in big.lens_q) - 1) < 0.02


def test_bench_varlen_dry_run(capsys):
    """bench --varlen --dry-run runs the pipeline on the CPU: the SDPA loop is timed and checked against the
    reference; the CuTeDSL cells say why they cannot run here."""
    argv = ["bench", "--varlen", "--dry-run", "--d", "264", "--causal", "yes", "--varlen-lens", "9,1,20",
            "--reps", "1", "--impl", "sdpa-loop,cutedsl"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "D=264 causal H2 3 seqs 30 tok" in out and "lens_q=[9, 1, 20]" in out, out
    loop = next(line for line in out.splitlines() if "sdpa-loop" in line)
    assert "TFLOPS" in loop and float(loop.split("err")[1]) < 1e-2, out
    if not torch.cuda.is_available():
        assert "cutedsl" in out and "CUDA device" in out, out


@pytest.mark.parametrize("extra", [["--json", "x.json"], ["--out", "d"], ["--md", "x.md"], ["--plot", "x.png"],
                                   ["--bwd"], ["--time-budget", "5"], ["--seqlen", "64"], ["--seqlen-kv", "64"],
                                   ["--batch", "2"], ["--gqa", "2,4"]])
def test_bench_varlen_refuses_what_it_would_ignore(extra, capsys):
    """bench --varlen prints a forward table sized by --varlen-lens: an option it would not honour is an error
    naming the option (it was silently dropped), and --varlen-lens without --varlen is one too."""
    with pytest.raises(SystemExit):
        cli.main(["bench", "--varlen", "--dry-run", *extra])
    assert extra[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dry-run", "--varlen-lens", "9,1"])
    assert "--varlen-lens needs --varlen" in capsys.readouterr().err


def test_bench_decode_dry_run(tmp_path, monkeypatch, capsys):
    """bench --decode --dry-run runs the KV-cache table on the CPU: ffpa_attn_with_kvcache (decode kernel, and the
    paged varlen route of a chunk), ffpa_attn_func and torch SDPA over the gathered cache, each checked against
    the reference; then the serving rows (paged prefill: the planner's route, in place, packed, dense; a mixed batch:
    one call, the two calls apart); the plans are printed; JSON and history rows are written."""
    from ffpa_attn.bench import kvcache as bench_kv

    monkeypatch.setattr(bench_kv, "DRY_RUN_CASES", (bench_kv.DecodeCase(2, 4, 2, 1, 264, 40, 16),
                                                    bench_kv.DecodeCase(1, 2, 1, 65, 32, 8, 16, append=True)))
    monkeypatch.setattr(bench_kv, "SERVING_DRY_RUN_CASES", (
        bench_kv.ServingCase("prefill", 2, 2, 1, 65, 264, 80, 16),
        bench_kv.ServingCase("mixed", 1, 2, 1, 65, 32, 80, 16, decode=2, decode_lo=20)))
    out_json, hist = tmp_path / "decode.json", tmp_path / "history.jsonl"
    argv = ["bench", "--decode", "--dry-run", "--json", str(out_json), "--append-history", str(hist)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "decode: triton:kvcache_fwd[" in out and "paged varlen: triton:kvcache_paged + triton:varlen_fwd" in out
    assert "triton:gather_kv + triton:varlen_fwd" in out and "triton:kvcache_fwd[" in out.split("serving rows")[1]
    run = json.loads(out_json.read_text())
    cells = {(c["label"], c["impl"]): c for c in run["cells"]}
    assert {impl for _, impl in cells} == {"kvcache", "dense", "sdpa"} and run["meta"]["device"] == "cpu"
    measured = [c for c in cells.values() if c["ms"] is not None]
    assert len(measured) == 6 and all(c["err"] < 1e-2 and c["tokens_s"] > 0 for c in measured), measured
    chunk_sdpa = next(c for (label, impl), c in cells.items() if impl == "sdpa" and "Nq65" in label)
    assert "GQA folded into rows" in chunk_sdpa["plan"] and not chunk_sdpa["note"]
    serving = {(c["case"]["kind"], c["impl"]): c for c in run["serving"]}
    assert set(serving) == {("prefill", "auto"), ("prefill", "inplace"), ("prefill", "packed"), ("prefill", "dense"),
                            ("mixed", "auto"), ("mixed", "inplace"), ("mixed", "separate")}
    assert all(c["ms"] is not None and c["err"] < 1e-2 and c["tflops"] >= 0 for c in serving.values()), serving
    rows = [json.loads(line) for line in hist.read_text().splitlines()]
    assert {r["direction"] for r in rows} == {"kvcache", "serving"}
    assert {"gb_s", "tokens_s", "tflops"} <= {r["metric"] for r in rows}
    assert cli.main(argv) == 0 and len(hist.read_text().splitlines()) > len(rows)  # another run: appended


@pytest.mark.parametrize("nq,causal", [(1, True), (3, True), (3, False)])
def test_bench_decode_sdpa_fold_matches_reference(nq, causal):
    """The SDPA cell's GQA fold: q [B, Nq, Hq, D] -> [B, Hkv, group * Nq, D] rows, the tail-aligned causal bias of
    those rows, and back to [B, Hq, Nq, D] from an output in the [B, N, H, D] memory order of torch's fused kernels
    (where a view cannot regroup the rows)."""
    from ffpa_attn.bench import kvcache as bench_kv
    from ffpa_attn.reference import attention

    b, hq, hkv, nkv, d = 2, 6, 2, 11, 16
    q = torch.randn(b, nq, hq, d)
    k, v = torch.randn(b, hkv, nkv, d), torch.randn(b, hkv, nkv, d)
    qf = bench_kv.fold_gqa_rows(q, hkv)
    assert qf.shape == (b, hkv, hq // hkv * nq, d)
    bias = bench_kv.folded_causal_bias(nq, nkv, hq // hkv, q.dtype, q.device) if causal else None
    out = torch.ops.aten.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=0.25)
    fused_order = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, rows, Hkv, D] in memory
    ref, _ = attention(q.transpose(1, 2), k, v, is_causal=causal, scale=0.25)
    for o in (out, fused_order):
        got = bench_kv.unfold_gqa_rows(o, hq)
        assert got.shape == (b, hq, nq, d)
        assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("extra", [["--d", "512"], ["--seqlen", "64"], ["--out", "d"], ["--bwd"], ["--varlen"],
                                   ["--impl", "cutedsl"]])
def test_bench_decode_refuses_what_it_would_ignore(extra, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--decode", "--dry-run", *extra])
    assert extra[0] in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- explain


def _explain_out(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["explain", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_explain_prints_the_plan_of_the_described_dense_call(capsys):
    code, out, _ = _explain_out(["--d", "320", "--hq", "4", "--hkv", "2", "--seqlen", "16", "--seqlen-kv", "24",
                                 "--causal", "--dtype", "fp16"], capsys)
    assert code == 0
    q, k, v = make_qkv(1, 4, 2, 16, 24, 320, torch.float16, CPU, requires_grad=True)
    plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert str(plan) in out, out
    assert "q [1, 4, 16, 320], k/v [1, 2, 24, 320] fp16 on cpu" in out and "is_causal=True" in out
    # the bench's spellings: --heads / --gqa, --causal yes
    code, out2, _ = _explain_out(["--d", "320", "--heads", "4", "--gqa", "2", "--seqlen", "16", "--seqlen-kv", "24",
                                  "--causal", "yes", "--dtype", "fp16"], capsys)
    assert code == 0 and out2 == out
    # inference: an explicitly named forward-only backend has no backward to plan
    code, out, _ = _explain_out(["--d", "320", "--backend", "sdpa", "--no-grad"], capsys)
    assert code == 0 and "[no grad]" in out and "forward: sdpa" in out


def test_explain_varlen_matches_explain_varlen(capsys):
    code, out, _ = _explain_out(["--varlen-lens", "5,1,3", "--varlen-lens-kv", "6,1,4", "--d", "512", "--hq", "4",
                                 "--hkv", "1", "--causal"], capsys)
    assert code == 0
    q, k, v = make_qkv(1, 4, 1, 9, 11, 512, torch.bfloat16, CPU, requires_grad=True)
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
    cu_q = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 7, 11], dtype=torch.int32)
    plan = ffpa_attn.explain_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, enable_gqa=True)
    assert str(plan) in out and "ffpa_attn_varlen_func(" in out and "lens_k=[6, 1, 4]" in out


def test_explain_never_allocates_the_inputs(capsys):
    """A shape whose q alone would be 64 GiB plans in no time: the inputs are one-element broadcasts."""
    code, out, _ = _explain_out(["--batch", "8", "--hq", "64", "--hkv", "8", "--seqlen", "65536", "--d", "1024"],
                                capsys)
    assert code == 0 and "forward:" in out and "backward:" in out


@pytest.mark.parametrize("argv, message", [
    (["--seqlen", "32", "--seqlen-kv", "16", "--causal"], "raises ValueError: is_causal=True needs Nkv >= Nq"),
    (["--hq", "6", "--hkv", "4"], "raises ValueError: Nh_q=6 must be a multiple of Nh_kv=4"),
    (["--backend", "flash"], "raises ValueError: backend='flash' is not a backend"),
    (["--backend", "cutedsl"] if not HAS_CUDA else ["--d", "100", "--backend", "cutedsl"],
     "raises NotImplementedError"),
])
def test_explain_reports_what_the_call_would_raise(argv, message, capsys):
    code, _, err = _explain_out(argv, capsys)
    assert code == 1 and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--varlen-lens-kv", "3"], "--varlen-lens-kv needs --varlen-lens"),
    (["--varlen-lens", "3,4", "--varlen-lens-kv", "3"], "one length per sequence"),
    (["--varlen-lens", "3", "--mask", "bool"], "--mask is for dense calls"),
    (["--seqlen", "0"], "expected a positive integer"),
    (["--gqa", "2", "--hkv", "4"], "give --gqa or --hkv, not both"),
    (["--hq", "6", "--gqa", "4"], "--hq 6 is not a multiple of the GQA group 4"),
])
def test_explain_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the usage line


@pytest.mark.parametrize("argv0, prog", [("/opt/venv/bin/ffpa-attn", "ffpa-attn"),
                                         ("/src/ffpa_attn/__main__.py", "python -m ffpa_attn")])
def test_usage_names_how_the_cli_was_started(monkeypatch, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    assert cli.build_parser().format_usage().startswith(f"usage: {prog} ")
    assert cli._command_line(["bench", "--d", "512"]) == f"{prog} bench --d 512"


def test_console_script_help_says_ffpa_attn(tmp_path):
    """What pip's console-script wrapper runs (a file named ffpa-attn calling ffpa_attn.cli:main), and -m."""
    script = tmp_path / cli.CONSOLE_SCRIPT
    script.write_text("import sys\nfrom ffpa_attn.cli import main\nsys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: ffpa-attn "), r.stdout + r.stderr
    assert "explain" in r.stdout
    r = _run_module("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m ffpa_attn "), r.stdout + r.stderr


# -------------------------------------------------------------------------------------------- install state


def test_info_names_the_distribution_and_warns_of_the_public_package(monkeypatch):
    """The public ffpa-attn installs the same ffpa_attn folder: info says so when both are installed."""
    from ffpa_attn.bench import env as bench_env

    versions = {"ffpa-attn": "0.2.4", ffpa_attn.__distribution__: ffpa_attn.__version__}
    monkeypatch.setattr(bench_env, "dist_version", lambda dist: versions.get(dist))
    lines = bench_env.info_lines(CPU)
    assert f"distribution {ffpa_attn.__distribution__}: {ffpa_attn.__version__} installed" in lines
    warning = [x for x in lines if x.startswith("WARNING")]
    assert len(warning) == 1 and "ffpa-attn 0.2.4" in warning[0]
    assert f"pip uninstall ffpa-attn {ffpa_attn.__distribution__}" in warning[0]
    versions.clear()
    lines = bench_env.info_lines(CPU)
    assert not any(x.startswith("WARNING") for x in lines)
    assert any("not installed (imported from a source tree)" in x for x in lines)

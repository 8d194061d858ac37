"""The benchmark says true things: the commit stamp only from ffpa-attn's own checkout, a method footer that fits
the device, failed implementations visible in the table and the plot, and a dry run that says it is one."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import ffpa_attn
from ffpa_attn.bench import env as bench_env
from ffpa_attn.bench.report import markdown_report, summary_table, text_report
from ffpa_attn.bench.results import BenchRun, Case, Cell

REPO = Path(ffpa_attn.__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()


def _repo(root: Path, name: str) -> Path:
    """A git repository at ``root`` whose pyproject names ``name``, with an ``ffpa_attn`` package dir, committed."""
    pkg = root / "ffpa_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "pyproject.toml").write_text(f'[build-system]\nrequires = []\n\n[project]\nname = "{name}"\n')
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "init")
    return pkg


@pytest.fixture(autouse=True)
def no_forced_commit(monkeypatch):
    monkeypatch.delenv(bench_env.COMMIT_ENV, raising=False)


def test_commit_only_from_own_checkout(tmp_path):
    own = _repo(tmp_path / "own", ffpa_attn.__distribution__)
    head = _git(own.parent, "rev-parse", "HEAD")
    assert bench_env.repo_root(own) == own.parent.resolve()
    assert bench_env.git_commit(own) == (head, False)
    (own.parent / "run.sh").chmod(0o755)  # a mode change (copies of a tree bring them) is not a change
    assert bench_env.git_commit(own) == (head, False)
    (own.parent / "run.sh").write_text("#!/bin/sh\necho changed\n")
    assert bench_env.git_commit(own) == (head, True)


def test_no_commit_inside_a_foreign_repository(tmp_path):
    # a package copy at the top of someone else's project
    foreign = _repo(tmp_path / "user-project", "user-project")
    assert bench_env.repo_root(foreign) is None
    assert bench_env.git_commit(foreign) == ("unknown", None)
    # an installed package deep inside a user's repository (a virtual environment in the project)
    site = tmp_path / "user-project" / ".venv" / "lib" / "site-packages" / "ffpa_attn"
    site.mkdir(parents=True)
    (site.parent / "pyproject.toml").write_text(f'[project]\nname = "{ffpa_attn.__distribution__}"\n')  # a look-alike
    assert bench_env.repo_root(site) is None
    assert bench_env.git_commit(site) == ("unknown", None)
    # no git at all
    bare = tmp_path / "bare" / "ffpa_attn"
    bare.mkdir(parents=True)
    assert bench_env.git_commit(bare) == ("unknown", None)


def test_this_checkout_is_recognised():
    if not (REPO / ".git").exists() or not (REPO / "pyproject.toml").exists():
        pytest.skip("not running from a git checkout")
    assert bench_env.repo_root() == REPO
    commit, _ = bench_env.git_commit()
    assert commit == _git(REPO, "rev-parse", "HEAD")


def _run(device: str) -> BenchRun:
    gpu = {"name": "NVIDIA H200", "capability": "9.0", "sm_count": 132} if device == "cuda" else None
    meta = {"command": "python -m ffpa_attn bench", "commit": "0123456789abcdef", "commit_dirty": False,
            "date": "2026-12-01T00:00:00Z", "device": device, "gpu": gpu,
            "gpu_name": gpu["name"] if gpu else "CPU", "versions": {},
            "left_out": {"upstream-triton": "FFPA_UPSTREAM_PATH is not set"}}
    run = BenchRun(meta=meta)
    for d in (320, 512):
        case = Case(d=d, causal=False, hq=2, hkv=2, nq=64, nkv=64)
        for direction in ("fwd", "bwd"):
            run.add(Cell("ffpa", case, direction, "ok", ms=2.0, tflops=3.0 + d / 1000, err=1e-3, reps=2))
            run.add(Cell("sdpa-efficient", case, direction, "ok", ms=3.0, tflops=2.0, err=1e-3, reps=2))
            run.add(Cell("triton", case, direction, "ok", ms=2.5, tflops=2.5, err=1e-3, reps=2))
            run.add(Cell("flex", case, direction, "error", note="RuntimeError: boom"))
            run.add(Cell("upstream-cutedsl", case, direction, "n/a",
                         note="cannot import the public ffpa-attn (FFPA_UPSTREAM_PATH): ModuleNotFoundError: x"))
    run.fill_speedups()
    return run


def test_footer_on_cpu_claims_no_gpu_timing():
    run = _run("cpu")
    for text in (text_report(run), markdown_report(run)):
        assert "Dry run on the CPU" in text
        for false_claim in ("CUDA-event", "do_bench", "speedup vs", "CUDA memory", "DESIGN.md"):
            assert false_claim not in text, false_claim
    assert all(c.speedup is None for c in run.cells)  # CPU times compare interpreters, not kernels


def test_footer_on_gpu():
    run = _run("cuda")
    text = text_report(run)
    assert "triton.testing.do_bench (L2 cache cleared before every run" in text
    assert "speedup vs sdpa-efficient" in text and "DESIGN.md" not in text
    assert run.cell("ffpa", run.cases()[0], "fwd").speedup == pytest.approx(3.32 / 2.0)


def test_failed_implementations_stay_in_the_table():
    run = _run("cuda")
    headers, rows = summary_table(run)
    assert {"ffpa", "triton", "sdpa-efficient", "flex", "upstream-cutedsl"} <= set(headers)
    flex = headers.index("flex")
    assert all(r[flex] == "ERR / ERR" for r in rows)
    text = text_report(run)
    assert "upstream-triton [not run]: FFPA_UPSTREAM_PATH is not set" in text
    assert "flex [error, fwd+bwd] all cases: RuntimeError: boom" in text


def test_plot_of_a_dry_run(tmp_path):
    pytest.importorskip("matplotlib")
    from ffpa_attn.bench import plot

    run = _run("cpu")
    path = plot.write_plot(run, tmp_path / "cpu.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert plot.backends_path(path).read_bytes()[:4] == b"\x89PNG"
    assert plot.title(run, "bench").startswith("DRY RUN on the CPU")
    assert not plot.title(_run("cuda"), "bench").startswith("DRY RUN")
    impls = plot.headline_impls(run)
    assert impls[:2] == ["ffpa", "sdpa-efficient"] and "triton" not in impls  # backends go to the second figure
    assert "triton" in plot.backend_impls(run)
    labels = {impl: (label, ok) for impl, label, ok in plot.legend_entries(run, impls)}
    assert labels["ffpa"] == ("ffpa (default)", True)
    assert labels["flex"][0].startswith("flex (failed: RuntimeError: boom") and not labels["flex"][1]
    assert labels["upstream-cutedsl"][0].startswith("upstream-cutedsl (not importable:")
    assert labels["upstream-triton"][0] == "upstream-triton (not run: FFPA_UPSTREAM_PATH is not set)"


def _part(run: BenchRun, measured_d: int, commit: str, date: str) -> BenchRun:
    """A copy of ``run`` whose cells at every D but ``measured_d`` were skipped (a sweep split in parts)."""
    part = BenchRun.from_json(run.to_json())
    part.meta.update(commit=commit, date=date, command=f"python -m ffpa_attn bench --d {measured_d}")
    for c in part.cells:
        if c.case.d != measured_d:
            c.status, c.ms, c.tflops, c.note = "skipped", None, None, "out of time budget"
    return part


def test_merged_runs_take_each_measured_cell_and_name_their_sources(tmp_path):
    from ffpa_attn import cli
    from ffpa_attn.bench.results import merge_runs

    a = _part(_run("cuda"), 320, "aaaa", "2026-12-01T00:00:00Z")
    b = _part(_run("cuda"), 512, "bbbb", "2026-12-02T00:00:00Z")
    for c in b.cells:  # the later run measured D=512 differently: its numbers must win
        if c.status == "ok" and c.impl == "ffpa":
            c.tflops = 9.0
    merged = merge_runs([a, b])
    by_d = {case.d: case for case in merged.cases()}
    assert merged.cell("ffpa", by_d[320], "fwd").status == "ok"  # a later "skipped" does not erase a measurement
    assert merged.cell("ffpa", by_d[512], "fwd").tflops == 9.0
    assert merged.cell("ffpa", by_d[512], "fwd").speedup == pytest.approx(9.0 / 2.0)
    assert merged.cell("flex", by_d[320], "fwd").status == "error"  # failures stay visible
    md = markdown_report(merged)
    assert "sweep 1: `python -m ffpa_attn bench --d 320`; commit aaaa" in md and "cases: D=320 full" in md
    assert "sweep 2: `python -m ffpa_attn bench --d 512`; commit bbbb" in md and "cases: D=512 full" in md
    # the CLI merges several files; runs of different GPUs and a history append of a merge are refused
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(a.to_json())
    pb.write_text(b.to_json())
    assert cli.main(["report", str(pa), str(pb), "--json", str(tmp_path / "m.json")]) == 0
    assert BenchRun.from_json((tmp_path / "m.json").read_text()).meta["sources"][1]["commit"] == "bbbb"
    assert cli.main(["report", str(pa), str(pb), "--append-history", str(tmp_path / "h.jsonl")]) == 2
    from ffpa_attn.bench.plot import title

    assert "2 sweeps, commits aaaa, bbbb, 2026-12-01, 2026-12-02" in title(merged, "bench")
    other = BenchRun.from_json(b.to_json())
    other.meta["gpu_name"] = "NVIDIA H100"
    with pytest.raises(ValueError, match="different GPUs"):
        merge_runs([a, other])


def test_a_merged_table_merged_again_keeps_its_sweeps_apart():
    """Re-merging the committed table with a newer sweep: every cell keeps the sweep that measured it (two
    sweeps may measure one case with different implementations), and a sweep that lost all its cells goes."""
    from ffpa_attn.bench.results import merge_runs

    a = _part(_run("cuda"), 320, "aaaa", "2026-12-01T00:00:00Z")
    b = _part(_run("cuda"), 512, "bbbb", "2026-12-02T00:00:00Z")
    c = _part(_run("cuda"), 512, "cccc", "2026-12-03T00:00:00Z")
    c.cells = [x for x in c.cells if x.impl == "ffpa"]  # a newer sweep of one implementation
    for x in c.cells:
        if x.status == "ok":
            x.tflops = 7.0
    table = BenchRun.from_json(merge_runs([a, b]).to_json())
    again = merge_runs([table, c])
    src = again.meta["sources"]
    assert [s["commit"] for s in src] == ["aaaa", "bbbb", "cccc"]
    by_d = {case.d: case for case in again.cases()}
    assert src[again.cell("ffpa", by_d[512], "fwd").source]["commit"] == "cccc"
    assert again.cell("ffpa", by_d[512], "fwd").tflops == 7.0
    assert src[again.cell("sdpa-efficient", by_d[512], "fwd").source]["commit"] == "bbbb"
    assert src[again.cell("ffpa", by_d[320], "fwd").source]["commit"] == "aaaa"
    assert src[1]["cases"] == src[2]["cases"] == ["D=512 full"]
    assert merge_runs([a, merge_runs([b])]).meta["sources"][1]["commit"] == "bbbb"
    whole = _part(_run("cuda"), 512, "dddd", "2026-12-04T00:00:00Z")  # measures every cell of D=512 again
    assert [s["commit"] for s in merge_runs([merge_runs([b]), whole]).meta["sources"]] == ["dddd"]
    legacy = BenchRun.from_json(table.to_json())
    for x in legacy.cells:
        x.source = None
    with pytest.raises(ValueError, match="do not name their sweep"):
        merge_runs([legacy, c])


@pytest.mark.parametrize("content", [
    '{"name": "some other JSON", "cells": 3}',  # an object without the results keys
    '[1, 2, 3]',  # not an object
    '{"meta": {"gpu_name": "NVIDIA H200"}, "cells": []}',  # the shape of a results file, with nothing in it
    'gpu,ms\nH200,1.0\n',  # readable, not JSON: not an I/O error
])
def test_report_refuses_a_file_that_is_not_results(tmp_path, capsys, content):
    from ffpa_attn import cli

    path = tmp_path / "other.json"
    path.write_text(content)
    assert cli.main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    assert str(path) in captured.err and ("not a benchmark results file" in captured.err
                                          or "holds no measurements" in captured.err), captured.err
    assert "cannot read" not in captured.err, captured.err
    assert captured.out == ""  # no empty report that reads like a result
    good = tmp_path / "good.json"
    good.write_text(_run("cuda").to_json())
    assert cli.main(["report", str(good)]) == 0 and "TFLOPS" in capsys.readouterr().out


def test_sdpa_kernels_without_a_cpu_implementation_say_so_in_a_short_cell():
    """On CPU tensors torch's memory-efficient and cuDNN kernels only raise "No viable backend": the cell says
    what that means, in a few words, instead of torch's message."""
    import torch

    from ffpa_attn.bench.impls import SDPAImpl, Unavailable
    from ffpa_attn.bench.results import Case

    case = Case(d=320, causal=False, b=1, hq=2, hkv=2, nq=8, nkv=8, dtype="bf16")
    q = torch.randn(1, 2, 8, 320, dtype=torch.bfloat16)
    for name, kind in (("sdpa-efficient", "EFFICIENT_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION")):
        with pytest.raises(Unavailable) as exc:
            SDPAImpl(name).prepare(case, q, q, q)
        assert str(exc.value) == f"torch SDPA has no {kind} kernel for cpu tensors"

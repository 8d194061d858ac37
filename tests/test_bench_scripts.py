"""The first-call bench scripts' own logic (no compile, no GPU): bench/first_call_latency.py reports a measured
process that runs past --timeout as an error entry and times a fresh process's first eager call on CPU; bench/first_compile_cpu.py refuses variants it does not
know and the fork variant without its reference package; bench/host_overhead.py refuses backends and lengths it
cannot time, says it needs a GPU, times the CPU call against torch SDPA with --cpu and the host path part by part
with --cpu --parts, and checks each target against its yardstick; bench/kernel_ab.py refuses experiments it does not
know and says it needs a GPU; bench/memcheck.py's KV-cache and Triton split-KV families run their checks under the
interpreter, and it refuses families it does not know."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_call_latency_timeout_is_an_error_entry(tmp_path):
    latency = _script("first_call_latency")
    assert latency.run(512, False, True, str(tmp_path), timeout=0.01) == {"error": "timed out after 0 s"}


def test_first_call_latency_cpu_first_call():
    """--cpu-first-call: a fresh process times its first eager forward and backward and reports the compiler modules
    it imported (none)."""
    latency = _script("first_call_latency")
    res = latency.cpu_first_call(1, timeout=300)
    assert "error" not in res, res
    (run,) = res["runs"]
    assert run["fwd_s"] > 0 and run["bwd_s"] > 0 and run["compiler_stack_imported"] == []


def test_first_compile_cpu_checks_its_variants():
    script = str(ROOT / "bench" / "first_compile_cpu.py")
    for argv, message in ((["--variants", "pool,forked"], "unknown variants"), (["--variants", "fork"], "--fork-ref")):
        proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_host_overhead_checks_its_arguments(capsys):
    script = _script("host_overhead")
    for argv, message in ((["--impl", "cutedsl,flash"], "unknown ['flash']"), (["--lens", "4,0"], "--lens")):
        with pytest.raises(SystemExit) as exc:
            script.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main(["--calls", "1"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_host_overhead_cpu_mode_writes_history_rows(tmp_path, capsys):
    """--cpu: the public call against torch SDPA, forward and forward + backward, implicit and backend="sdpa", each
    row in the history format with its ratio to SDPA printed."""
    import json

    script = _script("host_overhead")
    out = tmp_path / "host.jsonl"
    assert script.main(["--cpu", "--d", "64", "--lens", "16", "--calls", "6", "--rounds", "2", "--json",
                        str(out)]) == 0
    text = capsys.readouterr().out
    assert "implicit plan on CPU" in text and "x sdpa" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["impl"], r["direction"]) for r in rows} == {(i, d) for i in ("torch-sdpa", "implicit", "sdpa")
                                                           for d in ("fwd", "fwd+bwd")}
    assert {r["metric"] for r in rows} == {"host_us", "wall_us"} and all(r["value"] > 0 for r in rows)
    assert {"date", "commit", "device", "command", "case"} <= set(rows[0])


def test_host_overhead_cpu_parts(capsys):
    """--cpu --parts times every part of the dense, varlen and decode host paths with stand-in kernels (none raises),
    and leaves the package as it found it (kernel modules and the interpreter flag restored)."""
    import os

    from ffpa_attn import ops

    script = _script("host_overhead")
    real, flag = ops.kernel_module, os.environ.get("TRITON_INTERPRET")
    assert script.main(["--cpu", "--parts", "--d", "320", "--calls", "4", "--rounds", "2"]) == 0
    text = capsys.readouterr().out
    assert ops.kernel_module is real and os.environ.get("TRITON_INTERPRET") == flag
    rows = [line for line in text.splitlines() if line.startswith("  part ")]
    assert len(rows) == 15 and not [r for r in rows if " n/a " in r], text
    for part in ("dense: public call", "varlen: validation + plan + boundaries", "decode: value checks"):
        assert any(part in r for r in rows), part


def test_host_overhead_targets():
    """Each target divides by its yardstick (or reads microseconds) and says whether it is met; torch SDPA's own rows
    and paths that raised are not judged."""
    script = _script("host_overhead")
    results = {("dense", "fwd", "cutedsl"): (40.0, 41.0), ("dense", "fwd", script.SDPA_TINY): (10.0, 11.0),
               ("dense", "fwd+bwd", "triton"): (90.0, 95.0), ("dense", "fwd+bwd", script.SDPA): (100.0, 120.0),
               ("varlen", "fwd", "implicit"): (55.0, 56.0), ("decode", "fwd", "implicit"): (61.0, 62.0),
               ("varlen", "fwd", "triton"): RuntimeError("no")}
    lines = script.target_lines(results, script.GPU_TARGETS)
    assert lines == ["  dense fwd cutedsl: 4.00x dense fwd torch-sdpa tiny (target <= 3x) NOT met",
                     "  dense fwd+bwd triton: 0.90x dense fwd+bwd torch-sdpa (target <= 1x) met",
                     "  varlen fwd implicit: 55.0 us (target <= 60 us) met",
                     "  decode fwd implicit: 61.0 us (target <= 60 us) NOT met"], lines


def test_kernel_ab_checks_its_arguments(capsys):
    script = _script("kernel_ab")
    with pytest.raises(SystemExit) as exc:
        script.main(["--only", "bwd-ring,fwd-tiles"])
    assert exc.value.code == 2 and "unknown ['fwd-tiles']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert script.main(["--only", "bwd-ring"]) == 2 and "needs an sm90 GPU" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["kvcache-decode", "kvcache-append", "kvcache-paged", "kvcache-gather",
                                    "triton-splitkv"])
@pytest.mark.parametrize("causal", [False, True])
def test_memcheck_families_run_on_the_interpreter(family, causal):
    """The KV-cache and split-KV families of bench/memcheck.py (their checks, on CPU at D = 64 under the Triton
    interpreter): the planner's route / kernel is the family's, nothing outside the sequences changes, the output
    matches the reference."""
    memcheck = _script("memcheck")
    run, arg = memcheck.FAMILIES[family]
    assert run(arg, 64, causal, torch.bfloat16, device="cpu") == ""


def test_memcheck_kvcache_family_sees_a_stray_write(monkeypatch):
    """A kernel that writes one sentinel slot (outside every sequence) fails the family."""
    memcheck = _script("memcheck")
    real = memcheck.ffpa_attn_with_kvcache

    def stray(q, k_cache, v_cache, *args, **kwargs):
        out = real(q, k_cache, v_cache, *args, **kwargs)
        spare = (k_cache == memcheck.SENTINEL).all(-1).all(-1).nonzero()[0]
        k_cache[tuple(spare)] = 0
        return out

    monkeypatch.setattr(memcheck, "ffpa_attn_with_kvcache", stray)
    assert "k_cache" in memcheck._kvcache("append", 64, False, torch.bfloat16, device="cpu")


def test_memcheck_refuses_unknown_families(capsys):
    memcheck = _script("memcheck")
    with pytest.raises(SystemExit):
        memcheck.main(["--family", "kvcache-decode,bogus"])
    assert "bogus" in capsys.readouterr().err
    assert {"triton-splitkv", "cute-splitkv", "kvcache-decode", "kvcache-append", "kvcache-gather"} <= set(
        memcheck.FAMILIES)

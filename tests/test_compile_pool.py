"""ffpa_attn.cute.compile_pool: kernels compile in processes that never had a CUDA context (children of one
compile server: a fresh interpreter with no GPU visible that imported the compiler once), hand their result over
through the disk cache, and a job that fails or hangs leaves the caller to compile the kernel itself. No
``os.fork`` in the calling process."""
from __future__ import annotations

import functools
import json
import os
import time
import warnings
from pathlib import Path

import pytest

from ffpa_attn.cute import _cache, compile_pool

try:
    import cutlass  # noqa: F401

    HAS_CUTLASS = True
except ImportError:  # pragma: no cover
    HAS_CUTLASS = False
# a worker runs _cache._disk_get_or_compile, whose cache fingerprint hashes the cutlass version
pytestmark = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")


def record_worker(path: str) -> str:
    """A picklable stand-in for a kernel compile: writes what the worker process looks like."""
    import sys

    Path(path).write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "compiler_imported": "ffpa_attn.cute._compile" in sys.modules,
        "torch_cuda_initialized": bool(sys.modules.get("torch") and sys.modules["torch"].cuda.is_initialized()),
        "cache_dir": os.environ.get("FFPA_ATTN_CACHE_DIR"),
    }))
    return "built"


def fail() -> None:
    raise RuntimeError("compiler exploded")


def startup_fd_open(path: str) -> str:
    """A job that checks the descriptor a library opened at the server's start-up is still open."""
    import sitecustomize

    same = os.fstat(sitecustomize.FFPA_TEST_FD).st_ino == sitecustomize.FFPA_TEST_INO  # not a reused number
    Path(path).write_text("open" if same and sitecustomize.FFPA_TEST_PID == os.getppid() else "closed")
    return "built"


@pytest.fixture
def no_fork(monkeypatch, tmp_path):
    """The cache in tmp_path, parallel compiles on, and os.fork forbidden in this process."""
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FFPA_ATTN_CUTE_PARALLEL_COMPILE", raising=False)
    monkeypatch.delenv("FFPA_ATTN_CUTE_DISK_CACHE", raising=False)

    def forbidden(*a, **k):
        raise AssertionError("os.fork called")

    monkeypatch.setattr(os, "fork", forbidden)
    yield tmp_path
    _cache.wait_all()
    _cache.clear_memory_cache()


def test_compiles_in_a_child_of_a_prestarted_server_without_gpu(no_fork):
    out1, out2 = no_fork / "w1.json", no_fork / "w2.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fork warning (nor any other) from starting the server
        compile_pool.pool().prestart(1)  # what api.py does before its own first cutlass import
        server = compile_pool.pool().server_pid()
        job = _cache.compile_in_child(("pool-env",), "sm_90a", functools.partial(record_worker, str(out1)))
    assert server is not None
    assert job is not None and _cache._PENDING[("sm_90a", ("pool-env",))] == job
    assert _cache.wait_child(job) is True
    seen = json.loads(out1.read_text())
    # a child of the prestarted server, forked after the server imported the compiler
    assert seen["pid"] not in (os.getpid(), server) and seen["ppid"] == server and seen["compiler_imported"]
    assert seen["cuda_visible"] == "" and not seen["torch_cuda_initialized"]
    assert seen["cache_dir"] == str(no_fork / "cache")  # the caller's cache root, as of the submission
    # the server stays up: a second job (another cache root) is forked by the same server
    os.environ["FFPA_ATTN_CACHE_DIR"] = str(no_fork / "cache2")
    job = _cache.compile_in_child(("pool-env-2",), "sm_90a", functools.partial(record_worker, str(out2)))
    assert job is not None and _cache.wait_child(job) is True
    second = json.loads(out2.read_text())
    assert second["ppid"] == server and second["cache_dir"] == str(no_fork / "cache2")
    assert compile_pool.pool().server_pid() == server
    records = compile_pool.pool().job_records()[-2:]
    assert [r["pid"] for r in records] == [seen["pid"], second["pid"]] and all(r["compiled"] for r in records)


def test_failure_timeout_and_wait_all(no_fork):
    """A failing compile reports False; a hanging one is killed at the timeout and its file lock freed (the
    caller then compiles the kernel itself); wait_all leaves nothing pending."""
    job = _cache.compile_in_child(("pool-fail",), "sm_90a", fail)
    assert job is not None and _cache.wait_child(job) is False
    job = _cache.compile_in_child(("pool-hang",), "sm_90a", functools.partial(time.sleep, 300))
    assert job is not None
    t0 = time.monotonic()
    assert _cache.wait_child(job, timeout_s=2.0) is False
    assert time.monotonic() - t0 < 30
    # the key's file lock died with the worker: compiling the same key here does not block
    _cache._PENDING.clear()
    assert _cache.get_or_compile(("pool-hang",), "sm_90a", lambda: "built") == "built"
    job = _cache.compile_in_child(("pool-wait-all",), "sm_90a", functools.partial(time.sleep, 0.2))
    assert job is not None and _cache._PENDING
    _cache.wait_all()
    assert not _cache._PENDING and compile_pool.pool().done(job)


def test_what_is_not_handed_to_a_worker(no_fork, monkeypatch):
    # a closure cannot travel to another interpreter: the caller compiles it when it needs it
    assert _cache.compile_in_child(("pool-closure",), "sm_90a", lambda: "built") is None
    monkeypatch.setenv("FFPA_ATTN_CUTE_DISK_CACHE", "0")  # the worker hands its kernel over through the disk
    assert _cache.compile_in_child(("pool-no-disk",), "sm_90a", fail) is None
    monkeypatch.delenv("FFPA_ATTN_CUTE_DISK_CACHE")
    monkeypatch.setenv("FFPA_ATTN_CUTE_PARALLEL_COMPILE", "0")
    assert _cache.compile_in_child(("pool-off",), "sm_90a", fail) is None
    assert not _cache._PENDING


def test_kernel_build_functions_pickle():
    """What api.py hands to a worker must pickle (a partial of a module-level function, never a closure)."""
    import pickle

    import torch

    from ffpa_attn.cute import api

    fwd = api._fwd_build(api.fwd_config(512, torch.bfloat16, True), "sm_90a")
    bwd = api._bwd_build(api.bwd_config(512, torch.bfloat16, False), True, "sm_90a")
    for build in (fwd, bwd):
        again = pickle.loads(pickle.dumps(build))
        assert again.func is build.func and again.args == build.args


def append_line(path: str) -> str:
    """A picklable compile stand-in that leaves one line per run (counts how often a key was compiled)."""
    time.sleep(0.5)  # still running when the same key is handed over again
    with open(path, "a") as f:
        f.write("compiled\n")
    return "built"


def test_one_key_is_handed_over_once(no_fork):
    """A key handed over and not finished yet is not handed over again (no second compile of one kernel)."""
    runs = no_fork / "runs.txt"
    build = functools.partial(append_line, str(runs))
    first = _cache.compile_in_child(("pool-once",), "sm_90a", build)
    assert first is not None and _cache.compile_in_child(("pool-once",), "sm_90a", build) == first
    _cache.wait_all()
    assert runs.read_text().count("compiled") == 1


def test_server_starts_ahead_single_threaded_and_exits_fast(no_fork):
    """prestart starts the server before any job (its imports overlap the caller's); it imported the compiler
    without torch and has one OS thread when it forks; a shutdown while it still imports does not wait for the
    imports."""
    pool = compile_pool.CompilePool()
    pool.prestart(2)
    assert pool.server_pid() is not None
    t0 = time.monotonic()
    pool.shutdown()  # at once: the imports take seconds
    assert time.monotonic() - t0 < 2 and pool.server_pid() is None
    pool.prestart(1)
    server = pool._server
    assert server.ready.wait(120) and server.startup["os_threads"] == 1
    assert not server.startup["torch_imported"]  # the compiler and the kernels import without torch
    job = pool.submit(("pool-ahead",), "sm_90a", functools.partial(time.sleep, 0))
    assert job is not None and pool.wait(job, 60)
    (record,) = pool.job_records()
    assert record["ok"] and record["queued_s"] < 5  # the server was ready: the job did not wait for its imports
    pool.shutdown()


def test_server_keeps_descriptors_opened_at_its_start_up(no_fork, tmp_path, monkeypatch):
    """Libraries injected into the server (compute-sanitizer's, for one) open descriptors before the server's own
    code runs; closing them broke its imports with EBADF (and the caller compiled everything itself)."""
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nFFPA_TEST_FD = os.open(__file__, os.O_RDONLY)\n"
        "FFPA_TEST_INO, FFPA_TEST_PID = os.fstat(FFPA_TEST_FD).st_ino, os.getpid()\n")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])  # the server's PYTHONPATH comes from sys.path
    compile_pool.pool().shutdown()
    try:
        out = tmp_path / "fd.txt"
        job = _cache.compile_in_child(("pool-fd",), "sm_90a", functools.partial(startup_fd_open, str(out)))
        assert job is not None and _cache.wait_child(job) is True
        assert out.read_text() == "open"
    finally:
        compile_pool.pool().shutdown()  # the next server starts without this sitecustomize

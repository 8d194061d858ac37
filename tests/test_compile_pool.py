"""ffpa_attn.cache.pool: artifacts compile in processes that never had a CUDA context (children of one compile
server: a fresh interpreter with no GPU visible and no torch that imported its preload modules once), hand their
result over through the disk cache, and a job that fails or hangs leaves the caller to compile the artifact itself.
No ``os.fork`` in the calling process. The generic tests use trivial picklable build functions (no compiler); the
CuTeDSL adapter's test needs cutlass."""
from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest

from ffpa_attn.cache import PICKLE, ArtifactCache, CompilePool, Store
from ffpa_attn.cutedsl import _cache

try:
    import cutlass  # noqa: F401

    HAS_CUTLASS = True
except ImportError:  # pragma: no cover
    HAS_CUTLASS = False

# a module nothing but the preload imports in the server (so a job's child sees the preload happened)
PRELOAD_MARK = "ffpa_attn.common.causal"


def record_worker(path: str) -> str:
    """A picklable stand-in for a compile: writes what the worker process looks like."""
    Path(path).write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "preloaded": PRELOAD_MARK in sys.modules, "cute_compiler": "ffpa_attn.cutedsl._compile" in sys.modules,
        "torch_imported": sys.modules.get("torch") is not None,  # None: made unimportable (cutedsl._server)
        "tvm_ffi": "tvm_ffi" in sys.modules,
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


def append_line(path: str) -> str:
    """A picklable compile stand-in that leaves one line per run (counts how often a key was compiled)."""
    time.sleep(0.5)  # still running when the same key is handed over again
    with open(path, "a") as f:
        f.write("compiled\n")
    return "built"


@pytest.fixture
def no_fork(monkeypatch, tmp_path):
    """The cache in tmp_path and os.fork forbidden in this process."""
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path / "cache"))

    def forbidden(*a, **k):
        raise AssertionError("os.fork called")

    monkeypatch.setattr(os, "fork", forbidden)
    return tmp_path


@pytest.fixture
def arts(no_fork):
    """A pickle-format cache with its own pool (3 workers, preloading :data:`PRELOAD_MARK`)."""
    pool = CompilePool("test", preload=(PRELOAD_MARK,), max_workers=lambda: 3)
    cache = ArtifactCache(Store("test", PICKLE), pool=lambda: pool)
    yield cache
    cache.wait_all()
    pool.shutdown()


def test_compiles_in_a_child_of_a_prestarted_server_without_gpu_or_torch(arts, no_fork):
    out1, out2 = no_fork / "w1.json", no_fork / "w2.json"
    pool = arts.pool()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fork warning (nor any other) from starting the server
        pool.prestart(1)  # what a caller does before its own one-time imports
        server = pool.server_pid()
        job = arts.submit(("pool-env",), "fp", functools.partial(record_worker, str(out1)))
    assert server is not None
    assert job is not None and arts.pending() == {("fp", ("pool-env",)): job}
    assert pool.wait(job) is True
    seen = json.loads(out1.read_text())
    # a child of the prestarted server, forked after the server imported its preload modules
    assert seen["pid"] not in (os.getpid(), server) and seen["ppid"] == server and seen["preloaded"]
    assert seen["cuda_visible"] == "" and not seen["torch_imported"]
    assert seen["cache_dir"] == str(no_fork / "cache")  # the caller's cache root, as of the submission
    assert arts.get_or_compile(("pool-env",), "fp", fail) == "built"  # the job's artifact, loaded from disk
    # the server stays up: a second job (another cache root) is forked by the same server
    os.environ["FFPA_ATTN_CACHE_DIR"] = str(no_fork / "cache2")
    job = arts.submit(("pool-env-2",), "fp", functools.partial(record_worker, str(out2)))
    assert job is not None and pool.wait(job) is True
    second = json.loads(out2.read_text())
    assert second["ppid"] == server and second["cache_dir"] == str(no_fork / "cache2")
    assert (no_fork / "cache2" / "test" / "fp").is_dir()
    assert pool.server_pid() == server
    records = pool.job_records()[-2:]
    assert [r["pid"] for r in records] == [seen["pid"], second["pid"]] and all(r["compiled"] for r in records)
    assert not pool.startup_stats()["torch_imported"] and pool.startup_stats()["os_threads"] == 1


def test_failure_timeout_and_wait_all(arts):
    """A failing compile reports False; a hanging one is killed at the timeout and its file lock freed (the
    caller then compiles the artifact itself); wait_all leaves nothing pending."""
    pool = arts.pool()
    job = arts.submit(("pool-fail",), "fp", fail)
    assert job is not None and pool.wait(job) is False
    assert "compiler exploded" in pool.job_records()[-1]["error"]
    job = arts.submit(("pool-hang",), "fp", functools.partial(time.sleep, 300))
    assert job is not None
    t0 = time.monotonic()
    assert pool.wait(job, timeout_s=2.0) is False
    assert time.monotonic() - t0 < 30
    # the key's file lock died with the worker: compiling the same key here does not block
    assert arts.get_or_compile(("pool-hang",), "fp", lambda: "built") == "built"
    job = arts.submit(("pool-wait-all",), "fp", functools.partial(time.sleep, 0.2))
    assert job is not None and arts.pending()
    arts.wait_all()
    assert not arts.pending() and pool.done(job)


def test_a_pending_job_is_waited_for_before_the_disk_is_read(arts, no_fork):
    """get_or_compile of a key a worker is compiling waits for it and loads its file (no second compile)."""
    runs = no_fork / "runs.txt"
    assert arts.submit(("pool-wait",), "fp", functools.partial(append_line, str(runs))) is not None
    assert arts.get_or_compile(("pool-wait",), "fp", fail) == "built"
    assert runs.read_text().count("compiled") == 1 and not arts.pending()


def test_what_is_not_handed_to_a_worker(arts, monkeypatch):
    # a closure cannot travel to another interpreter: the caller compiles it when it needs it
    assert arts.submit(("pool-closure",), "fp", lambda: "built") is None
    no_disk = ArtifactCache(arts.store, disk=lambda: False, pool=arts.pool)  # a worker hands over through the disk
    assert no_disk.submit(("pool-no-disk",), "fp", fail) is None
    assert ArtifactCache(arts.store).submit(("pool-no-pool",), "fp", fail) is None
    # the CuTeDSL switches (checked before anything imports cutlass)
    monkeypatch.setenv("FFPA_ATTN_CUTE_DISK_CACHE", "0")
    assert _cache.compile_in_child(("pool-no-disk",), "sm_90a", fail) is None
    monkeypatch.delenv("FFPA_ATTN_CUTE_DISK_CACHE")
    monkeypatch.setenv("FFPA_ATTN_CUTE_PARALLEL_COMPILE", "0")
    assert _cache.compile_in_child(("pool-off",), "sm_90a", fail) is None
    assert not arts.pending() and not _cache.KERNELS.pending()


def test_at_most_max_workers_jobs_run(no_fork):
    pool = CompilePool("test-one", max_workers=lambda: 1)
    cache = ArtifactCache(Store("test", PICKLE), pool=lambda: pool)
    try:
        first = cache.submit(("pool-a",), "fp", functools.partial(time.sleep, 0.5))
        assert first is not None and cache.submit(("pool-b",), "fp", fail) is None
        assert pool.wait(first) is True
        assert cache.submit(("pool-b",), "fp", functools.partial(time.sleep, 0)) is not None
    finally:
        cache.wait_all()
        pool.shutdown()


def test_kernel_build_functions_pickle():
    """What cutedsl/api.py hands to a worker must pickle (a partial of a module-level function, never a closure)."""
    import pickle

    import torch

    from ffpa_attn.cutedsl import api

    fwd = api._fwd_build(api.fwd_config(512, torch.bfloat16, True), "sm_90a")
    bwd = api._bwd_build(api.bwd_config(512, torch.bfloat16, False), True, "sm_90a")
    for build in (fwd, bwd):
        again = pickle.loads(pickle.dumps(build))
        assert again.func is build.func and again.args == build.args


def test_one_key_is_handed_over_once(arts, no_fork):
    """A key handed over and not finished yet is not handed over again (no second compile of one artifact)."""
    runs = no_fork / "runs.txt"
    build = functools.partial(append_line, str(runs))
    first = arts.submit(("pool-once",), "fp", build)
    assert first is not None and arts.submit(("pool-once",), "fp", build) == first
    arts.wait_all()
    assert runs.read_text().count("compiled") == 1
    # finished and on disk: the next job only finds the file (nothing compiled)
    job = arts.submit(("pool-once",), "fp", build)
    assert job is not None and arts.pool().wait(job) and arts.pool().job_records()[-1]["compiled"] is False


def test_server_starts_ahead_and_exits_fast(no_fork):
    """prestart starts the server before any job (its imports overlap the caller's); a shutdown while it still
    imports does not wait for the imports; a job of a ready server does not queue."""
    pool = CompilePool("test-ahead", preload=(PRELOAD_MARK,))
    pool.prestart(2)
    assert pool.server_pid() is not None
    t0 = time.monotonic()
    pool.shutdown()  # at once
    assert time.monotonic() - t0 < 2 and pool.server_pid() is None
    pool.prestart(1)
    server = pool._server
    assert server.ready.wait(120) and server.startup["os_threads"] == 1
    job = pool.submit(("pool-ahead",), functools.partial(time.sleep, 0))
    assert job is not None and pool.wait(job, 60)
    (record,) = pool.job_records()
    assert record["ok"] and record["queued_s"] < 5  # the server was ready: the job did not wait for its imports
    pool.shutdown()


def test_server_restarts_when_its_start_up_configuration_changes(no_fork, monkeypatch):
    monkeypatch.setenv("FFPA_TEST_COMPILER_OPT", "a")
    pool = CompilePool("test-env", startup_env=lambda: {"FFPA_TEST_COMPILER": os.environ["FFPA_TEST_COMPILER_OPT"]})
    try:
        pool.prestart(1)
        first = pool.server_pid()
        pool.prestart(1)
        assert pool.server_pid() == first
        assert pool.worker_env()["FFPA_TEST_COMPILER"] == "a"
        monkeypatch.setenv("FFPA_TEST_COMPILER_OPT", "b")
        pool.prestart(1)
        assert pool.server_pid() not in (None, first)
    finally:
        pool.shutdown()


def test_server_keeps_descriptors_opened_at_its_start_up(arts, tmp_path, monkeypatch):
    """Libraries injected into the server (compute-sanitizer's, for one) open descriptors before the server's own
    code runs; closing them broke its imports with EBADF (and the caller compiled everything itself)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nFFPA_TEST_FD = os.open(__file__, os.O_RDONLY)\n"
        "FFPA_TEST_INO, FFPA_TEST_PID = os.fstat(FFPA_TEST_FD).st_ino, os.getpid()\n")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])  # the server's PYTHONPATH comes from sys.path
    out = tmp_path / "fd.txt"
    job = arts.submit(("pool-fd",), "fp", functools.partial(startup_fd_open, str(out)))
    assert job is not None and arts.pool().wait(job) is True
    assert out.read_text() == "open"


@pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl is not installed")
def test_cute_pool_forks_from_a_server_that_imported_the_compiler_without_torch(no_fork):
    """The CuTeDSL pool's server imported the compiler (cutlass and the kernels) without torch, with the
    compiler's arch set before that import; its jobs' children see no GPU."""
    out = no_fork / "w.json"
    pool = _cache.pool()
    try:
        pool.prestart(1)
        job = pool.submit(("pool-cute",), functools.partial(record_worker, str(out)))
        assert job is not None and pool.wait(job) is True
        seen = json.loads(out.read_text())
        # the compiler and TVM-FFI (which the kernels compile with) preloaded, torch not: a job pays neither import
        assert seen["cute_compiler"] and seen["tvm_ffi"] and not seen["torch_imported"] and seen["cuda_visible"] == ""
        assert not pool.startup_stats()["torch_imported"]
        assert pool.worker_env()["CUTE_DSL_ARCH"] == os.environ.get("CUTE_DSL_ARCH", "sm_90a")
    finally:
        pool.shutdown()

"""ffpa_attn.cache: the generic compiled-artifact cache (memory, disk, per-key locks, a cache that never fails) and
the disk primitives, on CPU with trivial picklable build functions (no compiler)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ffpa_attn.cache import (PICKLE, ArtifactCache, FileLock, Store, build_to_disk, bytes_format, key_name,
                             kind_dir, read_json, update_json)

REPO = str(Path(__file__).resolve().parents[1])


class Builder:
    """Counts its builds; returns a fresh value each time (so a reload is told apart from the object built)."""

    def __init__(self, value: object = "artifact", delay: float = 0.0):
        self.value, self.delay, self.calls = value, delay, 0

    def __call__(self) -> object:
        self.calls += 1
        time.sleep(self.delay)
        return {"value": self.value, "build": self.calls}


@pytest.fixture
def root(monkeypatch, tmp_path):
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def store():
    return Store("test", PICKLE)


def test_miss_then_memory_hit_then_disk_hit_in_a_new_cache(root, store):
    build = Builder()
    cache = ArtifactCache(store)
    first = cache.get_or_compile(("k", 1), "fp1", build)
    assert first == {"value": "artifact", "build": 1} and build.calls == 1
    assert cache.get_or_compile(("k", 1), "fp1", build) is first and build.calls == 1  # memory
    path = store.path(("k", 1), "fp1")
    assert path.parent == root / "test" / "fp1" and path.suffix == ".pkl" and path.exists()
    assert not list(path.parent.glob(".tmp_*"))  # atomic write left no temp file
    fresh = ArtifactCache(store)  # what a later process sees
    assert fresh.is_cached(("k", 1), "fp1") and not fresh.is_cached(("k", 2), "fp1")
    again = fresh.get_or_compile(("k", 1), "fp1", build)
    assert again == first and again is not first and build.calls == 1  # loaded from disk
    # another key or another fingerprint (the sources changed) compiles
    fresh.get_or_compile(("k", 2), "fp1", build)
    fresh.get_or_compile(("k", 1), "fp2", build)
    assert build.calls == 3 and (root / "test" / "fp2").is_dir()
    fresh.clear_memory()
    assert fresh.get_or_compile(("k", 2), "fp1", build)["build"] == 2 and build.calls == 3


_RELOAD = """
import sys
from ffpa_attn.cache import PICKLE, ArtifactCache, Store
calls = []
def build():
    calls.append(1)
    return {"made_by": sys.argv[1]}
got = ArtifactCache(Store("test", PICKLE)).get_or_compile(("k",), "fp", build)
print(len(calls), got["made_by"])
"""


def test_a_fresh_process_loads_what_another_wrote(root):
    env = {**os.environ, "FFPA_ATTN_CACHE_DIR": str(root), "PYTHONPATH": os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.run([sys.executable, "-c", _RELOAD, name], capture_output=True, text=True, env=env,
                           timeout=120) for name in ("first", "second")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert [r.stdout.split() for r in runs] == [["1", "first"], ["0", "first"]]


def test_a_corrupt_file_is_rebuilt(root, store):
    build = Builder()
    path = store.path(("k",), "fp")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a pickle")
    assert ArtifactCache(store).get_or_compile(("k",), "fp", build)["build"] == 1
    assert ArtifactCache(store).get_or_compile(("k",), "fp", build)["build"] == 1 and build.calls == 1  # rewritten


def test_a_disk_that_refuses_falls_back_to_compiling(monkeypatch, tmp_path, store):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(blocker / "root"))  # a root under a file: mkdir fails
    build = Builder()
    cache = ArtifactCache(store)
    assert cache.get_or_compile(("k",), "fp", build)["build"] == 1
    assert cache.get_or_compile(("k",), "fp", build)["build"] == 1 and build.calls == 1  # memory still works
    assert not cache.is_cached(("other",), "fp")


def unpicklable() -> object:
    return lambda: None  # a lambda does not pickle: the save fails after the build


def test_a_failed_write_keeps_the_artifact_and_a_failed_build_is_the_callers(root, store):
    cache = ArtifactCache(store)
    assert callable(cache.get_or_compile(("k",), "fp", unpicklable))
    assert not store.path(("k",), "fp").exists() and not list((root / "test" / "fp").glob(".tmp_*"))

    def broken() -> object:
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="compiler exploded"):
        cache.get_or_compile(("bad",), "fp", broken)
    with pytest.raises(RuntimeError, match="compiler exploded"):  # not remembered as a result
        cache.get_or_compile(("bad",), "fp", broken)


def test_disk_off_keeps_artifacts_in_memory_only(root, store):
    build = Builder()
    cache = ArtifactCache(store, disk=lambda: False)
    cache.get_or_compile(("k",), "fp", build)
    assert not (root / "test").exists() and not ArtifactCache(store, disk=lambda: False).is_cached(("k",), "fp")


def test_one_key_compiles_once_across_threads(root, store):
    build = Builder(delay=0.3)
    cache = ArtifactCache(store)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get_or_compile(("k",), "fp", build)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.calls == 1 and all(g is got[0] for g in got)


def test_other_keys_do_not_wait_for_a_slow_compile(root, store):
    cache = ArtifactCache(store)
    slow = threading.Thread(target=cache.get_or_compile, args=(("slow",), "fp", Builder(delay=2.0)))
    slow.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    cache.get_or_compile(("fast",), "fp", Builder())
    assert time.monotonic() - t0 < 1.5
    slow.join()


def test_the_file_lock_orders_processes_on_one_key(root, store):
    """While another process holds a key's lock (compiling it), a lookup waits and then loads that process's
    file instead of compiling."""
    path = store.path(("k",), "fp")
    path.parent.mkdir(parents=True)
    build, got = Builder(), []
    with FileLock(path.with_suffix(".lock")):
        lookup = threading.Thread(target=lambda: got.append(ArtifactCache(store).get_or_compile(("k",), "fp", build)))
        lookup.start()
        time.sleep(0.3)
        assert lookup.is_alive() and not got  # blocked on the lock
        PICKLE.save({"value": "other process"}, path)
    lookup.join(10)
    assert got == [{"value": "other process"}] and build.calls == 0


def test_build_to_disk_is_what_a_compile_job_runs(root, store):
    build = Builder()
    assert build_to_disk(store, ("k",), "fp", build) is True
    assert build_to_disk(store, ("k",), "fp", build) is False and build.calls == 1  # on disk already
    assert PICKLE.load(store.path(("k",), "fp"))["build"] == 1


def test_bytes_format_and_key_names(root):
    cubins = Store("cubin_test", bytes_format(".cubin"))
    cache = ArtifactCache(cubins)
    assert cache.get_or_compile("ffpa_fwd_d512_sm_90a_abc", "fp", lambda: b"\x7fELF") == b"\x7fELF"
    assert (root / "cubin_test" / "fp" / "ffpa_fwd_d512_sm_90a_abc.cubin").read_bytes() == b"\x7fELF"
    assert ArtifactCache(cubins).get_or_compile("ffpa_fwd_d512_sm_90a_abc", "fp", lambda: b"other") == b"\x7fELF"
    # tuples and unsafe strings are hashed; the hash is the same in every process (repr of str / int / bool)
    assert key_name(("bf16", 512, True)) == key_name(("bf16", 512, True)) != key_name(("bf16", 512, False))
    assert key_name("../escape").startswith("k") and "/" not in key_name("../escape")
    with pytest.raises(ValueError, match="cache kind"):
        kind_dir("../x")


def test_update_json_merges_concurrent_writers(root):
    path = kind_dir("test") / "fp" / "results.json"
    threads = [threading.Thread(target=update_json, args=(path, {f"key{i}": {"ms": i}})) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert read_json(path) == {f"key{i}": {"ms": i} for i in range(8)}
    path.write_text("[1, 2]")  # not an object: read as empty, then replaced
    assert read_json(path) == {} and update_json(path, {"a": 1}) and json.loads(path.read_text()) == {"a": 1}
    (root / "blocker").write_text("")
    assert update_json(root / "blocker" / "x.json", {"a": 1}) is False  # a disk that refuses: no exception


_BARE_IMPORT = """
import sys, types
pkg = types.ModuleType("ffpa_attn")
pkg.__path__, pkg.__version__ = [sys.argv[1] + "/ffpa_attn"], "0"
sys.modules["ffpa_attn"] = pkg
import ffpa_attn.cache
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("ffpa_attn.")))
"""


def test_the_package_imports_no_torch_and_no_backend():
    """What the compile server imports (a bare ffpa_attn package, as its bootstrap registers): no torch, no
    backend package, only the environment registry besides itself."""
    run = subprocess.run([sys.executable, "-c", _BARE_IMPORT, REPO], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[0] == str(["ffpa_attn.cache", "ffpa_attn.cache.artifacts", "ffpa_attn.cache.disk",
                                            "ffpa_attn.cache.pool", "ffpa_attn.common", "ffpa_attn.common.env"])

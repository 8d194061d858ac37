"""The environment-variable registry (ffpa_attn.common.env) and the cache root every cache uses (ffpa_attn.cache)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ffpa_attn import cache
from ffpa_attn.common import env

PKG = Path(__file__).resolve().parents[1] / "ffpa_attn"


def test_every_variable_the_package_reads_is_registered():
    """Every FFPA_ATTN_* name in the package source is in the registry (so the README table lists it)."""
    names = set()
    for path in PKG.rglob("*"):
        if path.suffix in (".py", ".cu", ".cuh", ".h"):
            names |= set(re.findall(r"FFPA_ATTN_[A-Z0-9_]+", path.read_text()))
    assert names, "the scan found nothing: the pattern or the path is wrong"
    assert names <= set(env.REGISTRY), sorted(names - set(env.REGISTRY))
    assert set(env.REGISTRY) <= names  # no stale entries either


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("ON", True), ("0", False), ("false", False),
                                        ("no", False), ("", True)])
def test_env_flag(monkeypatch, value, want):
    monkeypatch.setenv("FFPA_ATTN_TAIL_SPLIT", value)
    assert env.env_flag("FFPA_ATTN_TAIL_SPLIT") is want


def test_env_flag_rejects_typos_and_unknown_names(monkeypatch):
    monkeypatch.setenv("FFPA_ATTN_TAIL_SPLIT", "nope")
    with pytest.raises(ValueError, match="FFPA_ATTN_TAIL_SPLIT"):
        env.env_flag("FFPA_ATTN_TAIL_SPLIT")
    with pytest.raises(KeyError):
        env.env_str("FFPA_ATTN_NOT_A_VARIABLE")
    monkeypatch.delenv("FFPA_ATTN_TAIL_SPLIT")
    assert env.env_flag("FFPA_ATTN_TAIL_SPLIT") is True  # its default


def test_env_int_and_the_compile_worker_cap(monkeypatch):
    from ffpa_attn.cutedsl import _cache

    monkeypatch.delenv("FFPA_ATTN_CUTE_COMPILE_WORKERS", raising=False)
    assert env.env_int("FFPA_ATTN_CUTE_COMPILE_WORKERS") == 3 == _cache.max_workers()
    assert _cache.pool().max_workers is _cache.max_workers  # the pool reads it at each submission
    monkeypatch.setenv("FFPA_ATTN_CUTE_COMPILE_WORKERS", "0")
    assert _cache.max_workers() == 1  # at least one worker
    monkeypatch.setenv("FFPA_ATTN_CUTE_COMPILE_WORKERS", "two")
    with pytest.raises(ValueError, match="FFPA_ATTN_CUTE_COMPILE_WORKERS must be an integer"):
        _cache.max_workers()
    with pytest.raises(TypeError, match="not an integer variable"):
        env.env_int("FFPA_ATTN_TAIL_SPLIT")


def test_markdown_table_lists_every_variable():
    table = env.markdown_table()
    assert table.count("\n") == len(env.REGISTRY) + 1
    for name in env.REGISTRY:
        assert f"`{name}`" in table


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_root() == tmp_path / "a"
    monkeypatch.delenv("FFPA_ATTN_CACHE_DIR")
    assert cache.cache_root() == tmp_path / "x" / "ffpa_attn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == Path.home() / ".cache" / "ffpa_attn"


def test_every_cache_uses_the_root(monkeypatch, tmp_path):
    from ffpa_attn.cuda import build
    from ffpa_attn.cutedsl import _cache
    from ffpa_attn.triton import autotune

    monkeypatch.delenv("FFPA_ATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = tmp_path / "ffpa_attn"
    assert autotune.cache_dir() == root / "autotune" == cache.kind_dir("autotune")
    assert build.cache_dir() == root / "cuda" == build.CUBINS.store.path("x", "fp").parent.parent
    assert _cache.KERNELS.store.path(("k",), "fp").parent.parent == root / "cute"


def test_source_fingerprint_and_atomic_write(tmp_path):
    f = tmp_path / "k.py"
    f.write_text("a")
    one = cache.source_fingerprint([f], extra="v1")
    assert one == cache.source_fingerprint([f], extra="v1") and len(one) == 24
    assert one != cache.source_fingerprint([f], extra="v2")
    f.write_text("b")
    assert one != cache.source_fingerprint([f], extra="v1")
    out = tmp_path / "sub" / "x.bin"
    with cache.FileLock(tmp_path / "x.lock"):
        cache.atomic_write(out, b"data")
    assert out.read_bytes() == b"data" and [p.name for p in out.parent.iterdir()] == ["x.bin"]

"""Every backend's kernel module implements the kernel-module protocol (ffpa_attn.kernel_module)."""
from __future__ import annotations

import importlib
import inspect

import pytest

from ffpa_attn.dispatch.capabilities import KERNEL_MODULES
from ffpa_attn.kernel_module import OPTIONAL, REQUIRED, KernelModule, PreparesBackward


def _keyword_only(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


@pytest.mark.parametrize("backend", sorted(KERNEL_MODULES))
def test_module_satisfies_the_protocol(backend):
    mod = importlib.import_module(KERNEL_MODULES[backend])  # never imports cutlass / a compiler
    assert isinstance(mod, KernelModule)
    for name in REQUIRED + tuple(n for n in OPTIONAL if hasattr(mod, n)):
        fn, want = getattr(mod, name), getattr(PreparesBackward if name in OPTIONAL else KernelModule, name)
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        if kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            continue  # a stub that accepts any call and raises NotImplementedError (the CUDA backward)
        have = _keyword_only(fn)
        assert set(_keyword_only(want)) <= set(have), (backend, name)
        extra = [p for p in inspect.signature(fn).parameters.values() if p.name in set(have) - set(_keyword_only(want))]
        assert all(p.default is not p.empty for p in extra), (backend, name, extra)  # extras are optional
        assert len(_positional(fn)) == len(_positional(want)), (backend, name)


def test_a_module_missing_a_function_fails_the_check():
    import types

    mod = types.ModuleType("broken")
    mod.dense_forward = mod.dense_backward = mod.varlen_forward = lambda *a, **k: None
    assert not isinstance(mod, KernelModule)

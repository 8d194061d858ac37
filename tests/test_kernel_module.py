"""Every backend's kernel module implements the kernel-module protocol (ffpa_attn.kernel_module)."""
from __future__ import annotations

import importlib
import inspect

import pytest

from ffpa_attn.dispatch.registry import REGISTRY
from ffpa_attn.kernel_module import OPTIONAL, REQUIRED, KernelModule, KernelSpec, PreparesBackward, load_spec

KERNEL_MODULES = {name: spec.kernel_module for name, spec in REGISTRY.items()}


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


@pytest.mark.parametrize("backend", sorted(KERNEL_MODULES))
def test_a_kernel_name_the_module_does_not_have_raises(backend):
    """The planner's kernel name is the module's only say in what runs: a name it lacks is an error naming the
    argument, never a silent substitute (checked before any input is looked at)."""
    mod = importlib.import_module(KERNEL_MODULES[backend])
    for name in REQUIRED:
        fn = getattr(mod, name)
        if "kernel" not in _keyword_only(fn):
            continue  # a stub that accepts any call and raises NotImplementedError (the CUDA backward)
        kw = {p: None for p in _keyword_only(fn)}
        with pytest.raises(ValueError, match=r"kernel: .*no kernel 'no_such_kernel'"):
            fn(*[None] * len(_positional(fn)), **{**kw, "kernel": KernelSpec("no_such_kernel")})


@pytest.mark.parametrize("backend", sorted(KERNEL_MODULES))
def test_the_module_runs_the_kernels_its_description_lists(backend):
    """A kernel package reads its kernel names from its own backend.json, the file the registry collects: the
    module's description object is the registry's (one source)."""
    mod = importlib.import_module(KERNEL_MODULES[backend])
    assert mod.SPEC is REGISTRY[backend] is load_spec(KERNEL_MODULES[backend])
    for entry in REQUIRED:
        fn = getattr(mod, entry)
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert bool(REGISTRY[backend].kernels_of(entry)) or kinds == {inspect.Parameter.VAR_POSITIONAL,
                                                                       inspect.Parameter.VAR_KEYWORD}, entry


def test_the_kernel_explain_names_is_the_kernel_that_runs(monkeypatch):
    """The Triton dense forward runs the kernel of the plan even when the heuristics say otherwise by the time the
    op runs (the module decides nothing again: it never reads the heuristics)."""
    import torch

    import ffpa_attn
    from ffpa_attn import triton as triton_mod
    from ffpa_attn.dispatch import heuristics
    from ffpa_attn.testing import make_qkv

    ran = []

    def spy(name):
        def run(q, k, v, **kw):
            ran.append(name)
            return torch.zeros_like(q), torch.zeros(q.shape[:3])
        return run

    monkeypatch.setattr(triton_mod.splitkv, "splitkv_forward", spy("splitkv_fwd"))
    monkeypatch.setattr(triton_mod.fwd, "dense_forward", spy("fwd"))
    for nq, nkv in ((2, 512), (64, 64)):  # split-KV-sized, then not
        q, k, v = make_qkv(1, 2, 2, nq, nkv, 264, torch.float16)
        with monkeypatch.context() as m:
            plan = ffpa_attn.explain(q, k, v, backend="triton")
            opposite = "fwd" if plan.forward.kernel == "splitkv_fwd" else "splitkv_fwd"
            m.setattr(heuristics, "splitkv_sized", lambda *a, **kw: opposite == "splitkv_fwd")
            torch.ops.ffpa_attn.attn(q, k, v, None, 0.0, None, False, 0.1, *plan.forward.op_args(),
                                     *plan.backward.op_args())
        assert ran[-1] == plan.forward.kernel != opposite, (nq, nkv, str(plan))
    assert ran == ["splitkv_fwd", "fwd"]


def test_the_cutedsl_forward_runs_the_named_kernel(monkeypatch):
    """The CuTeDSL dense forward takes S-recompute vs cluster vs split-KV, the tile, the last-wave split and the slice
    count from the kernel spec alone (not from the config's ``fwd_recompute`` nor from the query length); its kernels
    are stubbed (no cutlass, no GPU)."""
    import sys
    import types

    import torch

    import ffpa_attn.cutedsl as cute_mod
    from ffpa_attn.config import CuTeDSLBackend

    from ffpa_attn.common.tail_split import TailSplit

    ran = []
    api = types.SimpleNamespace(run_forward=lambda q, k, v, causal, scale, tile_n, tail, recompute: ran.append(
        ("fwd_sm90_recompute" if recompute else "fwd_sm90", tile_n, tail)))
    splitkv = types.SimpleNamespace(forward=lambda *a, splits, tile_n: ran.append(("splitkv_fwd_sm90", tile_n, splits)))
    monkeypatch.setitem(sys.modules, "ffpa_attn.cutedsl.api", api)
    monkeypatch.setitem(sys.modules, "ffpa_attn.cutedsl.splitkv", splitkv)
    monkeypatch.setattr(cute_mod, "splitkv", splitkv, raising=False)
    q = torch.empty(1, 2, 128, 768)  # long queries: split-KV only because it is named
    tail = (3, 0, 1, 64, 4, 64)
    for kernel, cfg, want in (
            (KernelSpec("fwd_sm90_recompute"), CuTeDSLBackend(fwd_recompute=False), ("fwd_sm90_recompute", None, None)),
            (KernelSpec.of("fwd_sm90", tile_n=80, tail=tail), CuTeDSLBackend(fwd_recompute=True),
             ("fwd_sm90", 80, TailSplit(*tail))),
            (KernelSpec.of("splitkv_fwd_sm90", splits=7, tile_n=64), CuTeDSLBackend(), ("splitkv_fwd_sm90", 64, 7))):
        cute_mod.dense_forward(q, q, q, attn_mask=None, dropout_p=0.0, rng=None, causal=False, scale=0.1,
                               config=cfg, kernel=kernel)
        assert ran[-1] == want


def test_the_triton_splitkv_forward_refuses_dropout():
    """The split-KV kernel has no dropout: named with dropout_p > 0 it raises instead of ignoring it."""
    import torch

    from ffpa_attn import triton as triton_mod

    q = torch.empty(1, 1, 1, 264)
    with pytest.raises(NotImplementedError, match="dropout"):
        triton_mod.dense_forward(q, q, q, attn_mask=None, dropout_p=0.1, rng=None, causal=False, scale=0.1,
                                 config=None, kernel=KernelSpec("splitkv_fwd"))

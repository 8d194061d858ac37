"""The host path of a call, on CPU: what the CuTeDSL backend needs at run time (TVM-FFI, named when missing), the
varlen work lists kept per unchanged boundary tensors, no kernel compiled or loaded during a CUDA-graph capture,
the shared-object format of the disk cache, an import that stays lazy, and eager calls that bypass torch's op
dispatch (no compiler stack imported, a profiler range per call) while compiled graphs hold the ops. The compile and load through TVM-FFI
themselves: tests/test_cute_compile.py (``test_aot_kernel_loads_without_the_compiler``).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ffpa_attn
from ffpa_attn.cutedsl import _cache, api, ranges
from ffpa_attn.testing import pretend_gpu


def test_import_loads_neither_the_compiler_nor_tvm_ffi():
    code = ("import sys, torch, ffpa_attn, ffpa_attn.cutedsl, ffpa_attn.cutedsl.api; "
            "bad = [m for m in ('cutlass', 'tvm_ffi') if m in sys.modules]; assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_missing_tvm_ffi_is_named(monkeypatch):
    """Without apache-tvm-ffi the implicit plan passes the CuTeDSL backend over with the reason, a named CuTeDSL
    backend raises naming the install, and a direct caller of the kernel module gets an ImportError saying so."""
    pretend_gpu(monkeypatch, missing=("tvm_ffi",))
    q = torch.empty(1, 4, 1024, 512, dtype=torch.bfloat16, device="meta")
    plan = ffpa_attn.explain(q, q, q)
    assert plan.forward.backend != "cutedsl" and "apache-tvm-ffi is not installed" in str(plan)
    with pytest.raises(NotImplementedError, match=r"apache-tvm-ffi is not installed.*\[cute\]"):
        ffpa_attn.explain(q, q, q, backend="cutedsl")
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # an import of it fails
    with pytest.raises(ImportError, match=r"ffpa-attn-kernels\[cute\]"):
        _cache.require_tvm_ffi()


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def test_work_lists_kept_per_unchanged_boundaries():
    """The same tensors, unchanged: the list built for them; an in-place write through torch (the version counter),
    another tensor with equal values, other scalars, or increment_version after a write torch cannot see (through
    ``.data``): a new list, equal to a fresh build."""
    ranges.clear_work_lists()
    cu = _cu([100, 30, 250])
    first = ranges.work_items(cu, cu, 380, 64, 64, True)
    assert ranges.work_items(cu, cu, 380, 64, 64, True) is first
    assert torch.equal(first, ranges.varlen_work_items(cu, cu, 380, 64, 64, True))
    assert ranges.work_items(cu, cu, 380, 64, 64, False) is not first  # another kernel's list
    assert ranges.work_items(cu.clone(), cu, 380, 64, 64, True) is not first  # another object
    cu[1:] = _cu([250, 30, 100])[1:]  # a write torch sees
    second = ranges.work_items(cu, cu, 380, 64, 64, True)
    assert second is not first and torch.equal(second, ranges.varlen_work_items(cu, cu, 380, 64, 64, True))
    cu.data.copy_(_cu([30, 100, 250]))  # a write torch does not see: the documented rule applies
    assert ranges.work_items(cu, cu, 380, 64, 64, True) is second
    torch.autograd.graph.increment_version(cu)
    third = ranges.work_items(cu, cu, 380, 64, 64, True)
    assert torch.equal(third, ranges.varlen_work_items(cu, cu, 380, 64, 64, True)) and not torch.equal(third, second)


def test_work_lists_never_kept_while_capturing_or_for_inference_tensors(monkeypatch):
    ranges.clear_work_lists()
    cu = _cu([64, 64])
    kept = ranges.work_items(cu, cu, 128, 64, 64, False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    during = ranges.work_items(cu, cu, 128, 64, 64, False)  # built in the capture: a replay rebuilds it
    assert during is not kept and torch.equal(during, kept)
    assert ranges.work_items(_cu([10, 20]), _cu([10, 20]), 30, 64, 64, False) is not None
    monkeypatch.undo()
    assert len(ranges._WORK_LISTS) == 1  # nothing built during the capture was kept
    with torch.inference_mode():
        ci = _cu([5, 7])
    assert ranges.work_items(ci, ci, 12, 64, 64, True) is not ranges.work_items(ci, ci, 12, 64, 64, True)


def test_work_list_cache_is_bounded():
    ranges.clear_work_lists()
    tensors = [_cu([i + 1]) for i in range(ranges.WORK_LIST_CACHE_SIZE + 5)]
    for t in tensors:
        ranges.work_items(t, t, int(t[-1]), 64, 64, False)
    assert len(ranges._WORK_LISTS) == ranges.WORK_LIST_CACHE_SIZE


def test_no_kernel_compiled_or_loaded_while_capturing(monkeypatch, tmp_path):
    """A kernel this process has not loaded is never compiled or loaded during a capture: a RuntimeError naming the
    warm-up, before any compiler runs."""
    monkeypatch.setenv("FFPA_ATTN_CACHE_DIR", str(tmp_path))
    built = []
    monkeypatch.setattr(api, "build_fwd", lambda *a: built.append(a))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cfg = api.fwd_config(384, torch.float16, True)
    with pytest.raises(RuntimeError, match="warm-up"):
        api.get_fwd_kernel(cfg)
    assert not built


def test_loaded_kernels_are_launched_without_a_cache_lookup(monkeypatch):
    """After the first lookup a kernel is one dict entry away: no fingerprint, no disk, no build."""
    calls = []
    monkeypatch.setattr(_cache.KERNELS, "get_or_compile", lambda key, fp, build: calls.append(key) or object())
    _cache.clear_memory_cache()
    try:
        first = _cache.get_or_compile(("k",), "sm_90a", lambda: None)
        assert _cache.get_or_compile(("k",), "sm_90a", lambda: None) is first and calls == [("k",)]
        assert _cache.is_loaded(("k",), "sm_90a") and not _cache.is_loaded(("k",), "sm_100a")
    finally:
        _cache.clear_memory_cache()


def test_shared_object_format(tmp_path, monkeypatch):
    """The exported symbol is a C identifier per file; linking goes through $CC (a failing one is an error the
    artifact cache logs and survives: the kernel then stays in memory only); no linker at all names the fix."""
    assert _cache._symbol(Path("kabc123.so")) == "ffpa_kabc123"
    assert _cache._symbol(Path("fwd-1.2.so")) == "ffpa_fwd_1_2"
    obj = tmp_path / "x.o"
    obj.write_bytes(b"not an object file")
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="linking x.o failed"):
        _cache.link_shared(obj, tmp_path / "x.so", [])
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(_cache.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler driver"):
        _cache._linker()


def test_a_real_object_file_links_and_loads(tmp_path):
    """The link step on a real object file (a C function compiled here) against a library, with an rpath: the
    shared object loads (dlopen) with the library found through the rpath."""
    import ctypes
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "lib.c").write_text("int seven(void) { return 7; }\n")
    (tmp_path / "k.c").write_text("int seven(void); int eight(void) { return seven() + 1; }\n")
    libdir = tmp_path / "libs"
    libdir.mkdir()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(libdir / "libseven.so"), str(tmp_path / "lib.c")], check=True)
    subprocess.run([cc, "-c", "-fPIC", "-o", str(tmp_path / "k.o"), str(tmp_path / "k.c")], check=True)
    _cache.link_shared(tmp_path / "k.o", tmp_path / "k.so", [str(libdir / "libseven.so")])
    assert ctypes.CDLL(str(tmp_path / "k.so")).eight() == 8


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed")
def test_launches_match_the_compiled_signatures(monkeypatch):
    """Every launch passes what its kernel was compiled for, positionally: the kernel class's ``__call__`` without
    ``self`` and the stream (TVM-FFI's environment stream), tensors where it takes tensors (unit stride on the last
    mode; 16-bit ones 16-byte aligned, lse / delta fp32, boundaries and work lists int32), a float for Float32, an int
    for Int32, None for an absent optional tensor (dense) and a tensor for it (varlen). Recorded on CPU tensors with a
    stand-in for the compiled function (the compiled one checks the same on a GPU)."""
    import inspect

    from ffpa_attn.cutedsl.bwd_dq_sm90 import FlashBwdDqSm90
    from ffpa_attn.cutedsl.bwd_sm90 import FlashBwdSm90SplitD
    from ffpa_attn.cutedsl.fwd_sm90 import FlashFwdSm90SplitD

    launches = []

    def fake(key, arch, build):
        kind = "dq" if "dq" in str(key) else ("bwd" if "bwd" in str(key).lower() else "fwd")
        return lambda *args: launches.append((kind, args))

    monkeypatch.setattr(_cache, "get_or_compile", fake)
    monkeypatch.setattr(_cache, "is_loaded", lambda key, arch: True)
    bf = torch.bfloat16
    q, k, v = (torch.randn(1, h, 80, 320).to(bf) for h in (4, 2, 2))
    out, lse = api.run_forward(q, k, v, True, 0.1)
    out.normal_(), lse.zero_()  # the stand-in wrote nothing: finite values for the backward's delta
    api.launch_q_broadcast(q[:1, :1], k[:, :1].expand(3, 1, 80, 320), v[:, :1].expand(3, 1, 80, 320),
                           torch.empty(3, 1, 80, 320, dtype=bf), torch.empty(3, 1, 80), 0.1)
    api.run_backward(torch.randn_like(out), q, k, v, out, lse, True, 0.1)
    cu = _cu([30, 50])
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    vout, vlse = api.run_varlen_forward(qp, kp, vp, cu, cu, True, 0.1)
    vout.normal_(), vlse.zero_()
    api.run_varlen_backward(torch.randn_like(vout), qp, kp, vp, vout, vlse, cu, cu, 50, 50, True, 0.1)
    classes = {"fwd": FlashFwdSm90SplitD, "bwd": FlashBwdSm90SplitD, "dq": FlashBwdDqSm90}
    assert [kind for kind, _ in launches] == ["fwd", "fwd", "bwd", "dq", "fwd", "bwd", "dq"], launches
    for i, (kind, args) in enumerate(launches):
        params = [p for n, p in inspect.signature(classes[kind].__call__).parameters.items()
                  if n not in ("self", "stream")]
        assert len(args) == len(params), (kind, len(args), [p.name for p in params])
        varlen = i >= 4
        for p, a in zip(params, args):
            where = f"launch {i} ({kind}) argument {p.name}"
            if p.annotation == "Float32":
                assert type(a) is float, where
            elif p.annotation == "Int32":
                assert type(a) is int, where
            elif "None" in p.annotation or "Optional" in p.annotation:
                assert (a is None) != varlen, where
                if varlen:
                    assert a.dtype == torch.int32 and a.stride(-1) == 1, where
            else:
                assert isinstance(a, torch.Tensor) and a.stride(-1) == 1, where
                if a.dtype == bf:
                    assert a.data_ptr() % 16 == 0 and a.dim() == 4, where
                else:
                    assert a.dtype == torch.float32 and a.dim() == 3, where


# ------------------------------------------------------------------------------------------- eager calls

_COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy")


@pytest.mark.parametrize("route", ["sdpa", "triton", "kvcache", "paged"])
def test_eager_calls_import_no_compiler_stack(route):
    """An eager forward + backward (dense and varlen), a KV-cache call and a paged varlen call (serving) leave
    torch's compiler stack unimported:
    its first import costs seconds, and torch SDPA's first call imports none of it. In a fresh process each, the
    SDPA backend through its kernel module (the low-level entries, which need the lse) and the Triton backend and
    KV-cache kernels under the interpreter."""
    code = f"""if True:
        import sys, torch, ffpa_attn
        from ffpa_attn.testing import make_kvcache, make_qkv
        route = {route!r}
        q, k, v = make_qkv(1, 4, 2, 16, 16, 320, torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, 7, 16], dtype=torch.int32)
        qp, kp, vp = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        if route == "sdpa":
            out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
            (out.float().sum() + lse.sum()).backward()
            out, lse = ffpa_attn.ffpa_attn_varlen_fwd(qp, kp, vp, cu, cu, 9, 9, causal=True, enable_gqa=True,
                                                      backend="sdpa")
            (out.float().sum() + lse.sum()).backward()
        elif route == "triton":
            ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, backend="triton").sum().backward()
            ffpa_attn.ffpa_attn_varlen_func(qp, kp, vp, cu, cu, 9, 9, causal=True, enable_gqa=True,
                                            backend="triton").sum().backward()
        elif route == "paged":
            case = make_kvcache([40, 9], 2, 320, torch.bfloat16, page_size=16)
            qs = torch.randn(5, 4, 320, dtype=torch.bfloat16)
            cq = torch.tensor([0, 3, 5], dtype=torch.int32)
            out = ffpa_attn.ffpa_attn_varlen_func(qs, case.k_cache, case.v_cache, cq, None, 3, case.capacity,
                                                  causal=True, enable_gqa=True, seqused_k=case.cache_seqlens,
                                                  block_table=case.block_table)
            assert torch.isfinite(out.float()).all()
        else:
            case = make_kvcache([40], 2, 320, torch.bfloat16, page_size=16, n_new=1)
            qd = torch.randn(1, 1, 4, 320, dtype=torch.bfloat16)
            kn, vn = (torch.randn(1, 1, 2, 320, dtype=torch.bfloat16) for _ in range(2))
            ffpa_attn.ffpa_attn_with_kvcache(qd, case.k_cache, case.v_cache, kn, vn, causal=True, **case.kwargs())
        assert q.grad is not None or route in ("kvcache", "paged")
        print(sorted(m for m in {_COMPILER_STACK!r} if m in sys.modules))
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout


def test_eager_calls_show_in_the_profiler():
    """Each eager call is one ``ffpa_attn::attn`` range in the torch profiler (and its backward one
    ``ffpa_attn::attn_backward``), as the op showed before eager calls bypassed it."""
    q, k, v = (torch.randn(1, h, 8, 320, dtype=torch.bfloat16, requires_grad=True) for h in (2, 1, 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
        (out.float().sum() + lse.sum()).backward()
        cu = torch.tensor([0, 8], dtype=torch.int32)
        ffpa_attn.ffpa_attn_varlen_fwd(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 8, 8,
                                       enable_gqa=True, backend="sdpa")
    names = [e.name for e in prof.events()]
    assert names.count("ffpa_attn::attn") == 3, sorted(set(n for n in names if "ffpa" in n))
    assert names.count("ffpa_attn::attn_backward") == 1
    assert names.count("ffpa_attn::varlen_attn") == 1


def test_compiled_graphs_hold_the_ops():
    """Under torch.compile the calls are the ops (the forward graph holds ``ffpa_attn.attn``, the backward graph
    ``ffpa_attn.attn_backward``), not the eager path's Python."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def recorder(name):
        def compile_fn(gm, example_inputs):
            graphs[name] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)
        return compile_fn

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
    q, k, v = (torch.randn(1, h, 8, 320, dtype=torch.bfloat16, requires_grad=True) for h in (2, 1, 1))
    f = torch.compile(lambda q, k, v: ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True,
                                                               backend="sdpa")[0], fullgraph=True, backend=backend)
    f(q, k, v).float().sum().backward()
    assert "ffpa_attn.attn.default" in graphs["fw"], graphs["fw"]
    assert "ffpa_attn.attn_backward.default" in graphs["bw"], graphs["bw"]
    assert q.grad is not None and bool(q.grad.isfinite().all())
    torch._dynamo.reset()


def test_tma_ready_views():
    """What a launch hands TMA: an aligned tensor as it is; a size-1 mode's stride set to the element count rounded
    up to 16 bytes (a view, no copy); a misaligned base or stride copied to a contiguous tensor."""
    bf = torch.bfloat16
    dense = torch.randn(2, 4, 16, 320).to(bf)
    assert api._tma_ready(dense) is dense
    packed = torch.randn(16, 4, 320).to(bf).transpose(0, 1).unsqueeze(0)  # [1, H, T, D] view of packed rows
    got = api._tma_ready(packed)
    assert got.data_ptr() == packed.data_ptr() and got.stride() == (16 * 4 * 320, 320, 4 * 320, 1)
    assert torch.equal(got, packed)
    odd = torch.randn(2, 4, 16, 321).to(bf)[..., 1:]  # base 2 bytes off, row stride 321 elements
    got = api._tma_ready(odd)
    assert got.data_ptr() != odd.data_ptr() and got.is_contiguous() and torch.equal(got, odd)


def test_dispatch_modes_see_the_ops():
    """Under a torch dispatch mode (flop counters, debug modes, fake tensors) a call is the op, as in a traced graph:
    the mode sees ``ffpa_attn.attn`` and its backward ``ffpa_attn.attn_backward``, not the kernels' inner ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, h, 8, 320, dtype=torch.bfloat16, requires_grad=True) for h in (2, 1, 1))
    with Record() as rec:
        out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend="sdpa")
        out.float().sum().backward()
    assert "ffpa_attn.attn.default" in rec.ops and "ffpa_attn.attn_backward.default" in rec.ops, rec.ops
    assert q.grad is not None

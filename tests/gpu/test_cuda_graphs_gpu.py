"""CUDA-graph capture of every public path on a GPU (skipped without CUDA): capture once, copy new values into the
static inputs (new boundary values too, for varlen), replay, and compare with an eager call on the same new values
and with the fp32 reference. Every backend that runs the path on this GPU: CuTeDSL (sm90 + nvidia-cutlass-dsl),
Triton, CUDA (forward), SDPA and the implicit plan; dense and varlen, forward and forward + backward, the split-KV
decode, the tail-split forward, the low-level entries and the compatibility ops; and
``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graphs) of a transformers decoder layer with
``attn_implementation="ffpa"``. The CPU side of the same promise (no host reads while capturing):
tests/test_capture_safety.py.

    python -m pytest -q tests/gpu/test_cuda_graphs_gpu.py
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.testing import TOL, assert_close, capture, rel_err, reference_grads

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
DEV = "cuda"
_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_CUTE = _SM90 and importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
needs_cute = pytest.mark.skipif(not _CUTE, reason="needs an sm90 GPU, nvidia-cutlass-dsl and apache-tvm-ffi")

DENSE_BACKENDS = [pytest.param("cutedsl", marks=needs_cute), "triton", "cuda", "sdpa", None]
GRAD_BACKENDS = [pytest.param("cutedsl", marks=needs_cute), "triton", "sdpa", None]
VARLEN_BACKENDS = [pytest.param("cutedsl", marks=needs_cute), "triton", "sdpa", None]


def _kw(backend):
    return {} if backend is None else {"backend": backend}


def _ids(backend):
    return backend or "implicit"


def refill(*tensors: torch.Tensor) -> None:
    """New random values into the static inputs, in place (what a training / decode loop does between replays)."""
    with torch.no_grad():
        for t in tensors:
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))


def replay_equals_eager(graph, outs, fn, exact: bool) -> tuple:
    """Replay, then run ``fn`` eagerly on the same inputs: bit-equal outputs (``exact``: the same deterministic
    kernels run in both) or within a tenth of the dtype's tolerance (Triton's backward adds with atomics; the SDPA
    backend's varlen runs its packed variant in a capture and per sequence eagerly)."""
    graph.replay()
    torch.cuda.synchronize()
    eager = fn()
    for i, (a, b) in enumerate(zip(outs, eager)):
        if exact:
            assert torch.equal(a, b), f"output {i}: replay differs from eager"
        else:
            assert rel_err(a, b) <= TOL[BF16] / 10, f"output {i}: replay vs eager {rel_err(a, b):.2e}"
    return tuple(t.clone() for t in outs)


def _qkv(b, hq, hkv, nq, nkv, d):
    return (torch.randn(b, h, n, d, device=DEV, dtype=BF16) for h, n in ((hq, nq), (hkv, nkv), (hkv, nkv)))


@pytest.mark.parametrize("backend", DENSE_BACKENDS, ids=_ids)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_forward(backend, causal):
    q, k, v = _qkv(2, 8, 2, 1000, 1000, 512)

    def fn():
        return (ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=True, **_kw(backend)),)

    graph, outs = capture(fn)
    for _ in range(2):
        refill(q, k, v)
        (out,) = replay_equals_eager(graph, outs, fn, exact=True)
        assert_close(out, reference.attention(q, k, v, is_causal=causal)[0], BF16)


@needs_cute
def test_dense_forward_with_tail_split():
    """The CuTeDSL forward whose last wave the planner splits over KV slices (a second launch and an lse merge)."""
    q, k, v = _qkv(1, 32, 32, 8192, 8192, 512)
    assert "tail=" in str(ffpa_attn.explain(q, k, v, backend="cutedsl").forward)

    def fn():
        return (ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl"),)

    graph, outs = capture(fn)
    refill(q, k, v)
    (out,) = replay_equals_eager(graph, outs, fn, exact=True)
    rows = slice(7936, None)  # the split tail rows of the last head, against the reference
    ref = reference.attention(q[:, -1:, rows], k[:, -1:], v[:, -1:])[0]
    assert_close(out[:, -1:, rows], ref, BF16)


@pytest.mark.parametrize("backend", GRAD_BACKENDS, ids=_ids)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_forward_backward(backend, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 8, 2, 768, 768, 512))
    dout = torch.randn(1, 8, 768, 512, device=DEV, dtype=BF16)

    def fn():
        out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=True, **_kw(backend))
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    graph, outs = capture(fn)
    refill(q, k, v, dout)
    out, *grads = replay_equals_eager(graph, outs, fn, exact=backend in ("cutedsl", "sdpa"))
    assert_close(out, reference.attention(q, k, v, is_causal=causal)[0], BF16)
    for name, a, r in zip("qkv", grads, reference_grads(q, k, v, dout, causal=causal)):
        assert_close(a, r, BF16, f"d{name}")


@pytest.mark.parametrize("backend", [pytest.param("cutedsl", marks=needs_cute), "triton", None], ids=_ids)
def test_decode_splitkv(backend):
    """One query row per head against a long KV cache: the split-KV forward and its combine (a decode step is the
    call CUDA graphs matter most for)."""
    q, k, v = _qkv(1, 32, 8, 1, 8192, 512)
    assert "splitkv" in str(ffpa_attn.explain(q, k, v, enable_gqa=True, **_kw(backend)).forward)

    def fn():
        return (ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, **_kw(backend)),)

    graph, outs = capture(fn)
    refill(q, k, v)
    (out,) = replay_equals_eager(graph, outs, fn, exact=True)
    assert_close(out, reference.attention(q, k, v)[0], BF16)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


LENS = ([128, 384, 256, 256], [384, 128, 320, 192])  # captured with the first, replayed with the second (same T)


@pytest.mark.parametrize("backend", VARLEN_BACKENDS, ids=_ids)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_varlen_new_boundaries(backend, causal, grad):
    """Replays with new boundary VALUES copied into the same static cu_seqlens: the device-built work lists (and
    everything else that depends on them) are rebuilt by the replay. max_seqlen is the bound of every replay."""
    t, mx = sum(LENS[0]), max(max(LENS[0]), max(LENS[1]))
    q = torch.randn(t, 8, 512, device=DEV, dtype=BF16, requires_grad=grad)
    k, v = (torch.randn(t, 2, 512, device=DEV, dtype=BF16, requires_grad=grad) for _ in range(2))
    dout = torch.randn(t, 8, 512, device=DEV, dtype=BF16)
    cu = _cu(LENS[0])

    def fn():
        out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal, enable_gqa=True,
                                              **_kw(backend))
        return (out, *torch.autograd.grad(out, (q, k, v), dout)) if grad else (out,)

    graph, outs = capture(fn)
    for lens in (LENS[1], LENS[0]):
        refill(q, k, v, dout)
        cu.copy_(_cu(lens))
        exact = backend == "cutedsl" or (backend == "triton" and not grad)
        out, *grads = replay_equals_eager(graph, outs, fn, exact=exact)
        ref = reference.varlen_attention(q.detach(), k.detach(), v.detach(), cu, cu, causal=causal)[0]
        assert_close(out, ref, BF16)
        if grad:
            qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
            want = torch.autograd.grad(reference.varlen_attention(qr, kr, vr, cu, cu, causal=causal)[0],
                                       (qr, kr, vr), dout.float())
            for name, a, r in zip("qkv", grads, want):
                assert_close(a, r, BF16, f"d{name}")


@pytest.mark.parametrize("backend", [pytest.param("cutedsl", marks=needs_cute), "triton", "sdpa"])
def test_low_level_entries(backend):
    q, k, v = _qkv(1, 8, 2, 512, 512, 512)
    g = torch.randn(1, 8, 512, 512, device=DEV, dtype=BF16)

    def fn():
        out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, causal=True, enable_gqa=True, backend=backend)
        return (out, lse, *ffpa_attn.ffpa_attn_bwd(g, q, k, v, out, lse, causal=True, enable_gqa=True,
                                                   backend=backend))

    graph, outs = capture(fn)
    refill(q, k, v, g)
    out, lse, *grads = replay_equals_eager(graph, outs, fn, exact=backend != "triton")
    ref, ref_lse = reference.attention(q, k, v, is_causal=True)
    assert_close(out, ref, BF16)
    assert_close(lse, ref_lse, torch.float32, "lse", tol=1e-4)
    for name, a, r in zip("qkv", grads, reference_grads(q, k, v, g, causal=True)):
        assert_close(a, r, BF16, f"d{name}")


def test_compat_ops():
    """The public package's op names (flash layout; the implicit backends): dense and varlen, forward and
    backward."""
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(1, 8, 2, 512, 512, 512))
    g = torch.randn_like(q)
    qp, kp, vp = (t[0] for t in (q, k, v))
    cu = _cu([200, 312])
    ops, s = torch.ops.ffpa_attn, 512 ** -0.5

    def fn():
        o, lse = ops._fwd_cute(q, k, v, s, 1, 1)
        dq, dk, dv = ops._bwd_cute(g, q, k, v, o, lse, s, 1, 0)
        vo, vl = ops._varlen_fwd_cute(qp, kp, vp, cu, cu, 312, 312, s, True, -1, -1, 0.0, False)
        vq, vk, vv = ops._varlen_bwd_cute(qp, kp, vp, vo, g[0], vl, cu, cu, 312, 312, s, True, -1, -1, 0.0, None)
        return o, dq, vo, vq

    graph, outs = capture(fn)
    refill(q, k, v, g)
    cu.copy_(_cu([312, 200]))
    o, dq, vo, vq = replay_equals_eager(graph, outs, fn, exact=False)
    ref = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)[0]
    assert_close(o, ref.transpose(1, 2), BF16)
    assert_close(vo, reference.varlen_attention(qp, kp, vp, cu, cu, causal=True)[0], BF16)


@needs_cute
def test_cutedsl_kernel_not_loaded_raises_a_clear_error():
    """A CuTeDSL kernel is never compiled or loaded during a capture: capturing a call whose kernel this process has
    not run is a RuntimeError that says to warm up first (the capture is abandoned, not corrupted)."""
    from ffpa_attn.cutedsl import _cache

    q, k, v = _qkv(1, 4, 4, 256, 256, 384)
    _cache.clear_memory_cache()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(graph):
            ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl")
    out = ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl")  # eager: loads it; then it captures
    assert_close(out, reference.attention(q, k, v)[0], BF16)
    g2, outs = capture(lambda: (ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl"),))
    replay_equals_eager(g2, outs, lambda: (ffpa_attn.ffpa_attn_func(q, k, v, backend="cutedsl"),), exact=True)


@needs_cute
def test_work_lists_kept_per_unchanged_boundaries():
    """Eager varlen launches reuse the work list of unchanged boundary tensors; an in-place write (seen by the
    version counter) or torch.autograd.graph.increment_version after a write torch cannot see gives a new one."""
    from ffpa_attn.cutedsl.ranges import varlen_work_items, work_items

    cu = _cu([100, 300, 50])
    first = work_items(cu, cu, 450, 64, 64, True)
    assert work_items(cu, cu, 450, 64, 64, True) is first
    cu.copy_(_cu([300, 100, 50]))
    second = work_items(cu, cu, 450, 64, 64, True)
    assert second is not first and torch.equal(second, varlen_work_items(cu, cu, 450, 64, 64, True))
    cu.data.copy_(_cu([50, 100, 300]))  # through .data: the version counter does not move
    assert work_items(cu, cu, 450, 64, 64, True) is second
    torch.autograd.graph.increment_version(cu)
    assert torch.equal(work_items(cu, cu, 450, 64, 64, True), varlen_work_items(cu, cu, 450, 64, 64, True))


@pytest.mark.parametrize("position_ids", [False, True], ids=["layer", "with_position_ids"])
def test_transformers_layer_reduce_overhead(position_ids):
    """torch.compile(mode="reduce-overhead") of a decoder layer with attn_implementation="ffpa" (D = 512, GQA):
    inductor captures CUDA graphs around the FFPA ops; replays with new hidden states equal the eager layer. With
    position_ids the binding inspects them for packed sequences on the host, outside the captured graphs."""
    transformers = pytest.importorskip("transformers")
    from ffpa_attn.integrations import transformers as hf

    assert hf.register_ffpa_attention()
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=512,
                                   attn_implementation="ffpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.LlamaModel(cfg).to(BF16).eval()
    layer, rope = model.layers[0], model.rotary_emb
    pos = torch.arange(1024, device=DEV)[None]
    compiled = torch.compile(layer, mode="reduce-overhead")
    kwargs = {"position_ids": pos} if position_ids else {}
    with torch.no_grad():
        for step in range(4):
            x = torch.randn(1, 1024, 1024, device=DEV, dtype=BF16)
            pe = rope(x, pos)
            got = compiled(x, position_embeddings=pe, attention_mask=None, **kwargs)
            got = (got[0] if isinstance(got, tuple) else got).clone()
            want = layer(x, position_embeddings=pe, attention_mask=None, **kwargs)
            want = want[0] if isinstance(want, tuple) else want
            assert rel_err(got, want) <= TOL[BF16], f"step {step}: {rel_err(got, want):.2e}"

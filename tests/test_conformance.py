"""Conformance: every backend of the registry x every feature, against what its description claims.

For each backend (:data:`ffpa_attn.dispatch.registry.REGISTRY`, read from its package's ``backend.json``):

* a feature it claims runs, named explicitly, and matches the fp32 reference (forward and backward); backends that
  cannot run on this machine (CUDA-only ones on a CPU) run it on a GPU (``gpu`` marker);
* a feature it does not claim raises the documented error when the backend is named (NotImplementedError naming
  the feature), checked everywhere: the planner on a pretended device of the backend's arch, and the kernel
  module itself when called with the feature (so neither the description nor the code can claim more than the
  other does).

So a capability claim cannot drift from the code: adding a feature to ``backend.json`` without the code fails the
first kind, removing the code without the claim fails it too, and code that silently accepts an unclaimed feature
fails the second kind.
"""
from __future__ import annotations

import importlib

import pytest
import torch

import ffpa_attn
from ffpa_attn import reference
from ffpa_attn.dispatch import registry
from ffpa_attn.kernel_module import KernelSpec
from ffpa_attn.testing import assert_close, assert_kvcache_matches, make_kvcache, make_qkv, pretend_gpu

BACKENDS = sorted(registry.REGISTRY)
DTYPE = torch.float16  # the interpreter's fp16 dots are exact enough; bf16 runs on the GPU grid too
ENTRIES = ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward", "kvcache_forward")
FEATURES = ENTRIES + ("attn_mask", "mask_grad", "dropout", "value_head_dim", "deterministic", "paged_kv", "seqused_k")


def claims(name: str, feature: str) -> bool:
    spec = registry.spec(name)
    if feature in spec.features:
        return True
    return bool(spec.kernels_of(feature)) if feature in ENTRIES else False


def head_dim(name: str) -> int:
    """A head dim in the FFPA range that the backend takes."""
    spec = registry.spec(name)
    return next(d for d in (320, 384, 512) if spec.head_dim_ok(d))


def runs_here(name: str, device: str) -> bool:
    return registry.available(name, torch.device(device))[0]


def named(name: str, feature: str) -> dict:
    """The kwargs that name ``name`` for the direction(s) ``feature`` exercises (a forward-only backend is named for
    the forward; the backward then is the planner's)."""
    spec = registry.spec(name)
    if feature in ("dense_backward", "varlen_backward", "mask_grad", "deterministic"):
        return {"backward_backend": name}
    if feature == "kvcache_forward" or (spec.runs("backward", feature.startswith("varlen"))
                                        and feature != "dense_forward"):
        return {"backend": name}
    return {"forward_backend": name}


# ----------------------------------------------------------------------------------------------- requests


def run_dense(name, device, *, mask=None, mask_grad=False, dropout_p=0.0, dv=None, grad=True):
    d = head_dim(name)
    q, k, v = make_qkv(1, 4, 2, 24, 40, d, DTYPE, device=device, requires_grad=grad)
    if dv is not None:
        v = torch.randn(1, 2, 40, dv, dtype=DTYPE, device=device, requires_grad=grad)
    if mask is not None and mask_grad:
        mask = mask.clone().requires_grad_(True)
    return q, k, v, mask


def check_dense(name, device, kw, *, mask=None, mask_grad=False, dv=None, backward=True, causal=True):
    q, k, v, mask = run_dense(name, device, mask=mask, mask_grad=mask_grad, dv=dv)
    out = ffpa_attn.ffpa_attn_func(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True, **kw)
    ref, _ = reference.attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    assert_close(out, ref, DTYPE, "out")
    if not backward:
        return
    inputs = (q, k, v) + ((mask,) if mask_grad else ())
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, g.to(DTYPE))
    ref_grads = torch.autograd.grad(ref, inputs, g)
    for n, a, r in zip(("dq", "dk", "dv", "dmask"), grads, ref_grads):
        assert_close(a, r, DTYPE, n)


def check_varlen(name, device, kw, *, backward=True):
    d = head_dim(name)
    lens = [7, 0, 13]
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(20, h, d, dtype=DTYPE, device=device, requires_grad=True) for h in (4, 2, 2))
    out = ffpa_attn.ffpa_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, enable_gqa=True, **kw)
    ref, _ = reference.varlen_attention(q.float(), k.float(), v.float(), cu, cu, causal=True)
    assert_close(out, ref, DTYPE, "out")
    if backward:
        g = torch.randn_like(ref)
        for n, a, r in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), g.to(DTYPE)),
                           torch.autograd.grad(ref, (q, k, v), g)):
            assert_close(a, r, DTYPE, n)


def serving_varlen_request(name, device, feature, dtype=DTYPE):
    """A causal GQA varlen call of ``feature``: paged caches through a block table (``paged_kv``) or packed K/V whose
    sequences use fewer keys than they hold (``seqused_k``); returns (args, kwargs, the reference out)."""
    d = head_dim(name)
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=device)
    q = torch.randn(12, 4, d, device=device).to(dtype)
    if feature == "paged_kv":
        case = make_kvcache([9, 30, 40], 2, d, dtype, page_size=16, device=device)
        ref, _ = reference.paged_varlen_attention(q, case.k_cache, case.v_cache, cu_q, case.cache_seqlens,
                                                  case.block_table, causal=True)
        return ((q, case.k_cache, case.v_cache, cu_q, None, 7, 0),
                dict(seqused_k=case.cache_seqlens, block_table=case.block_table), ref)
    cu_k = torch.tensor([0, 9, 39, 79], dtype=torch.int32, device=device)
    k, v = (torch.randn(79, 2, d, device=device).to(dtype) for _ in range(2))
    used = torch.tensor([7, 0, 33], dtype=torch.int32, device=device)
    keep = torch.cat([torch.arange(int(cu_k[b]), int(cu_k[b]) + int(n)) for b, n in enumerate(used)])
    ref, _ = reference.varlen_attention(q.float(), k[keep].float(), v[keep].float(), cu_q,
                                        torch.tensor([0, 7, 7, 40], dtype=torch.int32, device=device), causal=True)
    return (q, k, v, cu_q, cu_k, 7, 40), dict(seqused_k=used), ref


def check_kvcache(name, device, kw):
    """A paged decode step appending one token (GQA, causal) and a contiguous chunk of the gather route."""
    from ffpa_attn.dispatch.heuristics import value

    d = head_dim(name)
    for page, nq in ((16, 1), (None, value("kvcache_gather_min_nq"))):
        case = make_kvcache([0, 17, 40], 2, d, DTYPE, page_size=page, capacity=128, n_new=nq, device=device)
        q = torch.randn(3, nq, 4, d, device=device).to(DTYPE)
        k, v = (torch.randn(3, nq, 2, d, device=device).to(DTYPE) for _ in range(2))
        before = (case.k_cache.clone(), case.v_cache.clone())
        out, lse = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True,
                                                    return_softmax_lse=True, **case.kwargs(), **kw)
        assert_kvcache_matches(out, lse, q, case, *before, k, v, causal=True)


def exercise(name: str, feature: str, device: str) -> None:
    """Run ``feature`` on backend ``name`` (named) and compare with the reference."""
    kw = named(name, feature)
    if feature == "kvcache_forward":
        check_kvcache(name, device, kw)
    elif feature == "dense_forward":
        check_dense(name, device, kw, backward=False)
    elif feature == "dense_backward":
        check_dense(name, device, kw)
    elif feature == "varlen_forward":
        check_varlen(name, device, kw, backward=False)
    elif feature == "varlen_backward":
        check_varlen(name, device, kw)
    elif feature == "attn_mask":
        for mask in (torch.rand(24, 40, device=device) > 0.3, torch.randn(1, 4, 24, 40, device=device)):
            check_dense(name, device, kw, mask=mask, backward=claims(name, "dense_backward"), causal=False)
    elif feature == "mask_grad":
        check_dense(name, device, kw, mask=torch.randn(1, 4, 24, 40, device=device), mask_grad=True, causal=False)
    elif feature in ("paged_kv", "seqused_k"):
        args, extra, ref = serving_varlen_request(name, device, feature)
        out = ffpa_attn.ffpa_attn_varlen_func(*args, causal=True, enable_gqa=True, backend=name, **extra)
        assert_close(out, ref, DTYPE, "out")
    elif feature == "value_head_dim":
        check_dense(name, device, kw, dv=head_dim(name) // 2 if head_dim(name) // 2 > 0 else 64,
                    backward=claims(name, "dense_backward"))
    elif feature == "dropout":
        q, k, v, _ = run_dense(name, device)
        outs = []
        for _ in range(2):  # reproducible under the same seed, differs from no dropout, gradients finite
            torch.manual_seed(11)
            out = ffpa_attn.ffpa_attn_func(q, k, v, dropout_p=0.3, enable_gqa=True, backend=name)
            outs.append(out)
            grads = torch.autograd.grad(out.float().sum(), (q, k, v))
            assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(outs[0], outs[1])
        plain = ffpa_attn.ffpa_attn_func(q, k, v, enable_gqa=True, backend=name)
        assert not torch.equal(outs[0], plain)
    elif feature == "deterministic":
        q, k, v, _ = run_dense(name, device)
        g = torch.randn(q.shape, dtype=DTYPE, device=device)
        runs = []
        with torch.autograd.set_grad_enabled(True):
            for _ in range(2):
                out = ffpa_attn.ffpa_attn_func(q, k, v, is_causal=True, enable_gqa=True, **kw)
                runs.append(torch.autograd.grad(out, (q, k, v), g))
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    else:  # pragma: no cover
        raise AssertionError(feature)


CASES = [(n, f) for n in BACKENDS for f in FEATURES]


@pytest.mark.parametrize("name,feature", [c for c in CASES if claims(*c)])
def test_claimed_feature_runs_and_matches_the_reference(name, feature, device):
    if not runs_here(name, device):
        pytest.skip(f"{name} cannot run on {device} ({registry.available(name, torch.device(device))[1]}); "
                    "the gpu-marked test runs it on a GPU")
    exercise(name, feature, device)


@pytest.mark.gpu
@pytest.mark.parametrize("name,feature", [c for c in CASES if claims(*c) and c[0] in ("cutedsl", "cuda")])
def test_claimed_feature_on_the_gpu(name, feature):
    if not runs_here(name, "cuda"):
        pytest.skip(registry.available(name, torch.device("cuda"))[1])
    exercise(name, feature, "cuda")


# --------------------------------------------------------------------------------------- unclaimed features


def _request(name: str, feature: str):
    """Meta tensors and kwargs of a call that needs ``feature`` (for the planner on a pretended device)."""
    d = head_dim(name)
    meta = dict(dtype=torch.bfloat16, device="meta")
    q = torch.empty(1, 4, 24, d, requires_grad=True, **meta)
    k = torch.empty(1, 2, 40, d, requires_grad=True, **meta)
    v = torch.empty(1, 2, 40, d, requires_grad=True, **meta)
    kw = dict(enable_gqa=True, backend=name)
    if feature in ("attn_mask", "mask_grad"):
        kw["attn_mask"] = torch.empty(1, 4, 24, 40, device="meta", requires_grad=feature == "mask_grad")
    elif feature == "dropout":
        kw["dropout_p"] = 0.2
    elif feature == "value_head_dim":
        v = torch.empty(1, 2, 40, d // 2, requires_grad=True, **meta)
    return q, k, v, kw


def _arch(name: str) -> tuple[int, int]:
    archs = registry.spec(name).cuda_archs
    return archs[0] if archs else (9, 0)


@pytest.mark.parametrize("name,feature", [c for c in CASES if not claims(*c) and c[1] != "deterministic"])
def test_unclaimed_feature_is_refused_by_the_planner(name, feature, monkeypatch):
    pretend_gpu(monkeypatch, capability=_arch(name))
    if feature.startswith("varlen"):
        cu = torch.tensor([0, 7, 20], dtype=torch.int32)
        q, k, v = (torch.empty(20, h, head_dim(name), dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
        with pytest.raises(NotImplementedError, match=f"backend {name!r} cannot run this .*varlen"):
            ffpa_attn.explain_varlen(q, k, v, cu, cu, 13, 13, enable_gqa=True, backend=name)
        return
    if feature in ("paged_kv", "seqused_k"):
        args, extra, _ = serving_varlen_request(name, "cpu", feature, torch.bfloat16)
        why = "paged K/V" if feature == "paged_kv" else "seqused_k"
        with pytest.raises(NotImplementedError, match=f"backend {name!r} cannot run this forward: .*({why}|varlen)"):
            ffpa_attn.explain_varlen(*args, causal=True, enable_gqa=True, backend=name, **extra)
        return
    if feature == "kvcache_forward":
        case = make_kvcache([5, 9], 2, head_dim(name), torch.bfloat16, page_size=16, capacity=32)
        q = torch.empty(2, 1, 4, head_dim(name), dtype=torch.bfloat16)
        with pytest.raises(NotImplementedError, match=f"backend {name!r} cannot run this forward: .*no KV-cache"):
            ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, backend=name, **case.kwargs())
        return
    q, k, v, kw = _request(name, feature)
    if feature == "dense_backward":
        with pytest.raises((NotImplementedError, ValueError), match="backward"):
            ffpa_attn.explain(q, k, v, backward_backend=name, enable_gqa=True)
        return
    want = {"attn_mask": "attn_mask", "mask_grad": "attn_mask", "dropout": "dropout",
            "value_head_dim": "value head dim", "dense_forward": "forward"}[feature]
    with pytest.raises(NotImplementedError, match=want):
        ffpa_attn.explain(q, k, v, **kw)


@pytest.mark.parametrize("name,feature", [c for c in CASES if not claims(*c)
                                          and c[1] in ("attn_mask", "dropout", "varlen_forward", "varlen_backward",
                                                       "dense_backward", "kvcache_forward")])
def test_unclaimed_feature_is_refused_by_the_kernel_module(name, feature):
    """Called directly with a feature its description does not claim, the kernel module raises NotImplementedError
    before touching any data (no silent wrong answer if a planner ever sent one)."""
    mod = importlib.import_module(registry.kernel_package(name))
    spec = registry.spec(name)
    t = torch.empty(1, 2, 8, head_dim(name), dtype=torch.bfloat16)
    if feature in ("attn_mask", "dropout"):
        kernel = KernelSpec(spec.kernels_of("dense_forward")[0])
        mask = torch.ones(1, 2, 8, 8, dtype=torch.bool) if feature == "attn_mask" else None
        with pytest.raises(NotImplementedError, match="attn_mask|dropout"):
            mod.dense_forward(t, t, t, attn_mask=mask, dropout_p=0.2 if feature == "dropout" else 0.0, rng=None,
                              causal=False, scale=0.1, config=None, kernel=kernel)
    else:
        with pytest.raises(NotImplementedError):
            getattr(mod, feature)(*([t] * 10)[:4], kernel=KernelSpec("any"))

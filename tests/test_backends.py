"""Backend dataclasses (validation at construction), kwarg resolution, and the dispatch plan / explain()."""
import logging

import pytest
import torch

import ffpa_attn
from ffpa_attn import Backend, CUDABackend, CuTeDSLBackend, SDPABackend, TritonBackend
from ffpa_attn.config import as_backend, from_config, resolve_backends
from ffpa_attn.dispatch.capabilities import backend_available
from ffpa_attn.testing import make_qkv


# ------------------------------------------------------------------------------------------ dataclasses


def test_defaults_and_directions():
    t = TritonBackend()
    assert (t.name, t.forward, t.backward) == ("triton", True, True)
    c = CUDABackend()
    assert (c.acc, c.stages, c.forward, c.backward) == ("f32", None, True, False)
    assert CuTeDSLBackend().grad_kv_storage_dtype is None
    assert SDPABackend().high_precision_grad is False
    assert Backend(name="sdpa").backward is True


@pytest.mark.parametrize("make, match", [
    (lambda: TritonBackend(autotune_mode="slow"), "autotune_mode"),
    (lambda: TritonBackend(enable_ws=True, enable_tma=False), "enable_ws=True"),
    (lambda: TritonBackend(persist_dkdv=True), "persist_dkdv"),
    (lambda: TritonBackend(persist_dkdv=True, enable_tma=True, backward=False), "backward=True"),
    (lambda: TritonBackend(grad_kv_storage_dtype=torch.bfloat16), "grad_kv_storage_dtype"),
    (lambda: TritonBackend(grad_q_storage_dtype="float16"), "grad_q_storage_dtype"),
    (lambda: TritonBackend(autotune="yes"), "autotune"),
    (lambda: CUDABackend(acc="f64"), "acc"),
    (lambda: CUDABackend(stages=5), "stages"),
    (lambda: CUDABackend(stages=0), "stages"),
    (lambda: CUDABackend(backward=True), "no backward kernel"),
    (lambda: CuTeDSLBackend(grad_kv_storage_dtype="int8"), "grad_kv_storage_dtype"),
    (lambda: SDPABackend(high_precision_grad=1), "high_precision_grad"),
    (lambda: TritonBackend(forward=False, backward=False), "neither"),
    (lambda: TritonBackend(name="cuda"), "name must be 'triton'"),
    (lambda: Backend(name="flash"), "Backend name must be one of"),
])
def test_invalid_configs_raise_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_grad_dtype_normalised():
    t = TritonBackend(grad_kv_storage_dtype=torch.float32, grad_q_storage_dtype="fp32")
    assert t.grad_kv_storage_dtype == "float32" and t.grad_q_storage_dtype == "float32"


def test_config_roundtrip():
    t = TritonBackend(autotune=False, enable_tma=True, enable_ws=True, grad_kv_storage_dtype=torch.float16)
    assert from_config("triton", t.to_config()) == t
    c = CUDABackend(acc="f16", stages=2)
    assert from_config("cuda", c.to_config()) == c


# ------------------------------------------------------------------------------------------ resolution


def test_backend_fills_both_directions_and_explicit_wins():
    f, b = resolve_backends("triton")
    assert isinstance(f, TritonBackend) and isinstance(b, TritonBackend)
    f, b = resolve_backends("triton", backward_backend="sdpa")
    assert isinstance(f, TritonBackend) and isinstance(b, SDPABackend)
    f, b = resolve_backends(SDPABackend(), forward_backend=TritonBackend(autotune=False))
    assert isinstance(f, TritonBackend) and f.autotune is False and isinstance(b, SDPABackend)


def test_forward_only_backend_leaves_backward_implicit():
    f, b = resolve_backends("cuda")
    assert isinstance(f, CUDABackend) and b is None


def test_direction_flags_respected():
    f, b = resolve_backends(TritonBackend(forward=False))
    assert f is None and isinstance(b, TritonBackend)
    with pytest.raises(ValueError, match="does not configure the forward"):
        resolve_backends(forward_backend=TritonBackend(forward=False))
    with pytest.raises(ValueError, match="does not configure the backward"):
        resolve_backends(backward_backend=TritonBackend(backward=False))


def test_string_shorthands():
    for name, cls in [("triton", TritonBackend), ("cuda", CUDABackend), ("cutedsl", CuTeDSLBackend),
                      ("sdpa", SDPABackend), ("TRITON", TritonBackend)]:
        assert isinstance(as_backend(name, "backend"), cls)


# ------------------------------------------------------------------------------------------ plan


def test_plan_on_cpu_with_interpreter_picks_triton():
    q, k, v = make_qkv(1, 4, 2, 16, 32, 512, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert plan.forward.backend == "triton" and plan.backward.backend == "triton"
    assert not plan.forward.explicit
    assert "triton:fwd" in str(plan)


@pytest.mark.parametrize("d", [128, 256, 1025, 2048])
def test_plan_outside_ffpa_range_falls_back_to_sdpa_with_reason(d, caplog):
    q, k, v = make_qkv(1, 2, 2, 8, 8, d, torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ffpa_attn"):
        plan = ffpa_attn.explain(q, k, v)
    assert plan.direct_sdpa
    assert f"D={d}" in plan.forward.reason


def test_fallback_logged_once(caplog):
    from ffpa_attn.dispatch import planner

    planner._LOGGED.clear()
    q, k, v = make_qkv(1, 2, 2, 8, 8, 96, torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="ffpa_attn"):
        ffpa_attn.explain(q, k, v)
        ffpa_attn.explain(q, k, v)
    msgs = [r.getMessage() for r in caplog.records if "falls back to SDPA" in r.getMessage()]
    assert len(msgs) == 1 and "D=96" in msgs[0]


def test_plan_without_interpreter_falls_back(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v)
    assert plan.forward.backend == "sdpa"
    assert "TRITON_INTERPRET" in plan.forward.reason
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET"):
        ffpa_attn.explain(q, k, v, backend="triton")


def test_explicit_plan_is_marked_explicit():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, forward_backend="sdpa", backward_backend="triton")
    assert plan.forward.explicit and plan.forward.backend == "sdpa"
    assert plan.backward.explicit and plan.backward.backend == "triton"
    assert not plan.direct_sdpa


def test_implicit_dropout_with_mismatched_rng_falls_back_to_sdpa():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, dropout_p=0.1)
    assert plan.forward.backend == "triton" and plan.backward.backend == "triton"


def test_cuda_forward_gets_triton_backward_by_default():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="CUDA device"):
        ffpa_attn.explain(q, k, v, backend="cuda")  # no CUDA here


def test_availability_reasons_cpu():
    ok, why = backend_available("cutedsl", torch.device("cpu"))
    assert not ok and "CUDA device" in why
    ok, why = backend_available("cuda", torch.device("cpu"))
    assert not ok and "CUDA device" in why
    assert backend_available("sdpa", torch.device("cpu"))[0]


def test_cutedsl_capability_lists_are_consistent():
    from ffpa_attn.dispatch.capabilities import _cute_dims
    from ffpa_attn.dispatch.heuristics import cute_preferred_dims

    fwd, bwd, _ = _cute_dims()
    assert cute_preferred_dims() <= fwd
    assert all(256 < d <= 1024 and d % 8 == 0 for d in fwd)
    assert bwd <= fwd


def test_cutedsl_preference_reason(monkeypatch):
    """Implicit choice on an sm90 box with cutlass: cutedsl where preferred, Triton elsewhere (with the reason)."""
    from ffpa_attn import backends
    from ffpa_attn.dispatch import capabilities

    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend sm90"))
    for d, want in [(512, "cutedsl"), (320, "triton"), (640, "triton")]:
        q, k, v = make_qkv(1, 2, 2, 8, 8, d, torch.bfloat16)
        plan = ffpa_attn.explain(q, k, v)
        assert plan.forward.backend == want, (d, str(plan))
        assert plan.backward.backend == "cutedsl"  # measured faster than Triton at every D it runs (up to 1024)
        if want == "triton":
            assert "cutedsl" in plan.forward.reason


def test_cutedsl_varlen_backward_dispatch(monkeypatch):
    """A varlen call's backward goes to the CuTeDSL kernels wherever its head dim has them (explicitly too);
    outside them it falls back to Triton implicitly and raises when named."""
    from ffpa_attn.dispatch import capabilities

    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend sm90"))
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)

    def packed(d):
        return [t[0].transpose(0, 1).contiguous() for t in make_qkv(1, 4, 2, 8, 8, d, torch.bfloat16)]

    for d, want in [(512, "cutedsl"), (1024, "cutedsl"), (264, "cutedsl"), (300, "triton")]:
        plan = ffpa_attn.explain_varlen(*packed(d), cu, cu, 5, 5, causal=True, enable_gqa=True)
        assert plan.backward.backend == want, (d, str(plan))
    named = ffpa_attn.explain_varlen(*packed(512), cu, cu, 5, 5, enable_gqa=True, backward_backend="cutedsl")
    assert named.backward.backend == "cutedsl" and named.backward.kernel != "none"
    q, k, v = packed(300)
    with pytest.raises(NotImplementedError, match="D=300"):  # (a gradient can be asked for: q requires grad)
        ffpa_attn.explain_varlen(q.requires_grad_(), k, v, cu, cu, 5, 5, enable_gqa=True, backward_backend="cutedsl")
    assert named.backward.kernel == "varlen_bwd_sm90+varlen_bwd_dq_sm90"
    fwd_dims, bwd_dims, _ = capabilities._cute_dims()  # without the varlen backward: Triton, with the reason
    monkeypatch.setattr(capabilities, "_cute_dims", lambda: (fwd_dims, bwd_dims, frozenset({"forward"})))
    plan = ffpa_attn.explain_varlen(*packed(512), cu, cu, 5, 5, enable_gqa=True)
    assert plan.backward.backend == "triton" and "no varlen backward kernel" in plan.backward.reason


def test_forward_only_backend_named_for_inference(monkeypatch):
    """An explicit backend whose backward cannot run this request is fine when no gradient can be asked
    for (no_grad or no input requiring grad) and raises as soon as one can (and in the low-level bwd)."""
    from ffpa_attn import backends
    from ffpa_attn.dispatch import capabilities

    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend sm90"))
    monkeypatch.setattr(capabilities, "_cute_dims", lambda: (frozenset({512, 640}), frozenset({512}), frozenset()))
    q, k, v = make_qkv(1, 2, 2, 8, 8, 640, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, backend="cutedsl")  # nothing requires grad
    assert (plan.forward.backend, plan.backward.backend, plan.backward.kernel) == ("cutedsl", "cutedsl", "none")
    assert "no input requires grad" in plan.backward.reason
    q.requires_grad_(True)
    with torch.no_grad():
        assert ffpa_attn.explain(q, k, v, backend="cutedsl").backward.kernel == "none"
    with pytest.raises(NotImplementedError, match="cannot run this backward"):
        ffpa_attn.explain(q, k, v, backend="cutedsl")
    with pytest.raises(NotImplementedError, match="cannot run this backward"):
        ffpa_attn.ffpa_attn_bwd(q.detach(), q.detach(), k, v, q.detach(), torch.zeros(1, 2, 8), backend="cutedsl")
    # D=512 has a backward kernel; grad_kv_storage_dtype means nothing to it and is refused, not ignored
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.bfloat16, requires_grad=True)
    assert ffpa_attn.explain(q, k, v, backend="cutedsl").backward.kernel == "bwd_sm90+bwd_dq_sm90"  # dK/dV, dQ
    with pytest.raises(NotImplementedError, match="grad_kv_storage_dtype"):
        ffpa_attn.explain(q, k, v, backend=ffpa_attn.CuTeDSLBackend(grad_kv_storage_dtype=torch.float32))
    # a configuration error is not deferred
    with torch.no_grad(), pytest.raises(ValueError, match="acc"):
        ffpa_attn.explain(q, k, v, backend=ffpa_attn.CUDABackend(acc="f16"))


@pytest.mark.parametrize("d,cap,want", [(768, (9, 0), "cutedsl"), (1024, (9, 0), "cutedsl"),
                                        (512, (9, 0), "cutedsl"), (640, (9, 0), "cutedsl"), (640, (8, 0), "triton"),
                                        (768, (8, 0), "cutedsl")])
def test_cuda_forward_preferred_where_measured(monkeypatch, d, cap, want):
    """Implicit default on a (pretend) CUDA device with every backend (pretended) available: the forward that
    measured fastest at that head dim and arch, the CuTeDSL backward after it; a mask sends the forward on down
    the list."""
    import dataclasses

    from ffpa_attn import backends
    from ffpa_attn.dispatch import capabilities
    from ffpa_attn.contract import check_dense

    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend"))
    monkeypatch.setattr(capabilities, "device_capability", lambda device: cap)
    q, k, v = make_qkv(1, 2, 2, 128, 128, d, torch.bfloat16)
    prob = dataclasses.replace(check_dense(q, k, v, None, 0.0, False, None, False), device=torch.device("cuda", 0))
    plan = backends.plan(prob, None, None)
    assert plan.forward.backend == want, str(plan)
    assert plan.backward.backend == "cutedsl"  # (pretended available) its backward runs every D up to 1024
    if d > 512 and cap == (9, 0):  # the S-recompute forward, the CUDA one next
        assert plan.forward.kernel == "fwd_sm90_recompute", str(plan)
    if d in (768, 1024) and cap == (9, 0):
        masked = backends.plan(dataclasses.replace(prob, mask_kind="bool"), None, None)
        assert masked.forward.backend == "triton" and "cuda" in masked.forward.reason


@pytest.mark.parametrize("d", [520, 640, 768, 896, 1024])
def test_recompute_forward_is_the_sm90_default_where_measured(monkeypatch, d):
    """At the head dims where the S-recompute forward measured fastest on sm90 (heuristics
    "cutedsl_fwd_recompute_first"), the implicit CuTeDSL forward of a dense call is that kernel, with
    fwd_recompute=True in the config the op receives; without the cute extra the CUDA forward comes next; a named
    CuTeDSLBackend() keeps the cluster kernel; varlen and split-KV-sized calls keep their own kernels."""
    import dataclasses

    from ffpa_attn import backends
    from ffpa_attn.contract import check_dense
    from ffpa_attn.dispatch import capabilities, heuristics

    monkeypatch.setattr(capabilities, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend sm90"))
    q, k, v = make_qkv(1, 2, 2, 128, 128, d, torch.bfloat16)
    for causal in (False, True):
        prob = dataclasses.replace(check_dense(q, k, v, None, 0.0, causal, None, False),
                                   device=torch.device("cuda", 0))
        plan = backends.plan(prob, None, None)
        assert (plan.forward.backend, plan.forward.kernel) == ("cutedsl", "fwd_sm90_recompute"), str(plan)
        assert plan.forward.config.fwd_recompute is True and plan.backward.config.fwd_recompute is False
        assert backends.plan(prob, ffpa_attn.CuTeDSLBackend(), None).forward.kernel == "fwd_sm90"
        decode = dataclasses.replace(prob, nq=4, nkv=4096, causal=False)  # split-KV, where CuTeDSL measured faster
        want = "splitkv_fwd_sm90" if d in heuristics.cute_preferred_dims() else "splitkv_fwd"
        assert backends.plan(decode, None, None).forward.kernel == want
        assert not heuristics.recompute_preferred(dataclasses.replace(prob, d=512))  # one CTA owns a block there
    monkeypatch.setattr(capabilities, "backend_available",
                        lambda name, device: (name != "cutedsl", "pretend: no cute extra"))
    # then the faster of CUDA and Triton there (heuristics "cuda_forward_first")
    assert backends.plan(prob, None, None).forward.backend == ("cuda" if d in (768, 896, 1024) else "triton")


def test_varlen_forward_follows_the_dense_choice(monkeypatch):
    """Implicit default (pretend sm90 with cutlass): a varlen forward goes to CuTeDSL exactly where the dense
    forward of the same D would (else Triton), with the reason in explain(); its backward to the CuTeDSL varlen
    backward (every D of the dense backward); backend="cutedsl" runs both directions."""
    from ffpa_attn.dispatch import capabilities

    monkeypatch.setattr(capabilities, "backend_available", lambda name, device: (True, "pretend sm90"))
    lens = [5, 0, 9]
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for d in (320, 512, 768):
        q, k, v = (torch.randn(14, 2, d, dtype=torch.bfloat16) for _ in range(3))
        dense = ffpa_attn.explain(*make_qkv(1, 2, 2, 64, 64, d, torch.bfloat16), is_causal=True)
        plan = ffpa_attn.explain_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        want = "cutedsl" if dense.forward.backend in ("cutedsl", "cuda") else dense.forward.backend
        assert plan.forward.backend == want, (d, str(plan), str(dense))
        if want == "cutedsl":
            assert plan.forward.kernel == "varlen_fwd_sm90"
        assert plan.backward.backend == "cutedsl", str(plan)
    q.requires_grad_(True)
    plan = ffpa_attn.explain_varlen(q, k, v, cu, cu, 9, 9, backend="cutedsl")
    assert (plan.forward.kernel, plan.backward.kernel) == ("varlen_fwd_sm90", "varlen_bwd_sm90+varlen_bwd_dq_sm90")


# ------------------------------------------------------------------------------- immutable configs


@pytest.mark.parametrize("field,value", [("grad_q_storage_dtype", torch.float32), ("name", "sdpa"),
                                         ("autotune_mode", "bogus"), ("forward", False)])
def test_configs_cannot_change_after_construction(field, value):
    """A config is validated once and frozen: a later assignment raises at once (it can neither fail later
    inside the op nor silently run another backend); dataclasses.replace builds a new, validated config."""
    import dataclasses

    b = TritonBackend()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(b, field, value)
    assert b == TritonBackend()


def test_replace_validates():
    import dataclasses

    b = dataclasses.replace(TritonBackend(), grad_q_storage_dtype=torch.float32)
    assert b.grad_q_storage_dtype == "float32" and from_config("triton", b.to_config()) == b
    with pytest.raises(ValueError, match="name"):
        dataclasses.replace(TritonBackend(), name="sdpa")
    with pytest.raises(ValueError, match="grad_q_storage_dtype"):
        dataclasses.replace(TritonBackend(), grad_q_storage_dtype=torch.bfloat16)
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.bfloat16)
    plan = ffpa_attn.explain(q, k, v, backend=b)
    assert plan.forward.config is b and plan.forward.backend == "triton"


def test_heuristics_table_has_provenance():
    from ffpa_attn.dispatch import heuristics

    assert heuristics.HEURISTICS
    for h in heuristics.HEURISTICS.values():
        assert h.provenance and h.value is not None, h
    table = heuristics.markdown_table()
    assert all(f"`{name}`" in table for name in heuristics.HEURISTICS)


def test_capability_table_matches_the_kernel_modules():
    from ffpa_attn.dispatch.capabilities import CAPABILITIES, KERNEL_MODULES

    assert set(CAPABILITIES) == {"triton", "cuda", "cutedsl", "sdpa"} == set(KERNEL_MODULES)
    assert not CAPABILITIES["cuda"].backward and CAPABILITIES["triton"].dropout

"""The planner: backend configs (validation at construction), kwarg resolution, the plan per direction and its
complete kernel choice (kernel, tiles, last-wave split, split-KV slices), and explain()."""
import dataclasses
import logging

import pytest
import torch

import ffpa_attn
from ffpa_attn import Backend, CUDABackend, CuTeDSLBackend, SDPABackend, TritonBackend
from ffpa_attn.config import as_backend, from_config, resolve_backends
from ffpa_attn.contract import check_dense
from ffpa_attn.dispatch import heuristics, planner, registry
from ffpa_attn.kernel_module import KernelSpec, decode_kernel
from ffpa_attn.testing import make_qkv, pretend_gpu


def meta_qkv(b, hq, hkv, nq, nkv, d, dtype=torch.bfloat16, requires_grad=False):
    """Shape-only inputs for planning realistic sizes (the planner reads shapes, never data)."""
    q = torch.empty(b, hq, nq, d, dtype=dtype, device="meta", requires_grad=requires_grad)
    k = torch.empty(b, hkv, nkv, d, dtype=dtype, device="meta", requires_grad=requires_grad)
    return q, k, torch.empty_like(k, requires_grad=requires_grad)


# ------------------------------------------------------------------------------------------ dataclasses


def test_defaults_and_directions():
    t = TritonBackend()
    assert (t.name, t.forward, t.backward) == ("triton", True, True)
    c = CUDABackend()
    assert (c.acc, c.stages, c.forward, c.backward) == ("f32", None, True, False)
    assert CuTeDSLBackend().fwd_recompute is None
    assert CuTeDSLBackend(grad_kv_storage_dtype=None) == CuTeDSLBackend()  # the public package's field, accepted
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
    (lambda: CuTeDSLBackend(grad_kv_storage_dtype=torch.float32), "leave it None"),
    (lambda: CuTeDSLBackend(fwd_recompute=1), "fwd_recompute"),
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
    ok, why = registry.available("cutedsl", torch.device("cpu"))
    assert not ok and "CUDA device" in why
    ok, why = registry.available("cuda", torch.device("cpu"))
    assert not ok and "CUDA device" in why
    assert registry.available("sdpa", torch.device("cpu"))[0]


def test_availability_reasons_pretend_gpu(monkeypatch):
    """Availability is the registry's generic rule over each description: the modules it requires, the arch range."""
    pretend_gpu(monkeypatch, capability=(8, 0), missing=("cutlass",))
    dev = torch.device("cuda", 0)
    ok, why = registry.available("cutedsl", dev)
    assert not ok and "nvidia-cutlass-dsl is not installed" in why and "[cute]" in why
    pretend_gpu(monkeypatch, capability=(8, 0))
    ok, why = registry.available("cutedsl", dev)
    assert not ok and "sm90" in why and "(8, 0)" in why
    assert registry.available("cuda", dev)[0] and registry.available("triton", dev)[0]
    pretend_gpu(monkeypatch, capability=(7, 5))
    ok, why = registry.available("triton", dev)
    assert not ok and "sm80" in why


def test_registry_descriptions_are_consistent():
    """Every backend package describes itself; the planner's heuristics only pick among what the descriptions allow."""
    assert set(registry.REGISTRY) == {"triton", "cuda", "cutedsl", "sdpa"}
    cute = registry.spec("cutedsl")
    assert all(cute.head_dim_ok(d) for d in heuristics.value("cutedsl_forward_dims"))
    assert all(cute.head_dim_ok(d) for d in heuristics.value("cutedsl_fwd_recompute_first")[(9, 0)])
    assert not cute.head_dim_ok(260) and cute.head_dim_ok(264) and not cute.head_dim_ok(1032)
    assert registry.spec("cuda").runs("forward", False) and not registry.spec("cuda").runs("backward", False)
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        registry.spec("flash")


def test_kernel_spec_roundtrip():
    spec = KernelSpec.of("fwd_sm90", tile_n=80, tail=(4092, 0, 31, 7936, 32, 64), unused=None)
    assert spec.params == (("tail", (4092, 0, 31, 7936, 32, 64)), ("tile_n", 80))  # None left out, sorted
    assert decode_kernel(spec.encode()) == spec and spec.get("tile_n") == 80 and spec.get("splits", 7) == 7
    assert decode_kernel("bwd") == KernelSpec("bwd")
    with pytest.raises(ValueError, match="kernel"):
        decode_kernel("fwd[tile_n=64")


def test_cutedsl_preference_reason(monkeypatch):
    """Implicit choice on an sm90 box with cutlass: cutedsl where preferred, Triton elsewhere (with the reason)."""
    pretend_gpu(monkeypatch)
    for d, want in [(512, "cutedsl"), (320, "triton"), (640, "cutedsl")]:
        q, k, v = meta_qkv(1, 2, 2, 128, 128, d)
        plan = ffpa_attn.explain(q, k, v)
        assert plan.forward.backend == want, (d, str(plan))
        assert plan.backward.backend == "cutedsl"  # measured faster than Triton at every D it runs (up to 1024)
        if want == "triton":
            assert "measured faster at D=320" in plan.forward.reason


def _without(monkeypatch, backend, *entries):
    """A registry in which ``backend`` has no kernels for ``entries``."""
    spec = registry.spec(backend)
    kernels = {e: names for e, names in spec.kernels.items() if e not in entries}
    monkeypatch.setattr(registry, "REGISTRY", {**registry.REGISTRY, backend: dataclasses.replace(spec, kernels=kernels)})
    planner.invalidate()


def test_cutedsl_varlen_backward_dispatch(monkeypatch):
    """A varlen call's backward goes to the CuTeDSL kernels wherever its head dim has them (explicitly too);
    outside them it falls back to Triton implicitly and raises when named."""
    pretend_gpu(monkeypatch)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)

    def packed(d):
        return [t[0].transpose(0, 1).contiguous() for t in make_qkv(1, 4, 2, 8, 8, d, torch.bfloat16)]

    for d, want in [(512, "cutedsl"), (1024, "cutedsl"), (264, "cutedsl"), (300, "triton")]:
        plan = ffpa_attn.explain_varlen(*packed(d), cu, cu, 5, 5, causal=True, enable_gqa=True)
        assert plan.backward.backend == want, (d, str(plan))
    named = ffpa_attn.explain_varlen(*packed(512), cu, cu, 5, 5, enable_gqa=True, backward_backend="cutedsl")
    assert named.backward.backend == "cutedsl" and named.backward.kernel == "varlen_bwd_sm90+varlen_bwd_dq_sm90"
    q, k, v = packed(300)
    with pytest.raises(NotImplementedError, match="D=300"):  # (a gradient can be asked for: q requires grad)
        ffpa_attn.explain_varlen(q.requires_grad_(), k, v, cu, cu, 5, 5, enable_gqa=True, backward_backend="cutedsl")
    _without(monkeypatch, "cutedsl", "varlen_backward")  # without the varlen backward: Triton, with the reason
    plan = ffpa_attn.explain_varlen(*packed(512), cu, cu, 5, 5, enable_gqa=True)
    assert plan.backward.backend == "triton" and "no varlen backward kernel" in plan.backward.reason


def test_backend_without_a_backward_named_for_inference(monkeypatch):
    """An explicit backend whose backward cannot run this request is fine when no gradient can be asked
    for (no_grad or no input requiring grad) and raises as soon as one can (and in the low-level bwd)."""
    pretend_gpu(monkeypatch)
    _without(monkeypatch, "cutedsl", "dense_backward")
    q, k, v = meta_qkv(1, 2, 2, 8, 8, 640)
    plan = ffpa_attn.explain(q, k, v, backend="cutedsl")  # nothing requires grad
    assert (plan.forward.backend, plan.backward.backend, plan.backward.kernel) == ("cutedsl", "cutedsl", "none")
    assert "no input requires grad" in plan.backward.reason
    q.requires_grad_(True)
    with torch.no_grad():
        assert ffpa_attn.explain(q, k, v, backend="cutedsl").backward.kernel == "none"
    with pytest.raises(NotImplementedError, match="cannot run this backward"):
        ffpa_attn.explain(q, k, v, backend="cutedsl")
    with pytest.raises(NotImplementedError, match="cannot run this backward"):
        ffpa_attn.ffpa_attn_bwd(q.detach(), q.detach(), k, v, q.detach(), torch.zeros(1, 2, 8, device="meta"),
                                backend="cutedsl")
    # a configuration error is not deferred
    with torch.no_grad(), pytest.raises(ValueError, match="acc"):
        ffpa_attn.explain(q, k, v, backend=ffpa_attn.CUDABackend(acc="f16"))


@pytest.mark.parametrize("d,cap,missing,want", [
    (768, (9, 0), (), "cutedsl"), (1024, (9, 0), (), "cutedsl"), (512, (9, 0), (), "cutedsl"),
    (640, (9, 0), (), "cutedsl"), (768, (9, 0), ("cutlass",), "cuda"), (640, (9, 0), ("cutlass",), "triton"),
    (768, (8, 0), (), "triton"), (512, (8, 0), (), "triton")])
def test_forward_preferred_where_measured(monkeypatch, d, cap, missing, want):
    """Implicit default on a (pretend) CUDA device: the forward that measured fastest at that head dim and arch among
    those installed; the CuTeDSL backward where it runs; a mask sends the forward on down the list."""
    pretend_gpu(monkeypatch, capability=cap, missing=missing)
    q, k, v = meta_qkv(1, 2, 2, 128, 128, d)
    plan = ffpa_attn.explain(q, k, v)
    assert plan.forward.backend == want, str(plan)
    assert plan.backward.backend == ("cutedsl" if cap == (9, 0) and not missing else "triton"), str(plan)
    if d > 512 and want == "cutedsl":  # the S-recompute forward
        assert plan.forward.kernel == "fwd_sm90_recompute", str(plan)
    if want == "cuda":
        mask = torch.ones(128, 128, dtype=torch.bool, device="meta")
        masked = ffpa_attn.explain(q, k, v, attn_mask=mask)
        assert masked.forward.backend == "triton" and "cuda" in masked.forward.reason


@pytest.mark.parametrize("d", [520, 640, 768, 896, 1024])
def test_recompute_forward_is_the_sm90_default_where_measured(monkeypatch, d):
    """At the head dims where the S-recompute forward measured fastest on sm90 (heuristics
    "cutedsl_fwd_recompute_first"), a CuTeDSL dense forward is that kernel, implicit or named (fwd_recompute=None);
    fwd_recompute=False names the cluster kernel, True is refused where it would change nothing; varlen and
    split-KV-sized calls keep their own kernels; without the cute extra the faster of CUDA and Triton there."""
    pretend_gpu(monkeypatch)
    q, k, v = meta_qkv(1, 2, 2, 128, 128, d)
    for causal in (False, True):
        plan = ffpa_attn.explain(q, k, v, is_causal=causal)
        assert (plan.forward.backend, plan.forward.kernel) == ("cutedsl", "fwd_sm90_recompute"), str(plan)
        assert plan.forward.config == CuTeDSLBackend()  # the choice lives in the kernel, not in the config
        assert ffpa_attn.explain(q, k, v, is_causal=causal, backend="cutedsl").forward.kernel == "fwd_sm90_recompute"
        cluster = ffpa_attn.explain(q, k, v, is_causal=causal, backend=CuTeDSLBackend(fwd_recompute=False))
        assert cluster.forward.kernel == "fwd_sm90" and cluster.forward.spec.get("tail") is None  # cluster: no tail
    dq, dk, dv = meta_qkv(1, 2, 2, 4, 4096, d)  # split-KV, where the CuTeDSL packed path measured faster
    want = "splitkv_fwd_sm90" if d in heuristics.value("cutedsl_forward_dims") else "splitkv_fwd"
    assert ffpa_attn.explain(dq, dk, dv).forward.kernel == want
    with pytest.raises(NotImplementedError, match="fwd_recompute=True has no effect on this call"):
        ffpa_attn.explain(dq, dk, dv, backend=CuTeDSLBackend(fwd_recompute=True))
    pretend_gpu(monkeypatch, missing=("cutlass",))
    assert ffpa_attn.explain(q, k, v).forward.backend == ("cuda" if d in (768, 896, 1024) else "triton")


def test_recompute_refused_at_d512(monkeypatch):
    pretend_gpu(monkeypatch)
    q, k, v = meta_qkv(1, 2, 2, 128, 128, 512)
    with pytest.raises(NotImplementedError, match=r"fwd_recompute=True has no effect on this call \(D=512\)"):
        ffpa_attn.explain(q, k, v, backend=CuTeDSLBackend(fwd_recompute=True))


def test_varlen_forward_follows_the_dense_choice(monkeypatch):
    """Implicit default (pretend sm90 with cutlass): a varlen forward goes to CuTeDSL where the dense forward of the
    same D measured it faster (else Triton), with the reason in explain(); its backward to the CuTeDSL varlen
    backward (every D of the dense backward); backend="cutedsl" runs both directions."""
    pretend_gpu(monkeypatch)
    lens = [5, 0, 9]
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    for d, want in ((320, "triton"), (512, "cutedsl"), (768, "cutedsl")):
        q, k, v = (torch.randn(14, 2, d, dtype=torch.bfloat16) for _ in range(3))
        plan = ffpa_attn.explain_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        assert plan.forward.backend == want, (d, str(plan))
        if want == "cutedsl":
            # causal tiles: heuristics "cutedsl_fwd_causal_tile_n" (80 keys at D = 512, else 64)
            assert plan.forward.spec == KernelSpec.of("varlen_fwd_sm90", tile_n=80 if d == 512 else 64)
        assert plan.backward.backend == "cutedsl", str(plan)
    q.requires_grad_(True)
    plan = ffpa_attn.explain_varlen(q, k, v, cu, cu, 9, 9, backend="cutedsl")
    assert (plan.forward.kernel, plan.backward.kernel) == ("varlen_fwd_sm90", "varlen_bwd_sm90+varlen_bwd_dq_sm90")


# ------------------------------------------------------------------------------- the complete kernel choice


def test_explain_shows_the_tail_split_and_tiles(monkeypatch):
    """The last-wave split is the planner's: explain() prints its geometry, and it is exactly what crosses the op
    boundary (B=1 H=32 N=8192 on 132 SMs: 4096 CTAs = 31 waves + 4, the last 4 blocks of head 31 over 32 slices)."""
    pretend_gpu(monkeypatch)
    q, k, v = meta_qkv(1, 32, 32, 8192, 8192, 512)
    plan = ffpa_attn.explain(q, k, v)
    assert plan.forward.spec == KernelSpec.of("fwd_sm90", tile_n=80, tail=(4092, 0, 31, 8192 - 4 * 64, 32, 64))
    assert "tail=(4092, 0, 31, 7936, 32, 64)" in str(plan) and "tile_n=80" in str(plan)
    assert plan.forward.op_args()[1] == plan.forward.spec.encode()
    assert decode_kernel(plan.forward.op_args()[1]) == plan.forward.spec
    causal = ffpa_attn.explain(q, k, v, is_causal=True).forward.spec
    assert causal == KernelSpec.of("fwd_sm90", tile_n=80)  # causal: longest blocks first, no tail; 80-key tiles
    d320 = ffpa_attn.explain(*meta_qkv(1, 32, 32, 8192, 8192, 320), backend="cutedsl").forward.spec
    assert d320.get("tail") is None  # measured slower at D=320 (heuristics "cutedsl_tail_split_min_d")
    monkeypatch.setenv("FFPA_ATTN_TAIL_SPLIT", "0")
    assert ffpa_attn.explain(q, k, v).forward.spec.get("tail") is None
    bwd = ffpa_attn.explain(*meta_qkv(1, 32, 32, 8192, 8192, 512, requires_grad=True)).backward.spec
    assert bwd == KernelSpec.of("bwd_sm90+bwd_dq_sm90", ring_stages=4)  # the measured ring depth at D=512


def test_explain_shows_the_cuda_rows_and_tail(monkeypatch):
    pretend_gpu(monkeypatch, missing=("cutlass",))
    q, k, v = meta_qkv(1, 32, 32, 8192, 8192, 768)
    spec = ffpa_attn.explain(q, k, v).forward.spec
    assert spec.name == "fwd" and spec.get("rows_per_warp") == 32
    # 32-row blocks above D=512: 8192 CTAs = 62 waves of 132 + 8, the last 8 blocks of head 31 over 16 slices
    assert spec.get("tail") == (8192 - 8, 0, 31, 8192 - 8 * 32, 16, 32), spec
    monkeypatch.setenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", "16")
    assert ffpa_attn.explain(q, k, v).forward.spec.get("rows_per_warp") == 16
    monkeypatch.setenv("FFPA_ATTN_CUDA_ROWS_PER_WARP", "24")
    with pytest.raises(ValueError, match="FFPA_ATTN_CUDA_ROWS_PER_WARP"):
        ffpa_attn.explain(q, k, v)
    pretend_gpu(monkeypatch, capability=(8, 0), missing=("cutlass",))
    monkeypatch.delenv("FFPA_ATTN_CUDA_ROWS_PER_WARP")
    spec = ffpa_attn.explain(q, k, v, backend="cuda").forward.spec
    assert spec == KernelSpec.of("fwd", rows_per_warp=16)  # not measured off sm90: 16 rows, no tail split


def test_explain_shows_the_splitkv_slices(monkeypatch):
    pretend_gpu(monkeypatch)
    q, k, v = meta_qkv(1, 32, 8, 1, 32768, 512)
    spec = ffpa_attn.explain(q, k, v, enable_gqa=True).forward.spec
    # 8 KV heads x 1 row block = 8 CTAs per slice; 132 // 8 = 16 slices of 2048 keys
    assert spec == KernelSpec.of("splitkv_fwd_sm90", splits=16, tile_n=64), spec
    causal = ffpa_attn.explain(*meta_qkv(1, 32, 8, 4, 32768, 512), enable_gqa=True, is_causal=True).forward
    assert causal.backend == "triton" and causal.kernel == "splitkv_fwd"  # rows see different prefixes


def test_each_decision_is_made_once_per_call(monkeypatch):
    """The split-KV rule is evaluated once per plan, the autograd question once per call."""
    from ffpa_attn import interface

    calls = {"splitkv": 0, "grad": 0}
    real_sized, real_grad = heuristics.splitkv_sized, interface._needs_backward

    def sized(*a):
        calls["splitkv"] += 1
        return real_sized(*a)

    def grad(*a):
        calls["grad"] += 1
        return real_grad(*a)

    monkeypatch.setattr(heuristics, "splitkv_sized", sized)
    monkeypatch.setattr(interface, "_needs_backward", grad)
    pretend_gpu(monkeypatch)
    ffpa_attn.explain(*meta_qkv(1, 32, 8, 1, 32768, 512), enable_gqa=True)
    assert calls == {"splitkv": 1, "grad": 1}
    monkeypatch.undo()
    monkeypatch.setattr(interface, "_needs_backward", grad)
    calls["grad"] = 0
    q, k, v = make_qkv(1, 2, 2, 8, 8, 96, torch.bfloat16, requires_grad=True)
    ffpa_attn.ffpa_attn_func(q, k, v).sum().backward()
    assert calls["grad"] == 1


def test_dtype_is_checked_once_on_the_ffpa_path():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 512, torch.float32)
    with pytest.raises(TypeError, match="query.dtype must be torch.float16 or torch.bfloat16"):
        ffpa_attn.explain(q, k, v)
    with pytest.raises(TypeError, match="query.dtype"):
        ffpa_attn.explain(q, k, v, backend="triton")
    assert ffpa_attn.explain(q, k, v, backend="sdpa").forward.backend == "sdpa"
    assert ffpa_attn.explain(*make_qkv(1, 2, 2, 8, 8, 128, torch.float32)).direct_sdpa  # outside the FFPA range


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


def test_every_backend_has_a_config_class_and_a_kernel_selector():
    from ffpa_attn.config import BACKEND_CLASSES

    assert set(registry.REGISTRY) == set(BACKEND_CLASSES) == set(heuristics.SELECTORS)
    assert all(spec.kernel_module == registry.kernel_package(name) for name, spec in registry.REGISTRY.items())

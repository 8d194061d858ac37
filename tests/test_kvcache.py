"""The public KV-cache entry ``ffpa_attn_with_kvcache`` (flash-attn's ``flash_attn_with_kvcache``) on the Triton
interpreter against the fp32 reference (``ffpa_attn.reference.kvcache_attention``): paged (shuffled block tables) and
contiguous (``cache_batch_idx``) caches, ragged lengths (0, 1, page boundaries, full), GQA, Nq > 1 causal, append
then attend in one call, lse; the three routes (the decode kernel; for chunked prefill the varlen forward over the
pages in place, or the packed gather + varlen forward for contiguous caches and cache_leftpad) and
``explain_kvcache``; argument errors naming the argument with nothing written; the flash-attn options
we do not implement; ``num_splits``; named backends; torch.compile (fullgraph) of a decode step; autocast; the plan
memo and the once-per-tensor value checks.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ffpa_attn
from ffpa_attn import contract, interface
from ffpa_attn.dispatch import heuristics, planner
from ffpa_attn.testing import assert_kvcache_matches, make_kvcache, pretend_gpu, ragged_seqlens

BF16, FP16 = torch.bfloat16, torch.float16


def new_tokens(batch: int, n: int, hkv: int, d: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(batch, n, hkv, d, device=device).to(dtype) for _ in range(2))


def call_and_check(q, case, k=None, v=None, *, causal=False, cache_leftpad=None, **kw):
    """ffpa_attn_with_kvcache on the case's caches (mutated in place), checked against the reference."""
    before = (case.k_cache.clone(), case.v_cache.clone())
    out, lse = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, causal=causal,
                                                cache_leftpad=cache_leftpad, return_softmax_lse=True,
                                                **case.kwargs(), **kw)
    assert_kvcache_matches(out, lse, q, case, *before, k, v, causal=causal, cache_leftpad=cache_leftpad)
    return out, lse


# ------------------------------------------------------------------------------------------ results


@pytest.mark.parametrize("page", [16, 64, None])
def test_decode_ragged_lengths_append(device, page):
    """One new token per sequence appended and attended in one call: lengths 0, 1, page - 1, page, page + 1 and
    full, shuffled tables (paged) or a cache_batch_idx into a larger cache (contiguous); GQA 8 / 2; lse."""
    g = torch.Generator().manual_seed(page or 1)
    cap = 2 * (page or 32)
    lens = ragged_seqlens(6, cap, page or 16, n_new=1, generator=g)
    case = make_kvcache(lens, 2, 64, BF16, page_size=page, capacity=cap, n_new=1, device=device, generator=g,
                        batch_cache=8 if page is None else None)
    assert page is not None or case.cache_batch_idx is not None
    q = torch.randn(6, 1, 8, 64, device=device).to(BF16)
    k, v = new_tokens(6, 1, 2, 64, BF16, device)
    call_and_check(q, case, k, v, causal=True)


def test_speculative_verify_causal_leftpad(device):
    """Nq = 3 queries, 3 new tokens, causal (tail-aligned per sequence) with a left-padded sequence, fp16."""
    case = make_kvcache([0, 13, 16, 40], 1, 48, FP16, page_size=16, capacity=48, n_new=3, device=device)
    q = torch.randn(4, 3, 4, 48, device=device).to(FP16)
    k, v = new_tokens(4, 3, 1, 48, FP16, device)
    leftpad = torch.tensor([0, 5, 16, 1], dtype=torch.int32, device=device)
    call_and_check(q, case, k, v, causal=True, cache_leftpad=leftpad)


def test_attend_without_append_and_short_sequences(device):
    """No new tokens: Nq = 2 causal over sequences of 0 and 1 keys (rows that see nothing: out 0, lse -inf) and an
    int cache_seqlens over a contiguous cache."""
    case = make_kvcache([0, 1, 30], 2, 32, BF16, capacity=32, device=device)
    q = torch.randn(3, 2, 2, 32, device=device).to(BF16)
    _, lse = call_and_check(q, case, causal=True)
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, :, 0]).all()
    case.cache_seqlens = 17  # flash-attn's int form: every sequence holds 17 keys
    call_and_check(q, case)


@pytest.mark.parametrize("page, leftpad, route, kernel", [
    (16, False, "paged varlen", "kvcache_paged"),  # the varlen forward reads the pages in place
    (48, True, "gather+varlen", "kvcache_gather"),  # cache_leftpad: the packed route
    (None, False, "gather+varlen", "kvcache_gather"),  # a contiguous cache: the packed route
])
def test_chunked_prefill_routes(device, page, leftpad, route, kernel):
    """65 new queries per sequence (> 64: the chunked-prefill routes) appended onto ragged caches, causal;
    explain_kvcache names the route and both kernels."""
    n = heuristics.value("kvcache_gather_min_nq")
    case = make_kvcache([0, 20, 33], 1, 32, BF16, page_size=page, capacity=112, n_new=n, device=device)
    q = torch.randn(3, n, 2, 32, device=device).to(BF16)
    k, v = new_tokens(3, n, 1, 32, BF16, device)
    pad = torch.tensor([0, 5, 17], dtype=torch.int32, device=device) if leftpad else None
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True, cache_leftpad=pad,
                                     **case.kwargs())
    assert plan.route == route and plan.kvcache.kernel == kernel, str(plan)
    assert plan.varlen is not None and plan.varlen.kernel == "varlen_fwd" and f"route: {route}" in str(plan)
    call_and_check(q, case, k, v, causal=True, cache_leftpad=pad)


def test_gather_route_unchecked_sizes_its_buffers(device):
    """With check_values=False the gather route reads the packed key count itself (non-causal, no append)."""
    n = heuristics.value("kvcache_gather_min_nq")
    case = make_kvcache([7, 90], 1, 32, FP16, page_size=16, capacity=96, device=device)
    q = torch.randn(2, n, 1, 32, device=device).to(FP16)
    call_and_check(q, case, check_values=False)


def test_routing_decode_plan_on_an_h200(monkeypatch):
    """On a (pretended) H200 the serving shape plans the decode kernel with the measured tiles and two slices per
    sequence; 2K new queries plan the gather + the CuTeDSL varlen forward (the varlen order's first at D = 512, which
    reads no pages: heuristic paged_gather_first), and at D = 320, where Triton comes first, its varlen forward over
    the pages in place."""
    pretend_gpu(monkeypatch, capability=(9, 0), sms=132)
    case = make_kvcache([8] * 32, 8, 512, BF16, page_size=64, capacity=4096, device="meta")
    q = torch.empty(32, 1, 32, 512, dtype=BF16, device="meta")
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, causal=True, **case.kwargs())
    assert plan.route == "decode" and plan.varlen is None
    spec = plan.kvcache.spec
    assert (spec.name, spec.get("block_m"), spec.get("block_n"), spec.get("warps"), spec.get("stages"),
            spec.get("splits")) == ("kvcache_fwd", 16, 16, 4, 4, 2), str(plan)
    q = torch.empty(32, 2048, 32, 512, dtype=BF16, device="meta")
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, causal=True, **case.kwargs())
    assert plan.route == "gather+varlen" and plan.kvcache.kernel == "kvcache_gather", str(plan)
    assert plan.varlen.backend == "cutedsl", str(plan)
    case = make_kvcache([8] * 32, 8, 320, BF16, page_size=64, capacity=4096, device="meta")
    q = torch.empty(32, 2048, 32, 320, dtype=BF16, device="meta")
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, causal=True, **case.kwargs())
    assert plan.route == "paged varlen" and plan.kvcache.kernel == "kvcache_paged", str(plan)
    assert plan.varlen.backend == "triton" and plan.varlen.kernel == "varlen_fwd", str(plan)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_public_entry(device, data):
    """Random layouts, lengths, heads, query counts (both routes), appends, leftpad and causality through the public
    entry, against the reference (out, lse, and the caches bit for bit)."""
    page = data.draw(st.sampled_from([None, 16, 32, 48]), "page")
    hq, hkv = data.draw(st.sampled_from([(2, 1), (4, 2), (4, 4)]), "heads")
    nq = data.draw(st.sampled_from([1, 2, 3, heuristics.value("kvcache_gather_min_nq")]), "nq")
    n_new = data.draw(st.sampled_from([0, 1, nq]), "n_new")
    cap = data.draw(st.sampled_from([48, 96]), "cap") + n_new
    if page:
        cap = -(-cap // page) * page
    batch = data.draw(st.integers(1, 3), "batch")
    lens = data.draw(st.lists(st.integers(0, cap - n_new), min_size=batch, max_size=batch), "lens")
    causal = data.draw(st.booleans(), "causal")
    case = make_kvcache(lens, hkv, 32, BF16, page_size=page, capacity=cap, n_new=n_new, device=device,
                        batch_cache=batch + 1 if page is None else None)
    leftpad = None
    if data.draw(st.booleans(), "leftpad"):
        leftpad = torch.tensor([data.draw(st.integers(0, n), f"pad{i}") for i, n in enumerate(lens)],
                               dtype=torch.int32, device=device)
    q = torch.randn(batch, nq, hq, 32, device=device).to(BF16)
    k = v = None
    if n_new:
        k, v = new_tokens(batch, n_new, hkv, 32, BF16, device)
    call_and_check(q, case, k, v, causal=causal, cache_leftpad=leftpad)


# ------------------------------------------------------------------------------------------ errors


def _errcase(device):
    case = make_kvcache([10, 20], 2, 64, BF16, page_size=16, capacity=32, n_new=1, device=device)
    q = torch.randn(2, 1, 4, 64, device=device).to(BF16)
    k, v = new_tokens(2, 1, 2, 64, BF16, device)
    return case, q, k, v


@pytest.mark.parametrize("what,exc,match", [
    ("seqlens past the cache", ValueError, "past the cache's capacity"),
    ("negative seqlens", ValueError, r"cache_seqlens\[0\] = -1 is negative"),
    ("block id out of range", ValueError, r"block_table\[1, 0\] = 99"),
    ("int64 block table", TypeError, "block_table must be int32"),
    ("int64 seqlens", TypeError, "cache_seqlens must be int32"),
    ("flat cache", ValueError, "k_cache must be 4-D"),
    ("BHND cache", ValueError, "unit stride on the head dim"),
    ("page of 24", ValueError, "multiple of 16"),
    ("table with batch idx", ValueError, "cache_batch_idx cannot be combined"),
    ("k without v", ValueError, "k and v must be given together"),
    ("heads", ValueError, "multiple of the cache's Hkv"),
    ("dtype", ValueError, "share dtype"),
    ("q rank", ValueError, r"q must be 4-D \[B, Nq, Hq, D\]"),
    ("new tokens shape", ValueError, r"k must have shape \[B, Nq_new, Hkv, D\]"),
    ("leftpad", ValueError, r"cache_leftpad\[1\] = 21"),
])
def test_bad_inputs_name_the_argument_and_write_nothing(device, what, exc, match):
    case, q, k, v = _errcase(device)
    kw = dict(case.kwargs(), k=k, v=v)
    if what == "seqlens past the cache":
        kw["cache_seqlens"] = torch.tensor([10, 32], dtype=torch.int32, device=device)
    elif what == "negative seqlens":
        kw["cache_seqlens"] = torch.tensor([-1, 3], dtype=torch.int32, device=device)
    elif what == "block id out of range":
        kw["block_table"] = case.block_table.clone()
        kw["block_table"][1, 0] = 99
    elif what == "int64 block table":
        kw["block_table"] = case.block_table.long()
    elif what == "int64 seqlens":
        kw["cache_seqlens"] = case.cache_seqlens.long()
    elif what == "flat cache":
        kw["k_cache"], kw["v_cache"] = case.k_cache.flatten(0, 1), case.v_cache.flatten(0, 1)
    elif what == "BHND cache":
        kw["k_cache"] = kw["v_cache"] = case.k_cache.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif what == "page of 24":
        c24 = make_kvcache([10, 20], 2, 64, BF16, page_size=24, capacity=48, device=device)
        kw.update(c24.kwargs(), k_cache=c24.k_cache, v_cache=c24.v_cache)
    elif what == "table with batch idx":
        kw["cache_batch_idx"] = torch.tensor([0, 1], dtype=torch.int32, device=device)
    elif what == "k without v":
        kw["v"] = None
    elif what == "heads":
        q = torch.randn(2, 1, 3, 64, device=device).to(BF16)
    elif what == "dtype":
        q = q.half()
    elif what == "q rank":
        q = q[:, 0]
    elif what == "new tokens shape":
        kw["k"], kw["v"] = k.transpose(1, 2), v.transpose(1, 2)
    elif what == "leftpad":
        kw["cache_leftpad"] = torch.tensor([0, 21], dtype=torch.int32, device=device)
    caches = kw.pop("k_cache", case.k_cache), kw.pop("v_cache", case.v_cache)
    saved = [c.clone() for c in caches]
    with pytest.raises(exc, match=match):
        ffpa_attn.ffpa_attn_with_kvcache(q, *caches, **kw)
    assert all(torch.equal(c, s) for c, s in zip(caches, saved)), "a refused call wrote into the cache"


def test_contiguous_cache_errors(device):
    case = make_kvcache([10, 20], 2, 64, BF16, capacity=32, batch_cache=4, device=device)
    q = torch.randn(2, 1, 4, 64, device=device).to(BF16)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[1\] = 4 is outside the cache's 4 rows"):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=case.cache_seqlens,
                                         cache_batch_idx=torch.tensor([0, 4], dtype=torch.int32, device=device))
    small = make_kvcache([10, 20], 2, 64, BF16, capacity=32, device=device)
    with pytest.raises(ValueError, match="fewer than the batch"):
        ffpa_attn.ffpa_attn_with_kvcache(torch.randn(3, 1, 4, 64, device=device).to(BF16), small.k_cache, small.v_cache,
                                         cache_seqlens=5)
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        ffpa_attn.ffpa_attn_with_kvcache(q, small.k_cache, small.v_cache, *new_tokens(2, 1, 2, 64, BF16, device))


@pytest.mark.parametrize("kw,match", [
    ({"rotary_cos": torch.ones(4, 8)}, "rotary"),
    ({"window_size": (8, 0)}, "window_size"),
    ({"softcap": 30.0}, "softcap"),
    ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
    ({"k_descale": torch.ones(1)}, "k_descale"),
    ({"v_descale": torch.ones(1)}, "v_descale"),
])
def test_unimplemented_flash_attn_options_raise(kw, match, device):
    case, q, _, _ = _errcase(device)
    with pytest.raises(NotImplementedError, match=match):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs(), **kw)


def test_defaults_and_bad_option_types(device):
    case, q, _, _ = _errcase(device)
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, window_size=(None, None), softcap=0.0,
                                     rotary_interleaved=False, k_descale=None, **case.kwargs())
    assert plan.route == "decode"
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, bogus=1, **case.kwargs())
    with pytest.raises(TypeError, match="causal must be a bool"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, causal=1, **case.kwargs())
    with pytest.raises(TypeError, match="check_values must be a bool"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, check_values="no", **case.kwargs())
    with pytest.raises(ValueError, match=r"num_splits must be in \[0, 256\]"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, num_splits=-1, **case.kwargs())
    with pytest.raises(TypeError, match="num_splits must be an int"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, num_splits=2.0, **case.kwargs())


def test_num_splits_is_honoured_or_refused(device):
    """num_splits > 0 is the decode kernel's slice count (the answer does not change); on the gather route it is
    refused naming both fixes."""
    case = make_kvcache([60, 3], 1, 32, BF16, page_size=16, capacity=64, device=device)
    q = torch.randn(2, 1, 2, 32, device=device).to(BF16)
    plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, num_splits=3, **case.kwargs())
    assert plan.kvcache.spec.get("splits") == 3 and "splits=3" in str(plan)
    call_and_check(q, case, num_splits=3)
    n = heuristics.value("kvcache_gather_min_nq")
    long_q = torch.randn(2, n, 2, 32, device=device).to(BF16)
    with pytest.raises(NotImplementedError, match=f"num_splits=3 .*Nq={n}.*pass num_splits=0"):
        ffpa_attn.explain_kvcache(long_q, case.k_cache, case.v_cache, num_splits=3, **case.kwargs())


@pytest.mark.parametrize("name", ["cutedsl", "cuda", "sdpa"])
def test_backends_without_a_kvcache_kernel_are_refused(monkeypatch, name):
    """A named backend whose description lists no KV-cache kernel is refused with the registry's generic reason (on a
    pretended H200, where CuTeDSL and CUDA are available); the kernel modules refuse too."""
    import importlib

    from ffpa_attn.dispatch import registry

    pretend_gpu(monkeypatch, capability=(9, 0))
    case, q, _, _ = _errcase("cpu")
    chunk = torch.empty(q.shape[0], heuristics.value("kvcache_gather_min_nq"), *q.shape[2:], dtype=q.dtype)
    for query in (q, chunk):  # a chunk too: the missing KV-cache kernel is the reason, not the chunk's varlen forward
        with pytest.raises(NotImplementedError,
                           match=f"backend '{name}' cannot run this forward: .*no KV-cache forward"):
            ffpa_attn.explain_kvcache(query, case.k_cache, case.v_cache, backend=name, **case.kwargs())
    mod = importlib.import_module(registry.kernel_package(name))
    with pytest.raises(NotImplementedError, match="KV-cache|kvcache"):
        mod.kvcache_forward(q, case.k_cache, case.v_cache, None, None, None, None, None, None, causal=False,
                            scale=1.0, config=None, kernel=None)


def test_no_backend_and_head_dims_out_of_reach(monkeypatch, device):
    """Without a KV-cache kernel for the call there is no SDPA fallback: NotImplementedError naming each backend's
    reason (a CPU tensor without the interpreter; a head dim above 1024)."""
    from ffpa_attn.common import device as device_facts

    case, q, _, _ = _errcase("cpu")
    big = make_kvcache([3], 1, 1040, BF16, capacity=16, device=device)
    with pytest.raises(NotImplementedError, match=r"triton: head dim D=1040 outside .*\[16, 1024\]"):
        ffpa_attn.explain_kvcache(torch.randn(1, 1, 1, 1040, device=device).to(BF16), big.k_cache, big.v_cache,
                                  **big.kwargs())
    monkeypatch.setattr(device_facts, "interpreter_on", lambda: False)
    with pytest.raises(NotImplementedError, match="no backend can run this KV-cache call .*TRITON_INTERPRET=1"):
        ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())


def test_unchecked_values_do_not_raise_and_stay_inside(device):
    """check_values=False: a length past the capacity is neither reported nor written outside the cache."""
    case, q, k, v = _errcase(device)
    spare = case.k_cache.clone()
    seq = torch.tensor([32, 20], dtype=torch.int32, device=device)  # 32 + 1 new token > the 32-key capacity
    kw = dict(case.kwargs(), cache_seqlens=seq)
    out = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, check_values=False, **kw)
    assert torch.isfinite(out).all()
    used = set(case.block_table[case.block_table >= 0].tolist())
    untouched = [b for b in range(case.k_cache.shape[0]) if b not in used]
    assert untouched and torch.equal(case.k_cache[untouched], spare[untouched])
    with pytest.raises(ValueError, match="past the cache's capacity"):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, **kw)


# ------------------------------------------------------------------------------------------ compile, autocast, memo


def test_torch_compile_fullgraph_decode_step(device):
    """A decode step (append + attention, lse) compiled with fullgraph=True: no graph break, same results and the
    same cache writes as eager."""
    torch._dynamo.reset()
    case = make_kvcache([5, 17, 32], 2, 32, BF16, page_size=16, capacity=48, n_new=1, device=device)
    q = torch.randn(3, 1, 4, 32, device=device).to(BF16)
    k, v = new_tokens(3, 1, 2, 32, BF16, device)
    eager_case = make_kvcache([5, 17, 32], 2, 32, BF16, page_size=16, capacity=48, n_new=1, device=device)
    eager_case.k_cache.copy_(case.k_cache)
    eager_case.v_cache.copy_(case.v_cache)
    eager_case.block_table.copy_(case.block_table)

    def step(q, k_cache, v_cache, k, v, seqlens, table):
        return ffpa_attn.ffpa_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                                causal=True, return_softmax_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    out, lse = compiled(q, case.k_cache, case.v_cache, k, v, case.cache_seqlens, case.block_table)
    ref_out, ref_lse = step(q, eager_case.k_cache, eager_case.v_cache, k, v, eager_case.cache_seqlens,
                            eager_case.block_table)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(case.k_cache, eager_case.k_cache) and torch.equal(case.v_cache, eager_case.v_cache)


def test_fp32_query_under_bf16_autocast(device):
    """fp32 q / k / v inside a bf16 autocast region run in bf16 (the cache's dtype), as torch SDPA's inputs would;
    outside the region fp32 is a clear dtype error."""
    case = make_kvcache([9, 30], 1, 32, BF16, page_size=16, capacity=32, n_new=1, device=device)
    twin = make_kvcache([9, 30], 1, 32, BF16, page_size=16, capacity=32, n_new=1, device=device)
    for a, b in ((twin.k_cache, case.k_cache), (twin.v_cache, case.v_cache), (twin.block_table, case.block_table)):
        a.copy_(b)
    q = torch.randn(2, 1, 2, 32, device=device)
    k, v = torch.randn(2, 1, 1, 32, device=device), torch.randn(2, 1, 1, 32, device=device)
    with torch.autocast(device if device != "cpu" else "cpu", dtype=BF16):
        out = ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, k, v, causal=True, **case.kwargs())
    ref = ffpa_attn.ffpa_attn_with_kvcache(q.to(BF16), twin.k_cache, twin.v_cache, k.to(BF16), v.to(BF16),
                                           causal=True, **twin.kwargs())
    assert out.dtype == BF16 and torch.equal(out, ref) and torch.equal(case.k_cache, twin.k_cache)
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())


def test_fp32_caches_are_refused_with_the_fix(device):
    """Under autocast too: the caches are the caller's storage, written in place, and never cast."""
    case = make_kvcache([9, 30], 1, 32, torch.float32, page_size=16, capacity=32, device=device)
    q = torch.randn(2, 1, 2, 32, device=device)
    with torch.autocast(device if device != "cpu" else "cpu", dtype=BF16), \
            pytest.raises(TypeError, match=r"k_cache.dtype .*caller's storage.*allocate them in torch.bfloat16"):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())


def test_head_count_error_hints_at_the_query_layout(device):
    """q in SDPA's [B, Hq, Nq, D] against a cache of Hkv = 2: the message names flash-attn's layout; a head count that
    is wrong in either layout gets no hint."""
    case = make_kvcache([9, 30], 2, 32, BF16, page_size=16, capacity=32, device=device)
    q = torch.randn(2, 4, 1, 32, device=device).to(BF16)  # [B, Hq=4, Nq=1, D]
    with pytest.raises(ValueError, match=r"Hq = 1 must be a multiple .* Hkv = 2; did you pass q as \[B, Hq, Nq, D\]"):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    with pytest.raises(ValueError, match=r"Hkv = 2$"):
        ffpa_attn.ffpa_attn_with_kvcache(q[:, :3].transpose(1, 2), case.k_cache, case.v_cache, **case.kwargs())
    ffpa_attn.ffpa_attn_with_kvcache(q.transpose(1, 2), case.k_cache, case.v_cache, **case.kwargs())  # the fix


@pytest.fixture
def counts(monkeypatch):
    """Counts the plans and the host reads of lengths / tables the entry makes."""
    interface.clear_plan_memo()
    contract._CHECKED_KVCACHE.clear()
    n = {"plan": 0, "values": 0}
    real_plan, real_values = interface.plan_kvcache, contract.check_kvcache_values

    def plan(*a, **k):
        n["plan"] += 1
        return real_plan(*a, **k)

    def values(*a, **k):
        n["values"] += 1
        return real_values(*a, **k)

    monkeypatch.setattr(interface, "plan_kvcache", plan)
    monkeypatch.setattr(contract, "check_kvcache_values", values)
    return n


def test_plan_memo_and_value_checks_once_per_tensor(counts, device):
    """Layers of one step share lengths and tables: one plan per call signature (an int cache_seqlens of another
    value included) and one host read per unchanged tensor set; an in-place change of the lengths is read again."""
    case = make_kvcache([4, 9], 1, 32, BF16, page_size=16, capacity=32, device=device)
    q = torch.randn(2, 1, 2, 32, device=device).to(BF16)
    for _ in range(3):  # three "layers"
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    assert counts == {"plan": 1, "values": 1}
    case.cache_seqlens.add_(1)  # the next step
    ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    assert counts == {"plan": 1, "values": 2}
    ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, check_values=False, **case.kwargs())
    assert counts == {"plan": 2, "values": 2}  # another signature (the keyword), no read
    for n in (5, 6):
        ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=n,
                                         block_table=case.block_table)
    assert counts["plan"] == 3 and counts["values"] == 4
    ffpa_attn.ffpa_attn_with_kvcache(torch.randn(2, 2, 2, 32, device=device).to(BF16), case.k_cache, case.v_cache,
                                     **case.kwargs())
    assert counts["plan"] == 4


def test_lengths_advanced_in_place_keep_one_checked_entry(counts, device):
    """A decode loop advances its lengths in place every step: each step reads them once, and the checked entries
    of earlier versions (which can never match again) are dropped, so a step compares against one entry."""
    case = make_kvcache([4, 9], 1, 32, BF16, page_size=16, capacity=64, device=device)
    q = torch.randn(2, 1, 2, 32, device=device).to(BF16)
    for step in range(1, 6):
        case.cache_seqlens.add_(1)
        for _ in range(2):  # two layers
            ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
        assert counts["values"] == step and len(contract._CHECKED_KVCACHE) == 1
    other = case.cache_seqlens.clone()
    ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, cache_seqlens=other, block_table=case.block_table)
    assert len(contract._CHECKED_KVCACHE) == 2  # other tensors: both kept


def test_inference_mode_tensors_are_checked_every_call(counts, device):
    """Inference-mode tensors carry no version counter: their values are read on every call (never trusted)."""
    with torch.inference_mode():
        case = make_kvcache([4, 9], 1, 32, BF16, page_size=16, capacity=32, device=device)
        q = torch.randn(2, 1, 2, 32, device=device).to(BF16)
        for _ in range(2):
            ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    assert counts == {"plan": 1, "values": 2}


def test_value_checks_are_skipped_during_graph_capture(counts, monkeypatch, device):
    """While a CUDA graph is being captured the entry reads nothing on the host (and does not raise)."""
    case, q, _, _ = _errcase(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ffpa_attn.ffpa_attn_with_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    assert counts["values"] == 0
    with pytest.raises(RuntimeError, match="check_values=False"):
        contract.check_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())


def test_explain_kvcache_plans_afresh(counts, device):
    case, q, _, _ = _errcase(device)
    for _ in range(2):
        plan = ffpa_attn.explain_kvcache(q, case.k_cache, case.v_cache, **case.kwargs())
    assert counts["plan"] == 2 and isinstance(plan, planner.KVCachePlan)
    assert "route: decode" in str(plan) and "kvcache: triton:kvcache_fwd[" in str(plan)


@pytest.mark.parametrize("pages", [8, contract._SMALL_TABLE])  # min / max on Python ints, and with a torch op
def test_block_table_entries_checked_on_occupied_pages_only(pages):
    """-1 past a sequence's pages is accepted; an out-of-range entry on a page it occupies is named; both for a
    decode-sized table and for one past the size checked on Python ints."""
    k_cache = torch.zeros(17, 16, 1, 8, dtype=BF16)
    seqlens = torch.tensor([40, 100], dtype=torch.int32)  # pages 0..2 and 0..6
    table = torch.full((2, pages), -1, dtype=torch.int32)
    table[0, :3], table[1, :7] = torch.arange(3), torch.arange(3, 10)
    assert contract.check_kvcache_values(k_cache, seqlens, table, None, None, 2, 0) == 140
    table[1, 6] = 17
    with pytest.raises(ValueError, match=r"block_table\[1, 6\] = 17 is outside the cache's 17 blocks"):
        contract.check_kvcache_values(k_cache, seqlens, table, None, None, 2, 0)

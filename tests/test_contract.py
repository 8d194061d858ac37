"""The public contract (docs/design.md, "Contract"): argument validation, exception types and messages, kwargs."""
import pytest
import torch

import ffpa_attn
from ffpa_attn import ffpa_attn_func, ffpa_attn_varlen_func
from ffpa_attn.reference import attention, varlen_attention
from ffpa_attn.testing import assert_close, make_qkv


def qkv(b=1, hq=2, hkv=2, nq=16, nkv=16, d=320, dtype=torch.bfloat16):
    return make_qkv(b, hq, hkv, nq, nkv, d, dtype)


# ------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ffpa_range_rejects_non_half_dtypes(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match=r"query\.dtype.*float16.*bfloat16"):
        ffpa_attn_func(q, k, v)


def test_explicit_ffpa_backend_rejects_fp32_even_for_small_d():
    q, k, v = qkv(d=64, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        ffpa_attn_func(q, k, v, backend="triton")


def test_small_d_fp32_falls_back_to_sdpa_and_is_exact():
    q, k, v = qkv(d=64, dtype=torch.float32)
    out = ffpa_attn_func(q, k, v, is_causal=True)
    ref, _ = attention(q, k, v, is_causal=True, dtype=torch.float64)
    assert_close(out, ref, torch.float32)
    plan = ffpa_attn.explain(q, k, v, is_causal=True)
    assert plan.forward.backend == "sdpa" and "D=64" in plan.forward.reason


def test_mixed_dtypes_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dtype.*query.dtype=torch.bfloat16.*key.dtype=torch.float16"):
        ffpa_attn_func(q, k.half(), v)


# ------------------------------------------------------------------------------------------ shapes


def test_bad_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"query must be 4-D"):
        ffpa_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match=r"value must be 4-D"):
        ffpa_attn_func(q, k, v[0])


def test_heads_not_divisible():
    q, k, v = qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match=r"Nh_q=3 must be a multiple of Nh_kv=2"):
        ffpa_attn_func(q, k, v, enable_gqa=True)


def test_gqa_requires_enable_gqa():
    q, k, v = qkv(hq=4, hkv=2)
    with pytest.raises(ValueError, match=r"Nh_q=4 != Nh_kv=2 with enable_gqa=False"):
        ffpa_attn_func(q, k, v)


def test_causal_needs_nkv_ge_nq():
    q, k, v = qkv(nq=32, nkv=16)
    with pytest.raises(ValueError, match=r"Nkv >= Nq.*Nq=32, Nkv=16"):
        ffpa_attn_func(q, k, v, is_causal=True)


def test_key_value_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key and value must share"):
        ffpa_attn_func(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="batch sizes differ"):
        ffpa_attn_func(q, k.expand(2, -1, -1, -1), v)
    with pytest.raises(ValueError, match="head dims differ"):
        ffpa_attn_func(q, k[..., :256], v)


def test_mask_that_does_not_broadcast():
    q, k, v = qkv(nq=16, nkv=24)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(16, 16\) does not broadcast"):
        ffpa_attn_func(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool or floating"):
        ffpa_attn_func(q, k, v, attn_mask=torch.ones(16, 24, dtype=torch.int32))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_range(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p must be in"):
        ffpa_attn_func(q, k, v, dropout_p=p)


def test_non_tensor_input():
    _, k, v = qkv()
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        ffpa_attn_func([1, 2], k, v)


# ------------------------------------------------------------------------------------------ kwargs


def test_unknown_kwarg_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'softcap'"):
        ffpa_attn_func(q, k, v, softcap=30.0)


def test_unknown_backend_name():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"backend='flash' is not a backend"):
        ffpa_attn_func(q, k, v, backend="flash")
    with pytest.raises(ValueError, match=r"forward_backend must be a str or a Backend"):
        ffpa_attn_func(q, k, v, forward_backend=3)


def test_bf16_with_acc_f16_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"acc='f16'.*fp16"):
        ffpa_attn_func(q, k, v, forward_backend=ffpa_attn.CUDABackend(acc="f16"))


def test_explicit_backend_that_cannot_run_raises_not_implemented():
    q, k, v = qkv()
    # no CUDA device here (or no CuTeDSL support for a mask): never a silent fallback
    with pytest.raises(NotImplementedError, match="cutedsl"):
        ffpa_attn_func(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool), backend="cutedsl")
    with pytest.raises(NotImplementedError, match="cuda"):
        ffpa_attn_func(q, k, v, dropout_p=0.1, forward_backend="cuda")


def test_dropout_across_backends_is_rejected_when_explicit():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="dropout"):
        ffpa_attn_func(q, k, v, dropout_p=0.2, forward_backend="sdpa", backward_backend="triton")


# ------------------------------------------------------------------------------------------ varlen


def _varlen(lens_q, lens_k=None, hq=2, hkv=2, d=320, dtype=torch.bfloat16):
    lens_k = lens_q if lens_k is None else lens_k
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d).to(dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d).to(dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d).to(dtype)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_varlen_sdpa_backend_matches_reference_with_lse():
    q, k, v, cu_q, cu_k, mq, mk = _varlen([5, 0, 17, 1], [9, 3, 17, 4])
    out, lse = ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, return_lse=True, backend="sdpa")
    ref, ref_lse = varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert_close(out, ref, torch.bfloat16)
    assert lse.shape == (2, q.shape[0]) and lse.dtype == torch.float32
    assert_close(lse, ref_lse, torch.float32, tol=1e-4)


def test_varlen_cu_seqlens_errors():
    q, k, v, cu_q, cu_k, mq, mk = _varlen([5, 7])
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        ffpa_attn_varlen_func(q, k, v, cu_q.long(), cu_k, mq, mk)
    with pytest.raises(ValueError, match="must start at 0"):
        ffpa_attn_varlen_func(q, k, v, cu_q + 1, cu_k, mq, mk)
    with pytest.raises(ValueError, match="non-decreasing"):
        ffpa_attn_varlen_func(q, k, v, torch.tensor([0, 9, 5, 12], dtype=torch.int32),
                              torch.tensor([0, 4, 8, 12], dtype=torch.int32), 9, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=12 must equal the packed length 11"):
        ffpa_attn_varlen_func(q, k[:11], v[:11], cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="same length B\\+1"):
        ffpa_attn_varlen_func(q, k, v, cu_q, torch.tensor([0, 12], dtype=torch.int32), mq, 12)
    with pytest.raises(ValueError, match="max_seqlen_q=3 is smaller than the longest sequence"):
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, 3, mk)


def test_varlen_kwargs():
    q, k, v, cu_q, cu_k, mq, mk = _varlen([4, 6])
    for key, val in [("window_size", (8, 0)), ("softcap", 30.0), ("alibi_slopes", torch.ones(2)),
                     ("num_splits", 4), ("attn_mask", torch.ones(1))]:
        with pytest.raises(NotImplementedError, match=key):
            ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **{key: val})
    for window in [(None, 0), (4, None), (-1, 0), 8]:
        with pytest.raises(NotImplementedError, match="window_size"):
            ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=window)
    # defaults are accepted: flash-attn 2's and flash-attn 4's spellings of "no window"
    for window in [(-1, -1), (None, None), [None, -1]]:
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, window_size=window, softcap=0.0, num_splits=1,
                              backend="sdpa")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, deterministic=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'determinstic'"):
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, determinstic=True)


def test_varlen_deterministic():
    """deterministic=True puts the Triton backward in its split mode (no atomics); False leaves the default."""
    q, k, v, cu_q, cu_k, mq, mk = _varlen([4, 6])
    q.requires_grad_()
    for flag in (True, False):
        pl = ffpa_attn.explain_varlen(q, k, v, cu_q, cu_k, mq, mk, deterministic=flag, backend="triton")
        assert pl.backward.backend == "triton" and pl.backward.config.deterministic is flag
        sdpa = ffpa_attn.explain_varlen(q, k, v, cu_q, cu_k, mq, mk, deterministic=flag, backend="sdpa")
        assert sdpa.backward.backend == "sdpa"
    ffpa_attn.ffpa_attn_varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, deterministic=True, window_size=(None, None),
                                   backend="sdpa")


def test_varlen_shape_and_gqa_errors():
    q, k, v, cu_q, cu_k, mq, mk = _varlen([4, 6], hq=4, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=False"):
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="must be 3-D"):
        ffpa_attn_varlen_func(q[None], k, v, cu_q, cu_k, mq, mk)
    with pytest.raises(TypeError, match="dtype"):
        ffpa_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, mq, mk, enable_gqa=True)


def test_varlen_causal_needs_nk_ge_nq_per_sequence():
    q, k, v, cu_q, cu_k, mq, mk = _varlen([4, 6], [4, 5])
    with pytest.raises(ValueError, match="sequence 1 has Nq=6, Nk=5"):
        ffpa_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)


def test_varlen_self_attention_when_cu_seqlens_k_is_none():
    q, k, v, cu_q, _, mq, _ = _varlen([3, 8, 2])
    out = ffpa_attn_varlen_func(q, k, v, cu_q, None, mq, None, causal=True, backend="sdpa")
    ref, _ = varlen_attention(q, k, v, cu_q, cu_q, causal=True)
    assert_close(out, ref, torch.bfloat16)


# ------------------------------------------------------------------------------------------ low level


def test_low_level_shape_checks():
    q, k, v = qkv()
    out, lse = ffpa_attn.ffpa_attn_fwd(q, k, v, backend="sdpa")
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 16\)"):
        ffpa_attn.ffpa_attn_bwd(out, q, k, v, out, lse[..., :8], backend="sdpa")
    with pytest.raises(TypeError, match="lse must be float32"):
        ffpa_attn.ffpa_attn_bwd(out, q, k, v, out, lse.double(), backend="sdpa")
    with pytest.raises(ValueError, match=r"dout must have shape"):
        ffpa_attn.ffpa_attn_bwd(out[:, :1], q, k, v, out, lse, backend="sdpa")


def test_varlen_boundaries_read_once_per_unchanged_tensor(monkeypatch):
    """The same boundary tensors with the same scalars are read on the host once (a model passes one cu_seqlens to
    every layer; each read is a device sync); another tensor, other scalars, an in-place change or an inference
    tensor (no version counter) is read again, so a changed boundary is still caught."""
    from ffpa_attn import contract

    reads = []
    real = contract._check_varlen_values
    monkeypatch.setattr(contract, "_check_varlen_values", lambda *a: (reads.append(a), real(*a))[1])
    monkeypatch.setattr(contract, "_CHECKED_BOUNDARIES", [])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    for _ in range(3):
        contract.check_varlen_values(cu, cu, 7, 7, 4, 4, True)
    assert len(reads) == 1
    contract.check_varlen_values(cu, cu, 7, 7, 4, 4, False)  # other scalars
    contract.check_varlen_values(cu.clone(), cu, 7, 7, 4, 4, True)  # another object, same values
    assert len(reads) == 3
    cu[1] = 5  # in place: sequence 1 now has 2 rows, sequence 0 five (> max_seqlen 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        contract.check_varlen_values(cu, cu, 7, 7, 4, 4, True)
    with torch.inference_mode():
        inf = torch.tensor([0, 3, 7], dtype=torch.int32)
    n = len(reads)
    contract.check_varlen_values(inf, inf, 7, 7, 4, 4, True)
    contract.check_varlen_values(inf, inf, 7, 7, 4, 4, True)
    assert len(reads) == n + 2


# ------------------------------------------------------------------------------------------ messages


def test_flash_layout_gets_a_transpose_hint():
    """[B, N, H, D] inputs with Nq != Nkv fail the head-count check; the message says which layout is expected, and
    the transposed call is exact."""
    q, k, v = qkv(hq=2, hkv=2, nq=16, nkv=24)
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash-attn's [B, N, H, D]
    with pytest.raises(ValueError, match=r"num_heads.*did you pass \[B, N, H, D\].*\.transpose\(1, 2\)"):
        ffpa_attn_func(qf, kf, vf)
    q2, k2, v2 = qkv(hq=2, hkv=2, nq=48, nkv=24)
    with pytest.raises(ValueError, match=r"enable_gqa=False.*did you pass \[B, N, H, D\]"):
        ffpa_attn_func(*(t.transpose(1, 2).contiguous() for t in (q2, k2, v2)))
    out = ffpa_attn_func(*(t.transpose(1, 2) for t in (qf, kf, vf)))
    assert_close(out, attention(q, k, v, dtype=torch.float64)[0], torch.bfloat16)


def test_no_layout_hint_for_wrong_head_counts_in_the_right_layout():
    q, k, v = qkv(hq=3, hkv=2, nq=16, nkv=16)
    with pytest.raises(ValueError) as exc:
        ffpa_attn_func(q, k, v, enable_gqa=True)
    assert "num_heads" in str(exc.value) and "did you pass" not in str(exc.value)


def test_messages_use_the_public_packages_words_too():
    """Callers of the public ffpa-attn match its words ("seqlen", "num_heads"); ours name both."""
    q, k, v = qkv(hq=2, hkv=2, nq=16, nkv=16)
    with pytest.raises(ValueError, match="seqlen") as exc:
        ffpa_attn_func(q, k, torch.cat([v, v], dim=2))  # value longer than key
    assert "Nkv" in str(exc.value)
    q, k, v = qkv(hq=12, hkv=8)
    with pytest.raises(ValueError, match="num_heads") as exc:
        ffpa_attn_func(q, k, v)
    assert "Nh_q=12" in str(exc.value)
    q, k, v = qkv(hq=16, hkv=4)
    with pytest.raises(ValueError, match="num_heads"):
        ffpa_attn_func(q, k, v[:, :2])  # key and value head counts differ
    q, k, v = qkv(nq=32, nkv=16)
    with pytest.raises(ValueError, match=r"is_causal.*seqlen"):
        ffpa_attn_func(q, k, v, is_causal=True)
    qv = torch.randn(10, 6, 320, dtype=torch.bfloat16)
    kv = torch.randn(10, 4, 320, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"H_q=6.*num_heads"):
        ffpa_attn_varlen_func(qv, kv, kv, cu, cu, 10, 10, enable_gqa=True)


def test_cuda_backend_takes_the_public_packages_quantization_fields():
    """CUDABackend(enable_fp8=..., enable_fp4=...) (the public package's sm120 options): False is accepted and
    changes nothing; True raises NotImplementedError naming the option, when the config is built."""
    b = ffpa_attn.CUDABackend(enable_fp8=False, enable_fp4=False)
    assert b == ffpa_attn.CUDABackend()
    for field, what in (("enable_fp8", "FP8"), ("enable_fp4", "NVFP4")):
        with pytest.raises(NotImplementedError, match=rf"CUDABackend\({field}=True\).*no {what} attention kernel"):
            ffpa_attn.CUDABackend(forward=True, backward=False, **{field: True})
        with pytest.raises(ValueError, match=field):
            ffpa_attn.CUDABackend(**{field: 1})


# ------------------------------------------------------------------------------ deliberate differences


def _readme_differences() -> str:
    from pathlib import Path

    readme = (Path(ffpa_attn.__file__).resolve().parents[1] / "README.md").read_text()
    return readme[readme.index("Deliberate differences:"):readme.index("## Environment variables")]


def test_mask_floor_difference_is_the_documented_one():
    """A row masked everywhere by fp16's finfo.min: torch SDPA adds the constant (the row's softmax stays the
    unmasked one); here every entry <= -16384 counts as masked, so the row is uniform (the mean of V). README's
    differences table says so."""
    q, k, v = qkv(hq=1, hkv=1, nq=4, nkv=8, dtype=torch.float16)
    mask = torch.zeros(4, 8, dtype=torch.float16)
    mask[1] = torch.finfo(torch.float16).min
    out = ffpa_attn_func(q, k, v, attn_mask=mask, backend="triton")
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    unmasked, _ = attention(q, k, v, dtype=torch.float64)
    assert_close(out[:, :, 1:2], v.double().mean(2, keepdim=True), torch.float16)
    assert_close(sdpa[:, :, 1:2], unmasked[:, :, 1:2], torch.float16)
    assert ffpa_attn.contract.MASK_FLOOR == -2.0 ** 14
    assert "finfo.min" in _readme_differences() and "mean of V" in _readme_differences()


def test_cuda_backward_backend_is_a_value_error_as_documented():
    """The public package asserts (AssertionError) where a backend without a backward is named for it; here it is
    the ValueError of every invalid backend config, listed in README's differences table."""
    q, k, v = qkv()
    with pytest.raises(ValueError, match="backward_backend"):
        ffpa_attn_func(q, k, v, forward_backend="triton", backward_backend="cuda")
    with pytest.raises(ValueError, match="no backward kernel"):
        ffpa_attn.CUDABackend(backward=True)
    assert "AssertionError" in _readme_differences() and "enable_fp8" in _readme_differences()

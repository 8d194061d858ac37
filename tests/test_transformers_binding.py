"""The transformers binding (attn_implementation="ffpa") on CPU: kernels under the Triton interpreter.

Two layers of tests:
* the attention function and mask factory called directly, every routing path against the fp32 reference
  (forward and gradients), with a spy proving which FFPA entry point ran;
* tiny real models built from configs (random weights, no downloads): a Gemma-4-style model (sliding
  head_dim-256 layers + full head_dim-512 GQA layers, scaling 1.0) and a Llama-style model with head_dim 320,
  whose logits / loss gradients / generate() logits with "ffpa" must be as close to an fp32 eager oracle as
  twice the error of transformers' own "sdpa" in the same dtype (docs/design.md, "Errors and tolerances").
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ffpa_attn.integrations import transformers as hf  # noqa: E402
from ffpa_attn.reference import varlen_attention  # noqa: E402
from ffpa_attn.testing import (EntryPointSpy, assert_close, assert_fwd_bwd_close, assert_grads_close,  # noqa: E402
                               make_qkv, reference_bshd, rel_err, tiny_llama)

mu = transformers.masking_utils


@pytest.fixture(scope="module", autouse=True)
def _registered(hf_registered):
    """Every test of this module runs with ``attn_implementation="ffpa"`` registered."""


@pytest.fixture
def spy(monkeypatch):
    return EntryPointSpy(monkeypatch)


class FakeAttention(torch.nn.Module):
    """What transformers' attention functions read from a module."""

    def __init__(self, hq=4, hkv=2, d=512, causal=True):
        super().__init__()
        self.is_causal = causal
        self.num_key_value_groups = hq // hkv
        self.head_dim = d
        self.training = False


# ------------------------------------------------------------------------------------- registration


def test_register_is_idempotent_and_fills_both_registries():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert hf.register_ffpa_attention() and hf.register_ffpa_attention()
    assert ALL_ATTENTION_FUNCTIONS["ffpa"] is hf.ffpa_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["ffpa"] is hf.ffpa_mask
    # class-level: a fresh interface instance sees it too
    assert transformers.AttentionInterface()["ffpa"] is hf.ffpa_attention_forward
    hf.unregister_ffpa_attention()
    assert "ffpa" not in ALL_ATTENTION_FUNCTIONS and "ffpa" not in ALL_MASK_ATTENTION_FUNCTIONS
    assert hf.register_ffpa_attention()
    assert "ffpa" in ALL_ATTENTION_FUNCTIONS and "ffpa" in ALL_MASK_ATTENTION_FUNCTIONS


def test_setup_validates_then_registers():
    hf.unregister_ffpa_attention()
    with pytest.raises(ValueError, match="ring_attn_func"):
        hf.setup_ffpa_backend(cp_size=2, has_packed_sequence=False)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        hf.setup_ffpa_backend(cp_size=0, has_packed_sequence=False)
    with pytest.raises(TypeError, match="has_packed_sequence"):
        hf.setup_ffpa_backend(cp_size=1, has_packed_sequence="yes")
    with pytest.raises(TypeError, match="cp_size"):
        hf.setup_ffpa_backend(cp_size=1.0, has_packed_sequence=True)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "ffpa" not in ALL_ATTENTION_FUNCTIONS
    hf.setup_ffpa_backend(cp_size=1, has_packed_sequence=True)
    assert ALL_ATTENTION_FUNCTIONS["ffpa"] is hf.ffpa_attention_forward


def test_importing_ffpa_attn_does_not_import_transformers():
    code = ("import sys, ffpa_attn, ffpa_attn.integrations, ffpa_attn.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------- mask factory


def _factory(**kw):
    kw.setdefault("batch_size", 2)
    kw.setdefault("device", "cpu")
    return hf.ffpa_mask(**kw)


def test_mask_plain_causal_and_padding():
    assert _factory(q_length=8, kv_length=8) is None
    assert _factory(q_length=1, kv_length=9, q_offset=8) is None  # decode step, tail-aligned
    assert _factory(q_length=3, kv_length=9, q_offset=6) is None  # chunked prefill with a cache
    ones = torch.ones(2, 9, dtype=torch.bool)
    assert _factory(q_length=1, kv_length=9, q_offset=8, attention_mask=ones) is None
    pad = ones.clone()
    pad[0, :3] = False
    got = _factory(q_length=1, kv_length=9, q_offset=8, attention_mask=pad)
    assert got.dtype == torch.bool and torch.equal(got, pad)
    # the KV window of a sliding cache layer: the mask is sliced to it
    pad[1, 6] = False
    got = _factory(q_length=1, kv_length=4, q_offset=8, kv_offset=5, attention_mask=pad,
                   mask_function=mu.sliding_window_causal_mask_function(6), local_size=6)
    assert torch.equal(got, pad[:, 5:9])
    assert _factory(q_length=5, kv_length=7, mask_function=mu.bidirectional_mask_function) is None


@pytest.mark.parametrize("case", ["sliding", "static_cache", "overlay"])
def test_mask_other_patterns_are_exact(case):
    """Patterns beyond None / 2D padding come back as the exact 4D mask on CPU (BlockMask on CUDA)."""
    kw = dict(q_length=12, kv_length=12)
    if case == "sliding":
        kw.update(mask_function=mu.sliding_window_causal_mask_function(4), local_size=4)
    elif case == "static_cache":  # KV buffer longer than what was written: tail alignment would be wrong
        kw.update(q_length=3, kv_length=16, q_offset=5)
    else:
        kw.update(mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: (q < 4) & (k < 4)),
                  allow_is_causal_skip=False, use_vmap=True)
    got = _factory(**kw)
    want = mu.sdpa_mask(batch_size=2, allow_is_causal_skip=False, device="cpu", **{
        k: v for k, v in kw.items() if k not in ("local_size", "allow_is_causal_skip")})
    assert got.shape == (2, 1, kw["q_length"], kw["kv_length"]) and torch.equal(got, want)
    assert hf._PACKED_MASKS.get(got) is None


def test_mask_packed_sequences_are_recognized():
    pos = torch.cat([torch.arange(n) for n in (3, 5, 4)])[None].expand(2, -1)
    psm = mu.find_packed_sequence_indices(pos)
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(psm))
    got = _factory(q_length=12, kv_length=12, mask_function=fn, allow_is_causal_skip=False)
    packed = hf._PACKED_MASKS.get(got)
    assert packed is not None
    assert packed.cu_q.tolist() == [0, 3, 8, 12, 15, 20, 24] and packed.max_q == 5
    # one sequence per row through a non-trivial mask function is plain causal
    fn = mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0)
    assert _factory(q_length=12, kv_length=12, mask_function=fn, allow_is_causal_skip=False, use_vmap=True) is None


# ------------------------------------------------------------------------ the attention function


@pytest.mark.parametrize("scaling", [1.0, None])
def test_dense_causal_gqa_forward_backward(spy, scaling):
    q, k, v = make_qkv(1, 4, 2, 32, 32, 512, torch.bfloat16, layout="bnhd", requires_grad=True)
    if scaling == 1.0:  # keep scores O(1) at scale 1.0 (as a trained model's q/k norms do)
        q, k = (t.detach().mul(0.05).requires_grad_() for t in (q, k))
    out, weights = hf.ffpa_attention_forward(FakeAttention(), q, k, v, None, scaling=scaling)
    assert weights is None and out.shape == (1, 32, 4, 512)
    ref = reference_bshd(q, k, v, is_causal=True, scale=scaling)
    assert_close(out, ref, torch.bfloat16)
    if scaling == 1.0:
        assert_fwd_bwd_close(out, ref, (q, k, v), torch.bfloat16)
    assert spy.dense == [(512, 32, False, True)] and not spy.varlen


@pytest.mark.parametrize("nq", [1, 5])
def test_cached_step_is_tail_aligned(spy, nq):
    """A decode step (Nq=1) sees the whole cache; a chunk sees the cache plus its causal prefix."""
    q, k, v = make_qkv(2, 2, 1, nq, 37, 512, torch.bfloat16)
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 1), q, k, v, None)
    ref = reference_bshd(q, k, v, is_causal=True)
    assert_close(out, ref, torch.bfloat16)
    if nq == 1:
        assert_close(out, reference_bshd(q, k, v, is_causal=False), torch.bfloat16)
    assert spy.dense == [(512, nq, False, True)]


def test_padding_mask_prefill_unpads_to_varlen(spy):
    b, s = 3, 20
    q, k, v = make_qkv(b, 2, 1, s, s, 512, torch.float16, layout="bnhd", requires_grad=True)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, :5] = False  # left padding
    keep[1, 17:] = False  # right padding
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 1), q, k, v, keep)
    ref = reference_bshd(q, k, v, attn_mask=keep[:, None, None, :], is_causal=True)
    assert_close(out[keep], ref[keep], torch.float16)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))  # padded rows: 0, never NaN
    w = torch.randn_like(ref) * keep[:, :, None, None]  # padded rows' outputs are ignored
    kk = keep[:, None, :, None]  # and so are their gradients
    grads, ref_grads = (torch.autograd.grad((o.float() * w).sum(), (q, k, v)) for o in (out, ref))
    assert_grads_close([g * kk for g in grads], [r * kk for r in ref_grads], torch.float16)
    assert spy.varlen == [(512, b)] and not spy.dense


def test_padding_mask_decode_uses_dense_key_mask(spy):
    q, k, v = make_qkv(2, 2, 1, 1, 30, 512, torch.bfloat16)
    keep = torch.ones(2, 30, dtype=torch.bool)
    keep[1, :11] = False
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 1), q, k, v, keep)
    assert_close(out, reference_bshd(q, k, v, attn_mask=keep[:, None, None, :]), torch.bfloat16)
    assert spy.dense == [(512, 1, True, True)] and not spy.varlen


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens", "factory_mask"])
def test_packed_sequences_run_varlen(spy, how):
    lens = [7, 12, 5]
    s = sum(lens)
    q, k, v = make_qkv(1, 2, 1, s, s, 512, torch.bfloat16, layout="bnhd", requires_grad=True)
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    kwargs, mask = {}, None
    if how == "position_ids":
        kwargs = {"position_ids": pos}
    elif how == "cu_seq_lens":
        kwargs = {"cu_seq_lens_q": cu.long(), "cu_seq_lens_k": cu.long(), "max_length_q": 12, "max_length_k": 12,
                  "position_ids": torch.arange(s)[None]}
    else:
        psm = mu.find_packed_sequence_indices(pos)
        fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(psm))
        mask = hf.ffpa_mask(1, s, s, mask_function=fn, allow_is_causal_skip=False, device="cpu")
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 1), q, k, v, mask, scaling=0.05, **kwargs)
    tok = lambda t: t[0].transpose(0, 1).float()  # noqa: E731
    ref, _ = varlen_attention(tok(q), tok(k), tok(v), cu, causal=True, softmax_scale=0.05)
    ref = ref.unsqueeze(0)
    assert_close(out, ref, torch.bfloat16)
    if how == "position_ids":
        assert_fwd_bwd_close(out, ref, (q, k, v), torch.bfloat16)
    assert spy.varlen == [(512, 3)] and not spy.dense


def test_position_ids_without_restart_are_one_sequence(spy):
    q, k, v = make_qkv(1, 2, 2, 20, 20, 512, torch.bfloat16)
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 2), q, k, v, None, position_ids=torch.arange(3, 23)[None])
    assert_close(out, reference_bshd(q, k, v, is_causal=True), torch.bfloat16)
    assert spy.dense == [(512, 20, False, True)]


def test_block_mask_and_4d_mask_on_ffpa_layers_are_exact(spy):
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = make_qkv(2, 2, 1, 24, 24, 512, torch.bfloat16)
    sliding = mu.sliding_window_causal_mask_function(6)
    bm = create_block_mask(sliding, 2, None, 24, 24, device="cpu", _compile=False)
    dense = mu.sdpa_mask(batch_size=2, q_length=24, kv_length=24, mask_function=sliding,
                         allow_is_causal_skip=False, device="cpu")
    ref = reference_bshd(q, k, v, attn_mask=dense)
    for mask in (bm, dense):
        out, _ = hf.ffpa_attention_forward(FakeAttention(2, 1), q, k, v, mask)
        assert_close(out, ref, torch.bfloat16)
    assert spy.dense == [(512, 24, True, False)] * 2


def test_sliding_window_kwarg_is_honoured(spy):
    q, k, v = make_qkv(1, 2, 2, 1, 30, 512, torch.bfloat16)
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 2), q, k, v, None, sliding_window=8)
    visible = torch.zeros(1, 30, dtype=torch.bool)
    visible[:, 22:] = True  # the decode token at position 29 sees 22..29
    assert_close(out, reference_bshd(q, k, v, attn_mask=visible), torch.bfloat16)


def test_non_causal_module_and_is_causal_kwarg(spy):
    q, k, v = make_qkv(1, 2, 2, 16, 16, 512, torch.bfloat16)
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 2, causal=False), q, k, v, None)
    assert_close(out, reference_bshd(q, k, v), torch.bfloat16)
    out, _ = hf.ffpa_attention_forward(FakeAttention(2, 2, causal=False), q, k, v, None, is_causal=True)
    assert_close(out, reference_bshd(q, k, v, is_causal=True), torch.bfloat16)


@pytest.mark.parametrize("case", ["head_dim", "dtype"])
def test_fallbacks_to_sdpa_warn_once_and_are_exact(spy, monkeypatch, case):
    monkeypatch.setattr(hf, "_FALLBACK_WARNED", set())
    d, dtype = (128, torch.bfloat16) if case == "head_dim" else (512, torch.float32)
    q, k, v = make_qkv(2, 4, 2, 12, 12, d, dtype)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, :3] = False
    ref = reference_bshd(q, k, v, attn_mask=keep[:, None, None, :], is_causal=True)
    with pytest.warns(hf.FFPAFallbackWarning, match="head_dim=128" if case == "head_dim" else "float32"):
        out, _ = hf.ffpa_attention_forward(FakeAttention(), q, k, v, keep)
    assert_close(out[keep], ref[keep], dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = hf.ffpa_attention_forward(FakeAttention(), q, k, v, None)  # same reason: silent
    assert_close(out, reference_bshd(q, k, v, is_causal=True), dtype)
    assert not spy.dense and not spy.varlen


def test_softcap_and_output_attentions_go_to_eager(spy, monkeypatch):
    monkeypatch.setattr(hf, "_FALLBACK_WARNED", set())
    q, k, v = make_qkv(2, 4, 2, 10, 10, 512, torch.float32)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.warns(hf.FFPAFallbackWarning, match="softcap"):
        out, _ = hf.ffpa_attention_forward(FakeAttention(), q, k, v, None, scaling=0.2, softcap=5.0)
    # reference with a tanh cap: scores' = 5 tanh(s / 5)
    kf, vf = (t.float().repeat_interleave(2, 1) for t in (k, v))
    s = q.float() @ kf.transpose(-1, -2) * 0.2
    s = 5.0 * torch.tanh(s / 5.0) + torch.zeros(10, 10).masked_fill(~torch.ones(10, 10).tril().bool(), -1e30)
    assert_close(out, (s.softmax(-1) @ vf).transpose(1, 2), torch.bfloat16)
    with pytest.warns(hf.FFPAFallbackWarning, match="output_attentions"):
        out, probs = hf.ffpa_attention_forward(FakeAttention(), q, k, v, None, output_attentions=True)
    assert probs.shape == (2, 4, 10, 10) and bool((probs.triu(1) == 0).all())
    assert_close(out, reference_bshd(q, k, v, is_causal=True), torch.bfloat16)
    assert not spy.dense and not spy.varlen


# ------------------------------------------------------------------------------------- tiny models


def _gemma4(attn: str):
    cfg = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
        attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        vocab_size_per_layer_input=64, hidden_size_per_layer_input=8, pad_token_id=0, attn_implementation=attn)
    return transformers.Gemma4ForCausalLM(cfg)


# (build, dtype, #ffpa layers)
MODELS = {"gemma4": (_gemma4, torch.bfloat16, 1), "llama": (tiny_llama, torch.float16, 2)}


def _condition(model):
    """Random q/k norms of 1 make Gemma 4's scale-1.0 scores ~sqrt(D) wide (argmax-like softmax, where any
    rounding flips the pattern); a trained model's are O(1). Scale them down so the comparison means something."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name, None) is not None:
                getattr(attn, name).weight.data.fill_(0.3)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def models(request):
    build, dtype, n_ffpa = MODELS[request.param]
    assert hf.register_ffpa_attention()
    torch.manual_seed(1234)
    ref = _condition(build("eager")).eval()
    state = ref.state_dict()

    def make(attn):
        m = build(attn)
        m.load_state_dict(state)
        return m.to(dtype).eval()

    return {"kind": request.param, "ref": ref, "ffpa": make("ffpa"), "sdpa": make("sdpa"), "dtype": dtype,
            "n_ffpa": n_ffpa}


def _loss_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    names = [n for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None]
    grads = torch.cat([dict(model.named_parameters())[n].grad.float().reshape(-1) for n in names])
    return out.logits.detach().float(), grads


def _check(models, what, ffpa, sdpa, ref):
    """ffpa's model result within the tolerance of the fp32 eager oracle's, or 2x transformers' "sdpa"'s error."""
    err = assert_close(ffpa, ref, models["dtype"], name=f"{models['kind']} {what}", baseline=sdpa)
    assert err < 0.5, f"{what}: ffpa error {err:.3e} (sdpa {rel_err(sdpa, ref):.3e})"


def test_model_logits_and_loss_grads(models, spy):
    ids = torch.randint(3, 64, (1, 32))
    labels = ids.clone()
    ref = _loss_grads(models["ref"], input_ids=ids, labels=labels, use_cache=False)
    sdpa = _loss_grads(models["sdpa"], input_ids=ids, labels=labels, use_cache=False)
    spy.dense.clear()
    ffpa = _loss_grads(models["ffpa"], input_ids=ids, labels=labels, use_cache=False)
    _check(models, "logits", ffpa[0], sdpa[0], ref[0])
    _check(models, "attention weight grads", ffpa[1], sdpa[1], ref[1])
    d = 512 if models["kind"] == "gemma4" else 320
    assert spy.dense == [(d, 32, False, True)] * models["n_ffpa"]


def test_model_padding_batch(models, spy):
    ids = torch.randint(3, 64, (2, 24))
    am = torch.ones(2, 24, dtype=torch.long)
    am[0, :7] = 0  # left padding
    am[1, 19:] = 0  # right padding
    labels = ids.masked_fill(am == 0, -100)
    inputs = dict(input_ids=ids, attention_mask=am, labels=labels, use_cache=False)
    ref, sdpa = _loss_grads(models["ref"], **inputs), _loss_grads(models["sdpa"], **inputs)
    ffpa = _loss_grads(models["ffpa"], **inputs)
    keep = am.bool()
    _check(models, "padded logits", ffpa[0][keep], sdpa[0][keep], ref[0][keep])
    _check(models, "padded grads", ffpa[1], sdpa[1], ref[1])
    assert len(spy.varlen) == models["n_ffpa"] and not spy.dense


def test_model_packed_batch(models, spy):
    lens = (9, 13, 6)
    ids = torch.randint(3, 64, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[0, [0, 9, 22]] = -100  # no prediction across a sequence boundary
    inputs = dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    sdpa = _loss_grads(models["sdpa"], **inputs)
    ffpa = _loss_grads(models["ffpa"], **inputs)
    # oracle: each sequence on its own
    starts = [0, 9, 22, 28]
    with torch.no_grad():
        ref_logits = torch.cat([models["ref"](input_ids=ids[:, a:b], use_cache=False).logits
                                for a, b in zip(starts[:-1], starts[1:])], dim=1)
    ref = _loss_grads(models["ref"], **inputs)
    assert_close(ref[0], ref_logits, torch.float32, tol=1e-4, name="eager packing")
    _check(models, "packed logits", ffpa[0], sdpa[0], ref_logits)
    _check(models, "packed grads", ffpa[1], sdpa[1], ref[1])
    assert spy.varlen == [(512 if models["kind"] == "gemma4" else 320, 3)] * models["n_ffpa"]
    assert not [c for c in spy.dense if c[0] > 256]


def test_model_generate_with_cache(models, spy):
    """Greedy generate (left-padded batch, KV cache): each step's logits vs an fp32 pass over the sequence."""
    ids = torch.randint(3, 64, (2, 12))
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0
    new = 3
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        g = models["ffpa"].generate(input_ids=ids, attention_mask=am, **gen)
        s = models["sdpa"].generate(input_ids=ids, attention_mask=am, **gen)

        def oracle(seq):
            full = torch.cat([am, torch.ones(2, new, dtype=torch.long)], dim=1)
            pos = (full.cumsum(-1) - 1).clamp(min=0)
            return models["ref"](input_ids=seq, attention_mask=full, position_ids=pos).logits[:, 11:-1]

        got, ref = torch.stack(g.logits, 1).float(), oracle(g.sequences)
        base = rel_err(torch.stack(s.logits, 1).float(), oracle(s.sequences))
    assert_close(got, ref, models["dtype"], name="generate logits", baseline=base)
    d = 512 if models["kind"] == "gemma4" else 320
    decode = [c for c in spy.dense if c[0] == d and c[1] == 1]
    assert len(decode) == (new - 1) * models["n_ffpa"]  # every decode step of every FFPA layer
    assert all(has_mask and causal for _, _, has_mask, causal in decode)  # key padding + tail-aligned causal
    assert len(spy.varlen) == models["n_ffpa"]  # the padded prefill

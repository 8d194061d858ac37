"""The transformers binding's KV-cache paths on CPU (Triton interpreter): a tiny Gemma-3-style model (head_dim 512,
a sliding-window layer and a full layer, GQA) generating greedily with a StaticCache (``attn_implementation="ffpa"``:
the full layer reads the static buffer through ``ffpa_attn_with_kvcache``) and with continuous batching
(``generate_batch`` under ``ffpa_for_sdpa``: the full layer runs each step's packed requests as varlen FFPA), against
transformers' "sdpa" (same tokens, logits / log-probabilities within bf16 tolerance of an fp32 oracle); transformers'
paged decode keywords (block table, interleaved K/V page views) against the KV-cache reference; the static-window
recognition of the mask factory.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ffpa_attn  # noqa: E402
from ffpa_attn.integrations import transformers as hf  # noqa: E402
from ffpa_attn.testing import TOL, assert_close, assert_kvcache_matches, make_kvcache, rel_err  # noqa: E402

BF16 = torch.bfloat16
mu = transformers.masking_utils


@pytest.fixture(scope="module", autouse=True)
def _registered(hf_registered):
    """Every test of this module runs with ``attn_implementation="ffpa"`` registered."""


class Calls:
    """Which FFPA entry points ran (names, in order)."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        for name in ("ffpa_attn_func", "ffpa_attn_varlen_func", "ffpa_attn_with_kvcache"):
            real = getattr(ffpa_attn, name)

            def spy(*a, _real=real, _name=name, **kw):
                self.names.append(_name)
                return _real(*a, **kw)

            monkeypatch.setattr(ffpa_attn, name, spy)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


def _gemma3(attn: str):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=512, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        pad_token_id=0, attn_implementation=attn)
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def models():
    """fp32 eager oracle, and bf16 copies with the same weights (q/k norms scaled down: random norms of 1 make the
    head_dim-512 scores argmax-like, where any rounding flips the pattern)."""
    torch.manual_seed(1234)
    ref = _gemma3("eager")
    for layer in ref.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(0.3)
        layer.self_attn.k_norm.weight.data.fill_(0.3)
    ref = ref.eval()
    state = ref.state_dict()

    def make(attn):
        m = _gemma3(attn)
        m.load_state_dict(state)
        return m.to(BF16).eval()

    return {"ref": ref, "ffpa": make("ffpa"), "sdpa": make("sdpa")}


def test_static_cache_generate_reads_the_buffer_in_place(models, calls):
    """Greedy generation with a StaticCache and a left-padded batch: the full layer's prefill and every decode step
    run ffpa_attn_with_kvcache (cache_seqlens = the step's end, cache_leftpad = the padding); the tokens equal
    "sdpa"'s and every step's logits are as close to an fp32 pass over the sequence as twice "sdpa"'s error."""
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    am = (torch.arange(8) >= 3).long().expand(2, 8).clone()
    am[1] = 1
    new = 8
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)

    def static():  # room to spare: every step leaves unused slots at the end of the buffer
        return transformers.StaticCache(config=models["ffpa"].config, max_cache_len=32)

    with torch.no_grad():
        s = models["sdpa"].generate(input_ids=ids, attention_mask=am, cache=static(), **gen)
        calls.names.clear()
        f = models["ffpa"].generate(input_ids=ids, attention_mask=am, cache=static(), **gen)

        def oracle(seq):
            full = torch.cat([am, torch.ones(2, new, dtype=torch.long)], dim=1)
            pos = (full.cumsum(-1) - 1).clamp(min=0)
            return models["ref"](input_ids=seq, attention_mask=full, position_ids=pos).logits[:, 7:-1]

        got, ref = torch.stack(f.logits, 1).float(), oracle(f.sequences)
        base = rel_err(torch.stack(s.logits, 1).float(), oracle(s.sequences))
    assert torch.equal(f.sequences, s.sequences)
    assert_close(got, ref, BF16, name="static-cache logits", baseline=base, tol=TOL[BF16])
    assert calls.names.count("ffpa_attn_with_kvcache") == new, calls.names  # prefill and decode steps, full layer
    assert "ffpa_attn_func" in calls.names  # the sliding layer: its window mask on the dense FFPA forward


def test_continuous_batching_runs_varlen_ffpa(models, calls):
    """generate_batch (paged cache, index-based reads) with the model's "sdpa" run through ffpa_for_sdpa: the same
    tokens as transformers' own "sdpa" and log-probabilities within bf16 tolerance; the full layer ran every step
    (prefill and decode) as varlen FFPA over the requests' boundaries."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    def cb_config():  # a small cache (the default sizes it from the machine's memory)
        return ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64, max_requests_per_batch=4,
                                        return_logprobs=True)

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46]]
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        want = models["sdpa"].generate_batch(inputs=prompts, generation_config=gen,
                                             continuous_batching_config=cb_config())
        calls.names.clear()
        with hf.ffpa_for_sdpa():
            got = models["sdpa"].generate_batch(inputs=prompts, generation_config=gen,
                                                continuous_batching_config=cb_config())
    assert sorted(got) == sorted(want)
    for rid in want:
        assert got[rid].generated_tokens == want[rid].generated_tokens, rid
        lp, lp_want = torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs)
        assert (lp - lp_want).abs().max().item() < 2e-2, (rid, lp, lp_want)
    assert calls.names.count("ffpa_attn_varlen_func") >= 8  # one per step at least
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward  # restored


def test_ffpa_for_sdpa_restores_on_error():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    before = (AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"])
    with pytest.raises(RuntimeError, match="boom"):
        with hf.ffpa_for_sdpa():
            assert AttentionInterface._global_mapping["sdpa"] is hf.ffpa_attention_forward
            raise RuntimeError("boom")
    assert (AttentionInterface._global_mapping["sdpa"], AttentionMaskInterface._global_mapping["sdpa"]) == before


@pytest.mark.parametrize("page", [16, 32])
def test_paged_decode_keywords(calls, device, page):
    """What transformers' paged decode step passes its flash path: one new token per request ([1, H, T, D]
    query / key / value), interleaved K/V page views, a block table with -1 past each request's pages, cu_seq_lens_k
    counting the new token; the new tokens are appended and attended in one ffpa_attn_with_kvcache call."""
    lens = [0, 15, 16, 40]
    case = make_kvcache(lens, 1, 512, BF16, page_size=page, capacity=64, n_new=1, interleaved=True, device=device)
    n = len(lens)
    q = torch.randn(1, 2, n, 512, device=device).to(BF16)
    k = torch.randn(1, 1, n, 512, device=device).to(BF16)
    v = torch.randn(1, 1, n, 512, device=device).to(BF16)
    cu_k = torch.tensor([0] + torch.tensor(lens).add(1).cumsum(0).tolist(), dtype=torch.int32, device=device)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    before = (case.k_cache.clone(), case.v_cache.clone())
    out, _ = hf.ffpa_attention_forward(
        module, q, k, v, None, scaling=0.05, block_table=case.block_table, k_cache=case.k_cache,
        v_cache=case.v_cache, cu_seq_lens_k=cu_k, cu_seq_lens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
        max_length_q=1, max_length_k=1)
    assert calls.names == ["ffpa_attn_with_kvcache"] and out.shape == (1, n, 2, 512)
    flash_q = q.transpose(1, 2).reshape(n, 1, 2, 512)
    new_k, new_v = (x.transpose(1, 2).reshape(n, 1, 1, 512) for x in (k, v))
    assert_kvcache_matches(out.view(n, 1, 2, 512), None, flash_q, case, *before, new_k, new_v, causal=True,
                           softmax_scale=0.05)


def test_mask_factory_recognizes_the_static_window():
    """A causal step over a 32-slot buffer at offset 6 (2 queries): the exact mask, remembered with each sequence's
    slots; left padding gives cache_leftpad; a hole in the padding, an overlay or a sliding window do not qualify."""
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, :3] = False
    mask = hf.ffpa_mask(2, 2, 32, q_offset=torch.tensor(6), kv_offset=0, mask_function=mu.causal_mask_function,
                        attention_mask=keep)
    assert mask.shape == (2, 1, 2, 32) and not bool(mask[:, :, :, 8:].any())
    window = hf._CACHE_WINDOWS.get(mask)
    assert window.seqlens.tolist() == [8, 8] and window.leftpad.tolist() == [3, 0]
    holed = keep.clone()
    holed[1, 4] = False
    mask = hf.ffpa_mask(2, 2, 32, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function,
                        attention_mask=holed)
    assert hf._CACHE_WINDOWS.get(mask) is None
    mask = hf.ffpa_mask(2, 2, 32, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function, local_size=4)
    assert hf._CACHE_WINDOWS.get(mask) is None
    mask = hf.ffpa_mask(2, 2, 32, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function)
    assert hf._CACHE_WINDOWS.get(mask).leftpad is None
    with torch.inference_mode():  # transformers' pipelines generate in inference mode (tensors without versions)
        mask = hf.ffpa_mask(2, 2, 32, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function,
                            attention_mask=keep)
        assert hf._CACHE_WINDOWS.get(mask).leftpad.tolist() == [3, 0]


def test_packed_boundaries_replace_the_mask_only_for_the_batch_manager(calls):
    """A 4D mask with cu_seq_lens runs as varlen only when the batch manager built it (its ``write_index`` keyword)
    and the boundaries cover every token; otherwise the mask itself is run (exact either way)."""
    from ffpa_attn.contract import causal_mask

    lens_q, lens_k = (2, 1), (6, 3)
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(1, 2, 3, 512).to(BF16)
    k, v = (torch.randn(1, 1, 9, 512).to(BF16) for _ in range(2))
    mask = torch.zeros(1, 1, 3, 9, dtype=torch.bool)
    mask[0, 0, :2, :6] = causal_mask(2, 6)
    mask[0, 0, 2:, 6:] = causal_mask(1, 3)
    module = torch.nn.Module()
    module.is_causal = True
    kw = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max(lens_q), max_length_k=max(lens_k))
    plain, _ = hf.ffpa_attention_forward(module, q, k, v, mask, is_causal=False, **kw)
    assert calls.names == ["ffpa_attn_func"]
    packed, _ = hf.ffpa_attention_forward(module, q, k, v, mask, is_causal=False, write_index=[], **kw)
    assert calls.names[-1] == "ffpa_attn_varlen_func"
    from ffpa_attn.reference import varlen_attention

    ref, _ = varlen_attention(*(x[0].transpose(0, 1).float() for x in (q, k, v)), cu_q, cu_k, causal=True)
    assert_close(packed[0], ref, BF16, "varlen")
    assert_close(plain[0], ref, BF16, "mask")
    short = dict(kw, cu_seq_lens_k=torch.tensor([0, 6, 8], dtype=torch.int32))  # a padded key tail: keep the mask
    hf.ffpa_attention_forward(module, q, k, v, mask, is_causal=False, write_index=[], **short)
    assert calls.names[-1] == "ffpa_attn_func"


def test_static_window_falls_back_to_the_mask_where_no_kvcache_kernel_runs(calls, monkeypatch):
    """Without a KV-cache kernel for the tensors (CPU without the interpreter) a static-cache step warns once and
    runs its exact mask instead."""
    from ffpa_attn.common import device as device_facts
    from ffpa_attn.reference import attention

    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, :3] = False
    mask = hf.ffpa_mask(2, 2, 32, q_offset=6, kv_offset=0, mask_function=mu.causal_mask_function,
                        attention_mask=keep)
    q = torch.randn(2, 2, 2, 512).to(BF16)
    k, v = (torch.randn(2, 1, 32, 512).to(BF16) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    monkeypatch.setattr(device_facts, "interpreter_on", lambda: False)
    hf._FALLBACK_WARNED.clear()
    with pytest.warns(ffpa_attn.FFPAFallbackWarning, match="KV-cache entry cannot run"):
        out, _ = hf.ffpa_attention_forward(module, q, k, v, mask)
    assert calls.names == ["ffpa_attn_with_kvcache", "ffpa_attn_func"]
    ref, _ = attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert_close(out, ref.transpose(1, 2), BF16, "mask path")

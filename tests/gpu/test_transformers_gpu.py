"""attn_implementation="ffpa" on a GPU (skipped without CUDA), with Gemma 4 31B's text shapes.

Random weights, no downloads: hidden 5376, 32 query heads, sliding layers head_dim 256 with 16 KV heads
(window 1024), full layers global_head_dim 512 with 4 KV heads and K = V (``attention_k_eq_v``), scaling
1.0; 4 layers (sliding, full, sliding, full) and a 32K vocabulary to keep it quick. bf16 models are compared
with an fp32 eager oracle: "ffpa" must be within max(tolerance, 2x the error of "sdpa" in bf16). The
attention function is also checked alone at the full layers' shapes against the fp32 reference.

    python -m pytest -q -s tests/gpu/test_transformers_gpu.py      # ~1-2 min; prints a summary table
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ffpa_attn  # noqa: E402
from ffpa_attn.integrations import transformers as hf  # noqa: E402
from ffpa_attn.reference import varlen_attention  # noqa: E402
from ffpa_attn.testing import (EntryPointSpy, assert_close, assert_fwd_bwd_close, cu_seqlens, make_qkv,  # noqa: E402
                               reference_bshd, rel_err)

# the models fixture holds three Gemma-shaped models (one fp32) and their gradients: one worker at a time runs
# these tests, so xdist never builds it on several workers at once (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_memory_heavy]

BF16 = torch.bfloat16
DEV = "cuda"
RESULTS: list[dict] = []  # one row per check, printed (and written to $OUT) by the last test


def record(check: str, got: float, base: float | None = None, **extra) -> None:
    RESULTS.append({"check": check, "ffpa_err": got, "sdpa_err": base, **extra})


@pytest.fixture
def spy(monkeypatch):
    """The FFPA entry points called: (head dim, query length, mask given, is_causal) / (head dim, #sequences)."""
    return EntryPointSpy(monkeypatch)


# ------------------------------------------------------------- the attention function, full-layer shapes


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 8
    head_dim = 512


def test_full_layer_prefill_forward_backward(spy):
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 32, 4, 4096, 4096, 512, BF16, DEV, layout="bnhd")
    q, k = q * 0.05, k * 0.05  # O(1) scores at scaling 1.0
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = hf.ffpa_attention_forward(_Module(), q, k, v, None, scaling=1.0)
    errs = assert_fwd_bwd_close(out, reference_bshd(q, k, v, is_causal=True, scale=1.0), (q, k, v), BF16)
    record("attn D=512 32/4 heads N=4096 causal fwd", errs[0])
    record("attn D=512 32/4 heads N=4096 causal dq/dk/dv (max)", max(errs[1:]))
    assert spy.dense == [(512, 4096, False, True)]


def test_full_layer_decode_and_padded_decode(spy):
    torch.manual_seed(1)
    q, k, v = make_qkv(2, 32, 4, 1, 8192, 512, BF16, DEV)
    out, _ = hf.ffpa_attention_forward(_Module(), q, k, v, None)
    record("attn decode Nq=1 Nkv=8192", assert_close(out, reference_bshd(q, k, v), BF16, "decode"))
    keep = torch.ones(2, 8192, dtype=torch.bool, device=DEV)
    keep[1, :3000] = False
    out, _ = hf.ffpa_attention_forward(_Module(), q, k, v, keep)
    record("attn decode Nq=1 Nkv=8192 left-padded",
           assert_close(out, reference_bshd(q, k, v, attn_mask=keep[:, None, None, :]), BF16, "padded decode"))
    assert spy.dense == [(512, 1, False, True), (512, 1, True, True)]
    plan = ffpa_attn.explain(q, k, v, is_causal=True, enable_gqa=True)
    print("decode plan:", plan.forward)


def test_full_layer_padding_and_packing(spy):
    torch.manual_seed(2)
    q, k, v = make_qkv(2, 32, 4, 2048, 2048, 512, BF16, DEV, layout="bnhd")
    keep = torch.ones(2, 2048, dtype=torch.bool, device=DEV)
    keep[0, :700] = False
    keep[1, 1900:] = False
    out, _ = hf.ffpa_attention_forward(_Module(), q, k, v, keep)
    ref = reference_bshd(q, k, v, attn_mask=keep[:, None, None, :], is_causal=True)
    record("attn padded prefill (varlen)", assert_close(out[keep], ref[keep], BF16, "padded"))
    assert bool((out[~keep] == 0).all())
    lens = [700, 1100, 248]
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])[None]
    q1, k1, v1 = q[:1], k[:1], v[:1]
    out, _ = hf.ffpa_attention_forward(_Module(), q1, k1, v1, None, position_ids=pos)
    cu = cu_seqlens(lens, device=DEV)
    tok = lambda t: t[0].transpose(0, 1).float()  # noqa: E731
    ref = varlen_attention(tok(q1), tok(k1), tok(v1), cu, causal=True)[0].unsqueeze(0)
    record("attn packed 700+1100+248 (varlen)", assert_close(out, ref, BF16, "packed"))
    assert spy.varlen == [(512, 2), (512, 3)]


# ------------------------------------------------------------------------ Gemma 4 31B-shaped model


def _config(attn: str):
    return transformers.Gemma4TextConfig(
        vocab_size=32768, hidden_size=5376, intermediate_size=21504, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=16, head_dim=256, global_head_dim=512, num_global_key_value_heads=4,
        attention_k_eq_v=True, sliding_window=1024, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0, max_position_embeddings=131072,
        pad_token_id=0, attn_implementation=attn)


@pytest.fixture(scope="module")
def models():
    assert hf.register_ffpa_attention()
    torch.manual_seed(1234)
    with torch.device(DEV):
        ref = transformers.Gemma4ForCausalLM(_config("eager")).eval()
    for layer in ref.model.layers:  # O(1) scores at scaling 1.0 (random q/k norms of 1 give ~sqrt(D))
        layer.self_attn.q_norm.weight.data.fill_(0.3)
        layer.self_attn.k_norm.weight.data.fill_(0.3)
    state = ref.state_dict()
    out = {"ref": ref}
    for attn in ("ffpa", "sdpa"):
        with torch.device(DEV):
            m = transformers.Gemma4ForCausalLM(_config(attn))
        m.load_state_dict(state)
        out[attn] = m.to(BF16).eval()
    yield out
    del out
    torch.cuda.empty_cache()


def _run(model, grads: bool, **inputs):
    model.zero_grad(set_to_none=True)
    if not grads:
        with torch.no_grad():
            return model(**inputs).logits.float(), None
    res = model(**inputs)
    res.loss.backward()
    names = [n for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None]
    params = dict(model.named_parameters())
    g = torch.cat([params[n].grad.float().reshape(-1) for n in names])
    model.zero_grad(set_to_none=True)
    return res.logits.detach().float(), g


def _compare(what, ffpa, sdpa, ref):
    record(what, assert_close(ffpa, ref, BF16, what, baseline=sdpa), rel_err(sdpa, ref))


@pytest.mark.parametrize("masks", ["block", "dense"])
def test_model_logits_and_loss_grads(models, spy, monkeypatch, masks):
    """Sliding layers: FlexAttention BlockMask (CUDA default) or a 4D mask for SDPA; full layers: FFPA."""
    monkeypatch.setenv(hf.MASK_FORMAT_ENV, masks)
    torch.manual_seed(3)
    ids = torch.randint(3, 32768, (1, 2048), device=DEV)
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    t0 = time.time()
    ffpa = _run(models["ffpa"], True, **inputs)
    seconds = time.time() - t0
    sdpa, ref = _run(models["sdpa"], True, **inputs), _run(models["ref"], True, **inputs)
    _compare(f"model logits S=2048 ({masks} masks)", ffpa[0], sdpa[0], ref[0])
    _compare(f"model attn grads S=2048 ({masks} masks)", ffpa[1], sdpa[1], ref[1])
    RESULTS[-1]["first_step_s"] = round(seconds, 1)
    assert spy.dense == [(512, 2048, False, True)] * 2


def test_model_padding_batch(models, spy, monkeypatch):
    monkeypatch.setenv(hf.MASK_FORMAT_ENV, "dense")
    torch.manual_seed(4)
    ids = torch.randint(3, 32768, (2, 1536), device=DEV)
    am = torch.ones(2, 1536, dtype=torch.long, device=DEV)
    am[0, :500] = 0
    am[1, 1400:] = 0
    inputs = dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100), use_cache=False)
    ffpa, sdpa, ref = (_run(models[k], True, **inputs) for k in ("ffpa", "sdpa", "ref"))
    keep = am.bool()
    _compare("model padded logits", ffpa[0][keep], sdpa[0][keep], ref[0][keep])
    _compare("model padded attn grads", ffpa[1], sdpa[1], ref[1])
    assert spy.varlen == [(512, 2)] * 2


def test_model_packed_batch(models, spy, monkeypatch):
    monkeypatch.setenv(hf.MASK_FORMAT_ENV, "block")
    torch.manual_seed(5)
    lens = (700, 1100, 248)  # 2048 tokens: the same flex shapes as the unpacked test (no recompile)
    ids = torch.randint(3, 32768, (1, sum(lens)), device=DEV)
    pos = torch.cat([torch.arange(n, device=DEV) for n in lens])[None]
    labels = ids.clone()
    labels[0, [0, 700, 1800]] = -100
    inputs = dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    ffpa, sdpa = _run(models["ffpa"], True, **inputs), _run(models["sdpa"], True, **inputs)
    ref = _run(models["ref"], True, **inputs)
    starts = [0, 700, 1800, 2048]
    with torch.no_grad():
        alone = torch.cat([models["ref"](input_ids=ids[:, a:b], use_cache=False).logits.float()
                           for a, b in zip(starts[:-1], starts[1:])], dim=1)
    assert_close(ref[0], alone, torch.float32, "eager packing", tol=1e-4)
    _compare("model packed logits", ffpa[0], sdpa[0], alone)
    _compare("model packed attn grads", ffpa[1], sdpa[1], ref[1])
    assert spy.varlen == [(512, 3)] * 2


def test_model_generate_with_cache(models, spy, monkeypatch):
    """Prompt longer than the sliding window, left-padded batch; decode steps of the full layers go to the
    split-KV kernel through ffpa_attn_func with tail-aligned causal semantics."""
    monkeypatch.setenv(hf.MASK_FORMAT_ENV, "dense")
    torch.manual_seed(6)
    n, new = 1100, 6
    ids = torch.randint(3, 32768, (2, n), device=DEV)
    am = torch.ones(2, n, dtype=torch.long, device=DEV)
    am[1, :37] = 0
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
               return_dict_in_generate=True, pad_token_id=0)
    full = torch.cat([am, torch.ones(2, new, dtype=torch.long, device=DEV)], dim=1)
    pos = (full.cumsum(-1) - 1).clamp(min=0)

    def oracle(seq):
        with torch.no_grad():
            return models["ref"](input_ids=seq, attention_mask=full, position_ids=pos).logits[:, n - 1:-1].float()

    with torch.no_grad():
        g = models["ffpa"].generate(input_ids=ids, attention_mask=am, **gen)
        s = models["sdpa"].generate(input_ids=ids, attention_mask=am, **gen)
    got = torch.stack(g.logits, 1).float()
    base = rel_err(torch.stack(s.logits, 1).float(), oracle(s.sequences))
    err = assert_close(got, oracle(g.sequences), BF16, "generate logits", baseline=base)
    record(f"generate {new} tokens after {n} (KV cache)", err, base)
    decode = [c for c in spy.dense if c[0] == 512 and c[1] == 1]
    assert len(decode) == 2 * (new - 1) and all(c[2] for c in decode)


def test_zz_summary():
    """Prints the table of every check above (and writes $OUT/transformers_gpu.json when OUT is set)."""
    print("\n== transformers binding on GPU: relative error vs fp32 (ffpa | sdpa bf16 baseline) ==")
    for r in RESULTS:
        base = "" if r["sdpa_err"] is None else f"{r['sdpa_err']:.2e}"
        extra = f"  first step {r['first_step_s']} s" if "first_step_s" in r else ""
        print(f"{r['check']:<55} {r['ffpa_err']:.2e} | {base:>8}{extra}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "transformers_gpu.json").write_text(json.dumps(RESULTS, indent=1))

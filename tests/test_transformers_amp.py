"""Mixed-precision training through the transformers binding (``attn_implementation="ffpa"``) on CPU.

fp32 master weights under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (what HF Trainer / accelerate do with
``bf16=True``): RoPE multiplies the bf16 projections by fp32 cos/sin, so q and k reach attention as fp32. The
binding runs FFPA in the autocast dtype (or, outside autocast, in the model's dtype, as transformers'
flash-attention path does) with one warning; the profiler must see an ``ffpa_attn::`` op in every attention layer,
and the losses / gradients of a few optimizer steps must be as close to an fp32 oracle as twice the error of
transformers' own ``"sdpa"`` under the same autocast (the losses also within bf16's tolerance of "sdpa"'s).
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ffpa_attn.integrations import transformers as hf  # noqa: E402
from ffpa_attn.testing import EntryPointSpy, assert_close, make_qkv, reference_bshd, tiny_llama  # noqa: E402

BF16 = torch.bfloat16
STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def _registered(hf_registered):
    """Every test of this module runs with ``attn_implementation="ffpa"`` registered."""


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(hf, "_FALLBACK_WARNED", set())


# ------------------------------------------------------------------------------ the attention function


class Attention(torch.nn.Module):
    """What the binding reads from an attention module: ``is_causal``, its Linear weights, ``config``."""

    def __init__(self, dtype: torch.dtype, config: object = None):
        super().__init__()
        self.is_causal = True
        self.q_proj = torch.nn.Linear(4, 4, dtype=dtype)
        self.config = config


def _run(module, q, k, v, monkeypatch):
    """The binding's forward on ``[B, H, S, D]`` inputs; returns (out [B, S, H, D], dtypes FFPA's dense entry saw)."""
    spy = EntryPointSpy(monkeypatch)
    out, _ = hf.ffpa_attention_forward(module, q, k, v, None)
    return out, spy.dtypes


def _ref(q, k, v, dtype):
    """The fp32 reference ``[B, S, H, D]`` (causal) of q, k, v rounded to ``dtype``."""
    return reference_bshd(*(t.detach().to(dtype) for t in (q, k, v)), is_causal=True)


def test_fp32_inputs_under_autocast_run_ffpa_in_the_autocast_dtype(monkeypatch, fresh_warnings):
    q, k, v = make_qkv(1, 2, 1, 8, 8, 320, torch.float32, requires_grad=True)
    with pytest.warns(hf.FFPAFallbackWarning, match="cast to torch.bfloat16 .the autocast dtype") as rec:
        with torch.autocast("cpu", dtype=BF16):
            out, seen = _run(Attention(torch.float32), q, k, v, monkeypatch)
            hf.ffpa_attention_forward(Attention(torch.float32), q, k, v, None)  # same reason: no second warning
    assert len([w for w in rec if issubclass(w.category, hf.FFPAFallbackWarning)]) == 1
    assert seen == [BF16, BF16] and out.dtype == BF16
    assert_close(out, _ref(q, k, v, BF16), BF16)
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32


@pytest.mark.parametrize("how", ["weights", "pre_quantization", "quantized_config"])
def test_fp32_inputs_outside_autocast_run_in_the_model_dtype(monkeypatch, fresh_warnings, how):
    """fp32 layer norms of a bf16 model (PEFT), or a quantized model: the flash-attention path's target dtype."""
    if how == "weights":
        module = Attention(BF16)
    elif how == "pre_quantization":  # transformers < 5 records the original dtype of a quantized model here
        module = Attention(torch.float32, config=type("Config", (), {"_pre_quantization_dtype": BF16})())
    else:
        module = Attention(torch.float32, config=type("Config", (), {"_is_quantized": True, "dtype": BF16})())
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float32)
    with pytest.warns(hf.FFPAFallbackWarning, match="model's dtype"):
        out, seen = _run(module, q, k, v, monkeypatch)
    assert seen == [BF16] and out.dtype == BF16
    assert_close(out, _ref(q, k, v, BF16), BF16)


def test_fp32_model_without_autocast_falls_back_to_sdpa_naming_the_fix(monkeypatch, fresh_warnings):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 320, torch.float32)
    with pytest.warns(hf.FFPAFallbackWarning, match="float32.*torch.autocast"):
        out, seen = _run(Attention(torch.float32), q, k, v, monkeypatch)
    assert seen == [] and out.dtype == torch.float32
    assert_close(out, _ref(q, k, v, torch.float32), torch.float32, tol=1e-5)


# ------------------------------------------------------------------------------------- tiny models


def _gemma3(attn: str):
    """Gemma 3 style: a sliding-window layer (window 8 < seq 16: a mask) and a full layer, head_dim 512."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=512, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        pad_token_id=0, attn_implementation=attn)
    return transformers.Gemma3ForCausalLM(cfg)


def _layer_scopes(model) -> list:
    """A profiler scope ``attention layer i`` around each attention module's forward (hook handles returned)."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        def enter(mod, args, kwargs, i=i):
            mod._profile_scope = torch.profiler.record_function(f"attention layer {i}")
            mod._profile_scope.__enter__()

        def leave(mod, args, kwargs, out):
            mod._profile_scope.__exit__(None, None, None)

        handles.append(layer.self_attn.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(layer.self_attn.register_forward_hook(leave, with_kwargs=True))
    return handles


def _train(model, ids, amp: bool):
    """STEPS SGD steps on fp32 weights; per step (loss, attention weight grads); and the ffpa ops the profiler saw:
    forward ops per attention layer, and the number of backward ops."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handles = _layer_scopes(model)
    history = []
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=BF16, enabled=amp):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                grads = [p.grad for n, p in model.named_parameters() if "self_attn" in n]
                assert all(g.dtype == torch.float32 for g in grads)
                history.append((loss.detach().float(), torch.cat([g.reshape(-1) for g in grads])))
                opt.step()
    finally:
        for h in handles:
            h.remove()
    per_layer, backward = collections.Counter(), 0
    for ev in prof.events():
        if ev.name == "ffpa_attn::attn":
            parent = ev.cpu_parent
            while parent is not None and not parent.name.startswith("attention layer"):
                parent = parent.cpu_parent
            per_layer[parent.name if parent is not None else None] += 1
        backward += ev.name == "ffpa_attn::attn_backward"
    return history, per_layer, backward


@pytest.mark.parametrize("build", [tiny_llama, _gemma3], ids=["llama", "gemma3"])
def test_training_steps_under_bf16_autocast(build, fresh_warnings):
    torch.manual_seed(1234)
    models = {"oracle": build("eager")}
    for name in ("ffpa", "sdpa"):
        models[name] = build(name)
        models[name].load_state_dict(models["oracle"].state_dict())
    ids = torch.randint(3, 64, (1, 16))
    oracle, _, _ = _train(models["oracle"], ids, amp=False)  # fp32 throughout
    sdpa, sdpa_ops, _ = _train(models["sdpa"], ids, amp=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ffpa, per_layer, backward = _train(models["ffpa"], ids, amp=True)
    assert [str(w.message) for w in rec if issubclass(w.category, hf.FFPAFallbackWarning)] == [
        next(str(w.message) for w in rec if "cast to torch.bfloat16" in str(w.message))]
    n_layers = len(models["ffpa"].model.layers)
    assert per_layer == {f"attention layer {i}": STEPS for i in range(n_layers)}
    assert backward == n_layers * STEPS and not sdpa_ops
    for step, ((lf, gf), (ls, gs), (lo, go)) in enumerate(zip(ffpa, sdpa, oracle)):
        assert_close(lf, ls, BF16, f"step {step} loss vs sdpa")
        assert_close(lf, lo, BF16, f"step {step} loss", baseline=ls)
        assert_close(gf, go, BF16, f"step {step} attention grads", baseline=gs)

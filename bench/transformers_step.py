"""Training-step time (forward + backward) of a Gemma-4-31B-shaped model: attn_implementation "ffpa" vs "sdpa".

Random weights, bf16, 8K tokens (B=1, N=8192), Gemma 4 31B's attention shapes (hidden 5376, 32 query heads;
full layers: head_dim 512, 4 KV heads, K = V, scaling 1.0; sliding layers: head_dim 256, 16 KV heads,
window 1024), a 32K vocabulary and only a few layers so that it finishes in about two minutes:

* ``attention``: the full layer's attention function alone (transformers' SDPA forward vs FFPA's);
* ``2 full``: two full-attention layers, causal 8K and 4 packed 2K sequences (position_ids);
* ``5:1``: Gemma 4's layer pattern (5 sliding + 1 full): "ffpa" runs the sliding layers on FlexAttention
  (BlockMask), "ffpa/dense" on SDPA with a 4D mask as "sdpa" does.

Every row also checks the loss against "sdpa" (relative difference) and counts the FFPA forward ops the profiler
sees in one step (``ffpa ops``: seen / full-attention layers; every full layer of an "ffpa" row must run FFPA).
``--amp`` runs mixed-precision training instead: fp32 weights, each step under ``torch.autocast(dtype=bfloat16)``
(what HF Trainer does with ``bf16=True``; RoPE then hands attention fp32 q/k, which the binding casts to bf16).
Prints a table; with ``OUT`` set it also writes ``$OUT/transformers_step.json`` (``transformers_step_amp.json``
with ``--amp``; rows + commit, GPU, versions, command).

    python bench/transformers_step.py             # on the H200
    python bench/transformers_step.py --amp       # fp32 weights under bf16 autocast
    python bench/transformers_step.py --dry-run   # tiny shapes on CPU (Triton interpreter), checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import transformers  # noqa: E402

from ffpa_attn.bench.env import run_meta  # noqa: E402
from ffpa_attn.bench.timing import measure, wall  # noqa: E402
from ffpa_attn.integrations import transformers as hf  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")
DTYPE = torch.bfloat16
AMP = "--amp" in sys.argv  # fp32 weights, steps under torch.autocast(dtype=DTYPE)
FFPA_OPS = ("ffpa_attn::attn", "ffpa_attn::varlen_attn")  # the forward ops of the dense and packed paths
SEQ = 64 if DRY else 8192
VOCAB = 256 if DRY else 32768


def config(attn: str, layer_types: list[str]) -> transformers.Gemma4TextConfig:
    dims = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_global_key_value_heads=1, sliding_window=16) if DRY else
            dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                 num_global_key_value_heads=4, sliding_window=1024))
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, num_hidden_layers=len(layer_types), head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, layer_types=layer_types, hidden_size_per_layer_input=0,
        max_position_embeddings=131072, pad_token_id=0, attn_implementation=attn, **dims)


def build(attn: str, layer_types: list[str]) -> torch.nn.Module:
    """The same random weights for every implementation (same seed, same construction order)."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.Gemma4ForCausalLM(config(attn, layer_types))
    for layer in model.model.layers:  # O(1) attention scores at scaling 1.0, as a trained model has
        layer.self_attn.q_norm.weight.data.fill_(0.3)
        layer.self_attn.k_norm.weight.data.fill_(0.3)
    return model.to(torch.float32 if AMP else DTYPE).train()


def autocast() -> torch.autocast:
    """The mixed-precision region of a step (``--amp``), else a disabled one."""
    return torch.autocast(DEV.type, dtype=DTYPE, enabled=AMP)


def ffpa_ops(step) -> int:
    """How many FFPA forward ops (dense or packed) the profiler sees in one call of ``step``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(ev.name in FFPA_OPS for ev in prof.events())


def time_steps(model: torch.nn.Module, inputs: dict) -> tuple[float, float, object, int]:
    """(loss, seconds of the first step, Timing of the next ones, FFPA ops in one step) of forward + backward."""

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(**inputs).loss
        loss.backward()
        return loss

    loss, first_s = wall(step, DEV)
    t = measure(step, DEV, max_reps=10, min_reps=3, budget_s=3.0, warmup=1)
    return float(loss.detach()), first_s, t, ffpa_ops(step)


def model_row(name: str, layer_types: list[str], impls: list[str], packed: bool) -> list[dict]:
    rows, losses = [], {}
    ids = torch.randint(3, VOCAB, (1, SEQ), device=DEV)
    inputs = dict(input_ids=ids, labels=ids, use_cache=False)
    if packed:
        n = SEQ // 4
        inputs["position_ids"] = torch.arange(SEQ, device=DEV).remainder(n)[None]
        inputs["labels"] = ids.clone()
        inputs["labels"][0, ::n] = -100
    for impl in impls:
        attn, masks = (impl.split("/") + ["auto"])[:2]
        os.environ[hf.MASK_FORMAT_ENV] = masks
        loss, first_s, t, ops = time_steps(build(attn, layer_types), inputs)
        losses[impl] = loss
        rows.append({"row": name, "impl": impl, "ms": round(t.median_ms, 2), "first_s": round(first_s, 1),
                     "loss": loss, "ffpa_ops": ops, "full_layers": layer_types.count("full_attention")})
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        r["loss_rel_diff_vs_sdpa"] = abs(r["loss"] - losses["sdpa"]) / abs(losses["sdpa"])
    os.environ.pop(hf.MASK_FORMAT_ENV, None)
    return rows


class _FullAttn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2 if DRY else 8
    head_dim = 512
    training = True


def attention_row() -> list[dict]:
    """The full layer's attention function alone: [1, 32, 8K, 512] queries, 4 KV heads, causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    hq, hkv = (4, 2) if DRY else (32, 4)
    dtype = torch.float32 if AMP else DTYPE  # --amp: fp32 inputs (fp32 RoPE), cast by the region
    g = torch.Generator(device=DEV).manual_seed(0)
    q = (torch.randn(1, SEQ, hq, 512, device=DEV, generator=g) * 0.05).to(dtype).transpose(1, 2)
    k = (torch.randn(1, SEQ, hkv, 512, device=DEV, generator=g) * 0.05).to(dtype).transpose(1, 2)
    v = torch.randn(1, SEQ, hkv, 512, device=DEV, generator=g).to(dtype).transpose(1, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(1, SEQ, hq, 512, device=DEV, generator=g).to(DTYPE)
    rows, outs = [], {}
    for impl, fn in (("sdpa", sdpa_attention_forward), ("ffpa", hf.ffpa_attention_forward)):
        def step():
            with autocast():
                out = fn(_FullAttn(), q, k, v, None, scaling=1.0)[0]
            out.backward(dout)
            return out

        out, first_s = wall(step, DEV)
        outs[impl] = out.detach().float()
        t = measure(step, DEV, max_reps=20, min_reps=3, budget_s=2.0, warmup=1)
        rows.append({"row": "attention fwd+bwd (full layer)", "impl": impl, "ms": round(t.median_ms, 2),
                     "first_s": round(first_s, 1), "ffpa_ops": ffpa_ops(step), "full_layers": 1})
    diff = (outs["ffpa"] - outs["sdpa"]).norm().item() / outs["sdpa"].norm().item()
    for r in rows:
        r["out_rel_diff_vs_sdpa"] = diff
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--skip-flex", action="store_true", help="leave out the 5:1 row's FlexAttention variant")
    ap.add_argument("--amp", action="store_true", help="fp32 weights, each step under bf16 torch.autocast")
    args = ap.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("no CUDA GPU: use --dry-run to check the script on CPU")
        return 2
    assert hf.register_ffpa_attention()
    t0 = time.time()
    meta = run_meta(" ".join(["python"] + sys.argv), DEV)
    full2 = ["full_attention"] * 2
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    rows = attention_row()
    n = f"{SEQ // 1024}K" if SEQ >= 1024 else str(SEQ)
    rows += model_row(f"2 full layers, causal {n}", full2, ["sdpa", "ffpa"], packed=False)
    rows += model_row(f"2 full layers, 4 packed = {n}", full2, ["sdpa", "ffpa"], packed=True)
    impls = ["sdpa", "ffpa/dense"] + ([] if args.skip_flex else ["ffpa"])
    rows += model_row(f"5 sliding + 1 full, causal {n}", gemma, impls, packed=False)

    base = {r["row"]: r["ms"] for r in rows if r["impl"] == "sdpa"}
    precision = "fp32 weights under bf16 autocast" if AMP else "bf16"
    print(f"\n== Gemma-4-31B-shaped step time, {precision}, {SEQ} tokens, {meta['gpu_name']}, "
          f"commit {meta['commit']} ==")
    print(f"{'row':<32} {'impl':<11} {'ms':>9} {'x sdpa':>7} {'first s':>8} {'vs sdpa':>9} {'ffpa ops':>9}")
    for r in rows:
        check = r.get("loss_rel_diff_vs_sdpa", r.get("out_rel_diff_vs_sdpa"))
        print(f"{r['row']:<32} {r['impl']:<11} {r['ms']:>9.1f} {base[r['row']] / r['ms']:>7.2f} "
              f"{r['first_s']:>8.1f} {check:>9.1e} {r['ffpa_ops']:>4}/{r['full_layers']:<4}")
    every = all(r["ffpa_ops"] == r["full_layers"] for r in rows if r["impl"].startswith("ffpa"))
    print(f"(x sdpa: speedup over attn_implementation='sdpa'; vs sdpa: relative difference of the loss, or of "
          f"the attention output; ffpa ops: FFPA forward ops the profiler saw in one step / full-attention layers; "
          f"wall {time.time() - t0:.0f} s)")
    print(f"FFPA ran in every full-attention layer of every ffpa row: {'yes' if every else 'NO'}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = "transformers_step_amp.json" if AMP else "transformers_step.json"
        (Path(out) / name).write_text(json.dumps({"meta": meta, "rows": rows, "amp": AMP,
                                                  "ffpa_in_every_full_layer": every}, indent=1, default=str))
    return 0 if every else 1


if __name__ == "__main__":
    sys.exit(main())

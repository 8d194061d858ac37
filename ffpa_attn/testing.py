"""Helpers shared by the tests, ``python -m ffpa_attn check`` and the benchmark's correctness column.

The error metric (docs/design.md, "Errors and tolerances"): ``||out - ref|| / ||ref||`` against the fp32/fp64 reference, with bf16
within 1e-2 and fp16 within 3e-3, and never worse than ``factor`` times the error of torch's own
same-dtype computation on the same inputs. NaN never passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# dtype tolerances (relative Frobenius error vs the fp32 reference; docs/design.md, "Errors and tolerances")
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (inf if out has NaN/inf where ref is finite)."""
    o = out.detach().double()
    r = ref.detach().double()
    if not torch.isfinite(o).all():
        return float("inf")
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return num
    return num / den


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str = "out",
                 baseline: float | None = None, factor: float = 2.0, tol: float | None = None) -> float:
    """Assert ``rel_err(out, ref) <= max(tol, factor * baseline)``; returns the error.

    ``baseline`` is torch's own same-dtype error vs the reference on the same inputs (optional); ``tol``
    defaults to the per-dtype tolerance.
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    limit = TOL[dtype] if tol is None else tol
    if baseline is not None:
        limit = max(limit, factor * baseline)
    if not err <= limit:
        diff = (out.detach().double() - ref.detach().double()).abs().nan_to_num(nan=float("inf"))
        if diff.numel() == 0:
            raise AssertionError(f"{name}: relative error {err:.3e} > {limit:.3e} (dtype {dtype})")
        flat = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        raise AssertionError(
            f"{name}: relative error {err:.3e} > {limit:.3e} (dtype {dtype}); max |diff| {diff[idx].item():.3e} "
            f"at {idx}: got {out.detach()[idx].item()}, ref {ref.detach()[idx].item()}"
        )
    return err


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                    mask: torch.Tensor | None = None, causal: bool = False, dropout_p: float = 0.0,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv, dmask or None)`` of the fp32 reference (:func:`ffpa_attn.reference.attention`) for ``dout``.

    q / dout ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]``; a float ``mask`` gets its gradient too (a bool one
    none); ``keep`` is dropout's keep-mask (``dropout_p`` > 0)."""
    from . import reference

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    m32 = mask.detach().float().requires_grad_() if (mask is not None and mask.is_floating_point()) else mask
    out, _ = reference.attention(q32, k32, v32, attn_mask=m32, is_causal=causal, dropout_p=dropout_p,
                                 dropout_keep=keep)
    out.backward(dout.float())
    dm = m32.grad if (m32 is not None and m32.is_floating_point()) else None
    return q32.grad, k32.grad, v32.grad, dm


def sdpa_grad_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                     refs: tuple[torch.Tensor, ...], *, mask: torch.Tensor | None = None,
                     causal: bool = False) -> list[float] | None:
    """torch SDPA's own same-dtype gradient errors ``[dq, dk, dv]`` against ``refs`` (the fp32 reference's), the
    ``baseline`` of :func:`assert_close` for a backward.

    q ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]`` (GQA expanded here), dout like q; ``mask`` / ``causal`` as in
    :func:`ffpa_attn.reference.scores_bias` (tail-aligned causal). None where a query row sees no key: SDPA's
    gradients are NaN there, so it gives no baseline.
    """
    import torch.nn.functional as F

    from . import reference

    b, hq, nq, _ = q.shape
    bias = reference.scores_bias(b, hq, nq, k.shape[2], mask, causal, q.device, torch.float32)
    if bias is not None and torch.isneginf(bias).all(-1).any():
        return None
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, reference._expand_kv(ks, hq), reference._expand_kv(vs, hq),
                                         attn_mask=None if bias is None else bias.to(q.dtype))
    out.backward(dout)
    return [rel_err(g, r) for g, r in zip((qs.grad, ks.grad, vs.grad), refs[:3])]


def assert_fwd_bwd_close(out: torch.Tensor, ref: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                         dtype: torch.dtype) -> None:
    """``out`` vs the reference ``ref`` (same graph inputs ``inputs`` = (q, k, v)), then both backwards for one
    random ``dout``: each gradient within :func:`assert_close`'s tolerance of the reference's."""
    assert_close(out, ref, dtype, "out")
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, g)
    ref_grads = torch.autograd.grad(ref, inputs, g)
    for name, a, r in zip("qkv", grads, ref_grads):
        assert_close(a, r, dtype, f"d{name}")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN so unwritten elements show up."""
    return t.fill_(float("nan"))


def shape_id(shape: tuple) -> str:
    """pytest id of a ``(B, Hq, Hkv, Nq, Nkv, D, causal, dtype)`` test shape, e.g.
    ``B1-Hq32-Hkv8-Nq4-Nkv32768-D512-cTrue-bfloat16``."""
    return "B{}-Hq{}-Hkv{}-Nq{}-Nkv{}-D{}-c{}-{}".format(*shape[:-1], str(shape[-1]).removeprefix("torch."))


def make_qkv(b: int, hq: int, hkv: int, nq: int, nkv: int, d: int, dtype: torch.dtype,
             device: str | torch.device = "cpu", requires_grad: bool = False, layout: str = "bhnd",
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``.

    ``layout="bnhd"`` returns non-contiguous ``[B, H, N, D]`` views of ``[B, N, H, D]`` storage (what a
    model's ``transpose(1, 2)`` gives).
    """
    def one(h: int, n: int) -> torch.Tensor:
        if layout == "bnhd":
            t = torch.randn(b, n, h, d, dtype=torch.float32, device=device, generator=generator)
            t = t.to(dtype).transpose(1, 2)
        else:
            t = torch.randn(b, h, n, d, dtype=torch.float32, device=device, generator=generator).to(dtype)
        return t.requires_grad_(requires_grad)

    return one(hq, nq), one(hkv, nkv), one(hkv, nkv)


class PoisonTorch:
    """Stands in for the ``torch`` module of a kernel module in tests: ``empty`` / ``empty_like`` return
    NaN-filled floating tensors, so an output element a kernel forgets to write shows up as NaN.

    Use: ``monkeypatch.setattr(kernel_module, "torch", PoisonTorch())``.
    """

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty_like(t: torch.Tensor, *a, **kw) -> torch.Tensor:
        x = torch.empty_like(t, *a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    @staticmethod
    def empty(*a, **kw) -> torch.Tensor:
        x = torch.empty(*a, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x


def pretend_gpu(monkeypatch, capability: tuple[int, int] = (9, 0), sms: int = 132, missing: tuple[str, ...] = ()):
    """Make the planner believe it plans for a CUDA device of ``capability`` with ``sms`` SMs (``monkeypatch``: the
    pytest fixture), whatever the tensors' device: availability runs the registry's real rules on that device, with
    the modules in ``missing`` not installed. For planning tests on a CPU machine (``explain`` / ``plan``); running
    the plan needs the real device."""
    import dataclasses

    from .common import device as device_facts
    from .dispatch import heuristics, planner, registry

    fake = torch.device("cuda", 0)
    real_available, real_facts = registry.available, heuristics.facts
    monkeypatch.setattr(device_facts, "capability", lambda d: capability if d.type == "cuda" else None)
    monkeypatch.setattr(registry, "module_present", lambda name: name not in missing)
    monkeypatch.setattr(registry, "available", lambda name, device: real_available(name, fake))
    monkeypatch.setattr(heuristics, "facts", lambda prob: dataclasses.replace(real_facts(prob), capability=capability,
                                                                               sms=sms))
    planner.invalidate()  # plans memoized before the pretence are stale (and those made during it, after it)
    monkeypatch.setattr(planner, "_GENERATION", [planner._GENERATION[0] + 1])


@dataclass
class KVCacheCase:
    """A random KV cache for tests: ``k_cache / v_cache`` paged ``[num_blocks, page, Hkv, D]`` (with
    ``block_table`` int32 ``[B, max_pages]``) or contiguous ``[B_cache, N_max, Hkv, D]`` (with
    ``cache_batch_idx`` int32 ``[B]`` or None), ``cache_seqlens`` int32 ``[B]``, and the capacity of one sequence."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None
    cache_batch_idx: torch.Tensor | None
    page_size: int | None
    capacity: int

    def kwargs(self) -> dict:
        """The cache keyword arguments of ``flash_attn_with_kvcache``-style calls."""
        return {"cache_seqlens": self.cache_seqlens, "block_table": self.block_table,
                "cache_batch_idx": self.cache_batch_idx}


def make_kvcache(seqlens: Sequence[int], hkv: int, d: int, dtype: torch.dtype, *, page_size: int | None = None,
                 capacity: int | None = None, n_new: int = 0, batch_cache: int | None = None, spare_blocks: int = 2,
                 interleaved: bool = False, device: str | torch.device = "cpu",
                 generator: torch.Generator | None = None) -> KVCacheCase:
    """A cache holding ``seqlens[b]`` random keys per sequence with room for ``n_new`` more, every slot random
    (unused slots act as sentinels: a stray write changes them).

    Paged (``page_size``): each sequence gets ``cdiv(seqlens[b] + n_new, page)`` blocks drawn from a random
    permutation of ``num_blocks = sum + spare_blocks`` (shuffled tables); table entries past a sequence's pages
    are -1 (as in transformers' continuous batching); ``max_pages = cdiv(capacity, page)``.
    ``interleaved``: K and V pages alternate in one storage tensor (``[num_blocks, page, Hkv, D]`` views with a
    page stride of two pages: K and V of a layer sharing one storage, as in transformers' continuous-batching
    cache, whose page views skip the other layers' pages through the table entries instead).
    Contiguous: ``[batch_cache or B, capacity, Hkv, D]``; with ``batch_cache > B`` a random distinct
    ``cache_batch_idx``. ``capacity`` defaults to the longest ``seqlens[b] + n_new`` (at least one page / key).
    """
    bsz = len(seqlens)
    need = [s + n_new for s in seqlens]
    unit = page_size or 1
    cap = capacity if capacity is not None else max(max(need, default=1), 1)
    cap = -(-cap // unit) * unit
    if max(need, default=0) > cap:
        raise ValueError(f"capacity {cap} is below the longest sequence {max(need)}")

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float32, device=device, generator=generator).to(dtype)

    table = bidx = None
    if page_size:
        pages = [-(-n // page_size) for n in need]
        n_blocks = sum(pages) + spare_blocks
        perm = torch.randperm(n_blocks, generator=generator).tolist()
        table = torch.full((bsz, cap // page_size), -1, dtype=torch.int32)
        used = 0
        for b, p in enumerate(pages):
            table[b, :p] = torch.tensor(perm[used:used + p], dtype=torch.int32)
            used += p
        table = table.to(device)
        if interleaved:
            storage = rand(2 * n_blocks, page_size, hkv, d)
            k_cache, v_cache = storage[0::2], storage[1::2]
        else:
            k_cache, v_cache = rand(n_blocks, page_size, hkv, d), rand(n_blocks, page_size, hkv, d)
    else:
        rows = batch_cache or bsz
        if rows > bsz:
            bidx = torch.randperm(rows, generator=generator)[:bsz].to(torch.int32).to(device)
        k_cache, v_cache = rand(rows, cap, hkv, d), rand(rows, cap, hkv, d)
    seq = torch.tensor(list(seqlens), dtype=torch.int32, device=device)
    return KVCacheCase(k_cache, v_cache, seq, table, bidx, page_size, cap)


def relocate_kvcache(case: KVCacheCase, seqlens: Sequence[int], n_new: int = 0) -> None:
    """Give a paged case new lengths in place: ``cache_seqlens`` set to ``seqlens`` and every sequence's pages
    (room for ``n_new`` more tokens) drawn afresh from a random permutation of the blocks, -1 past them (what a
    serving loop does between CUDA-graph replays: the tensors stay, their values change)."""
    page = case.k_cache.shape[1]
    case.cache_seqlens.copy_(torch.tensor(list(seqlens), dtype=torch.int32))
    table = torch.full(tuple(case.block_table.shape), -1, dtype=torch.int32)
    perm = torch.randperm(case.k_cache.shape[0])
    used = 0
    for i, n in enumerate(seqlens):
        pages = -(-(n + n_new) // page)
        table[i, :pages] = perm[used:used + pages].to(torch.int32)
        used += pages
    case.block_table.copy_(table)


def ragged_seqlens(batch: int, capacity: int, page_size: int, n_new: int = 0,
                   generator: torch.Generator | None = None) -> list[int]:
    """``batch`` cache lengths that leave room for ``n_new`` tokens: the edge cases first (0, 1, one page
    minus one, one page, one page plus one, full), then random lengths."""
    top = capacity - n_new
    edges = [0, 1, page_size - 1, page_size, page_size + 1, top]
    out = [min(max(e, 0), top) for e in edges][:batch]
    while len(out) < batch:
        out.append(int(torch.randint(0, top + 1, (1,), generator=generator)))
    return out


def assert_kvcache_matches(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, case: KVCacheCase,
                           k_cache_before: torch.Tensor, v_cache_before: torch.Tensor,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, causal: bool = False,
                           cache_leftpad: torch.Tensor | None = None, softmax_scale: float | None = None,
                           lse_tol: float = 5e-4) -> None:
    """Check one KV-cache call against the fp32 reference (:func:`ffpa_attn.reference.kvcache_attention` on the
    caches as they were before the call): ``out [B, Nq, Hq, D]`` within the dtype's tolerance, ``lse [B, Hq, Nq]``
    fp32 within ``lse_tol`` (None: not returned by the path under test), rows that see no key at out 0 / lse -inf,
    and the case's caches after the call equal, bit for bit, to the reference append of ``k / v`` (so a stray write
    anywhere, sentinel slots included, fails)."""
    from .reference import kvcache_append, kvcache_attention

    kw = case.kwargs()
    ref, ref_lse = kvcache_attention(q, k_cache_before, v_cache_before, k, v, causal=causal,
                                     cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert_close(out, ref, q.dtype, "out")
    empty = torch.isneginf(ref_lse)
    assert (out.transpose(1, 2)[empty] == 0).all(), "rows without a visible key must get out = 0"
    if lse is not None:
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32, (lse.shape,
                                                                                                 lse.dtype)
        assert torch.equal(torch.isneginf(lse), empty), "rows without a visible key must get lse = -inf"
        if (~empty).any():
            assert (lse[~empty] - ref_lse[~empty]).abs().max().item() < lse_tol
    if k is not None:
        ref_k, ref_v = kvcache_append(k_cache_before, v_cache_before, k, v, kw["cache_seqlens"],
                                      block_table=case.block_table, cache_batch_idx=case.cache_batch_idx)
    else:
        ref_k, ref_v = k_cache_before, v_cache_before
    assert torch.equal(case.k_cache, ref_k) and torch.equal(case.v_cache, ref_v), \
        "the caches differ from the reference append"

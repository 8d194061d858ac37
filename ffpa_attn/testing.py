"""Helpers shared by the tests, ``python -m ffpa_attn check`` and the benchmark's correctness column.

The error metric (docs/design.md, "Errors and tolerances"): ``||out - ref|| / ||ref||`` against the fp32/fp64
reference, with bf16 within 1e-2 and fp16 within 3e-3, and never worse than ``factor`` times the error of torch's
own same-dtype computation on the same inputs. NaN never passes.

Contents: the metric and its assertions (:func:`assert_close`, :func:`assert_grads_close`,
:func:`assert_lse_close`, :func:`assert_forward_close`, :func:`assert_results_close`,
:func:`assert_fwd_bwd_close`); reference results with their gradients (:func:`reference_fwd_bwd`,
:func:`reference_varlen_fwd_bwd`, :func:`reference_bshd`), torch SDPA's own (:func:`sdpa_output`,
:func:`sdpa_grad_errors`) and the package's (:func:`func_fwd_bwd`); random inputs (:func:`randn`,
:func:`make_qkv`, :func:`make_varlen_qkv`, :func:`make_kvcache`); NaN poisoning, a pretended GPU for planner
tests, the CuTeDSL GPU tests' skip condition, a tiny transformers model (:func:`tiny_llama`) and a spy on
the public entry points (:class:`EntryPointSpy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

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
                 baseline: float | torch.Tensor | None = None, factor: float = 2.0, tol: float | None = None,
                 strict: bool = False) -> float:
    """Assert ``rel_err(out, ref) <= max(tol, factor * baseline)``; returns the error.

    ``baseline`` is torch's own same-dtype error vs the reference on the same inputs (optional), or torch's own
    same-dtype result itself (a tensor shaped like ``ref``, e.g. :func:`sdpa_output`), whose error is then taken
    here; ``tol`` defaults to the per-dtype tolerance. ``strict``: the error must stay within both,
    ``min(tol, factor * baseline)`` (for kernels that must be as accurate as torch, not only within the dtype's
    tolerance).
    """
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    limit = TOL[dtype] if tol is None else tol
    if isinstance(baseline, torch.Tensor):
        baseline = rel_err(baseline, ref)
    if baseline is not None:
        limit = min(limit, factor * baseline) if strict else max(limit, factor * baseline)
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


GRAD_NAMES = ("dq", "dk", "dv", "dmask")


def assert_grads_close(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None], dtype: torch.dtype,
                       *, names: Sequence[str] = GRAD_NAMES, baselines: Sequence[float | None] | None = None,
                       factor: float = 2.0, tol: float | Mapping[str, float] | None = None,
                       strict: bool = False) -> list[float]:
    """Each gradient in ``got`` (``(dq, dk, dv[, dmask])``, shapes of q, k, v and the mask) finite and within
    :func:`assert_close` of the reference's in ``want`` (e.g. :attr:`AttnResult.grads`); returns the errors.

    A reference entry that is None (no float mask: no dmask) is skipped; one that has no counterpart in ``got``
    fails. ``baselines[i]``: torch's own error of gradient i (:func:`sdpa_grad_errors`), ``strict`` /
    ``factor`` as in :func:`assert_close`; ``tol`` one tolerance for all, or per name (``{"dmask": 2e-2}``).
    """
    missing = [n for n, r in zip(names[len(got):], want[len(got):]) if r is not None]
    assert not missing, f"no gradient to compare with the reference's {missing}"
    errs = []
    for i, (g, r, n) in enumerate(zip(got, want, names)):
        if r is None:
            continue
        assert g is not None, f"{n}: missing"
        assert torch.isfinite(g).all(), f"{n}: not finite"
        base = baselines[i] if baselines is not None and i < len(baselines) else None
        t = tol.get(n) if isinstance(tol, Mapping) else tol
        errs.append(assert_close(g, r, dtype, n, baseline=base, factor=factor, tol=t, strict=strict))
    return errs


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor, atol: float = 2e-2, *, scaled: bool = False,
                     name: str = "lse") -> None:
    """A kernel's lse (fp32, ``[B, Hq, Nq]`` or ``[Hq, T]``) against the reference's: no NaN, -inf exactly where
    the reference's rows see no key, and ``|lse - ref| <= atol`` elsewhere (``scaled``: ``atol`` times
    ``max(1, max |ref|)``, for lse values that grow with the scale)."""
    assert lse.dtype == torch.float32, f"{name}: dtype {lse.dtype}"
    assert lse.shape == ref_lse.shape, f"{name}: shape {tuple(lse.shape)} != reference {tuple(ref_lse.shape)}"
    assert not torch.isnan(lse).any(), f"{name} has NaN"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{name}: -inf pattern differs from the reference"
    fin = torch.isfinite(ref_lse)
    if not fin.any():
        return
    ref = ref_lse[fin].double()
    limit = atol * max(1.0, ref.abs().max().item()) if scaled else atol
    err = (lse[fin].double() - ref).abs().max().item()
    assert err <= limit, f"{name} off by {err:.3e} > {limit:.3e}"


class AttnResult(NamedTuple):
    """Output, lse and gradients of one forward + backward: out ``[B, Hq, Nq, D]`` (varlen ``[T_q, Hq, D]``),
    lse ``[B, Hq, Nq]`` (varlen ``[Hq, T_q]``; None where the call returns none), dq / dk / dv shaped like q / k /
    v, dmask like the mask (None without a float mask or its gradient)."""

    out: torch.Tensor
    lse: torch.Tensor | None
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dmask: torch.Tensor | None = None

    @property
    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """``(dq, dk, dv, dmask)``, the order of :func:`assert_grads_close`."""
        return self.dq, self.dk, self.dv, self.dmask


def _backward(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> None:
    """Backpropagate ``<out, dout> + <lse, dlse>`` (lse's -inf rows, which see no key, left out)."""
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(lse.dtype)).sum()
    if loss.requires_grad:  # false only without a single row (nothing to differentiate)
        loss.backward()


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t``'s gradient; zeros where autograd left none (``t`` never reached the loss, e.g. no rows at all)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def reference_fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                      mask: torch.Tensor | None = None, causal: bool = False, scale: float | None = None,
                      dropout_p: float = 0.0, keep: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
                      mask_grad: bool = True, dtype: torch.dtype = torch.float32) -> AttnResult:
    """Out, lse and the exact gradients of ``<out, dout> + <lse, dlse>`` from autograd through the reference
    (:func:`ffpa_attn.reference.attention`) in ``dtype`` (fp32 or fp64), all in ``dtype``.

    q / dout ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]``, dlse ``[B, Hq, Nq]`` (optional); ``mask`` /
    ``causal`` / ``scale`` as in the reference; a float ``mask`` gets its gradient unless ``mask_grad=False``
    (a bool one never); ``keep`` is dropout's keep-mask (``dropout_p`` > 0).
    """
    from . import reference

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    float_mask = mask is not None and mask.is_floating_point()
    m = mask.detach().to(dtype).requires_grad_(mask_grad) if float_mask else mask
    out, lse = reference.attention(*leaves, attn_mask=m, is_causal=causal, scale=scale, dropout_p=dropout_p,
                                   dropout_keep=keep, dtype=dtype)
    _backward(out, lse, dout, dlse)
    dm = _grad(m) if float_mask and mask_grad else None
    return AttnResult(out.detach(), lse.detach(), *(_grad(t) for t in leaves), dm)


def reference_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    **kwargs) -> tuple[torch.Tensor | None, ...]:
    """``(dq, dk, dv, dmask or None)`` of the reference for ``dout``: :func:`reference_fwd_bwd`'s gradients
    (same arguments)."""
    return reference_fwd_bwd(q, k, v, dout, **kwargs).grads


def unpack_sequence(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a packed ``[T, H, D]`` tensor as a ``[1, H, end - start, D]`` view."""
    return t[start:end].transpose(0, 1).unsqueeze(0)


def reference_varlen_fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                             cu_k: torch.Tensor, dout: torch.Tensor, *, causal: bool = False,
                             scale: float | None = None, dropout_p: float = 0.0, keep: torch.Tensor | None = None,
                             dlse: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> AttnResult:
    """:func:`reference_fwd_bwd` for packed sequences: out ``[T_q, Hq, D]``, lse ``[Hq, T_q]`` and the gradients
    from autograd through :func:`ffpa_attn.reference.varlen_attention` (each sequence alone, tail-aligned causal).

    q / dout ``[T_q, Hq, D]``, k / v ``[T_k, Hkv, D]``, cu_q / cu_k int32 ``[B + 1]``, dlse ``[Hq, T_q]``;
    ``keep`` ``[Hq, T_q, T_k]`` is dropout's packed keep-mask (``dropout_p`` > 0): each sequence reads its block.
    """
    from . import reference

    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if keep is None:
        out, lse = reference.varlen_attention(*leaves, cu_q, cu_k, causal=causal, softmax_scale=scale, dtype=dtype)
    else:  # the reference's varlen entry has no dropout: sequence by sequence, each with its keep block
        out = leaves[0].new_zeros(q.shape[0], q.shape[1], v.shape[2])
        lse = leaves[0].new_full((q.shape[1], q.shape[0]), float("-inf"))
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for a, b, c, e in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
            if b > a:
                o, l = reference.attention(*(unpack_sequence(t, lo, hi) for t, lo, hi in
                                             ((leaves[0], a, b), (leaves[1], c, e), (leaves[2], c, e))),
                                           is_causal=causal, scale=scale, dropout_p=dropout_p,
                                           dropout_keep=keep[:, a:b, c:e][None], dtype=dtype)
                out[a:b], lse[:, a:b] = o[0].transpose(0, 1), l[0]
    _backward(out, lse, dout, dlse)
    return AttnResult(out.detach(), lse.detach(), *(_grad(t) for t in leaves))


def reference_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """The fp32 reference output of q ``[B, Hq, N, D]``, k / v ``[B, Hkv, Nkv, D]`` in the ``[B, N, Hq, D]`` layout
    (what transformers' attention functions return); differentiable w.r.t. q, k, v. ``kwargs``: those of
    :func:`ffpa_attn.reference.attention` (attn_mask, is_causal, scale)."""
    from . import reference

    return reference.attention(q.float(), k.float(), v.float(), **kwargs)[0].transpose(1, 2)


def _sdpa_bias(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """The reference's additive fp32 bias (:func:`ffpa_attn.reference.scores_bias`): what SDPA gets as its mask."""
    from . import reference

    b, hq, nq, _ = q.shape
    return reference.scores_bias(b, hq, nq, k.shape[2], mask, causal, q.device, torch.float32)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          scale: float | None) -> torch.Tensor:
    """torch SDPA in q's dtype with K/V expanded to q's heads (GQA) and ``bias`` in q's dtype: a bias that does not
    require grad keeps SDPA on its fused CPU kernel (16-bit operands, fp32 accumulation, like the GPU kernels);
    its math fallback would compute in fp32 on CPU."""
    import torch.nn.functional as F

    from . import reference

    hq = q.shape[1]
    return F.scaled_dot_product_attention(q, reference._expand_kv(k, hq), reference._expand_kv(v, hq),
                                          attn_mask=None if bias is None else bias.to(q.dtype), scale=scale)


def sdpa_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """torch SDPA's own same-dtype output ``[B, Hq, Nq, D]`` on the same inputs, the ``baseline`` of
    :func:`assert_close` for a forward (pass the tensor: its error against the reference is taken there).

    q ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]`` (GQA expanded here); ``mask`` / ``causal`` as in
    :func:`ffpa_attn.reference.scores_bias` (tail-aligned causal); rows that see no key come out 0, as the
    reference's (SDPA gives NaN there).
    """
    with torch.no_grad():
        return _sdpa(q, k, v, _sdpa_bias(q, k, mask, causal), scale).nan_to_num(0.0)


def sdpa_grad_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                     refs: Sequence[torch.Tensor | None], *, mask: torch.Tensor | None = None,
                     causal: bool = False, scale: float | None = None) -> list[float] | None:
    """torch SDPA's own same-dtype gradient errors ``[dq, dk, dv]`` against ``refs`` (the reference's, e.g.
    :attr:`AttnResult.grads`), the ``baselines`` of :func:`assert_grads_close`.

    q ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]`` (GQA expanded here), dout like q; ``mask`` / ``causal`` as in
    :func:`ffpa_attn.reference.scores_bias` (tail-aligned causal). None where a query row sees no key: SDPA's
    gradients are NaN there, so it gives no baseline.
    """
    bias = _sdpa_bias(q, k, mask, causal)
    if bias is not None and torch.isneginf(bias).all(-1).any():
        return None
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    _sdpa(qs, ks, vs, bias, scale).backward(dout)
    return [rel_err(g, r) for g, r in zip((qs.grad, ks.grad, vs.grad), refs[:3])]


def assert_forward_close(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False,
                         scale: float | None = None, baseline: bool = False, lse_atol: float = 2e-2,
                         lse_scaled: bool = False) -> float:
    """A dense forward's out ``[B, Hq, Nq, D]`` (q's dtype) and lse ``[B, Hq, Nq]`` (fp32; None: not checked) on
    q ``[B, Hq, Nq, D]``, k / v ``[B, Hkv, Nkv, D]`` against the fp32 reference: out as :func:`assert_close`
    (``baseline``: or within 2x torch SDPA's own error, :func:`sdpa_output`), lse as :func:`assert_lse_close`
    (``lse_atol`` / ``lse_scaled``). Returns out's error."""
    from . import reference

    ref, ref_lse = reference.attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    base = sdpa_output(q, k, v, mask=mask, causal=causal, scale=scale) if baseline else None
    err = assert_close(out, ref, q.dtype, "out", baseline=base)
    if lse is not None:
        assert_lse_close(lse, ref_lse, lse_atol, scaled=lse_scaled)
    return err


def func_fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                 attn_mask: torch.Tensor | None = None, mask_grad: bool = True, **kwargs) -> AttnResult:
    """Out and gradients of :func:`ffpa_attn.ffpa_attn_func` for ``dout`` on fresh leaf copies of q ``[B, Hq, Nq,
    D]``, k / v ``[B, Hkv, Nkv, D]`` (lse None). A float ``attn_mask`` gets its gradient (dmask) unless
    ``mask_grad=False``; ``kwargs`` go to ``ffpa_attn_func`` (``enable_gqa`` defaults to Hq != Hkv)."""
    import ffpa_attn

    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    ms = attn_mask.detach().clone().requires_grad_(mask_grad) if float_mask else attn_mask
    kwargs.setdefault("enable_gqa", q.shape[1] != k.shape[1])
    out = ffpa_attn.ffpa_attn_func(qs, ks, vs, attn_mask=ms, **kwargs)
    out.backward(dout)
    return AttnResult(out.detach(), None, qs.grad, ks.grad, vs.grad, ms.grad if float_mask and mask_grad else None)


def assert_results_close(got: AttnResult, want: AttnResult, dtype: torch.dtype, **grad_kwargs) -> None:
    """A forward + backward ``got`` (e.g. :func:`func_fwd_bwd`) against the reference's ``want`` (e.g.
    :func:`reference_fwd_bwd`): out within the dtype's tolerance (:func:`assert_close`), the gradients as
    :func:`assert_grads_close` with ``grad_kwargs`` (tol, baselines, strict)."""
    assert_close(got.out, want.out, dtype, "out")
    assert_grads_close(got.grads, want.grads, dtype, **grad_kwargs)


def assert_fwd_bwd_close(out: torch.Tensor, ref: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                         dtype: torch.dtype, dout: torch.Tensor | None = None) -> list[float]:
    """``out`` vs the reference ``ref`` (same graph inputs ``inputs`` = (q, k, v)), then both backwards for
    ``dout`` (shaped like ``ref``; default random): each gradient within :func:`assert_close`'s tolerance of the
    reference's. Returns the errors ``[out, dq, dk, dv]``."""
    err = assert_close(out, ref, dtype, "out")
    g = torch.randn_like(ref) if dout is None else dout
    grads = torch.autograd.grad(out, inputs, g)
    ref_grads = torch.autograd.grad(ref, inputs, g)
    return [err, *assert_grads_close(grads, ref_grads, dtype)]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN so unwritten elements show up."""
    return t.fill_(float("nan"))


def shape_id(shape: tuple) -> str:
    """pytest id of a ``(B, Hq, Hkv, Nq, Nkv, D, causal, dtype)`` test shape, e.g.
    ``B1-Hq32-Hkv8-Nq4-Nkv32768-D512-cTrue-bfloat16``."""
    return "B{}-Hq{}-Hkv{}-Nq{}-Nkv{}-D{}-c{}-{}".format(*shape[:-1], str(shape[-1]).removeprefix("torch."))


def randn(*shape: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh random normal tensor of ``shape`` in ``dtype``, drawn in fp32 (the same values for every dtype)."""
    return torch.randn(*shape, dtype=torch.float32, device=device, generator=generator).to(dtype)


def make_qkv(b: int, hq: int, hkv: int, nq: int, nkv: int, d: int, dtype: torch.dtype,
             device: str | torch.device = "cpu", requires_grad: bool = False, layout: str = "bhnd",
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``.

    ``layout="bnhd"`` returns non-contiguous ``[B, H, N, D]`` views of ``[B, N, H, D]`` storage (what a
    model's ``transpose(1, 2)`` gives).
    """
    def one(h: int, n: int) -> torch.Tensor:
        if layout == "bnhd":
            t = randn(b, n, h, d, dtype=dtype, device=device, generator=generator).transpose(1, 2)
        else:
            t = randn(b, h, n, d, dtype=dtype, device=device, generator=generator)
        return t.requires_grad_(requires_grad)

    return one(hq, nq), one(hkv, nkv), one(hkv, nkv)


def cu_seqlens(lens: Sequence[int], start: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """int32 ``[len(lens) + 1]`` boundaries of packed sequences of lengths ``lens`` whose first row is ``start``."""
    cu = [start]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


class VarlenQKV(NamedTuple):
    """Packed random sequences: q ``[T_q, Hq, D]``, k / v ``[T_k, Hkv, D]``, their boundaries cu_q / cu_k
    (int32 ``[B + 1]``) and longest lengths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def make_varlen_qkv(lens_q: Sequence[int], lens_k: Sequence[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
                    device: str | torch.device = "cpu", requires_grad: bool = False,
                    generator: torch.Generator | None = None) -> VarlenQKV:
    """Fresh random packed q / k / v for sequences of ``lens_q[i]`` queries and ``lens_k[i]`` keys."""
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (randn(t, h, d, dtype=dtype, device=device, generator=generator).requires_grad_(requires_grad)
               for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    return VarlenQKV(q, k, v, cu_seqlens(lens_q, device=device), cu_seqlens(lens_k, device=device),
                     max(lens_q, default=0), max(lens_k, default=0))


def tiny_llama(attn: str, head_dim: int = 320):
    """A 2-layer Llama-style causal LM with random weights (vocabulary 64, hidden 32, 2 query heads on 1 KV head of
    ``head_dim``) built from a config (no download) with ``attn_implementation=attn``; needs transformers."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, pad_token_id=0, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


class EntryPointSpy:
    """Records the calls of ``ffpa_attn.ffpa_attn_func`` / ``ffpa_attn_varlen_func`` (patched on the package, where
    integrations look them up) while still running them: ``dense`` ``(D, Nq, attn_mask given, is_causal)`` and
    ``dtypes`` (q's) per dense call, ``varlen`` ``(D, number of sequences)`` per varlen call.

    Use: ``spy = EntryPointSpy(monkeypatch)`` (``monkeypatch``: the pytest fixture, which undoes the patch).
    """

    def __init__(self, monkeypatch) -> None:
        import ffpa_attn

        self.dense: list[tuple[int, int, bool, bool]] = []
        self.dtypes: list[torch.dtype] = []
        self.varlen: list[tuple[int, int]] = []
        dense, varlen = ffpa_attn.ffpa_attn_func, ffpa_attn.ffpa_attn_varlen_func

        def spy_dense(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
            self.dense.append((q.shape[-1], q.shape[2], attn_mask is not None, is_causal))
            self.dtypes.append(q.dtype)
            return dense(q, k, v, attn_mask, dropout_p, is_causal, *args, **kwargs)

        def spy_varlen(q, k, v, cu_q, *args, **kwargs):
            self.varlen.append((q.shape[-1], cu_q.numel() - 1))
            return varlen(q, k, v, cu_q, *args, **kwargs)

        monkeypatch.setattr(ffpa_attn, "ffpa_attn_func", spy_dense)
        monkeypatch.setattr(ffpa_attn, "ffpa_attn_varlen_func", spy_varlen)


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


def sm90_with_cutedsl() -> bool:
    """Whether this machine runs the CuTeDSL sm90a kernels: a CUDA device of capability 9.0 and nvidia-cutlass-dsl
    installed (found without importing it). The skip condition of their GPU tests."""
    import importlib.util

    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and importlib.util.find_spec("cutlass") is not None)


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
        return randn(*shape, dtype=dtype, device=device, generator=generator)

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


def capture(fn, warmup: int = 2):
    """``(graph, static outputs)`` of ``fn`` captured in a CUDA graph, after ``warmup`` calls on a side stream (what a
    capture needs: kernels compiled or loaded and launched once, autotune decided, tables validated, autograd's state
    settled). Replay with ``graph.replay()`` after writing new values into ``fn``'s static inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def ptxas_available() -> bool:
    """Whether Triton ships its ptxas (sm_90 kernels then compile on a machine without a GPU)."""
    from pathlib import Path

    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def compile_rows(script: str, shapes: Sequence, root, cache_dir) -> list[dict]:
    """Run ``script`` (Python source that compiles kernels for the shapes in ``sys.argv[1]``, JSON, and prints one JSON
    list of result rows last) in a fresh interpreter without ``TRITON_INTERPRET``, from ``root`` with Triton's cache
    in ``cache_dir``; returns the rows (AssertionError with the output when it fails)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(list(shapes))], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == len(shapes), rows
    return rows

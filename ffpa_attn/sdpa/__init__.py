"""The SDPA backend's kernel module: torch SDPA forward (+ lse) and an explicit backward that honours the
caller's out/lse.

Implements the kernel-module protocol (:mod:`ffpa_attn.kernel_module`).

This module is the fallback: it materializes score chunks of ``_CHUNK`` query rows (never the whole
``Nq x Nkv`` matrix at once) and expands K/V for GQA. Dropout is not supported here; calls with dropout
that resolve to SDPA in both directions go straight to torch's SDPA (see :mod:`ffpa_attn.interface`). Torch SDPA
is always reached through the aten op ``torch.ops.aten.scaled_dot_product_attention``, never through
``torch.nn.functional``, whose attribute callers may have replaced with ``ffpa_attn_func``.
"""
from __future__ import annotations

import torch

from ..contract import add_float_mask, reduce_to_shape, varlen_mask
from ..common.device import is_capturing
from ..common.lse import empty_result
from ..config import SDPABackend
from ..kernel_module import check_kernel, load_spec
from ..reference import _expand_kv, scores_bias

SPEC = load_spec(__name__)  # this backend's description (backend.json)
_CHUNK = 1024


def _no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise NotImplementedError("the SDPA backend runs dropout only through torch SDPA's own autograd")


def _bias_chunk(bias: torch.Tensor | None, r0: int, r1: int) -> torch.Tensor | None:
    return None if bias is None else bias[..., r0:r1, :]


def dense_forward(q, k, v, *, attn_mask, dropout_p, rng, causal, scale, config, kernel):
    """SDPA output plus the lse (chunked over query rows); kernel ``"sdpa_fwd"``."""
    del rng, config
    check_kernel(SPEC, "dense_forward", kernel)
    _no_dropout(dropout_p)
    return _forward(q, k, v, attn_mask, causal, scale, fused=True)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool,
             scale: float, *, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, Nq, Dv] like q, lse [B, Hq, Nq] fp32)`` from q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``.

    lse always comes from fp32 scores. ``fused``: without a mask or causal bias torch's fused SDPA gives out; else
    (and always when False) out = exp(scores - lse) @ V from the same fp32 scores. The varlen paths pass False:
    their capture variant needs a mask, and the eager variant must run the same formula as the replay."""
    b, hq, nq, d = q.shape
    nkv = k.shape[2]
    ke = _expand_kv(k, hq)
    ve = _expand_kv(v, hq)
    bias = scores_bias(b, hq, nq, nkv, attn_mask, causal, q.device, torch.float32)
    if nkv == 0:
        return empty_result(q, v.shape[-1], (b, hq, nq))
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    # With a mask out comes from the same fp32 scores as lse (the mask's MASK_FLOOR rule is not expressible as an
    # additive SDPA mask).
    math_out = bias is not None or not fused
    out = torch.empty(b, hq, nq, v.shape[-1], dtype=q.dtype, device=q.device) if math_out else \
        torch.ops.aten.scaled_dot_product_attention(q, ke, ve, scale=scale)
    for r0 in range(0, nq, _CHUNK):
        r1 = min(nq, r0 + _CHUNK)
        s = torch.matmul(q[:, :, r0:r1].float(), ke.float().transpose(-1, -2)) * scale
        bc = _bias_chunk(bias, r0, r1)
        if bc is not None:
            s = add_float_mask(s, bc)
        lse[:, :, r0:r1] = torch.logsumexp(s, dim=-1)
        if math_out:
            lc = lse[:, :, r0:r1].unsqueeze(-1)
            p = torch.where(torch.isneginf(lc), torch.zeros_like(s), torch.exp(s - lc))
            out[:, :, r0:r1] = torch.matmul(p, ve.float()).to(q.dtype)
    # rows with no visible key: SDPA returns NaN there; the contract says 0
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(out), out)
    return out.contiguous(), lse


def dense_backward(dout, q, k, v, out, lse, *, dlse, attn_mask, mask_grad, dropout_p, rng, causal, scale,
                   config, kernel):
    """dS = P * (dO V^T - delta) with P = exp(scale QK^T + bias - lse) from the caller's lse; kernel
    ``"math_bwd"``."""
    del rng
    check_kernel(SPEC, "dense_backward", kernel)
    _no_dropout(dropout_p)
    cfg = config if isinstance(config, SDPABackend) else SDPABackend()
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    cdt = torch.float32 if (cfg.high_precision_grad or q.device.type == "cpu") else q.dtype
    ke = _expand_kv(k, hq).to(cdt)
    ve = _expand_kv(v, hq).to(cdt)
    bias = scores_bias(b, hq, nq, nkv, attn_mask, causal, q.device, torch.float32)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    dq = torch.empty(b, hq, nq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hq, nkv, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hq, nkv, v.shape[-1], dtype=torch.float32, device=q.device)
    dmask = torch.empty(b, hq, nq, nkv, dtype=torch.float32, device=q.device) if mask_grad else None
    for r0 in range(0, nq, _CHUNK):
        r1 = min(nq, r0 + _CHUNK)
        qc = q[:, :, r0:r1].to(cdt)
        doc = dout[:, :, r0:r1].to(cdt)
        s = torch.matmul(qc, ke.transpose(-1, -2)).float() * scale
        bc = _bias_chunk(bias, r0, r1)
        if bc is not None:
            s = add_float_mask(s, bc)
        lc = lse[:, :, r0:r1].unsqueeze(-1)
        p = torch.where(torch.isneginf(lc), torch.zeros_like(s), torch.exp(s - lc))
        dv += torch.matmul(p.to(cdt).transpose(-1, -2), doc).float()
        dp = torch.matmul(doc, ve.transpose(-1, -2)).float()
        ds = p * (dp - delta[:, :, r0:r1].unsqueeze(-1))
        if dmask is not None:
            dmask[:, :, r0:r1] = ds
        dsc = ds.to(cdt)
        dq[:, :, r0:r1] = torch.matmul(dsc, ke).float() * scale
        dk += torch.matmul(dsc.transpose(-1, -2), qc).float() * scale
    if hkv != hq:
        dk = dk.view(b, hkv, hq // hkv, nkv, d).sum(2)
        dv = dv.view(b, hkv, hq // hkv, nkv, v.shape[-1]).sum(2)
    if dmask is not None:
        dmask = reduce_to_shape(dmask, attn_mask.shape).to(attn_mask.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask


def _packed(x: torch.Tensor) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> ``[1, H, T, D]`` view (all sequences as one, separated by a mask)."""
    return x.transpose(0, 1).unsqueeze(0)


def _unpacked(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> contiguous packed ``[T, H, D]``."""
    return x[0].transpose(0, 1).contiguous()


def _seq_views(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """[T, H, D] rows a:b -> [1, H, n, D] view."""
    return x[a:b].transpose(0, 1).unsqueeze(0)


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p, rng, causal, scale, config, kernel):
    """Per-sequence dense forward (fallback only; the Triton/CuTeDSL paths take the packed batch at once); kernel
    ``"sdpa_fwd"``, per sequence. During a CUDA-graph capture (which cannot read the boundaries on the host) one
    dense forward over the packed rows with the block-diagonal mask of :func:`ffpa_attn.contract.varlen_mask`.

    Both variants compute out from fp32 scores (never torch's fused SDPA, which the capture's mask would rule
    out), so a replay and an eager call differ only in the fp32 summation order of masked (zero) terms: see
    docs/design.md, "Host path"."""
    del max_q, max_k, rng, config
    check_kernel(SPEC, "varlen_forward", kernel)
    _no_dropout(dropout_p)
    if is_capturing():
        o, l = _forward(_packed(q), _packed(k), _packed(v), varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal),
                        False, scale, fused=False)
        return _unpacked(o), l[0]
    tq, hq, d = q.shape
    out = q.new_zeros(tq, hq, v.shape[-1])
    lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i]:
            continue
        o, l = _forward(_seq_views(q, cq[i], cq[i + 1]), _seq_views(k, ck[i], ck[i + 1]),
                        _seq_views(v, ck[i], ck[i + 1]), None, causal, scale, fused=False)
        out[cq[i]:cq[i + 1]] = o[0].transpose(0, 1)
        lse[:, cq[i]:cq[i + 1]] = l[0]
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, kernel):
    """Per-sequence dense backward with the caller's out/lse; kernel ``"math_bwd"``, per sequence (during a
    CUDA-graph capture: over the packed rows with the block-diagonal mask, as :func:`varlen_forward`)."""
    del max_q, max_k
    check_kernel(SPEC, "varlen_backward", kernel)
    if is_capturing():
        g = dense_backward(_packed(dout), _packed(q), _packed(k), _packed(v), _packed(out), lse.unsqueeze(0),
                           dlse=None if dlse is None else dlse.unsqueeze(0),
                           attn_mask=varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal), mask_grad=False,
                           dropout_p=dropout_p, rng=rng, causal=False, scale=scale, config=config, kernel=kernel)
        return _unpacked(g[0]), _unpacked(g[1]), _unpacked(g[2])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        a, b_ = cq[i], cq[i + 1]
        c, e = ck[i], ck[i + 1]
        if b_ == a:
            continue
        dl = None if dlse is None else dlse[:, a:b_].unsqueeze(0)
        g = dense_backward(_seq_views(dout, a, b_), _seq_views(q, a, b_), _seq_views(k, c, e),
                           _seq_views(v, c, e), _seq_views(out, a, b_), lse[:, a:b_].unsqueeze(0), dlse=dl,
                           attn_mask=None, mask_grad=False, dropout_p=dropout_p, rng=rng, causal=causal,
                           scale=scale, config=config, kernel=kernel)
        dq[a:b_] = g[0][0].transpose(0, 1)
        dk[c:e] = g[1][0].transpose(0, 1)
        dv[c:e] = g[2][0].transpose(0, 1)
    return dq, dk, dv


def kvcache_forward(*args, **kwargs):
    """Not implemented: the SDPA backend has no KV-cache kernel (its backend.json lists none, so the planner
    never routes a KV-cache call here)."""
    raise NotImplementedError("the SDPA backend has no KV-cache kernel: ffpa_attn_with_kvcache runs on the Triton "
                              "backend")

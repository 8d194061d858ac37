"""Public entry points: argument checks, the backend decision, and the call into :mod:`ffpa_attn.ops`.

Flow: interface (autocast cast, validate, plan) -> :mod:`ffpa_attn.dispatch.planner` (which backend/kernel) ->
:mod:`ffpa_attn.ops` (eager: the kernel module called directly; traced: the torch op family, with autograd) ->
kernel package. This module never imports a kernel package.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import torch

from .common.device import is_capturing
from .config import TritonBackend, resolve_backends
from .contract import (
    DenseProblem,
    KVCacheProblem,
    VarlenProblem,
    causal_mask,
    check_dense,
    check_dense_kwargs,
    check_kvcache,
    check_kvcache_kwargs,
    check_kvcache_options,
    check_kvcache_values_once,
    check_paged_varlen,
    check_paged_varlen_values,
    check_varlen,
    check_varlen_kwargs,
    check_varlen_values,
    kvcache_problem,
    normalize_mask,
    varlen_mask,
)
from .dispatch.planner import (KVCachePlan, PagedVarlenPlan, Plan, config_generation, plan, plan_kvcache,
                               plan_paged_varlen)
from .ops import (  # importing ops registers torch.ops.ffpa_attn.*
    autocast_inputs,
    prepare_backward,
    run_attn,
    run_attn_backward,
    run_kvcache_attn,
    run_paged_varlen_attn,
    run_varlen_attn,
    run_varlen_attn_backward,
)

__all__ = [
    "ffpa_attn_func",
    "ffpa_attn_varlen_func",
    "ffpa_attn_fwd",
    "ffpa_attn_bwd",
    "ffpa_attn_varlen_fwd",
    "ffpa_attn_varlen_bwd",
    "explain",
    "explain_varlen",
    "ffpa_attn_with_kvcache",
    "explain_kvcache",
]


def _draw_rng(device: torch.device) -> torch.Tensor:
    """(seed, offset) int64 [2] from torch's default generator of ``device`` (manual_seed reproduces it)."""
    return torch.randint(0, 2**31 - 1, (2,), device=device, dtype=torch.int64)


def _needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd can reach the backward of this call: grad enabled and some input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------- the plan memo
# Validation and planning read only the call's metadata (shapes, strides, dtypes, devices, flags, scalars, the named
# configs) and the process's configuration (environment variables the planner reads, deterministic mode), never
# tensor values: for a call signature seen before, the checked problem and the plan are the same, so repeated calls
# (every layer of every step) take them from this memo. Varlen boundary values are not part of it: they are checked
# per unchanged tensor (contract.check_varlen_values). Bounded (least recently used out), thread-safe; skipped while
# torch.compile traces (symbolic shapes) and for tensor subclasses.

_MEMO: OrderedDict = OrderedDict()
_MEMO_LOCK = threading.Lock()
MEMO_SIZE = 512


class _Unmemoizable(Exception):
    pass


def _sig(x: object) -> object:
    """The hashable signature of one argument (types kept apart: ``1`` must not hit the entry of ``True``)."""
    kind = type(x)
    if kind is torch.Tensor:  # first: most arguments are plain tensors
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        raise _Unmemoizable
    if isinstance(x, (tuple, list)):
        return (kind, tuple(map(_sig, x)))
    hash(x)
    return (kind, x)


def _memo_key(args: tuple, kwargs: dict, extra: tuple) -> tuple | None:
    if torch.compiler.is_compiling():
        return None
    try:
        return (tuple(map(_sig, args)), tuple(sorted((k, _sig(v)) for k, v in kwargs.items())) if kwargs else (),
                extra, config_generation())
    except (_Unmemoizable, TypeError):
        return None


def _memo_get(key: tuple | None):
    if key is None:
        return None
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None:
            _MEMO.move_to_end(key)
        return hit


def _memo_put(key: tuple | None, value: tuple) -> None:
    if key is None:
        return
    with _MEMO_LOCK:
        _MEMO[key] = value
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)


def clear_plan_memo() -> None:
    """Forget every memoized plan (configuration changes that :func:`ffpa_attn.dispatch.planner.config_generation`
    does not see, e.g. a test that replaces a planner function, call this)."""
    with _MEMO_LOCK:
        _MEMO.clear()


def _plan_dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, kwargs, needs_backward: bool,
                needs_lse: bool = False, memo: bool = True) -> tuple[DenseProblem, Plan, torch.Tensor | None]:
    """Validate, plan (memoized per call signature unless ``memo=False``: explain() plans afresh), and return the
    normalized mask (:func:`normalize_mask`) every path receives; ``needs_lse``: the low-level entries (their plan
    never calls torch SDPA directly)."""
    memo = _memo_key((query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), kwargs,
                     ("dense", needs_backward, needs_lse, torch.is_grad_enabled())) if memo else None
    hit = _memo_get(memo)
    if hit is None:
        bk = check_dense_kwargs(kwargs)
        fwd_cfg, bwd_cfg = resolve_backends(**bk)
        prob = check_dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        hit = (prob, plan(prob, fwd_cfg, bwd_cfg, needs_backward, needs_lse))
        _memo_put(memo, hit)
    return hit[0], hit[1], normalize_mask(attn_mask, query.dtype)


def _sdpa_direct(query, key, value, attn_mask, prob: DenseProblem, enable_gqa: bool) -> torch.Tensor:
    """torch SDPA with our semantics (tail-aligned causal; rows that see no key give 0)."""
    mask = attn_mask
    is_causal = prob.causal
    if prob.causal and (prob.nq != prob.nkv or mask is not None):
        cm = causal_mask(prob.nq, prob.nkv, query.device)
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask & cm
        else:
            mask = mask.masked_fill(~cm, float("-inf"))
        is_causal = False
    # torch's binding itself, never the attribute torch.nn.functional.scaled_dot_product_attention: callers replace
    # that with ffpa_attn_func, and this path would then call itself (torch.ops.aten's Python entry costs ~10 us more)
    out = torch._C._nn.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=prob.dropout_p,
                                                    is_causal=is_causal, scale=prob.scale,
                                                    enable_gqa=enable_gqa and prob.hq != prob.hkv)
    if mask is not None:
        empty = (~mask).all(-1) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out


def ffpa_attn_func(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **kwargs: object,
) -> torch.Tensor:
    """FFPA attention for large head dims (256 < D <= 1024), SDPA's signature.

    Args:
        query: ``[B, Nh_q, Nq, D]`` fp16/bf16.
        key, value: ``[B, Nh_kv, Nkv, D]``, same dtype/device; Nh_q a multiple of Nh_kv.
        attn_mask: broadcastable to ``[B, Nh_q, Nq, Nkv]`` (any rank <= 4); bool True = participates, float
            (any float dtype) = additive bias (the Triton backend returns its gradient when it requires
            grad). ``-inf`` hides a key (a row with none visible gives 0); a finite value <= -16384
            (``finfo.min``, ``-1e9``) masks it too, and a row masked so everywhere is uniform, as in SDPA.
        dropout_p: attention dropout (SDPA semantics); the backward regenerates the same mask.
        is_causal: query row r sees key k <= r + (Nkv - Nq) (tail-aligned); needs Nkv >= Nq.
        scale: softmax scale (Python or numpy real), default 1/sqrt(D).
        enable_gqa: allow Nh_q != Nh_kv (GQA/MQA).
        **kwargs: ``backend``, ``forward_backend``, ``backward_backend`` (str or Backend); explicit
            directions win over ``backend``.

    Returns:
        ``[B, Nh_q, Nq, D]`` in the input dtype.

    Raises:
        TypeError: dtype not fp16/bf16 on the FFPA path (fp32 outside autocast); an unknown kwarg;
            ``is_causal`` not a bool; ``scale`` / ``dropout_p`` not a real number; a mask neither bool nor float.
        ValueError: bad shapes/ranks/devices/dtype mix, head counts, causal with Nkv < Nq, a mask that does
            not broadcast, a non-finite scale, dropout_p outside [0, 1), invalid backend config (e.g. bf16
            with ``CUDABackend(acc='f16')``). Every message names the argument.
        NotImplementedError: an explicitly named backend that cannot do the request.

    Under ``torch.autocast`` (fp16/bf16) query/key/value run in the region's dtype, as torch SDPA's do.
    """
    query, key, value = autocast_inputs(query, key, value)
    grad = _needs_backward(query, key, value, attn_mask)
    prob, pl, attn_mask = _plan_dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      kwargs, grad)
    if pl.direct_sdpa:
        return _sdpa_direct(query, key, value, attn_mask, prob, enable_gqa)
    rng = _draw_rng(query.device) if prob.dropout_p > 0 else None
    if grad and not torch.compiler.is_compiling():
        prepare_backward(pl.backward.backend, pl.backward.spec, query, key, value, attn_mask, prob.dropout_p,
                         prob.causal)
    out, _ = run_attn(query, key, value, attn_mask, prob.dropout_p, rng, prob.causal, prob.scale, pl.forward,
                      pl.backward)
    return out


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **kwargs: object,
) -> Plan:
    """Which backend and kernel each direction of ``ffpa_attn_func(...)`` with these arguments uses, and why.

    Raises exactly what ``ffpa_attn_func`` would raise for the same arguments (in the same grad mode:
    when no input requires grad, an explicit backward backend that cannot run is reported with kernel
    ``"none"`` instead of raising). ``str(plan)`` reads well. Under ``torch.autocast`` it plans for the dtype the
    call would run in.
    """
    query, key, value = autocast_inputs(query, key, value)
    return _plan_dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, kwargs,
                       _needs_backward(query, key, value, attn_mask), memo=False)[1]


# ------------------------------------------------------------------------------------------------ varlen


def _plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                 causal, enable_gqa, kwargs, needs_backward: bool, memo: bool = True
                 ) -> tuple[VarlenProblem, Plan, torch.Tensor, torch.Tensor]:
    """Validate and plan a varlen call (memoized per call signature unless ``memo=False``); returns the checked
    contiguous ``(cu_seqlens_q, cu_seqlens_k)``."""
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
        max_seqlen_k = max_seqlen_q if max_seqlen_k is None else max_seqlen_k
    memo = _memo_key((q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, enable_gqa), kwargs, ("varlen", needs_backward, torch.is_grad_enabled())) if memo else None
    hit = _memo_get(memo)
    if hit is None:
        bk = check_varlen_kwargs(kwargs)
        fwd_cfg, bwd_cfg = resolve_backends(**bk)
        prob = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                            softmax_scale, enable_gqa, validate_values=False)
        pl = plan(prob, fwd_cfg, bwd_cfg, needs_backward)
        if kwargs.get("deterministic") and isinstance(pl.backward.config, TritonBackend):
            # flash-attn's flag: the Triton backward's split mode has no atomics (the other backends' varlen
            # backwards have none at all), so deterministic=True is a bitwise reproducible backward
            pl = dataclasses.replace(pl, backward=dataclasses.replace(
                pl.backward, config=dataclasses.replace(pl.backward.config, deterministic=True)))
        hit = (prob, pl)
        _memo_put(memo, hit)
    prob, pl = hit
    if torch.compiler.is_compiling():
        # the value checks run in this op inside compiled graphs (the interface cannot read tensor values there)
        cu_q, cu_k = torch.ops.ffpa_attn.varlen_boundaries(cu_seqlens_q, cu_seqlens_k, prob.total_q, prob.total_k,
                                                           prob.max_seqlen_q, prob.max_seqlen_k, prob.causal)
    else:  # eager: checked once per unchanged boundary tensor, and passed on as they are (no copy per call)
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, prob.total_q, prob.total_k, prob.max_seqlen_q,
                            prob.max_seqlen_k, prob.causal)
        cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    return prob, pl, cu_q, cu_k


def _varlen_sdpa_direct(q, k, v, cu_q, cu_k, prob: VarlenProblem, enable_gqa: bool) -> torch.Tensor:
    """Per-sequence torch SDPA (fallback only, e.g. dropout outside the FFPA range); during a CUDA-graph capture, which
    cannot read the boundaries on the host, one torch SDPA over the packed rows with the block-diagonal mask."""
    if is_capturing():
        p = DenseProblem(1, prob.hq, prob.hkv, prob.total_q, prob.total_k, prob.d, prob.dv, prob.dtype, prob.device,
                         False, prob.scale, prob.dropout_p, "bool", False)
        mask = varlen_mask(cu_q, cu_k, prob.total_q, prob.total_k, prob.causal)
        packed = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return _sdpa_direct(*packed, mask, p, enable_gqa)[0].transpose(0, 1).contiguous()
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(prob.batch):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1).unsqueeze(0)
        if qs.shape[2] == 0:
            continue
        p = DenseProblem(1, prob.hq, prob.hkv, qs.shape[2], ks.shape[2], prob.d, prob.dv, prob.dtype,
                         prob.device, prob.causal, prob.scale, prob.dropout_p, "none", False)
        if ks.shape[2] == 0:
            outs.append(q.new_zeros(qs.shape[2], prob.hq, prob.dv))
            continue
        outs.append(_sdpa_direct(qs, ks, vs, None, p, enable_gqa)[0].transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape[0], prob.hq, prob.dv)
    return torch.cat(outs, dim=0)


def ffpa_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    enable_gqa: bool = False,
    return_lse: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Variable-length (packed THD) attention with flash-attn's argument names.

    Args:
        q: ``[T_q, H_q, D]``; k, v: ``[T_k, H_kv, D]`` fp16/bf16 (paged caches with ``block_table``, below).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` boundaries (any stride) starting at 0 and ending at T
            (``cu_seqlens_k=None``: self-attention, same boundaries as q; with ``block_table``: not needed).
        max_seqlen_q, max_seqlen_k: at least the longest sequence lengths (Python or numpy ints); checked
            against the boundaries on every call, compiled or eager (ValueError naming the argument).
        dropout_p: attention dropout; softmax_scale: default 1/sqrt(D); causal: tail-aligned per sequence.
        enable_gqa: allow H_q != H_kv; return_lse: also return lse ``[H_q, T_q]`` fp32 (natural log, scaled).
        **kwargs: ``backend``/``forward_backend``/``backward_backend``; ``deterministic`` (bool, flash-attn's
            flag): True makes the backward bitwise reproducible (the Triton backward runs in its split mode,
            as with ``TritonBackend(deterministic=True)``; the other backends' varlen backwards use no atomics
            either way); ``window_size`` meaning full attention: ``(None, None)`` (flash-attn 4's default) or
            ``(-1, -1)``. flash-attn options we recognize but do not implement (a sliding window_size,
            softcap, sink, attention_mask/attn_mask, block_mask, score_mod, aux_tensors, num_splits,
            alibi_slopes) raise NotImplementedError naming the argument when not at their default; anything else
            raises TypeError.
        seqused_k: int32 ``[B]``: sequence b uses only ``seqused_k[b]`` keys (its first ones; flash-attn's
            meaning). Forward only.
        block_table: int32 ``[B, max_pages]`` (serving engines' paged KV cache, e.g. vLLM's unified
            prefill + decode batch): k / v are paged caches ``[num_blocks, page, H_kv, D]`` (page a multiple of 16,
            any strides with a unit stride on D) and key j of sequence b is row ``j % page`` of block
            ``block_table[b, j // page]``, read in place (no packed copy). Each sequence holds ``seqused_k[b]``
            keys, or, without ``seqused_k``, ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` (flash-attn's rule; the
            boundaries then give only the counts); ``max_seqlen_k`` is not used. Causal stays tail-aligned per
            sequence (a sequence of one query is a decode row over all its keys); a causal row that sees no key
            (``seqused_k[b]`` below the sequence's query count, or 0) gets out 0 and lse -inf, as in
            :func:`ffpa_attn_with_kvcache`. Lengths and block ids are checked as there (ValueError naming
            ``seqused_k`` / ``block_table``; once per unchanged tensors; skipped during CUDA-graph capture, under
            torch.compile and with ``FFPA_ATTN_VARLEN_VALUE_CHECKS=0``, when the kernels still read nothing
            outside the caches). Forward only: inputs that require grad (with grad enabled) and
            ``dropout_p > 0`` raise NotImplementedError; a named backend whose varlen forward does not read
            pages (CuTeDSL, CUDA, SDPA) raises NotImplementedError; implicitly the first backend that reads them
            runs (Triton).

    Returns:
        ``out [T_q, H_q, D]``, or ``(out, lse)`` when ``return_lse``. Under ``torch.autocast`` (fp16/bf16) q/k/v
        run in the region's dtype, as in :func:`ffpa_attn_func`.
    """
    q, k, v = autocast_inputs(q, k, v)
    if seqused_k is not None or block_table is not None:
        out, lse = _serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                   block_table, dropout_p, softmax_scale, causal, enable_gqa, kwargs)
        return (out, lse) if return_lse else out
    grad = _needs_backward(q, k, v)
    prob, pl, cu_q, cu_k = _plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p, softmax_scale, causal, enable_gqa, kwargs, grad)
    if pl.forward.backend == pl.backward.backend == "sdpa" and prob.dropout_p > 0:
        if return_lse:
            raise NotImplementedError("return_lse=True with dropout on the SDPA fallback path")
        return _varlen_sdpa_direct(q, k, v, cu_q, cu_k, prob, enable_gqa)
    rng = _draw_rng(q.device) if prob.dropout_p > 0 else None
    if grad and not torch.compiler.is_compiling():
        prepare_backward(pl.backward.backend, pl.backward.spec, q, k, v, None, prob.dropout_p, prob.causal)
    out, lse = run_varlen_attn(q, k, v, cu_q, cu_k, prob.max_seqlen_q, prob.max_seqlen_k, prob.dropout_p, rng,
                               prob.causal, prob.scale, pl.forward, pl.backward)
    return (out, lse) if return_lse else out


def _plan_serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                         dropout_p, softmax_scale, causal, enable_gqa, kwargs,
                         memo: bool = True) -> tuple[VarlenProblem, PagedVarlenPlan]:
    """Validate (metadata) and plan a varlen call with ``seqused_k`` / ``block_table`` (memoized per signature)."""
    key = _memo_key((q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                     dropout_p, softmax_scale, causal, enable_gqa), kwargs, ("serving varlen",)) if memo else None
    hit = _memo_get(key)
    if hit is None:
        fwd_cfg, _ = resolve_backends(**check_varlen_kwargs(kwargs))
        prob = check_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                  block_table, dropout_p, causal, softmax_scale, enable_gqa)
        hit = (prob, plan_paged_varlen(prob, fwd_cfg))
        _memo_put(key, hit)
    return hit


def _serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                    dropout_p, softmax_scale, causal, enable_gqa, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ffpa_attn_varlen_func` with ``seqused_k`` / ``block_table``: ``(out [T_q, Hq, D], lse [Hq, T_q])``."""
    if _needs_backward(q, k, v):
        raise NotImplementedError("ffpa_attn_varlen_func with block_table / seqused_k is forward-only (serving): "
                                  "call it under torch.no_grad() or torch.inference_mode(), or pass detached inputs")
    prob, pl = _plan_serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                    block_table, dropout_p, softmax_scale, causal, enable_gqa, kwargs)
    paged = block_table is not None
    used = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    total = 0  # keys the sequences hold (rows of the gather route's packed buffers; 0: the kernel module reads it)
    if not torch.compiler.is_compiling():
        total = check_paged_varlen_values(prob, cu_seqlens_q, cu_seqlens_k, used, block_table, k)
    return run_paged_varlen_attn(
        q, k, v, cu_seqlens_q.contiguous(), None if paged else cu_seqlens_k.contiguous(), used.contiguous(),
        block_table, prob.max_seqlen_q, prob.max_seqlen_k, prob.causal, prob.scale, total if pl.varlen else 0, pl)


def explain_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, dropout_p=0.0,
                   softmax_scale=None, causal=False, enable_gqa=False, seqused_k=None, block_table=None,
                   **kwargs) -> Plan | PagedVarlenPlan:
    """Like :func:`explain` for :func:`ffpa_attn_varlen_func` (with ``block_table`` / ``seqused_k``: the route, the
    kernel that reads the pages and, on the gather route, the varlen forward it packs them for)."""
    q, k, v = autocast_inputs(q, k, v)
    if seqused_k is not None or block_table is not None:
        return _plan_serving_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                    block_table, dropout_p, softmax_scale, causal, enable_gqa, kwargs, memo=False)[1]
    return _plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, enable_gqa, kwargs, _needs_backward(q, k, v), memo=False)[1]


# ------------------------------------------------------------------------------------- low-level entries


def ffpa_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attn_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-level dense forward: ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)``.

    For callers that merge partial results themselves (ring attention) and later call
    :func:`ffpa_attn_bwd` with the merged out/lse. Differentiable through out and lse. kwargs: backend
    selection as in :func:`ffpa_attn_func`. Under ``torch.autocast`` q/k/v run in the region's dtype; lse is fp32.
    """
    q, k, v = autocast_inputs(q, k, v)
    prob, pl, attn_mask = _plan_dense(q, k, v, attn_mask, 0.0, causal, scale, enable_gqa, kwargs,
                                      _needs_backward(q, k, v, attn_mask), needs_lse=True)
    return run_attn(q, k, v, attn_mask, 0.0, None, prob.causal, prob.scale, pl.forward, pl.backward)


def ffpa_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attn_mask: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-level dense backward from the caller's ``out``/``lse`` (e.g. globally merged by a ring).

    Args:
        dout, out: ``[B, Hq, Nq, D]``; q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``;
        lse: ``[B, Hq, Nq]`` fp32; dlse: optional gradient reaching lse (same shape).
    Returns:
        ``(dq [B, Hq, Nq, D], dk [B, Hkv, Nkv, D], dv [B, Hkv, Nkv, D])``. Under ``torch.autocast`` dout, q, k,
        v and out run in the region's dtype (lse and dlse stay fp32).
    """
    dout, q, k, v, out = autocast_inputs(dout, q, k, v, out)
    prob, pl, attn_mask = _plan_dense(q, k, v, attn_mask, 0.0, causal, scale, enable_gqa, kwargs,
                                      needs_backward=True, needs_lse=True)
    _check_like(dout, out, "dout", q.shape[:-1] + (v.shape[-1],))
    _check_like(out, q, "out", q.shape[:-1] + (v.shape[-1],))
    _check_lse(lse, q.shape[:-1], "lse")
    if dlse is not None:
        _check_lse(dlse, q.shape[:-1], "dlse")
    return run_attn_backward(dout, q, k, v, out, lse, dlse, attn_mask, 0.0, None, prob.causal, prob.scale,
                             pl.backward)


def ffpa_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                         softmax_scale=None, enable_gqa=False, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-level varlen forward: ``(out [T_q, Hq, D], lse [Hq, T_q] fp32)``; arguments (and autocast) as the varlen
    func."""
    q, k, v = autocast_inputs(q, k, v)
    prob, pl, cu_q, cu_k = _plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                        softmax_scale, causal, enable_gqa, kwargs, _needs_backward(q, k, v))
    return run_varlen_attn(q, k, v, cu_q, cu_k, prob.max_seqlen_q, prob.max_seqlen_k, 0.0, None, prob.causal,
                           prob.scale, pl.forward, pl.backward)


def ffpa_attn_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                         causal=False, softmax_scale=None, enable_gqa=False, dlse=None,
                         **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-level varlen backward from the caller's ``out [T_q, Hq, D]`` / ``lse [Hq, T_q]``.

    Returns ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])``. Autocast as in :func:`ffpa_attn_bwd`.
    """
    dout, q, k, v, out = autocast_inputs(dout, q, k, v, out)
    prob, pl, cu_q, cu_k = _plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                        softmax_scale, causal, enable_gqa, kwargs, needs_backward=True)
    _check_like(dout, out, "dout", q.shape[:-1] + (v.shape[-1],))
    _check_like(out, q, "out", q.shape[:-1] + (v.shape[-1],))
    _check_lse(lse, (q.shape[1], q.shape[0]), "lse")
    if dlse is not None:
        _check_lse(dlse, (q.shape[1], q.shape[0]), "dlse")
    return run_varlen_attn_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, prob.max_seqlen_q, prob.max_seqlen_k,
                                    0.0, None, prob.causal, prob.scale, pl.backward)


def _check_like(t: torch.Tensor, ref: torch.Tensor, name: str, shape) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {got}")
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}.dtype={t.dtype} must match {ref.dtype} (the dtype of q/out)")


def _check_lse(t: torch.Tensor, shape, name: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {got}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")


# ------------------------------------------------------------------------------------------------ KV cache


def _plan_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                  block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                  num_splits, return_softmax_lse, kwargs,
                  memo: bool = True) -> tuple[KVCacheProblem, KVCachePlan, bool]:
    """Validate the metadata of a KV-cache call and plan it (memoized per call signature unless ``memo=False``); returns
    the problem, the plan and ``check_values``. The values of lengths and tables are checked by the caller."""
    # an int cache_seqlens changes every step and never changes the plan: only its type is part of the signature
    seq_sig = "int" if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) else cache_seqlens
    key = _memo_key((q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seq_sig, cache_batch_idx, cache_leftpad,
                     block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                     num_splits, return_softmax_lse), kwargs, ("kvcache",)) if memo else None
    hit = _memo_get(key)
    if hit is None:
        splits = check_kvcache_options(rotary_cos, rotary_sin, window_size, softcap, rotary_interleaved, alibi_slopes,
                                       num_splits, return_softmax_lse, causal)
        bk, check_values = check_kvcache_kwargs(kwargs)
        fwd_cfg, _ = resolve_backends(**bk)
        check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, values=False)
        prob = kvcache_problem(q, k_cache, k, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                               softmax_scale, causal, splits)
        hit = (prob, plan_kvcache(prob, fwd_cfg), check_values)
        _memo_put(key, hit)
    return hit


def ffpa_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    **kwargs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a KV cache with flash-attn's ``flash_attn_with_kvcache`` arguments (names, order, semantics).

    Args:
        q: ``[B, Nq, Hq, D]`` fp16/bf16 (decode Nq = 1, speculative verification, chunked prefill).
        k_cache, v_cache: contiguous ``[B_cache, N_max, Hkv, D]`` (no ``block_table``) or paged
            ``[num_blocks, page, Hkv, D]`` (page a multiple of 16), q's dtype, any strides with a unit stride on D
            (e.g. K and V pages interleaved in one storage). Hq must be a multiple of Hkv (GQA / MQA).
        k, v: optional new keys / values ``[B, Nq_new, Hkv, D]``, written into the caches in place at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + Nq_new - 1`` before attending; the caller advances its lengths
            afterwards, as with flash-attn.
        rotary_cos, rotary_sin, window_size, softcap, alibi_slopes: not implemented: NotImplementedError unless at
            their defaults (``window_size`` (-1, -1) or (None, None)); ``rotary_interleaved`` takes any bool.
        cache_seqlens: int or int32 ``[B]``: keys already cached per sequence (None: every sequence holds the full
            capacity; required with k / v). Sequence b attends over ``cache_seqlens[b] + Nq_new`` keys.
        cache_batch_idx: int32 ``[B]``: the cache row of sequence b (contiguous caches; default b).
        cache_leftpad: int32 ``[B]``: keys before it are not part of the sequence.
        block_table: int32 ``[B, max_pages]``: page ids of sequence b (entries past its pages are never read).
        softmax_scale: default 1/sqrt(D). causal: tail-aligned per sequence (row r sees keys
            ``j <= r + len_b - Nq``); a row that sees no key gets out 0 and lse -inf.
        num_splits: 0 = the planner's split count; n > 0 asks for n KV slices per sequence on the decode route
            (Nq <= 64; at most 256), NotImplementedError on the chunked-prefill route (Nq > 64), which does not
            split the keys.
        return_softmax_lse: also return lse ``[B, Hq, Nq]`` fp32 (natural log of the scaled scores' sum).
        **kwargs: ``backend`` (str or Backend: the one backend that runs the call, or NotImplementedError);
            ``check_values`` (default True): read lengths, indices and tables on the host and check them against
            the cache (a device sync, once per unchanged tensors; skipped during CUDA-graph capture and under
            torch.compile); False for callers that guarantee valid tables. Without the checks a bad length or
            block id reads and writes nothing outside the caches, but the result is not defined.

    Returns:
        ``out [B, Nq, Hq, D]``, or ``(out, lse)`` with ``return_softmax_lse``.

    Routing (:func:`explain_kvcache`): up to 64 new queries per sequence run the Triton split-KV kernel over the
    cache in place; longer chunks append and run the varlen forward the planner picks (CuTeDSL on sm90 at its
    head dims, else Triton): Triton's over a paged cache's pages in place, otherwise over each sequence's keys
    packed first (contiguous caches, ``cache_leftpad``, CuTeDSL). Outside what the Triton backend runs (no triton, CPU tensors without ``TRITON_INTERPRET=1``,
    D > 1024) it raises NotImplementedError: there is no SDPA fallback for a KV cache. Under ``torch.autocast``
    (fp16/bf16) q, k and v run in the region's dtype (the caches must already be in it).
    """
    q, k, v = autocast_inputs(q, k, v)
    prob, pl, check_values = _plan_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                           window_size, softcap, rotary_interleaved, alibi_slopes, num_splits,
                                           return_softmax_lse, kwargs)
    max_total = 0
    if check_values and not torch.compiler.is_compiling() and not _capturing():
        total = check_kvcache_values_once(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                                          prob.batch, prob.n_new)
        max_total = total if pl.varlen is not None else 0
    seqlens = cache_seqlens
    if isinstance(cache_seqlens, int):
        seqlens = torch.full((prob.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    out, lse = run_kvcache_attn(q, k_cache, v_cache, k, v, seqlens, block_table, cache_batch_idx, cache_leftpad,
                                prob.causal, prob.scale, max_total, pl)
    return (out, lse) if return_softmax_lse else out


def explain_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                    return_softmax_lse=False, **kwargs) -> KVCachePlan:
    """The plan of :func:`ffpa_attn_with_kvcache` with these arguments (the route, the KV-cache kernel with its tiles
    and split count, and the varlen forward of the chunked-prefill route), raising what the call would raise for
    its metadata; ``str(plan)`` reads well. Lengths and tables are not read."""
    q, k, v = autocast_inputs(q, k, v)
    return _plan_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse, kwargs, memo=False)[1]


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (value checks would break the capture)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

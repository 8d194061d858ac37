"""Host side of the Triton split-D backward (dense and varlen): buffers, plan choice, kernel launches.

Implements ``dense_backward`` and ``varlen_backward`` of the kernel-module protocol (:mod:`ffpa_attn.kernel_module`).
Device code and the math: :mod:`ffpa_attn.triton.bwd_kernels`; tiles and D-slices:
:mod:`ffpa_attn.triton.bwd_config`.

Launch sequence: (1) delta = rowsum(dO * O) - dlse (fp32); (2) one dK/dV launch per D-slice group, which
also adds dQ into an fp32 buffer with atomics (fused mode) and writes d(mask); (3) split mode only: one dQ
launch per dQ slice group (no atomics). ``TritonBackend`` fields honoured here:

* ``deterministic=True`` or ``split_launch=True``: split mode; with ``deterministic`` a broadcast float mask's
  gradient goes through a full ``[B, Hq, Nq, Nkv]`` fp32 buffer and a torch sum instead of atomics, so the
  whole backward is bitwise reproducible. ``torch.use_deterministic_algorithms(True)`` turns ``deterministic``
  on for every call while it is in effect.
* ``grad_q_storage_dtype``: the fused mode always accumulates dQ in an fp32 buffer (None and float32 are the
  same); in split mode float32 makes the dQ kernel store fp32 and cast once (default: store q.dtype).
* ``grad_kv_storage_dtype``: dK/dV are always accumulated in fp32 registers (a GQA group's query heads are
  summed inside the program); a storage dtype makes the kernel write that dtype and cast to k/v.dtype after.
* ``enable_tma``: tensor descriptors (TMA) for every tile; None = on for sm90+ when the tensors allow it
  (16-byte aligned rows, unit last stride; else masked pointer loads).
* ``autotune`` / ``autotune_mode``: the plan comes from the autotune cache (:mod:`.autotune`, kernel name
  ``ffpa_bwd``), then the shipped table ``tuned/ffpa_bwd.json`` (written by ``bench/tune_triton_bwd.py``), then
  :func:`~.bwd_config.default_plan`; candidates are benchmarked on a miss only in ``autotune_mode="max"``.
* ``preprocess_d_chunk``: the delta preprocess always walks D in chunks; the flag changes nothing.
* ``enable_ws`` / ``persist_dkdv``: no effect on the backward (no warp-specialized variant; dK/dV always
  stay in fp32 registers for the whole launch).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import triton

from ..config import TritonBackend, grad_storage_dtype
from ..contract import canonical_mask, reduce_to_shape
from . import autotune
from .bwd_config import (
    BwdPlan,
    candidate_plans,
    chunk_width,
    config_to_plan,
    default_plan,
    fit_plan,
    plan_to_config,
    slice_groups,
)
from ..common import device as hw
from ..common.delta import backward_delta
from ..common.delta import s3_dense as _s3_dense, s3_ht as _s3_ht, s4_dense as _s4_dense, s4_thd as _s4_thd
from .bwd_kernels import LOG2E, _bwd_dkdv_kernel, _bwd_dq_kernel
from .common import dropout_threshold, tma_layout_ok

KERNEL_NAME = "ffpa_bwd"
_SOURCES = tuple(str(Path(__file__).with_name(n)) for n in ("bwd.py", "bwd_kernels.py", "bwd_config.py"))


def _as_triton(config: object) -> TritonBackend:
    """The call's :class:`TritonBackend` (the defaults when another backend's config arrives); under
    ``torch.use_deterministic_algorithms(True)`` with ``deterministic`` forced on (no atomics anywhere)."""
    cfg = config if isinstance(config, TritonBackend) else TritonBackend()
    if torch.are_deterministic_algorithms_enabled() and not cfg.deterministic:
        cfg = dataclasses.replace(cfg, deterministic=True)
    return cfg


def _tune_key(q: torch.Tensor, causal: bool, split: bool, mask_kind: int, mask_grad: bool, dropout: bool,
              varlen: bool, group: int, nq: int, nkv: int) -> tuple:
    return (str(q.dtype).replace("torch.", ""), q.shape[-1], int(causal), int(split), mask_kind, int(mask_grad),
            int(dropout), int(varlen), int(group > 1), autotune.bucket(nq), autotune.bucket(nkv))


def _default_key(key: tuple) -> tuple:
    """The shipped tuned-defaults key: dtype, D, causal, split (``bench/tune_triton_bwd.py`` writes these)."""
    return key[:4]


def _plan_for(d: int, cfg: TritonBackend, device: torch.device, key: tuple | None = None,
              bench=None) -> BwdPlan:
    """The plan for a call: memory/disk autotune cache, then the shipped tuned default for (dtype, D, causal,
    split), then :func:`default_plan`. Candidates are benchmarked on a miss only with
    ``TritonBackend(autotune=True, autotune_mode="max")``: one backward plan costs ~10 s of compilation,
    so the "fast" mode relies on the table the bench ships."""
    split = cfg.split_launch or cfg.deterministic
    on_gpu = device.type == "cuda" and not hw.interpreter_on()
    if not on_gpu or key is None:
        return default_plan(d, split, on_gpu=on_gpu)
    cands = [p for p in candidate_plans(d) if p.split == split] or [default_plan(d, split)]
    first = default_plan(d, split)
    cands = [first] + [p for p in cands if p != first]
    tune = cfg.autotune and cfg.autotune_mode == "max" and bench is not None
    chosen = autotune.pick_config(
        KERNEL_NAME, key, [plan_to_config(p) for p in cands],
        (lambda c: bench(config_to_plan(c))) if tune else None, device=device,
        fingerprint=autotune.source_fingerprint(*_SOURCES), autotune=tune, mode=cfg.autotune_mode,
        default_key=_default_key(key))
    return fit_plan(config_to_plan(chosen), d)


def _tma_ok(tensors: list[torch.Tensor], widths: list[int]) -> bool:
    """Tensor descriptors need unit last strides, 16-byte aligned bases and row strides, and boxes <= 256."""
    return all(w <= 256 for w in widths) and tma_layout_ok(*tensors)


def _use_tma(plan: BwdPlan, cfg: TritonBackend, device: torch.device, tensors: list[torch.Tensor],
             widths: list[int]) -> bool:
    """TMA when the plan or config asks for it (None = on for sm90+ GPUs) and the tensors allow it."""
    want = plan.tma if plan.tma is not None else cfg.enable_tma
    if want is None:
        want = device.type == "cuda" and not hw.interpreter_on() and hw.capability_major(device) >= 9
    return bool(want) and _tma_ok(tensors, widths)


def _alloc_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (triton.set_allocator)."""
    del alignment, stream
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


def _ensure_allocator() -> None:
    # the allocator is a per-thread context variable: set it in the thread that launches (autograd's
    # backward may run on a worker thread); leave a user's own allocator alone
    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        if not isinstance(_allocator.get(), NullAllocator):
            return
    except ImportError:  # pragma: no cover - layout of a future triton
        pass
    triton.set_allocator(_alloc_scratch)


# ------------------------------------------------------------------------------------- stride helpers
# Every tensor is described to the kernels as (batch, head, row, col) strides; varlen tensors get batch
# stride 0 and their rows are packed rows (the kernels add cu_seqlens starts).


# ------------------------------------------------------------------------------------------- launches


def _run(dout, q, k, v, lse, delta, *, varlen: bool, cu_q, cu_k, batch: int, max_q: int, max_k: int,
         mask: torch.Tensor | None, dmask_buf: torch.Tensor | None, dmask_atomic: bool, dropout_p: float,
         rng: torch.Tensor | None, causal: bool, scale: float, plan: BwdPlan,
         cfg: TritonBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the dK/dV (and dQ) kernels; returns (dq, dk, dv) in the input dtypes."""
    if varlen:
        _, hq, d = q.shape
        hkv = k.shape[1]
        s4, s3 = _s4_thd, _s3_ht
    else:
        _, hq, _, d = q.shape
        hkv = k.shape[1]
        s4, s3 = _s4_dense, _s3_dense
    group = hq // hkv
    kv_store = grad_storage_dtype(cfg.grad_kv_storage_dtype) or k.dtype
    dk = torch.empty(k.shape, dtype=kv_store, device=k.device)
    dv = torch.empty(v.shape, dtype=kv_store, device=v.device)
    if plan.split:
        dqa = torch.empty(q.shape, dtype=grad_storage_dtype(cfg.grad_q_storage_dtype) or q.dtype, device=q.device)
    else:
        dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    interp = hw.interpreter_on()
    dummy = delta
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    if mask is not None:
        mask_t = mask.view(torch.int8) if mask.dtype == torch.bool else mask
        sm = _s4_dense(mask_t)
    else:
        mask_t, sm = dummy, (0, 0, 0, 0)
    sx = _s4_dense(dmask_buf) if dmask_buf is not None else (0, 0, 0, 0)
    dropout = dropout_p > 0.0
    p_thresh = dropout_threshold(dropout_p) if dropout else 0
    p_scale = 1.0 / (1.0 - dropout_p) if dropout else 1.0
    nq_arg = 0 if varlen else q.shape[2]
    nkv_arg = 0 if varlen else k.shape[2]
    cu_q_t = cu_q if varlen else dummy
    cu_k_t = cu_k if varlen else dummy
    rng_t = rng if dropout else dummy
    kc = plan.dkdv
    widths = [w for _, w, _ in slice_groups(d, kc.slice_d)] + [kc.block_k]
    tma_tensors = [q, k, v, dout] + ([] if plan.split else [dqa])
    if plan.split:
        widths += [w for _, w, _ in slice_groups(d, plan.dq.slice_d)] + [plan.dq.block_k]
    use_tma = _use_tma(plan, cfg, q.device, tma_tensors, widths)
    if use_tma and q.device.type == "cuda":
        _ensure_allocator()
    common = dict(CAUSAL=causal, MASK_KIND=mask_kind, DROPOUT=dropout, VARLEN=varlen, USE_TMA=use_tma,
                  INTERP=interp)
    for gi, (d0, width, count) in enumerate(slice_groups(d, kc.slice_d)):
        grid = (triton.cdiv(max_k, kc.block_n) * count, batch * hkv)
        _bwd_dkdv_kernel[grid](
            q, k, v, dout, lse, delta, dqa, dk, dv, mask_t, dmask_buf if dmask_buf is not None else dummy,
            rng_t, cu_q_t, cu_k_t,
            *s4(q), *s4(k), *s4(v), *s4(dout), *s3(lse), *s3(delta), *s4(dqa), *s4(dk), *sm, *sx,
            hq, hkv, nq_arg, nkv_arg, d, d0, count, scale, scale * LOG2E, p_thresh, p_scale,
            GROUP=group, BM=kc.block_m, BN=kc.block_n, BK=chunk_width(kc.block_k, d0, width), DS=width,
            NJ=2 if kc.halves and width >= 32 else 1, MASK_GRAD=dmask_buf is not None and gi == 0,
            DMASK_ATOMIC=dmask_atomic, DQ_ATOMIC=not plan.split, num_warps=kc.num_warps,
            num_stages=kc.num_stages, **common)
    if plan.split:
        qc = plan.dq
        for d0, width, count in slice_groups(d, qc.slice_d):
            grid = (triton.cdiv(max_q, qc.block_m) * count, batch * hq)
            _bwd_dq_kernel[grid](
                q, k, v, dout, lse, delta, dqa, mask_t, rng_t, cu_q_t, cu_k_t,
                *s4(q), *s4(k), *s4(v), *s4(dout), *s3(lse), *s3(delta), *s4(dqa), *sm,
                hq, nq_arg, nkv_arg, d, d0, count, scale, scale * LOG2E, p_thresh, p_scale,
                GROUP=group, BM=qc.block_m, BN=qc.block_n, BK=chunk_width(qc.block_k, d0, width), DS=width,
                num_warps=qc.num_warps, num_stages=qc.num_stages, **common)
    return dqa.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------ protocol


def dense_backward(dout, q, k, v, out, lse, *, dlse, attn_mask, mask_grad, dropout_p, rng, causal, scale,
                   config, plan: BwdPlan | None = None):
    """Split-D dense backward.

    Args:
        dout, out, q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]``; lse, dlse (optional): ``[B, Hq, Nq]``
        fp32; attn_mask: bool/float broadcastable to ``[B, Hq, Nq, Nkv]``; rng: int64 ``[2]`` (seed,
        offset) when ``dropout_p > 0``; config: a :class:`TritonBackend`; plan: force tiles (bench/tests).
    Returns:
        ``(dq, dk [B, Hkv, Nkv, D], dv, dmask)``; dmask has ``attn_mask``'s shape and dtype when
        ``mask_grad``, else None.
    """
    cfg = _as_triton(config)
    b, hq, nq, d = q.shape
    nkv = k.shape[2]
    delta = backward_delta(out, dout, dlse, varlen=False)
    mask = canonical_mask(attn_mask, b, hq, nq, nkv) if attn_mask is not None else None
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    mask_grad = bool(mask_grad and attn_mask is not None)

    def dmask_buffers():
        """(kernel buffer, atomic?, result buffer, reduce?) for d(mask); all None without mask_grad."""
        if not mask_grad:
            return None, False, None, False
        buf = torch.zeros(attn_mask.shape, dtype=torch.float32, device=q.device)
        view = canonical_mask(buf, b, hq, nq, nkv)
        broadcast = any(st == 0 and sz > 1 for st, sz in zip(view.stride(), view.shape))
        if broadcast and cfg.deterministic:  # no atomics: a full buffer, reduced by torch
            full = torch.zeros(b, hq, nq, nkv, dtype=torch.float32, device=q.device)
            return full, False, full, True
        return view, broadcast, buf, False

    def run(p: BwdPlan):
        xbuf, atomic, res, red = dmask_buffers()
        grads = _run(dout, q, k, v, lse, delta, varlen=False, cu_q=None, cu_k=None, batch=b, max_q=nq, max_k=nkv,
                     mask=mask, dmask_buf=xbuf, dmask_atomic=atomic, dropout_p=dropout_p, rng=rng, causal=causal,
                     scale=scale, plan=p, cfg=cfg)
        return grads, res, red

    if plan is not None:
        plan = fit_plan(plan, d)
    else:
        key = _tune_key(q, causal, cfg.split_launch or cfg.deterministic, mask_kind, mask_grad, dropout_p > 0,
                        False, hq // k.shape[1], nq, nkv)
        plan = _plan_for(d, cfg, q.device, key, bench=lambda p: autotune.bench_ms(lambda: run(p)))
    (dq, dk, dv), res, red = run(plan)
    dmask = None
    if res is not None:
        dmask = (reduce_to_shape(res, attn_mask.shape) if red else res).to(attn_mask.dtype)
    return dq, dk, dv, dmask


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, dlse, dropout_p, rng, causal, scale,
                    config, plan: BwdPlan | None = None):
    """Split-D packed (THD) backward; one launch for the whole batch (no per-sequence loop, no padding).

    Args:
        dout, out, q: ``[T_q, Hq, D]``; k, v: ``[T_k, Hkv, D]``; lse, dlse (optional): ``[Hq, T_q]`` fp32;
        cu_q, cu_k: int32 ``[B+1]``; max_q, max_k: longest sequence lengths (grid sizes).
    Returns:
        ``(dq [T_q, Hq, D], dk [T_k, Hkv, D], dv [T_k, Hkv, D])``.
    """
    cfg = _as_triton(config)
    d = q.shape[2]
    delta = backward_delta(out, dout, dlse, varlen=True)
    batch = cu_q.numel() - 1

    def run(p: BwdPlan):
        return _run(dout, q, k, v, lse, delta, varlen=True, cu_q=cu_q, cu_k=cu_k, batch=batch,
                    max_q=max(max_q, 1), max_k=max(max_k, 1), mask=None, dmask_buf=None, dmask_atomic=False,
                    dropout_p=dropout_p, rng=rng, causal=causal, scale=scale, plan=p, cfg=cfg)

    if plan is not None:
        plan = fit_plan(plan, d)
    else:
        key = _tune_key(q, causal, cfg.split_launch or cfg.deterministic, 0, False, dropout_p > 0, True,
                        q.shape[1] // k.shape[1], max_q, max_k)
        plan = _plan_for(d, cfg, q.device, key, bench=lambda p: autotune.bench_ms(lambda: run(p)))
    return run(plan)

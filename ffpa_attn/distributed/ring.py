"""Ring attention (context parallelism): exact attention of a sequence sharded over a process group.

Forward: each rank keeps its query shard and passes its K/V shard around the ring ``r -> r+1``. At step
``s`` it attends its queries to the K/V shard of rank ``r - s`` (the step plan of
:mod:`~ffpa_attn.distributed.schedule`: full, causal diagonal, or skipped) while the K/V of step ``s+1``
is already in flight, and merges the step's ``(out, lse)`` into fp32 accumulators with the -inf-safe
log-sum-exp merge :func:`ffpa_attn.common.lse.merge_partials`.

Backward: the ring runs again with the *globally merged* out/lse. At step ``s`` rank ``r`` computes the
step's ``(dq, dk, dv)`` through the package's low-level backward; dq accumulates locally, and dK/dV travel
with an fp32 accumulator buffer that follows the K/V around the ring (each rank adds its contribution and
passes it on) and lands back on its owner after one last hop.

Every call is a collective over ``group``: all ranks must call it (forward and backward) with shards of the
same shapes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..contract import BACKEND_KWARGS, check_dense, check_scale
from ..common.lse import merge_partials
from ..interface import explain, explain_varlen
from ..ops import autocast_inputs, autocast_off
from .comm import RingComm
from .layout import check_cu_seqlens, check_layout, local_cu_seqlens
from .runners import DenseRunner, VarlenRunner, add_rows_, put_rows_, take
from .schedule import dense_schedule, varlen_schedule

Runner = DenseRunner | VarlenRunner

_KV_TAG, _DKV_TAG = 0, 1  # distinct tags keep K/V and dK/dV messages apart on gloo


# ---------------------------------------------------------------------------------------------- the ring


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (same dtype) in one flat contiguous buffer: one message per ring hop."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a :func:`_pack` buffer shaped like ``k`` and ``v``."""
    nk = k.numel()
    return buf[:nk].view(k.shape), buf[nk:].view(v.shape)


def ring_forward(runner: Runner, comm: RingComm, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring: ``(out like q in q.dtype, lse fp32)`` of the local queries against all K/V."""
    kv = _pack(k, v)
    out_acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse_acc = torch.full(runner.lse_shape(q), float("-inf"), dtype=torch.float32, device=q.device)
    merged = runner.merge_view(out_acc)  # sequence dim = runner.lse_dim, like lse_acc
    d = runner.lse_dim
    for s, step in enumerate(runner.steps):
        pending = comm.start(kv, _KV_TAG) if s + 1 < comm.world else None
        if step.kind != "skip":
            ks, vs = _unpack(kv, k, v)
            out_p, lse_p = runner.forward(step, q, ks, vs)
            o, lse = merge_partials([take(merged, step.q_sel, d), runner.merge_view(out_p)],
                                    [take(lse_acc, step.q_sel, d), lse_p])
            put_rows_(merged, step.q_sel, d, o)
            put_rows_(lse_acc, step.q_sel, d, lse)
        if pending is not None:
            kv = pending.wait()
    return out_acc.to(q.dtype), lse_acc


def ring_backward(runner: Runner, comm: RingComm, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward ring from the merged ``out``/``lse``: ``(dq, dk, dv)`` of the local shards."""
    kv = _pack(k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kd = runner.q_dim  # the sequence dim of k/v is that of q
    pending_dkv = None
    dkv = None
    for s, step in enumerate(runner.steps):
        pending_kv = comm.start(kv, _KV_TAG) if s + 1 < comm.world else None
        grads = None
        if step.kind != "skip":
            ks, vs = _unpack(kv, k, v)
            grads = runner.backward(step, dout, q, ks, vs, out, lse, dlse)
        # the dK/dV accumulator of the K/V shard held now: started here at step 0, else from the previous rank
        dkv = pending_dkv.wait() if pending_dkv is not None else torch.zeros(kv.numel(), dtype=torch.float32,
                                                                             device=kv.device)
        if grads is not None:
            dq_p, dk_p, dv_p = grads
            add_rows_(dq, step.q_sel, runner.q_dim, dq_p.float())
            dk_acc, dv_acc = _unpack(dkv, k, v)
            add_rows_(dk_acc, step.kv_sel, kd, dk_p.float())
            add_rows_(dv_acc, step.kv_sel, kd, dv_p.float())
        if comm.world > 1:  # pass it on; after the last step this hop brings it home to its owner
            pending_dkv = comm.start(dkv, _DKV_TAG)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_dkv is not None:
        dkv = pending_dkv.wait()
    dk, dv = _unpack(dkv, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd over the ring: forward returns ``(out, lse)``; backward runs the ring again."""

    @staticmethod
    def forward(ctx, q, k, v, runner, comm):  # noqa: D401 - autograd signature
        with autocast_off(q.device.type):  # the inputs are cast already; the merges stay fp32
            out, lse = ring_forward(runner, comm, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runner, ctx.comm = runner, comm
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        with autocast_off(q.device.type):
            dq, dk, dv = ring_backward(ctx.runner, ctx.comm, dout, q, k, v, out, lse, dlse)
        return dq, dk, dv, None, None


# ------------------------------------------------------------------------------------------- public API


def _backend_kwargs(kwargs: dict, fn: str) -> dict:
    for key in kwargs:
        if key not in BACKEND_KWARGS:
            raise TypeError(f"{fn} got an unexpected keyword argument {key!r}; supported extension kwargs: "
                            f"{', '.join(BACKEND_KWARGS)}")
    return dict(kwargs)


def ring_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
    return_lse: bool = False,
    **kwargs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of a sequence sharded along N over the ranks of ``group`` (ring attention).

    Args:
        q: local query shard ``[B, Hq, N_local, D]`` (fp16/bf16 on the FFPA path).
        k, v: local key/value shards ``[B, Hkv, Nkv_local, D]``; same shapes on every rank.
        group: the process group forming the ring (default: the world).
        causal: global causal self-attention (query at global position p sees keys at positions <= p);
            needs ``Nkv_local == N_local``.
        scale: softmax scale, default 1/sqrt(D).
        enable_gqa: allow Hq != Hkv (query head h reads KV head h // (Hq // Hkv)); only Hkv heads travel.
        layout: how the global sequence is sharded: ``"zigzag"`` (rank r holds chunks r and 2R-1-r of 2R;
            balanced causal work) or ``"contiguous"`` (rank r holds piece r of R). See
            :mod:`ffpa_attn.distributed.layout` for shard/gather helpers and position ids.
        return_lse: also return the lse ``[B, Hq, N_local]`` fp32 (natural log of the scaled scores),
            differentiable.
        **kwargs: ``backend`` / ``forward_backend`` / ``backward_backend`` as in ``ffpa_attn_func``,
            passed to every step.

    Returns:
        ``out [B, Hq, N_local, D]`` in q's dtype (the local rows of the global attention), or
        ``(out, lse)``. Differentiable w.r.t. q, k, v; the backward is a collective too. Under ``torch.autocast``
        (fp16/bf16) q/k/v run in the region's dtype, as in :func:`ffpa_attn.ffpa_attn_func`.
    """
    q, k, v = autocast_inputs(q, k, v)
    bk = _backend_kwargs(kwargs, "ring_attn_func")
    check_layout(layout)
    if causal and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4 \
            and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal ring attention is global self-attention: q and k shards need the same length, "
                         f"got N_local={q.shape[2]} and Nkv_local={k.shape[2]}")
    prob = check_dense(q, k, v, None, 0.0, causal, scale, enable_gqa)
    if causal and layout == "zigzag" and prob.nq % 2:
        raise ValueError(f"zigzag layout needs an even local length (two chunks), got N_local={prob.nq}")
    # raise what a step would raise (dtype, backend availability) before any communication
    explain(q, k, v, is_causal=causal, scale=prob.scale, enable_gqa=enable_gqa, **bk)
    comm = RingComm(group)
    runner = DenseRunner(dense_schedule(comm.rank, comm.world, prob.nq, causal, layout), prob.scale, enable_gqa,
                         bk)
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), runner, comm)
    return (out, lse) if return_lse else out


def ring_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "zigzag",
    return_lse: bool = False,
    **kwargs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over packed sequences (THD) sharded along T over the ranks of ``group``.

    Args:
        q: local packed queries ``[T_local, Hq, D]``; k, v: ``[T_local, Hkv, D]`` (self-attention).
        cu_seqlens: *global* int32 ``[B+1]`` boundaries of the packed sequences (the same on every rank);
            ``cu_seqlens[-1] == T_local * world``. Contiguous layout: the packed stream is cut into R equal
            pieces (sequences may straddle ranks). Zigzag: every sequence is cut into 2R chunks (its length a
            multiple of 2R) and rank r holds chunks r and 2R-1-r of each, packed in sequence order.
            :func:`ffpa_attn.distributed.shard_varlen` produces the local shard.
        causal: causal within each sequence; softmax_scale: default 1/sqrt(D); enable_gqa: Hq != Hkv.
        layout, group, return_lse, kwargs: as in :func:`ring_attn_func` (lse is ``[Hq, T_local]``).

    Returns:
        ``out [T_local, Hq, D]`` or ``(out, lse)``; differentiable w.r.t. q, k, v; autocast as in
        :func:`ring_attn_func`.
    """
    q, k, v = autocast_inputs(q, k, v)
    bk = _backend_kwargs(kwargs, "ring_attn_varlen_func")
    check_layout(layout)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be an int32 tensor, got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [B+1], got shape {tuple(cu_seqlens.shape)}")
    comm = RingComm(group)
    cu = check_cu_seqlens(cu_seqlens, comm.world, layout)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D [T_local, Hq, D] tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if cu[-1] != q.shape[0] * comm.world:
        raise ValueError(f"cu_seqlens[-1]={cu[-1]} must equal T_local * world = {q.shape[0]} * {comm.world}")
    mine = local_cu_seqlens(cu, comm.rank, comm.world, layout)
    cu_local = torch.tensor(mine, dtype=torch.int32, device=q.device)
    max_local = max((b - a for a, b in zip(mine[:-1], mine[1:])), default=0)
    # shape/dtype/backend checks of the local problem: raise what a step would, before any communication
    explain_varlen(q, k, v, cu_local, cu_local, max_local, max_local, causal=causal, softmax_scale=softmax_scale,
                   enable_gqa=enable_gqa, **bk)
    scale = check_scale(softmax_scale, q.shape[-1], "softmax_scale")
    runner = VarlenRunner(varlen_schedule(cu, comm.rank, comm.world, causal, layout, q.device), scale,
                          enable_gqa, bk)
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), runner, comm)
    return (out, lse) if return_lse else out

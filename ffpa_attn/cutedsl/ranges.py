"""Block ranges and the varlen work list of the CuTeDSL kernels, as plain arithmetic (no cutlass import).

The one place that says which key blocks a query block reads (and which query blocks a key block is read by),
with tail-aligned causal masking per sequence (query row ``r`` of a sequence of ``Nq`` rows sees key ``k`` of
its ``Nk`` keys iff ``k <= r + Nk - Nq``, :func:`ffpa_attn.contract.causal_offset`). The functions take the
integer ``min`` / ``max`` as arguments so that the same text runs

* inside CuTeDSL kernels (:class:`ffpa_attn.cutedsl.block_info.BlockInfo` passes ``cutlass.min`` /
  ``cutlass.max``; the lengths are runtime ``Int32`` values, tiles and ``causal`` compile-time),
* on the host with Python ints (the pure model the tests check against the reference), and
* on torch tensors (:func:`varlen_work_items` builds the varlen work list on the GPU without a sync).

Every division has a non-negative numerator (the kernels' signed division truncates; Python's floors), so
the three agree.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..common.causal import causal_offset

if TYPE_CHECKING:  # torch is imported by the host-side functions only: the kernels import this module without it
    import torch

IntOp = Callable[[Any, Any], Any]


def ceil_div(a: Any, b: int) -> Any:
    """``ceil(a / b)`` for ``a >= 0``."""
    return (a + (b - 1)) // b


def key_block_range(m_block: Any, seqlen_q: Any, seqlen_k: Any, tile_m: int, tile_n: int, causal: bool,
                    imin: IntOp = min, imax: IntOp = max) -> tuple[Any, Any]:
    """``[n_block_min, n_block_max)``: the key blocks (``tile_n`` keys each) query block ``m_block``
    (``tile_m`` rows) of one sequence must read.

    Causal: up to the block of the last key the block's last real row (``< seqlen_q``) sees. A block whose
    rows see no key at all (causal with ``seqlen_q > seqlen_k``, or ``seqlen_k == 0``) gets
    ``n_block_max <= n_block_min``: its rows are out 0, lse -inf.
    """
    n_block_max = ceil_div(seqlen_k, tile_n)
    if causal:
        last_row = imin((m_block + 1) * tile_m, seqlen_q) - 1
        # keys 0 .. last_row + Nk - Nq: (last_row + Nk - Nq + 1) of them, if positive
        n_block_max = imin(n_block_max, ceil_div(imax(last_row + causal_offset(seqlen_q, seqlen_k) + 1, 0), tile_n))
    return 0, n_block_max


def masked_key_blocks(m_block: Any, seqlen_q: Any, seqlen_k: Any, tile_m: int, tile_n: int, causal: bool,
                      n_block_max: Any, imin: IntOp = min, imax: IntOp = max) -> Any:
    """How many of the key blocks ``[0, n_block_max)`` of query block ``m_block``, counted from the top
    (``n_block_max - 1`` down), need a mask: the block holding key ``seqlen_k - 1`` when it is partial, and
    (causal) every block some row of the query tile (all ``tile_m`` rows, from its first) does not fully see.
    The blocks below them are read without a mask."""
    unmasked_end = seqlen_k // tile_n  # blocks entirely below seqlen_k
    if causal:
        # the first row of the tile sees keys <= m_block * tile_m + Nk - Nq; later rows see more
        first_visible_end = imax(m_block * tile_m + causal_offset(seqlen_q, seqlen_k) + 1, 0)
        unmasked_end = imin(unmasked_end, first_visible_end // tile_n)
    return n_block_max - imax(imin(unmasked_end, n_block_max), 0)


def query_block_range(n_block: Any, seqlen_q: Any, seqlen_k: Any, tile_m: int, tile_n: int, causal: bool,
                      imin: IntOp = min, imax: IntOp = max) -> tuple[Any, Any]:
    """``[m_block_min, m_block_max)``: the query blocks (``tile_m`` rows) that read key block ``n_block``
    (``tile_n`` keys) of one sequence -- the inverse of :func:`key_block_range`, for the dK/dV kernel.

    Causal: from the block of the first row that sees key ``n_block * tile_n`` (row
    ``n_block * tile_n - (Nk - Nq)``). Empty (``m_block_max <= m_block_min``) when no row sees the block.
    """
    m_block_max = ceil_div(seqlen_q, tile_m)
    m_block_min = 0
    if causal:
        first_row = n_block * tile_n - causal_offset(seqlen_q, seqlen_k)
        m_block_min = imin(imax(first_row, 0) // tile_m, m_block_max)
    return m_block_min, m_block_max


# ------------------------------------------------------------------------------------------------------------
# varlen work list: one item per (sequence, query block), most key blocks first


def work_list_capacity(total_q: int, batch: int, tile_m: int) -> int:
    """Slots of the varlen work list: an upper bound of ``sum_i ceil(Nq_i / tile_m)`` over sequences whose
    lengths sum to at most ``total_q`` (each sequence wastes less than one block), known without reading
    ``cu_seqlens`` (no device sync)."""
    return ceil_div(total_q, tile_m) + batch


def varlen_work_items_model(lens_q: Sequence[int], lens_k: Sequence[int], tile_m: int, tile_n: int,
                            causal: bool, key_stationary: bool = False) -> list[tuple[int, int]]:
    """Pure-Python model of :func:`varlen_work_items`: the ``(sequence, m_block)`` items, sorted by the
    number of key blocks they read, most first (ties: sequence, then m_block, ascending); ``key_stationary``:
    ``(sequence, n_block)`` items sorted by the number of query blocks that read them."""
    items = []
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        for m in range(ceil_div(nk, tile_n) if key_stationary else ceil_div(nq, tile_m)):
            rng = query_block_range if key_stationary else key_block_range
            lo, hi = rng(m, nq, nk, tile_m, tile_n, causal)
            items.append((-(hi - lo), b, m))
    items.sort()
    return [(b, m) for _, b, m in items]


def varlen_work_items(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, tile_m: int,
                      tile_n: int, causal: bool, key_stationary: bool = False) -> torch.Tensor:
    """The varlen forward's work list, built with torch ops on the device of ``cu_seqlens_q`` (no host sync:
    its length is :func:`work_list_capacity`, not the real item count).

    Args:
        cu_seqlens_q, cu_seqlens_k: int ``[B+1]`` sequence boundaries (non-decreasing, last <= ``total_q``).
        total_q: rows of the packed q (``T_q``); ``key_stationary``: of the packed k (``T_k``).
        key_stationary: the dK/dV kernel's list instead: one item per (sequence, key block), sorted by the number
            of query blocks that read it (:func:`query_block_range`); capacity ``T_k / tile_n + B``.
    Returns:
        int32 ``[2, capacity]``: row 0 the sequence, row 1 the query block of each item; items sorted by the
        number of key blocks they read, most first (a long causal tail block never starts last), then by
        (sequence, block); unused slots at the end hold sequence -1 (their CTAs exit at once).

    Why this shape: one grid slot (per head) per item keeps the launch a single kernel with no padding to
    ``max_seqlen``, and sorting by work is what the dense kernel's reversed causal block order does for one
    sequence. Cost: a handful of tiny kernels per call (sort of ``T_q / tile_m + B`` keys).
    """
    import torch

    batch = cu_seqlens_q.numel() - 1
    cap = work_list_capacity(total_q, batch, tile_n if key_stationary else tile_m)
    dev = cu_seqlens_q.device
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    lens_q = cu_q[1:] - cu_q[:-1]
    lens_k = cu_k[1:] - cu_k[:-1]
    nblk = ceil_div(lens_k, tile_n) if key_stationary else ceil_div(lens_q, tile_m)
    ends = torch.cumsum(nblk, 0)
    slot = torch.arange(cap, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(ends, slot, right=True)  # == batch past the last real item
    valid = seq < batch
    seq_c = seq.clamp(max=max(batch - 1, 0))
    m_block = slot - (ends[seq_c] - nblk[seq_c]) if batch else slot
    tmin, tmax = _torch_ops()
    if batch:
        rng = query_block_range if key_stationary else key_block_range
        lo, hi = rng(m_block, lens_q[seq_c], lens_k[seq_c], tile_m, tile_n, causal, tmin, tmax)
        work = torch.where(valid, hi - lo, torch.full_like(slot, -1))
    else:
        work = torch.full_like(slot, -1)
    order = torch.argsort(work, descending=True, stable=True)
    items = torch.stack([torch.where(valid, seq, torch.full_like(seq, -1)), torch.where(valid, m_block, 0)])
    return items[:, order].to(torch.int32).contiguous()


# The work lists of recent boundary tensors. A model passes one cu_seqlens pair to every layer of a step: the list is
# built once for it (a dozen tiny kernels and a sort) instead of per launch. The key holds what identifies unchanged
# values without reading them: the tensors' identity (a weak reference, so a dead tensor is never matched through a
# reused id), their version counters (every in-place write through torch moves them), their data pointers (a
# storage swap) and the stream the list was built on (a launch on another stream would not wait for it). Bounded,
# least recently used out. Never consulted or filled during a CUDA-graph capture: the capture records the building
# kernels, so a replay with new boundary values copied into the same static tensors builds the new lists.
WORK_LIST_CACHE_SIZE = 32
_WORK_LISTS: OrderedDict = OrderedDict()
_WORK_LISTS_LOCK = threading.Lock()


def work_items(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, tile_m: int, tile_n: int,
               causal: bool, key_stationary: bool = False) -> torch.Tensor:
    """:func:`varlen_work_items`, built once per unchanged boundary tensors (same objects, same version counters and
    data pointers, same stream) and reused by later launches; built afresh during a CUDA-graph capture, for
    inference-mode tensors (no version counter) and after a write torch does not see (through ``.data``, a raw
    pointer or another framework: ``torch.autograd.graph.increment_version(cu_seqlens)`` makes such a write
    visible). The returned list is shared: kernels only read it."""
    from ..common.device import is_capturing

    if is_capturing():
        return varlen_work_items(cu_seqlens_q, cu_seqlens_k, total_q, tile_m, tile_n, causal, key_stationary)
    key = _boundaries_key(cu_seqlens_q, cu_seqlens_k)
    if key is None:
        return varlen_work_items(cu_seqlens_q, cu_seqlens_k, total_q, tile_m, tile_n, causal, key_stationary)
    key += (total_q, tile_m, tile_n, bool(causal), key_stationary)
    hit = _WORK_LISTS.get(key)
    if hit is not None and hit[0]() is cu_seqlens_q and hit[1]() is cu_seqlens_k:
        with _WORK_LISTS_LOCK:
            if key in _WORK_LISTS:
                _WORK_LISTS.move_to_end(key)
        return hit[2]
    items = varlen_work_items(cu_seqlens_q, cu_seqlens_k, total_q, tile_m, tile_n, causal, key_stationary)
    with _WORK_LISTS_LOCK:
        _WORK_LISTS[key] = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k), items)
        while len(_WORK_LISTS) > WORK_LIST_CACHE_SIZE:
            _WORK_LISTS.popitem(last=False)
    return items


def _boundaries_key(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple | None:
    """What identifies unchanged boundary values (see :data:`_WORK_LISTS`); None for inference-mode tensors."""
    import torch

    try:
        versions = (cu_q._version, cu_k._version)
    except RuntimeError:  # inference tensors: no version counter, so no way to see a change
        return None
    stream = torch.cuda.current_stream(cu_q.device).cuda_stream if cu_q.is_cuda else None
    return (id(cu_q), id(cu_k), *versions, cu_q.data_ptr(), cu_k.data_ptr(), stream)


def clear_work_lists() -> None:
    """Forget every kept work list (tests; the lists of live tensors are rebuilt at their next launch)."""
    with _WORK_LISTS_LOCK:
        _WORK_LISTS.clear()


def _torch_ops() -> tuple[IntOp, IntOp]:
    """Elementwise integer min / max on int64 tensors; a Python int operand becomes a clamp bound (no
    host-to-device copy, so nothing waits on the device)."""
    import torch

    def tmin(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.minimum(a, b)
        t, x = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        return t.clamp(max=x)

    def tmax(a: Any, b: Any) -> Any:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return torch.maximum(a, b)
        t, x = (a, b) if isinstance(a, torch.Tensor) else (b, a)
        return t.clamp(min=x)

    return tmin, tmax

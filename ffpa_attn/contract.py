"""Argument validation and the conventions every path shares (the one source of truth).

Everything that more than one backend, the reference, the bindings or the ring attention needs to agree on
lives here and nowhere else:

* shape / dtype / device validation of dense ``[B, H, N, D]`` and packed varlen ``[T, H, D]`` inputs;
* the causal convention: query row ``r`` of a sequence with ``Nq`` queries and ``Nkv`` keys sees key
  positions ``k <= r + (Nkv - Nq)`` (queries aligned to the KV tail, FlashAttention's convention);
* the GQA head mapping: query head ``h`` reads KV head ``h // (Hq // Hkv)``;
* the lse convention: natural-log log-sum-exp of the *scaled* (and biased) scores, fp32, shaped
  ``[B, Hq, Nq]`` (dense) or ``[Hq, T_q]`` (varlen); ``-inf`` for a row that sees no key;
* attention-mask canonicalization: a broadcastable mask becomes a stride-0 ``[B, Hq, Nq, Nkv]`` view;
* the float-mask floor (:data:`MASK_FLOOR`, :func:`add_float_mask`): how every kernel adds a float mask to
  the scores so that finite "large negative" masks (``finfo.min``, ``-1e9``) never overflow.

Kernels assume inputs that passed these checks.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import weakref
from dataclasses import dataclass

import torch

from .common.causal import causal_offset  # noqa: F401  (defined without torch for the kernel code)
from .common.device import is_capturing
from .common.env import env_flag

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FFPA_MIN_D_EXCLUSIVE = 256  # the FFPA range is (256, 1024]
FFPA_MAX_D = 1024

# kwargs of flash_attn_varlen_func that we recognize but do not implement (non-default -> NotImplementedError)
# (window_size is checked by no_window: any pair of None / negative sides means "no window")
VARLEN_REJECTED_KWARGS = {
    "softcap": (None, 0.0, 0),
    "sink": (None,),
    "attention_mask": (None,),
    "attn_mask": (None,),
    "block_mask": (None,),
    "score_mod": (None,),
    "aux_tensors": (None,),
    "num_splits": (None, 0, 1),
    "alibi_slopes": (None,),
}
BACKEND_KWARGS = ("backend", "forward_backend", "backward_backend")

# A float-mask entry at or below MASK_FLOOR (natural-log units) replaces the score by MASK_FLOOR itself.
# Why: masks filled with torch.finfo(dtype).min (transformers' padding convention) or -1e9 overflow to -inf
# once scaled by log2(e) for exp2, and a row whose maximum is that large cannot carry log(sum) in an fp32
# lse (the backward's P = exp(s - lse) would come back as 1 instead of 1/N). With the floor, an entry masked
# that way gets weight exp(MASK_FLOOR - max) = 0 next to any ordinary score, and a row masked that way
# everywhere is uniform over its keys (what SDPA returns for a row of equal huge negatives), with an lse
# MASK_FLOOR + log(N) that fp32 holds to ~1e-3. -inf stays -inf (the key is invisible). -2**14 keeps
# old-style -10000 masks additive.
MASK_FLOOR = -16384.0


def in_ffpa_range(d: int) -> bool:
    """True when head dim ``d`` is one FFPA's kernels are built for: 256 < d <= 1024."""
    return FFPA_MIN_D_EXCLUSIVE < d <= FFPA_MAX_D


def default_scale(d: int) -> float:
    """The softmax scale used when the caller passes None: 1/sqrt(D) (1.0 at D=0, where every score is 0
    and any finite scale gives SDPA's answer, the mean of V)."""
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


def kv_head(q_head: int, hq: int, hkv: int) -> int:
    """GQA mapping: the KV head that query head ``q_head`` reads."""
    return q_head // (hq // hkv)


def causal_mask(nq: int, nkv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool ``[Nq, Nkv]`` mask (True = visible) of the tail-aligned causal rule."""
    rows = torch.arange(nq, device=device).unsqueeze(1)
    cols = torch.arange(nkv, device=device).unsqueeze(0)
    return cols <= rows + causal_offset(nq, nkv)


def varlen_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                causal: bool) -> torch.Tensor:
    """Bool ``[T_q, T_k]`` mask (True = visible) of packed sequences: row r of sequence b sees the keys of sequence
    b, with the tail-aligned causal rule inside it; rows and keys outside every sequence see nothing. Built from the
    boundaries on their device without reading them on the host, so a CUDA-graph capture can record it (the
    fallbacks that otherwise split a varlen call per sequence use it then; it costs ``T_q x T_k`` memory)."""
    dev = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    batch = cu_q.numel() - 1
    rows, cols = torch.arange(total_q, device=dev), torch.arange(total_k, device=dev)
    # the sequence of each row / key (B past the last boundary); right=True skips empty sequences
    seq_r = torch.searchsorted(cu_q, rows, right=True) - 1
    seq_c = torch.searchsorted(cu_k, cols, right=True) - 1
    ok_r, ok_c = (seq_r >= 0) & (seq_r < batch), (seq_c >= 0) & (seq_c < batch)
    mask = (seq_r[:, None] == seq_c[None, :]) & ok_r[:, None] & ok_c[None, :]
    if causal and batch > 0:
        sr = seq_r.clamp(0, batch - 1)
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        pos_r = rows - cu_q[sr]
        pos_c = cols - cu_k[seq_c.clamp(0, batch - 1)]
        mask &= pos_c[None, :] <= (pos_r + causal_offset(len_q[sr], len_k[sr]))[:, None]
    return mask


def _dtype_error(name: str, dtype: torch.dtype) -> TypeError:
    """The FFPA path's dtype error, naming the two fixes (an explicit cast, or an autocast region, which casts
    fp32 inputs as it does for torch SDPA)."""
    return TypeError(
        f"{name}.dtype must be torch.float16 or torch.bfloat16 on the FFPA path, got {dtype}: cast the inputs "
        f"(e.g. .to(torch.bfloat16)) or, for float32 inputs (mixed-precision training), call inside "
        f"torch.autocast(device_type, dtype=torch.bfloat16)"
    )


def check_dtype(t: torch.Tensor, name: str) -> None:
    """TypeError unless ``t`` is fp16 or bf16 (the FFPA path's dtypes)."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise _dtype_error(name, t.dtype)


def check_ffpa_dtype(prob: "DenseProblem | VarlenProblem") -> None:
    """TypeError unless a validated problem's dtype is one the FFPA kernels take (the rule of the FFPA path: a head
    dim in (256, 1024] with no backend named, or a named FFPA backend)."""
    if prob.dtype not in SUPPORTED_DTYPES:
        raise _dtype_error("query", prob.dtype)


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _layout_hint(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """The tail of a head-count message when the inputs look like flash-attn's ``[B, N, H, D]``: their dims 1 and 2
    swapped give head counts that work, and dim 1 (read as heads) is the longer one for query or key (heads are
    usually fewer than tokens). An empty string otherwise."""
    hq, hkv, hv = query.shape[2], key.shape[2], value.shape[2]
    if hkv == 0 or hkv != hv or hq % hkv:
        return ""
    if query.shape[1] <= hq and key.shape[1] <= hkv:
        return ""
    return ("; did you pass [B, N, H, D] (flash-attn's layout)? the dense calls take SDPA's [B, H, N, D]: "
            "use .transpose(1, 2) on query, key and value")


def _kvcache_layout_hint(q: torch.Tensor, hkv: int) -> str:
    """The tail of the KV-cache head-count message when q looks like SDPA's ``[B, Hq, Nq, D]``: its dim 1, read as
    heads, is a multiple of the cache's Hkv. An empty string otherwise."""
    if hkv < 1 or q.shape[1] % hkv:
        return ""
    return ("; did you pass q as [B, Hq, Nq, D] (SDPA's layout)? ffpa_attn_with_kvcache takes flash-attn's "
            "[B, Nq, Hq, D]: use q.transpose(1, 2)")


def _check_same(tensors: dict[str, torch.Tensor], attr: str) -> None:
    vals = {n: getattr(t, attr) for n, t in tensors.items()}
    if len(set(vals.values())) > 1:
        desc = ", ".join(f"{n}.{attr}={v}" for n, v in vals.items())
        raise ValueError(f"query/key/value must share {attr}: {desc}")


# Scalar arguments: one rule each for every entry point (dense, varlen, low-level).
# Reals: Python int/float and numpy scalars (numbers.Real; SDPA accepts np.float32 too); not bool, not a
# tensor (a tensor scale would need a device sync or a recompile per value). Flags: Python bool only, as
# SDPA's is_causal (an int is almost always a positional-argument mistake). Lengths: Python or numpy ints.


def check_real(value: object, name: str) -> float:
    """``float(value)`` for a real Python/numpy scalar; TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (float, int or numpy scalar), got {type(value).__name__}")
    return float(value)


def check_flag(value: object, name: str) -> bool:
    """``value`` when it is a bool; TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_length(value: object, name: str) -> int:
    """``int(value)`` for a non-negative Python/numpy integer; TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_scale(scale: float | None, d: int, name: str = "scale") -> float:
    """Resolve the softmax scale (None -> 1/sqrt(D)); ValueError for a non-finite value."""
    if scale is None:
        return default_scale(d)
    s = check_real(scale, name)
    if not math.isfinite(s):
        raise ValueError(f"{name} must be finite, got {scale}")
    return s


def check_dropout(dropout_p: float) -> float:
    """``dropout_p`` as a float in [0, 1); TypeError / ValueError naming it otherwise."""
    p = check_real(dropout_p, "dropout_p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return p


@dataclass(frozen=True)
class DenseProblem:
    """A validated dense attention call. Shapes: q [B, Hq, Nq, D], k/v [B, Hkv, Nkv, D(v)]."""

    batch: int
    hq: int
    hkv: int
    nq: int
    nkv: int
    d: int
    dv: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float
    dropout_p: float
    mask_kind: str  # "none" | "bool" | "float"
    mask_requires_grad: bool

    @property
    def group(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.hq // self.hkv

    @property
    def has_mask(self) -> bool:
        return self.mask_kind != "none"


def check_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> DenseProblem:
    """Validate a dense call (everything but the dtype, which only the FFPA path restricts).

    Raises ValueError for bad ranks, mixed dtypes/devices, mismatched batch/heads/lengths, head counts
    that do not divide (or differ with ``enable_gqa=False``), causal with Nkv < Nq, or a mask that does not
    broadcast to ``[B, Hq, Nq, Nkv]``.
    """
    tensors = {"query": _check_tensor(query, "query"), "key": _check_tensor(key, "key"),
               "value": _check_tensor(value, "value")}
    for n, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(f"{n} must be 4-D [B, Nh, N, D], got shape {tuple(t.shape)}")
    _check_same(tensors, "dtype")
    _check_same(tensors, "device")
    b, hq, nq, d = query.shape
    bk, hkv, nkv, dk = key.shape
    bv, hv, nv, dv = value.shape
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: query {b}, key {bk}, value {bv}")
    if hkv != hv or nkv != nv:
        raise ValueError(
            f"key and value must share Nh_kv (num_heads) and Nkv (seqlen): key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}"
        )
    if dk != d:
        raise ValueError(f"query and key head dims differ: query D={d}, key D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Nh_q={hq} must be a multiple of Nh_kv={hkv} (query num_heads over key/value "
                         f"num_heads){_layout_hint(query, key, value)}")
    if hq != hkv and not enable_gqa:
        raise ValueError(
            f"Nh_q={hq} != Nh_kv={hkv} with enable_gqa=False (query and key/value num_heads differ); pass "
            f"enable_gqa=True for GQA/MQA{_layout_hint(query, key, value)}"
        )
    check_flag(is_causal, "is_causal")
    if is_causal and nkv < nq:
        raise ValueError(
            f"is_causal=True needs Nkv >= Nq (key seqlen >= query seqlen; queries are aligned to the KV tail), "
            f"got Nq={nq}, Nkv={nkv}"
        )
    p = check_dropout(dropout_p)
    s = check_scale(scale, d)
    mask_kind = "none"
    mask_grad = False
    if attn_mask is not None:
        _check_tensor(attn_mask, "attn_mask")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask.device={attn_mask.device} differs from query.device={query.device}")
        if attn_mask.dtype == torch.bool:
            mask_kind = "bool"
        elif attn_mask.is_floating_point():
            mask_kind = "float"
            mask_grad = attn_mask.requires_grad
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        canonical_mask(attn_mask, b, hq, nq, nkv)  # raises if it does not broadcast
    return DenseProblem(b, hq, hkv, nq, nkv, d, dv, query.dtype, query.device, bool(is_causal), s, p,
                        mask_kind, mask_grad)


def normalize_mask(attn_mask: torch.Tensor | None, query_dtype: torch.dtype) -> torch.Tensor | None:
    """The mask every path receives (call after :func:`check_dense` accepted it).

    Rank: leading unit dims are added up to 4-D (a view: ``[Nkv]`` -> ``[1, 1, 1, Nkv]``), so every consumer
    indexes the same four dims. Dtype: bool, the query's dtype and float32 pass unchanged (what torch SDPA
    accepts); any other float (float64, or bf16 with fp16 queries, ...) becomes float32, with finite values
    beyond float32's range saturated to its finite extremes so a finite "masked" value stays finite
    (:data:`MASK_FLOOR`); -inf stays -inf. Autograd flows back to the caller's mask through these ops.
    """
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dtype not in (torch.bool, query_dtype, torch.float32):
        if torch.finfo(m.dtype).max > torch.finfo(torch.float32).max:  # float64: saturate, do not overflow
            fin = torch.finfo(torch.float32)
            m = torch.where(torch.isinf(m), m, m.clamp(fin.min, fin.max))
        m = m.to(torch.float32)
    if m.dim() < 4:
        m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    return m


def add_float_mask(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``scores + bias`` with the :data:`MASK_FLOOR` rule (torch twin of the Triton ``add_float_mask``).

    scores: fp32 scaled scores (natural log units); bias: the float mask, broadcastable to scores.
    Entries with ``bias <= MASK_FLOOR`` become ``MASK_FLOOR`` (``-inf`` where the bias is ``-inf``).
    """
    bias = bias.to(scores.dtype)
    floor = torch.where(torch.isneginf(bias), float("-inf"), MASK_FLOOR)
    return torch.where(bias > MASK_FLOOR, scores + bias, floor)


def canonical_mask(mask: torch.Tensor, b: int, hq: int, nq: int, nkv: int) -> torch.Tensor:
    """View ``mask`` as ``[B, Hq, Nq, Nkv]`` (broadcast dims get stride 0; nothing is copied)."""
    if mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    try:
        return mask.expand(b, hq, nq, nkv)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to [B, Nh_q, Nq, Nkv]="
            f"{[b, hq, nq, nkv]}"
        ) from None


def reduce_to_shape(grad: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Sum a ``[B, Hq, Nq, Nkv]`` gradient over the dims a mask of ``shape`` was broadcast along."""
    lead = grad.dim() - len(shape)
    if lead:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(shape)


@dataclass(frozen=True)
class VarlenProblem:
    """A validated varlen call. q [T_q, Hq, D], k/v [T_k, Hkv, D], cu_seqlens int32 [B+1]."""

    batch: int
    total_q: int
    total_k: int
    hq: int
    hkv: int
    d: int
    dv: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float
    dropout_p: float
    page: int | None = None  # paged K/V caches [num_blocks, page, Hkv, D] read through a block table
    seqused_k: bool = False  # per-sequence key counts (seqused_k) bound the keys each sequence uses

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def forward_only(self) -> bool:
        """The serving forms (paged K/V, seqused_k) have no backward."""
        return self.page is not None or self.seqused_k


def _check_cu_seqlens_meta(cu: torch.Tensor, name: str, device: torch.device) -> None:
    _check_tensor(cu, name)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length B+1 >= 1, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}.device={cu.device} differs from q.device={device}")


def _check_cu_seqlens_values(vals: list[int], name: str, total: int, max_seqlen: int,
                             max_name: str) -> list[int]:
    """Check boundaries read from the device; returns the per-sequence lengths."""
    if vals[0] != 0:
        raise ValueError(f"{name} must start at 0, got {vals[0]}")
    lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{name} must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1]={vals[-1]} must equal the packed length {total}")
    if lens and max(lens) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence ({max(lens)})")
    return lens


# Boundary tensors already checked: (weakref q, its version, weakref k, its version, the call's scalars). A model
# builds cu_seqlens once per batch and passes the same tensors to every layer; reading them on the host each time
# is a device sync per call, which leaves the GPU idle while the call's host work runs. A tensor is read again
# when it is another object, or the same one changed in place (its version counter moved); inference-mode
# tensors have no version counter and are always read.
_CHECKED_BOUNDARIES: list[tuple] = []
_CHECKED_MAX = 8


def _boundaries_key(cu_q: torch.Tensor, cu_k: torch.Tensor, scalars: tuple) -> tuple | None:
    try:
        return (weakref.ref(cu_q), cu_q._version, weakref.ref(cu_k), cu_k._version, scalars)
    except (RuntimeError, TypeError):  # inference tensors: no version counter
        return None


def _already_checked(cu_q: torch.Tensor, cu_k: torch.Tensor, scalars: tuple) -> bool:
    for rq, vq, rk, vk, sc in _CHECKED_BOUNDARIES:
        if rq() is cu_q and rk() is cu_k and sc == scalars and (vq, vk) == (cu_q._version, cu_k._version):
            return True
    return False


def check_varlen_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                        max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> None:
    """The value checks of a varlen call (one device-to-host copy of both boundary tensors, skipped for the same
    unchanged tensors with the same scalars as a recent call: :data:`_CHECKED_BOUNDARIES`).

    ValueError unless both start at 0, never decrease, end at the packed lengths ``total_q`` / ``total_k``,
    no sequence is longer than its ``max_seqlen`` (the kernels' grids are sized by it: a longer sequence
    would leave output rows unwritten) and, with ``causal``, no sequence has fewer keys than queries.

    Not checked (the caller's promise) during a CUDA-graph capture, which cannot wait for the device (a replay
    runs on whatever values the static boundary tensors then hold, so they must keep those promises), and with
    ``FFPA_ATTN_VARLEN_VALUE_CHECKS=0``.
    """
    if is_capturing() or not env_flag("FFPA_ATTN_VARLEN_VALUE_CHECKS"):
        return
    scalars = (total_q, total_k, max_seqlen_q, max_seqlen_k, causal)
    key = _boundaries_key(cu_seqlens_q, cu_seqlens_k, scalars)
    if key is not None and _already_checked(cu_seqlens_q, cu_seqlens_k, scalars):
        return
    _check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, causal)
    if key is not None:
        _remember_boundaries(key)


def _remember_boundaries(key: tuple) -> None:
    _CHECKED_BOUNDARIES[:] = [e for e in _CHECKED_BOUNDARIES if e[0]() is not None][-(_CHECKED_MAX - 1):] + [key]


def _check_varlen_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool) -> None:
    both = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()
    nq_b = cu_seqlens_q.numel()
    lq = _check_cu_seqlens_values(both[:nq_b], "cu_seqlens_q", total_q, max_seqlen_q, "max_seqlen_q")
    lk = _check_cu_seqlens_values(both[nq_b:], "cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k")
    if causal:
        bad = [i for i, (a, b) in enumerate(zip(lq, lk)) if b < a]
        if bad:
            i = bad[0]
            raise ValueError(
                f"causal=True needs Nk_i >= Nq_i for every sequence (tail-aligned), sequence {i} has "
                f"Nq={lq[i]}, Nk={lk[i]}"
            )


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    causal: bool,
    softmax_scale: float | None,
    enable_gqa: bool,
    validate_values: bool = True,
) -> VarlenProblem:
    """Validate a packed THD call. ``validate_values=False`` skips the host sync that reads cu_seqlens.

    Causal with a sequence whose key length is shorter than its query length raises ValueError.
    """
    tensors = {"q": _check_tensor(q, "q"), "k": _check_tensor(k, "k"), "v": _check_tensor(v, "v")}
    for n, t in tensors.items():
        if t.dim() != 3:
            raise ValueError(f"{n} must be 3-D [T, H, D], got shape {tuple(t.shape)}")
    names = {"query": q, "key": k, "value": v}
    _check_same(names, "dtype")
    _check_same(names, "device")
    tq, hq, d = q.shape
    tk, hkv, dk = k.shape
    tv, hv, dv = v.shape
    if tk != tv or hkv != hv:
        raise ValueError(f"k and v must share T_k (total seqlen) and H_kv (num_heads): k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    _check_varlen_heads(hq, hkv, d, dk, enable_gqa)
    max_seqlen_q = check_length(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = check_length(max_seqlen_k, "max_seqlen_k")
    check_flag(causal, "causal")
    _check_cu_seqlens_meta(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_cu_seqlens_meta(cu_seqlens_k, "cu_seqlens_k", q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length B+1, got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    if validate_values:
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, tq, tk, max_seqlen_q, max_seqlen_k, bool(causal))
    return VarlenProblem(cu_seqlens_q.numel() - 1, tq, tk, hq, hkv, d, dv, max_seqlen_q, max_seqlen_k,
                         q.dtype, q.device, bool(causal), check_scale(softmax_scale, d, "softmax_scale"),
                         check_dropout(dropout_p))


def _check_varlen_heads(hq: int, hkv: int, d: int, dk: int, enable_gqa: bool) -> None:
    if dk != d:
        raise ValueError(f"q and k head dims differ: q D={d}, k D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"H_q={hq} must be a multiple of H_kv={hkv} (q num_heads over k/v num_heads)")
    if hq != hkv and not enable_gqa:
        raise ValueError(f"H_q={hq} != H_kv={hkv} with enable_gqa=False (q and k/v num_heads differ); pass "
                         f"enable_gqa=True for GQA/MQA")


def check_paged_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int | None,
    seqused_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
    dropout_p: float,
    causal: bool,
    softmax_scale: float | None,
    enable_gqa: bool,
) -> VarlenProblem:
    """Validate the metadata of a varlen call in a serving form (no device access; the values:
    :func:`check_paged_varlen_values`). Forward only: ``dropout_p > 0`` raises NotImplementedError.

    * ``block_table`` int32 ``[B, max_pages]``: k / v are paged caches ``[num_blocks, page, Hkv, D]`` (the KV-cache
      layout rules of :func:`check_kvcache`: page a multiple of 16, unit stride on D, naming ``k`` / ``v``);
      sequence b's keys are its first ``seqused_k[b]`` positions, or, without ``seqused_k``,
      ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` of them (flash-attn's rule; the boundaries then only give the
      counts). ``max_seqlen_k`` is not used (the table's capacity bounds every sequence).
    * ``seqused_k`` int32 ``[B]`` without a table: k / v are packed ``[T_k, Hkv, D]`` with the usual
      ``cu_seqlens_k``, and sequence b uses keys ``cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b]``.
    """
    if block_table is None:
        prob = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                            softmax_scale, enable_gqa, validate_values=False)
        _int32_vector(seqused_k, "seqused_k", prob.batch, q.device)
        prob = dataclasses.replace(prob, seqused_k=True)
    else:
        q = _check_tensor(q, "q")
        if q.dim() != 3:
            raise ValueError(f"q must be 3-D [T_q, Hq, D], got shape {tuple(q.shape)}")
        _check_cu_seqlens_meta(cu_seqlens_q, "cu_seqlens_q", q.device)
        batch = cu_seqlens_q.numel() - 1
        _check_cache_layout(k, v, block_table, None, batch, names=("k", "v"))
        if q.dtype != k.dtype or q.device != k.device:
            raise ValueError(f"q ({q.dtype}, {q.device}) and k ({k.dtype}, {k.device}) must share dtype and device")
        tq, hq, d = q.shape
        _check_varlen_heads(hq, k.shape[2], d, k.shape[3], enable_gqa)
        if seqused_k is not None:
            _int32_vector(seqused_k, "seqused_k", batch, q.device)
        elif cu_seqlens_k is None:
            raise ValueError("block_table needs the key count of each sequence: seqused_k (int32 [B]) or "
                             "cu_seqlens_k")
        else:
            _check_cu_seqlens_meta(cu_seqlens_k, "cu_seqlens_k", q.device)
            if cu_seqlens_k.numel() != batch + 1:
                raise ValueError(f"cu_seqlens_k must have length B+1 = {batch + 1} (cu_seqlens_q's), got "
                                 f"{cu_seqlens_k.numel()}")
        if max_seqlen_k is not None:
            check_length(max_seqlen_k, "max_seqlen_k")
        check_flag(causal, "causal")
        prob = VarlenProblem(batch, tq, k.shape[0] * k.shape[1], hq, k.shape[2], d, d,
                             check_length(max_seqlen_q, "max_seqlen_q"), kvcache_capacity(k, block_table), q.dtype,
                             q.device, bool(causal), check_scale(softmax_scale, d, "softmax_scale"),
                             check_dropout(dropout_p), page=k.shape[1], seqused_k=True)
    if prob.dropout_p > 0:
        raise NotImplementedError(f"dropout_p={prob.dropout_p} with block_table / seqused_k: the serving forms of "
                                  "ffpa_attn_varlen_func are forward-only inference calls")
    return prob


def check_paged_varlen_values(prob: VarlenProblem, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
                              seqused_k: torch.Tensor, block_table: torch.Tensor | None, k: torch.Tensor) -> int:
    """The value checks of :func:`check_paged_varlen`'s calls, each tensor read once while unchanged (the varlen
    boundaries' rule). ``seqused_k``: the key counts (with a table and no ``seqused_k``, the caller passes
    ``cu_seqlens_k``'s differences). ValueError naming the argument unless ``cu_seqlens_q`` is well formed (starts
    at 0, non-decreasing, ends at T_q, no sequence longer than ``max_seqlen_q``) and: paged, every count lies in
    ``[0, capacity]`` and the block ids of every page a sequence occupies lie in ``[0, num_blocks)``
    (:func:`check_kvcache_values`, one source of truth with the KV-cache entry); packed, ``0 <= seqused_k[b] <=
    cu_seqlens_k[b+1] - cu_seqlens_k[b]`` and ``cu_seqlens_k`` as in :func:`check_varlen_values`.

    Causal rows that see no key (``seqused_k[b]`` below the sequence's query count) get out 0 and lse -inf, as in
    ``ffpa_attn_with_kvcache``. Skipped during a CUDA-graph capture and with ``FFPA_ATTN_VARLEN_VALUE_CHECKS=0``.
    Counts derived from ``cu_seqlens_k`` are a new tensor per call, so that form reads them on every call. Returns
    the keys the sequences hold in all when paged and checked, else 0.
    """
    if is_capturing() or not env_flag("FFPA_ATTN_VARLEN_VALUE_CHECKS"):
        return 0
    # remembered as the varlen boundaries are (_CHECKED_BOUNDARIES): packed, the pair (seqused_k, cu_seqlens_k);
    # paged, cu_seqlens_q alone (as a pair with itself); the counts and the table by check_kvcache_values_once
    if block_table is None:
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, prob.total_q, prob.total_k, prob.max_seqlen_q,
                            prob.max_seqlen_k, False)
        pair, scalars = (seqused_k, cu_seqlens_k), ("seqused_k",)
    else:
        pair, scalars = (cu_seqlens_q, cu_seqlens_q), ("paged", prob.total_q, prob.max_seqlen_q)
    key = _boundaries_key(*pair, scalars)
    if key is None or not _already_checked(*pair, scalars):
        if block_table is None:
            used = seqused_k.tolist()
            cu = cu_seqlens_k.tolist()
            for i, n in enumerate(used):
                if not 0 <= n <= cu[i + 1] - cu[i]:
                    raise ValueError(f"seqused_k[{i}] = {n} must lie in [0, {cu[i + 1] - cu[i]}] (sequence {i}'s keys "
                                     "in cu_seqlens_k)")
        else:
            _check_cu_seqlens_values(cu_seqlens_q.tolist(), "cu_seqlens_q", prob.total_q, prob.max_seqlen_q,
                                     "max_seqlen_q")
        if key is not None:
            _remember_boundaries(key)
    if block_table is None:
        return 0
    return check_kvcache_values_once(k, seqused_k, block_table, None, None, prob.batch, 0, "seqused_k")


def no_window(window_size: object) -> bool:
    """Whether ``window_size`` means full attention: ``None`` or a pair whose sides are each ``None`` (the
    flash-attn 4 default) or negative (flash-attn 2's ``(-1, -1)``). Anything else is a sliding window."""
    if window_size is None:
        return True
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        return False
    return all(side is None or (isinstance(side, int) and not isinstance(side, bool) and side < 0)
               for side in window_size)


def check_varlen_kwargs(kwargs: dict) -> dict:
    """Split varlen kwargs: reject recognized-unsupported ones, TypeError on unknown; return backend kwargs.

    ``deterministic`` (flash-attn's flag) must be a bool; True is honoured by the planner step of
    :mod:`ffpa_attn.interface` (the Triton backward's atomic-free split mode)."""
    out = {}
    for key, val in kwargs.items():
        if key in BACKEND_KWARGS:
            out[key] = val
        elif key == "window_size":
            if not no_window(val):
                raise NotImplementedError(f"ffpa_attn_varlen_func does not support window_size={val!r} "
                                          "(sliding-window attention)")
        elif key == "deterministic":
            if not isinstance(val, bool):
                raise TypeError(f"deterministic must be a bool, got {type(val).__name__}")
        elif key in VARLEN_REJECTED_KWARGS:
            defaults = VARLEN_REJECTED_KWARGS[key]
            is_default = any(val is dflt or (not isinstance(val, torch.Tensor) and val == dflt)
                             for dflt in defaults)
            if not is_default:
                raise NotImplementedError(f"ffpa_attn_varlen_func does not support {key}={val!r}")
        else:
            raise TypeError(f"ffpa_attn_varlen_func got an unexpected keyword argument {key!r}")
    return out


def check_dense_kwargs(kwargs: dict) -> dict:
    """TypeError for anything but backend / forward_backend / backward_backend."""
    for key in kwargs:
        if key not in BACKEND_KWARGS:
            raise TypeError(
                f"ffpa_attn_func got an unexpected keyword argument {key!r}; "
                f"supported extension kwargs: {', '.join(BACKEND_KWARGS)}"
            )
    return dict(kwargs)


# ------------------------------------------------------------------------------------------------- KV cache
# flash-attn's flash_attn_with_kvcache layouts: q [B, Nq, Hq, D]; a contiguous cache [B_cache, N_max, Hkv, D] (row
# cache_batch_idx[b], default b) or a paged one [num_blocks, page, Hkv, D] addressed by an int32 block_table
# [B, max_pages]; int32 cache_seqlens / cache_leftpad [B]; new keys/values k, v [B, Nq_new, Hkv, D] written at
# cache_seqlens[b] + t before attending over cache_seqlens[b] + Nq_new keys (tail-aligned causal per sequence).

KVCACHE_MAX_SPLITS = 256  # the combine kernel's bound on KV slices per sequence
KVCACHE_KWARGS = ("backend", "check_values")
# flash-attn 3 / 4 keywords of flash_attn_with_kvcache we recognize but do not implement (non-default ->
# NotImplementedError naming them)
KVCACHE_REJECTED_KWARGS = {
    "q_descale": (None,), "k_descale": (None,), "v_descale": (None,), "qv": (None,), "rotary_seqlens": (None,),
    "cache_seqlens_new": (None,), "cu_seqlens_q": (None,), "cu_seqlens_k_new": (None,), "max_seqlen_q": (None,),
    "attention_chunk": (None, 0), "sinks": (None,), "learnable_sink": (None,), "s_aux": (None,),
    "scheduler_metadata": (None,), "pack_gqa": (None,), "sm_margin": (0, None), "page_table": (None,),
}


@dataclass(frozen=True)
class KVCacheProblem:
    """A validated KV-cache call (:func:`check_kvcache`): q ``[B, Nq, Hq, D]`` over caches of ``capacity`` keys per
    sequence, ``n_new`` tokens appended first. ``num_splits``: the caller's request (0 = the planner's choice).
    ``dv``, ``dropout_p`` and ``mask_kind`` are there for the registry's generic feature checks."""

    batch: int
    nq: int
    hq: int
    hkv: int
    d: int
    n_new: int
    capacity: int
    page: int | None  # None: a contiguous cache
    num_blocks: int  # paged: blocks; contiguous: cache rows
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float
    has_seqlens: bool
    has_batch_idx: bool
    has_leftpad: bool
    num_splits: int = 0

    dv = property(lambda self: self.d)
    dropout_p = 0.0
    mask_kind = "none"

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def rows(self) -> int:
        """Query rows per KV head (the packed rows of the decode kernel): ``group * Nq``."""
        return self.group * self.nq


def kvcache_capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Keys one sequence can hold: ``max_pages * page`` (paged) or ``N_max`` (contiguous)."""
    if block_table is not None:
        return block_table.shape[1] * k_cache.shape[1]
    return k_cache.shape[1]


def _int32_vector(t: object, name: str, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [B]), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the cache on {device}")


def _check_cache_layout(k_cache: object, v_cache: object, block_table: object, cache_batch_idx: object,
                        batch: int, names: tuple[str, str] = ("k_cache", "v_cache")) -> None:
    """The caches' and the table's metadata; ``names``: how messages name the two caches (the varlen entry's
    paged caches are its ``k`` / ``v``)."""
    kn, vn = names
    for name, t in ((kn, k_cache), (vn, v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "[num_blocks, page, Hkv, D]" if block_table is not None else "[B_cache, N_max, Hkv, D]"
            hint = (" (a flat [tokens, Hkv, D] paged cache is addressed by a block table as its "
                    "[tokens // page, page, Hkv, D] view)" if t.dim() == 3 else "")
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}{hint}")
        if t.dtype not in SUPPORTED_DTYPES:
            # autocast casts q / k / v, never the caches: they are storage the call writes in place
            raise TypeError(f"{name}.dtype must be torch.float16 or torch.bfloat16, got {t.dtype}: the caches are "
                            "the caller's storage (written in place; torch.autocast does not cast them): allocate "
                            "them in torch.bfloat16 or torch.float16")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride on the head dim, got strides {tuple(t.stride())}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(f"{vn} {tuple(v_cache.shape)} {v_cache.dtype} {v_cache.device} must match {kn} "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}")
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [B, max_pages] with B = {batch}, got "
                             f"{tuple(block_table.shape)}")
        if block_table.shape[1] > 0 and block_table.stride(1) != 1:
            raise ValueError(f"block_table must have a unit stride along its pages, got {tuple(block_table.stride())}")
        if block_table.device != k_cache.device:
            raise ValueError(f"block_table is on {block_table.device}, the cache on {k_cache.device}")
        page = k_cache.shape[1]
        if page < 16 or page % 16:
            raise ValueError(f"the page size ({kn}.shape[1]) must be a positive multiple of 16, got {page}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the table maps each "
                             "sequence to its pages)")
    else:
        _int32_vector(cache_batch_idx, "cache_batch_idx", batch, k_cache.device)
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, fewer than the batch ({batch}); pass "
                             "cache_batch_idx to map sequences to cache rows")


def check_kvcache(q: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                  cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                  cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
                  batch: int | None = None, values: bool = True) -> None:
    """Validate a KV-cache call; raises TypeError (dtypes) or ValueError (shapes, layouts, values), naming the
    argument.

    Always (no device access, fine under CUDA-graph capture and torch.compile): ranks, shapes, dtypes (fp16 / bf16
    data, int32 lengths, tables and indices), devices, unit stride on D for the caches, page size a multiple of 16,
    block_table and cache_batch_idx not together, k and v together and only with lengths. With ``values=True``
    (:func:`check_kvcache_values`: reads lengths and tables to the host, a device sync; refused while a CUDA graph
    is being captured): lengths within the capacity, cache rows and the block-table entries of every page a
    sequence occupies in range.

    Args:
        q: ``[B, Nq, Hq, D]`` (None: cache-only calls such as the packed gather; then ``batch`` gives B).
        k_cache, v_cache: ``[num_blocks, page, Hkv, D]`` with ``block_table``, else ``[B_cache, N_max, Hkv, D]``.
        k, v: new keys / values ``[B, Nq_new, Hkv, D]`` (written at ``cache_seqlens``) or None.
        cache_seqlens: int or int32 ``[B]``; None = full capacity (not allowed with k / v).
        block_table: int32 ``[B, max_pages]``; cache_batch_idx, cache_leftpad: int32 ``[B]``.
    """
    if q is not None:
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 4:
            raise ValueError(f"q must be 4-D [B, Nq, Hq, D], got shape {tuple(q.shape)}")
        if q.dtype not in SUPPORTED_DTYPES:
            raise _dtype_error("q", q.dtype)
        batch = q.shape[0]
    if batch is None:
        raise ValueError("check_kvcache needs q or batch")
    _check_cache_layout(k_cache, v_cache, block_table, cache_batch_idx, batch)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if q is not None:
        if q.dtype != k_cache.dtype or q.device != k_cache.device:
            raise ValueError(f"q ({q.dtype}, {q.device}) and k_cache ({k_cache.dtype}, {k_cache.device}) must "
                             "share dtype and device")
        if q.shape[3] != d:
            raise ValueError(f"q's head dim {q.shape[3]} != the cache's {d}")
        if hkv < 1 or q.shape[2] % hkv:
            raise ValueError(f"Hq = {q.shape[2]} must be a multiple of the cache's Hkv = {hkv}"
                             f"{_kvcache_layout_hint(q, hkv)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    n_new = 0
    if k is not None:
        if cache_seqlens is None:
            raise ValueError("appending k / v needs cache_seqlens (where the new tokens go)")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != k_cache.dtype or t.device != k_cache.device:
                raise ValueError(f"{name} ({t.dtype}, {t.device}) must match the cache ({k_cache.dtype}, "
                                 f"{k_cache.device})")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != (hkv, d):
                raise ValueError(f"{name} must have shape [B, Nq_new, Hkv, D] = [{batch}, *, {hkv}, {d}], got "
                                 f"{tuple(t.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        n_new = k.shape[1]
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor [B], got {type(cache_seqlens).__name__}")
        _int32_vector(cache_seqlens, "cache_seqlens", batch, k_cache.device)
    _int32_vector(cache_leftpad, "cache_leftpad", batch, k_cache.device)
    if values:
        check_kvcache_values(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, n_new)


_SMALL_TABLE = 1024  # up to this many block-table entries, the min / max is taken on Python ints (cheaper than
# a torch op and a slice at decode sizes)


def check_kvcache_values(k_cache: torch.Tensor, cache_seqlens: int | torch.Tensor | None,
                         block_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                         cache_leftpad: torch.Tensor | None, batch: int, n_new: int,
                         seqlens_name: str = "cache_seqlens") -> int:
    """The value checks of a KV-cache call (one device-to-host copy of the lengths, tables and indices, then the
    per-sequence checks on Python ints and one min / max of the table; the page-by-page check only when the table
    holds an entry outside ``[0, num_blocks)`` somewhere, e.g. transformers' -1 past a sequence's pages); returns the
    number of keys the sequences hold in all (``sum_b cache_seqlens[b] + n_new - cache_leftpad[b]``).

    ValueError unless ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + n_new <= capacity``,
    ``0 <= cache_leftpad[b] <= cache_seqlens[b]``, cache rows lie in ``[0, B_cache)`` and every block-table entry of
    a page the sequence occupies lies in ``[0, num_blocks)`` (entries past a sequence's pages are never read and may
    hold anything, e.g. transformers' -1). RuntimeError while a CUDA graph is being captured (the read would break
    the capture): validate before the capture and skip the checks inside it. ``seqlens_name``: how messages name the
    lengths (the paged varlen entry's are ``seqused_k``).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("checking KV-cache lengths and tables reads them on the host, which a CUDA graph "
                           "capture forbids: validate before capture and pass check_values=False inside it")
    capacity = kvcache_capacity(k_cache, block_table)
    vectors = [t for t in (cache_seqlens, cache_leftpad, cache_batch_idx) if isinstance(t, torch.Tensor)]
    parts = vectors + ([block_table.reshape(-1)] if block_table is not None else [])
    n_rows = batch * len(vectors)
    host, rows, flat_table = None, [], None
    if parts:  # one copy to the host (a sync on a GPU) for everything
        host = (parts[0] if len(parts) == 1 else torch.cat(parts)).detach().cpu()
        if block_table is None or block_table.numel() <= _SMALL_TABLE:  # all of it as Python ints: one call
            values = host.tolist()
            rows, flat_table = values[:n_rows], values[n_rows:]
        else:
            rows = host[:n_rows].tolist()
    at = 0

    def vector(t: torch.Tensor | None) -> list[int] | None:
        nonlocal at
        if not isinstance(t, torch.Tensor):
            return None
        at += batch
        return rows[at - batch:at]

    seqs, pads, idx = vector(cache_seqlens), vector(cache_leftpad), vector(cache_batch_idx)
    if cache_seqlens is None:
        ends = [capacity] * batch
    else:
        seqs = seqs if seqs is not None else [int(cache_seqlens)] * batch
        for i, s in enumerate(seqs):
            if s < 0:
                raise ValueError(f"{seqlens_name}[{i}] = {s} is negative")
        ends = [s + n_new for s in seqs]
        for i, e in enumerate(ends):
            if e > capacity:
                new = f" + {n_new} new tokens = {e}" if n_new else ""
                raise ValueError(f"sequence {i}: {seqlens_name} {seqs[i]}{new} is past the cache's capacity of "
                                 f"{capacity} keys")
    starts = [0] * batch
    if pads is not None:
        starts = pads
        for i, (a, e) in enumerate(zip(starts, ends)):
            if a < 0 or a > e - n_new:
                raise ValueError(f"cache_leftpad[{i}] = {a} must lie in [0, cache_seqlens[{i}] = {e - n_new}]")
    if idx is not None:
        for i, r in enumerate(idx):
            if r < 0 or r >= k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx[{i}] = {r} is outside the cache's {k_cache.shape[0]} rows")
    if block_table is not None and block_table.numel():
        n_blocks = k_cache.shape[0]
        if flat_table is not None:
            lo, hi = min(flat_table), max(flat_table)
        else:
            lo, hi = (int(x) for x in torch.aminmax(host[n_rows:]))
        if lo < 0 or hi >= n_blocks:  # some entry is out of range: is it on a page a sequence occupies?
            _check_block_table(host[n_rows:].view(block_table.shape), k_cache.shape[1], n_blocks, starts, ends)
    return sum(ends) - sum(starts)


def _check_block_table(table: torch.Tensor, page: int, n_blocks: int, starts: list[int], ends: list[int]) -> None:
    """ValueError naming the first entry of a page some sequence occupies that lies outside ``[0, n_blocks)``
    (``table``: the host copy ``[B, max_pages]``)."""
    table = table.long()
    first = torch.tensor([a // page for a in starts]).unsqueeze(1)
    last = torch.tensor([(e + page - 1) // page for e in ends]).unsqueeze(1)
    pages = torch.arange(table.shape[1]).unsqueeze(0)
    bad = ((pages >= first) & (pages < last) & ((table < 0) | (table >= n_blocks))).nonzero()
    if len(bad):
        b, p = (int(x) for x in bad[0])
        raise ValueError(f"block_table[{b}, {p}] = {int(table[b, p])} is outside the cache's {n_blocks} "
                         f"blocks (sequence {b} occupies pages {starts[b] // page}.."
                         f"{(ends[b] + page - 1) // page - 1})")


# Lengths / tables already checked: weakrefs and version counters of the tensors and the call's scalars, with the
# key count they hold. A model passes the same cache_seqlens and block_table to every layer of a step: reading them
# on the host once per step instead of once per layer (a device sync each). A tensor changed in place by torch ops
# bumps its version and is read again; one written through a raw pointer (another library's kernel, a CUDA graph
# replay) does not, which is why the public entry re-checks only tensors torch saw unchanged.
_CHECKED_KVCACHE: list[tuple] = []
_CHECKED_KVCACHE_MAX = 8


def _kvcache_values_key(tensors: tuple, scalars: tuple) -> tuple | None:
    try:
        return tuple((None, 0) if t is None else (weakref.ref(t), t._version) for t in tensors) + (scalars,)
    except (RuntimeError, TypeError):  # inference tensors: no version counter
        return None


def _same_kvcache_values(entry: tuple, tensors: tuple, scalars: tuple) -> bool:
    if entry[-1] != scalars:
        return False
    for (ref, version), t in zip(entry[:-1], tensors):
        if t is None:
            if ref is not None:
                return False
        elif ref is None or ref() is not t or version != t._version:
            return False
    return True


def _same_tensors(refs: tuple, tensors: tuple) -> bool:
    """Whether the ``(weakref, version)`` pairs of an entry refer to exactly ``tensors`` (at any version)."""
    return all((None if r is None else r()) is t for (r, _), t in zip(refs, tensors))


def check_kvcache_values_once(k_cache: torch.Tensor, cache_seqlens: int | torch.Tensor | None,
                              block_table: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                              cache_leftpad: torch.Tensor | None, batch: int, n_new: int,
                              seqlens_name: str = "cache_seqlens") -> int:
    """:func:`check_kvcache_values`, skipped for the same unchanged tensors with the same scalars as a recent call
    (:data:`_CHECKED_KVCACHE`); returns the key count either way."""
    seq = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    tensors = (seq, block_table, cache_batch_idx, cache_leftpad)
    scalars = (cache_seqlens if not isinstance(cache_seqlens, torch.Tensor) else "tensor", batch, n_new,
               tuple(k_cache.shape), k_cache.device)
    key = _kvcache_values_key(tensors, scalars)
    for entry in _CHECKED_KVCACHE if key is not None else ():
        if _same_kvcache_values(entry[:-1], tensors, scalars):
            return entry[-1]
    total = check_kvcache_values(k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, n_new,
                                 seqlens_name)
    if key is not None:
        # an entry of the same tensors and scalars at older versions never matches again (versions only grow): a
        # decode loop that advances its lengths in place keeps one entry, not a list of stale ones to compare
        live = [e for e in _CHECKED_KVCACHE if all(r is None or r() is not None for r, _ in e[:-2])
                and not (e[-2] == scalars and _same_tensors(e[:-2], tensors))]
        _CHECKED_KVCACHE[:] = live[-(_CHECKED_KVCACHE_MAX - 1):] + [key + (total,)]
    return total


def check_kvcache_options(rotary_cos: object, rotary_sin: object, window_size: object, softcap: object,
                          rotary_interleaved: object, alibi_slopes: object, num_splits: object,
                          return_softmax_lse: object, causal: object) -> int:
    """The flash-attn options of ``ffpa_attn_with_kvcache``: NotImplementedError for rotary embeddings, a sliding
    window, softcap and ALiBi (any value but their defaults); TypeError for a non-bool flag or a non-int
    ``num_splits``; ValueError for ``num_splits`` outside [0, 256]. Returns ``num_splits``.

    ``rotary_interleaved`` takes any bool: it only says how rotary_cos / rotary_sin apply, and those are refused."""
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("ffpa_attn_with_kvcache does not apply rotary embeddings (rotary_cos / "
                                  "rotary_sin): rotate q and k before the call")
    if not no_window(window_size):
        raise NotImplementedError(f"ffpa_attn_with_kvcache does not support window_size={window_size!r} "
                                  "(sliding-window attention)")
    if isinstance(softcap, torch.Tensor) or softcap not in (None, 0, 0.0):
        raise NotImplementedError(f"ffpa_attn_with_kvcache does not support softcap={softcap!r}")
    if alibi_slopes is not None:
        raise NotImplementedError("ffpa_attn_with_kvcache does not support alibi_slopes")
    check_flag(rotary_interleaved, "rotary_interleaved")
    check_flag(return_softmax_lse, "return_softmax_lse")
    check_flag(causal, "causal")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= KVCACHE_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {KVCACHE_MAX_SPLITS}] (0: the planner's choice), got "
                         f"{num_splits}")
    return int(num_splits)


def check_kvcache_kwargs(kwargs: dict) -> tuple[dict, bool]:
    """Split the extra keywords of ``ffpa_attn_with_kvcache``: ``(backend kwargs, check_values)``. flash-attn 3 / 4
    keywords we do not implement raise NotImplementedError when not at their default; anything else TypeError."""
    backend = {}
    check_values = True
    for key, val in kwargs.items():
        if key == "backend":
            backend[key] = val
        elif key == "check_values":
            check_values = check_flag(val, "check_values")
        elif key in KVCACHE_REJECTED_KWARGS:
            if not any(val is dflt or (not isinstance(val, torch.Tensor) and val == dflt)
                       for dflt in KVCACHE_REJECTED_KWARGS[key]):
                raise NotImplementedError(f"ffpa_attn_with_kvcache does not support {key}={val!r}")
        else:
            raise TypeError(f"ffpa_attn_with_kvcache got an unexpected keyword argument {key!r}; supported extension "
                            f"kwargs: {', '.join(KVCACHE_KWARGS)}")
    return backend, check_values


def kvcache_problem(q: torch.Tensor, k_cache: torch.Tensor, k: torch.Tensor | None,
                    cache_seqlens: int | torch.Tensor | None, block_table: torch.Tensor | None,
                    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, softmax_scale: object,
                    causal: bool, num_splits: int) -> KVCacheProblem:
    """The :class:`KVCacheProblem` of a call :func:`check_kvcache` accepted."""
    b, nq, hq, d = q.shape
    return KVCacheProblem(
        b, nq, hq, k_cache.shape[2], d, 0 if k is None else k.shape[1], kvcache_capacity(k_cache, block_table),
        k_cache.shape[1] if block_table is not None else None, k_cache.shape[0], q.dtype, q.device, bool(causal),
        check_scale(softmax_scale, d, "softmax_scale"), cache_seqlens is not None, cache_batch_idx is not None,
        cache_leftpad is not None, num_splits)

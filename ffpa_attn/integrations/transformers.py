"""Hugging Face transformers binding: ``attn_implementation="ffpa"``.

Usage::

    from ffpa_attn.integrations.transformers import register_ffpa_attention
    register_ffpa_attention()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ffpa")

:func:`register_ffpa_attention` puts :func:`ffpa_attention_forward` into transformers' ``AttentionInterface``
and :func:`ffpa_mask` into ``AttentionMaskInterface`` (both are needed: a name missing from the mask registry
makes transformers hand every layer ``attention_mask=None``).

How a layer is routed (query ``[B, Hq, Sq, D]``, key/value ``[B, Hkv, Skv, D]`` as transformers passes them):

* head dim in (256, 1024] and fp16/bf16 -> FFPA, with the module's ``scaling`` (Gemma 4: 1.0) and
  ``is_causal``, native GQA, and the mask the factory produced. fp32 query/key/value (fp32 RoPE under
  ``torch.autocast``, fp32 layer norms) run FFPA in the dtype transformers' flash-attention path picks: the
  autocast dtype, else a quantized model's original dtype, else the dtype of the layer's weights (one warning);
  when that is fp32 too, the layer falls back to SDPA:

  - ``None``: plain causal (tail-aligned: a cached decode step sees the whole cache) or plain full attention
    -> :func:`ffpa_attn.ffpa_attn_func` (which picks its split-KV kernel for short queries itself); packed
    sequences announced by ``cu_seq_lens_*`` kwargs or by ``position_ids`` restarting at 0 (batch 1)
    -> :func:`ffpa_attn.ffpa_attn_varlen_func`;
  - a 2D padding mask ``[B, Skv]``: prefill/training -> unpad, varlen FFPA, re-pad (padded rows give 0);
    a step with a KV cache -> dense FFPA with the padding as a key mask (no gather of the whole cache);
  - a mask the factory recognized as packed causal (position-id packing) -> varlen FFPA;
  - a causal step over a static cache (``StaticCache``: every step sees the whole ``[B, Hkv, N_max, D]`` buffer,
    the mask hides the unused slots; left padding allowed) -> :func:`ffpa_attn.ffpa_attn_with_kvcache` over each
    sequence's slots, reading the buffer in place (eager; under torch.compile the mask path below);
  - a continuous-batching step (batch 1, ``cu_seq_lens_q / k`` covering the packed requests, a causal module, no
    sliding window) -> varlen FFPA over those boundaries instead of the step's 4D mask;
  - transformers' paged decode keywords (``block_table``, ``k_cache`` / ``v_cache`` page views, ``cu_seq_lens_k``:
    what its flash path receives) -> :func:`ffpa_attn.ffpa_attn_with_kvcache` on the paged cache, appending the new
    token;
  - any other BlockMask or 4D mask -> dense FFPA with that mask (exact, materialized once per forward).
* softcap, attention sinks or ``output_attentions`` -> eager attention (the model's own when it has one);
* anything else FFPA does not cover (head dim, dtype, position bias) -> transformers' FlexAttention forward
  for a BlockMask (sliding-window layers, e.g. Gemma 4's head_dim-256 layers), else transformers' SDPA forward.

Continuous batching (``generate_batch``) accepts only transformers' own implementation names ("sdpa",
"paged|eager", flash attention); :func:`ffpa_for_sdpa` runs a model loaded with ``attn_implementation="sdpa"`` through
this module for the duration of a ``with`` block.

Each fallback reason warns once (:class:`FFPAFallbackWarning`). Importing this module does not import
transformers; every function imports it when called.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn.functional as F

import ffpa_attn
from ffpa_attn.common.env import env_str
from ffpa_attn.contract import SUPPORTED_DTYPES, causal_mask, in_ffpa_range
from ffpa_attn.fallback import FFPAFallbackWarning  # the package's one class: one filter silences every fallback
from ffpa_attn.ops import autocast_dtype
from ffpa_attn.reference import _expand_kv

if TYPE_CHECKING:  # pragma: no cover
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "FFPAFallbackWarning",
    "ffpa_attention_forward",
    "ffpa_for_sdpa",
    "ffpa_mask",
    "register_ffpa_attention",
    "setup_ffpa_backend",
    "unregister_ffpa_attention",
]

ATTN_NAME = "ffpa"
# mask representation for the patterns FFPA cannot express as None / 2D padding:
# "auto" (BlockMask on CUDA when FlexAttention is available, else a 4D bool mask), "block" or "dense"
MASK_FORMAT_ENV = "FFPA_ATTN_HF_MASKS"

_FALLBACK_WARNED: set[str] = set()


def _warn_once(reason: str, message: str, target: str = "sdpa") -> None:
    """Warn the first time ``reason`` sends a layer to ``target``."""
    key = f"{reason} -> {target}"
    if key in _FALLBACK_WARNED:
        return
    _FALLBACK_WARNED.add(key)
    warnings.warn(f"ffpa attention: {message}; this layer runs on {target} (shown once per reason)",
                  FFPAFallbackWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------ lazy imports


def _masking_utils() -> Any:
    import transformers.masking_utils as mu

    return mu


def _get_sdpa() -> Callable:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _get_flex() -> Callable | None:
    from transformers.utils import is_torch_flex_attn_available

    if not is_torch_flex_attn_available():
        return None
    from transformers.integrations.flex_attention import flex_attention_forward

    return flex_attention_forward


def _get_eager(module: torch.nn.Module, need: str | None = None) -> Callable | None:
    """The model's own ``eager_attention_forward`` (from the module's modeling file), if it has one.

    ``need="softcap"`` accepts only an eager function with an explicit ``softcap`` parameter (a function that
    swallows it in ``**kwargs`` would silently ignore it).
    """
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None or not callable(fn):
        return None
    if need is not None:
        try:
            if need not in inspect.signature(fn).parameters:
                return None
        except (TypeError, ValueError):
            return None
    return fn


def _is_block_mask(mask: Any) -> bool:
    """True for a FlexAttention ``BlockMask`` (the factory's representation of sliding/custom patterns)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(mask, BlockMask)


# --------------------------------------------------------------------------------------- registration


def register_ffpa_attention() -> bool:
    """Register ``"ffpa"`` in transformers' attention and mask registries (class-level). Idempotent.

    Returns:
        True when ``"ffpa"`` is registered afterwards; False (with a warning) when transformers is not
        installed.
    """
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as err:
        warnings.warn(f"ffpa attention: transformers is not importable ({err}); nothing registered",
                      stacklevel=2)
        return False
    if AttentionInterface._global_mapping.get(ATTN_NAME) is not ffpa_attention_forward:
        AttentionInterface.register(ATTN_NAME, ffpa_attention_forward)
    if AttentionMaskInterface._global_mapping.get(ATTN_NAME) is not ffpa_mask:
        AttentionMaskInterface.register(ATTN_NAME, ffpa_mask)
    return True


def unregister_ffpa_attention() -> None:
    """Undo :func:`register_ffpa_attention` (removes only entries that are this module's functions)."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return
    if AttentionInterface._global_mapping.get(ATTN_NAME) is ffpa_attention_forward:
        del AttentionInterface._global_mapping[ATTN_NAME]
    if AttentionMaskInterface._global_mapping.get(ATTN_NAME) is ffpa_mask:
        del AttentionMaskInterface._global_mapping[ATTN_NAME]


@contextlib.contextmanager
def ffpa_for_sdpa() -> Iterator[None]:
    """Inside this context transformers' ``"sdpa"`` attention and mask functions are this module's
    (:func:`ffpa_attention_forward`, :func:`ffpa_mask`): layers FFPA covers run FFPA, the others transformers' own
    SDPA forward, exactly as with ``attn_implementation="ffpa"``.

    For the transformers code paths that accept only their own implementation names: continuous batching
    (``generate_batch``, ``ContinuousBatchingManager``) runs ``"sdpa"``, ``"paged|eager"`` or a flash-attention
    implementation and refuses any other name. A model loaded with ``attn_implementation="sdpa"`` then runs its
    FFPA-range layers on FFPA inside the context: each step's packed requests as a varlen call (the
    ``cu_seq_lens_q / k`` it receives), decode steps included. The registries are restored on exit (also on an
    exception); the swap is process-wide while it lasts.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    saved = (AttentionInterface._global_mapping.get("sdpa"), AttentionMaskInterface._global_mapping.get("sdpa"))
    AttentionInterface._global_mapping["sdpa"] = ffpa_attention_forward
    AttentionMaskInterface._global_mapping["sdpa"] = ffpa_mask
    try:
        yield
    finally:
        for registry, fn in zip((AttentionInterface, AttentionMaskInterface), saved):
            if fn is None:
                registry._global_mapping.pop("sdpa", None)
            else:
                registry._global_mapping["sdpa"] = fn


def setup_ffpa_backend(cp_size: int, has_packed_sequence: bool) -> None:
    """Check the preconditions of ``attn_implementation="ffpa"``, then register it.

    Args:
        cp_size: context-parallel world size. The ``"ffpa"`` backend attends over the sequence a rank holds,
            so only 1 is accepted; for context parallelism use the ring attention of this package
            (:func:`ffpa_attn.distributed.ring_attn_func` / ``ring_attn_varlen_func``).
        has_packed_sequence: whether batches pack several sequences per row. Supported: pass
            ``position_ids`` restarting at 0 with ``attention_mask=None`` (and ``use_cache=False``), or
            flash-attention style ``cu_seq_lens_q/k`` + ``max_length_q/k`` kwargs with batch 1.

    Raises:
        TypeError / ValueError: bad arguments, ``cp_size > 1``.
        ImportError: transformers is not installed.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int):
        raise TypeError(f"cp_size must be an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not isinstance(has_packed_sequence, bool):
        raise TypeError(f"has_packed_sequence must be a bool, got {type(has_packed_sequence).__name__}")
    if cp_size > 1:
        raise ValueError(
            f"attn_implementation='ffpa' attends within one rank's sequence and cannot run with context "
            f"parallelism (cp_size={cp_size}); use the exact ring attention of this package instead: "
            f"ffpa_attn.distributed.ring_attn_func (dense shards) or ring_attn_varlen_func (packed shards)"
        )
    if importlib.util.find_spec("transformers") is None:
        raise ImportError("attn_implementation='ffpa' needs transformers (pip install transformers)")
    register_ffpa_attention()


# ------------------------------------------------------------------ per-object caches (one per forward)


@dataclass(frozen=True)
class _Packed:
    """Packed sequences over ``B * S`` flattened tokens: int32 boundaries ``[n+1]`` and the longest length."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class _Unpad:
    """Where the kept tokens of a 2D padding mask are: flat indices ``[T]``, int32 ``cu [B+1]``, longest."""

    index: torch.Tensor
    cu: torch.Tensor
    max_len: int


class _ObjectCache:
    """Values derived from a mask / position-id object, kept while the object lives and is not modified.

    Transformers hands the same mask object to every layer of a kind, so host syncs (``nonzero``,
    ``.item()``) happen once per forward instead of once per layer. Entries are keyed by object identity
    (tensors compare elementwise, so they cannot be dict keys by value) and dropped when the object dies;
    a tensor's version counter is stored too, so an in-place change invalidates its entry.
    """

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, int, Any]] = {}

    @staticmethod
    def _version(obj: Any) -> int:
        if not isinstance(obj, torch.Tensor):
            return 0
        try:
            return obj._version
        except RuntimeError:  # an inference-mode tensor (pipelines generate under torch.inference_mode): untracked
            return -1

    def get(self, obj: Any, default: Any = None) -> Any:
        entry = self._data.get(id(obj))
        if entry is None or entry[0]() is not obj or entry[1] != self._version(obj):
            return default
        return entry[2]

    def put(self, obj: Any, value: Any) -> None:
        key = id(obj)
        data = self._data

        def drop(ref: weakref.ref) -> None:
            if data.get(key, (None,))[0] is ref:
                del data[key]

        try:
            ref = weakref.ref(obj, drop)
        except TypeError:  # not weak-referenceable: no caching
            return
        data[key] = (ref, self._version(obj), value)

    def compute(self, obj: Any, fn: Callable[[], Any]) -> Any:
        missing = object()
        value = self.get(obj, missing)
        if value is missing:
            value = fn()
            self.put(obj, value)
        return value


@dataclass(frozen=True)
class _CacheWindow:
    """The keys of a causal step over a fixed-size cache (StaticCache): sequence b holds cache slots
    ``[leftpad[b], seqlens[b])`` (int32 ``[B]`` device tensors; leftpad None without padding); the slots after it are
    unused (the mask hides them)."""

    seqlens: torch.Tensor
    leftpad: torch.Tensor | None


_PACKED_MASKS = _ObjectCache()  # factory-made masks recognized as packed causal -> _Packed
_UNPAD = _ObjectCache()  # 2D padding mask -> _Unpad
_POSITION_PACKING = _ObjectCache()  # position_ids tensor -> _Packed | None
_DENSE_MASKS = _ObjectCache()  # BlockMask -> dense bool [B, 1|H, Sq, Skv]
_CACHE_WINDOWS = _ObjectCache()  # masks of a causal step over a static cache -> _CacheWindow
_CB_BOUNDS = _ObjectCache()  # continuous batching's cu_seq_lens_k -> (cu_seq_lens_q, its last entry, cu_k's last)
_CB_LENGTHS = _ObjectCache()  # the paged decode step's cu_seq_lens_k -> int32 cached lengths [B]


def _cu_from_starts(starts: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """int32 boundaries from a bool ``[T]`` start-of-sequence flag vector (``starts[0]`` must be True)."""
    idx = starts.nonzero().squeeze(1).to(torch.int32)
    cu = torch.cat([idx, idx.new_tensor([total])])
    return cu, int((cu[1:] - cu[:-1]).max().item())


def _packing_from_position_ids(position_ids: torch.Tensor, n: int) -> _Packed | None:
    """Packed sequences of a batch-1 row whose positions restart at 0 (``[0..a-1, 0..b-1, ...]``), else None.

    Positions must count up by one inside each sequence; anything else is not treated as packing.
    """
    pos = position_ids.reshape(-1)
    if pos.numel() != n or n < 2:
        return None
    starts = pos == 0
    if not bool(starts[0]) or int(starts.sum()) < 2:
        return None
    ar = torch.arange(n, device=pos.device)
    seg_start = torch.where(starts, ar, torch.zeros_like(ar)).cummax(0).values
    if not bool((pos == ar - seg_start).all()):
        return None
    cu, max_len = _cu_from_starts(starts, n)
    return _Packed(cu, cu, max_len, max_len)


def _packing_from_kwargs(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> _Packed | None:
    """Packed sequences announced by flash-attention kwargs or position ids (batch 1, no cache), else None."""
    b, _, sq, _ = query.shape
    skv = key.shape[2]
    if b != 1 or sq != skv or sq < 2:
        return None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int((cu_q[1:] - cu_q[:-1]).max().item()) if max_q is None else int(max_q)
        max_k = int((cu_k[1:] - cu_k[:-1]).max().item()) if max_k is None else int(max_k)
        return _Packed(cu_q, cu_k, max_q, max_k)
    pos = kwargs.get("position_ids")
    if not isinstance(pos, torch.Tensor):
        return None
    return _POSITION_PACKING.compute(pos, lambda: _packing_from_position_ids(pos, sq))


def _unpad_info(keep: torch.Tensor) -> _Unpad:
    """Indices and boundaries of the True entries of a bool ``[B, S]`` padding mask (flattened row-major)."""

    def build() -> _Unpad:
        lens = keep.sum(-1, dtype=torch.int32)
        cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        return _Unpad(keep.reshape(-1).nonzero().squeeze(1), cu, int(lens.max().item()))

    return _UNPAD.compute(keep, build)


def _dense_from_block_mask(block_mask: BlockMask) -> torch.Tensor:
    """The bool ``[B, 1|H, Sq, Skv]`` mask a BlockMask's ``mask_mod`` describes (built once per object)."""

    def build() -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_mask

        b, h, sq, skv = block_mask.shape
        return create_mask(block_mask.mask_mod, b, h, sq, skv, device=block_mask.kv_num_blocks.device)

    return _DENSE_MASKS.compute(block_mask, build)


# --------------------------------------------------------------------------------------- mask factory


def _mask_format(device: torch.device) -> str:
    """"block" (FlexAttention BlockMask) or "dense" (4D bool) for patterns beyond None / 2D padding."""
    fmt = env_str(MASK_FORMAT_ENV).lower()
    if fmt not in ("auto", "block", "dense"):
        raise ValueError(f"{MASK_FORMAT_ENV} must be 'auto', 'block' or 'dense', got {fmt!r}")
    if fmt == "auto":
        # flex attention has no CPU backward, so CPU models get 4D masks
        from transformers.utils import is_torch_flex_attn_available

        fmt = "block" if device.type == "cuda" and is_torch_flex_attn_available() else "dense"
    return fmt


def _as_int(x: int | torch.Tensor) -> int | None:
    """A Python int for an offset (StaticCache passes tensors); None while tracing."""
    if isinstance(x, torch.Tensor):
        if torch.compiler.is_compiling():
            return None
        return int(x.item())
    return int(x)


def _padding_window(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> torch.Tensor | None:
    """The 2D padding mask over the KV window ``[kv_offset, kv_offset + kv_length)``: bool ``[B, kv_length]``."""
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.bool)
    short = kv_offset + kv_length - keep.shape[-1]
    if short > 0:  # positions the mask does not cover are padding (as transformers' masks treat them)
        keep = F.pad(keep, (0, short), value=False)
    return keep[:, kv_offset:kv_offset + kv_length]


def _is_plain(mu: Any, mask_function: Callable, q_length: int, kv_length: int, q_off: int | None,
              kv_off: int | None, local_size: int | None, allow_skip: bool) -> bool:
    """Whether the pattern (padding aside) is full attention or tail-aligned causal over this KV window."""
    if mask_function is mu.bidirectional_mask_function:
        return True
    aligned = q_off is not None and kv_off is not None and q_off + q_length == kv_off + kv_length
    if mask_function is mu.causal_mask_function:
        return aligned
    # a local (sliding/chunked) causal pattern without overlays whose window covers every key: plain causal
    # (the same condition transformers' SDPA mask uses to skip the mask)
    return bool(local_size is not None and allow_skip and aligned and kv_length < local_size)


def _segments(rows: Callable[[int, int], torch.Tensor], batch: int, n: int) -> _Packed | str | None:
    """Classify an ``n x n`` self-attention pattern given by ``rows(r0, r1) -> bool [B, r1-r0, n]``.

    Returns "plain" for causal attention over each whole row, a :class:`_Packed` when every row is causal
    within consecutive segments (packed sequences; boundaries over the flattened ``B * n`` tokens), else None.
    Row r must see exactly the keys ``[start(r), r]`` with ``start(r)`` either r or ``start(r - 1)``.
    """
    step = max(1, min(n, (1 << 24) // max(1, batch * n)))
    firsts = []
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        m = rows(r0, r1)
        r = torch.arange(r0, r1, device=m.device)
        first = m.to(torch.uint8).argmax(-1)
        last = (n - 1) - m.flip(-1).to(torch.uint8).argmax(-1)
        count = m.sum(-1)
        if not bool(((last == r) & (count == r - first + 1)).all()):
            return None
        firsts.append(first)
    first = torch.cat(firsts, dim=1)
    ar = torch.arange(n, device=first.device)
    prev = F.pad(first[:, :-1], (1, 0))
    if not bool(((first == ar) | (first == prev)).all()):
        return None
    starts = (first == ar).reshape(-1)
    if int(starts.sum()) == batch:
        return "plain"
    cu, max_len = _cu_from_starts(starts, batch * n)
    return _Packed(cu, cu, max_len, max_len)


def _static_cache_window(mu: Any, mask_function: Callable, batch_size: int, q_length: int, kv_length: int,
                         q_off: int | None, kv_off: int | None, local_size: int | None,
                         attention_mask: torch.Tensor | None, device: torch.device) -> _CacheWindow | None:
    """The :class:`_CacheWindow` of a causal step over a fixed-size cache, else None.

    A static cache hands every step its whole buffer (``kv_length`` slots from 0) with the queries at
    ``q_off .. q_off + q_length - 1``: the sequence is slots ``[0, q_off + q_length)``, minus its left padding. Only
    plain causal masks (no overlays, no local window) whose padding is left padding qualify (read on the host once
    per mask); anything else keeps its exact mask."""
    if mask_function is not mu.causal_mask_function or local_size is not None or q_off is None or kv_off != 0:
        return None
    end = q_off + q_length
    if not 0 < end < kv_length:
        return None
    keep = _padding_window(attention_mask, end, 0)
    leftpad = None
    if keep is not None and not bool(keep.all()):
        seen = keep.to(torch.int32).cummax(-1).values.bool()
        if not bool((seen == keep).all()):  # a hole after the first real token: not left padding
            return None
        leftpad = (~keep).sum(-1, dtype=torch.int32).to(device)
    seqlens = torch.full((batch_size,), end, dtype=torch.int32, device=device)
    return _CacheWindow(seqlens, leftpad)


def ffpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    **kwargs: Any,
) -> torch.Tensor | BlockMask | None:
    """Mask factory registered as ``ALL_MASK_ATTENTION_FUNCTIONS["ffpa"]``.

    Args:
        batch_size, q_length, kv_length: mask extent; queries sit at positions ``q_offset + [0, q_length)``,
            keys at ``kv_offset + [0, kv_length)``.
        mask_function: transformers' mask function (default: causal).
        attention_mask: bool ``[B, >= kv_offset + kv_length]`` 2D padding mask (True = real token).
        dtype: unused (float masks are eager's business).
        **kwargs: transformers' extras (``local_size``, ``allow_is_causal_skip``, ``use_vmap``, ``device``, ...).

    Returns:
        * ``None``: plain causal (tail-aligned) or full attention, no padding;
        * bool ``[B, kv_length]``: the same with padding;
        * otherwise the exact pattern: a FlexAttention ``BlockMask`` on CUDA (when FlexAttention is available)
          or a bool ``[B, 1, q_length, kv_length]`` mask (environment variable ``FFPA_ATTN_HF_MASKS`` =
          ``block`` / ``dense`` forces one). A pattern recognized as packed causal sequences is remembered so
          that FFPA layers run it as varlen attention.
    """
    mu = _masking_utils()
    if mask_function is None:
        mask_function = mu.causal_mask_function
    device = kwargs.get("device")
    device = torch.device(device) if device is not None else (
        attention_mask.device if attention_mask is not None else torch.device("cpu"))
    q_off, kv_off = _as_int(q_offset), _as_int(kv_offset)
    local_size = kwargs.get("local_size")
    allow_skip = bool(kwargs.get("allow_is_causal_skip", True))
    use_vmap = bool(kwargs.get("use_vmap", False))

    if _is_plain(mu, mask_function, q_length, kv_length, q_off, kv_off, local_size, allow_skip):
        keep = _padding_window(attention_mask, kv_length, kv_off if kv_off is not None else 0)
        if keep is None or bool(keep.all()):
            return None
        return keep

    def dense(q0: int, q_len: int) -> torch.Tensor:
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_len, kv_length=kv_length, q_offset=q_offset + q0,
                            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                            allow_is_causal_skip=False, use_vmap=use_vmap, device=device)

    block = _mask_format(device) == "block"
    full = None if block else dense(0, q_length).expand(batch_size, 1, q_length, kv_length)
    packed = None
    if (local_size is None and attention_mask is None and q_length == kv_length and q_off is not None
            and q_off == kv_off):
        if full is not None:
            packed = _segments(lambda r0, r1: full[:, 0, r0:r1], batch_size, q_length)
        else:
            packed = _segments(lambda r0, r1: dense(r0, r1 - r0)[:, 0].expand(batch_size, -1, -1),
                               batch_size, q_length)
        if packed == "plain":
            return None
    if block:
        result = mu.flex_attention_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                        attention_mask=attention_mask, device=device)
    else:
        result = full
    if isinstance(packed, _Packed):
        _PACKED_MASKS.put(result, packed)
    window = _static_cache_window(mu, mask_function, batch_size, q_length, kv_length, q_off, kv_off, local_size,
                                  attention_mask, device)
    if window is not None:
        _CACHE_WINDOWS.put(result, window)
    return result


# ---------------------------------------------------------------------------------------- the forward


def _half_dtype(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.dtype | None:
    """The fp16/bf16 dtype fp32 query/key/value run FFPA in, None when none is fp32 or the rule gives fp32.

    transformers' flash-attention rule (``get_target_dtype``): the dtype of an active autocast region, else the
    original dtype of a quantized model, else the dtype of the layer's first Linear weight.
    """
    if all(t.dtype != torch.float32 for t in (query, key, value)):
        return None
    dtype = autocast_dtype(query.device.type)
    if dtype is None:
        config = getattr(module, "config", None)
        dtype = getattr(config, "_pre_quantization_dtype", None)  # transformers < 5 records it on quantized models
        if dtype is None and getattr(config, "_is_quantized", False):
            dtype = getattr(config, "dtype", None)
    if dtype is None:
        dtype = next((m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    return dtype if dtype in SUPPORTED_DTYPES else None


def _ineligible_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict,
                       dtype: torch.dtype | None = None) -> str | None:
    """Why FFPA cannot run this layer (None = it can); ``dtype``: the dtype the layer would run in when not the
    inputs' own (:func:`_half_dtype`)."""
    d = query.shape[-1]
    dtypes = {dtype} if dtype is not None else {query.dtype, key.dtype, value.dtype}
    bad = sorted(str(t) for t in dtypes if t not in SUPPORTED_DTYPES)
    if bad:
        return (f"dtype {', '.join(bad)} (FFPA takes float16/bfloat16: load the model in bfloat16, or train the "
                f"float32 model under torch.autocast)")
    if not in_ffpa_range(d):
        return f"head_dim={d} outside FFPA's range (256, 1024]"
    if key.shape[-1] != d or value.shape[-1] != d:
        return f"key/value head dims ({key.shape[-1]}, {value.shape[-1]}) differ from the query's ({d})"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    return None


def _to_bshd(out: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B, S, H, D]`` (what transformers expects back)."""
    return out.transpose(1, 2).contiguous()


def _flat_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B * S, H, D]`` (token-major, as varlen attention takes it)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _ffpa_dense(query, key, value, attn_mask, dropout, scale, causal) -> torch.Tensor:
    out = ffpa_attn.ffpa_attn_func(query, key, value, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal,
                                   scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return _to_bshd(out)


def _ffpa_packed(query, key, value, packed: _Packed, dropout, scale, causal) -> torch.Tensor:
    b, hq, s, d = query.shape
    out = ffpa_attn.ffpa_attn_varlen_func(
        _flat_tokens(query), _flat_tokens(key), _flat_tokens(value), packed.cu_q, packed.cu_k, packed.max_q,
        packed.max_k, dropout_p=dropout, softmax_scale=scale, causal=causal, enable_gqa=hq != key.shape[1])
    return out.view(b, s, hq, value.shape[-1])


def _ffpa_unpadded(query, key, value, keep: torch.Tensor, dropout, scale, causal) -> torch.Tensor:
    """Self-attention over the kept tokens of each row (varlen), zeros at padded rows."""
    b, hq, s, _ = query.shape
    info = _unpad_info(keep)
    pick = functools.partial(torch.index_select, dim=0, index=info.index)
    out = ffpa_attn.ffpa_attn_varlen_func(
        pick(_flat_tokens(query)), pick(_flat_tokens(key)), pick(_flat_tokens(value)), info.cu, info.cu,
        info.max_len, info.max_len, dropout_p=dropout, softmax_scale=scale, causal=causal,
        enable_gqa=hq != key.shape[1])
    full = out.new_zeros(b * s, hq, out.shape[-1]).index_copy(0, info.index, out)
    return full.view(b, s, hq, out.shape[-1])


def _ffpa_static_cache(query, key, value, window: _CacheWindow, scale) -> torch.Tensor:
    """A causal step over a static cache: the KV-cache entry reads the buffer in place (``[B, Hkv, N_max, D]`` seen
    as flash-attn's ``[B, N_max, Hkv, D]``) over each sequence's slots only."""
    return ffpa_attn.ffpa_attn_with_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=window.seqlens,
        cache_leftpad=window.leftpad, softmax_scale=scale, causal=True, check_values=False)


def _ffpa_block_table(query, key, value, scale, kwargs: dict) -> torch.Tensor:
    """transformers' paged decode step (the keywords its flash path receives: ``block_table``, ``k_cache`` /
    ``v_cache`` page views, ``cu_seq_lens_k``): one new token per sequence, appended and attended in one call."""
    n = query.shape[2]
    cu_k = kwargs["cu_seq_lens_k"]
    # the keys already cached per sequence: its key count minus the new token (what transformers' flash path passes)
    lens = _CB_LENGTHS.compute(cu_k, lambda: (cu_k[1:n + 1] - cu_k[:n] - 1).to(torch.int32))
    q, k, v = (x.transpose(1, 2).reshape(n, 1, x.shape[1], x.shape[-1]) for x in (query, key, value))
    out = ffpa_attn.ffpa_attn_with_kvcache(q, kwargs["k_cache"], kwargs["v_cache"], k, v, cache_seqlens=lens,
                                           block_table=kwargs["block_table"], softmax_scale=scale, causal=True)
    return out.view(query.shape[0], n, out.shape[-2], out.shape[-1])


def _continuous_batching_packing(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> _Packed | None:
    """Packed requests of a continuous-batching step (batch 1; ``cu_seq_lens_q / k`` with their ``max_length``,
    and the cache's ``write_index`` keyword, which says the 4D mask is the step's block-diagonal causal mask built by
    transformers' batch manager): a :class:`_Packed` when the boundaries cover exactly the query and key tokens
    (read on the host once per boundary tensor), None otherwise (a padded batch, or another caller's mask, keeps
    its mask)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if "write_index" not in kwargs:
        return None
    if not (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and isinstance(max_q, int)
            and isinstance(max_k, int)) or query.shape[0] != 1 or cu_q.numel() != cu_k.numel():
        return None

    def ends() -> tuple:
        return (cu_q, *torch.stack([cu_q[-1], cu_k[-1]]).tolist())

    seen_q, end_q, end_k = _CB_BOUNDS.compute(cu_k, ends)
    if seen_q is not cu_q or end_q != query.shape[2] or end_k != key.shape[2]:
        return None
    return _Packed(cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k)


def _sliding_mask(query: torch.Tensor, key: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor | None:
    """Bool ``[Sq, Skv]`` tail-aligned sliding-window mask when ``window`` hides some key, else None."""
    sq, skv = query.shape[2], key.shape[2]
    if window is None or skv <= window:
        return None
    rows = torch.arange(sq, device=query.device).unsqueeze(1) + (skv - sq)
    dist = rows - torch.arange(skv, device=query.device).unsqueeze(0)
    visible = dist < window
    return visible & (dist >= 0) if causal else visible & (dist > -window)


def _packed_visibility(packed: _Packed, sq: int, skv: int, causal: bool,
                       device: torch.device) -> torch.Tensor:
    """Bool ``[Sq, Skv]`` mask of packed sequences (block diagonal; tail-aligned causal inside a sequence)."""

    def seq_ids(cu: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ar = torch.arange(n, device=device)
        ids = torch.bucketize(ar, cu[1:].to(device=device, dtype=torch.int64), right=True)
        return ids, ar - cu.to(device=device, dtype=torch.int64)[ids]

    idq, pq = seq_ids(packed.cu_q, sq)
    idk, pk = seq_ids(packed.cu_k, skv)
    mask = idq.unsqueeze(1) == idk.unsqueeze(0)
    if causal:
        lq = (packed.cu_q[1:] - packed.cu_q[:-1]).to(device=device, dtype=torch.int64)[idq]
        lk = (packed.cu_k[1:] - packed.cu_k[:-1]).to(device=device, dtype=torch.int64)[idq]
        mask = mask & (pk.unsqueeze(0) <= (pq + lk - lq).unsqueeze(1))
    return mask


def _explicit_mask(attention_mask: Any, query: torch.Tensor, key: torch.Tensor, causal: bool, kwargs: dict,
                   need_causal: bool) -> torch.Tensor | None:
    """The layer's visibility as a bool ``[B|1, 1|H, Sq, Skv]`` mask for SDPA / eager (or a 4D float mask).

    None means "no mask needed": full attention, or (unless ``need_causal``) causal attention that SDPA's
    ``is_causal`` expresses (Sq == Skv) or that sees every key (Sq == 1).
    """
    sq, skv = query.shape[2], key.shape[2]
    if _is_block_mask(attention_mask):
        return _dense_from_block_mask(attention_mask)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return attention_mask
    mask = None
    if attention_mask is None:
        packed = _packing_from_kwargs(query, key, kwargs)
        if packed is not None:
            return _packed_visibility(packed, sq, skv, causal, query.device)[None, None]
    else:
        mask = attention_mask.to(torch.bool)[:, None, None, :]
    window = _sliding_mask(query, key, kwargs.get("sliding_window"), causal)
    if window is not None:
        mask = window[None, None] if mask is None else mask & window
    elif causal and (need_causal or mask is not None or 1 < sq != skv):
        cm = causal_mask(sq, skv, query.device)[None, None]
        mask = cm if mask is None else mask & cm
    return mask


def _eager_fallback(reason: str, message: str, module, query, key, value, attention_mask, dropout, scale,
                    softcap, causal, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    eager = _get_eager(module, need="softcap" if softcap is not None else None)
    if eager is None and kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) need the model's eager_attention_forward")
    _warn_once(reason, message, "eager attention" if eager is not None else "ffpa_attn's eager attention")
    mask = _explicit_mask(attention_mask, query, key, causal, kwargs, need_causal=True)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    extra = {"softcap": softcap} if softcap is not None else {}
    fn = eager if eager is not None else _eager_attention
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scale, **extra, **kwargs)


def _eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with an additive mask and tanh softcap: ``(out [B, S, Hq, D], probs [B, Hq, Sq, Skv])``."""
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    k = _expand_kv(key, query.shape[1])
    v = _expand_kv(value, query.shape[1])
    scores = torch.matmul(query, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return _to_bshd(torch.matmul(probs, v)), probs


def _other_fallback(reason: str, module, query, key, value, attention_mask, dropout, scale, causal,
                    kwargs) -> torch.Tensor:
    """FlexAttention for a BlockMask (when it can), else transformers' SDPA forward."""
    if _is_block_mask(attention_mask) and dropout == 0.0:
        flex = _get_flex()
        if flex is not None:
            _warn_once(reason, f"{reason} with a block mask (sliding window / custom pattern)", "flex_attention")
            try:
                return flex(module, query, key, value, attention_mask, scaling=scale, **kwargs)[0]
            except Exception as err:  # e.g. a compile failure for this head dim on this GPU
                _warn_once(f"flex failed: {type(err).__name__}",
                           f"flex_attention failed ({type(err).__name__}: {err})", "sdpa with a dense mask")
    else:
        _warn_once(reason, reason, "sdpa")
    mask = _explicit_mask(attention_mask, query, key, causal, kwargs, need_causal=False)
    return _get_sdpa()(module, query, key, value, mask, dropout=dropout, scaling=scale, is_causal=causal,
                       **kwargs)[0]


def ffpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    dropout: float | int = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function registered as ``ALL_ATTENTION_FUNCTIONS["ffpa"]`` (routing: see the module doc).

    Args:
        module: the attention module (its ``is_causal`` is used unless an ``is_causal`` kwarg is given).
        query: ``[B, Hq, Sq, D]``; key, value: ``[B, Hkv, Skv, D]`` (Hq a multiple of Hkv).
        attention_mask: what :func:`ffpa_mask` produced (None, bool ``[B, Skv]``, BlockMask, or a 4D
            bool/additive mask).
        dropout: attention dropout probability; scaling: the module's softmax scale (None -> 1/sqrt(D));
        softcap: tanh soft-capping of the scores (eager fallback).
        **kwargs: transformers' extras (``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
            ``sliding_window``, ``is_causal``, ...).

    Returns:
        ``(out [B, Sq, Hq, D], None)``; the eager fallback returns its attention weights instead of None.
    """
    is_causal = kwargs.pop("is_causal", None)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    scale = None if scaling is None else float(scaling)
    dropout = float(dropout)
    if softcap is not None:
        return _eager_fallback("softcap", f"softcap={softcap}", module, query, key, value, attention_mask, dropout,
                               scale, softcap, causal, kwargs)
    if kwargs.get("s_aux") is not None:
        return _eager_fallback("s_aux", "attention sinks (s_aux)", module, query, key, value, attention_mask,
                               dropout, scale, softcap, causal, kwargs)
    if kwargs.get("output_attentions", False):
        return _eager_fallback("output_attentions", "output_attentions=True needs the attention weights", module,
                               query, key, value, attention_mask, dropout, scale, softcap, causal, kwargs)
    half = _half_dtype(module, query, key, value)
    reason = _ineligible_reason(query, key, value, kwargs, half)
    if reason is not None:
        return _other_fallback(reason, module, query, key, value, attention_mask, dropout, scale, causal,
                               kwargs), None
    if half is not None:
        source = "the autocast dtype" if autocast_dtype(query.device.type) is not None else "the model's dtype"
        if not torch.compiler.is_compiling():  # warnings.warn would break a compiled graph; eager calls warn
            _warn_once(f"float32 inputs -> {half}", f"float32 query/key/value are cast to {half} ({source}), as "
                       f"transformers' flash-attention path does", f"FFPA in {half}")
        query, key, value = (t.to(half) for t in (query, key, value))

    if (kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None and causal and dropout == 0.0
            and kwargs.get("sliding_window") is None):
        return _ffpa_block_table(query, key, value, scale, kwargs), None
    if attention_mask is not None and not torch.compiler.is_compiling():
        window = _CACHE_WINDOWS.get(attention_mask)
        if window is not None and causal and dropout == 0.0 and kwargs.get("sliding_window") is None:
            try:
                return _ffpa_static_cache(query, key, value, window, scale), None
            except NotImplementedError as err:  # no KV-cache kernel here (e.g. CPU tensors without the interpreter)
                _warn_once("kvcache", f"the KV-cache entry cannot run this step ({err})", "the mask path")
        if (not _is_block_mask(attention_mask) and attention_mask.dim() == 4
                and getattr(module, "is_causal", True) and kwargs.get("sliding_window") is None):
            packed = _continuous_batching_packing(query, key, kwargs)
            if packed is not None:  # the mask is the requests' block-diagonal causal mask: run it as varlen
                return _ffpa_packed(query, key, value, packed, dropout, scale, True), None

    if attention_mask is not None and not _is_block_mask(attention_mask) and attention_mask.dim() == 2:
        keep = attention_mask.to(torch.bool)
        if tuple(keep.shape) != (query.shape[0], key.shape[2]):
            raise ValueError(f"2D attention_mask must be [B, Skv]={[query.shape[0], key.shape[2]]}, "
                             f"got {list(keep.shape)}")
        window = _sliding_mask(query, key, kwargs.get("sliding_window"), causal)
        if causal and window is None and query.shape[2] == key.shape[2]:
            return _ffpa_unpadded(query, key, value, keep, dropout, scale, causal), None
        # a step with a KV cache (or keys-only padding): dense FFPA with a key mask, no gather of the cache
        mask = keep[:, None, None, :] if window is None else keep[:, None, None, :] & window
        return _ffpa_dense(query, key, value, mask, dropout, scale, causal and window is None), None

    if attention_mask is None:
        packed = _packing_from_kwargs(query, key, kwargs)
        if packed is not None:
            return _ffpa_packed(query, key, value, packed, dropout, scale, causal), None
        window = _sliding_mask(query, key, kwargs.get("sliding_window"), causal)
        return _ffpa_dense(query, key, value, window, dropout, scale, causal and window is None), None

    packed = _PACKED_MASKS.get(attention_mask)
    if packed is not None:
        return _ffpa_packed(query, key, value, packed, dropout, scale, True), None
    dense = _dense_from_block_mask(attention_mask) if _is_block_mask(attention_mask) else attention_mask
    if dense.dim() != 4:
        raise ValueError(f"attention_mask must be None, [B, Skv], 4D or a BlockMask, got shape {tuple(dense.shape)}")
    # the mask carries the whole pattern (causality included, transformers' convention for 4D masks)
    return _ffpa_dense(query, key, value, dense, dropout, scale, False), None

"""Backend configurations and the decision of which backend runs each direction.

The dataclasses are the public configuration objects (seed field names). ``resolve_backends`` turns the
``backend`` / ``forward_backend`` / ``backward_backend`` kwargs into one config per direction (``None`` =
implicit), and ``plan_dense`` / ``plan_varlen`` pick the backend and kernel for a validated problem,
applying the fallback rule for implicit choices and raising NotImplementedError for explicit ones that
cannot do the request. Nothing here imports a kernel module: availability is probed with
``importlib.util.find_spec`` and device properties only.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Union

import torch

from .contract import DenseProblem, VarlenProblem, check_dtype, in_ffpa_range

logger = logging.getLogger("ffpa_attn")

_GRAD_DTYPES = {
    None: None,
    torch.float32: "float32",
    torch.float16: "float16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}


def _norm_grad_dtype(value: Any, field: str) -> str | None:
    try:
        return _GRAD_DTYPES[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"{field} must be None, torch.float32 or torch.float16 (or 'float32'/'float16'), got {value!r}"
        ) from None


def grad_storage_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The torch dtype of a ``grad_*_storage_dtype`` field (None = kernel default)."""
    name = _norm_grad_dtype(value, "grad storage dtype")
    return None if name is None else getattr(torch, name)


@dataclass
class Backend:
    """Base backend configuration.

    Attributes:
        name: backend identifier ("triton", "cuda", "cutedsl", "sdpa").
        forward: whether this instance configures the forward pass; None = not set (resolved in
            ``__post_init__`` from what the backend can do).
        backward: whether this instance configures the backward pass; same None semantics.
    """

    name: str = ""
    forward: bool | None = None
    backward: bool | None = None

    # what the backend implements (class-level facts, not fields)
    _CAN_FORWARD = True
    _CAN_BACKWARD = True

    def __post_init__(self) -> None:
        if type(self) is Backend:
            if self.name not in BACKEND_CLASSES:
                raise ValueError(f"Backend name must be one of {sorted(BACKEND_CLASSES)}, got {self.name!r}")
        elif self.name != self._NAME:
            raise ValueError(f"{type(self).__name__}.name must be {self._NAME!r}, got {self.name!r}")
        for field in ("forward", "backward"):
            val = getattr(self, field)
            if val is not None and not isinstance(val, bool):
                raise ValueError(f"{type(self).__name__}.{field} must be a bool or None, got {val!r}")
        can_f, can_b = self._capabilities()
        if self.forward is None:
            self.forward = can_f
        if self.backward is None:
            self.backward = can_b
        if self.forward and not can_f:
            raise ValueError(f"the {self.name!r} backend has no forward kernel (forward=True given)")
        if self.backward and not can_b:
            raise ValueError(
                f"the {self.name!r} backend has no backward kernel (backward=True given); "
                f"choose backward_backend='triton' or 'sdpa'"
            )
        if not self.forward and not self.backward:
            raise ValueError(f"{type(self).__name__} configures neither forward nor backward")

    def _capabilities(self) -> tuple[bool, bool]:
        cls = BACKEND_CLASSES.get(self.name, type(self))
        return cls._CAN_FORWARD, cls._CAN_BACKWARD

    def to_config(self) -> str:
        """The backend-specific fields as ``name=repr;...`` (what crosses the torch op boundary as a string).

        Plain string formatting of constants, so torch.compile traces it without a graph break.
        """
        skip = ("name", "forward", "backward")
        return ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                        if f.name not in skip)


@dataclass
class TritonBackend(Backend):
    """Triton forward + backward backend (the portable default, sm80+; CPU under TRITON_INTERPRET=1).

    Attributes:
        autotune: autotune kernel configs (results cached on disk per GPU + shape bucket); False uses the
            shipped tuned defaults.
        autotune_mode: "fast" (small sensible set) or "max" (wider search).
        enable_tma: use tensor descriptors (TMA) on sm90+; None = automatic (on where supported).
        enable_ws: warp-specialized configs; None = automatic; True requires enable_tma not False.
        persist_dkdv: keep the dK/dV accumulator in fp32 across the backward launch (requires enable_tma
            and backward).
        split_launch: separate backward launches for dK/dV and dQ (no dQ atomics; deterministic).
        preprocess_d_chunk: split the delta = rowsum(dO * O) preprocess over D chunks.
        grad_kv_storage_dtype: dtype of an intermediate dK/dV buffer (None = accumulate in registers and
            write the input dtype once).
        grad_q_storage_dtype: dtype of the dQ accumulation buffer (None = fp32).
        deterministic: make the backward bitwise reproducible (no atomics; implies split_launch).
    """

    name: str = "triton"
    autotune: bool = True
    autotune_mode: str = "fast"
    enable_tma: bool | None = None
    enable_ws: bool | None = None
    persist_dkdv: bool = False
    split_launch: bool = False
    preprocess_d_chunk: bool = False
    grad_kv_storage_dtype: Union[torch.dtype, str, None] = None
    grad_q_storage_dtype: Union[torch.dtype, str, None] = None
    deterministic: bool = False

    _NAME = "triton"

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("autotune", "persist_dkdv", "split_launch", "preprocess_d_chunk", "deterministic"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"TritonBackend.{f} must be a bool, got {getattr(self, f)!r}")
        for f in ("enable_tma", "enable_ws"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), bool):
                raise ValueError(f"TritonBackend.{f} must be a bool or None, got {getattr(self, f)!r}")
        if self.autotune_mode not in ("fast", "max"):
            raise ValueError(f"TritonBackend.autotune_mode must be 'fast' or 'max', got {self.autotune_mode!r}")
        if self.enable_ws and self.enable_tma is False:
            raise ValueError("TritonBackend(enable_ws=True) requires enable_tma (got enable_tma=False)")
        if self.persist_dkdv and not self.enable_tma:
            raise ValueError("TritonBackend(persist_dkdv=True) requires enable_tma=True")
        if self.persist_dkdv and not self.backward:
            raise ValueError("TritonBackend(persist_dkdv=True) requires backward=True")
        self.grad_kv_storage_dtype = _norm_grad_dtype(self.grad_kv_storage_dtype,
                                                      "TritonBackend.grad_kv_storage_dtype")
        self.grad_q_storage_dtype = _norm_grad_dtype(self.grad_q_storage_dtype,
                                                     "TritonBackend.grad_q_storage_dtype")
        if self.grad_q_storage_dtype == "float16":
            raise ValueError("TritonBackend.grad_q_storage_dtype='float16' would accumulate dQ in fp16; "
                             "use torch.float32 or None")


@dataclass
class CUDABackend(Backend):
    """Hand-written CUDA forward-only backend (mma.sync, compiled at first use).

    Attributes:
        acc: MMA accumulator precision, "f32" (default) or "f16" (fp16 inputs only).
        stages: cp.async pipeline stages, 1..4; None = per-arch default (3 on sm80/89, 4 on sm90).
    """

    name: str = "cuda"
    acc: str = "f32"
    stages: int | None = None

    _NAME = "cuda"
    _CAN_BACKWARD = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.acc not in ("f16", "f32"):
            raise ValueError(f"CUDABackend.acc must be 'f16' or 'f32', got {self.acc!r}")
        if self.stages is not None and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                        or not 1 <= self.stages <= 4):
            raise ValueError(f"CUDABackend.stages must be an int in 1..4 or None, got {self.stages!r}")


@dataclass
class CuTeDSLBackend(Backend):
    """CuTeDSL sm90a (Hopper) backend, forward + backward; needs the ``ffpa-attn[cute]`` extra.

    Attributes:
        grad_kv_storage_dtype: storage dtype of an intermediate dK/dV buffer (None = kernel default);
            final gradients are always cast back to k.dtype / v.dtype.
    """

    name: str = "cutedsl"
    grad_kv_storage_dtype: Union[torch.dtype, str, None] = None

    _NAME = "cutedsl"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.grad_kv_storage_dtype = _norm_grad_dtype(self.grad_kv_storage_dtype,
                                                      "CuTeDSLBackend.grad_kv_storage_dtype")


@dataclass
class SDPABackend(Backend):
    """PyTorch ``scaled_dot_product_attention`` backend.

    Attributes:
        high_precision_grad: compute the backward (which honours the caller's out/lse) in fp32 instead of
            the input dtype.
    """

    name: str = "sdpa"
    high_precision_grad: bool = False

    _NAME = "sdpa"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.high_precision_grad, bool):
            raise ValueError(f"SDPABackend.high_precision_grad must be a bool, got {self.high_precision_grad!r}")


BACKEND_CLASSES: dict[str, type[Backend]] = {
    "triton": TritonBackend,
    "cuda": CUDABackend,
    "cutedsl": CuTeDSLBackend,
    "sdpa": SDPABackend,
}
# kernel package of each backend (imported lazily by ops.py only)
KERNEL_MODULES = {
    "triton": "ffpa_attn.triton",
    "cuda": "ffpa_attn.cuda",
    "cutedsl": "ffpa_attn.cute",
    "sdpa": "ffpa_attn.sdpa",
}

BackendLike = Union[str, Backend, None]


def as_backend(value: BackendLike, arg: str) -> Backend | None:
    """Turn a string shorthand or Backend instance into a Backend (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Backend):
        return value
    if isinstance(value, str):
        cls = BACKEND_CLASSES.get(value.lower())
        if cls is None:
            raise ValueError(f"{arg}={value!r} is not a backend; choose one of {sorted(BACKEND_CLASSES)}")
        return cls()
    raise ValueError(f"{arg} must be a str or a Backend instance, got {type(value).__name__}")


@functools.lru_cache(maxsize=256)
def from_config(name: str, config: str) -> Backend:
    """Rebuild a backend from ``name`` and its ``to_config()`` string (the op-boundary encoding).

    Cached: every op call decodes its config, and kernels treat the result as read-only."""
    cls = BACKEND_CLASSES[name]
    data = {}
    for item in filter(None, config.split(";")):
        key, _, val = item.partition("=")
        data[key] = ast.literal_eval(val)
    return cls(**data)


def resolve_backends(backend: BackendLike = None, forward_backend: BackendLike = None,
                     backward_backend: BackendLike = None) -> tuple[Backend | None, Backend | None]:
    """Return the (forward, backward) configs; None means "implicit: let the dispatcher choose".

    ``backend`` fills both directions it configures; explicit ``forward_backend`` / ``backward_backend``
    take priority. A forward-only backend given as ``backend`` leaves the backward implicit.
    """
    both = as_backend(backend, "backend")
    fwd = as_backend(forward_backend, "forward_backend")
    bwd = as_backend(backward_backend, "backward_backend")
    if fwd is not None and not fwd.forward:
        raise ValueError(f"forward_backend={fwd!r} does not configure the forward pass")
    if bwd is not None and not bwd.backward:
        raise ValueError(f"backward_backend={bwd!r} does not configure the backward pass")
    if fwd is None and both is not None and both.forward:
        fwd = both
    if bwd is None and both is not None and both.backward:
        bwd = both
    return fwd, bwd


# ----------------------------------------------------------------------------------------------------
# availability (no kernel imports)


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_CAPS: dict[int, tuple[int, int]] = {}
_MODULES: dict[str, bool] = {}


def _cuda_capability(index: int) -> tuple[int, int]:
    # plain dict caches (not functools.lru_cache) so torch.compile traces the planner without warnings
    if index not in _CAPS:
        _CAPS[index] = torch.cuda.get_device_capability(index)
    return _CAPS[index]


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for other devices."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def _module_present(name: str) -> bool:
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            _MODULES[name] = False
    return _MODULES[name]


def backend_available(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device`` at all, with the reason when not."""
    cap = device_capability(device)
    if name == "sdpa":
        return True, "torch SDPA runs everywhere"
    if name == "triton":
        if not _module_present("triton"):
            return False, "triton is not installed"
        if device.type == "cpu":
            if _interpreter_on():
                return True, "CPU tensors under TRITON_INTERPRET=1 (interpreter)"
            return False, "CPU tensors need TRITON_INTERPRET=1 for the Triton backend"
        if cap is None:
            return False, f"device type {device.type!r} is not supported by Triton kernels"
        if cap < (8, 0):
            return False, f"compute capability {cap} < (8, 0)"
        return True, f"CUDA sm{cap[0]}{cap[1]}"
    if name == "cuda":
        if cap is None:
            return False, "the CUDA backend needs a CUDA device"
        if cap < (8, 0):
            return False, f"compute capability {cap} < (8, 0)"
        if not _module_present("ffpa_attn.cuda"):
            return False, "the CUDA kernel sources are not part of this build"
        return True, f"CUDA sm{cap[0]}{cap[1]}"
    if name == "cutedsl":
        if cap is None:
            return False, "the CuTeDSL backend needs a CUDA device (sm90)"
        if cap != (9, 0):
            return False, f"the CuTeDSL kernels are built for sm90a, device is sm{cap[0]}{cap[1]}"
        if not _module_present("cutlass"):
            return False, "nvidia-cutlass-dsl is not installed (pip install 'ffpa-attn[cute]')"
        if not _module_present("ffpa_attn.cute"):
            return False, "the CuTeDSL kernels are not part of this build"
        return True, "sm90 with nvidia-cutlass-dsl"
    raise ValueError(f"unknown backend {name!r}")


# ----------------------------------------------------------------------------------------------------
# feature support per backend and direction

# Head-dim range each FFPA kernel family handles (inclusive bounds). The CuTeDSL family advertises the
# dims its module implements (cute/__init__.py: SUPPORTED_HEAD_DIMS) once it exists.
TRITON_D_RANGE = (16, 1024)
CUDA_D_RANGE = (257, 1024)


# Where the implicit default tries the CUDA forward first, per compute capability: head dims where it
# measured fastest of our forwards (H200, bf16, B=1 H=32 N=8192, 2026-11-29, 32 rows per warp:
# D=768 185 vs CuTeDSL 133 / Triton 109 TFLOPS, D=1024 197 vs 178 / 117;
# bench/results/2026-11-29-h200-session2/). The backward then follows the usual rule (Triton).
CUDA_PREFERRED_HEAD_DIMS: dict[tuple[int, int], frozenset[int]] = {(9, 0): frozenset({768, 1024})}


def cuda_preferred(prob: DenseProblem | VarlenProblem) -> bool:
    """Whether the implicit default tries the CUDA forward first for this (dense) problem."""
    if isinstance(prob, VarlenProblem) or prob.device.type != "cuda":
        return False
    return prob.d in CUDA_PREFERRED_HEAD_DIMS.get(device_capability(prob.device), frozenset())


def cute_preferred_dims() -> frozenset[int]:
    """Head dims where the implicit default prefers the CuTeDSL forward (it measured faster there)."""
    if not _module_present("ffpa_attn.cute._dims"):
        return frozenset()
    from .cute import _dims  # type: ignore[attr-defined]

    return frozenset(getattr(_dims, "PREFERRED_HEAD_DIMS", _dims.SUPPORTED_HEAD_DIMS))


def _cute_dims() -> tuple[frozenset[int], frozenset[int], frozenset[str]]:
    """(forward head dims, backward head dims, directions with a varlen kernel) the CuTeDSL package really
    supports; a varlen direction takes the same head dims as the dense one.

    Read from ``cute/_dims.py`` without importing cutlass (``cute/__init__.py`` imports it lazily).
    """
    if not _module_present("ffpa_attn.cute._dims"):
        return frozenset(), frozenset(), frozenset()
    from .cute import _dims  # type: ignore[attr-defined]

    return (frozenset(_dims.SUPPORTED_HEAD_DIMS), frozenset(getattr(_dims, "SUPPORTED_BWD_HEAD_DIMS", ())),
            frozenset(getattr(_dims, "VARLEN_DIRECTIONS", ())))


def unsupported_reason(name: str, direction: str, prob: DenseProblem | VarlenProblem,
                       cfg: Backend | None) -> str | None:
    """Why backend ``name`` cannot run ``direction`` ("forward"/"backward") of ``prob``; None if it can."""
    varlen = isinstance(prob, VarlenProblem)
    mask_kind = "none" if varlen else prob.mask_kind
    if name != "sdpa" and prob.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {prob.dtype} (FFPA kernels take fp16/bf16)"
    if prob.dv != prob.d and name != "sdpa":
        return f"value head dim {prob.dv} != query/key head dim {prob.d}"
    if name == "triton":
        lo, hi = TRITON_D_RANGE
        if not lo <= prob.d <= hi:
            return f"head dim D={prob.d} outside the Triton kernels' range [{lo}, {hi}]"
        return None
    if name == "cuda":
        if direction == "backward":
            return "the CUDA backend is forward-only"
        lo, hi = CUDA_D_RANGE
        if not lo <= prob.d <= hi:
            return f"head dim D={prob.d} outside the CUDA kernel's range [{lo}, {hi}]"
        if varlen:
            return "the CUDA backend has no varlen kernel"
        if mask_kind != "none":
            return "the CUDA backend takes no attn_mask"
        if prob.dropout_p > 0:
            return "the CUDA backend has no dropout"
        return None
    if name == "cutedsl":
        fwd_dims, bwd_dims, varlen_directions = _cute_dims()
        dims = fwd_dims if direction == "forward" else bwd_dims
        if prob.d not in dims:
            have = ", ".join(map(str, sorted(dims))) or "none yet"
            return f"head dim D={prob.d} has no CuTeDSL {direction} kernel (built: {have})"
        if varlen and direction not in varlen_directions:
            return f"the CuTeDSL backend has no varlen {direction} kernel yet"
        if mask_kind != "none":
            return "the CuTeDSL backend takes no attn_mask"
        if prob.dropout_p > 0:
            return "the CuTeDSL backend has no dropout"
        return None
    if name == "sdpa":
        return None
    raise ValueError(f"unknown backend {name!r}")


def check_backend_config(cfg: Backend | None, prob: DenseProblem | VarlenProblem) -> None:
    """Config errors that depend on the inputs (ValueError), e.g. bf16 with CUDABackend(acc='f16')."""
    if isinstance(cfg, CUDABackend) and cfg.acc == "f16" and prob.dtype == torch.bfloat16:
        raise ValueError("CUDABackend(acc='f16') needs fp16 inputs: there is no bf16 mma with an f16 "
                         "accumulator; use acc='f32' for bf16")


@dataclass(frozen=True)
class Choice:
    """Which backend and kernel one direction uses, and why."""

    backend: str
    kernel: str
    reason: str
    explicit: bool
    config: Backend

    def __str__(self) -> str:
        how = "explicit" if self.explicit else "implicit"
        return f"{self.backend}:{self.kernel} ({how}; {self.reason})"


@dataclass(frozen=True)
class Plan:
    """The choice for each direction of one call. ``direct_sdpa``: both SDPA, call torch SDPA as is."""

    forward: Choice
    backward: Choice

    @property
    def direct_sdpa(self) -> bool:
        return self.forward.backend == "sdpa" and self.backward.backend == "sdpa"

    def __str__(self) -> str:
        return f"forward: {self.forward}\nbackward: {self.backward}"


_LOGGED: set[str] = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.debug("ffpa_attn falls back to SDPA: %s", reason)


def triton_forward_kernel(nq: int, nkv: int, varlen: bool = False, dropout: bool = False) -> str:
    """Which Triton forward kernel serves a call: split-KV ("flash decoding") for few query rows against a
    long KV sequence, else the split-D kernel. The Triton package dispatches by this same function.

    Split-KV when Nq <= 64 and the KV is at least 16 tiles of the query length (Nkv >= 16 * max(Nq, 16):
    256 keys for a decode step, 1024 at Nq = 64): there the split-D kernel has one program per (batch,
    head, query block) - too few to stream the KV cache at full bandwidth - and reads each KV head once
    per query head of a GQA group; split-KV shares one K/V read per group and spreads the KV over the
    GPU (with one split it is a single launch, so short caches lose nothing). Dropout and varlen use the
    split-D kernels.
    """
    if not varlen and not dropout and nq <= 64 and nkv >= 16 * max(nq, 16):
        return "splitkv_fwd"
    return "varlen_fwd" if varlen else "fwd"


def cute_forward_kernel(nq: int, nkv: int, causal: bool) -> str:
    """Which CuTeDSL forward kernel serves a dense call: ``"splitkv_fwd_sm90"`` (the forward kernel on packed
    GQA rows x KV slices, :mod:`ffpa_attn.cute.splitkv`) for split-KV-sized calls (the Triton rule,
    :func:`triton_forward_kernel`) where every row sees the same keys (not causal, or Nq == 1); else
    ``"fwd_sm90"``. With 64-key tiles it measured at least as fast as the Triton split-KV kernel on every shape
    of the issue-11 table (H200, D=512, Nkv=32768, Hkv 32/8/2 x Nq 1/4/16: +1% to +5% at 1-16 rows per KV
    head, and up to 2.5x where Triton is MMA-bound; bench/results/2026-12-01-h200-session6/decode_nsplit3).
    The CuTeDSL package dispatches by this same function."""
    if triton_forward_kernel(nq, nkv) == "splitkv_fwd" and (not causal or nq == 1):
        return "splitkv_fwd_sm90"
    return "fwd_sm90"


def _kernel_name(name: str, direction: str, prob: DenseProblem | VarlenProblem) -> str:
    varlen = isinstance(prob, VarlenProblem)
    if name == "triton":
        if direction == "forward":
            if varlen:
                return triton_forward_kernel(0, 0, varlen=True)
            return triton_forward_kernel(prob.nq, prob.nkv, dropout=prob.dropout_p > 0)
        return "varlen_bwd" if varlen else "bwd"
    if name == "sdpa":
        return "math_bwd" if direction == "backward" else "sdpa_fwd"
    if name == "cutedsl" and direction == "forward" and not varlen:
        return cute_forward_kernel(prob.nq, prob.nkv, prob.causal)
    if name == "cutedsl" and direction == "backward" and not varlen:
        from .cute.config import DEFAULT_BWD_DQ_MODE  # (no cutlass import)

        return "bwd_sm90+bwd_dq_sm90" if DEFAULT_BWD_DQ_MODE == "separate" else "bwd_sm90"  # dK/dV [+ dQ] kernels
    prefix = "varlen_" if varlen else ""
    return f"{prefix}{'fwd' if direction == 'forward' else 'bwd'}_sm90" if name == "cutedsl" else f"{prefix}fwd"


def _choose(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None,
            preferred: list[str]) -> Choice:
    if cfg is not None:
        if cfg.name != "sdpa":
            check_dtype_ffpa(prob)
        check_backend_config(cfg, prob)
        avail, why = backend_available(cfg.name, prob.device)
        if not avail:
            raise NotImplementedError(f"backend {cfg.name!r} cannot run here: {why}")
        reason = unsupported_reason(cfg.name, direction, prob, cfg)
        if reason is None and direction == "backward" and isinstance(cfg, CuTeDSLBackend) and \
                cfg.grad_kv_storage_dtype is not None:
            reason = (f"grad_kv_storage_dtype={cfg.grad_kv_storage_dtype} has no effect there: the sm90 "
                      f"backward keeps dK/dV in fp32 registers over every query block and head of a group and "
                      f"writes them once (no intermediate buffer); leave it None")
        if reason is not None:
            raise NotImplementedError(f"backend {cfg.name!r} cannot run this {direction}: {reason}")
        return Choice(cfg.name, _kernel_name(cfg.name, direction, prob), "named by the caller", True, cfg)
    reasons = []
    for name in preferred:
        avail, why = backend_available(name, prob.device)
        if not avail:
            reasons.append(f"{name}: {why}")
            continue
        reason = unsupported_reason(name, direction, prob, None)
        if reason is None and name == "cutedsl" and direction == "forward" and \
                prob.d not in cute_preferred_dims():
            reason = f"the Triton forward measured faster at D={prob.d}"
        if reason is not None:
            reasons.append(f"{name}: {reason}")
            continue
        if name == "sdpa":
            why = "; ".join(reasons) if reasons else "default"
            _log_fallback_once(why)
            return Choice("sdpa", _kernel_name("sdpa", direction, prob), why, False, SDPABackend())
        skipped = f"; not {'; not '.join(reasons)}" if reasons else ""
        return Choice(name, _kernel_name(name, direction, prob), f"default for this request ({why}){skipped}",
                      False, BACKEND_CLASSES[name]())
    raise AssertionError("sdpa always accepts")  # pragma: no cover


def check_dtype_ffpa(prob: DenseProblem | VarlenProblem) -> None:
    """TypeError unless the problem's dtype is fp16/bf16 (FFPA path)."""
    check_dtype(torch.empty(0, dtype=prob.dtype), "query")


def plan(prob: DenseProblem | VarlenProblem, fwd_cfg: Backend | None, bwd_cfg: Backend | None,
         needs_backward: bool = True) -> Plan:
    """Choose backend + kernel per direction (fallback rule for implicit choices, errors for explicit).

    ``needs_backward=False`` (grad disabled or no input requires grad): an explicitly named backward backend
    that cannot run this backward is recorded with kernel ``"none"`` instead of raising, so a forward-only
    capable backend can be named for inference. Invalid configurations (ValueError) still raise.
    """
    implicit_sdpa_reason = None
    if not in_ffpa_range(prob.d):
        implicit_sdpa_reason = f"head dim D={prob.d} outside the FFPA range (256, 1024]"
    if fwd_cfg is None and bwd_cfg is None and implicit_sdpa_reason is None:
        # the FFPA path: its dtypes only
        check_dtype_ffpa(prob)
    if fwd_cfg is None:
        if implicit_sdpa_reason is not None:
            _log_fallback_once(implicit_sdpa_reason)
            fwd = Choice("sdpa", _kernel_name("sdpa", "forward", prob), implicit_sdpa_reason, False,
                         SDPABackend())
        else:
            order = ["cutedsl", "triton", "sdpa"]
            if isinstance(prob, DenseProblem) and \
                    triton_forward_kernel(prob.nq, prob.nkv, dropout=prob.dropout_p > 0) == "splitkv_fwd":
                order = ["triton", "cutedsl", "sdpa"]  # short queries: the split-KV kernel fills the GPU
                if cute_forward_kernel(prob.nq, prob.nkv, prob.causal) == "splitkv_fwd_sm90":
                    order = ["cutedsl", "triton", "sdpa"]  # measured at least as fast (cute_forward_kernel)
            elif cuda_preferred(prob):
                order = ["cuda", *order]
            fwd = _choose("forward", prob, None, order)
    else:
        fwd = _choose("forward", prob, fwd_cfg, [])
    if bwd_cfg is None:
        # follow the forward where it has a backward; dropout needs the forward's RNG family
        if fwd.backend == "sdpa" and not fwd.explicit:
            bwd = Choice("sdpa", _kernel_name("sdpa", "backward", prob), fwd.reason, False, SDPABackend())
        elif fwd.backend == "sdpa":
            bwd = _choose("backward", prob, None, ["sdpa"])
        else:
            # the CuTeDSL backward wherever it can run: it measured faster than the Triton backward at every
            # head dim it has (H200 bf16 N=8192, 2026-11-29: D=320 184/170 vs 147/163 TFLOPS non-causal/causal,
            # 384 215/198 vs 145/149, 512 230/224 vs 133/142; 2026-12-01, bench/results/2026-12-01-h200-session6:
            # D=576 167/159 vs 108/108, 768 161/161 vs 112/121, 1024 134 vs 98 non-causal); masks, dropout (the
            # forward's RNG) and varlen (until cute/_dims.VARLEN_DIRECTIONS lists the backward) go to Triton
            bwd = _choose("backward", prob, None, ["cutedsl", "triton", "sdpa"])
    else:
        try:
            bwd = _choose("backward", prob, bwd_cfg, [])
        except NotImplementedError as exc:
            if needs_backward:
                raise
            bwd = Choice(bwd_cfg.name, "none", f"not needed: no input requires grad ({exc})", True, bwd_cfg)
    if prob.dropout_p > 0 and not (fwd.backend == bwd.backend == "sdpa"):
        if fwd.backend != "triton" or bwd.backend != "triton":
            if fwd.explicit or bwd.explicit:
                raise NotImplementedError(
                    f"dropout_p={prob.dropout_p} needs the same RNG in both directions: forward "
                    f"{fwd.backend!r} and backward {bwd.backend!r} cannot share a dropout mask "
                    f"(use backend='triton' or backend='sdpa')"
                )
            why = f"dropout with forward {fwd.backend!r} / backward {bwd.backend!r}"
            _log_fallback_once(why)
            fwd = Choice("sdpa", _kernel_name("sdpa", "forward", prob), why, False, SDPABackend())
            bwd = Choice("sdpa", _kernel_name("sdpa", "backward", prob), why, False, SDPABackend())
    if fwd.backend == bwd.backend == "sdpa" and not isinstance(prob, VarlenProblem):
        # both directions SDPA: the interface calls torch SDPA itself and autograd runs its backward
        fwd = dataclasses.replace(fwd, kernel="torch_sdpa")
        bwd = dataclasses.replace(bwd, kernel="torch_sdpa_autograd")
    return Plan(fwd, bwd)

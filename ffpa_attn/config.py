"""The public backend configuration objects and how the ``backend`` kwargs become one config per direction.

The dataclasses keep the seed API's names and constructor signatures. They are frozen: a config is validated
once, in ``__post_init__``, and can never change afterwards (``dataclasses.replace(cfg, field=value)`` builds a
new, validated one), so what the planner checked is what the kernel runs. ``to_config`` / :func:`from_config`
carry a config across the torch op boundary as a string.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Union

import torch

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


@dataclass(frozen=True)
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
            object.__setattr__(self, "forward", can_f)
        if self.backward is None:
            object.__setattr__(self, "backward", can_b)
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

    def check_inputs(self, dtype: torch.dtype) -> None:
        """Config errors that depend on the inputs (ValueError); none for most configs."""

    def to_config(self) -> str:
        """The backend-specific fields as ``name=repr;...`` (what crosses the torch op boundary as a string).

        Plain string formatting of constants, so torch.compile traces it without a graph break.
        """
        skip = ("name", "forward", "backward")
        return ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                        if f.name not in skip)


@dataclass(frozen=True)
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
        object.__setattr__(self, "grad_kv_storage_dtype",
                           _norm_grad_dtype(self.grad_kv_storage_dtype, "TritonBackend.grad_kv_storage_dtype"))
        object.__setattr__(self, "grad_q_storage_dtype",
                           _norm_grad_dtype(self.grad_q_storage_dtype, "TritonBackend.grad_q_storage_dtype"))
        if self.grad_q_storage_dtype == "float16":
            raise ValueError("TritonBackend.grad_q_storage_dtype='float16' would accumulate dQ in fp16; "
                             "use torch.float32 or None")


@dataclass(frozen=True)
class CUDABackend(Backend):
    """Hand-written CUDA forward-only backend (mma.sync, compiled at first use).

    Attributes:
        acc: MMA accumulator precision, "f32" (default) or "f16" (fp16 inputs only).
        stages: cp.async pipeline stages, 1..4; None = per-arch default (3 on sm80/89, 4 on sm90).
        enable_fp8, enable_fp4: the public ffpa-attn package's quantized sm120 forwards (FP8 / NVFP4), accepted
            for its callers; only False is implemented: True raises NotImplementedError here, at construction.
    """

    name: str = "cuda"
    acc: str = "f32"
    stages: int | None = None
    enable_fp8: bool = False
    enable_fp4: bool = False

    _NAME = "cuda"
    _CAN_BACKWARD = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for f, what in (("enable_fp8", "FP8"), ("enable_fp4", "NVFP4")):
            value = getattr(self, f)
            if not isinstance(value, bool):
                raise ValueError(f"CUDABackend.{f} must be a bool, got {value!r}")
            if value:
                raise NotImplementedError(
                    f"CUDABackend({f}=True): this package has no {what} attention kernel (the public ffpa-attn "
                    f"package's sm120 quantized forward); the CUDA backend computes in fp16/bf16 only")
        if self.acc not in ("f16", "f32"):
            raise ValueError(f"CUDABackend.acc must be 'f16' or 'f32', got {self.acc!r}")
        if self.stages is not None and (isinstance(self.stages, bool) or not isinstance(self.stages, int)
                                        or not 1 <= self.stages <= 4):
            raise ValueError(f"CUDABackend.stages must be an int in 1..4 or None, got {self.stages!r}")

    def check_inputs(self, dtype: torch.dtype) -> None:
        if self.acc == "f16" and dtype == torch.bfloat16:
            raise ValueError("CUDABackend(acc='f16') needs fp16 inputs: there is no bf16 mma with an f16 "
                             "accumulator; use acc='f32' for bf16")


@dataclass(frozen=True)
class CuTeDSLBackend(Backend):
    """CuTeDSL sm90a (Hopper) backend, forward + backward; needs the ``cute`` extra.

    Attributes:
        fwd_recompute: 512 < D <= 1024, dense calls: which forward kernel. None (default) = the one measured
            faster on this GPU (the S-recompute kernel on sm90, ``docs/design.md``); True = the S-recompute forward
            (two CTAs per query block without a cluster, each computing the whole S and half of O); False = the
            2-CTA cluster forward. True is refused (NotImplementedError) where it would change nothing: D <= 512
            (one CTA already owns a query block), the split-KV path of short query lengths, varlen.
        grad_kv_storage_dtype: accepted for code written for the public ffpa-attn package, where it sets the
            storage dtype of an intermediate dK/dV buffer. The kernels here keep dK/dV in fp32 registers and write
            them once, so only None is valid (anything else raises ValueError); it is not stored.
    """

    name: str = "cutedsl"
    grad_kv_storage_dtype: dataclasses.InitVar[Union[torch.dtype, str, None]] = None
    fwd_recompute: bool | None = None

    _NAME = "cutedsl"

    def __post_init__(self, grad_kv_storage_dtype: Union[torch.dtype, str, None] = None) -> None:
        super().__post_init__()
        if grad_kv_storage_dtype is not None:
            raise ValueError(f"CuTeDSLBackend.grad_kv_storage_dtype={grad_kv_storage_dtype!r}: the sm90 backward "
                             "keeps dK/dV in fp32 registers over every query block and head of a group and writes "
                             "them once (no intermediate buffer to store in another dtype); leave it None")
        if self.fwd_recompute is not None and not isinstance(self.fwd_recompute, bool):
            raise ValueError(f"CuTeDSLBackend.fwd_recompute must be a bool or None, got {self.fwd_recompute!r}")


@dataclass(frozen=True)
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


__all__ = ["Backend", "TritonBackend", "CUDABackend", "CuTeDSLBackend", "SDPABackend", "BACKEND_CLASSES",
           "BackendLike", "as_backend", "from_config", "resolve_backends", "grad_storage_dtype"]

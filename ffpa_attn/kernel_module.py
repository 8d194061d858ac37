"""The kernel-module protocol: what every backend package offers -- its description and its entry points.

Each backend is one package (``ffpa_attn.sdpa``, ``ffpa_attn.triton``, ``ffpa_attn.cuda``, ``ffpa_attn.cutedsl``)
holding two things:

* ``backend.json``, the description of what it can run (:class:`BackendSpec`: devices, head dims, the kernels of
  each entry point, features). It is data the package owns: the package itself reads it (:func:`load_spec`) to know
  its kernel names, and :mod:`ffpa_attn.dispatch.registry` collects every description by reading the same files
  (without importing a kernel package), so what the planner believes and what the package runs cannot drift;
* the five entry points below, called only by :mod:`ffpa_attn.ops`, on
inputs validated by :mod:`ffpa_attn.contract`, after the planner chose the backend; a module raises
NotImplementedError for a call its backend cannot run (the planner never sends one).

Shapes: dense q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]``, out like q, lse ``[B, Hq, Nq]`` fp32; varlen
q ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]``, lse ``[Hq, T_q]`` fp32; KV cache (flash-attn's layout) q ``[B, Nq, Hq,
D]``, out like q, lse ``[B, Hq, Nq]`` fp32, caches and lengths as :meth:`KernelModule.kvcache_forward` says. dk/dv
come back reduced to Hkv. ``dlse`` (optional, like lse) is the gradient reaching lse: the backward uses
``delta = rowsum(dO * O) - dlse`` (:func:`ffpa_attn.common.delta.backward_delta`). lse is the natural log of the
scaled scores' sum, -inf for rows that see no key (their out is 0). ``rng`` is an int64 ``[2]`` (seed, offset)
tensor when dropout_p > 0.
``config`` is the backend's (frozen) config object (:mod:`ffpa_attn.config`). ``kernel`` is the
:class:`KernelSpec` the planner chose for this direction (:class:`ffpa_attn.dispatch.planner.KernelChoice`, what
``explain()`` reports): the kernel's name and every parameter decided for it (tile sizes, the last-wave split,
split-KV slices). The module runs exactly that, verbatim, and decides nothing itself; a name it does not have
raises ValueError (:func:`check_kernel`).

Importing this module imports neither torch nor a kernel package (the torch-free CuTeDSL compile server reads the
CuTeDSL description through it).
"""
from __future__ import annotations

import ast
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the CuTeDSL package imports check_kernel in its torch-free compile server
    from typing import Callable

    from torch import Tensor

    from .config import Backend

    # the varlen forward a KV-cache kernel that packs the cached keys calls (see KernelModule.kvcache_forward)
    VarlenForward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int], tuple[Tensor, Tensor]]


@runtime_checkable
class KernelModule(Protocol):
    """What a kernel module provides (``prepare_backward`` is optional: :class:`PreparesBackward`)."""

    def dense_forward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor], dropout_p: float,
                      rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                      kernel: KernelSpec) -> tuple[Tensor, Tensor]:
        """``(out [B, Hq, Nq, Dv], lse [B, Hq, Nq] fp32)``."""
        ...

    def dense_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       dlse: Optional[Tensor], attn_mask: Optional[Tensor], mask_grad: bool, dropout_p: float,
                       rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                       kernel: KernelSpec) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """``(dq, dk [B, Hkv, Nkv, D], dv, dmask or None)``; dmask (the mask's shape) only when ``mask_grad``."""
        ...

    def varlen_forward(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                       *, dropout_p: float, rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                       kernel: KernelSpec) -> tuple[Tensor, Tensor]:
        """``(out [T_q, Hq, Dv], lse [Hq, T_q] fp32)``; ``cu_*`` int32 cumulative sequence starts. A backend that
        claims ``seqused_k`` / ``paged_kv`` also takes ``seqused_k=`` (int32 ``[B]``) and ``block_table=`` (k / v
        then paged caches ``[num_blocks, page, Hkv, D]``, ``cu_k`` None), and its gather kernel (Triton's
        ``varlen_gather``) ``varlen=`` / ``max_total=``: another backend's varlen forward to run over the packed
        pages."""
        ...

    def varlen_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor,
                        cu_k: Tensor, max_q: int, max_k: int, *, dlse: Optional[Tensor], dropout_p: float,
                        rng: Optional[Tensor], causal: bool, scale: float, config: Backend,
                        kernel: KernelSpec) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk [T_k, Hkv, D], dv)``."""
        ...

    def kvcache_forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                        cache_seqlens: Optional[Tensor], block_table: Optional[Tensor],
                        cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], *, causal: bool,
                        scale: float, config: Backend, kernel: KernelSpec, max_total: int = 0,
                        varlen: Optional[VarlenForward] = None) -> tuple[Tensor, Tensor]:
        """Attention over a KV cache (flash-attn's ``flash_attn_with_kvcache``): ``k / v [B, Nq_new, Hkv, D]``
        (when given) are first written into the caches in place at ``cache_seqlens[b] ..``, then ``q [B, Nq, Hq, D]``
        attends over ``cache_seqlens[b] + Nq_new`` keys per sequence. Caches: paged ``[num_blocks, page, Hkv, D]``
        with an int32 ``block_table [B, max_pages]``, or contiguous ``[B_cache, N_max, Hkv, D]`` (row
        ``cache_batch_idx[b]``); ``cache_seqlens`` / ``cache_leftpad`` int32 ``[B]`` or None. No host sync on the
        lengths or tables. Returns ``(out [B, Nq, Hq, D] contiguous, lse [B, Hq, Nq] fp32)``.

        A kernel that packs the cached keys for a varlen forward (chunked prefill) runs the planner's varlen forward
        through ``varlen(q [T_q, Hq, D], k [T_k, Hkv, D], v, cu_q, cu_k, max_q, max_k) -> (out, lse [Hq, T_q])``
        (another backend's, possibly: :mod:`ffpa_attn.ops` passes it in); ``max_total`` bounds the packed keys
        (0: the module sizes the buffers itself)."""
        ...


@runtime_checkable
class PreparesBackward(Protocol):
    """The optional hook: called (through :func:`ffpa_attn.ops.prepare_backward`) before a dense or varlen forward
    (varlen: q ``[T_q, Hq, D]``, attn_mask None) whose backward will run on this backend with the spec ``kernel``, to
    start work the backward's first call would otherwise wait for (the CuTeDSL module starts compiling its backward
    kernels)."""

    def prepare_backward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Optional[Tensor], dropout_p: float,
                         causal: bool, kernel: KernelSpec) -> None:
        ...


REQUIRED = ("dense_forward", "dense_backward", "varlen_forward", "varlen_backward", "kvcache_forward")
OPTIONAL = ("prepare_backward",)
# the directions of each entry point (what the planner decides per direction)
ENTRY_DIRECTION = {"dense_forward": "forward", "dense_backward": "backward", "varlen_forward": "forward",
                   "varlen_backward": "backward", "kvcache_forward": "forward"}
# the layout of a call each entry point serves
ENTRY_LAYOUT = {"dense_forward": "dense", "dense_backward": "dense", "varlen_forward": "varlen",
                "varlen_backward": "varlen", "kvcache_forward": "kvcache"}


def entry_point(direction: str, layout: str) -> str:
    """The entry point that runs ``direction`` ("forward" / "backward") of a ``layout`` ("dense", "varlen",
    "kvcache") call."""
    return f"{layout}_{direction}"


# ---------------------------------------------------------------------------------------------- kernel spec


Param = Any  # int, bool, str, None or a tuple of those (what ast.literal_eval reads back)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel and the parameters the planner decided for it: what a kernel module runs, verbatim.

    ``params`` is a sorted tuple of ``(name, value)`` pairs (read with :meth:`get`); values are plain literals, so
    the spec crosses the torch op boundary as a string (:meth:`encode` / :func:`decode_kernel`) and torch.compile
    traces the formatting without a graph break.
    """

    name: str
    params: tuple[tuple[str, Param], ...] = ()

    @staticmethod
    def of(name: str, **params: Param) -> "KernelSpec":
        """A spec from keyword parameters (None values are left out: "not decided" reads as the default)."""
        return KernelSpec(name, tuple(sorted((k, v) for k, v in params.items() if v is not None)))

    def get(self, key: str, default: Param = None) -> Param:
        for k, v in self.params:
            if k == key:
                return v
        return default

    def encode(self) -> str:
        """``name`` or ``name[k=v;...]`` (values as Python literals)."""
        if not self.params:
            return self.name
        return f"{self.name}[{';'.join(f'{k}={v!r}' for k, v in self.params)}]"

    def __str__(self) -> str:
        return self.encode()


@functools.lru_cache(maxsize=1024)
def decode_kernel(text: str) -> KernelSpec:
    """The :class:`KernelSpec` of an :meth:`KernelSpec.encode` string (cached: every op call decodes one)."""
    name, sep, rest = text.partition("[")
    if not sep:
        return KernelSpec(name)
    if not rest.endswith("]"):
        raise ValueError(f"kernel: malformed kernel spec {text!r}")
    params = []
    for item in filter(None, rest[:-1].split(";")):
        key, _, val = item.partition("=")
        params.append((key, ast.literal_eval(val)))
    return KernelSpec(name, tuple(params))


def as_kernel_spec(kernel: "KernelSpec | str") -> KernelSpec:
    """A spec from a spec or its encoded string."""
    return kernel if isinstance(kernel, KernelSpec) else decode_kernel(kernel)


# ----------------------------------------------------------------------------------------- backend description


@dataclass(frozen=True)
class Requirement:
    """A module the backend imports at run time: missing -> the backend is unavailable, with the install hint."""

    module: str
    package: str
    extra: str | None = None  # the package extra that installs it (``None``: a core dependency)


@dataclass(frozen=True)
class BackendSpec:
    """What one backend package can run (its ``backend.json``).

    Attributes:
        name: the backend's name (``TritonBackend.name`` ...).
        label: how messages name it ("the CuTeDSL backend").
        kernel_module: the package :mod:`ffpa_attn.ops` imports (lazily) to run it.
        requires: modules it needs at run time.
        cuda_archs: inclusive ``((major, minor), (major, minor))`` range of CUDA devices, None = no CUDA device.
        cuda_archs_note: why the range is what it is (part of the reason when a device is outside it).
        cpu: ``"any"`` (runs CPU tensors), ``"interpreter"`` (under ``TRITON_INTERPRET=1``) or None.
        head_dims: ``(lo, hi, multiple_of)`` inclusive, None = any.
        dtypes: input dtype names it takes ("float16", "bfloat16"), None = any.
        kernels: kernel names per entry point (:data:`REQUIRED`); an entry point with none is a direction / layout
            the backend does not run.
        features: request features it takes: ``attn_mask``, ``mask_grad``, ``dropout``, ``value_head_dim`` (a V
            head dim other than D), ``deterministic`` (a bit-reproducible backward), ``paged_kv`` (its varlen
            forward reads K/V pages through a block table, ``varlen_forward(..., block_table=, seqused_k=)``),
            ``seqused_k`` (its varlen forward takes per-sequence key counts).
    """

    name: str
    label: str
    kernel_module: str
    requires: tuple[Requirement, ...]
    cuda_archs: tuple[tuple[int, int], tuple[int, int]] | None
    cuda_archs_note: str
    cpu: str | None
    head_dims: tuple[int, int, int] | None
    dtypes: frozenset[str] | None = None
    kernels: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    features: frozenset[str] = frozenset()

    def kernels_of(self, entry: str) -> tuple[str, ...]:
        return self.kernels.get(entry, ())

    def runs(self, direction: str, varlen: bool | str) -> bool:
        """Whether it has a kernel for ``direction`` ("forward" / "backward") of a dense or varlen call (``varlen``
        a bool), or of a call of layout ``varlen`` ("dense", "varlen", "kvcache")."""
        layout = varlen if isinstance(varlen, str) else ("varlen" if varlen else "dense")
        return bool(self.kernels_of(entry_point(direction, layout)))

    def head_dim_ok(self, d: int) -> bool:
        if self.head_dims is None:
            return True
        lo, hi, step = self.head_dims
        return lo <= d <= hi and d % step == 0

    def head_dims_text(self) -> str:
        if self.head_dims is None:
            return "any D"
        lo, hi, step = self.head_dims
        return f"D in [{lo}, {hi}]" + (f", a multiple of {step}" if step > 1 else "")


_FEATURES = frozenset({"attn_mask", "mask_grad", "dropout", "value_head_dim", "deterministic", "paged_kv",
                       "seqused_k"})
_PACKAGE_ROOT = Path(__file__).resolve().parent


def spec_path(package: str) -> Path:
    """The ``backend.json`` of kernel package ``package`` ("ffpa_attn.cutedsl"), located without importing it."""
    parts = package.split(".")
    if parts[0] != "ffpa_attn" or len(parts) != 2:
        raise ValueError(f"not a backend package of ffpa_attn: {package!r}")
    return _PACKAGE_ROOT / parts[1] / "backend.json"


@functools.lru_cache(maxsize=None)
def load_spec(package: str) -> BackendSpec:
    """Parse and check the ``backend.json`` of ``package`` (ValueError naming the file and the field)."""
    path = spec_path(package)
    raw = json.loads(path.read_text())

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: {what}")

    unknown = set(raw) - {"name", "label", "requires", "cuda_archs", "cuda_archs_note", "cpu", "head_dims", "dtypes",
                          "kernels", "features", "about"}
    if unknown:
        raise bad(f"unknown fields {sorted(unknown)}")
    kernels = {entry: tuple(names) for entry, names in raw.get("kernels", {}).items()}
    if set(kernels) - set(REQUIRED):
        raise bad(f"kernels: unknown entry points {sorted(set(kernels) - set(REQUIRED))}")
    features = frozenset(raw.get("features", ()))
    if features - _FEATURES:
        raise bad(f"features: unknown {sorted(features - _FEATURES)} (known: {sorted(_FEATURES)})")
    if raw.get("cpu") not in (None, "any", "interpreter"):
        raise bad("cpu must be null, 'any' or 'interpreter'")
    archs = raw.get("cuda_archs")
    dims = raw.get("head_dims")
    return BackendSpec(
        name=raw["name"], label=raw["label"], kernel_module=package,
        requires=tuple(Requirement(**r) for r in raw.get("requires", ())),
        cuda_archs=None if archs is None else (tuple(archs[0]), tuple(archs[1])),
        cuda_archs_note=raw.get("cuda_archs_note", ""), cpu=raw.get("cpu"),
        head_dims=None if dims is None else (dims["min"], dims["max"], dims.get("multiple_of", 1)),
        dtypes=None if raw.get("dtypes") is None else frozenset(raw["dtypes"]), kernels=kernels, features=features)


def check_kernel(spec: BackendSpec, entry: str, kernel: "KernelSpec | str") -> KernelSpec:
    """The :class:`KernelSpec` to run, after checking that it names one of the kernels that ``entry`` of this backend
    runs (its description's list): a kernel the planner named that this module does not have is a ValueError, never a
    silent substitute."""
    kernel = as_kernel_spec(kernel)
    known = spec.kernels_of(entry)
    if kernel.name not in known:
        have = ", ".join(map(repr, known)) if known else "no kernel"
        raise ValueError(f"kernel: the {spec.name} kernel module's {entry} has no kernel {kernel.name!r} (it runs {have})")
    return kernel


__all__ = ["KernelModule", "PreparesBackward", "REQUIRED", "OPTIONAL", "ENTRY_DIRECTION", "ENTRY_LAYOUT", "entry_point",
           "KernelSpec", "decode_kernel",
           "as_kernel_spec", "Requirement", "BackendSpec", "spec_path", "load_spec", "check_kernel"]

"""The implementations the benchmark times, behind one small interface.

Each :class:`Impl` turns a case and its inputs into a :class:`Prepared` callable ``fn(q, k, v) -> out``
(autograd-capable, so the runner can time forward+backward through it), or says why it cannot run:
:class:`Unavailable` (reported as ``n/a`` with the reason) or :class:`Skipped` (deliberately not run).

* ``ffpa``: what the implicit default runs (``ffpa_attn_func`` with no backend named: the planner's choice per
  direction, SDPA included where it falls back); the plot's headline series "ffpa (default)".
* ``triton``, ``cutedsl``, ``cuda``: our backends through the public ``ffpa_attn_func`` with the backend
  named explicitly (``cuda`` is forward-only); availability and kernel come from
  :func:`ffpa_attn.dispatch.registry.available` and :func:`ffpa_attn.explain`.
* ``sdpa-efficient``, ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-math``: torch SDPA pinned to one backend
  with ``torch.nn.attention.sdpa_kernel``; a backend that refuses the shape is ``n/a`` with torch's own
  reason. Where a kernel refuses ``enable_gqa`` it gets K/V expanded to Hq heads inside the timed call
  (what a model has to do). ``sdpa-math`` materializes the score matrix and is skipped above
  :data:`MATH_MAX_SCORES` elements.
* ``flex``: ``torch.compile(flex_attention)``; a compile failure is ``n/a`` and is not retried for the
  other causal setting of the same head dim.
* ``upstream-triton``, ``upstream-cutedsl``: the public ffpa-attn package loaded by
  :mod:`ffpa_attn.bench.upstream` (only listed when ``FFPA_UPSTREAM_PATH`` is set).
* ``fa4-sm90``: FlashAttention-4's CuTeDSL sm90 forward as vLLM ships it (:mod:`ffpa_attn.bench.fa4`; D = 512
  only, forward only; listed when ``FFPA_FA4_PATH`` is set).
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config import CuTeDSLBackend
from ..contract import causal_mask
from ..dispatch.registry import available as backend_available
from ..interface import explain, ffpa_attn_func
from . import fa4, upstream
from .results import Case

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

OUR_BACKENDS = ("triton", "cutedsl", "cuda")
DEFAULT_IMPL = "ffpa"  # the implicit default (no backend named)
SDPA_KINDS = {
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}
UPSTREAM_BACKENDS = ("triton", "cutedsl")
# sweep and column order: ours, the baseline, the public package, then the peers that mostly refuse D > 256
IMPL_NAMES = (DEFAULT_IMPL, *OUR_BACKENDS, "sdpa-efficient", *(f"upstream-{b}" for b in UPSTREAM_BACKENDS), "fa4-sm90",
              "flex", "sdpa-flash", "sdpa-cudnn", "sdpa-math")
FA4_HEAD_DIMS = frozenset({512})  # the head dims above 256 of FA4's sm90 forward as vLLM ships it
# variants of our backends, timed only when named (``--impl``): name -> (backend, its config)
VARIANT_IMPLS = {"cutedsl-recompute": ("cutedsl", CuTeDSLBackend(fwd_recompute=True))}
# sdpa-math materializes B*Hq*Nq*Nkv scores several times over (fwd+bwd): skip it above this many
MATH_MAX_SCORES = 2**28


class Unavailable(Exception):
    """The implementation cannot run this case; ``str(exc)`` is the reason (reported as n/a)."""


class Skipped(Exception):
    """The implementation is deliberately not run on this case; ``str(exc)`` says why."""


@dataclass
class Prepared:
    """A ready-to-time callable and what it is.

    Attributes:
        fn: ``fn(q [B, Hq, Nq, D], k [B, Hkv, Nkv, D], v) -> out [B, Hq, Nq, D]``, differentiable.
        kernel: which kernel/backend runs (for the report).
        note: a remark for the report (e.g. K/V expanded).
        bwd_unavailable: reason the backward is not measured (forward-only implementation), else None.
    """

    fn: AttnFn
    kernel: str = ""
    note: str = ""
    bwd_unavailable: str | None = None


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of the innermost cause, whitespace collapsed, cut to ``limit`` characters."""
    inner = exc
    seen = {id(inner)}
    while inner.__cause__ is not None and id(inner.__cause__) not in seen:
        inner = inner.__cause__
        seen.add(id(inner))
    msg = " ".join(str(inner).split())
    for marker in ("Set TORCH_LOGS", "You can suppress this exception"):
        cut = msg.find(marker)
        if cut > 0:
            msg = msg[:cut].rstrip(" .")
    text = f"{type(inner).__name__}: {msg}" if msg else type(inner).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Impl:
    """Base class: ``name`` plus :meth:`prepare` and the classification of failures."""

    name = ""

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        """A callable for ``case`` on these inputs; raises Unavailable / Skipped."""
        raise NotImplementedError

    def failure(self, exc: BaseException, direction: str, case: Case) -> tuple[str, str]:
        """(status, note) of a call that raised ``exc``; default: an error with its text."""
        del direction, case
        return "error", error_text(exc)


class DefaultImpl(Impl):
    """``ffpa_attn_func`` with no backend named: whatever the planner picks per direction."""

    name = DEFAULT_IMPL

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        gqa, causal = case.hq != case.hkv, case.causal
        plan = explain(q, k, v, is_causal=causal, enable_gqa=gqa)
        kernel = (f"fwd {plan.forward.backend}:{plan.forward.kernel}, "
                  f"bwd {plan.backward.backend}:{plan.backward.kernel}")

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa)

        return Prepared(fn, kernel=kernel)


class FFPAImpl(Impl):
    """One of our backends, named explicitly through ``ffpa_attn_func``."""

    def __init__(self, backend: str, name: str | None = None, config: object = None) -> None:
        """``config``: a Backend instance passed instead of the name (a variant: ``name`` labels it)."""
        if backend not in OUR_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        self.name = name or backend
        self.backend = backend
        self.config = config or backend

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        ok, why = backend_available(self.backend, q.device)
        if not ok:
            raise Unavailable(why)
        gqa = case.hq != case.hkv
        # the backward is measured only where this backend has one; otherwise time its forward alone
        no_bwd = "forward-only backend" if self.backend == "cuda" else None
        kw = {"backend": self.config}
        try:
            plan = explain(q, k, v, is_causal=case.causal, enable_gqa=gqa, **kw)
        except NotImplementedError as exc:
            kw = {"forward_backend": self.config}
            try:
                plan = explain(q, k, v, is_causal=case.causal, enable_gqa=gqa, **kw)
            except NotImplementedError:
                raise Unavailable(str(exc)) from None
            no_bwd = no_bwd or f"no {self.backend} backward for this case ({exc})"
        forward_only = no_bwd is not None
        kernel = f"fwd {plan.forward.backend}:{plan.forward.kernel}"
        if not forward_only:
            kernel += f", bwd {plan.backward.backend}:{plan.backward.kernel}"
        causal = case.causal

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa, **kw)

        return Prepared(fn, kernel=kernel, bwd_unavailable=no_bwd)


def _probe(fn: AttnFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Run ``fn`` once without grad; None if it works, else the reason (torch's warnings + the error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                fn(q, k, v)
            if q.device.type == "cuda":
                torch.cuda.synchronize(q.device)
            return None
        except RuntimeError as exc:
            err = error_text(exc, limit=200)
    reasons: list[str] = []
    for w in caught:
        text = " ".join(str(w.message).split())
        if text and text not in reasons:
            reasons.append(text)
    why = "; ".join(reasons)
    return f"{why[:400]} ({err})" if why else err


class SDPAImpl(Impl):
    """torch SDPA pinned to one of its backends."""

    def __init__(self, name: str) -> None:
        if name not in SDPA_KINDS:
            raise ValueError(f"unknown SDPA implementation {name!r}")
        self.name = name
        self.kind = SDPA_KINDS[name]

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        scores = case.b * case.hq * case.nq * case.nkv
        if self.kind == "MATH" and scores > MATH_MAX_SCORES:
            raise Skipped(f"math materializes B*Hq*Nq*Nkv = {scores:.3g} scores (> {MATH_MAX_SCORES:.3g}): "
                          f"too slow and memory-hungry at this size")
        backend = getattr(SDPBackend, self.kind)
        # SDPA's is_causal is top-left aligned; ours is tail-aligned: pass a mask when they differ
        mask = causal_mask(case.nq, case.nkv, q.device) if case.causal and case.nq != case.nkv else None
        is_causal = case.causal and mask is None
        group = case.group

        def direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.ops.aten.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                   is_causal=is_causal, enable_gqa=group > 1)

        def expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ke = k.repeat_interleave(group, dim=1)
            ve = v.repeat_interleave(group, dim=1)
            with sdpa_kernel(backend):
                return torch.ops.aten.scaled_dot_product_attention(q, ke, ve, attn_mask=mask,
                                                                   is_causal=is_causal)

        kernel = f"torch SDPA {self.kind}"
        reason = _probe(direct, q, k, v)
        if reason is None:
            return Prepared(direct, kernel=kernel)
        if q.device.type != "cuda" and "No viable backend" in reason:
            # off CUDA torch gives no reason of its own, only this error: say what it means in a short cell
            raise Unavailable(f"torch SDPA has no {self.kind} kernel for {q.device.type} tensors")
        if group > 1:
            reason_expanded = _probe(expanded, q, k, v)
            if reason_expanded is None:
                return Prepared(expanded, kernel=kernel,
                                note="K/V expanded to Hq heads inside the timed call (no enable_gqa here)")
            reason = reason_expanded
        raise Unavailable(reason)


class FlexImpl(Impl):
    """``torch.compile(flex_attention)`` with a block mask for causal."""

    name = "flex"

    def __init__(self) -> None:
        self._failed: dict[tuple[int, str], str] = {}

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        if q.device.type != "cuda":
            raise Unavailable("FlexAttention is only compiled for CUDA devices here")
        failed = self._failed.get((case.d, case.dtype))
        if failed is not None:
            raise Unavailable(failed)
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError as exc:
            raise Unavailable(f"this torch has no FlexAttention ({exc})") from None
        torch._dynamo.reset()  # a fresh compile per case: no recompile-limit fallback to eager
        compiled = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if case.causal:
            offset = case.nkv - case.nq

            def tail_causal(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(tail_causal, None, None, case.nq, case.nkv, device=q.device)
        gqa = case.group > 1

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

        return Prepared(fn, kernel="torch.compile(flex_attention)")

    def failure(self, exc: BaseException, direction: str, case: Case) -> tuple[str, str]:
        what = "forward" if direction == "fwd" else "backward"
        note = f"{what} does not compile/run: {error_text(exc)}"
        if direction == "fwd":
            self._failed[(case.d, case.dtype)] = f"not retried after failing at {case.label()}: {note}"
        return "n/a", note


class UpstreamImpl(Impl):
    """The public ffpa-attn package (see :mod:`ffpa_attn.bench.upstream`) with one backend named."""

    def __init__(self, backend: str) -> None:
        if backend not in UPSTREAM_BACKENDS:
            raise ValueError(f"unknown upstream backend {backend!r}")
        self.name = f"upstream-{backend}"
        self.backend = backend

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        try:
            mod = upstream.load()
        except Exception as exc:
            raise Unavailable(f"cannot import the public ffpa-attn ({upstream.ENV_VAR}): "
                              f"{error_text(exc)}") from None
        if q.device.type != "cuda":
            raise Unavailable("the public ffpa-attn kernels need a CUDA device")
        if self.backend == "cutedsl" and importlib.util.find_spec("cutlass") is None:
            raise Unavailable("nvidia-cutlass-dsl is not installed")
        causal, gqa, backend = case.causal, case.group > 1, self.backend

        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return mod.ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa, backend=backend)

        return Prepared(fn, kernel=f"ffpa-attn {upstream.version(mod)} backend={backend}")

    def failure(self, exc: BaseException, direction: str, case: Case) -> tuple[str, str]:
        if isinstance(exc, NotImplementedError):
            return "n/a", error_text(exc)
        if isinstance(exc, ModuleNotFoundError):  # a dependency its kernels import on first use
            return "error", error_text(upstream.missing_dependency(exc), limit=500)  # two folder names
        return super().failure(exc, direction, case)


class FA4Impl(Impl):
    """FlashAttention-4's CuTeDSL sm90 forward as vLLM ships it (see :mod:`ffpa_attn.bench.fa4`), forward only."""

    name = "fa4-sm90"

    def prepare(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
            raise Unavailable("FA4's sm90 forward needs a Hopper GPU")
        if case.d not in FA4_HEAD_DIMS:
            raise Unavailable(f"FA4's sm90 forward runs head dim {sorted(FA4_HEAD_DIMS)} above 256, not {case.d}")
        try:
            fn = fa4.dense_forward(case.causal)
        except Exception as exc:
            raise Unavailable(f"cannot import FA4's CuTeDSL package ({fa4.ENV_VAR}): {error_text(exc)}") from None
        return Prepared(fn, kernel=f"{fa4.MODULE}.flash_attn_func", bwd_unavailable="forward only (the peer as "
                        "vLLM ships it)")


def make_impl(name: str) -> Impl:
    """The implementation called ``name`` (one of :data:`IMPL_NAMES`)."""
    if name == DEFAULT_IMPL:
        return DefaultImpl()
    if name in OUR_BACKENDS:
        return FFPAImpl(name)
    if name in VARIANT_IMPLS:
        backend, config = VARIANT_IMPLS[name]
        return FFPAImpl(backend, name, config)
    if name in SDPA_KINDS:
        return SDPAImpl(name)
    if name == "flex":
        return FlexImpl()
    if name.startswith("upstream-") and name.removeprefix("upstream-") in UPSTREAM_BACKENDS:
        return UpstreamImpl(name.removeprefix("upstream-"))
    if name == FA4Impl.name:
        return FA4Impl()
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join((*IMPL_NAMES, *VARIANT_IMPLS))}")


def default_impl_names() -> list[str]:
    """Every implementation; the upstream ones only when ``FFPA_UPSTREAM_PATH`` is set, FA4 only with
    ``FFPA_FA4_PATH``."""
    return [n for n in IMPL_NAMES if n not in left_out_by_default()]


def left_out_by_default() -> dict[str, str]:
    """``{name: reason}`` of the implementations a default run does not include (reported, never silent)."""
    out = {}
    if upstream.upstream_path() is None:
        out.update({n: f"{upstream.ENV_VAR} (the public ffpa-attn to compare with) is not set"
                    for n in IMPL_NAMES if n.startswith("upstream-")})
    if not fa4.fa4_paths():
        out[FA4Impl.name] = f"{fa4.ENV_VAR} (FA4's sm90 forward as vLLM ships it) is not set"
    return out


def make_impls(names: Sequence[str] | None = None) -> list[Impl]:
    return [make_impl(n) for n in (default_impl_names() if names is None else names)]

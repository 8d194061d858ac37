"""The planner: which backend and kernel run each direction of one validated call, and why (``explain``).

Generic ordering + fallback; it knows no backend by name:

1. a backend named by the caller runs or raises NotImplementedError with the reason (never a silent fallback);
2. otherwise the forward takes the first backend of :func:`.heuristics.forward_order` that is available on the
   device and can run the call (:mod:`.registry`, from each backend's own description) and that measurement does
   not pass over (:func:`.heuristics.implicit_skip`); SDPA is always last and always runs;
3. the backward takes the first of :func:`.heuristics.backward_order` that can run it (SDPA when the forward is SDPA);
4. dropout needs one RNG family in both directions (Triton's, or SDPA's).

The result is a :class:`KernelChoice` per direction with the complete :class:`~ffpa_attn.kernel_module.KernelSpec`
(:func:`.heuristics.select_kernel`: kernel name, tile sizes, last-wave split, split-KV slices). It crosses the torch
op boundary as three strings (:meth:`KernelChoice.op_args`) and the kernel module runs it verbatim, so what
``explain()`` prints is what runs.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..config import BACKEND_CLASSES, Backend, SDPABackend
from ..contract import DenseProblem, KVCacheProblem, VarlenProblem, check_ffpa_dtype, in_ffpa_range
from ..fallback import warn_sdpa_fallback
from ..kernel_module import KernelSpec
from . import heuristics as heur
from . import registry

logger = logging.getLogger("ffpa_attn")

# the kernels of the two SDPA-only plans that never reach a kernel module: the interface calls torch SDPA itself
# (forward) and torch's autograd differentiates it (backward)
TORCH_SDPA = KernelSpec("torch_sdpa")
TORCH_SDPA_AUTOGRAD = KernelSpec("torch_sdpa_autograd")
NOT_NEEDED = KernelSpec("none")


@dataclass(frozen=True)
class KernelChoice:
    """Everything one direction runs: the backend, its config, the kernel with its parameters, and why."""

    backend: str
    spec: KernelSpec
    reason: str
    explicit: bool
    config: Backend

    @property
    def kernel(self) -> str:
        """The kernel's name (``spec.name``)."""
        return self.spec.name

    def op_args(self) -> tuple[str, str, str]:
        """``(backend, kernel spec, config)`` as strings: how this choice crosses the torch op boundary
        (:mod:`ffpa_attn.ops`) to the kernel module, which runs the spec with the config."""
        return self.backend, self.spec.encode(), self.config.to_config()

    def __str__(self) -> str:
        how = "explicit" if self.explicit else "implicit"
        return f"{self.backend}:{self.spec} ({how}; {self.reason})"


@dataclass(frozen=True)
class Plan:
    """The choice for each direction of one call. ``direct_sdpa``: both SDPA, call torch SDPA as is."""

    forward: KernelChoice
    backward: KernelChoice

    @property
    def direct_sdpa(self) -> bool:
        return self.forward.spec == TORCH_SDPA

    def __str__(self) -> str:
        return f"forward: {self.forward}\nbackward: {self.backward}"


_LOGGED: set[str] = set()
_GENERATION = [0]


def invalidate() -> None:
    """Mark every plan made so far as stale (callers that memoize plans compare :func:`config_generation`)."""
    _GENERATION[0] += 1


def config_generation() -> tuple:
    """What the plan of a call depends on besides the call itself: the environment variables the planner reads,
    torch's deterministic mode and the generation :func:`invalidate` bumps. Equal values, equal plans."""
    import os

    import torch

    return (_GENERATION[0], os.environ.get("FFPA_ATTN_TAIL_SPLIT"), os.environ.get("FFPA_ATTN_CUDA_ROWS_PER_WARP"),
            os.environ.get("TRITON_INTERPRET"), torch.are_deterministic_algorithms_enabled())


def _log_fallback_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.debug("ffpa_attn falls back to SDPA: %s", reason)


def _sdpa(direction: str, prob: DenseProblem | VarlenProblem, reason: str, f: heur.Facts,
          cfg: Backend | None = None) -> KernelChoice:
    return KernelChoice("sdpa", heur.select_kernel("sdpa", direction, prob, cfg, f), reason, cfg is not None,
                        cfg or SDPABackend())


def _cannot(name: str, direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None,
            f: heur.Facts) -> tuple[str | None, KernelSpec | None]:
    """``(reason, None)`` when backend ``name`` cannot run ``direction`` of ``prob`` here, else ``(None, spec)``."""
    ok, why = registry.available(name, prob.device)
    if not ok:
        return why, None
    reason = registry.unsupported(name, direction, prob)
    if reason is not None:
        return reason, None
    try:
        return None, heur.select_kernel(name, direction, prob, cfg, f)
    except heur.Unsupported as exc:
        return str(exc), None


def _named(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend, f: heur.Facts) -> KernelChoice:
    cfg.check_inputs(prob.dtype)
    reason, spec = _cannot(cfg.name, direction, prob, cfg, f)
    if reason is not None:
        raise NotImplementedError(f"backend {cfg.name!r} cannot run this {direction}: {reason}")
    return KernelChoice(cfg.name, spec, "named by the caller", True, cfg)


def _implicit(direction: str, prob: DenseProblem | VarlenProblem, order: list[str], f: heur.Facts) -> KernelChoice:
    reasons = []
    for name in order:
        if name == "sdpa":
            break
        reason, spec = _cannot(name, direction, prob, None, f)
        if reason is None:
            reason = heur.implicit_skip(name, direction, prob, f)
        if reason is not None:
            reasons.append(f"{name}: {reason}")
            continue
        _, why = registry.available(name, prob.device)
        skipped = f"; not {'; not '.join(reasons)}" if reasons else ""
        return KernelChoice(name, spec, f"default for this request ({why}){skipped}", False, BACKEND_CLASSES[name]())
    why = "; ".join(reasons) if reasons else "default"
    _log_fallback_once(why)
    if reasons:  # SDPA first in the order was asked for: no fallback
        warn_sdpa_fallback(prob.device, prob.d, why)
    return _sdpa(direction, prob, why, f)


def plan(prob: DenseProblem | VarlenProblem, fwd_cfg: Backend | None, bwd_cfg: Backend | None,
         needs_backward: bool = True, needs_lse: bool = False) -> Plan:
    """Choose backend + kernel per direction (fallback rule for implicit choices, errors for explicit ones).

    ``needs_backward=False`` (grad disabled or no input requires grad): an explicitly named backward backend that
    cannot run this backward is recorded with kernel ``"none"`` instead of raising, so a forward-only capable
    backend can be named for inference. Invalid configurations (ValueError) still raise.
    ``needs_lse`` (the low-level entries, which return lse or start from the caller's): a dense call with SDPA in
    both directions runs the SDPA kernel module, since torch SDPA itself returns no lse.
    """
    f = heur.facts(prob)
    outside = None if in_ffpa_range(prob.d) else f"head dim D={prob.d} outside the FFPA range (256, 1024]"
    if any(c is not None and c.name != "sdpa" for c in (fwd_cfg, bwd_cfg)) or \
            (fwd_cfg is None and bwd_cfg is None and outside is None):
        check_ffpa_dtype(prob)  # the FFPA path: its dtypes only (TypeError)
    if fwd_cfg is not None:
        fwd = _named("forward", prob, fwd_cfg, f)
    elif outside is not None:
        _log_fallback_once(outside)
        fwd = _sdpa("forward", prob, outside, f)
    else:
        fwd = _implicit("forward", prob, heur.forward_order(prob, f), f)
    if bwd_cfg is not None:
        try:
            bwd = _named("backward", prob, bwd_cfg, f)
        except NotImplementedError as exc:
            if needs_backward:
                raise
            bwd = KernelChoice(bwd_cfg.name, NOT_NEEDED, f"not needed: no input requires grad ({exc})", True, bwd_cfg)
    elif fwd.backend == "sdpa" and not fwd.explicit:
        bwd = _sdpa("backward", prob, fwd.reason, f)
    else:
        bwd = _implicit("backward", prob, heur.backward_order() if fwd.backend != "sdpa" else ["sdpa"], f)
    if prob.dropout_p > 0 and not (fwd.backend == bwd.backend == "sdpa"):
        if fwd.backend != "triton" or bwd.backend != "triton":
            if fwd.explicit or bwd.explicit:
                raise NotImplementedError(
                    f"dropout_p={prob.dropout_p} needs the same RNG in both directions: forward "
                    f"{fwd.backend!r} and backward {bwd.backend!r} cannot share a dropout mask "
                    f"(use backend='triton' or backend='sdpa')")
            why = f"dropout with forward {fwd.backend!r} / backward {bwd.backend!r}"
            _log_fallback_once(why)
            warn_sdpa_fallback(prob.device, prob.d, why)
            fwd, bwd = _sdpa("forward", prob, why, f), _sdpa("backward", prob, why, f)
    if fwd.backend == bwd.backend == "sdpa" and not isinstance(prob, VarlenProblem) and not needs_lse:
        # both directions SDPA: the interface calls torch SDPA itself and autograd runs its backward
        fwd = dataclasses.replace(fwd, spec=TORCH_SDPA)
        bwd = dataclasses.replace(bwd, spec=TORCH_SDPA_AUTOGRAD)
    return Plan(fwd, bwd)


# ------------------------------------------------------------------------------------------------- KV cache


NO_VARLEN = ("", "", "")  # the op arguments of a KV-cache plan without a varlen forward


@dataclass(frozen=True)
class KVCachePlan:
    """The plan of one KV-cache call (``ffpa_attn_with_kvcache``).

    ``route``: ``"decode"`` (the KV-cache kernel appends the new tokens and attends over the cache in place, split
    over KV slices), ``"paged varlen"`` (the KV-cache kernel appends, then ``varlen`` -- a varlen forward that reads
    K/V pages through the block table -- runs the chunk over the cache in place) or ``"gather+varlen"`` (the KV-cache
    kernel appends and packs each sequence's keys, then ``varlen`` -- a varlen forward, possibly another backend's
    -- runs the chunk with the dense kernels' tiles).
    """

    route: str
    kvcache: KernelChoice
    varlen: KernelChoice | None

    def op_args(self) -> tuple[str, str, str, str, str, str]:
        """The six strings the KV-cache ops take: the KV-cache choice's, then the varlen forward's (empty without)."""
        return self.kvcache.op_args() + (self.varlen.op_args() if self.varlen is not None else NO_VARLEN)

    def __str__(self) -> str:
        why = {"decode": "the split-KV kernel reads the cache in place",
               "paged varlen": "the varlen forward reads the cache's pages in place",
               "gather+varlen": "the cached keys packed, then the varlen forward"}[self.route]
        lines = [f"route: {self.route} ({why})", f"kvcache: {self.kvcache}"]
        if self.varlen is not None:
            lines.append(f"varlen forward: {self.varlen}")
        return "\n".join(lines)


def _varlen_problem(prob: KVCacheProblem, route: str) -> VarlenProblem:
    """The varlen forward of a chunk. Paged route: B sequences of Nq queries over the cache's pages, at most
    ``capacity`` keys each (their counts on the device). Gather route: the same over packed keys, plus the padding
    sequence the packed buffers end with (the lengths live on the device; the planner sees bounds)."""
    if route == "paged varlen":
        return VarlenProblem(prob.batch, prob.batch * prob.nq, prob.num_blocks * prob.page, prob.hq, prob.hkv,
                             prob.d, prob.d, prob.nq, prob.capacity, prob.dtype, prob.device, prob.causal, prob.scale,
                             0.0, page=prob.page, seqused_k=True)
    return VarlenProblem(prob.batch + 1, prob.batch * prob.nq, prob.batch * prob.capacity, prob.hq, prob.hkv, prob.d,
                         prob.d, prob.nq, prob.batch * prob.capacity, prob.dtype, prob.device, prob.causal,
                         prob.scale, 0.0)


def _forward_of_ours(vprob: VarlenProblem, cfg: Backend | None, what: str, f: heur.Facts | None = None
                     ) -> KernelChoice:
    """A varlen forward no SDPA fallback can run (a KV-cache chunk, paged K/V, seqused_k): the named backend's
    (NotImplementedError with its reason when it cannot), else the implicit varlen order's first backend of ours
    that can run it (torch SDPA's per-sequence loop reads the boundaries on the host and takes no pages: never
    here)."""
    f = f or heur.facts(vprob)
    if cfg is not None:
        return _named("forward", vprob, cfg, f)
    reasons = []
    for name in heur.forward_order(vprob, f):
        if name == "sdpa":
            continue
        reason, spec = _cannot(name, "forward", vprob, None, f)
        if reason is None:
            reason = heur.implicit_skip(name, "forward", vprob, f)
        if reason is None:
            _, why = registry.available(name, vprob.device)
            skipped = f"; not {'; not '.join(reasons)}" if reasons else ""
            return KernelChoice(name, spec, f"default for this request ({why}){skipped}", False,
                                BACKEND_CLASSES[name]())
        reasons.append(f"{name}: {reason}")
    raise NotImplementedError(f"no varlen forward for this {what}: {'; '.join(reasons)}")


def _packed_problem(prob: VarlenProblem) -> VarlenProblem:
    """A paged varlen call as the gather hands it on: the sequences over packed keys (at most ``capacity`` each) and
    the padding sequence the packed buffers end with."""
    bound = prob.batch * prob.max_seqlen_k
    return dataclasses.replace(prob, batch=prob.batch + 1, total_k=bound, max_seqlen_k=bound, page=None,
                               seqused_k=False)


def _paged(prob: VarlenProblem, cfg: Backend | None, what: str) -> tuple[str, KernelChoice, KernelChoice | None]:
    """``(route, the choice that reads the pages, the varlen forward over the packed keys or None)`` of a varlen
    forward over paged K/V (heuristic ``paged_gather_first``, :func:`.heuristics.paged_route`). A named backend
    reads the pages itself or raises (no silent fallback); implicitly, when the varlen order's first backend for
    the packed call reads no pages, the backend that reads them gathers them for it ("gather"), else it runs the
    call in place."""
    if cfg is not None:
        return "in place", _forward_of_ours(prob, cfg, what), None
    fastest = _forward_of_ours(_packed_problem(prob), None, what)
    route = heur.paged_route(registry.unsupported(fastest.backend, "forward", prob) is None)
    f = dataclasses.replace(heur.facts(prob), paged_gather=route == "gather")
    pages = _forward_of_ours(prob, None, what, f)
    if route == "in place":
        return route, pages, None
    why = f"gathers the pages for {fastest.backend}'s varlen forward, which reads none (heuristic paged_gather_first)"
    return route, dataclasses.replace(pages, reason=why), fastest


@dataclass(frozen=True)
class PagedVarlenPlan:
    """The plan of a varlen call with ``block_table`` / ``seqused_k`` (forward only).

    ``route``: ``"in place"`` (``forward`` reads the pages through the block table, or the packed keys up to
    ``seqused_k``) or ``"gather"`` (``forward`` packs the pages, then ``varlen`` -- another backend's varlen forward --
    runs the call over them).
    """

    route: str
    forward: KernelChoice
    varlen: KernelChoice | None

    def op_args(self) -> tuple[str, str, str, str, str, str]:
        """The six strings ``ffpa_attn::paged_varlen_attn`` takes: the forward's, then the varlen forward's of the
        gather route (empty without)."""
        return self.forward.op_args() + (self.varlen.op_args() if self.varlen is not None else NO_VARLEN)

    def __str__(self) -> str:
        lines = [f"route: {self.route}", f"forward: {self.forward}"]
        if self.varlen is not None:
            lines.append(f"varlen forward: {self.varlen}")
        return "\n".join(lines + ["backward: none (forward only: block_table / seqused_k)"])


def plan_paged_varlen(prob: VarlenProblem, cfg: Backend | None) -> PagedVarlenPlan:
    """Choose the kernels of a varlen call with ``block_table`` / ``seqused_k`` (``prob.forward_only``): only
    kernels that read pages or key counts can run it (SDPA cannot, at any head dim); a named backend that cannot
    raises NotImplementedError."""
    check_ffpa_dtype(prob)
    what = "varlen call with block_table / seqused_k"
    if prob.page is None:
        return PagedVarlenPlan("in place", _forward_of_ours(prob, cfg, what), None)
    return PagedVarlenPlan(*_paged(prob, cfg, what))


def plan_kvcache(prob: KVCacheProblem, cfg: Backend | None) -> KVCachePlan:
    """Choose the KV-cache kernel (and, for long chunks, the varlen forward) of one validated call.

    A named backend (``cfg``) runs the whole call or raises NotImplementedError with the reason (the registry's, e.g.
    "the CUDA backend has no KV-cache forward kernel"); otherwise the first backend of
    :func:`.heuristics.kvcache_order` that is available and can run it. There is no SDPA fallback: a call no KV-cache
    kernel can run (no Triton, a CPU tensor without ``TRITON_INTERPRET=1``, a head dim the kernels lack) raises
    NotImplementedError naming each backend's reason.
    """
    f = heur.facts(prob)
    check_ffpa_dtype(prob)
    if cfg is not None:  # a named backend without a KV-cache kernel is refused for that, before any chunk planning
        _named("forward", prob, cfg, f)
    varlen = None
    if prob.nq >= heur.value("kvcache_gather_min_nq") and prob.page is not None and not prob.has_leftpad:
        how, pages, packed = _paged(_varlen_problem(prob, "paged varlen"), cfg, "KV-cache chunk")
        f = dataclasses.replace(f, paged_gather=how == "gather")
        varlen = pages if how == "in place" else packed
    route = heur.kvcache_route(prob, f)
    if cfg is not None:
        kv = _named("forward", prob, cfg, f)
        kv = dataclasses.replace(kv, reason=f"named by the caller; {_route_reason(prob, route)}")
    else:
        reasons = []
        kv = None
        for name in heur.kvcache_order(prob, f):
            reason, spec = _cannot(name, "forward", prob, None, f)
            if reason is None:
                _, why = registry.available(name, prob.device)
                kv = KernelChoice(name, spec, f"default ({why}); {_route_reason(prob, route)}", False,
                                  BACKEND_CLASSES[name]())
                break
            reasons.append(f"{name}: {reason}")
        if kv is None:
            others = [f"{n}: {registry.unsupported(n, 'forward', prob)}" for n in registry.REGISTRY
                      if n not in heur.kvcache_order(prob, f)]
            raise NotImplementedError(f"no backend can run this KV-cache call ({'; '.join(reasons + others)})")
    if route == "gather+varlen" and varlen is None:
        varlen = _forward_of_ours(_varlen_problem(prob, route), cfg, "KV-cache chunk")
    return KVCachePlan(route, kv, varlen)


def _route_reason(prob: KVCacheProblem, route: str) -> str:
    limit = heur.value("kvcache_gather_min_nq") - 1
    if route == "decode":
        return f"Nq={prob.nq} <= {limit} new queries: decode"
    return f"Nq={prob.nq} > {limit} new queries: chunked prefill"


__all__ = ["KernelChoice", "Plan", "plan", "TORCH_SDPA", "TORCH_SDPA_AUTOGRAD", "NOT_NEEDED", "invalidate",
           "config_generation", "KVCachePlan", "plan_kvcache", "PagedVarlenPlan", "plan_paged_varlen"]

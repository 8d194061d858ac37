"""The planner: which backend and kernel run each direction of one validated call, and why (``explain``).

Rules, in order: an explicitly named backend runs or raises NotImplementedError (never a silent fallback);
an implicit choice takes the first backend of the heuristics' order (:mod:`.heuristics`) that is available
and can run the call (:mod:`.capabilities`), SDPA last; the backward follows the forward's family where it has
one; dropout needs one RNG family in both directions. The kernel name recorded in the :class:`Choice` crosses
the torch op boundary with the backend and its config (:meth:`Choice.op_args`) and is the kernel the kernel
module runs (it decides nothing again), so ``explain()`` reports what runs.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..config import BACKEND_CLASSES, Backend, CuTeDSLBackend, SDPABackend
from ..contract import DenseProblem, VarlenProblem, check_dtype, in_ffpa_range
from ..fallback import warn_sdpa_fallback
from . import capabilities as caps
from . import heuristics as heur

logger = logging.getLogger("ffpa_attn")


@dataclass(frozen=True)
class Choice:
    """Which backend and kernel one direction uses, and why."""

    backend: str
    kernel: str
    reason: str
    explicit: bool
    config: Backend

    def op_args(self) -> tuple[str, str, str]:
        """``(backend, kernel, config string)``: how this choice crosses the torch op boundary (:mod:`ffpa_attn.ops`)
        to the kernel module, which runs ``kernel`` with ``config``."""
        return self.backend, self.kernel, self.config.to_config()

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


def _kernel_name(name: str, direction: str, prob: DenseProblem | VarlenProblem) -> str:
    varlen = isinstance(prob, VarlenProblem)
    if name == "triton":
        if direction == "forward":
            if varlen:
                return heur.triton_forward_kernel(0, 0, varlen=True)
            return heur.triton_forward_kernel(prob.nq, prob.nkv, dropout=prob.dropout_p > 0)
        return "varlen_bwd" if varlen else "bwd"
    if name == "sdpa":
        return "math_bwd" if direction == "backward" else "sdpa_fwd"
    if name == "cutedsl" and direction == "forward" and not varlen:
        return heur.cute_forward_kernel(prob.nq, prob.nkv, prob.causal)
    if name == "cutedsl" and direction == "backward" and not varlen:
        return "bwd_sm90+bwd_dq_sm90"  # the dK/dV and dQ kernels
    if name == "cutedsl" and direction == "backward":
        return "varlen_bwd_sm90+varlen_bwd_dq_sm90"  # the same two kernels over key- / query-block work lists
    prefix = "varlen_" if varlen else ""
    return f"{prefix}{'fwd' if direction == 'forward' else 'bwd'}_sm90" if name == "cutedsl" else f"{prefix}fwd"


def _choose(direction: str, prob: DenseProblem | VarlenProblem, cfg: Backend | None,
            preferred: list[str]) -> Choice:
    if cfg is not None:
        if cfg.name != "sdpa":
            check_dtype_ffpa(prob)
        caps.check_backend_config(cfg, prob)
        avail, why = caps.backend_available(cfg.name, prob.device)
        if not avail:
            raise NotImplementedError(f"backend {cfg.name!r} cannot run here: {why}")
        reason = caps.unsupported_reason(cfg.name, direction, prob, cfg)
        if reason is None and direction == "backward" and isinstance(cfg, CuTeDSLBackend) and \
                cfg.grad_kv_storage_dtype is not None:
            reason = (f"grad_kv_storage_dtype={cfg.grad_kv_storage_dtype} has no effect there: the sm90 "
                      f"backward keeps dK/dV in fp32 registers over every query block and head of a group and "
                      f"writes them once (no intermediate buffer); leave it None")
        kernel = _kernel_name(cfg.name, direction, prob)
        if reason is None and direction == "forward" and isinstance(cfg, CuTeDSLBackend) and cfg.fwd_recompute:
            if isinstance(prob, VarlenProblem) or prob.d <= 512 or kernel != "fwd_sm90":
                reason = ("fwd_recompute=True has no effect there: it replaces the 2-CTA cluster forward of dense "
                          f"calls with 512 < D <= 1024 (this call: D={prob.d}, kernel {kernel}); leave it False")
            kernel = "fwd_sm90_recompute"
        if reason is not None:
            raise NotImplementedError(f"backend {cfg.name!r} cannot run this {direction}: {reason}")
        return Choice(cfg.name, kernel, "named by the caller", True, cfg)
    reasons = []
    # the S-recompute forward where it measured fastest (heuristics "cutedsl_fwd_recompute_first"), else CuTeDSL's
    # forward only at the head dims where it beat Triton
    recompute = direction == "forward" and heur.recompute_preferred(prob)
    for name in preferred:
        avail, why = caps.backend_available(name, prob.device)
        if not avail:
            reasons.append(f"{name}: {why}")
            continue
        reason = caps.unsupported_reason(name, direction, prob, None)
        if reason is None and name == "cutedsl" and direction == "forward" and not recompute and \
                prob.d not in heur.cute_preferred_dims():
            reason = f"the Triton forward measured faster at D={prob.d}"
        if reason is not None:
            reasons.append(f"{name}: {reason}")
            continue
        if name == "sdpa":
            why = "; ".join(reasons) if reasons else "default"
            _log_fallback_once(why)
            if reasons:  # SDPA first in the order was asked for: no fallback
                warn_sdpa_fallback(prob.device, prob.d, why)
            return Choice("sdpa", _kernel_name("sdpa", direction, prob), why, False, SDPABackend())
        skipped = f"; not {'; not '.join(reasons)}" if reasons else ""
        if name == "cutedsl" and recompute:
            return Choice(name, "fwd_sm90_recompute", f"default for this request ({why}; the S-recompute forward "
                          f"measured fastest above D=512 on this arch){skipped}", False,
                          CuTeDSLBackend(fwd_recompute=True))
        return Choice(name, _kernel_name(name, direction, prob), f"default for this request ({why}){skipped}",
                      False, BACKEND_CLASSES[name]())
    raise AssertionError("sdpa always accepts")  # pragma: no cover


def check_dtype_ffpa(prob: DenseProblem | VarlenProblem) -> None:
    """TypeError unless the problem's dtype is fp16/bf16 (FFPA path)."""
    check_dtype(torch.empty(0, dtype=prob.dtype), "query")


def plan(prob: DenseProblem | VarlenProblem, fwd_cfg: Backend | None, bwd_cfg: Backend | None,
         needs_backward: bool = True, needs_lse: bool = False) -> Plan:
    """Choose backend + kernel per direction (fallback rule for implicit choices, errors for explicit).

    ``needs_backward=False`` (grad disabled or no input requires grad): an explicitly named backward backend
    that cannot run this backward is recorded with kernel ``"none"`` instead of raising, so a forward-only
    capable backend can be named for inference. Invalid configurations (ValueError) still raise.
    ``needs_lse`` (the low-level entries, which return lse or start from the caller's): a dense call with SDPA
    in both directions runs the SDPA kernel module, since torch SDPA itself returns no lse.
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
            order = heur.forward_order(prob)
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
            # masks and dropout (the forward's RNG) end up on Triton (heuristics.backward_order)
            bwd = _choose("backward", prob, None, heur.backward_order())
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
            warn_sdpa_fallback(prob.device, prob.d, why)
            fwd = Choice("sdpa", _kernel_name("sdpa", "forward", prob), why, False, SDPABackend())
            bwd = Choice("sdpa", _kernel_name("sdpa", "backward", prob), why, False, SDPABackend())
    if fwd.backend == bwd.backend == "sdpa" and not isinstance(prob, VarlenProblem) and not needs_lse:
        # both directions SDPA: the interface calls torch SDPA itself and autograd runs its backward
        fwd = dataclasses.replace(fwd, kernel="torch_sdpa")
        bwd = dataclasses.replace(bwd, kernel="torch_sdpa_autograd")
    return Plan(fwd, bwd)

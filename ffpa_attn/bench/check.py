"""``python -m ffpa_attn check``: each available backend on a few shapes against the fp32 reference.

Forward output and gradients (dq, dk, dv) are compared with :func:`ffpa_attn.testing.assert_close`: the
relative error must be within the dtype tolerance (docs/design.md, "Errors and tolerances") or within 2x the error of torch's own same-dtype SDPA
on the same inputs. Each line says which backend and kernel ran (:func:`ffpa_attn.explain`).

On a CPU-only machine the caller (:mod:`ffpa_attn.cli`) sets ``TRITON_INTERPRET=1`` before anything
imports triton, and the Triton kernels run under the interpreter on tiny shapes.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..contract import causal_mask
from ..dispatch.registry import available as backend_available
from ..interface import explain, ffpa_attn_func
from ..reference import attention as reference_attention
from ..testing import assert_close, make_qkv, rel_err
from .env import dist_version
from .impls import error_text


@dataclass(frozen=True)
class CheckCase:
    """q ``[b, hq, nq, d]``, k/v ``[b, hkv, nkv, d]``."""

    b: int
    hq: int
    hkv: int
    nq: int
    nkv: int
    d: int
    causal: bool
    dtype: torch.dtype

    def label(self) -> str:
        n = f"N{self.nq}" if self.nq == self.nkv else f"N{self.nq}x{self.nkv}"
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))
        return f"B{self.b} H{self.hq}/{self.hkv} {n} D{self.d} {'causal' if self.causal else 'full'} {dt}"


# tiny shapes for the Triton interpreter (seconds on a CPU)
CPU_CASES = (
    CheckCase(1, 2, 1, 64, 64, 320, True, torch.bfloat16),
    CheckCase(1, 2, 1, 48, 80, 512, True, torch.float16),
    CheckCase(1, 2, 2, 40, 40, 512, False, torch.bfloat16),
)
# a few real shapes on a GPU: GQA, cross-attention (tail-aligned causal), odd lengths, D up to 1024
GPU_CASES = (
    CheckCase(1, 4, 1, 512, 512, 320, True, torch.bfloat16),
    CheckCase(2, 4, 2, 200, 333, 512, True, torch.float16),
    CheckCase(1, 2, 2, 1000, 1000, 512, False, torch.bfloat16),
    CheckCase(1, 8, 2, 1024, 1024, 512, True, torch.bfloat16),
    CheckCase(1, 2, 1, 256, 256, 1024, True, torch.bfloat16),
)
GPU_BACKENDS = ("default", "triton", "cutedsl", "cuda", "sdpa")
CPU_BACKENDS = ("triton",)

# call(q, k, v, causal, gqa, backend kwargs) -> out; the default is the public function
AttnCall = Callable[..., torch.Tensor]


def _ffpa_call(q, k, v, causal: bool, gqa: bool, kwargs: dict) -> torch.Tensor:
    return ffpa_attn_func(q, k, v, is_causal=causal, enable_gqa=gqa, **kwargs)


@dataclass
class CheckResult:
    """One backend on one case: PASS / FAIL / SKIP, errors per tensor, what ran, why it failed."""

    backend: str
    case: CheckCase
    status: str
    errs: dict[str, float] = field(default_factory=dict)
    plan: str = ""
    seconds: float = 0.0
    message: str = ""

    def line(self) -> str:
        errs = "  ".join(f"{k} {v:.1e}" for k, v in self.errs.items())
        what = f"  [{self.plan}]" if self.plan else ""
        tail = f"  {self.message}" if self.message and self.status != "FAIL" else ""
        return f"{self.status:<4}  {self.backend:<7} {self.case.label():<38} {errs}{what} {self.seconds:.1f}s{tail}"


def backend_kwargs(backend: str) -> tuple[dict, bool]:
    """(kwargs of ffpa_attn_func naming ``backend``, whether its backward is checked)."""
    if backend == "default":  # the implicit choice of each direction (what a user gets)
        return {}, True
    if backend == "cuda":  # forward-only
        return {"forward_backend": "cuda"}, False
    return {"backend": backend}, True


def _torch_baseline(q, k, v, case: CheckCase, dout) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """torch SDPA in the input dtype (default kernel choice): the same-dtype error baseline."""
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mask = causal_mask(case.nq, case.nkv, q.device) if case.causal and case.nq != case.nkv else None
    out = torch.ops.aten.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask,
                                                      is_causal=case.causal and mask is None,
                                                      enable_gqa=case.hq != case.hkv)
    grads = torch.autograd.grad(out, (qb, kb, vb), dout)
    return out.detach(), grads


def check_one(backend: str, case: CheckCase, device: torch.device, seed: int = 0,
              call: AttnCall = _ffpa_call) -> CheckResult:
    """Run ``backend`` on ``case`` and compare with the fp32 reference (forward, and gradients if it has a
    backward)."""
    t0 = time.perf_counter()
    kwargs, with_bwd = backend_kwargs(backend)
    gqa = case.hq != case.hkv
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = make_qkv(case.b, case.hq, case.hkv, case.nq, case.nkv, case.d, case.dtype, device,
                       requires_grad=True, generator=gen)
    dout = torch.randn(q.shape, device=device, generator=gen).to(case.dtype)
    try:
        try:
            plan = explain(q, k, v, is_causal=case.causal, enable_gqa=gqa, **kwargs)
        except NotImplementedError:
            if backend in ("default", "cuda"):
                raise
            # no backward of this backend for the case: check its forward, gradients through the default
            kwargs = {"forward_backend": backend}
            plan = explain(q, k, v, is_causal=case.causal, enable_gqa=gqa, **kwargs)
    except NotImplementedError as exc:  # the named backend cannot do this shape: say why
        return CheckResult(backend, case, "SKIP", message=str(exc))
    except Exception as exc:
        return CheckResult(backend, case, "FAIL", message=f"explain: {error_text(exc)}",
                           seconds=time.perf_counter() - t0)
    plan_text = f"fwd {plan.forward.backend}:{plan.forward.kernel}"
    if with_bwd:
        plan_text += f", bwd {plan.backward.backend}:{plan.backward.kernel}"
    result = CheckResult(backend, case, "PASS", plan=plan_text)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref_out, _ = reference_attention(qf, kf, vf, is_causal=case.causal)
    ref_grads = torch.autograd.grad(ref_out, (qf, kf, vf), dout.float())
    base_out, base_grads = _torch_baseline(q, k, v, case, dout)
    failures: list[str] = []

    def compare(name: str, got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> None:
        try:
            result.errs[name] = assert_close(got, ref, case.dtype, name, baseline=rel_err(base, ref))
        except AssertionError as exc:
            result.errs[name] = rel_err(got, ref) if got.shape == ref.shape else float("nan")
            failures.append(str(exc))

    out = None
    try:  # a crash is a failure of this backend, not of the check command
        out = call(q, k, v, case.causal, gqa, kwargs)
        compare("out", out, ref_out, base_out)
    except Exception as exc:
        failures.append(f"forward: {error_text(exc, limit=500)}")
    if with_bwd and out is not None:
        try:
            grads = torch.autograd.grad(out, (q, k, v), dout)
            for name, got, ref, base in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
                compare(name, got, ref, base)
        except Exception as exc:
            failures.append(f"backward: {error_text(exc, limit=500)}")
    if failures:
        result.status = "FAIL"
        result.message = "\n        ".join(failures)
    result.seconds = time.perf_counter() - t0
    return result


def _release(version: str | None) -> tuple[int, ...]:
    """``"3.4.0+git"`` -> (3, 4); () for None."""
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])


def interpreter_numpy_problem(triton_version: str | None, numpy_version: str | None) -> str | None:
    """Why the Triton interpreter cannot run here, for the one known case: the interpreters of triton < 3.7 turn
    1-element arrays into ints with ``int()``, which numpy >= 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"). None when the pair is fine. GPU runs are not affected."""
    if _release(triton_version) and _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter fails under numpy {numpy_version} (numpy >= 2.4 refuses "
                "int() of a 1-element array; triton >= 3.7 fixed it): pip install 'numpy<2.4' for the CPU check")
    return None


def run_check(device: torch.device, backends: Sequence[str] | None = None,
              cases: Sequence[CheckCase] | None = None, print_fn: Callable[[str], None] = print,
              call: AttnCall = _ffpa_call) -> int:
    """Check every available backend on every case, print one line each; returns the exit code
    (0 all passed, 1 any failure or nothing checked)."""
    on_gpu = device.type == "cuda"
    backends = list(backends if backends is not None else (GPU_BACKENDS if on_gpu else CPU_BACKENDS))
    cases = list(cases if cases is not None else (GPU_CASES if on_gpu else CPU_CASES))
    if not on_gpu:
        print_fn("No CUDA GPU found: checking the Triton kernels under the interpreter (TRITON_INTERPRET=1) on "
                 "tiny CPU shapes. This checks correctness, not speed; `bench` needs a GPU.")
        problem = interpreter_numpy_problem(dist_version("triton"), dist_version("numpy"))
        if problem:
            print_fn(f"warning: {problem}")
    else:
        name = torch.cuda.get_device_name(device)
        print_fn(f"GPU: {name}; checking backends {', '.join(backends)} on {len(cases)} shapes "
                 f"(first calls compile/autotune)")
    try:  # what a user's default call would run (D=512 causal GQA)
        q, k, v = make_qkv(1, 4, 1, 128, 128, 512, torch.bfloat16, device)
        print_fn("default dispatch for D=512 bf16 causal GQA:\n  " +
                 str(explain(q, k, v, is_causal=True, enable_gqa=True)).replace("\n", "\n  "))
    except Exception as exc:
        print_fn(f"default dispatch: {error_text(exc)}")
    results: list[CheckResult] = []
    for backend in backends:
        ok, why = (True, "") if backend == "default" else backend_available(backend, device)
        if not ok:
            print_fn(f"SKIP  {backend:<7} not available: {why}")
            continue
        for i, case in enumerate(cases):
            r = check_one(backend, case, device, seed=i, call=call)
            results.append(r)
            print_fn(r.line())
            if r.status == "FAIL":
                print_fn(f"        {r.message}")
    passed = sum(r.status == "PASS" for r in results)
    failed = sum(r.status == "FAIL" for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    print_fn(f"check: {passed} passed, {failed} failed, {skipped} skipped")
    if failed:
        return 1
    if passed == 0:
        print_fn("check: nothing was checked (no backend could run here)")
        return 1
    return 0

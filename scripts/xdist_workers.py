#!/usr/bin/env python3
"""How many pytest-xdist workers ``scripts/test.sh`` starts: ``FFPA_TEST_WORKERS`` when set; else 2 without a GPU
(the CPU suite is interpreter-bound) and, with one, a worker per :data:`GIB_PER_WORKER` of the free memory of
GPU 0 (every worker allocates there), at least 1 and at most the CPU count.

The tests that hold the most memory (``tests/gpu/test_transformers_gpu.py``: three Gemma-shaped models and their
gradients in one module-scoped fixture) are one ``xdist_group``, run by one worker under ``--dist loadgroup``; the
per-worker budget leaves room for that worker beside the others. Prints the count.
"""
from __future__ import annotations

import os
import sys

ENV_VAR = "FFPA_TEST_WORKERS"
CPU_WORKERS = 2
GIB_PER_WORKER = 20  # a budget per worker (the grouped model tests' worker holds several times the others' peak)


def workers(env: str | None, free_bytes: int | None, cpus: int) -> int:
    """The worker count from ``FFPA_TEST_WORKERS`` (``env``; a non-negative integer), else from the free memory of
    the GPU (``free_bytes``; None without a GPU) and the CPU count."""
    if env is not None and env.strip():
        try:
            count = int(env)
        except ValueError:
            raise SystemExit(f"{ENV_VAR} must be a non-negative integer, got {env!r}") from None
        if count < 0:
            raise SystemExit(f"{ENV_VAR} must be a non-negative integer, got {env!r}")
        return count
    if free_bytes is None:
        return CPU_WORKERS
    return max(1, min(max(cpus, 1), free_bytes // (GIB_PER_WORKER * 2**30)))


def gpu_free_bytes() -> int | None:
    """Free memory of CUDA device 0, or None without a usable GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(0)[0])
    except Exception:  # noqa: BLE001 - no usable GPU: the CPU count applies
        return None


def main() -> int:
    env = os.environ.get(ENV_VAR)
    free = None if env is not None and env.strip() else gpu_free_bytes()
    print(workers(env, free, os.cpu_count() or 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

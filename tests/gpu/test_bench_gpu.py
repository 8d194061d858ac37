"""The benchmark's CUDA timer (triton.testing.do_bench, L2 cleared before every run) on a real GPU."""
from __future__ import annotations

import pytest
import torch

from ffpa_attn.bench.timing import measure

pytestmark = pytest.mark.gpu


def test_measure_uses_do_bench_and_scales_with_work():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    small = measure(lambda: a[:1024, :1024] @ a[:1024, :1024], dev, max_reps=20, min_reps=5, budget_s=0.2)
    large = measure(lambda: a @ a, dev, max_reps=20, min_reps=5, budget_s=0.2)
    for t in (small, large):
        assert 0 < t.min_ms <= t.median_ms and 5 <= t.reps <= 20
    assert large.median_ms > 4 * small.median_ms  # 64x the FLOPs: the timer sees the work, not launch overhead

"""ffpa_attn.common.device: the one module of device facts (read once per device, plain dict caches)."""
from __future__ import annotations

import types

import torch

from ffpa_attn.common import device as hw


def test_off_gpu_facts(monkeypatch):
    cpu = torch.device("cpu")
    for dev in (cpu, None):
        assert hw.capability(dev) is None and hw.capability_major(dev) == 0
        assert hw.sm_count(dev) == hw.OFF_GPU_SM_COUNT and hw.smem_limit(dev) == hw.OFF_GPU_SMEM
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert hw.interpreter_on() and hw.gpu_name(cpu) == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not hw.interpreter_on() and hw.gpu_name(cpu) == "cpu"


def test_cuda_facts_are_read_once_per_device(monkeypatch):
    """A simulated H200 at index 1 and an older GPU at index 0 whose torch lacks the opt-in shared memory."""
    reads = []
    props = {1: types.SimpleNamespace(major=9, minor=0, multi_processor_count=132, name="NVIDIA H200 (x)",
                                      shared_memory_per_block_optin=232448),
             0: types.SimpleNamespace(major=8, minor=6, multi_processor_count=84, name="NVIDIA RTX A6000")}

    def get_device_properties(index):
        reads.append(index)
        return props[index]

    for table in ("_CAPABILITY", "_SM_COUNT", "_SMEM_OPTIN", "_NAME"):
        monkeypatch.setattr(hw, table, {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    h200 = torch.device("cuda", 1)
    assert hw.capability(h200) == (9, 0) and hw.capability_major(h200) == 9
    assert hw.sm_count(h200) == 132 and hw.smem_limit(h200) == 232448
    assert hw.gpu_name(h200) == "NVIDIA_H200_x"  # file-name safe
    default = torch.device("cuda")  # no index: the current device
    assert hw.capability(default) == (8, 6) and hw.sm_count(default) == 84
    assert hw.smem_limit(default) == 163 * 1024  # by capability when torch does not report it
    assert reads == [1, 0]
    assert type(hw._CAPABILITY) is dict  # a plain dict: torch.compile traces the planner's reads


def test_facts_trace_under_torch_compile():
    """The planner reads these facts inside a torch.compile'd call: they must trace without a graph break."""
    import warnings

    @torch.compile(backend="eager", fullgraph=True)
    def scaled(x):
        major = hw.capability_major(x.device) + (hw.capability(x.device) is None)
        return x * hw.sm_count(x.device) + hw.smem_limit(x.device) + major + hw.interpreter_on()

    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = scaled(x)
    want = x * hw.OFF_GPU_SM_COUNT + hw.OFF_GPU_SMEM + 1 + hw.interpreter_on()
    assert torch.equal(got, want)


def test_first_cuda_facts_read_traces_under_torch_compile():
    """The first read of a CUDA device's facts may happen while dynamo traces a compiled call (a process whose first
    attention call is compiled): reading and sanitizing the properties must trace with ``fullgraph=True``. In a fresh
    process, because a read made earlier in the process leaves caches (the facts', ``re``'s compiled patterns) that
    hide what the first one traces."""
    import subprocess
    import sys

    code = """if True:
        import torch
        from ffpa_attn.common import device as hw

        class Props:  # what torch.cuda.get_device_properties returns, for an H100
            major, minor, multi_processor_count = 9, 0, 132
            name, shared_memory_per_block_optin = " NVIDIA H100 80GB HBM3 (x)", 232448

        props = Props()
        hw._properties = lambda index: props  # the real call is folded by dynamo; this one is traced
        gpu = torch.device("cuda", 0)

        @torch.compile(backend="eager", fullgraph=True)
        def scaled(x):
            return x * hw.sm_count(gpu) + hw.capability(gpu)[0] + len(hw.gpu_name(gpu))

        got = scaled(torch.ones(2))
        assert torch.equal(got, torch.full((2,), 132.0 + 9 + len("NVIDIA_H100_80GB_HBM3_x"))), got
        assert hw._NAME[0] == "NVIDIA_H100_80GB_HBM3_x", hw._NAME
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_gpu_name_sanitizing_matches_the_pattern():
    """Runs of characters outside ``[A-Za-z0-9_.-]`` become one ``_``; the ends lose theirs."""
    import re

    for name in ("NVIDIA H200", "  a__b  (c)/d ", "x-1.2_y", "_lead", "trail!!", "", "ü GPU"):
        assert hw._safe_name(name) == re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_"), name

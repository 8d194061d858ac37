"""The benchmark's peers loaded from folders (CPU): FlashAttention-4's sm90 forward as vLLM ships it
(:mod:`ffpa_attn.bench.fa4`) through a stand-in package, and the varlen benchmark's peer columns, which say why they
did not run instead of failing."""
from __future__ import annotations

import sys

import pytest
import torch

from ffpa_attn.bench import fa4, upstream
from ffpa_attn.bench.impls import FA4Impl, Unavailable, default_impl_names, left_out_by_default
from ffpa_attn.bench.results import Case
from ffpa_attn.bench.varlen import VarlenCase, peer_unavailable, run_varlen_bench

# a stand-in for vllm/vllm_flash_attn/cute/interface.py: records the layouts it was called with and returns (out, lse)
_FAKE_INTERFACE = '''
import torch
CALLS = []

def flash_attn_func(q, k, v, causal=False, **kw):
    CALLS.append(("dense", tuple(q.shape), tuple(k.shape), causal))
    return q * 2, None

def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, **kw):
    CALLS.append(("varlen", tuple(q.shape), cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q,
                  max_seqlen_k, causal))
    return q + 1, None
'''


@pytest.fixture
def fake_fa4(tmp_path, monkeypatch):
    """FFPA_FA4_PATH naming a folder with the stand-in package and a second (dependency) folder."""
    cute = tmp_path / "stage" / "vllm" / "vllm_flash_attn" / "cute"
    cute.mkdir(parents=True)
    for d in (cute.parents[1], cute.parents[0], cute):
        (d / "__init__.py").write_text("")
    (cute / "interface.py").write_text(_FAKE_INTERFACE)
    deps = tmp_path / "deps"
    deps.mkdir()
    monkeypatch.setenv(fa4.ENV_VAR, f"{tmp_path / 'stage'}:{deps}")
    monkeypatch.setattr(fa4, "_cache", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


def test_fa4_load_errors_name_the_variable(tmp_path, monkeypatch):
    monkeypatch.setattr(fa4, "_cache", {})
    monkeypatch.delenv(fa4.ENV_VAR, raising=False)
    with pytest.raises(FileNotFoundError, match=fa4.ENV_VAR):
        fa4.load()
    monkeypatch.setenv(fa4.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="vllm/vllm_flash_attn/cute"):
        fa4.load()


def test_fa4_calls_use_its_layouts(fake_fa4):
    """Dense: [B, H, N, D] in and out, FA4 called on [B, S, H, D] views; varlen: packed tensors and boundaries."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = fa4.dense_forward(True)(q, k, v)
    assert torch.equal(out, q * 2)
    mod = fa4.load()
    assert mod.CALLS[-1] == ("dense", (2, 5, 4, 8), (2, 5, 2, 8), True)
    assert str(fake_fa4 / "deps") in sys.path and str(fake_fa4 / "stage") in sys.path
    qp = torch.randn(7, 4, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = fa4.varlen_forward(qp, qp[:, :2], qp[:, :2], cu, cu, 4, 4, False)()
    assert torch.equal(out, qp + 1)
    assert mod.CALLS[-1] == ("varlen", (7, 4, 8), [0, 3, 7], [0, 3, 7], 4, 4, False)


def test_fa4_column_is_listed_only_when_staged(fake_fa4, monkeypatch):
    assert "fa4-sm90" in default_impl_names()
    monkeypatch.delenv(fa4.ENV_VAR)
    assert "fa4-sm90" not in default_impl_names()
    assert fa4.ENV_VAR in left_out_by_default()["fa4-sm90"]


def test_fa4_impl_refuses_what_it_cannot_run(fake_fa4):
    case = Case(b=1, hq=4, hkv=4, nq=64, nkv=64, d=512, causal=True, dtype="bf16")
    q = torch.randn(1, 4, 64, 512)
    with pytest.raises(Unavailable, match="Hopper"):
        FA4Impl().prepare(case, q, q, q)


def test_varlen_peers_say_why_they_did_not_run(monkeypatch):
    """Without the staged peers (or without a GPU) the two peer columns are n/a with the reason, never an error."""
    monkeypatch.delenv(fa4.ENV_VAR, raising=False)
    monkeypatch.delenv(upstream.ENV_VAR, raising=False)
    case = VarlenCase(lens_q=(5, 3), lens_k=(5, 3), hq=2, hkv=1, d=512, causal=True, dtype="bf16")
    cpu = torch.device("cpu")
    assert upstream.ENV_VAR in peer_unavailable("upstream-cutedsl", case, cpu)
    assert fa4.ENV_VAR in peer_unavailable("fa4-sm90", case, cpu)
    assert peer_unavailable("cutedsl", case, cpu) is None
    monkeypatch.setenv(fa4.ENV_VAR, "/nonexistent")
    assert "head dim 512" in peer_unavailable("fa4-sm90", VarlenCase(lens_q=(4,), lens_k=(4,), hq=2, hkv=1, d=320,
                                                                     causal=False, dtype="bf16"), cpu)
    assert peer_unavailable("fa4-sm90", case, cpu) == "needs a CUDA device"
    [(got_case, cells)] = run_varlen_bench([case], ["upstream-cutedsl", "fa4-sm90"], cpu, max_reps=1, min_reps=1,
                                           budget_s=0.01)
    notes = {c.impl: c.note for c in cells}
    assert notes == {"upstream-cutedsl": f"{upstream.ENV_VAR} (the public ffpa-attn to compare with) is not set",
                     "fa4-sm90": "needs a CUDA device"}
    assert all(c.ms is None for c in cells)

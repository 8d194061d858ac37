"""Ring attention (ffpa_attn.distributed) on CPU: layout/schedule math in-process, and the ring itself with
gloo in 2 and 4 spawned processes, compared with the fp32 reference on the gathered sequence.

The multi-process part spawns one process group per world size (module cache) and runs every case in it;
each case compares the gathered ring output, lse and input gradients with :mod:`ffpa_attn.reference`
(fp32, autograd) on fresh random inputs. bf16 cases also allow 2x the error of single-process attention
(``ffpa_attn_func`` / ``ffpa_attn_varlen_func`` with the same backend) on the gathered inputs.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ffpa_attn import ffpa_attn_fwd, ffpa_attn_varlen_fwd, reference
from ffpa_attn.distributed import (
    dense_positions,
    gather,
    gather_varlen,
    local_cu_seqlens,
    ring_attn_func,
    ring_attn_varlen_func,
    shard,
    shard_varlen,
    unshard,
    unshard_varlen,
    varlen_positions,
)
from ffpa_attn.distributed.schedule import dense_schedule, source_rank, varlen_schedule
from ffpa_attn.testing import (AttnResult, assert_close, assert_grads_close, cu_seqlens, make_qkv, make_varlen_qkv,
                               reference_fwd_bwd, reference_varlen_fwd_bwd)

F32_TOL = 2e-5  # fp32 inputs: the ring must agree with the fp32 reference to rounding

# ------------------------------------------------------------------------------------------------ cases
# dense: n = global length; varlen: seqlens = global sequence lengths (zigzag: multiples of 2 * world)
CASES: dict[str, dict] = {
    "dense_zigzag_causal": dict(kind="dense", layout="zigzag", causal=True, b=2, hq=2, hkv=2, n=64, d=320),
    "dense_zigzag_full_gqa": dict(kind="dense", layout="zigzag", causal=False, b=1, hq=4, hkv=2, n=64, d=320),
    "dense_contig_causal_gqa": dict(kind="dense", layout="contiguous", causal=True, b=1, hq=4, hkv=1, n=64,
                                    d=320),
    "dense_contig_full": dict(kind="dense", layout="contiguous", causal=False, b=2, hq=2, hkv=2, n=32, d=320),
    "dense_cross_full": dict(kind="dense", layout="contiguous", causal=False, b=1, hq=2, hkv=2, n=32, nkv=64,
                             d=320),
    "dense_bf16_zigzag_causal_gqa_lse": dict(kind="dense", layout="zigzag", causal=True, b=1, hq=4, hkv=2, n=128,
                                             d=512, dtype="bfloat16", lse_grad=True),
    "dense_bf16_contig_causal": dict(kind="dense", layout="contiguous", causal=True, b=1, hq=2, hkv=2, n=64,
                                     d=512, dtype="bfloat16"),
    "varlen_zigzag_causal_gqa": dict(kind="varlen", layout="zigzag", causal=True, hq=4, hkv=2,
                                     seqlens=[16, 0, 48, 8, 56], d=320),
    "varlen_zigzag_full": dict(kind="varlen", layout="zigzag", causal=False, hq=2, hkv=2, seqlens=[24, 40, 64],
                               d=320),
    "varlen_contig_causal": dict(kind="varlen", layout="contiguous", causal=True, hq=2, hkv=2,
                                 seqlens=[5, 37, 1, 60, 9, 16], d=320, lse_grad=True),
    "varlen_contig_full_gqa": dict(kind="varlen", layout="contiguous", causal=False, hq=4, hkv=1,
                                   seqlens=[50, 3, 11, 64], d=320),
    "varlen_bf16_zigzag_causal": dict(kind="varlen", layout="zigzag", causal=True, hq=2, hkv=1,
                                      seqlens=[32, 64, 24, 8], d=512, dtype="bfloat16"),
    # the ring on sub-groups (ranks of even / odd parity): group ranks differ from global ranks
    "dense_subgroups_zigzag_causal_gqa": dict(kind="dense", layout="zigzag", causal=True, b=1, hq=2, hkv=1, n=32,
                                              d=320, split_groups=True),
    # the package's Triton backend (interpreter on CPU): one small case, 2 ranks only
    "dense_triton_zigzag_causal": dict(kind="dense", layout="zigzag", causal=True, b=1, hq=2, hkv=1, n=32, d=320,
                                       dtype="bfloat16", backend="triton", worlds=(2,)),
}
WORLDS = (2, 4)
PARAMS = [(w, name) for w in WORLDS for name, c in CASES.items() if w in c.get("worlds", WORLDS)]


def _dtype(case: dict) -> torch.dtype:
    return getattr(torch, case.get("dtype", "float32"))


def _check(got: dict, refs: AttnResult, base: dict, dtype: torch.dtype) -> dict[str, float]:
    """Errors of the gathered ring results ``got`` (out, lse, dq, dk, dv) against the reference; bf16 ones may
    also reach 2x the error of single-process attention's results ``base`` (lse: always fp32)."""
    errs = {}
    for name, t in got.items():
        tdt = torch.float32 if name == "lse" else dtype
        errs[name] = assert_close(t, getattr(refs, name), tdt, name, baseline=base.get(name),
                                  tol=F32_TOL if tdt == torch.float32 else None)
    return errs


def _group(case: dict, rank: int, world: int) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, rank in it, its size): the world, or the sub-group of the ranks with this rank's parity."""
    if not case.get("split_groups"):
        return None, rank, world
    groups = [dist.new_group([r for r in range(world) if r % 2 == p]) for p in (0, 1)]  # every rank creates both
    g = groups[rank % 2]
    return g, dist.get_rank(g), dist.get_world_size(g)


def _run_dense(case: dict, rank: int, world: int, seed: int) -> dict[str, float]:
    group, rank, world = _group(case, rank, world)
    dtype, layout, causal = _dtype(case), case["layout"], case["causal"]
    backend = case.get("backend", "sdpa")
    b, hq, hkv, n, d = case["b"], case["hq"], case["hkv"], case["n"], case["d"]
    nkv = case.get("nkv", n)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = make_qkv(b, hq, hkv, n, nkv, d, dtype, generator=gen)
    g_out = torch.randn(b, hq, n, d, generator=gen)
    g_lse = torch.randn(b, hq, n, generator=gen) if case.get("lse_grad") else None
    gqa = hq != hkv
    refs = reference_fwd_bwd(q, k, v, g_out, causal=causal, dlse=g_lse)  # oracle: the global sequence
    # single-process attention on the global sequence (the baseline error for low precision)
    base = {}
    if dtype != torch.float32:
        sp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = ffpa_attn_fwd(*sp, causal=causal, enable_gqa=gqa, backend=backend)
        ((o.float() * g_out).sum() + (0 if g_lse is None else (lse * g_lse).sum())).backward()
        base = {"out": o, "dq": sp[0].grad, "dk": sp[1].grad, "dv": sp[2].grad}
    # the ring on local shards
    ql, kl, vl = (shard(t, rank, world, layout).requires_grad_() for t in (q, k, v))
    out_l, lse_l = ring_attn_func(ql, kl, vl, group=group, causal=causal, enable_gqa=gqa, layout=layout,
                                  return_lse=True, backend=backend)
    loss_l = (out_l.float() * shard(g_out, rank, world, layout)).sum()
    if g_lse is not None:
        loss_l = loss_l + (lse_l * shard(g_lse, rank, world, layout)).sum()
    loss_l.backward()
    got = {"out": out_l.detach(), "lse": lse_l.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return _check({name: gather(t, group=group, layout=layout) for name, t in got.items()}, refs, base, dtype)


def _run_varlen(case: dict, rank: int, world: int, seed: int) -> dict[str, float]:
    dtype, layout, causal = _dtype(case), case["layout"], case["causal"]
    backend = case.get("backend", "sdpa")
    hq, hkv, d = case["hq"], case["hkv"], case["d"]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, cu, _, mx, _ = make_varlen_qkv(case["seqlens"], case["seqlens"], hq, hkv, d, dtype, generator=gen)
    t_all = q.shape[0]
    g_out = torch.randn(t_all, hq, d, generator=gen)
    g_lse = torch.randn(hq, t_all, generator=gen) if case.get("lse_grad") else None
    gqa = hq != hkv
    refs = reference_varlen_fwd_bwd(q, k, v, cu, cu, g_out, causal=causal, dlse=g_lse)
    base = {}
    if dtype != torch.float32:
        sp = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = ffpa_attn_varlen_fwd(*sp, cu, None, mx, mx, causal=causal, enable_gqa=gqa, backend=backend)
        ((o.float() * g_out).sum() + (0 if g_lse is None else (lse * g_lse).sum())).backward()
        base = {"out": o, "dq": sp[0].grad, "dk": sp[1].grad, "dv": sp[2].grad}
    ql, kl, vl = (shard_varlen(t, cu, rank, world, layout).requires_grad_() for t in (q, k, v))
    out_l, lse_l = ring_attn_varlen_func(ql, kl, vl, cu, causal=causal, enable_gqa=gqa, layout=layout,
                                         return_lse=True, backend=backend)
    loss_l = (out_l.float() * shard_varlen(g_out, cu, rank, world, layout)).sum()
    if g_lse is not None:
        loss_l = loss_l + (lse_l * shard_varlen(g_lse, cu, rank, world, layout, dim=1)).sum()
    loss_l.backward()
    got = {"out": out_l.detach(), "lse": lse_l.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    return _check({name: gather_varlen(t, cu, layout=layout, dim=1 if name == "lse" else 0)
                   for name, t in got.items()}, refs, base, dtype)


def _worker(rank: int, world: int, port: int, seed: int, names: list[str], result_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for i, name in enumerate(names):
        case = CASES[name]
        t0 = time.time()
        try:
            run = _run_dense if case["kind"] == "dense" else _run_varlen
            results[name] = {"ok": True, "errs": run(case, rank, world, seed + i), "s": time.time() - t0}
        except Exception:  # recorded per case; the test of that case fails with it
            results[name] = {"ok": False, "msg": traceback.format_exc(), "s": time.time() - t0}
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict[int, dict] = {}


def _results(world: int) -> dict:
    """Run every case of ``world`` in one spawned gloo group (once per test run); per-rank results."""
    if world in _RESULTS:
        return _RESULTS[world]
    names = [n for w, n in PARAMS if w == world]
    seed = random.SystemRandom().randrange(2**31)
    out: dict = {"seed": seed, "ranks": {}, "error": None}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, _free_port(), seed, names, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.time() + 240
        try:
            while not ctx.join(timeout=2):
                if time.time() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    out["error"] = "timed out after 240 s"
                    break
        except Exception as e:  # a worker died outside a case
            out["error"] = f"{type(e).__name__}: {e}"
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out["ranks"][r] = json.load(f)
    _RESULTS[world] = out
    return out


@pytest.mark.parametrize("world,case", PARAMS, ids=[f"w{w}-{n}" for w, n in PARAMS])
def test_ring_matches_reference(world: int, case: str) -> None:
    res = _results(world)
    assert res["error"] is None, f"process group of {world} failed (seed {res['seed']}): {res['error']}"
    for r in range(world):
        assert r in res["ranks"] or str(r) in res["ranks"], f"rank {r} wrote no results (seed {res['seed']})"
        rec = res["ranks"].get(r, res["ranks"].get(str(r)))[case]
        assert rec["ok"], f"rank {r} of {world}, seed {res['seed']}:\n{rec['msg']}"
        errs = rec["errs"]
        assert set(errs) == {"out", "lse", "dq", "dk", "dv"}
        assert all(e == e for e in errs.values())  # no NaN slipped through


# --------------------------------------------------------------------------- layout and schedule (no ring)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_dense_shard_roundtrip(layout: str) -> None:
    world, n = 4, 40
    x = torch.randn(2, 3, n, 5)
    shards = [shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, n // world, 5) for s in shards)
    torch.testing.assert_close(unshard(shards, layout), x, rtol=0, atol=0)
    for r in range(world):
        torch.testing.assert_close(shards[r], x[:, :, dense_positions(n, r, world, layout)], rtol=0, atol=0)
    pos = torch.cat([dense_positions(n, r, world, layout) for r in range(world)])
    assert sorted(pos.tolist()) == list(range(n))


def test_zigzag_positions() -> None:
    assert dense_positions(16, 0, 2, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert dense_positions(16, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert dense_positions(16, 1, 2, "contiguous").tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match="divisible"):
        dense_positions(12, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        dense_positions(16, 0, 2, "striped")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_varlen_shard_roundtrip(layout: str) -> None:
    world = 2
    seqlens = [8, 0, 12, 4] if layout == "zigzag" else [3, 0, 14, 7]
    cu = cu_seqlens(seqlens)
    x = torch.randn(int(cu[-1]), 2, 3)
    shards = [shard_varlen(x, cu, r, world, layout) for r in range(world)]
    torch.testing.assert_close(unshard_varlen(shards, cu, layout), x, rtol=0, atol=0)
    for r in range(world):
        lcu = local_cu_seqlens(cu, r, world, layout)
        assert lcu[-1] == shards[r].shape[0]
        pos = varlen_positions(cu, r, world, layout)
        # every local piece of sequence i holds only tokens of sequence i
        seq_of = torch.bucketize(pos, cu[1:].long(), right=True)
        for i in range(len(seqlens)):
            assert (seq_of[lcu[i]:lcu[i + 1]] == i).all()
    with pytest.raises(ValueError, match="divisible"):
        varlen_positions(torch.tensor([0, 6], dtype=torch.int32), 0, 2, "zigzag")


def _global_causal(pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
    return pos_k[None, :] <= pos_q[:, None]


def _step_mask(step, nq: int, nk: int) -> torch.Tensor:
    """The visibility a step's kernel call computes, as a [nq, nk] bool over the local rows."""
    m = torch.zeros(nq, nk, dtype=torch.bool)
    if step.kind == "skip":
        return m
    qi = torch.arange(nq) if step.q_sel is None else torch.arange(nq)[step.q_sel]
    ki = torch.arange(nk) if step.kv_sel is None else torch.arange(nk)[step.kv_sel]
    block = torch.ones(len(qi), len(ki), dtype=torch.bool)
    if step.causal:
        block = torch.ones(len(qi), len(ki)).tril().bool()  # Nq == Nkv: offset 0
    m[qi[:, None], ki[None, :]] = block
    return m


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dense_schedule_covers_causal_mask_exactly(layout: str, world: int) -> None:
    n = 8 * world
    work = []
    for r in range(world):
        steps = dense_schedule(r, world, n // world, True, layout)
        pq = dense_positions(n, r, world, layout)
        cost = 0
        for s, step in enumerate(steps):
            pk = dense_positions(n, source_rank(r, s, world), world, layout)
            got = _step_mask(step, len(pq), len(pk))
            assert torch.equal(got, _global_causal(pq, pk)), (r, s, step)
            cost += int(got.sum()) if step.kind == "diag" else (0 if step.kind == "skip" else got.numel())
        work.append(cost)
    if layout == "zigzag":
        assert len(set(work)) == 1, f"zigzag causal work is unbalanced: {work}"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_schedule_covers_mask_exactly(layout: str, causal: bool) -> None:
    world = 3
    seqlens = [12, 0, 30, 6, 24] if layout == "zigzag" else [5, 0, 31, 1, 17, 6]
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    seq_of = torch.bucketize(torch.arange(cu[-1]), torch.tensor(cu[1:]), right=True)
    for r in range(world):
        pq = varlen_positions(cu, r, world, layout)
        for s, step in enumerate(varlen_schedule(cu, r, world, causal, layout, torch.device("cpu"))):
            pk = varlen_positions(cu, source_rank(r, s, world), world, layout)
            want = seq_of[pq][:, None] == seq_of[pk][None, :]
            if causal:
                want &= _global_causal(pq, pk)
            got = torch.zeros(len(pq), len(pk), dtype=torch.bool)
            if step.kind != "skip":
                qi = torch.arange(len(pq)) if step.q_sel is None else step.q_sel
                ki = torch.arange(len(pk)) if step.kv_sel is None else step.kv_sel
                cq, ck = step.cu_q.tolist(), step.cu_k.tolist()
                assert cq[-1] == len(qi) and ck[-1] == len(ki)
                for i in range(len(seqlens)):  # per sequence: full block, or tail-aligned causal
                    a, b, c, e = cq[i], cq[i + 1], ck[i], ck[i + 1]
                    blk = torch.ones(b - a, e - c, dtype=torch.bool)
                    if step.causal:
                        blk = torch.arange(e - c)[None, :] <= torch.arange(b - a)[:, None] + (e - c) - (b - a)
                    got[qi[a:b][:, None], ki[c:e][None, :]] = blk
            assert torch.equal(got, want), (r, s, step.kind)


# ------------------------------------------------------------------------------- world size 1, in-process


@pytest.fixture(scope="module")
def single_group():
    """A gloo group of one process (this one), torn down after the module."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_needs_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    q, k, v = make_qkv(1, 1, 1, 8, 8, 320, torch.bfloat16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attn_func(q, k, v, backend="sdpa")


@pytest.mark.parametrize("causal", [True, False])
def test_world1_dense_and_varlen(single_group, causal: bool) -> None:
    q, k, v = make_qkv(1, 2, 1, 24, 24, 320, torch.float32, requires_grad=True)
    g = torch.randn(1, 2, 24, 320)
    out = ring_attn_func(q, k, v, causal=causal, enable_gqa=True, backend="sdpa")
    (out * g).sum().backward()
    ref = reference_fwd_bwd(q, k, v, g, causal=causal)
    assert_close(out, ref.out, torch.float32, "out", tol=F32_TOL)
    assert_grads_close((q.grad, k.grad, v.grad), ref.grads, torch.float32, tol=F32_TOL)
    qv, kv, vv, cu, _, _, _ = make_varlen_qkv([6, 0, 14], [6, 0, 14], 2, 2, 320, torch.float32)
    o = ring_attn_varlen_func(qv, kv, vv, cu, causal=causal, layout="contiguous", backend="sdpa")
    r, _ = reference.varlen_attention(qv, kv, vv, cu, causal=causal)
    assert_close(o, r, torch.float32, "varlen out", tol=F32_TOL)


def test_errors(single_group) -> None:
    q, k, v = make_qkv(1, 2, 2, 16, 16, 320, torch.bfloat16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ring_attn_func(q, k, v, window_size=(1, 1))
    with pytest.raises(ValueError, match="layout"):
        ring_attn_func(q, k, v, layout="ring")
    with pytest.raises(ValueError, match="same length"):
        ring_attn_func(q, k[:, :, :8], v[:, :, :8], causal=True, backend="sdpa")
    with pytest.raises(ValueError, match="even"):
        ring_attn_func(q[:, :, :15], k[:, :, :15], v[:, :, :15], causal=True, backend="sdpa")
    with pytest.raises(ValueError, match="enable_gqa"):
        ring_attn_func(q, k[:, :1], v[:, :1], backend="sdpa")
    with pytest.raises(TypeError, match="float16"):
        ring_attn_func(q.float(), k.float(), v.float())  # implicit FFPA path: fp16/bf16 only
    qv, kv, vv = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    with pytest.raises(TypeError, match="int32"):
        ring_attn_varlen_func(qv, kv, vv, torch.tensor([0, 16]), backend="sdpa")
    with pytest.raises(ValueError, match="T_local"):
        ring_attn_varlen_func(qv, kv, vv, torch.tensor([0, 8], dtype=torch.int32), backend="sdpa")
    with pytest.raises(ValueError, match="divisible"):
        ring_attn_varlen_func(qv, kv, vv, torch.tensor([0, 5, 16], dtype=torch.int32), backend="sdpa")


def test_ring_scaling_table_efficiency():
    """bench/ring_scaling.py: efficiency(W) = T_1 / (W * T_W), hidden = sum of steps alone / ring time."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "ring_scaling.py"
    spec = importlib.util.spec_from_file_location("ring_scaling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(world, fwd, fb):
        row = {"causal": True, "fwd_ms": fwd, "fwdbwd_ms": fb, "fwd_tflops": 1.0, "fwdbwd_tflops": 1.0,
               "sum_steps_fwd_ms": fwd / 2, "sum_steps_fwdbwd_ms": fb}
        return {"world": world, "n_local": 1024 // world, "n_global": 1024, "rows": [row]}

    lines = mod.efficiency_table([run(1, 8.0, 20.0), run(4, 2.5, 5.0)])
    assert lines[2].split("|")[8].strip() == "1.00 / 1.00"
    assert lines[3].split("|")[8].strip() == "0.80 / 1.00"  # 8 / (4 * 2.5), 20 / (4 * 5)
    assert lines[3].split("|")[9].strip() == "0.50 / 1.00"
    # a run at another global length is never compared with the world-1 run
    other = run(2, 1.0, 1.0)
    other["n_global"] = 2048
    assert "n/a" in mod.efficiency_table([run(1, 8.0, 20.0), other])[3]

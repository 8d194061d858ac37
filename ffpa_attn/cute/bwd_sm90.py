"""sm90a (Hopper) attention backward in CuTeDSL: K/V-stationary, head dim split over CTAs, TMA + wgmma.

With the default ``BwdConfig.dq_mode = "separate"`` this kernel computes dK and dV only (no dQ GEMMs, no dS
tile, no reductions; consumer 1 arrives on the DS barrier once it has read P^T and consumer 0 waits on it
before writing the next P^T) and :mod:`.bwd_dq_sm90` computes dQ. Everything about dQ below ("dQ reduction",
the dQ GEMMs, sdS, the staging) applies to dq_mode "tma" and "atomic", where this one kernel does all three.

One CTA per (64-key block ``n``, head-dim part ``p`` of ``n_parts``, kv head, batch): grid ``(n_parts *
ceil(Nkv/64), Hkv, B)``; ``n_parts`` = 2 up to D = 512, ``ceil(D / 256)`` above (see "D > 512" below). The
CTA owns ``dK[n, part p]`` and ``dV[n, part p]`` (``d_part = n_part_chunks * 64`` columns, fp32 in
registers) and loops over every query head of its GQA group and every 64-row query block that sees the key
block (causal: from the first block that sees a key of ``n``). The score tiles S and dP are computed over
the full head dim by every part of a key block (recompute: 7 GEMM units instead of 5 --
a 2-CTA cluster variant that removes it measured slower). Per CTA, three warpgroups:

* warpgroup 0, warp 0 (producer, setmaxnreg 40): TMA-loads K and V of the key block once (all
  ``nc = ceil(D/64)`` column chunks of 64 x 64, one mbarrier), then per (head, query block) streams
  64 x 64 chunks through two mbarrier rings:
  ring A (consumer 0): Q chunks 0..nc-1, then the dO chunks of part p;
  ring B (consumer 1): dO chunks 0..nc-1, then the Q chunks of part p.
* warpgroup 1 (consumer 0, setmaxnreg 232):
  S^T = K Q^T (m64 n64, k = D, A = K chunk, B = Q chunk, both shared memory);
  P^T = exp2(S^T * scale*log2e - lse*log2e), 0 where masked / query row >= Nq / row without keys;
  P^T (fp32) -> shared memory for consumer 1; dV_p += P^T dO_p (A = P^T bf16 from registers);
  after consumer 1 wrote dS: dQ[:, first half of part p's chunks] += dS K_p (A = dS from shared
  memory) -> fp32 ``dq_accum``, scaled (see "dQ reduction" below).
* warpgroup 2 (consumer 1, setmaxnreg 232):
  dP^T = V dO^T (m64 n64, k = D); dS^T = P^T (dP^T - delta) in fp32 (P^T read from shared memory);
  dS (16-bit) -> shared memory (transposed, as the K-major A operand of dQ); dK_p += dS^T Q_p
  (A from registers); dQ[:, second half of the chunks] += dS K_p -> ``dq_accum``.
  The end: dK_p * scale and dV_p converted and stored (rows >= Nkv, columns >= D clipped).

dQ reduction (``BwdConfig.dq_mode``):

* "atomic": every consumer thread pairs with its neighbour lane and issues one 16-byte
  ``red.global.add.v4.f32`` per 4 values of its fragment (8 per thread per 64 x 64 chunk; each warp
  instruction touches 16 rows x 32 bytes), on the consumer's critical path.
* "tma": the consumer writes its scaled fp32 chunk into shared memory (64-byte swizzled 64 x 16 fp32
  boxes, 4 per chunk), ``fence.proxy.async.shared::cta``, named barrier (warps 1..3 arrive, warp 0 waits),
  and warp 0 of the consumer issues ``cp.reduce.async.bulk.tensor.4d ... .add.f32`` per box (the TMA
  clips rows >= Nq and columns >= D; a box wholly past D is not issued; the DSL elects one lane itself,
  so the copy must run on the whole converged warp, never under ``if tid == 0``: that deadlocked on the
  H200 on 2026-11-29; tests/test_cute_compile.py checks the PTX for it) and every lane of warp 0 commits one
  bulk group per pass (empty but for the elected lane). Before a staging slot is rewritten, warp 0 waits
  ``cp.async.bulk.wait_group.read`` (slots - 1)
  and the other warps wait on a second named barrier for it; the first wait of a chunk sits between
  issuing its dQ wgmma and waiting for it, so it overlaps the MMA. Staging: consumer 0 uses the P^T
  exchange (16 KiB = one whole chunk, one pass: it is free from the dS barrier until consumer 0 writes
  the next P^T, and consumer 0 waits for its reads, ``wait_group.read 0`` + its barrier, before that
  write); consumer 1 a ring of 2 boxes (8 KiB of its own, one 16-column quarter per pass, so a pass
  waits only for the reads of the pass before the previous one). Named barriers 3/4 (consumer 0) and
  5/6 (consumer 1); each consumer waits for all its groups (``wait_group 0``) before its epilogue.
  Per chunk: 4 TMA instructions from one lane instead of 8 x 128 vector atomics. ``BwdConfig.dq_box``
  = 32 (A/B option): 64 x 32 boxes with 128-byte swizzle and 128-byte rows (half the bulk requests per
  byte), 2 per chunk; consumer 1 then has one slot (a 32-column half per pass, each pass waits for the
  previous pass's reads).

Budget (D = 512, ``nc = 8`` chunks, part = 4 chunks = 256 columns; see :class:`..config.BwdConfig`):

* shared memory: K and V resident 2 x 64 x 512 x 2 B = 128 KiB; P^T exchange 64 x 64 fp32 = 16 KiB;
  dS 64 x 64 x 2 B = 8 KiB; rings A and B 4 slots each of 64 x 64 x 2 B = 64 KiB; total 216 KiB +
  mbarriers <= 227 KiB. dq_mode "tma": + consumer 1's staging 2 x 64 x 16 x 4 B = 8 KiB = 224 KiB
  (the ring rounding leaves 10 KiB at every D, so the ring depths do not change).
* registers per consumer thread (setmaxnreg 232): dV_p (or dK_p) 64 x 256 fp32 / 128 threads = 128,
  S^T (or dP^T) 32, P^T / dS^T as 16-bit A fragment 16, lse / delta of the thread's 16 query columns 16,
  dQ chunk accumulator 32 (live only after S / dP are dead); producer 40 (128 x 40 + 256 x 232 = 64512).
  ptxas (sm_90a, CUDA 13.0), every variant D in {264, 320, 384, 448, 512} x fp16/bf16 x causal: 168
  registers at launch (384 threads), 0 bytes spilled, no stack frame (tests/test_cute_compile.py).
  D < 512 uses the same 216 KiB with deeper rings (D = 448: 5 slots, 384: 6, 320 / 264: 7).
* traffic per (key block, query block) and CTA: Q and dO over the full D once each plus the part's
  chunks again (1.5 x 2 x 64 x D x 2 B), K/V once per CTA; dQ: 64 x d_part fp32 reductions per CTA
  (16-byte vector reductions or TMA bulk reductions, so Nkv/64 adds per dQ element in all). dK/dV are
  reduced inside one CTA in a fixed order (bit-reproducible); dQ is not (atomics / bulk reductions).
* dq_mode "tma", ptxas (sm_90a): 168 registers at launch, 0 bytes spilled, no stack frame, 7 named
  barriers, for every D in {264, 320, 384, 448, 512} x fp16/bf16 x causal (tests/test_cute_compile.py).

D > 512 (``BwdConfig.stream``, dq_mode "separate" only): K and V of a key block no longer fit next to the rings
(2 x 128 KiB at D = 1024), so V is not resident: ring B carries V_c, dO_c pairs (consumer 1's dP^T = sum_c V_c
dO_c^T reads both operands from the ring through :meth:`BwdSm90Base.pair_gemm`, a ring walk of two-slot items),
then the part's Q chunks; K stays resident for consumer 0. Parts of <= 4 chunks (D = 1024: 4 CTAs per key block,
each recomputing S^T and dP^T over the full D). Ring B moves twice the bytes of ring A per GEMM step and a pair
walk holds 4 of its slots, so it gets the deeper ring (``BwdConfig.ring_split``; D = 1024: K 128 KiB + P^T 16
KiB + ring A 4 x 8 KiB + ring B 6 x 8 KiB = 225 KiB; equal rings of 5 measured 86 against 134 TFLOPS).
Registers as at D = 512 (ptxas: 168, no spills).

EXPERIMENTAL cluster option (``BwdConfig.cluster``, correct on an H200 but slower; D with an even chunk count): the two
parts of a key block form a 2-CTA cluster (grid x = 2 n + p, cluster (2, 1, 1)). Each CTA keeps only its
part of K/V and streams only its part of Q / dO; consumer 0 computes partial S^T over the part, consumer
1 partial dP^T, and each adds the peer CTA's partial read through DSMEM (double-buffered fp32 exchange,
one cluster mbarrier per consumer with 4 + 4 warp arrivals, phase = iteration parity). Nothing is
recomputed (5 GEMM units) and the Q / dO traffic drops by a third. Same code path otherwise (dq_mode
"atomic" only).

Packed sequences (``BwdConfig.varlen``, dq_mode "separate"): q/dO/out ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]`` are
passed as ``[1, H, T, D]`` views (lse / delta ``[1, Hq, T_q]``) with ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 ``[B
+ 1]``) and a work list (:func:`..ranges.varlen_work_items` with ``key_stationary``: one item per (sequence, key
block), most query blocks first, built on the device); the grid is (work-list slots x parts, KV heads)
(:class:`..tile_scheduler.VarlenTileScheduler`; slots past the real work exit). Each CTA views every tensor from
its sequence's first row (:class:`..seqlen_info.SeqlenInfo`) and then runs the dense code with the sequence's
lengths: causal is tail-aligned per sequence, rows and keys past the
sequence (the next sequence's, read by the 64-row TMA boxes) are masked by the sequence's lengths exactly as rows
past Nq / Nkv are in the dense case, and every store is clipped at the sequence's end. One launch per kernel for
the whole batch; no padding, no copy.

Conventions (:mod:`ffpa_attn.contract`): tail-aligned causal (query row r sees key k iff
``k <= r + Nkv - Nq``), ``kv_head = q_head // (Hq // Hkv)``; lse natural log of the scaled scores, fp32
``[B, Hq, Nq]`` (-inf for a row without keys); ``delta = rowsum(dO * O) - dlse`` fp32 ``[B, Hq, Nq]``
(computed by the caller); ``dq_accum`` fp32 ``[B, Hq, Nq, D]`` zero-initialized by the caller, receives
``scale * dS K``.
"""
from __future__ import annotations

import math
from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir import ir
from cutlass._mlir.dialects import nvvm, vector
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.utils import LayoutEnum

from .block_info import BlockInfo
from .config import BwdConfig
from .seqlen_info import SeqlenInfo
from .tile_scheduler import VarlenTileScheduler

LOG2_E = math.log2(math.e)

# named barrier ids (0 is __syncthreads)
_BAR_P = 1  # both consumers: P^T written to shared memory
_BAR_DS = 2  # both consumers: dS written to shared memory
# dq_mode "tma", per consumer c (ids 3 + 2c, 4 + 2c): staging free (the issuing thread has waited for the
# bulk reads; warp 0 arrives, warps 1..3 sync) / staging written (warps 1..3 arrive, warp 0 syncs)
_BAR_DQ_FREE = 3
_BAR_DQ_FULL = 4

_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_WG = 128  # threads per warpgroup
_CH = 64  # columns per head-dim chunk (one 128-byte swizzle row of 16-bit elements)
_TILE = 64  # keys per CTA and query rows per step
_DQ_STAGE = 2 * _TILE * 16  # fp32 elements of consumer 1's dQ staging (8 KiB)
# S^T (keys x queries) C fragment: the thread's 16 query columns are those of registers (v % 2) + 4 (v // 4);
# register v reads entry (v % 2) + 2 (v // 4) of a per-column cache (tests/test_cute_compile.py)
_COL_REGS = [(i % 2) + 4 * (i // 2) for i in range(16)]


def _V4F32():
    """MLIR ``vector<4xf32>`` (needs an active MLIR context: call at trace time)."""
    return ir.VectorType.get([4], Float32.mlir_type)


def _dtype(name: str) -> Type[cutlass.Numeric]:
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _rows_from(t: cute.Tensor, row) -> cute.Tensor:
    """A ``[B, H, N(, D)]`` tensor (lse, delta, a gradient) viewed from row ``row`` of its N mode: a packed
    sequence's first row (:class:`SeqlenInfo` shifts the TMA views, whose row mode is the first)."""
    return cute.domain_offset((0, 0, row) + (0,) * (cute.rank(t) - 3), t)


class BwdSm90Base:
    """What the two sm90 backward kernels share: 64 x 64 16-bit chunk layouts, the three tiled MMAs, and
    the consumer pieces that run a chunked GEMM against an mbarrier ring (``release``, ``ring_gemms``,
    ``score_gemm``, ``part_gemm``) and store a row of 64 x 64 fp32 tiles. Subclasses set ``dtype``, ``stages`` and
    ``stages_b`` (slots of rings A and B) and ``kv_stages`` (chunks per score GEMM)."""

    dtype: Type[cutlass.Numeric]
    stages: int
    stages_b: int
    kv_stages: int

    def _smem_layout(self, stages: int):
        """(64, 64, stages) K-major 128-byte-swizzled layout of 64 x 64 16-bit chunks."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, _CH), self.dtype)
        return cute.tile_to_shape(atom, (_TILE, _CH, stages), order=(0, 1, 2))

    def _tiled_mmas(self):
        # S^T = K Q^T, dP^T = V dO^T: both operands K-major in shared memory
        ss = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1), (_TILE, _CH))
        # dV += P^T dO, dK += dS^T Q: A from registers, B (rows = queries, d contiguous) MN-major
        rs = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1), (_TILE, _CH),
            warpgroup.OperandSource.RMEM)
        # dQ = dS K: A = dS (K-major in shared memory), B = K chunk (MN-major)
        dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1), (_TILE, _CH))
        return ss, rs, dq

    def tma_loads(self, tensors, chunk_layout):
        """For each ``[B, H, N, D]`` tensor: its (N, D, H, B) view (TMA-friendly mode order, D contiguous) and
        a TMA load atom + TMA tensor for 64 x 64 chunks into ``chunk_layout``; returns (views, [(atom, t)])."""
        views = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0])) for t in tensors]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        atoms = [cpasync.make_tiled_tma_atom(g2s, t, chunk_layout, (_TILE, _CH)) for t in views]
        # the mbarrier transaction counts must equal what the TMA boxes deliver (else consumers hang)
        assert cute.size_in_bytes(self.dtype, chunk_layout) == self.cfg.chunk_bytes
        return views, atoms

    def make_rings(self, storage):
        """The two chunk rings (mbarriers in ``storage.mbar_a`` / ``mbar_b``): one producer thread fills a slot
        with one 64 x 64 chunk, the 4 warps of one consumer release it."""
        return [pipeline.PipelineTmaAsync.create(
            barrier_storage=getattr(storage, name).data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # warps of 1 consumer
            tx_count=self.cfg.chunk_bytes,
            defer_sync=True,
        ) for name, stages in (("mbar_a", self.stages), ("mbar_b", self.stages_b))]

    def p_exchange(self, storage):
        """The 64 x 64 fp32 P (or P^T) exchange between the consumers as (value, thread): each thread's 32
        values in 16-byte groups, the threads' groups adjacent (both consumers use the same C fragment)."""
        n_s = 32
        return cute.make_tensor(storage.sP.data_ptr(),
                                cute.make_layout(((4, n_s // 4), _WG), stride=((1, 4 * _WG), 4)))

    @cute.jit
    def chunk_of_part(self, part: Int32, part_chunks: int, j: int):
        """(chunk index of the j-th chunk of head-dim part ``part`` of ``part_chunks`` chunks, that index clamped
        to a real chunk).

        A chunk past the head dim (e.g. D = 320: dK/dV part 1 = chunks 3, 4, 5 of 5; D = 576: dQ part 1 = chunks
        5..9 of 9) is loaded from the last real chunk; what it produces lands in columns >= D, which are never
        stored."""
        c = part * part_chunks + j
        return c, cutlass.min(c, self.nc - 1)

    @cute.jit
    def load_query_values(self, mRow: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, regs: list, axis: int,
                          batch: Int32, head: Int32, m_block: Int32, seqlen_q: Int32, is_lse: bool):
        """out[i] = the lse (``is_lse``) or delta value of the query row of C-fragment register ``regs[i]``
        (its query index: ``coords[regs[i]][axis]`` within query block ``m_block``).

        lse: ``lse * log2(e)``, +inf for a query >= Nq or a row without keys (so P = 0 there); delta: the
        value, 0 for a query >= Nq."""
        for i in cutlass.range_constexpr(len(regs)):
            q = m_block * _TILE + coords[regs[i]][axis]
            x = mRow[batch, head, cutlass.min(q, seqlen_q - 1)]
            if const_expr(is_lse):
                out[i] = Float32.inf if (q >= seqlen_q or x == -Float32.inf) else x * LOG2_E
            else:
                out[i] = 0.0 if q >= seqlen_q else x

    @cute.jit
    def release(self, ring: pipeline.PipelineTmaAsync, idx: Int32):
        """Every warp of the consumer arrives once on ring slot ``idx`` (after its wgmma read it)."""
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(ring.sync_object_empty.get_barrier(idx))

    def ring_gemms(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, steps: int, issue,
                   width: int = 1):
        """The ring walk of :meth:`score_gemm` / :meth:`part_gemm` / :meth:`pair_gemm`: for each of ``steps``
        ring items of ``width`` consecutive slots in turn, wait until it is loaded, ``issue(step, *slots)``
        its wgmmas (one committed group), and release the previous item once this group is issued and the
        previous one completed (one group in flight: ``2 * width`` slots held at most); the last item is
        released after the last group completed. Plain Python run at trace time (``steps`` and the branches
        are static, as in its callers, so the DSL's control-flow rewriting stays out of the ``issue``
        closures); returns the advanced ``state``."""
        prev = None
        for j in range(steps):
            idxs = []
            for w in range(width):
                if w > 0:
                    state.advance()
                idx = state.index
                cute.arch.mbarrier_wait(ring.sync_object_full.get_barrier(idx), state.phase)
                idxs.append(idx)
            warpgroup.fence()
            issue(j, *idxs)
            warpgroup.commit_group()
            if j > 0:
                warpgroup.wait_group(1)
                for p in prev:
                    self.release(ring, p)
            prev = idxs
            state.advance()
        warpgroup.wait_group(0)
        for p in prev:
            self.release(ring, p)
        return state

    def score_gemm(self, mma_ss: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                   ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState):
        """acc = sum over the stationary head-dim chunks (all nc; cluster: the part's) of A(chunk c)
        B(ring item)^T; every ring slot is released as soon as the wgmma that reads it has completed (one
        wgmma group in flight)."""
        mma = cute.make_mma_atom(mma_ss.op)

        def issue(c, idx):
            for k in range(cute.size(tA, mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, c > 0 or k > 0)
                cute.gemm(mma, acc, tA[None, None, k, c], tB[None, None, k, idx], acc)

        return self.ring_gemms(ring, state, self.kv_stages, issue)

    def pair_gemm(self, mma_ss: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                  ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, steps: int):
        """acc = sum over ``steps`` chunk pairs of A(ring item 2c) B(ring item 2c + 1)^T: both operands streamed
        (D > 512: V with dO in the dK/dV kernel, dO with V in the dQ kernel); each pair is released once the
        next pair's wgmmas are issued and its own completed."""
        mma = cute.make_mma_atom(mma_ss.op)

        def issue(c, ia, ib):
            for k in range(cute.size(tA, mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, c > 0 or k > 0)
                cute.gemm(mma, acc, tA[None, None, k, ia], tB[None, None, k, ib], acc)

        return self.ring_gemms(ring, state, steps, issue, width=2)

    def part_gemm(self, mma_rs: cute.TiledMma, accs: list, tAr: cute.Tensor, tB: cute.Tensor,
                  ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState):
        """accs[j] += A (64 x 64 16-bit: registers, or shared memory with ``mma`` sourcing A there) B(ring
        item j) for each of the ``len(accs)`` ring items in turn (tAr: (MMA, 1, k-steps))."""
        mma = cute.make_mma_atom(mma_rs.op)
        mma.set(warpgroup.Field.ACCUMULATE, True)

        def issue(j, idx):
            for k in range(cute.size(tAr, mode=[2])):
                cute.gemm(mma, accs[j], tAr[None, None, k], tB[None, None, k, idx], accs[j])

        return self.ring_gemms(ring, state, len(accs), issue)

    @cute.jit
    def store_tiles(self, accs: list, mma: cute.TiledMma, mOut: cute.Tensor, mul: Float32, block: Int32,
                    chunk0: Int32, head: Int32, batch: Int32, seqlen: Int32, tid: Int32):
        """mOut[batch, head, rows of 64-row block ``block``, 64-column chunks chunk0, chunk0 + 1, ...] = accs[j]
        * mul (one 64 x 64 fp32 C fragment of ``mma`` per chunk; converted to the 16-bit dtype; rows >=
        ``seqlen`` and columns >= D clipped).

        A thread's C fragment is ((2 columns, 2 rows, 8 column groups), 1, 1): two rows, and in each
        8-column group one pair of adjacent columns. D is a multiple of 8, so a group is wholly in or out:
        one row test per row and one column test per group (a test per element made this epilogue about a
        third of the kernel's compile time)."""
        thr = mma.get_slice(tid)
        coords = thr.partition_C(cute.make_identity_tensor((_TILE, _CH)))
        gOut = mOut[batch, head, None, None]
        rows_ok = [block * _TILE + coords[2 * h][0] < seqlen for h in range(2)]
        for j in cutlass.range_constexpr(len(accs)):
            out16 = cute.make_rmem_tensor_like(accs[j], self.dtype)
            out16.store((accs[j].load() * mul).to(self.dtype))
            tCg = thr.partition_C(cute.local_tile(gOut, (_TILE, _CH), (block, chunk0 + j)))
            for g in cutlass.range_constexpr(cute.size(accs[j]) // 4):
                if (chunk0 + j) * _CH + 8 * g < self.cfg.head_dim:
                    for h in cutlass.range_constexpr(2):
                        if rows_ok[h]:
                            for c in cutlass.range_constexpr(2):
                                tCg[(c, h, g), 0, 0] = out16[(c, h, g), 0, 0]


class FlashBwdSm90SplitD(BwdSm90Base):
    """Backward kernel for one :class:`BwdConfig` (compile-time: D, dtype, causal, ring depth).

    Call (inside ``cute.compile``) with q/do ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit, unit
    stride on D), lse and delta ``[B, Hq, Nq]`` fp32, dq_accum ``[B, Hq, Nq, D]`` fp32 (zeroed), dk/dv
    ``[B, Hkv, Nkv, D]`` 16-bit (fully written), ``scale``, ``scale_log2 = scale * log2(e)``,
    ``group = Hq // Hkv`` and a stream. Sizes and strides are runtime values.
    """

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = _dtype(cfg.dtype)
        self.nc = cfg.n_chunks
        self.ncp = cfg.part_chunks
        self.stages = cfg.stages
        self.stages_b = cfg.stages_b
        self.causal = cfg.causal
        self.cluster = cfg.cluster
        # D > 512: V is streamed through ring B next to dO (K alone stays resident); more head-dim parts
        self.stream = cfg.stream
        self.n_parts = cfg.n_parts
        # stationary K/V chunks and chunks per score GEMM: the full head dim (recompute), or with the
        # 2-CTA cluster only the CTA's part (partial S / dP summed with the peer's through DSMEM)
        self.kv_stages = self.ncp if self.cluster else self.nc
        self.num_threads = 3 * _WG
        self.varlen = cfg.varlen
        self.tma_dq = cfg.dq_mode == "tma"
        # dq_mode "separate": no dQ here (FlashBwdDqSm90 computes it in a second launch), no dS tile
        self.separate = cfg.dq_mode == "separate"
        # dq_mode "tma": fp32 columns per TMA reduce box (16: 64-byte swizzle, 32: 128-byte swizzle)
        self.dq_box = cfg.dq_box
        assert self.ncp <= self.stages  # see BwdConfig: the rings cannot deadlock
        assert not self.cluster or 2 * self.ncp == self.nc  # cluster: both parts hold only real chunks

    # ------------------------------------------------------------------------------------------------
    # host side

    def _dq_stage_layout(self, boxes: int):
        """(64 rows, dq_box fp32 columns, boxes) K-major dQ staging (dq_mode "tma"); one box row = one
        swizzle row (16 columns: 64-byte swizzle, 32: 128-byte)."""
        kind = warpgroup.SmemLayoutAtomKind.K_SW64 if self.dq_box == 16 else warpgroup.SmemLayoutAtomKind.K_SW128
        atom = warpgroup.make_smem_layout_atom(kind, Float32)
        return cute.tile_to_shape(atom, (_TILE, self.dq_box, boxes), order=(0, 1, 2))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, scale: Float32, scale_log2: Float32, group: Int32,
                 stream: cuda.CUstream, mCuQ: cute.Tensor | None = None, mCuK: cute.Tensor | None = None,
                 mItems: cute.Tensor | None = None):
        kv_layout = self._smem_layout(self.kv_stages)
        ring_layout = self._smem_layout(self.stages)
        ring_layout_b = self._smem_layout(self.stages_b)
        ds_layout = self._smem_layout(1)
        chunk_layout = cute.slice_(ring_layout, (None, None, 0))
        (mQt, mKt, _, _), ((tma_q, tQ), (tma_k, tK), (tma_v, tV), (tma_do, tdO)) = self.tma_loads(
            (mQ, mK, mV, mdO), chunk_layout)
        mma_ss, mma_rs, mma_dq = self._tiled_mmas()
        # dq_mode "tma": 64 x 16 fp32 boxes, K-major 64-byte swizzle; consumer 0 stages a whole chunk (4
        # boxes, in the P^T exchange), consumer 1 a ring of 2 boxes (its own 8 KiB)
        dq_layout = self._dq_stage_layout(1)
        tma_dq, tdQ = tma_q, mQt  # atomic mode: placeholders, unused
        if const_expr(self.tma_dq):
            mdQt = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[2, 3, 1, 0]))
            tma_dq, tdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD), mdQt,
                cute.slice_(dq_layout, (None, None, 0)), (_TILE, self.dq_box))
        stages = self.stages
        stages_b = self.stages_b
        n_p = _TILE * _TILE  # fp32 values of the P^T exchange
        n_ds = cute.cosize(ds_layout) if const_expr(not self.separate) else 8  # separate: no dS tile (unused)
        n_v = cute.cosize(kv_layout) if const_expr(not self.stream) else 8  # stream: V comes through ring B

        @cute.struct
        class SharedStorage:
            mbar_a: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_b: cute.struct.MemRange[cutlass.Int64, 2 * stages_b]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, n_v], 1024]
            ringA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 1024]
            ringB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout_b)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, n_ds], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, n_p], 128]

        @cute.struct
        class SharedStorageTmaDq:  # dq_mode "tma": + consumer 1's staging box; sP doubles as consumer 0's
            mbar_a: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_b: cute.struct.MemRange[cutlass.Int64, 2 * stages_b]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            ringA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 1024]
            ringB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout_b)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, n_p], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, _DQ_STAGE], 1024]

        @cute.struct
        class SharedStorageCluster:
            mbar_a: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_b: cute.struct.MemRange[cutlass.Int64, 2 * stages_b]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_x: cute.struct.MemRange[cutlass.Int64, 2]  # partial S (consumer 0), partial dP (consumer 1)
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            ringA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout)], 1024]
            ringB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ring_layout_b)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, n_p], 128]
            sXS: cute.struct.Align[cute.struct.MemRange[Float32, 2 * n_p], 128]  # double-buffered partials
            sXdP: cute.struct.Align[cute.struct.MemRange[Float32, 2 * n_p], 128]

        self.shared_storage = SharedStorageCluster if const_expr(self.cluster) else SharedStorage
        if const_expr(self.tma_dq):
            self.shared_storage = SharedStorageTmaDq
        if const_expr(self.varlen):  # (work-list slots x parts, KV heads), a block's parts adjacent
            grid = VarlenTileScheduler(1, self.n_parts).grid(cute.size(mKt.shape[2]), mItems.shape[1])
        else:
            grid = (cute.ceil_div(mKt.shape[0], _TILE) * self.n_parts, cute.size(mKt.shape[2]),
                    cute.size(mKt.shape[3]))
        kernel = self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_do, tdO, mLSE, mDelta, mdQacc, mdK, mdV,
                             mma_ss, mma_rs, mma_dq, kv_layout, ring_layout, ring_layout_b, ds_layout, scale,
                             scale_log2, group, tma_dq, tdQ, mCuQ, mCuK, mItems)
        if const_expr(self.cluster):  # the two parts of a key block (grid x = 2 n_block + part) pair up
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], cluster=[2, 1, 1], stream=stream,
                          min_blocks_per_mp=1)
        else:
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------------
    # device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma,
               kv_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout, ring_layout_b: cute.ComposedLayout,
               ds_layout: cute.ComposedLayout, scale: Float32, scale_log2: Float32, group: Int32,
               tma_dq: cute.CopyAtom, mdQt: cute.Tensor, mCuQ: cute.Tensor | None,
               mCuK: cute.Tensor | None, mItems: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG)
        active = True  # dense: every CTA has a key block
        if const_expr(self.varlen):  # work-list slot -> (sequence, key block); tensors from the sequence's rows
            work = VarlenTileScheduler(1, self.n_parts).work(mItems)
            kv_head, part = work.head, work.part
            n_block = work.block
            active = work.valid  # (a slot past the real work: the CTA exits; it reads sequence 0's bounds)
            seq = SeqlenInfo.from_cu_seqlens(cutlass.max(work.batch, 0), mCuQ, mCuK)
            mQ, mdO, mK, mV = seq.rows_q(mQ), seq.rows_q(mdO), seq.rows_k(mK), seq.rows_k(mV)
            mLSE, mDelta = _rows_from(mLSE, seq.offset_q), _rows_from(mDelta, seq.offset_q)
            mdK, mdV = _rows_from(mdK, seq.offset_k), _rows_from(mdV, seq.offset_k)
            batch = Int32(0)
        else:
            bidx, kv_head, batch = cute.arch.block_idx()
            n_block = bidx // self.n_parts
            part = bidx % self.n_parts
            seq = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.tma_dq):
                cpasync.prefetch_descriptor(tma_dq)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar_kv = storage.mbar_kv.data_ptr()
        ring_a, ring_b = self.make_rings(storage)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_kv, 1)
                if const_expr(self.cluster):  # 4 warps of this CTA's consumer + 4 of the peer's
                    cute.arch.mbarrier_init(storage.mbar_x.data_ptr(), 8)
                    cute.arch.mbarrier_init(storage.mbar_x.data_ptr() + 1, 8)
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cluster):  # the peer arrives on our barriers: they must exist first
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)  # (64 keys, 64, nc)
        sV = None  # stream: V chunks are read from ring B
        if const_expr(not self.stream):
            sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sA = storage.ringA.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)  # (64 rows, 64, S)
        sB = storage.ringB.get_tensor(ring_layout_b.outer, swizzle=ring_layout_b.inner)
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)  # (64 q, 64 keys, 1)
        sP = self.p_exchange(storage)  # P^T exchange
        n_s = 32  # fp32 values per thread of a 64 x 64 tile

        m_block_min, m_block_max = BlockInfo(_TILE, _TILE, self.causal).query_block_range(seq, n_block)
        # query blocks that see key block n_block; the max (a no-op) tells the compiler n_m >= 0, so the loops'
        # it // n_m, it % n_m stay unsigned divisions
        n_m = cutlass.max(m_block_max - m_block_min, 0)
        n_iter = n_m * group

        if active:  # (a whole CTA: no thread reaches a barrier the others skip)
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if warp_idx == 0:
                    self.produce(tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, sK, sV, sA, sB, ring_a, ring_b,
                                 mbar_kv, n_block, part, kv_head, batch, group, m_block_min, n_m, n_iter)
            else:
                cute.arch.setmaxregister_increase(_CONSUMER_REGS)
                tid = tidx % _WG
                # cluster: double-buffered partial-S (consumer 0) / partial-dP (consumer 1) exchange
                sX = sP
                mbar_x = mbar_kv
                if const_expr(self.cluster):
                    x_layout = cute.make_layout(((4, n_s // 4), _WG, 2), stride=((1, 4 * _WG), 4, _TILE * _TILE))
                    sX = cute.make_tensor(storage.sXS.data_ptr(), x_layout)
                    if wg_idx == 2:
                        sX = cute.make_tensor(storage.sXdP.data_ptr(), x_layout)
                    mbar_x = storage.mbar_x.data_ptr() + (wg_idx - 1)
                if wg_idx == 1:
                    dqs = None
                    if const_expr(self.tma_dq):  # consumer 0 stages whole dQ chunks in the P^T exchange
                        dqs = self.dq_staging(storage.sP, _CH // self.dq_box, 1, tma_dq, mdQt, _BAR_DQ_FREE)
                    self.consume_s(mLSE, mdQacc, mdV, mma_ss, mma_rs, mma_dq, sK, sA, sdS, sP, ring_a, mbar_kv,
                                   scale, scale_log2, n_block, part, kv_head, batch, group, m_block_min, n_m,
                                   n_iter, seqlen_q, seqlen_k, tid, sX, mbar_x, dqs)
                else:
                    dqs = None
                    if const_expr(self.tma_dq):  # consumer 1: one box per pass, in its own 8 KiB (2 slots or 1)
                        dqs = self.dq_staging(storage.sdQ, 1, _DQ_STAGE // (_TILE * self.dq_box), tma_dq, mdQt,
                                              _BAR_DQ_FREE + 2)
                    self.consume_dp(mDelta, mdQacc, mdK, mma_ss, mma_rs, mma_dq, sK, sV, sB, sdS, sP, ring_b,
                                    mbar_kv, scale, n_block, part, kv_head, batch, group, m_block_min, n_m,
                                    n_iter, seqlen_q, seqlen_k, tid, sX, mbar_x, dqs)
        if const_expr(self.cluster):  # keep this CTA's shared memory alive while the peer reads it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def dq_staging(self, mem, boxes: int, slots: int, tma_dq: cute.CopyAtom, mdQt: cute.Tensor, bar_free: int):
        """dq_mode "tma": one consumer's dQ staging (a dict for ``dq_chunks``).

        A 64 x 64 fp32 dQ chunk is 64 / dq_box column groups (one TMA box each). A pass writes ``boxes``
        groups into one of ``slots`` staging slots and reduces them; consumer 0: all groups, 1 slot (the
        whole chunk, 16 KiB = the P^T exchange); consumer 1: 1 group per pass, in 8 KiB: dq_box 16 -> 2
        slots (double-buffered: a pass waits only for the reads of the pass before the previous one),
        dq_box 32 -> 1 slot (a pass waits for the previous pass's reads).
        ``view``: the (64 rows, 64 columns) tile the MMA fragment is written through (group g of a
        chunk -> box g % boxes of slot (g // boxes) % slots)."""
        lay = self._dq_stage_layout(boxes * slots)
        src = mem.get_tensor(lay.outer, swizzle=lay.inner)  # (64, 16, boxes * slots): the TMA sources
        w = self.dq_box
        passes = (_CH // w) // boxes
        box = _TILE * w
        view = mem.get_tensor(
            cute.make_layout((_TILE, (w, (boxes, slots, passes // slots))),
                             stride=(w, (1, (box, boxes * box, 0)))),
            swizzle=lay.inner)
        return {"atom": tma_dq, "g": mdQt, "src": src, "view": view, "boxes": boxes, "slots": slots,
                "passes": passes, "bar": bar_free}

    @cute.jit
    def dq_free(self, dqs, tid: Int32):
        """dq_mode "tma": the slot about to be written was read by its bulk reductions (the issuing thread
        waits until at most ``slots - 1`` groups are still reading; warp 0 arrives, warps 1..3 wait).

        Every lane of warp 0 waits: the DSL elects the issuing lane inside ``cute.copy`` (see
        :meth:`dq_issue`) and bulk groups are per thread, so the lanes that did not issue have only empty
        groups and pass at once. Warp-uniform branch: no divergence before the ``.aligned`` bar.arrive."""
        if tid // 32 == 0:
            cute.arch.cp_async_bulk_wait_group(dqs["slots"] - 1, read=True)
            cute.arch.barrier_arrive(barrier_id=dqs["bar"], number_of_threads=_WG)
        else:
            cute.arch.barrier(barrier_id=dqs["bar"], number_of_threads=_WG)

    @cute.jit
    def dq_issue(self, dqs, tSs: cute.Tensor, tGg: cute.Tensor, c: Int32, p: int, d: Int32, tid: Int32):
        """dq_mode "tma": pass ``p`` of chunk ``c`` written (fence to the async proxy, warps 1..3 arrive,
        warp 0 waits), then warp 0 issues one TMA reduce-add per box (boxes wholly past D skipped) and
        commits them as one bulk group.

        The whole (converged) warp 0 runs ``cute.copy``: the DSL wraps a TMA store / reduce in its own
        ``elect.sync -1`` (cpasync ``CopyBulkTensorTileS2GOp`` docs: "Do NOT wrap in elect_one (causes
        deadlock)"); under ``if tid == 0`` that elect.sync waited forever for lanes 1..31 (the H200 hang).
        Every lane of warp 0 commits (the elected lane's group holds the reductions, the others' are
        empty), so whichever lane the DSL elects, its groups are waited for in :meth:`dq_free` and the
        epilogue (all of warp 0 waits)."""
        cute.arch.fence_proxy("async.shared", space="cta")
        if tid // 32 == 0:
            cute.arch.barrier(barrier_id=dqs["bar"] + 1, number_of_threads=_WG)
            boxes = dqs["boxes"]
            for b in cutlass.range_constexpr(boxes):
                col_box = c * (_CH // self.dq_box) + p * boxes + b
                if col_box * self.dq_box < d:  # warp-uniform: the DSL's elect.sync sees all 32 lanes
                    cute.copy(dqs["atom"], tSs[None, (p % dqs["slots"]) * boxes + b], tGg[None, col_box])
            cute.arch.cp_async_bulk_commit_group()
        else:
            cute.arch.barrier_arrive(barrier_id=dqs["bar"] + 1, number_of_threads=_WG)

    @cute.jit
    def produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
                sK: cute.Tensor, sV: cute.Tensor, sA: cute.Tensor, sB: cute.Tensor,
                ring_a: pipeline.PipelineTmaAsync, ring_b: pipeline.PipelineTmaAsync, mbar_kv,
                n_block: Int32, part: Int32, kv_head: Int32, batch: Int32, group: Int32,
                m_block_min: Int32, n_m: Int32, n_iter: Int32):
        """Warp 0 of the producer warpgroup: K/V of the key block once (stream: K only), then per (head,
        query block) the Q / dO (stream: V and dO) chunks of rings A and B, in the order the consumers use
        them."""
        box = (_TILE, _CH)
        one = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, kv_head, batch], box, (n_block, None))  # (64, 64, nc)
        gV = cute.local_tile(mV[None, None, kv_head, batch], box, (n_block, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        if const_expr(self.stream):
            tVsB, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gV, 0, 2))
        else:
            tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        first = part * self.ncp if const_expr(self.cluster) else 0  # first chunk of the score GEMMs
        resident = 1 if const_expr(self.stream) else 2
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, resident * self.kv_stages * self.cfg.chunk_bytes)
        for c in cutlass.range_constexpr(self.kv_stages):
            cute.copy(tma_k, tKg[None, first + c], tKs[None, c], tma_bar_ptr=mbar_kv)
            if const_expr(not self.stream):
                cute.copy(tma_v, tVg[None, first + c], tVs[None, c], tma_bar_ptr=mbar_kv)

        st_a = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        st_b = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages_b)
        for it in cutlass.range(n_iter, unroll=1):
            head = kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            gQ = cute.local_tile(mQ[None, None, head, batch], box, (m_block, None))  # (64, 64, nc)
            gdO = cute.local_tile(mdO[None, None, head, batch], box, (m_block, None))
            tQsA, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sA, 0, 2),
                                              cute.group_modes(gQ, 0, 2))
            tQsB, _ = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sB, 0, 2),
                                            cute.group_modes(gQ, 0, 2))
            tdOsA, tdOg = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sA, 0, 2),
                                                cute.group_modes(gdO, 0, 2))
            tdOsB, _ = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sB, 0, 2),
                                             cute.group_modes(gdO, 0, 2))
            for c in cutlass.range_constexpr(self.kv_stages):
                ring_a.producer_acquire(st_a)
                cute.copy(tma_q, tQg[None, first + c], tQsA[None, st_a.index],
                          tma_bar_ptr=ring_a.producer_get_barrier(st_a))
                st_a.advance()
                if const_expr(self.stream):  # V_c next to dO_c (pair_gemm)
                    ring_b.producer_acquire(st_b)
                    cute.copy(tma_v, tVg[None, c], tVsB[None, st_b.index],
                              tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                    st_b.advance()
                ring_b.producer_acquire(st_b)
                cute.copy(tma_do, tdOg[None, first + c], tdOsB[None, st_b.index],
                          tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                st_b.advance()
            for j in cutlass.range_constexpr(self.ncp):
                _, cc = self.chunk_of_part(part, self.ncp, j)
                ring_a.producer_acquire(st_a)
                cute.copy(tma_do, tdOg[None, cc], tdOsA[None, st_a.index],
                          tma_bar_ptr=ring_a.producer_get_barrier(st_a))
                st_a.advance()
                ring_b.producer_acquire(st_b)
                cute.copy(tma_q, tQg[None, cc], tQsB[None, st_b.index], tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                st_b.advance()

    # ------------------------------------------------------------------------------------------------
    # consumer pieces

    @cute.jit
    def dq_chunks(self, mma_dq: cute.TiledMma, tdQrdS: cute.Tensor, tdQrK: cute.Tensor, mdQacc: cute.Tensor,
                  scale: Float32, part: Int32, head: Int32, batch: Int32, m_block: Int32, seqlen_q: Int32,
                  j_begin: int, j_end: int, tid: Int32, dqs=None):
        """dq_accum[rows of m_block, chunks j_begin..j_end-1 of the part] += scale * dS K_chunk.

        dq_mode "atomic": 16-byte ``red.global.add.v4.f32`` per thread (rows >= Nq and columns >= D
        skipped). dq_mode "tma" (``dqs`` from :meth:`dq_staging`): the scaled tile goes to the shared-memory
        staging, thread 0 issues TMA reduce-adds of 64 x 16 boxes (the TMA clips rows >= Nq and columns
        >= D). Consumer 0 stages the whole chunk (4 boxes, one pass), consumer 1 one 16-column quarter per
        pass (2-slot ring); the first wait for a staging slot overlaps the chunk's wgmma.
        """
        thr_dq = mma_dq.get_slice(tid)
        acc = cute.make_rmem_tensor(thr_dq.partition_shape_C((_TILE, _CH)), Float32)
        coords = thr_dq.partition_C(cute.make_identity_tensor((_TILE, _CH)))
        d = mdQacc.shape[3]
        mma = cute.make_mma_atom(mma_dq.op)
        tma = const_expr(self.tma_dq and not self.cfg.skip_dq)
        if const_expr(tma):
            tCs = thr_dq.partition_C(dqs["view"])  # same register order as acc
            gdQ = cute.local_tile(dqs["g"][None, None, head, batch], (_TILE, self.dq_box), (m_block, None))
            tSs, tGg = cpasync.tma_partition(dqs["atom"], 0, cute.make_layout(1), cute.group_modes(dqs["src"], 0, 2),
                                             cute.group_modes(gdQ, 0, 2))
            n_pass = dqs["passes"]
            per_pass = cute.size(acc) // n_pass
        for j in cutlass.range_constexpr(j_begin, j_end):
            c, cc = self.chunk_of_part(part, self.ncp, j)
            kv_idx = cc  # stationary K chunk: global chunk index, or with the cluster the part's j-th
            if const_expr(self.cluster):
                kv_idx = j
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tdQrdS, mode=[2])):
                mma.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(mma, acc, tdQrdS[None, None, k, 0], tdQrK[None, None, k, kv_idx], acc)
            warpgroup.commit_group()
            if const_expr(tma):
                self.dq_free(dqs, tid)  # overlaps the wgmma
            warpgroup.wait_group(0)
            if const_expr(tma):
                # register v holds column 2 (lane % 4) + 8 (v // 4) (+1): the group of w columns g =
                # registers w/2 g .. w/2 (g+1) - 1, pass h = groups h*boxes.. (test_bwd_fragment_orders)
                for h in cutlass.range_constexpr(n_pass):
                    if const_expr(h > 0):
                        self.dq_free(dqs, tid)
                    for v in cutlass.range_constexpr(h * per_pass, (h + 1) * per_pass):
                        tCs[v] = acc[v] * scale
                    self.dq_issue(dqs, tSs, tGg, c, h, d, tid)
            # registers 4i..4i+3 are (row r, cols col, col+1) and (row r+8, cols col, col+1); lanes 2x and
            # 2x+1 hold adjacent column pairs. After one exchange of two values with the partner lane the
            # even lane holds row r, cols col..col+3 and the odd lane row r+8, cols col-2..col+1: one
            # 16-byte red.global.add.v4.f32 each (D % 8 == 0 and col % 4 == 0: all four in range, aligned)
            if const_expr(not self.cfg.skip_dq and not self.tma_dq):  # (profiling variant: no reductions)
                odd = (tid % 2) == 1
                for i in cutlass.range_constexpr(cute.size(acc) // 4):
                    a0 = acc[4 * i] * scale
                    a1 = acc[4 * i + 1] * scale
                    b0 = acc[4 * i + 2] * scale
                    b1 = acc[4 * i + 3] * scale
                    r0 = cute.arch.shuffle_sync_bfly(a0 if odd else b0, offset=1)
                    r1 = cute.arch.shuffle_sync_bfly(a1 if odd else b1, offset=1)
                    x0 = r0 if odd else a0
                    x1 = r1 if odd else a1
                    x2 = b0 if odd else r0
                    x3 = b1 if odd else r1
                    row = m_block * _TILE + (coords[4 * i + 2][0] if odd else coords[4 * i][0])
                    col = c * _CH + coords[4 * i][1] - (2 if odd else 0)
                    if row < seqlen_q and col < d:
                        ptr = mdQacc.iterator + cute.crd2idx((batch, head, row, col), mdQacc.layout)
                        quad = vector.from_elements(_V4F32(), [x0.ir_value(), x1.ir_value(), x2.ir_value(),
                                                               x3.ir_value()])
                        cute.arch.atomic_add(ptr, quad)

    @cute.jit
    def exchange(self, acc: cute.Tensor, sX: cute.Tensor, mbar_x, it: Int32, rank: Int32, tid: Int32):
        """Cluster: acc (this CTA's partial S^T or dP^T over its head-dim part) += the peer CTA's partial.

        Buffer ``it % 2`` of the consumer's exchange area takes the partial; every consumer warp arrives on
        the exchange mbarrier of both CTAs (count 8), waits for phase ``it % 2``, then reads the peer's
        buffer through DSMEM. Two fp32 operands: a + b is bitwise commutative, so both CTAs hold identical
        sums. Double buffering makes the next write safe: a CTA writes buffer b again (iteration it + 2)
        only after the exchange of it + 1 completed, i.e. after the peer finished reading it."""
        buf = it % 2
        cute.autovec_copy(acc, sX[None, tid, buf])
        cute.arch.fence_acq_rel_cluster()  # our partial visible to the peer before the arrive
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(mbar_x)
            cute.arch.mbarrier_arrive(mbar_x, peer_cta_rank_in_cluster=1 - rank, scope=nvvm.MemScopeKind.CLUSTER)
        cute.arch.mbarrier_wait(mbar_x, buf)
        cute.arch.fence_acq_rel_cluster()
        sX_peer = cute.make_tensor(cute.arch.map_dsmem_ptr(sX.iterator, 1 - rank), sX.layout)
        for g in cutlass.range_constexpr(cute.size(acc) // 4):
            other = cute.make_rmem_tensor((4,), Float32)
            cute.autovec_copy(sX_peer[(None, g), tid, buf], other)
            for i in cutlass.range_constexpr(4):
                acc[4 * g + i] = acc[4 * g + i] + other[i]

    @cute.jit
    def store_part(self, accs: list, mma_rs: cute.TiledMma, mOut: cute.Tensor, mul: Float32,
                   n_block: Int32, part: Int32, kv_head: Int32, batch: Int32, seqlen_k: Int32, tid: Int32):
        """mOut[batch, kv_head, keys of n_block, columns of the part] = accs * mul (16-bit, clipped)."""
        self.store_tiles(accs, mma_rs, mOut, mul, n_block, part * self.ncp, kv_head, batch, seqlen_k, tid)

    @cute.jit
    def consume_s(self, mLSE: cute.Tensor, mdQacc: cute.Tensor, mdV: cute.Tensor, mma_ss: cute.TiledMma,
                  mma_rs: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor, sA: cute.Tensor,
                  sdS: cute.Tensor, sP: cute.Tensor, ring: pipeline.PipelineTmaAsync, mbar_kv,
                  scale: Float32, scale_log2: Float32, n_block: Int32, part: Int32, kv_head: Int32,
                  batch: Int32, group: Int32, m_block_min: Int32, n_m: Int32, n_iter: Int32,
                  seqlen_q: Int32, seqlen_k: Int32, tid: Int32, sX: cute.Tensor, mbar_x, dqs=None):
        """Consumer 0: S^T, P^T, dV_p, first half of the part's dQ chunks."""
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        thr_dq = mma_dq.get_slice(tid)
        tSrK = thr_ss.make_fragment_A(thr_ss.partition_A(sK))  # (MMA, 1, 4, nc)
        tSrQ = thr_ss.make_fragment_B(thr_ss.partition_B(sA))  # (MMA, 1, 4, S)
        sAT = cute.composition(sA, cute.make_ordered_layout((_CH, _TILE, self.stages), order=(1, 0, 2)))
        tVrdO = thr_rs.make_fragment_B(thr_rs.partition_B(sAT))  # (MMA, 1, 4, S): dO^T view
        tdQrK = tdQrdS = None
        if const_expr(not self.separate):
            sKT = cute.composition(sK, cute.make_ordered_layout((_CH, _TILE, self.kv_stages), order=(1, 0, 2)))
            tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKT))  # (MMA, 1, 4, nc)
            tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))  # (MMA, 1, 4, 1)
        acc_S = cute.make_rmem_tensor(thr_ss.partition_shape_C((_TILE, _TILE)), Float32)
        tOrP = cute.make_rmem_tensor(thr_rs.partition_shape_A((_TILE, _TILE)), self.dtype)
        tOrP_as_S = cute.make_tensor(tOrP.iterator, acc_S.layout)
        tScS = thr_ss.partition_C(cute.make_identity_tensor((_TILE, _TILE)))  # (key, query)
        acc_dV = []
        for _ in cutlass.range_constexpr(self.ncp):
            a = cute.make_rmem_tensor(thr_rs.partition_shape_C((_TILE, _CH)), Float32)
            a.fill(0.0)
            acc_dV.append(a)
        lse2 = cute.make_rmem_tensor((16,), Float32)
        n0 = n_block * _TILE
        offset = seqlen_k - seqlen_q

        cute.arch.mbarrier_wait(mbar_kv, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for it in cutlass.range(n_iter, unroll=1):
            head = kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            m0 = m_block * _TILE
            self.load_query_values(mLSE, tScS, lse2, _COL_REGS, 1, batch, head, m_block, seqlen_q, True)
            state = self.score_gemm(mma_ss, acc_S, tSrK, tSrQ, ring, state)
            if const_expr(self.cluster):
                self.exchange(acc_S, sX, mbar_x, it, part, tid)
            for v in cutlass.range_constexpr(cute.size(acc_S)):
                p = cute.math.exp2(acc_S[v] * scale_log2 - lse2[(v % 2) + 2 * (v // 4)], fastmath=True)
                key = n0 + tScS[v][0]
                keep = key < seqlen_k  # keys past Nkv (zero K rows): P = 0, never inf * 0 downstream
                if const_expr(self.causal):
                    keep = keep and key <= m0 + tScS[v][1] + offset
                p = p if keep else Float32(0.0)
                acc_S[v] = p
            if const_expr(self.tma_dq):  # sP was the dQ staging of the previous iteration
                if tid // 32 == 0:  # all of warp 0: the lane the DSL elected to issue is among them
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=_BAR_DQ_FREE, number_of_threads=_WG)
            if const_expr(self.separate):  # consumer 1 has read the previous P^T (it arrives after its read)
                if it > 0:
                    cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=2 * _WG)
            cute.autovec_copy(acc_S, sP[None, tid])
            if const_expr(self.separate):  # nothing to wait for: consumer 0 needs no dS
                cute.arch.barrier_arrive(barrier_id=_BAR_P, number_of_threads=2 * _WG)
            else:
                cute.arch.barrier(barrier_id=_BAR_P, number_of_threads=2 * _WG)
            tOrP_as_S.store(acc_S.load().to(self.dtype))
            # dV_p += P^T dO_p
            state = self.part_gemm(mma_rs, acc_dV, tOrP, tVrdO, ring, state)
            if const_expr(not self.separate):
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=2 * _WG)
                self.dq_chunks(mma_dq, tdQrdS, tdQrK, mdQacc, scale, part, head, batch, m_block, seqlen_q,
                               0, (self.ncp + 1) // 2, tid, dqs)
        if const_expr(self.tma_dq):  # the bulk reductions complete before the CTA's shared memory goes
            if tid // 32 == 0:  # all of warp 0 (the issuing lane is the DSL's elect.sync choice)
                cute.arch.cp_async_bulk_wait_group(0)
        self.store_part(acc_dV, mma_rs, mdV, Float32(1.0), n_block, part, kv_head, batch, seqlen_k, tid)

    @cute.jit
    def consume_dp(self, mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mma_ss: cute.TiledMma,
                   mma_rs: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor, sV: cute.Tensor,
                   sB: cute.Tensor, sdS: cute.Tensor, sP: cute.Tensor, ring: pipeline.PipelineTmaAsync,
                   mbar_kv, scale: Float32, n_block: Int32, part: Int32, kv_head: Int32, batch: Int32,
                   group: Int32, m_block_min: Int32, n_m: Int32, n_iter: Int32, seqlen_q: Int32,
                   seqlen_k: Int32, tid: Int32, sX: cute.Tensor, mbar_x, dqs=None):
        """Consumer 1: dP^T, dS^T (-> shared memory), dK_p, second half of the part's dQ chunks."""
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        thr_dq = mma_dq.get_slice(tid)
        tSrdO = thr_ss.make_fragment_B(thr_ss.partition_B(sB))  # (MMA, 1, 4, S)
        if const_expr(self.stream):
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(sB))  # (MMA, 1, 4, S): V chunks in ring B
        else:
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(sV))  # (MMA, 1, 4, nc)
        sBT = cute.composition(sB, cute.make_ordered_layout((_CH, _TILE, self.stages_b), order=(1, 0, 2)))
        tKrQ = thr_rs.make_fragment_B(thr_rs.partition_B(sBT))  # (MMA, 1, 4, S): Q^T view
        tdQrK = tdQrdS = tSsdS = None
        if const_expr(not self.separate):
            sKT = cute.composition(sK, cute.make_ordered_layout((_CH, _TILE, self.kv_stages), order=(1, 0, 2)))
            tdQrK = thr_dq.make_fragment_B(thr_dq.partition_B(sKT))  # (MMA, 1, 4, nc)
            tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))  # (MMA, 1, 4, 1)
            # dS^T (key, query) written into sdS (query, key): the transposed view
            sdS_T = cute.composition(sdS[None, None, 0], cute.make_ordered_layout((_TILE, _TILE), order=(1, 0)))
            tSsdS = thr_ss.partition_C(sdS_T)  # same (MMA, 1, 1) order as acc_dP
        acc_dP = cute.make_rmem_tensor(thr_ss.partition_shape_C((_TILE, _TILE)), Float32)
        rP = cute.make_rmem_tensor_like(acc_dP, Float32)
        tKrdS = cute.make_rmem_tensor(thr_rs.partition_shape_A((_TILE, _TILE)), self.dtype)
        tKrdS_as_S = cute.make_tensor(tKrdS.iterator, acc_dP.layout)
        tScS = thr_ss.partition_C(cute.make_identity_tensor((_TILE, _TILE)))
        acc_dK = []
        for _ in cutlass.range_constexpr(self.ncp):
            a = cute.make_rmem_tensor(thr_rs.partition_shape_C((_TILE, _CH)), Float32)
            a.fill(0.0)
            acc_dK.append(a)
        delta = cute.make_rmem_tensor((16,), Float32)
        n_half = (self.ncp + 1) // 2

        cute.arch.mbarrier_wait(mbar_kv, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages_b)
        for it in cutlass.range(n_iter, unroll=1):
            head = kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            self.load_query_values(mDelta, tScS, delta, _COL_REGS, 1, batch, head, m_block, seqlen_q, False)
            if const_expr(self.stream):
                state = self.pair_gemm(mma_ss, acc_dP, tSrV, tSrdO, ring, state, self.nc)
            else:
                state = self.score_gemm(mma_ss, acc_dP, tSrV, tSrdO, ring, state)
            if const_expr(self.cluster):
                self.exchange(acc_dP, sX, mbar_x, it, part, tid)
            cute.arch.barrier(barrier_id=_BAR_P, number_of_threads=2 * _WG)
            cute.autovec_copy(sP[None, tid], rP)
            if const_expr(self.separate):  # P^T read: consumer 0 may write the next one (it waits for this
                if it < n_iter - 1:  # arrive from its second iteration on, so the counts match)
                    cute.arch.barrier_arrive(barrier_id=_BAR_DS, number_of_threads=2 * _WG)
            for v in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[v] = rP[v] * (acc_dP[v] - delta[(v % 2) + 2 * (v // 4)])
            tKrdS_as_S.store(acc_dP.load().to(self.dtype))
            if const_expr(not self.separate):
                for v in cutlass.range_constexpr(cute.size(acc_dP)):
                    tSsdS[v] = tKrdS_as_S[v]
                cute.arch.fence_view_async_shared()  # generic-proxy writes -> wgmma (async proxy) reads
                cute.arch.barrier(barrier_id=_BAR_DS, number_of_threads=2 * _WG)
            # dK_p += dS^T Q_p
            state = self.part_gemm(mma_rs, acc_dK, tKrdS, tKrQ, ring, state)
            if const_expr(not self.separate):
                self.dq_chunks(mma_dq, tdQrdS, tdQrK, mdQacc, scale, part, head, batch, m_block, seqlen_q,
                               n_half, self.ncp, tid, dqs)
        if const_expr(self.tma_dq):
            if tid // 32 == 0:  # all of warp 0 (the issuing lane is the DSL's elect.sync choice)
                cute.arch.cp_async_bulk_wait_group(0)
        self.store_part(acc_dK, mma_rs, mdK, scale, n_block, part, kv_head, batch, seqlen_k, tid)

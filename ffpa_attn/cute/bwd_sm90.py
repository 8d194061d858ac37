"""sm90a (Hopper) attention backward in CuTeDSL, dK/dV kernel: K/V-stationary, head dim split over CTAs, TMA + wgmma.

This kernel computes dK and dV; :mod:`.bwd_dq_sm90` computes dQ in a second launch (no dQ GEMMs here, no dS tile,
no reductions; consumer 1 arrives on the DS barrier once it has read P^T and consumer 0 waits on it before writing
the next P^T).

One CTA per (64-key block ``n``, head-dim part ``p`` of ``n_parts``, kv head, batch): grid ``(n_parts *
ceil(Nkv/64), Hkv, B)``; ``n_parts`` = 2 up to D = 512, ``ceil(D / 256)`` above (see "D > 512" below). The
CTA owns ``dK[n, part p]`` and ``dV[n, part p]`` (``d_part = n_part_chunks * 64`` columns, fp32 in
registers) and loops over every query head of its GQA group and every 64-row query block that sees the key
block (causal: from the first block that sees a key of ``n``). The score tiles S and dP are computed over
the full head dim by every part of a key block (recompute; a 2-CTA cluster that exchanged partial S^T / dP^T
instead measured slower, docs/design.md). Per CTA, three warpgroups:

* warpgroup 0, warp 0 (producer, setmaxnreg 40): TMA-loads K and V of the key block once (all
  ``nc = ceil(D/64)`` column chunks of 64 x 64, one mbarrier), then per (head, query block) streams
  64 x 64 chunks through two mbarrier rings:
  ring A (consumer 0): Q chunks 0..nc-1, then the dO chunks of part p;
  ring B (consumer 1): dO chunks 0..nc-1, then the Q chunks of part p.
* warpgroup 1 (consumer 0, setmaxnreg 232):
  S^T = K Q^T (m64 n64, k = D, A = K chunk, B = Q chunk, both shared memory);
  P^T = exp2(S^T * scale*log2e - lse*log2e), 0 where masked / query row >= Nq / row without keys;
  P^T (fp32) -> shared memory for consumer 1; dV_p += P^T dO_p (A = P^T bf16 from registers).
* warpgroup 2 (consumer 1, setmaxnreg 232):
  dP^T = V dO^T (m64 n64, k = D); dS^T = P^T (dP^T - delta) in fp32 (P^T read from shared memory);
  dK_p += dS^T Q_p (A from registers).
  The end: dK_p * scale and dV_p converted and stored (rows >= Nkv, columns >= D clipped).

Budget (D = 512, ``nc = 8`` chunks, part = 4 chunks = 256 columns; see :class:`..config.BwdConfig`):

* shared memory: K and V resident 2 x 64 x 512 x 2 B = 128 KiB; P^T exchange 64 x 64 fp32 = 16 KiB;
  rings A and B 4 slots each of 64 x 64 x 2 B = 64 KiB; total 208 KiB + a 1 KiB placeholder + mbarriers
  <= 227 KiB. D < 512 uses deeper rings (D = 448: 6 slots, 384: 7, 320 / 264: 8).
* registers per consumer thread (setmaxnreg 232): dV_p (or dK_p) 64 x 256 fp32 / 128 threads = 128,
  S^T (or dP^T) 32, P^T / dS^T as 16-bit A fragment 16, lse / delta of the thread's 16 query columns 16;
  producer 40 (128 x 40 + 256 x 232 = 64512). ptxas (sm_90a): at most 168 registers at launch (384 threads),
  0 bytes spilled, no stack frame (tests/test_cute_compile.py).
* traffic per (key block, query block) and CTA: Q and dO over the full D once each plus the part's
  chunks again (1.5 x 2 x 64 x D x 2 B), K/V once per CTA. dK/dV are reduced inside one CTA in a fixed
  order (bit-reproducible).

D > 512 (``BwdConfig.stream``): K and V of a key block no longer fit next to the rings
(2 x 128 KiB at D = 1024), so V is not resident: ring B carries V_c, dO_c pairs (consumer 1's dP^T = sum_c V_c
dO_c^T reads both operands from the ring through :meth:`BwdSm90Base.pair_gemm`, a ring walk of two-slot items),
then the part's Q chunks; K stays resident for consumer 0. Parts of <= 4 chunks (D = 1024: 4 CTAs per key block,
each recomputing S^T and dP^T over the full D). Ring B moves twice the bytes of ring A per GEMM step and a pair
walk holds 4 of its slots, so it gets the deeper ring (``BwdConfig.ring_split``; D = 1024: K 128 KiB + P^T 16
KiB + ring A 4 x 8 KiB + ring B 6 x 8 KiB = 224 KiB; equal rings of 5 measured 86 against 134 TFLOPS).
Registers as at D = 512 (ptxas: 168, no spills).

Packed sequences (``BwdConfig.varlen``): q/dO/out ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]`` are
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
(computed by the caller).
"""
from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.utils import LayoutEnum

from .block_info import BlockInfo
from .config import BwdConfig
from .mask import Mask
from .named_barrier import DkDvBarrier
from .seqlen_info import SeqlenInfo
from .softmax import LOG2_E, probs_from_lse
from .tile_scheduler import DenseTileScheduler, VarlenTileScheduler

_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_WG = 128  # threads per warpgroup
_CH = 64  # columns per head-dim chunk (one 128-byte swizzle row of 16-bit elements)
_TILE = 64  # keys per CTA and query rows per step
# S^T (keys x queries) C fragment: the thread's 16 query columns are those of registers (v % 2) + 4 (v // 4);
# register v reads entry (v % 2) + 2 (v // 4) of a per-column cache (tests/test_cute_compile.py)
_COL_REGS = [(i % 2) + 4 * (i // 2) for i in range(16)]
_LSE_OF_REG = [(v % 2) + 2 * (v // 4) for v in range(32)]


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
        """acc = sum over the ``kv_stages`` stationary head-dim chunks of A(chunk c)
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
    """dK/dV kernel for one :class:`BwdConfig` (compile-time: D, dtype, causal, ring depths).

    Call (inside ``cute.compile``) with q/do ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nkv, D]`` (16-bit, unit
    stride on D), lse and delta ``[B, Hq, Nq]`` fp32, dk/dv ``[B, Hkv, Nkv, D]`` 16-bit (fully written),
    ``scale``, ``scale_log2 = scale * log2(e)``, ``group = Hq // Hkv`` and a stream (``cfg.varlen``: then
    ``cu_seqlens_q``, ``cu_seqlens_k`` and the work list). Sizes and strides are runtime values.
    """

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = _dtype(cfg.dtype)
        self.nc = cfg.n_chunks
        self.ncp = cfg.part_chunks
        self.stages = cfg.stages
        self.stages_b = cfg.stages_b
        self.causal = cfg.causal
        # D > 512: V is streamed through ring B next to dO (K alone stays resident); more head-dim parts
        self.stream = cfg.stream
        self.n_parts = cfg.n_parts
        self.kv_stages = self.nc  # chunks per score GEMM: the full head dim (every part recomputes S^T, dP^T)
        self.num_threads = 3 * _WG
        self.varlen = cfg.varlen
        assert self.ncp <= self.stages  # see BwdConfig: the rings cannot deadlock

    # ------------------------------------------------------------------------------------------------
    # host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale: Float32,
                 scale_log2: Float32, group: Int32, stream: cuda.CUstream, mCuQ: cute.Tensor | None = None,
                 mCuK: cute.Tensor | None = None, mItems: cute.Tensor | None = None):
        kv_layout = self._smem_layout(self.nc)
        ring_layout = self._smem_layout(self.stages)
        ring_layout_b = self._smem_layout(self.stages_b)
        chunk_layout = cute.slice_(ring_layout, (None, None, 0))
        (mQt, mKt, _, _), ((tma_q, tQ), (tma_k, tK), (tma_v, tV), (tma_do, tdO)) = self.tma_loads(
            (mQ, mK, mV, mdO), chunk_layout)
        mma_ss, mma_rs, mma_dq = self._tiled_mmas()
        stages = self.stages
        stages_b = self.stages_b
        n_p = _TILE * _TILE  # fp32 values of the P^T exchange
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
            # unused (this kernel has no dS tile); it keeps sP where the validated kernel's layout has it
            sdS_unused: cute.struct.Align[cute.struct.MemRange[self.dtype, 8], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, n_p], 128]

        self.shared_storage = SharedStorage
        if const_expr(self.varlen):  # (work-list slots x parts, KV heads), a block's parts adjacent
            grid = VarlenTileScheduler(1, self.n_parts).grid(cute.size(mKt.shape[2]), mItems.shape[1])
        else:
            grid = DenseTileScheduler(1, False, self.n_parts).grid(cute.ceil_div(mKt.shape[0], _TILE),
                                                                  cute.size(mKt.shape[2]), cute.size(mKt.shape[3]))
        # the four unused arguments (a tensor, an MMA, a TMA atom and its tensor) keep the kernel's parameter list,
        # and so its compiled code, identical to the GPU-validated build (dropping them renumbers the parameters)
        kernel = self.kernel(tma_q, tQ, tma_k, tK, tma_v, tV, tma_do, tdO, mLSE, mDelta, mdK, mdK, mdV, mma_ss,
                             mma_rs, mma_dq, kv_layout, ring_layout, ring_layout_b, scale, scale_log2, group,
                             tma_q, mQt, mCuQ, mCuK, mItems)
        kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------------
    # device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               mLSE: cute.Tensor, mDelta: cute.Tensor, unused_tensor: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, unused_mma: cute.TiledMma,
               kv_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout, ring_layout_b: cute.ComposedLayout,
               scale: Float32, scale_log2: Float32, group: Int32, unused_atom: cute.CopyAtom,
               unused_tma_tensor: cute.Tensor, mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None,
               mItems: cute.Tensor | None):
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
            work = DenseTileScheduler(1, False, self.n_parts).work()
            kv_head, batch, n_block, part = work.head, work.batch, work.block, work.part
            seq = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar_kv = storage.mbar_kv.data_ptr()
        ring_a, ring_b = self.make_rings(storage)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_kv, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)  # (64 keys, 64, nc)
        sV = None  # stream: V chunks are read from ring B
        if const_expr(not self.stream):
            sV = storage.sV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sA = storage.ringA.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)  # (64 rows, 64, S)
        sB = storage.ringB.get_tensor(ring_layout_b.outer, swizzle=ring_layout_b.inner)
        sP = self.p_exchange(storage)  # P^T exchange

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
                if wg_idx == 1:
                    self.consume_s(mLSE, mdV, mma_ss, mma_rs, sK, sA, sP, ring_a, mbar_kv, scale_log2, n_block,
                                   part, kv_head, batch, group, m_block_min, n_m, n_iter, seqlen_q, seqlen_k, tid)
                else:
                    self.consume_dp(mDelta, mdK, mma_ss, mma_rs, sV, sB, sP, ring_b, mbar_kv, scale, n_block, part,
                                    kv_head, batch, group, m_block_min, n_m, n_iter, seqlen_q, seqlen_k, tid)

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
        resident = 1 if const_expr(self.stream) else 2
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, resident * self.nc * self.cfg.chunk_bytes)
        for c in cutlass.range_constexpr(self.nc):
            cute.copy(tma_k, tKg[None, c], tKs[None, c], tma_bar_ptr=mbar_kv)
            if const_expr(not self.stream):
                cute.copy(tma_v, tVg[None, c], tVs[None, c], tma_bar_ptr=mbar_kv)

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
            for c in cutlass.range_constexpr(self.nc):
                ring_a.producer_acquire(st_a)
                cute.copy(tma_q, tQg[None, c], tQsA[None, st_a.index],
                          tma_bar_ptr=ring_a.producer_get_barrier(st_a))
                st_a.advance()
                if const_expr(self.stream):  # V_c next to dO_c (pair_gemm)
                    ring_b.producer_acquire(st_b)
                    cute.copy(tma_v, tVg[None, c], tVsB[None, st_b.index],
                              tma_bar_ptr=ring_b.producer_get_barrier(st_b))
                    st_b.advance()
                ring_b.producer_acquire(st_b)
                cute.copy(tma_do, tdOg[None, c], tdOsB[None, st_b.index],
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
    def store_part(self, accs: list, mma_rs: cute.TiledMma, mOut: cute.Tensor, mul: Float32,
                   n_block: Int32, part: Int32, kv_head: Int32, batch: Int32, seqlen_k: Int32, tid: Int32):
        """mOut[batch, kv_head, keys of n_block, columns of the part] = accs * mul (16-bit, clipped)."""
        self.store_tiles(accs, mma_rs, mOut, mul, n_block, part * self.ncp, kv_head, batch, seqlen_k, tid)

    @cute.jit
    def consume_s(self, mLSE: cute.Tensor, mdV: cute.Tensor, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma,
                  sK: cute.Tensor, sA: cute.Tensor, sP: cute.Tensor, ring: pipeline.PipelineTmaAsync, mbar_kv,
                  scale_log2: Float32, n_block: Int32, part: Int32, kv_head: Int32, batch: Int32, group: Int32,
                  m_block_min: Int32, n_m: Int32, n_iter: Int32, seqlen_q: Int32, seqlen_k: Int32, tid: Int32):
        """Consumer 0: S^T, P^T (-> shared memory for consumer 1), dV_p."""
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        tSrK = thr_ss.make_fragment_A(thr_ss.partition_A(sK))  # (MMA, 1, 4, nc)
        tSrQ = thr_ss.make_fragment_B(thr_ss.partition_B(sA))  # (MMA, 1, 4, S)
        sAT = cute.composition(sA, cute.make_ordered_layout((_CH, _TILE, self.stages), order=(1, 0, 2)))
        tVrdO = thr_rs.make_fragment_B(thr_rs.partition_B(sAT))  # (MMA, 1, 4, S): dO^T view
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
        mask = Mask(seqlen_q, seqlen_k, self.causal)

        cute.arch.mbarrier_wait(mbar_kv, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for it in cutlass.range(n_iter, unroll=1):
            head = kv_head * group + it // n_m
            m_block = m_block_min + it % n_m
            m0 = m_block * _TILE
            self.load_query_values(mLSE, tScS, lse2, _COL_REGS, 1, batch, head, m_block, seqlen_q, True)
            state = self.score_gemm(mma_ss, acc_S, tSrK, tSrQ, ring, state)
            # P^T; keys past Nkv (zero K rows) get P = 0, never inf * 0 downstream
            probs_from_lse(acc_S, tScS, lse2, _LSE_OF_REG, scale_log2, mask, m0, n0, 0)
            if it > 0:  # consumer 1 has read the previous P^T (it arrives after its read)
                cute.arch.barrier(barrier_id=DkDvBarrier.P_READ, number_of_threads=2 * _WG)
            cute.autovec_copy(acc_S, sP[None, tid])
            # consumer 0 waits for nothing
            cute.arch.barrier_arrive(barrier_id=DkDvBarrier.P_WRITTEN, number_of_threads=2 * _WG)
            tOrP_as_S.store(acc_S.load().to(self.dtype))
            # dV_p += P^T dO_p
            state = self.part_gemm(mma_rs, acc_dV, tOrP, tVrdO, ring, state)
        self.store_part(acc_dV, mma_rs, mdV, Float32(1.0), n_block, part, kv_head, batch, seqlen_k, tid)

    @cute.jit
    def consume_dp(self, mDelta: cute.Tensor, mdK: cute.Tensor, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma,
                   sV: cute.Tensor, sB: cute.Tensor, sP: cute.Tensor, ring: pipeline.PipelineTmaAsync, mbar_kv,
                   scale: Float32, n_block: Int32, part: Int32, kv_head: Int32, batch: Int32, group: Int32,
                   m_block_min: Int32, n_m: Int32, n_iter: Int32, seqlen_q: Int32, seqlen_k: Int32, tid: Int32):
        """Consumer 1: dP^T, dS^T, dK_p."""
        thr_ss = mma_ss.get_slice(tid)
        thr_rs = mma_rs.get_slice(tid)
        tSrdO = thr_ss.make_fragment_B(thr_ss.partition_B(sB))  # (MMA, 1, 4, S)
        if const_expr(self.stream):
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(sB))  # (MMA, 1, 4, S): V chunks in ring B
        else:
            tSrV = thr_ss.make_fragment_A(thr_ss.partition_A(sV))  # (MMA, 1, 4, nc)
        sBT = cute.composition(sB, cute.make_ordered_layout((_CH, _TILE, self.stages_b), order=(1, 0, 2)))
        tKrQ = thr_rs.make_fragment_B(thr_rs.partition_B(sBT))  # (MMA, 1, 4, S): Q^T view
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
            cute.arch.barrier(barrier_id=DkDvBarrier.P_WRITTEN, number_of_threads=2 * _WG)
            cute.autovec_copy(sP[None, tid], rP)
            # P^T read: consumer 0 may write the next one (it waits for this arrive from its second iteration on,
            # so the counts match)
            if it < n_iter - 1:
                cute.arch.barrier_arrive(barrier_id=DkDvBarrier.P_READ, number_of_threads=2 * _WG)
            for v in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[v] = rP[v] * (acc_dP[v] - delta[(v % 2) + 2 * (v // 4)])
            tKrdS_as_S.store(acc_dP.load().to(self.dtype))
            # dK_p += dS^T Q_p
            state = self.part_gemm(mma_rs, acc_dK, tKrdS, tKrQ, ring, state)
        self.store_part(acc_dK, mma_rs, mdK, scale, n_block, part, kv_head, batch, seqlen_k, tid)

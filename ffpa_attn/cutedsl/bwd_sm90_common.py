"""What the two sm90 backward kernels share (imports cutlass): :mod:`.bwd_sm90` (dK/dV) and :mod:`.bwd_dq_sm90` (dQ).

Both kernels have one shape. A CTA owns one 64-row block of the stationary side (a key block for dK/dV, a query
block for dQ) and one head-dim part of its output. Two tensors of that side are resident in shared memory (K and V,
or Q and dO; with ``BwdConfig.stream`` only the first, the second streams through ring B), the other side streams
in 64 x 64 chunks through two mbarrier rings (ring A for consumer 0, ring B for consumer 1), and the two consumers
exchange one 64 x 64 fp32 P tile through shared memory. Warp 0 of warpgroup 0 produces (TMA), warpgroups 1 and 2
consume (wgmma).

:class:`BwdSm90Base` holds what follows from that shape:

* host side: the chunk layouts, the TMA load atoms, the tiled MMAs, the shared-memory struct
  (:meth:`~BwdSm90Base.smem_struct`) and the grid and launch (:meth:`~BwdSm90Base.launch`);
* the prologue of a CTA (:meth:`~BwdSm90Base.prologue`, giving a :class:`BwdCta`): its work tile (dense grid or
  varlen work list, :mod:`.tile_scheduler`), the sequence's lengths with every tensor viewed from the sequence's
  first row (:class:`~.seqlen_info.SeqlenInfo`), the TMA descriptor prefetch, the mbarriers and the
  shared-memory tensors; then :meth:`~BwdSm90Base.run_warpgroups` gives the warpgroups their roles;
* the producer's loads (:meth:`~BwdSm90Base.load_resident`, :meth:`~BwdSm90Base.load_chunk`) and the consumers'
  pieces: chunked GEMMs against a ring, the lse / delta of the query rows, the 16-bit epilogue.
"""
from dataclasses import dataclass
from typing import Any, Callable, Optional, Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .config import BwdConfig
from .seqlen_info import SeqlenInfo
from .softmax import LOG2_E
from .tile_scheduler import DenseTileScheduler, VarlenTileScheduler

_PRODUCER_REGS = 40
_CONSUMER_REGS = 232
_WG = 128  # threads per warpgroup
_CH = 64  # columns per head-dim chunk (one 128-byte swizzle row of 16-bit elements)
_TILE = 64  # rows of a block: keys of a key block, query rows of a query block


def _dtype(name: str) -> Type[cutlass.Numeric]:
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


@dataclass(frozen=True)
class BwdCta:
    """One CTA of a backward kernel after :meth:`BwdSm90Base.prologue` (trace-time values; frozen, so the DSL's
    runtime loops and branches may read it).

    Attributes:
        tidx, warp_idx, wg_idx: the thread, its warp and its warpgroup.
        block, head, batch, part: the work tile: the stationary block, the grid's head (a KV head for dK/dV, a
            query head for dQ), the batch entry (0 for varlen: the tensors below start at the sequence) and the
            head-dim part; kv_head: the KV head of ``head``.
        active: False for a varlen work-list slot past the real work: the whole CTA skips its work.
        seq: the sequence's lengths (:class:`SeqlenInfo`).
        mQ, mK, mV, mdO: the TMA tensors ``(N, D, H, B)``, from the sequence's first row.
        q_rows, k_rows: the kernel's ``[B, H, N(, D)]`` tensors over query / key rows, from the sequence's first row.
        mbar_res: the mbarrier of the resident tensors. ring_a, ring_b: the chunk rings.
        sRes, sRes1: the resident tensors, ``(64, 64, nc)`` (``sRes1`` None with ``stream``); sA, sB: the
            rings' slots ``(64, 64, stages)``; sP: the P exchange (:meth:`BwdSm90Base.p_exchange`); storage: the
            shared-memory struct (for a kernel's own fields).
    """

    tidx: Any
    warp_idx: Any
    wg_idx: Any
    block: Any
    head: Any
    kv_head: Any
    batch: Any
    part: Any
    active: Any
    seq: SeqlenInfo
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mdO: cute.Tensor
    q_rows: tuple
    k_rows: tuple
    storage: Any
    mbar_res: Any
    ring_a: pipeline.PipelineTmaAsync
    ring_b: pipeline.PipelineTmaAsync
    sRes: cute.Tensor
    sRes1: Optional[cute.Tensor]
    sA: cute.Tensor
    sB: cute.Tensor
    sP: cute.Tensor


class BwdSm90Base:
    """What the two sm90 backward kernels share (see the module docstring), for one :class:`BwdConfig`.
    Subclasses set ``stages`` and ``stages_b`` (slots of rings A and B), ``parts`` (CTAs per block, one per
    head-dim part) and ``reverse_blocks`` (the dense grid's last block first)."""

    stages: int
    stages_b: int
    parts: int
    reverse_blocks: bool
    num_threads = 3 * _WG

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = _dtype(cfg.dtype)
        self.nc = cfg.n_chunks  # 64-column chunks of the head dim
        # chunks per score GEMM (S, dP): the full head dim (every head-dim part recomputes S and dP)
        self.kv_stages = self.nc
        self.causal = cfg.causal
        # D > 512: only the first resident tensor fits; the second (V / dO) streams through ring B
        self.stream = cfg.stream
        self.varlen = cfg.varlen

    # ------------------------------------------------------------------------------------------------
    # host side

    def host_setup(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor):
        """What both kernels build on the host: the shared-memory layouts (the resident tensors'
        ``(64, 64, nc)``, rings A and B), the ``(N, D, H, B)`` views and TMA load atoms of q, k, v, do, and the
        tiled MMAs; returns ``(layouts, views, atoms, mmas)``."""
        layouts = (self._smem_layout(self.nc), self._smem_layout(self.stages), self._smem_layout(self.stages_b))
        chunk_layout = cute.slice_(layouts[1], (None, None, 0))
        views, atoms = self.tma_loads((mQ, mK, mV, mdO), chunk_layout)
        return layouts, views, atoms, self._tiled_mmas()

    def smem_struct(self, res_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
                    ring_layout_b: cute.ComposedLayout, ds_elems: int = 0):
        """The shared-memory struct: the ring mbarriers, the resident tensors' mbarrier, the resident tensors
        (``stream``: the second is an 8-element placeholder, its chunks come through ring B), the two rings, a
        16-bit dS tile of ``ds_elems`` elements (dQ kernel; none for 0) and the fp32 P exchange (tiles 1024-byte
        aligned: 128-byte swizzle)."""
        dtype, stages, stages_b = self.dtype, self.stages, self.stages_b
        n_res1 = cute.cosize(res_layout) if not self.stream else 8

        @cute.struct
        class SharedStorage:
            mbar_a: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_b: cute.struct.MemRange[cutlass.Int64, 2 * stages_b]
            mbar_res: cute.struct.MemRange[cutlass.Int64, 1]
            sRes: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(res_layout)], 1024]
            sRes1: cute.struct.Align[cute.struct.MemRange[dtype, n_res1], 1024]
            ringA: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(ring_layout)], 1024]
            ringB: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(ring_layout_b)], 1024]
            if ds_elems:
                sdS: cute.struct.Align[cute.struct.MemRange[dtype, ds_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float32, _TILE * _TILE], 128]

        return SharedStorage

    def dense_scheduler(self) -> DenseTileScheduler:
        """The dense grid: one CTA per (block x part, head, batch), a block's parts adjacent along x."""
        return DenseTileScheduler(1, self.reverse_blocks, self.parts)

    def launch(self, kernel, mT: cute.Tensor, mItems: Optional[cute.Tensor], stream):
        """Launch ``kernel`` (a called ``@cute.kernel``) over the blocks and heads of ``mT``, the ``(N, D, H, B)``
        view of the stationary side (k for dK/dV, q for dQ): dense, one CTA per (block x part, head, batch);
        varlen, one per (work-list slot x part, head)."""
        if self.varlen:
            grid = VarlenTileScheduler(1, self.parts).grid(cute.size(mT.shape[2]), mItems.shape[1])
        else:
            grid = self.dense_scheduler().grid(cute.ceil_div(mT.shape[0], _TILE), cute.size(mT.shape[2]),
                                               cute.size(mT.shape[3]))
        kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

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

    # ------------------------------------------------------------------------------------------------
    # device side: the prologue and the warpgroups' roles

    @cute.jit
    def prologue(self, atoms: tuple, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 q_rows: tuple, k_rows: tuple, res_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
                 ring_layout_b: cute.ComposedLayout, mCuQ: Optional[cute.Tensor], mCuK: Optional[cute.Tensor],
                 mItems: Optional[cute.Tensor], group: Optional[Int32] = None) -> BwdCta:
        """Everything a CTA does before its warpgroups split (see :class:`BwdCta`): ``atoms`` the four TMA load
        atoms (descriptors prefetched), ``mQ .. mdO`` their ``(N, D, H, B)`` tensors, ``q_rows`` / ``k_rows``
        the kernel's ``[B, H, N(, D)]`` tensors over query / key rows (lse, delta, gradients); ``group`` (query
        heads per KV head) where the grid's heads are query heads, None where they are KV heads."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // _WG)
        active = True  # dense: every CTA has a block
        if const_expr(self.varlen):  # work-list slot -> (sequence, block); tensors from the sequence's rows
            work = VarlenTileScheduler(1, self.parts).work(mItems)
            active = work.valid  # (a slot past the real work: the CTA exits; it reads sequence 0's bounds)
            seq = SeqlenInfo.from_cu_seqlens(cutlass.max(work.batch, 0), mCuQ, mCuK)
            mQ, mdO, mK, mV = seq.rows_q(mQ), seq.rows_q(mdO), seq.rows_k(mK), seq.rows_k(mV)
            q_rows = tuple(seq.rows_q(t, mode=2) for t in q_rows)
            k_rows = tuple(seq.rows_k(t, mode=2) for t in k_rows)
            batch = Int32(0)
        else:
            work = self.dense_scheduler().work()
            seq = SeqlenInfo.dense(mQ.shape[0], mK.shape[0])
            batch = work.batch
        kv_head = work.head if const_expr(group is None) else work.head // group

        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        mbar_res = storage.mbar_res.data_ptr()
        ring_a, ring_b = self.make_rings(storage)
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_res, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sRes = storage.sRes.get_tensor(res_layout.outer, swizzle=res_layout.inner)  # (64 rows, 64, nc)
        sRes1 = None  # stream: its chunks are read from ring B
        if const_expr(not self.stream):
            sRes1 = storage.sRes1.get_tensor(res_layout.outer, swizzle=res_layout.inner)
        sA = storage.ringA.get_tensor(ring_layout.outer, swizzle=ring_layout.inner)  # (64 rows, 64, S)
        sB = storage.ringB.get_tensor(ring_layout_b.outer, swizzle=ring_layout_b.inner)
        sP = self.p_exchange(storage)
        return BwdCta(tidx, warp_idx, wg_idx, work.block, work.head, kv_head, batch, work.part, active, seq, mQ, mK,
                      mV, mdO, q_rows, k_rows, storage, mbar_res, ring_a, ring_b, sRes, sRes1, sA, sB, sP)

    @cute.jit
    def run_warpgroups(self, cta: BwdCta, produce: Callable[[], None], consume_0: Callable[[Int32], None],
                       consume_1: Callable[[Int32], None]):
        """Warp 0 of warpgroup 0 runs ``produce()``, warpgroups 1 and 2 ``consume_0(tid)`` / ``consume_1(tid)``
        (``tid``: the thread in its warpgroup), each after resizing its registers (setmaxnreg). A CTA whose tile
        is not ``active`` does nothing, as a whole: no thread reaches a barrier the others skip."""
        if cta.active:
            if cta.wg_idx == 0:
                cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
                if cta.warp_idx == 0:
                    produce()
            else:
                cute.arch.setmaxregister_increase(_CONSUMER_REGS)
                tid = cta.tidx % _WG
                if cta.wg_idx == 1:
                    consume_0(tid)
                else:
                    consume_1(tid)

    # ------------------------------------------------------------------------------------------------
    # producer pieces

    @cute.jit
    def load_resident(self, cta: BwdCta, tma_0: cute.CopyAtom, m_0: cute.Tensor, tma_1: cute.CopyAtom,
                      m_1: cute.Tensor):
        """The stationary block's resident tensors, all ``nc`` chunks on one mbarrier: ``m_0`` into ``sRes``,
        ``m_1`` into ``sRes1`` (``(N, D, H, B)`` TMA tensors, read at the tile's head and block); with ``stream``
        ``m_1`` stays out. Returns ``m_1``'s TMA partitions (shared: ``sRes1``, or ring B's slots with
        ``stream``, which then streams it; global: by chunk)."""
        box = (_TILE, _CH)
        one = cute.make_layout(1)
        g_0 = cute.local_tile(m_0[None, None, cta.head, cta.batch], box, (cta.block, None))  # (64, 64, nc)
        g_1 = cute.local_tile(m_1[None, None, cta.head, cta.batch], box, (cta.block, None))
        t0s, t0g = cpasync.tma_partition(tma_0, 0, one, cute.group_modes(cta.sRes, 0, 2), cute.group_modes(g_0, 0, 2))
        s_1 = cta.sB if const_expr(self.stream) else cta.sRes1
        t1s, t1g = cpasync.tma_partition(tma_1, 0, one, cute.group_modes(s_1, 0, 2), cute.group_modes(g_1, 0, 2))
        resident = 1 if const_expr(self.stream) else 2
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(cta.mbar_res, resident * self.nc * self.cfg.chunk_bytes)
        for c in cutlass.range_constexpr(self.nc):
            cute.copy(tma_0, t0g[None, c], t0s[None, c], tma_bar_ptr=cta.mbar_res)
            if const_expr(not self.stream):
                cute.copy(tma_1, t1g[None, c], t1s[None, c], tma_bar_ptr=cta.mbar_res)
        return t1s, t1g

    def ring_views(self, cta: BwdCta, tma: cute.CopyAtom, mT: cute.Tensor, head: Int32, block: Int32):
        """TMA partitions of 64-row block ``block`` of ``mT`` (``(N, D, H, B)``, at ``head``), a streamed block:
        (ring A's slots, ring B's slots, global by chunk)."""
        one = cute.make_layout(1)
        g = cute.local_tile(mT[None, None, head, cta.batch], (_TILE, _CH), (block, None))  # (64, 64, nc)
        tsA, tg = cpasync.tma_partition(tma, 0, one, cute.group_modes(cta.sA, 0, 2), cute.group_modes(g, 0, 2))
        tsB, _ = cpasync.tma_partition(tma, 0, one, cute.group_modes(cta.sB, 0, 2), cute.group_modes(g, 0, 2))
        return tsA, tsB, tg

    def producer_states(self) -> tuple[pipeline.PipelineState, pipeline.PipelineState]:
        """The producer's states of rings A and B, before their first slot."""
        return (pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages),
                pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages_b))

    def load_score_chunks(self, cta: BwdCta, st_a: pipeline.PipelineState, st_b: pipeline.PipelineState,
                          tma_a: cute.CopyAtom, ga: cute.Tensor, sa: cute.Tensor, tma_b: cute.CopyAtom,
                          gb: cute.Tensor, sb: cute.Tensor, tma_1: cute.CopyAtom, g_1: cute.Tensor, s_1: cute.Tensor):
        """The chunks of one streamed block that the two score GEMMs read, in their order: per chunk c, ring A
        chunk c of ``ga`` (consumer 0's B operand) and ring B chunk c of ``gb`` (consumer 1's), with ``stream``
        after chunk c of the second resident tensor (``g_1``, ``s_1``: :meth:`load_resident`; the pair of
        :meth:`pair_gemm`). Returns the advanced states."""
        for c in range(self.nc):
            st_a = self.load_chunk(cta.ring_a, st_a, tma_a, ga[None, c], sa)
            if self.stream:
                st_b = self.load_chunk(cta.ring_b, st_b, tma_1, g_1[None, c], s_1)
            st_b = self.load_chunk(cta.ring_b, st_b, tma_b, gb[None, c], sb)
        return st_a, st_b

    def load_chunk(self, ring: pipeline.PipelineTmaAsync, state: pipeline.PipelineState, tma: cute.CopyAtom,
                   src: cute.Tensor, dst: cute.Tensor) -> pipeline.PipelineState:
        """TMA-load the 64 x 64 chunk ``src`` into ring slot ``dst[None, slot]`` of ``state`` once it is free;
        returns ``state`` advanced (rebind it: the tracer carries loop state through plain local assignments
        only)."""
        ring.producer_acquire(state)
        cute.copy(tma, src, dst[None, state.index], tma_bar_ptr=ring.producer_get_barrier(state))
        state.advance()
        return state

    # ------------------------------------------------------------------------------------------------
    # consumer pieces

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

    def zero_accs(self, thr, n: int) -> list:
        """``n`` fp32 accumulators of 64 x 64 chunks (C fragments of the thread's slice ``thr`` of an MMA), zeroed."""
        accs = []
        for _ in range(n):
            a = cute.make_rmem_tensor(thr.partition_shape_C((_TILE, _CH)), Float32)
            a.fill(0.0)
            accs.append(a)
        return accs

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

"""Split-KV ("flash decoding") forward for few query rows against a long KV sequence.

A decode step (``Nq`` of 1..64 against thousands of cached keys) gives the split-D forward one program per
(batch, head, query block): a handful of programs for a whole GPU. Here the KV sequence is cut into
``S`` slices and every program owns one slice of one (batch, KV head):

* rows: all query rows that read that KV head, ``R = group * Nq`` (row ``r`` is query head
  ``hk * group + r // Nq``, query position ``r % Nq``: the GQA mapping of :func:`ffpa_attn.contract.kv_head`
  read backwards), in blocks of ``BLOCK_M``; the query heads of a group share one K/V read;
* ``S = QK^T`` over the whole head dim (``Q`` loaded once, or in ``QK_CHUNK`` columns for big tiles),
  online softmax in natural-log units (exp2 of ``(s - m) * log2 e``, so a huge finite float-mask bias
  cannot overflow), ``O += P V`` over ``BLOCK_DO`` columns of D (``N_DSPLIT = cdiv(D, BLOCK_DO)``
  programs share a slice when O does not fit the registers; they are launched next to each other so
  the repeated K reads hit L2);
* each program writes its slice's normalized partial ``o`` (fp32) into ``[B, Hq, S, Nq, D]`` and its
  running max ``m`` and sum ``l`` (partial lse = m + log l) into ``[B, Hq, S, Nq]``; a slice a row
  cannot see gives ``o = 0``, ``m = -inf``, ``l = 0``;
* :func:`_combine_kernel` merges the partials with weights ``w_s = l_s exp(m_s - M)``, ``M = max_s m_s``:
  ``out = sum_s w_s o_s / sum_s w_s``, ``lse = M + log(sum_s w_s)``; a row with no weight gets
  ``out = 0``, ``lse = -inf``. Keeping m and l apart (not lse_s) keeps the merge exact where m is huge
  (a row masked with ``finfo.min`` everywhere: fp32 would drop ``log l_s`` next to 3e38). With ``S = 1``
  the kernel writes ``out``/``lse`` directly and no combine runs.

Tiles (:func:`default_config`): on sm90 at D in (256, 512] BLOCK_M = 64 for any row count (wgmma, Q
resident in shared memory, 8 warps splitting O's columns; padded rows only idle the tensor cores), else
BLOCK_M covers the rows with mma.sync. A head dim that is not a power of two pads the tiles; the padding
is masked out of every load, so it costs MMA work (idle here anyway) but no bandwidth. Split count
(:func:`num_splits`): one wave of programs (SMs x programs per SM that shared memory allows), slices of at
least 4 tiles and 8 * R keys (so partials add <= 25% to the K/V traffic); a config's ``occ`` option
overrides the programs-per-SM estimate (:func:`choose_splits`), so the autotuner and the benchmarks can
try other split counts through the config alone.

Roofline of a decode step: ``4 * B * Hq * Nq * Nkv * D`` tensor-core FLOPs against ``4 * B * Hkv * Nkv * D``
bytes of bf16 K/V, i.e. ``R`` FLOP per K/V byte (R = rows per KV head). An H200 (989 dense bf16 TFLOPS,
4.8 TB/s) turns compute-bound above ~200 FLOP/B at peak and well before that at the MMA rates a
D = 512 online-softmax loop reaches (R = 256: 34 GFLOP vs 134 MB at B=1, Hkv=2, Nkv=32768 needs ~800
TFLOPS to run at 75% of a ~4.2 TB/s copy). For R = 64 the same target needs ~200 TFLOPS: reachable only
with tiles that keep the tensor cores busy, which :func:`candidate_configs` searches
(:func:`roofline` gives the numbers).

Causal is tail-aligned (:func:`ffpa_attn.triton.common.causal_visible`), attn_mask is read through the
stride-0 ``[B, Hq, Nq, Nkv]`` view of :func:`ffpa_attn.contract.canonical_mask`; any strides, 64-bit
offsets. The backward is the ordinary one (the lse written here is exact).

Entry points: :func:`splitkv_forward` (the kernel-module call), :func:`splitkv_launch` (explicit tiles and
split count: tests, benchmarks), :func:`default_config`, :func:`candidate_configs`, :func:`num_splits`,
:func:`choose_splits`, :func:`roofline`.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..contract import canonical_mask
from . import autotune
from .autotune import KernelConfig
from ..common.combine import launch_combine as _launch_combine, partial_buffers, pow2 as _pow2
from ..common import device as hw
from .common import add_float_mask, causal_visible, round_cast

KERNEL_NAME = "splitkv_fwd"
LOG2E = 1.4426950408889634
MAX_SPLITS = 1024


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with an fp32 accumulator; DOT_F32 (interpreter only) upcasts the operands first."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["Hkv", "GROUP", "Nq", "Nkv", "slice_len", "n_splits", "n_mblk", "n_dsplit"])
def _splitkv_kernel(
    Q, K, V, Mask, O, L, LS,
    sqb, sqh, sqn, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    smb, smh, smn, smk,
    sob, soh, sos, son, sod,
    slb, slh, sls, sln,
    Hkv, GROUP, Nq, Nkv, scale, slice_len, n_splits, n_mblk, n_dsplit,
    HEAD_DIM: tl.constexpr,  # D (compile-time: masks along D keep 16-byte vectors, so loads stay async)
    MASK_KIND: tl.constexpr,  # 0 none, 1 bool (True = visible), 2 float (additive)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr,
    QK_CHUNK: tl.constexpr, EVEN_D: tl.constexpr, DIRECT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One (D-slice of O, row block, KV slice, batch * KV head) program; 1-D grid, D-slice fastest.

    Q [B, Hq, Nq, D], K/V [B, Hkv, Nkv, D] (any strides). Partial mode: O = normalized partial out
    [B, Hq, S, Nq, D] fp32, L = running max m, LS = sum l (both [B, Hq, S, Nq] fp32; partial lse =
    m + log l). DIRECT (S = 1): O/L are the final out/lse (``sos = sls = 0``), LS is unused.
    """
    pid = tl.program_id(0)
    dsp = pid % n_dsplit
    rest = pid // n_dsplit
    m_blk = rest % n_mblk
    rest = rest // n_mblk
    split = rest % n_splits
    bh = rest // n_splits
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)

    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Nq
    qi = rows % Nq
    hq = hk * GROUP + rows // Nq  # the query heads h with kv_head(h) == hk
    q_rows = Q + b * sqb + hq * sqh + qi.to(tl.int64) * sqn
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_rows = Mask + b * smb + hq * smh + qi.to(tl.int64) * smn

    offs_d = tl.arange(0, BLOCK_D)
    offs_do = dsp * BLOCK_DO + tl.arange(0, BLOCK_DO)
    do_ok = offs_do < HEAD_DIM  # used only when not EVEN_D (loads and stores stay unmasked along D)
    if QK_CHUNK == BLOCK_D:
        if EVEN_D:
            q = tl.load(q_rows[:, None] + offs_d[None, :] * sqd, mask=row_ok[:, None], other=0.0)
        else:
            q = tl.load(q_rows[:, None] + offs_d[None, :] * sqd,
                        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    lo = split * slice_len
    hi = tl.minimum(lo + slice_len, Nkv)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DO], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        cols64 = cols.to(tl.int64)
        # K is loaded as K^T tiles [D, BLOCK_N] (no register transpose: the load then feeds the dot
        # operand straight from shared memory, so the pipeliner multi-buffers it like V)
        if QK_CHUNK == BLOCK_D:
            if EVEN_D:
                kt = tl.load(k_base + offs_d[:, None] * skd + cols64[None, :] * skn, mask=col_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_base + offs_d[:, None] * skd + cols64[None, :] * skn,
                             mask=col_ok[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
            s = _dot(q, kt, DOT_F32)
        else:
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for c in tl.static_range(BLOCK_D // QK_CHUNK):
                offs_c = c * QK_CHUNK + tl.arange(0, QK_CHUNK)
                qc = tl.load(q_rows[:, None] + offs_c[None, :] * sqd,
                             mask=row_ok[:, None] & (offs_c[None, :] < HEAD_DIM), other=0.0)
                kct = tl.load(k_base + offs_c[:, None] * skd + cols64[None, :] * skn,
                              mask=col_ok[None, :] & (offs_c[:, None] < HEAD_DIM), other=0.0)
                s += _dot(qc, kct, DOT_F32)
        s = s * scale
        visible = col_ok[None, :] & row_ok[:, None]
        if MASK_KIND == 1:
            mb = tl.load(m_rows[:, None] + cols64[None, :] * smk, mask=visible, other=0)
            visible = visible & (mb != 0)
        if MASK_KIND == 2:
            bias = tl.load(m_rows[:, None] + cols64[None, :] * smk, mask=visible, other=0.0)
            s = add_float_mask(s, bias, 1.0)
        if CAUSAL:
            visible = visible & causal_visible(qi, cols, Nkv - Nq)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
        alpha = tl.math.exp2((m_i - m_ref) * 1.4426950408889634)
        p = tl.math.exp2((s - m_ref[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_D:
            v = tl.load(v_base + cols64[:, None] * svn + offs_do[None, :] * svd, mask=col_ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + cols64[:, None] * svn + offs_do[None, :] * svd,
                        mask=col_ok[:, None] & do_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(round_cast(p, v.dtype, DOT_F32), v, DOT_F32)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    m_i = tl.where(seen, m_i, float("-inf"))
    split64 = split.to(tl.int64)
    o_rows = O + b * sob + hq * soh + split64 * sos + qi.to(tl.int64) * son
    if EVEN_D:
        tl.store(o_rows[:, None] + offs_do[None, :] * sod, round_cast(o, O.dtype.element_ty, DOT_F32), mask=row_ok[:, None])
    else:
        tl.store(o_rows[:, None] + offs_do[None, :] * sod, round_cast(o, O.dtype.element_ty, DOT_F32),
                 mask=row_ok[:, None] & do_ok[None, :])
    l_rows = b * slb + hq * slh + split64 * sls + qi.to(tl.int64) * sln
    if dsp == 0:
        if DIRECT:
            tl.store(L + l_rows, lse, mask=row_ok)
        else:  # max and sum separately: the merge stays exact when m is huge (finfo.min masks)
            tl.store(L + l_rows, m_i, mask=row_ok)
            tl.store(LS + l_rows, l_i, mask=row_ok)


# -------------------------------------------------------------------------------------------- host side


def _tile(cfg: KernelConfig, d: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_DO, QK_CHUNK) of a config for head dim d."""
    block_d = _pow2(d)
    block_do = min(_pow2(cfg.opt("block_do", block_d)), block_d)
    qk_chunk = min(_pow2(cfg.opt("qk_chunk", block_d)), block_d)
    return block_d, block_do, qk_chunk


def smem_bytes(cfg: KernelConfig, d: int, device: torch.device | None = None, elt: int = 2) -> int:
    """Shared memory of the split-KV kernel: Q (resident once, or reloaded in QK_CHUNK pieces and then
    pipelined like K) plus the K/V tile buffers - ``num_stages`` of them where the dots are wgmma
    (sm90, BLOCK_M >= 64), ``num_stages - 1`` with mma.sync (what Triton 3.6 allocates for sm90)."""
    block_d, block_do, qk_chunk = _tile(cfg, d)
    stages = max(cfg.num_stages, 1)
    wgmma = hw.capability_major(device) == 9 and cfg.block_m >= 64
    bufs = stages if (wgmma or device is None) else max(stages - 1, 1)
    kv = cfg.block_n * (block_d + block_do) * elt
    q = cfg.block_m * block_d * elt * (bufs if qk_chunk < block_d else 1)
    return bufs * kv + q


def acc_regs(cfg: KernelConfig, d: int) -> int:
    """fp32 O-accumulator registers per thread."""
    return cfg.block_m * _tile(cfg, d)[1] // (32 * cfg.num_warps)


def _family(d: int, rows: int, device: torch.device, wgmma: bool) -> KernelConfig:
    """The best-guess config of one kernel family for head dim ``d`` and ``rows = group * Nq``.

    wgmma (sm90, D in (256, 512]): BLOCK_M = 64 whatever the rows (padded rows only idle the tensor
    cores), Q resident in shared memory, 8 warps = two warpgroups splitting O's columns.
    mma.sync (otherwise): BLOCK_M covers the rows (16..64, Q <= 64 KiB).
    Both: Q loaded once (in shared memory, read by ldmatrix/wgmma each tile; compiled with Triton 3.6 for
    sm90 neither family spills inside the KV loop at D = 512 / 1024), the O accumulator <= 32K fp32 per
    program (else O's columns split over programs), K/V tiles sized so 2-3 pipeline stages fit.
    """
    block_d = _pow2(d)
    if wgmma:
        block_m = 64
    else:
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
        block_m = max(16, min(block_m, 32768 // block_d))
    block_do = block_d
    while block_m * block_do > 32768:
        block_do //= 2
    num_warps = 4 if block_m * block_do < 8192 else 8
    opts = (("block_do", block_do), ("qk_chunk", block_d))
    limit = hw.smem_limit(device) - 8 * 1024
    block_n = 64 if block_d <= 128 else (32 if block_d <= 512 else 16)
    for bn, stages in ((block_n, 3), (block_n, 2), (16, 2), (16, 1)):
        cfg = KernelConfig(block_m, bn, num_warps, 2 if wgmma and stages == 3 else stages, opts)
        if smem_bytes(cfg, d, device) <= limit:
            return cfg
    return cfg


def _wgmma_ok(d: int, device: torch.device) -> bool:
    return hw.capability_major(device) == 9 and 256 < _pow2(d) <= 512


def default_config(d: int, rows: int, device: torch.device) -> KernelConfig:
    """The best-guess tile config for head dim ``d`` and ``rows = group * Nq`` query rows per KV head:
    the wgmma family (:func:`_family`) where it applies and the rows fill more than one 16-row MMA tile,
    else the mma.sync family; off-GPU one small config that runs fast in the interpreter."""
    if device.type != "cuda":
        block_d = _pow2(d)
        block_m = max(16, min(16 if rows <= 16 else (32 if rows <= 32 else 64), 32768 // block_d))
        return KernelConfig(block_m, 16 if block_d >= 256 else 32, 4, 1, (("block_do", block_d),
                                                                          ("qk_chunk", block_d)))
    if 32 < rows <= 64 and _wgmma_ok(d, device):
        # MMA-bound (64 FLOP per K/V byte at rows = 64): the mma.sync tile with O's columns split over two
        # programs per row block (S recomputed, K read twice) measured faster than the wgmma BM64 tile
        # (bench/decode_bandwidth.py; docs/design.md, "Triton kernels")
        block_d = _pow2(d)
        cfg = KernelConfig(64, 32, 4, 3, (("block_do", block_d // 2), ("qk_chunk", block_d)))
        if smem_bytes(cfg, d, device) <= hw.smem_limit(device) - 8 * 1024:
            return cfg
    return _family(d, rows, device, rows > 16 and _wgmma_ok(d, device))


def candidate_configs(d: int, rows: int, device: torch.device, mode: str = "fast") -> list[KernelConfig]:
    """The default first, then a few neighbours (BLOCK_N, warps, stages), the other kernel family and, for
    ``16 < rows <= 64`` on sm90 at D in (256, 512], the mma.sync tile of 32 rows, 4 warps (two row blocks,
    the second reading K/V from L2; two programs per SM). ``mode="max"`` adds its 3-stage form, 16-row
    tiles (one per 16 rows, K/V re-read from L2) and, for <= 16 rows, a variant that aims at two programs
    per SM (``occ`` = 2: twice the splits, more loads in flight).

    Why the 32-row tile: at rows = 64 (B=1, Hq=32: Hkv=8 Nq=16, Hkv=2 Nq=4) the wgmma BM64 tile spends longer per
    32-key tile in MMAs than one 64 KiB K/V tile takes at an SM's share of the HBM bandwidth: the loop is
    MMA-bound, not HBM-bound, so another MMA shape is the lever, and the non-split forward at D = 512 peaks with
    exactly this tile (32x32, 4 warps, 2 stages); which one wins here is measured (bench/decode_bandwidth.py), not
    assumed.
    """
    base = default_config(d, rows, device)
    if device.type != "cuda":
        return [base]
    limit = hw.smem_limit(device) - 8 * 1024
    out = [base]

    def add(c: KernelConfig) -> None:
        # more than 128 accumulator registers per thread spills inside the KV loop
        if c not in out and smem_bytes(c, d, device) <= limit and acc_regs(c, d) <= 128:
            out.append(c)

    for bn, nw, st in ((base.block_n * 2, base.num_warps, 2), (max(16, base.block_n // 2), base.num_warps, 4),
                       (base.block_n, 12 - base.num_warps, base.num_stages)):
        add(KernelConfig(base.block_m, bn, nw, st, base.options))
    if _wgmma_ok(d, device):
        other = _family(d, rows, device, not (rows > 16))
        if other not in out:
            out.append(other)
        if 16 < rows <= 64:
            add(KernelConfig(32, base.block_n, 4, 2, base.options))
    if mode == "max":
        if rows > 16:
            add(KernelConfig(32, base.block_n, 4, 3, base.options))
            add(KernelConfig(16, base.block_n, 8, 3, base.options))
        if rows <= 16:
            add(KernelConfig(16, base.block_n, 4, 2, base.options).with_options(occ=2))
    return out


def occupancy(cfg: KernelConfig, d: int, device: torch.device) -> int:
    """Programs per SM (1..4; 2 off-GPU) that shared memory and registers allow; registers are taken at
    Triton's cap of 255 per thread (what these tiles compile to), so 8 warps -> 1, 4 warps -> 2."""
    if device.type != "cuda":
        return 2
    by_smem = hw.smem_limit(device) // max(smem_bytes(cfg, d, device), 1)
    by_regs = 65536 // (256 * 32 * cfg.num_warps)
    return max(1, min(4, by_smem, by_regs))


def num_splits(programs_per_split: int, nkv: int, block_n: int, rows: int, device: torch.device,
               occupancy: int = 2) -> int:
    """How many KV slices: enough programs to fill the GPU once, slices not shorter than a few tiles.

    Args:
        programs_per_split: programs that share one slice index (B * Hkv * row blocks * D slices).
        nkv: KV length; block_n: keys per tile; rows: query rows per KV head (group * Nq).
        occupancy: resident programs per SM to aim for (one wave of ``occupancy * SMs`` programs).
    """
    n_blocks = triton.cdiv(nkv, block_n)
    # each slice writes (and the combine reads) rows x D fp32 partials next to its 2 x keys x D K/V reads:
    # keys >= 8 * rows keeps that extra traffic <= 25%
    min_blocks = max(4, triton.cdiv(8 * rows, block_n))
    max_split = max(1, min(MAX_SPLITS, n_blocks // min_blocks))
    want = max(1, (hw.sm_count(device) * occupancy) // max(programs_per_split, 1))
    s = min(want, max_split)
    per = triton.cdiv(n_blocks, s)
    return triton.cdiv(n_blocks, per)


def choose_splits(cfg: KernelConfig, b: int, hkv: int, rows: int, nkv: int, d: int,
                  device: torch.device) -> int:
    """The split count :func:`splitkv_launch` uses for ``cfg`` when none is given: :func:`num_splits` over
    ``B * Hkv * row blocks * D slices`` programs per slice index, aiming at ``cfg``'s ``occ`` option
    (programs per SM) when set, else at :func:`occupancy`."""
    block_do = _tile(cfg, d)[1]
    per = b * hkv * triton.cdiv(rows, cfg.block_m) * triton.cdiv(d, block_do)
    occ = int(cfg.opt("occ", 0) or 0) or occupancy(cfg, d, device)
    return num_splits(per, nkv, cfg.block_n, rows, device, occupancy=occ)


def roofline(b: int, hq: int, hkv: int, nq: int, nkv: int, d: int, elt: int = 2) -> dict:
    """Work of one non-causal decode call: tensor-core FLOPs (``4 * B * Hq * Nq * Nkv * D``: QK^T and PV,
    2 FLOP per multiply-add, padding not counted), K/V bytes read once (``2 * B * Hkv * Nkv * D * elt``)
    and their ratio (= rows per KV head ``Hq / Hkv * Nq`` for 2-byte K/V)."""
    flops = 4.0 * b * hq * nq * nkv * d
    kv_bytes = 2.0 * b * hkv * nkv * d * elt
    return {"flops": flops, "kv_bytes": kv_bytes, "flop_per_byte": flops / kv_bytes}


def splitkv_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
                   causal: bool, scale: float, cfg: KernelConfig | None = None,
                   splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the split-KV forward with an explicit tile config and split count.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nkv, D]`` (validated: Hq % Hkv == 0, Nkv >= 1).
        attn_mask: None or broadcastable to ``[B, Hq, Nq, Nkv]`` (bool True = visible, float additive).
        causal: tail-aligned causal; scale: softmax scale.
        cfg: tiles (``block_m``, ``block_n``, warps, stages, options ``block_do`` / ``qk_chunk`` / ``occ``);
            None = :func:`default_config`.
        splits: number of KV slices (kept as given, so slices may be empty); None = :func:`choose_splits`.

    Returns:
        ``(out [B, Hq, Nq, D] in q.dtype, lse [B, Hq, Nq] fp32)``.
    """
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    group = hq // hkv
    rows = group * nq
    cfg = cfg or default_config(d, rows, q.device)
    block_d, block_do, qk_chunk = _tile(cfg, d)
    n_dsplit = triton.cdiv(d, block_do)
    n_mblk = triton.cdiv(rows, cfg.block_m)
    if splits is None:
        splits = choose_splits(cfg, b, hkv, rows, nkv, d, q.device)
    splits = max(1, int(splits))
    slice_len = triton.cdiv(triton.cdiv(nkv, splits), cfg.block_n) * cfg.block_n

    mask_kind, mask, mstr = 0, q, (0, 0, 0, 0)
    if attn_mask is not None:
        mask = canonical_mask(attn_mask, b, hq, nq, nkv)
        mask_kind = 1 if mask.dtype == torch.bool else 2
        mstr = mask.stride()

    out = torch.empty(b, hq, nq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    o_buf, l_buf, s_buf, ostr, lstr = partial_buffers(out, lse, splits)

    grid = (n_dsplit * n_mblk * splits * b * hkv,)
    _splitkv_kernel[grid](
        q, k, v, mask, o_buf, l_buf, s_buf,
        *q.stride(), *k.stride(), *v.stride(), *mstr, *ostr, *lstr,
        hkv, group, nq, nkv, float(scale), slice_len, splits, n_mblk, n_dsplit,
        HEAD_DIM=d, MASK_KIND=mask_kind, CAUSAL=bool(causal),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DO=block_do, QK_CHUNK=qk_chunk,
        EVEN_D=(d == block_d and block_do <= d), DIRECT=splits == 1, DOT_F32=q.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _launch_combine(o_buf, l_buf, s_buf, out, lse, b * hq, nq, hq, out.stride(0), out.stride(1),
                        lse.stride(0), lse.stride(1), lse_only=False)
    return out, lse


def _tune_key(q: torch.Tensor, k: torch.Tensor, mask_kind: str, causal: bool) -> tuple:
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    return (str(q.dtype).removeprefix("torch."), d, autotune.bucket(hq // hkv * nq, lo=16, hi=1024),
            autotune.bucket(nkv, lo=1024, hi=1 << 20), autotune.bucket(b * hkv, lo=1, hi=1024), mask_kind,
            bool(causal))


def splitkv_forward(q, k, v, *, attn_mask, causal, scale, config):
    """Kernel-module entry: ``(out [B, Hq, Nq, D], lse [B, Hq, Nq] fp32)`` for short queries, long KV.

    ``config`` is the TritonBackend (its ``autotune`` / ``autotune_mode`` pick tiles through
    :func:`ffpa_attn.triton.autotune.pick_config`); the split count follows :func:`num_splits`.
    """
    d = q.shape[-1]
    rows = q.shape[1] // k.shape[1] * q.shape[2]
    mode = getattr(config, "autotune_mode", "fast")
    cands = candidate_configs(d, rows, q.device, mode=mode)
    tune = bool(getattr(config, "autotune", False)) and q.device.type == "cuda"
    if tune and torch.cuda.is_current_stream_capturing():
        tune = False  # no benchmarking inside a CUDA graph capture: use the cached/default choice

    def bench(c: KernelConfig) -> float:
        return autotune.bench_ms(lambda: splitkv_launch(q, k, v, attn_mask=attn_mask, causal=causal,
                                                        scale=scale, cfg=c), cuda_graph=True)

    mask_kind = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
    cfg = autotune.pick_config(
        KERNEL_NAME, _tune_key(q, k, mask_kind, causal), cands, bench if tune else None, device=q.device,
        fingerprint=autotune.source_fingerprint(__file__), autotune=tune,
        mode=mode)
    # the shared-memory estimate is a plan, the compiler has the last word: step down on OutOfResources,
    # and where nothing fits (small-smem GPUs at D = 1024) the split-D forward serves the call
    for c in [cfg] + [c for c in cands if c != cfg] + [_smallest(cfg)]:
        try:
            return splitkv_launch(q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, cfg=c)
        except OutOfResources:
            continue
    from . import fwd

    return fwd.dense_forward(q, k, v, attn_mask=attn_mask, dropout_p=0.0, rng=None, causal=causal, scale=scale,
                             config=config)


def _smallest(cfg: KernelConfig) -> KernelConfig:
    """The lightest variant of ``cfg``: 16 rows, 16-key tiles, one pipeline stage."""
    return KernelConfig(16, 16, cfg.num_warps, 1, cfg.options)


__all__ = ["splitkv_forward", "splitkv_launch", "default_config", "candidate_configs", "num_splits",
           "choose_splits", "roofline", "smem_bytes", "acc_regs", "occupancy", "KERNEL_NAME", "LOG2E"]

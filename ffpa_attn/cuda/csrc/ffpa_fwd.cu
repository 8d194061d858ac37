// FFPA split-D attention forward for large head dims (256 < D <= 1024), fp16/bf16, mma.sync (sm80+).
//
// out[b, h, r, :] = softmax(scale * Q K^T + causal) V, lse[b, h, r] = natural-log sum-exp of the scaled
// scores (-inf for a row that sees no key). Tail-aligned causal: row r sees key k <= r + (Nkv - Nq).
// GQA: query head h reads KV head h / group.
//
// CTA = NW warps = WM row groups x WN column groups. Warp (wm, wn) owns WR = 16 * RM query rows and the O
// columns {c*SW + wn*CW + [0, CW) : c < NCH} (DW = DPAD / WN columns in all). Per key tile of BC = 64 keys:
//   1. QK^T, split over D: warp (wm, wn) accumulates a partial S[WR x 64] over *its* D columns
//      (Q from the resident shared Q tile, K streamed in chunks of 64 keys x SW columns);
//   2. the WN partials of a row group are exchanged through shared memory (fp32, named barriers);
//   3. online softmax in registers (exp2 with scale*log2e folded in), P kept in registers as the A operand;
//   4. O[WR x DW] += P V[:, its columns], V streamed in chunks like K.
// Shared memory per stage is O(1) in D (one chunk = 64 x SW halves); only O lives in registers.
//
// RM = 1 (16 rows per warp, the default; WN = 2 for D <= 512, 4 above): step 2 is an all-reduce: every
// warp sums all WN partials in a fixed order (bit-identical S in the group), one named barrier (two with a
// single exchange buffer), and every warp runs the softmax over all 64 keys of its 16 rows.
//
// RM = 2 (32 rows per warp; WN = 4 for D <= 512, 8 above, so DW <= 128): each ldmatrix'd K or V fragment
// feeds the MMAs of two m16 row tiles, halving the K/V shared-memory reads per FLOP. An all-reduce of the
// 32 x 64 partials would cost each warp (WN - 1) x 8 KiB of reads and eat the gain, so step 2-3 is a
// reduce-scatter: warp wn sums the WN partials of keys [wn * KS, wn * KS + KS) only (KS = 64 / WN: 16 or 8),
// scales/masks them and writes its slice row maxima (barrier A: partials written; B: maxima written); every
// warp then takes the group max (max is exact: all warps agree on m without shipping S), computes P of its
// slice and writes it as halves of m16n8k16 A fragments into the group's (now dead) partial space
// (barrier C), and reads back all of P. Row sums l stay per slice and are added over the group in the
// epilogue. The next tile's partials overwrite the P space only after the V chunk acquires (CTA barriers)
// that every warp reaches after reading its P. acc f16 keeps S in fp32 with RM = 2 (registers).
// Shared-memory traffic per warp and 64-key tile (reads + writes, D = 512; D = 1024 in brackets):
//   RM = 1: K 32 + V 32 + Q 8 + exchange 8 = 80 KiB [WN = 4: 32 + 32 + 8 + 20 = 92 KiB]
//   RM = 2: K 16 + V 16 + Q 8 + partials 8 + 8 + P 1 + 4 = 61 KiB [WN = 8: 16 + 16 + 8 + 16 + 4.5 = 60.5 KiB]
// for the same 2 x WR x 64 x DW x 2 = 1.05 MFLOP per warp; ldmatrix per 256 mma: 144 (RM = 1) vs 80 (RM = 2).
//
// Register budget (per thread, 256 threads, <= 255 regs, 1 CTA/SM):
//   RM = 1: O accumulators 16 * DW / 32 = DW / 2 fp32 -> 128 at DW = 256 (D = 512 with WN = 2, D = 1024
//   with WN = 4); S partial 16 x 64 / 32 = 32 fp32, P 16 regs (A fragments, reuse S's lifetime), +16
//   fp16x2 for acc f16, operand fragments 4 + 16, row stats 4, addressing ~20 => ~200; ptxas uses the rest
//   (185-250 in all) for ldmatrix prefetch.
//   RM = 2: O 32 * DW / 32 = DW fp32 -> 128 at DW = 128 (D = 512, WN = 4; D = 1024, WN = 8); S partial
//   32 x 64 / 32 = 64 fp32 during QK (dead after its store), then the slice 2 x KS / 8 x 4 <= 16 fp32 and
//   P 2 x 4 x 4 = 32 regs (PV); Q fragments 8, K/V fragment 4, row stats 8 => ~230 at the QK peak; ptxas:
//   243-255 regs. No spills in any instantiation (ffpa_attn/cuda/compile_check.py, -Xptxas -v).
// Shared memory: Q [BR x DPAD] (swizzled) + stages x chunk [64 x SW] + exchange.
//   RM = 1, exchange xbufs x [NW x 4 KiB]: D = 512 (BR = 64, SW = 256): 64 KiB + 4 x 32 KiB + 1 x 32 KiB
//   = 224 KiB (or 3 stages + 2 exchange buffers); D = 1024 (BR = 32, SW = 256): 64 + 4 x 32 + 1 x 32 = 224 KiB.
//   RM = 2, exchange NW x 8 KiB partials + NW x 128 B maxima: D = 512 (BR = 64) and D = 1024 (BR = 32):
//   64 + 3 x 32 + 65 = 225 KiB, so at most 3 stages on sm90 (227 KiB), 1 on sm80 (163 KiB).
//   One CTA-wide barrier per chunk.
// acc f16 (fp16 only): the MMAs accumulate in fp16 within one chunk (32 products of a dot product
// for S, 64 keys for O) and the chunk results are promoted into fp32 registers.
//
// Alignment: with vec16 (D % 8 == 0, 16-byte aligned rows/pointers) tiles are loaded with cp.async
// (zero-filled past Nq / Nkv / D); otherwise an element-wise synchronous path pads in shared memory.
// All global offsets are 64-bit. No headers are included: this file compiles with NVRTC as is.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct FfpaParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  i64 q_sb, q_sh, q_sn;  // element strides (D stride is 1)
  i64 k_sb, k_sh, k_sn;
  i64 v_sb, v_sh, v_sn;
  i64 o_sb, o_sh, o_sn;
  int nq, nkv, hq, group, d;
  int causal, causal_off, stages, xbufs, vec16;
  float scale_log2;  // softmax scale * log2(e)
  int cta_limit;     // CTAs whose linear index (x fastest, then y, z) is >= cta_limit exit at once
                     // (ffpa_attn/tail_split.py: the last partial wave runs as a split-KV launch instead)
};
static_assert(sizeof(FfpaParams) == 184, "FfpaParams layout must match ffpa_attn/cuda/launch.py");

struct alignas(16) U4 {
  u32 x, y, z, w;
};
struct alignas(16) F4 {
  float x, y, z, w;
};

#define FFPA_DEV __device__ __forceinline__

// ------------------------------------------------------------------------------------------- PTX helpers

FFPA_DEV u32 smem_u32(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

FFPA_DEV void cp_async16(u32 dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // src-size 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
FFPA_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
FFPA_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// wait until at most n (0..2) groups are pending; n is uniform (stages - 2)
FFPA_DEV void cp_async_wait_rt(int n) {
  if (n <= 0) {
    cp_async_wait<0>();
  } else if (n == 1) {
    cp_async_wait<1>();
  } else {
    cp_async_wait<2>();
  }
}

FFPA_DEV void bar_all() { asm volatile("bar.sync 0;" ::: "memory"); }
FFPA_DEV void bar_named(int id, int nthreads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory"); }

FFPA_DEV void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FFPA_DEV void ldsm_x4_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D[16x8] (+)= A[16x16] B[16x8], fp32 accumulators
template <bool BF16>
FFPA_DEV void mma_f32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// fp16 accumulators: c[0] = (row g, cols 2t, 2t+1), c[1] = (row g+8, ...)
FFPA_DEV void mma_f16(u32 (&c)[2], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%0, %1};"
      : "+r"(c[0]), "+r"(c[1])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

FFPA_DEV float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
FFPA_DEV float lg2(float x) {
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
FFPA_DEV float neg_inf() {
  float y;
  asm("mov.b32 %0, 0xff800000;" : "=f"(y));
  return y;
}
FFPA_DEV float fmax2(float a, float b) {
  float y;
  asm("max.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
FFPA_DEV float shfl_xor(float x, int m) {
  float y;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(y) : "f"(x), "r"(m));
  return y;
}

FFPA_DEV bool vote_any(bool pred) {
  u32 r;
  asm volatile("{ .reg .pred p; setp.ne.u32 p, %1, 0; vote.sync.any.pred p, p, 0xffffffff; selp.u32 %0, 1, 0, p; }"
               : "=r"(r)
               : "r"((u32)pred));
  return r != 0;
}

// two floats -> packed 16-bit pair, lo in the low half (cvt puts its first source in the high half)
template <bool BF16>
FFPA_DEV u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}
FFPA_DEV void unpack_h2(u32 x, float& lo, float& hi) {
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }"
      : "=f"(lo), "=f"(hi)
      : "r"(x));
}

// ------------------------------------------------------------------------------------------ tile geometry

template <int DPAD_, int WN_, int NW_, bool ACC16_, int CW_FORCE = 0, int RM_ = 1>
struct FfpaTile {
  static constexpr int DPAD = DPAD_;  // head dim padded to a multiple of 32 * WN
  static constexpr int WN = WN_;      // column groups (warps sharing a row block)
  static constexpr int NW = NW_;      // warps per CTA
  static constexpr int RM = RM_;      // m16 row tiles per warp (1: 16 rows, 2: 32 rows per warp)
  static constexpr int WM = NW / WN;  // row groups
  static constexpr int WR = 16 * RM;  // query rows per warp
  static constexpr int BR = WR * WM;  // query rows per CTA
  static constexpr int BC = 64;       // keys per tile
  static constexpr int DW = DPAD / WN;                   // O columns per warp
  // a warp's columns in one chunk: as wide as DW allows with chunks of <= 256 columns (32 KiB), so one
  // CTA-wide barrier covers 32-64 mma per warp; acc f16 keeps 32 (its fp16 partials need the registers
  // of the longer ldmatrix prefetch)
  static constexpr int CW = CW_FORCE ? CW_FORCE
                            : ACC16_ ? 32
                            : (DW % 128 == 0 && 128 * WN <= 256) ? 128
                            : (DW % 64 == 0 && 64 * WN <= 256)   ? 64
                                                                 : 32;
  static constexpr int SW = CW * WN;                     // chunk width (columns)
  static constexpr int NCH = DPAD / SW;                  // chunks per phase (K or V) per key tile
  static constexpr int NT = NW * 32;
  static constexpr int Q_BYTES = BR * DPAD * 2;
  static constexpr int CHUNK_BYTES = BC * SW * 2;
  static constexpr int X_FLOATS = NW * RM * 1024;        // one WR x 64 fp32 partial S per warp
  static constexpr int KS = BC / WN;                     // RM = 2: keys whose S sum/softmax a warp owns
  static constexpr int M_FLOATS = RM > 1 ? NW * WR : 0;  // RM = 2: per-warp row maxima of its key slice
  static_assert(DPAD % (32 * WN) == 0, "DPAD must be a multiple of 32 * WN");
  static_assert(NW % WN == 0 && WM >= 1 && WM <= 8, "bad warp grid");
  static_assert(RM == 1 || RM == 2, "16 or 32 rows per warp");
  static_assert(RM * DW <= 256, "O accumulators would exceed 128 fp32 registers per thread");
  static_assert(RM == 1 || (BC % WN == 0 && KS % 8 == 0), "RM = 2 splits the 64 keys into n8 slices per warp");
  static_assert(CW % 32 == 0 && DW % CW == 0, "a warp's columns must split into whole chunk pieces");
  static_assert((BR * DPAD / 8) % NT == 0 && (BC * SW / 8) % NT == 0, "tile loads must split evenly");
};

// Byte offset of element (row, col) in a row-major tile of ROW_BYTES-long rows (a multiple of 128): the
// 16-byte vectors of a row are XOR-swizzled with (row & 7), so the 8 row addresses of an ldmatrix phase and
// a warp's cp.async writes hit distinct banks.
template <int ROW_BYTES>
FFPA_DEV u32 swz(int row, int col) {
  static_assert(ROW_BYTES % 128 == 0, "swizzle needs 128-byte multiples");
  return (u32)(row * ROW_BYTES + ((((col >> 3) ^ (row & 7))) << 4) + ((col & 7) << 1));
}

// The rare path (D % 8 != 0 or unaligned rows): the tile element by element, synchronously. Out of line
// (one call per tile) so the hot loop carries none of its code.
__device__ __noinline__ void load_tile_slow(u32 s_base, int row_bytes, int rows, int cols, const u16* g, i64 stride,
                                            int row0, int nrows, int col0, int d, int tid, int nthreads) {
  const int vpr = cols / 8;
  for (int v = tid; v < rows * vpr; v += nthreads) {
    const int r = v / vpr;
    const int cv = v - r * vpr;
    const int gr = row0 + r;
    const int gc = col0 + cv * 8;
    u32 w[4] = {0u, 0u, 0u, 0u};
    if (gr < nrows) {
      const u16* row = g + (i64)gr * stride;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (gc + e < d) w[e >> 1] |= (u32)row[gc + e] << ((e & 1) * 16);
    }
    const u32 dst = s_base + (u32)(r * row_bytes + ((cv ^ (r & 7)) << 4));  // swz<row_bytes>(r, 8 * cv)
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                 "r"(w[3])
                 : "memory");
  }
}

// Copy rows [row0, row0 + ROWS) x cols [col0, col0 + COLS) of a row-major [n, d] matrix (row stride
// `stride` elements) into a swizzled shared tile; rows >= nrows and cols >= d read as zero.
// Fast path: 16-byte cp.async, each thread one fixed column vector and rows r0, r0 + RS, ... so the
// per-vector work is a pointer add, a compare and the copy.
template <int ROWS, int COLS, int NT>
FFPA_DEV void load_tile(u32 s_base, const u16* g, i64 stride, int row0, int nrows, int col0, int d, bool vec16,
                        int tid) {
  constexpr int VPR = COLS / 8;
  constexpr int NV = ROWS * VPR;
  static_assert(NV % NT == 0, "tile loads must split evenly");
  if (!vec16) {
    load_tile_slow(s_base, COLS * 2, ROWS, COLS, g, stride, row0, nrows, col0, d, tid, NT);
    return;
  }
  if constexpr (NT % VPR == 0) {
    constexpr int RS = NT / VPR;  // rows between one thread's vectors
    const int r0 = tid / VPR;
    const int cv = tid - r0 * VPR;
    const int gc = col0 + cv * 8;
    const bool col_ok = gc < d;
    const u16* src = g + (i64)(row0 + r0) * stride + gc;
    const i64 step = (i64)RS * stride;
#pragma unroll
    for (int i = 0; i < ROWS / RS; ++i) {
      const int r = r0 + i * RS;
      const bool ok = col_ok && row0 + r < nrows;
      cp_async16(s_base + swz<COLS * 2>(r, cv * 8), ok ? src : g, ok);
      src += step;
    }
  } else {
#pragma unroll
    for (int i = 0; i < NV / NT; ++i) {
      const int v = tid + i * NT;
      const int r = v / VPR;
      const int cv = v - r * VPR;
      const int gr = row0 + r;
      const int gc = col0 + cv * 8;
      const bool ok = gr < nrows && gc < d;
      cp_async16(s_base + swz<COLS * 2>(r, cv * 8), ok ? g + (i64)gr * stride + gc : g, ok);
    }
  }
}

// --------------------------------------------------------------------------------------------- the kernel

FFPA_DEV void st_shared_v2(u32 addr, u32 a, u32 b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(a), "r"(b) : "memory");
}
FFPA_DEV void ld_shared_v4(u32 (&r)[4], u32 addr) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

template <int DPAD, int WN, int NW, bool BF16, bool ACC16, int CW_FORCE, int RM>
FFPA_DEV void ffpa_fwd_body(const FfpaParams& p) {
  using T = FfpaTile<DPAD, WN, NW, ACC16, CW_FORCE, RM>;
  static_assert(!(BF16 && ACC16), "there is no bf16 mma with fp16 accumulators");
  extern __shared__ __align__(128) unsigned char smem[];

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / WN;
  const int wn = warp - wm * WN;
  const int g8 = lane >> 2;  // accumulator row within the 8-row half
  const int tq = lane & 3;   // accumulator column pair

  if (((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x >= p.cta_limit) return;
  const int qblocks = (p.nq + T::BR - 1) / T::BR;
  const int qb = p.causal ? (qblocks - 1 - (int)blockIdx.x) : (int)blockIdx.x;  // longest causal blocks first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = h / p.group;
  const int q0 = qb * T::BR;

  const u16* qg = static_cast<const u16*>(p.q) + (i64)b * p.q_sb + (i64)h * p.q_sh;
  const u16* kg = static_cast<const u16*>(p.k) + (i64)b * p.k_sb + (i64)hk * p.k_sh;
  const u16* vg = static_cast<const u16*>(p.v) + (i64)b * p.v_sb + (i64)hk * p.v_sh;

  const u32 s_q = smem_u32(smem);
  const u32 s_ring = s_q + T::Q_BYTES;
  float* xf = reinterpret_cast<float*>(smem + T::Q_BYTES + p.stages * T::CHUNK_BYTES);

  int n_tiles = (p.nkv + T::BC - 1) / T::BC;
  if (p.causal) {
    const int last_key = q0 + T::BR - 1 + p.causal_off;  // the block's last row sees keys <= last_key
    const int lim = last_key / T::BC + 1;
    n_tiles = n_tiles < lim ? n_tiles : lim;
  }
  const int total = n_tiles * 2 * T::NCH;  // chunks this CTA streams: per tile NCH of K, then NCH of V
  const bool vec16 = p.vec16 != 0;
  const int stages = p.stages;

  auto load_chunk = [&](int gi, int slot) {
    const int t = gi / (2 * T::NCH);
    const int r = gi - t * 2 * T::NCH;
    const bool is_v = r >= T::NCH;
    const int c = is_v ? r - T::NCH : r;
    load_tile<T::BC, T::SW, T::NT>(s_ring + slot * T::CHUNK_BYTES, is_v ? vg : kg, is_v ? p.v_sn : p.k_sn,
                                    t * T::BC, p.nkv, c * T::SW, p.d, vec16, tid);
  };

  // prologue: Q, then chunks 0 .. stages-2 (one commit group each; the first also carries Q)
  load_tile<T::BR, DPAD, T::NT>(s_q, qg, p.q_sn, q0, p.nq, 0, p.d, vec16, tid);
  if (stages == 1) {
    cp_async_commit();
  } else {
    for (int s = 0; s < stages - 1; ++s) {
      if (s < total) load_chunk(s, s);
      cp_async_commit();
    }
  }
  int rd_slot = 0;
  int wr_slot = stages - 1;

  // Make chunk g readable by every thread and prefetch chunk g + stages - 1 into the slot freed by g - 1.
  auto acquire = [&](int g) -> u32 {
    if (stages == 1) {
      bar_all();  // everyone is done with the single slot
      load_chunk(g, 0);
      cp_async_commit();
      cp_async_wait<0>();
      bar_all();
      return s_ring;
    }
    cp_async_wait_rt(stages - 2);
    bar_all();
    const int gn = g + stages - 1;
    if (gn < total) load_chunk(gn, wr_slot);
    cp_async_commit();
    wr_slot = (wr_slot + 1 == stages) ? 0 : wr_slot + 1;
    const u32 base = s_ring + rd_slot * T::CHUNK_BYTES;
    rd_slot = (rd_slot + 1 == stages) ? 0 : rd_slot + 1;
    return base;
  };

  float o[RM][T::NCH][T::CW / 8][4];
#pragma unroll
  for (int rm = 0; rm < RM; ++rm)
#pragma unroll
    for (int c = 0; c < T::NCH; ++c)
#pragma unroll
      for (int j = 0; j < T::CW / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[rm][c][j][e] = 0.f;
  float m_r[RM][2];  // running max (log2 domain), rows g8 and g8 + 8 of each row tile
  float l_r[RM][2];  // running sum of this thread's columns (RM = 2: of this warp's key slices)
#pragma unroll
  for (int rm = 0; rm < RM; ++rm)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m_r[rm][i] = neg_inf();
      l_r[rm][i] = 0.f;
    }
  const int row_w = wm * T::WR;  // this warp's first row within the CTA's block
  // acc f16 with 32 rows per warp: S accumulates in fp32 (its 32 fp16 partial registers would spill next
  // to 64 fp32 S and 128 O registers); P V still accumulates in fp16 per chunk
  constexpr bool S16 = ACC16 && RM == 1;
  const float scale_log2 = p.scale_log2;

  int g = 0;
  int xbuf = 0;
  for (int t = 0; t < n_tiles; ++t) {
    // ---- 1. partial S over this warp's D columns (each K fragment feeds RM row tiles)
    float s[RM][8][4];
#pragma unroll
    for (int rm = 0; rm < RM; ++rm)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[rm][j][e] = 0.f;
#pragma unroll 1
    for (int c = 0; c < T::NCH; ++c) {
      const u32 kb = acquire(g++);
      const int qcol0 = c * T::SW + wn * T::CW;
      u32 s16[RM][8][2];
      if constexpr (S16) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int j = 0; j < 8; ++j) s16[rm][j][0] = s16[rm][j][1] = 0u;
      }
#pragma unroll
      for (int kk = 0; kk < T::CW / 16; ++kk) {
        u32 a[RM][4];
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
          ldsm_x4(a[rm], s_q + swz<DPAD * 2>(row_w + rm * 16 + (lane & 15), qcol0 + kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          u32 bf[4];
          ldsm_x4(bf, kb + swz<T::SW * 2>(nn * 16 + (lane & 7) + ((lane >> 4) << 3),
                                          wn * T::CW + kk * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
          for (int rm = 0; rm < RM; ++rm) {
            if constexpr (S16) {
              mma_f16(s16[rm][2 * nn], a[rm], bf[0], bf[1]);
              mma_f16(s16[rm][2 * nn + 1], a[rm], bf[2], bf[3]);
            } else {
              mma_f32<BF16>(s[rm][2 * nn], a[rm], bf[0], bf[1]);
              mma_f32<BF16>(s[rm][2 * nn + 1], a[rm], bf[2], bf[3]);
            }
          }
        }
      }
      if constexpr (S16) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float x0, x1, x2, x3;
            unpack_h2(s16[rm][j][0], x0, x1);
            unpack_h2(s16[rm][j][1], x2, x3);
            s[rm][j][0] += x0;
            s[rm][j][1] += x1;
            s[rm][j][2] += x2;
            s[rm][j][3] += x3;
          }
      }
    }

    const int k0 = t * T::BC;
    const bool need_mask = (k0 + T::BC > p.nkv) || (p.causal && k0 + T::BC - 1 > q0 + p.causal_off);
    u32 pa[RM][4][4];  // P as m16n8k16 A fragments, one per 16 keys

    if constexpr (RM == 1) {
      // ---- 2. sum the WN partials of this row group (same order in every warp: identical S in the group)
      {
        float* xb = xf + xbuf * T::X_FLOATS;
        if (p.xbufs == 1 && t > 0) bar_named(1 + wm, WN * 32);  // partners are done reading the last partials
        F4* mine = reinterpret_cast<F4*>(xb + warp * 1024);
#pragma unroll
        for (int j = 0; j < 8; ++j) mine[j * 32 + lane] = F4{s[0][j][0], s[0][j][1], s[0][j][2], s[0][j][3]};
        bar_named(1 + wm, WN * 32);
        if constexpr (WN == 2) {
          // a + b == b + a exactly: both warps of the pair get bit-identical sums
          const F4* other = reinterpret_cast<const F4*>(xb + (wm * WN + (wn ^ 1)) * 1024);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const F4 x = other[j * 32 + lane];
            s[0][j][0] += x.x;
            s[0][j][1] += x.y;
            s[0][j][2] += x.z;
            s[0][j][3] += x.w;
          }
        } else {
          // fixed order ((p0 + p1) + p2) + ..., own partial re-read from shared memory (keeps s in place)
#pragma unroll
          for (int w2 = 0; w2 < WN; ++w2) {
            const F4* part = reinterpret_cast<const F4*>(xb + (wm * WN + w2) * 1024);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const F4 x = part[j * 32 + lane];
              if (w2 == 0) {
                s[0][j][0] = x.x;
                s[0][j][1] = x.y;
                s[0][j][2] = x.z;
                s[0][j][3] = x.w;
              } else {
                s[0][j][0] += x.x;
                s[0][j][1] += x.y;
                s[0][j][2] += x.z;
                s[0][j][3] += x.w;
              }
            }
          }
        }
        if (p.xbufs == 2) xbuf ^= 1;
      }

      // ---- 3. online softmax (log2 domain)
      // visible iff key <= lim(row) = min(Nkv - 1, row + Nkv - Nq [causal]); compared as the column offset
      // j * 8 + (e & 1) <= lim - k0 - 2 * tq, so the 32 key indices never occupy registers
      int lim_rel[2] = {0, 0};
      if (need_mask) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          int lim = p.nkv - 1;
          if (p.causal) {
            const int lc = q0 + row_w + i * 8 + g8 + p.causal_off;
            lim = lc < lim ? lc : lim;
          }
          lim_rel[i] = lim - k0 - 2 * tq;
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][j][e] *= scale_log2;
      if (need_mask) {  // only boundary tiles pay for the compares
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (j * 8 + (e & 1) > lim_rel[e >> 1]) s[0][j][e] = neg_inf();
      }
      float mx[2] = {m_r[0][0], m_r[0][1]};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmax2(mx[e >> 1], s[0][j][e]);
      float mu[2], alpha[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmax2(mx[i], shfl_xor(mx[i], 1));
        mx[i] = fmax2(mx[i], shfl_xor(mx[i], 2));
        mu[i] = (mx[i] == neg_inf()) ? 0.f : mx[i];  // a row with nothing visible yet: keep p = 0, no NaN
        alpha[i] = ex2(m_r[0][i] - mu[i]);
        m_r[0][i] = mx[i];
        l_r[0][i] *= alpha[i];
      }
      // rescale O only when some row of the warp got a new max (rare once the maxima settle)
      if (vote_any(alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int c = 0; c < T::NCH; ++c)
#pragma unroll
          for (int j = 0; j < T::CW / 8; ++j) {
            o[0][c][j][0] *= alpha[0];
            o[0][c][j][1] *= alpha[0];
            o[0][c][j][2] *= alpha[1];
            o[0][c][j][3] *= alpha[1];
          }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = ex2(s[0][j][0] - mu[0]);
        const float p1 = ex2(s[0][j][1] - mu[0]);
        const float p2 = ex2(s[0][j][2] - mu[1]);
        const float p3 = ex2(s[0][j][3] - mu[1]);
        l_r[0][0] += p0 + p1;
        l_r[0][1] += p2 + p3;
        pa[0][j >> 1][(j & 1) * 2 + 0] = pack2<BF16>(p0, p1);
        pa[0][j >> 1][(j & 1) * 2 + 1] = pack2<BF16>(p2, p3);
      }
    } else {
      // ---- 2'. reduce-scatter: warp wn of the group sums all WN partials for its KS keys only,
      //          [wn * KS, wn * KS + KS) of the tile, in the fixed order w2 = 0, 1, ... (one warp per key slice)
      constexpr int NJ = T::KS / 8;  // n8 tiles of this warp's key slice
      float* xg = xf + wm * WN * RM * 1024;  // the group's partials (later: its P fragments)
      float* mb = xf + T::X_FLOATS;          // per-warp row maxima [NW][WR]
      {
        F4* mine = reinterpret_cast<F4*>(xf + warp * RM * 1024);
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int j = 0; j < 8; ++j)
            mine[(rm * 8 + j) * 32 + lane] = F4{s[rm][j][0], s[rm][j][1], s[rm][j][2], s[rm][j][3]};
      }
      bar_named(1 + wm, WN * 32);  // A: the group's partials are written
      float sq[RM][NJ][4];
#pragma unroll
      for (int w2 = 0; w2 < WN; ++w2) {
        const F4* part = reinterpret_cast<const F4*>(xg + w2 * RM * 1024);
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) {
            const F4 x = part[(rm * 8 + wn * NJ + jj) * 32 + lane];
            if (w2 == 0) {
              sq[rm][jj][0] = x.x;
              sq[rm][jj][1] = x.y;
              sq[rm][jj][2] = x.z;
              sq[rm][jj][3] = x.w;
            } else {
              sq[rm][jj][0] += x.x;
              sq[rm][jj][1] += x.y;
              sq[rm][jj][2] += x.z;
              sq[rm][jj][3] += x.w;
            }
          }
      }
      // ---- 3'. scale, mask, slice row max -> shared -> group row max (max is exact: every warp of the
      //          group computes the same m), P of the slice -> shared as A-fragment halves -> all of P
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) sq[rm][jj][e] *= scale_log2;
      if (need_mask) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            int lim = p.nkv - 1;
            if (p.causal) {
              const int lc = q0 + row_w + rm * 16 + i * 8 + g8 + p.causal_off;
              lim = lc < lim ? lc : lim;
            }
            const int lim_rel = lim - k0 - wn * T::KS - 2 * tq;
#pragma unroll
            for (int jj = 0; jj < NJ; ++jj)
#pragma unroll
              for (int e = 2 * i; e < 2 * i + 2; ++e)
                if (jj * 8 + (e & 1) > lim_rel) sq[rm][jj][e] = neg_inf();
          }
      }
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = neg_inf();
#pragma unroll
          for (int jj = 0; jj < NJ; ++jj) mx = fmax2(mx, fmax2(sq[rm][jj][2 * i], sq[rm][jj][2 * i + 1]));
          mx = fmax2(mx, shfl_xor(mx, 1));
          mx = fmax2(mx, shfl_xor(mx, 2));
          if (tq == 0) mb[warp * T::WR + rm * 16 + i * 8 + g8] = mx;
        }
      bar_named(1 + wm, WN * 32);  // B: slice maxima written; everyone is done reading the partials
      float mu[RM][2], alpha[RM][2];
      bool rescale = false;
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float mx = m_r[rm][i];
#pragma unroll
          for (int w2 = 0; w2 < WN; ++w2) mx = fmax2(mx, mb[(wm * WN + w2) * T::WR + rm * 16 + i * 8 + g8]);
          mu[rm][i] = (mx == neg_inf()) ? 0.f : mx;
          alpha[rm][i] = ex2(m_r[rm][i] - mu[rm][i]);
          m_r[rm][i] = mx;
          l_r[rm][i] *= alpha[rm][i];
          rescale = rescale || alpha[rm][i] != 1.f;
        }
      if (vote_any(rescale)) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int c = 0; c < T::NCH; ++c)
#pragma unroll
            for (int j = 0; j < T::CW / 8; ++j) {
              o[rm][c][j][0] *= alpha[rm][0];
              o[rm][c][j][1] *= alpha[rm][0];
              o[rm][c][j][2] *= alpha[rm][1];
              o[rm][c][j][3] *= alpha[rm][1];
            }
      }
      // P fragments of the group: U4 [RM][4 kk][32 lanes] at xg (the partials are dead after barrier B);
      // n8 tile j of the tile's keys is half (j & 1) of fragment kk = j >> 1
      const u32 s_pg = smem_u32(xg);
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int jj = 0; jj < NJ; ++jj) {
          const float p0 = ex2(sq[rm][jj][0] - mu[rm][0]);
          const float p1 = ex2(sq[rm][jj][1] - mu[rm][0]);
          const float p2 = ex2(sq[rm][jj][2] - mu[rm][1]);
          const float p3 = ex2(sq[rm][jj][3] - mu[rm][1]);
          l_r[rm][0] += p0 + p1;
          l_r[rm][1] += p2 + p3;
          const int j = wn * NJ + jj;
          st_shared_v2(s_pg + (u32)(((rm * 4 + (j >> 1)) * 32 + lane) * 16 + (j & 1) * 8), pack2<BF16>(p0, p1),
                       pack2<BF16>(p2, p3));
        }
      bar_named(1 + wm, WN * 32);  // C: all of P written
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ld_shared_v4(pa[rm][kk], s_pg + (u32)(((rm * 4 + kk) * 32 + lane) * 16));
      // the next writes into xg (next tile's partials) come after this tile's V acquires (CTA barriers),
      // which every warp reaches only after reading its P here; mb is next written after barrier A of the
      // next tile, which follows every partner's reads of mb (they precede barrier C)
    }

    // ---- 4. O[:, this warp's columns] += P V (each V fragment feeds RM row tiles)
#pragma unroll
    for (int c = 0; c < T::NCH; ++c) {
      const u32 vb = acquire(g++);
      u32 o16[RM][T::CW / 8][2];
      if constexpr (ACC16) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int j = 0; j < T::CW / 8; ++j) o16[rm][j][0] = o16[rm][j][1] = 0u;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int nn = 0; nn < T::CW / 16; ++nn) {
          u32 bf[4];
          ldsm_x4_t(bf, vb + swz<T::SW * 2>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                            wn * T::CW + nn * 16 + (lane >> 4) * 8));
#pragma unroll
          for (int rm = 0; rm < RM; ++rm) {
            if constexpr (ACC16) {
              mma_f16(o16[rm][2 * nn], pa[rm][kk], bf[0], bf[1]);
              mma_f16(o16[rm][2 * nn + 1], pa[rm][kk], bf[2], bf[3]);
            } else {
              mma_f32<BF16>(o[rm][c][2 * nn], pa[rm][kk], bf[0], bf[1]);
              mma_f32<BF16>(o[rm][c][2 * nn + 1], pa[rm][kk], bf[2], bf[3]);
            }
          }
        }
      }
      if constexpr (ACC16) {
#pragma unroll
        for (int rm = 0; rm < RM; ++rm)
#pragma unroll
          for (int j = 0; j < T::CW / 8; ++j) {
            float x0, x1, x2, x3;
            unpack_h2(o16[rm][j][0], x0, x1);
            unpack_h2(o16[rm][j][1], x2, x3);
            o[rm][c][j][0] += x0;
            o[rm][c][j][1] += x1;
            o[rm][c][j][2] += x2;
            o[rm][c][j][3] += x3;
          }
      }
    }
  }

  // ---- epilogue: normalize, lse, stage O through the (now unused) Q tile, coalesced stores
  cp_async_wait<0>();
  bar_all();
  float l_tot[RM][2];
#pragma unroll
  for (int rm = 0; rm < RM; ++rm)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float l = l_r[rm][i];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      l_tot[rm][i] = l;
    }
  if constexpr (RM > 1) {
    // each warp summed its key slices only: add the group's WN slice sums (fixed order, same in every warp)
    if (tq == 0) {
#pragma unroll
      for (int rm = 0; rm < RM; ++rm)
#pragma unroll
        for (int i = 0; i < 2; ++i) xf[warp * T::WR + rm * 16 + i * 8 + g8] = l_tot[rm][i];
    }
    bar_all();
#pragma unroll
    for (int rm = 0; rm < RM; ++rm)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float l = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < WN; ++w2) l += xf[(wm * WN + w2) * T::WR + rm * 16 + i * 8 + g8];
        l_tot[rm][i] = l;
      }
  }
  float inv[RM][2];
#pragma unroll
  for (int rm = 0; rm < RM; ++rm)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float l = l_tot[rm][i];
      inv[rm][i] = l > 0.f ? 1.f / l : 0.f;
      const int row = q0 + row_w + rm * 16 + i * 8 + g8;
      if (wn == 0 && tq == 0 && row < p.nq) {
        const float lse = l > 0.f ? (m_r[rm][i] + lg2(l)) * 0.69314718055994531f : neg_inf();
        p.lse[((i64)b * p.hq + h) * p.nq + row] = lse;
      }
    }
#pragma unroll
  for (int rm = 0; rm < RM; ++rm)
#pragma unroll
    for (int c = 0; c < T::NCH; ++c)
#pragma unroll
      for (int j = 0; j < T::CW / 8; ++j) {
        const int col = c * T::SW + wn * T::CW + j * 8 + tq * 2;
        const int r0 = row_w + rm * 16 + g8;
        const u32 w0 = pack2<BF16>(o[rm][c][j][0] * inv[rm][0], o[rm][c][j][1] * inv[rm][0]);
        const u32 w1 = pack2<BF16>(o[rm][c][j][2] * inv[rm][1], o[rm][c][j][3] * inv[rm][1]);
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(s_q + swz<DPAD * 2>(r0, col)), "r"(w0) : "memory");
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(s_q + swz<DPAD * 2>(r0 + 8, col)), "r"(w1) : "memory");
      }
  bar_all();
  u16* og = static_cast<u16*>(p.o) + (i64)b * p.o_sb + (i64)h * p.o_sh;
  constexpr int VPR = DPAD / 8;
#pragma unroll
  for (int i = 0; i < T::BR * VPR / T::NT; ++i) {
    const int v = tid + i * T::NT;
    const int r = v / VPR;
    const int cv = v - r * VPR;
    const int gr = q0 + r;
    const int gc = cv * 8;
    if (gr >= p.nq || gc >= p.d) continue;
    const U4 val = *reinterpret_cast<const U4*>(smem + swz<DPAD * 2>(r, gc));
    u16* dst = og + (i64)gr * p.o_sn + gc;
    if (vec16) {
      *reinterpret_cast<U4*>(dst) = val;
    } else {
      const u32 w[4] = {val.x, val.y, val.z, val.w};
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (gc + e < p.d) dst[e] = (u16)(w[e >> 1] >> ((e & 1) * 16));
    }
  }
}

// One extern "C" entry point per instantiation (no name mangling: the launcher looks it up by name).
// CW = 0 picks the chunk width by FfpaTile's rule; a non-zero CW forces it (exploration only).
// RM = 1: 16 rows per warp, all-reduce exchange (the default); RM = 2: 32 rows per warp, reduce-scatter.
#define FFPA_DEFINE_KERNEL_RM(NAME, DPAD, WN, NW, BF16, ACC16, CW, RM)                          \
  extern "C" __global__ void __launch_bounds__((NW) * 32, 1) NAME(const FfpaParams p) {        \
    ffpa_fwd_body<(DPAD), (WN), (NW), (BF16) != 0, (ACC16) != 0, (CW), (RM)>(p);                \
  }
#define FFPA_DEFINE_KERNEL_CW(NAME, DPAD, WN, NW, BF16, ACC16, CW) \
  FFPA_DEFINE_KERNEL_RM(NAME, DPAD, WN, NW, BF16, ACC16, CW, 1)
#define FFPA_DEFINE_KERNEL(NAME, DPAD, WN, NW, BF16, ACC16) FFPA_DEFINE_KERNEL_CW(NAME, DPAD, WN, NW, BF16, ACC16, 0)

#ifdef FFPA_DPAD
#ifndef FFPA_CW
#define FFPA_CW 0
#endif
#ifndef FFPA_RM
#define FFPA_RM 1
#endif
FFPA_DEFINE_KERNEL_RM(ffpa_fwd, FFPA_DPAD, FFPA_WN, FFPA_NW, FFPA_BF16, FFPA_ACC16, FFPA_CW, FFPA_RM)
#endif

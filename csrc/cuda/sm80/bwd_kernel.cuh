// FlashAttention-2 backward on the mma.sync path (sm80 and newer).
//
// Three kernels per call, on one stream:
//   1. bwd_preprocess_kernel: D_i = rowsum(dO_i * O_i) (fp32), lse_i * log2(e)
//      (+inf for rows that saw no key, so their P is exactly 0), zeroes the
//      fp32 dQ accumulator and, in deterministic mode, the semaphores.
//   2. bwd_main_kernel: one thread block per (key tile of B_c rows, kv head,
//      batch). K_j, V_j are loaded to shared memory once; the block walks every
//      query tile i of every query head of its GQA group that can see the key
//      tile, recomputes P, and accumulates dV_j += P^T dO_i, dK_j += dS^T Q_i
//      in registers (fp32) for the whole walk; dQ_i += dS K_j is added to the
//      fp32 accumulator with red.global.add. dK/dV of a kv head are therefore
//      summed over its query heads without atomics, deterministically.
//   3. bwd_convert_dq_kernel: dq = softmax_scale * dQ accumulator, in dtype.
//
// Per query tile (S^T etc. are B_c x B_r; every warp owns a key slice, see
// bwd_config.h for the warp grid):
//   S^T  = K Q^T                       (mma, fp32)
//  [S^T  = softcap * tanh(S^T * scale / softcap) - slope * |query + Sk - Sq - key|
//         (kScoreMod: score units, the exp2 factor is log2e)]
//   P^T  = exp2(S^T * scale*log2e - lse_i*log2e), masked (keys >= Sk, outside
//          the window; edge tiles only)
//   dV  += P^T dO                      (P^T re-packed to 16 bit: from registers,
//                                       or through shared memory when the warps
//                                       sharing a key slice split the queries)
//   dP^T = V dO^T
//   dS^T = P^T * (dP^T - D_i)          -> shared memory (16 bit)
//         (softcap: times 1 - tanh^2, the derivative of the cap)
//   dK  += dS^T Q                      (scale applied once, at the end)
//   dQ_i = dS K                        -> red.global.add.f32 into dq_accum
// Two barriers per query tile (three when P^T is staged with one Q/dO buffer);
// Q_i+1/dO_i+1 stream in with cp.async under tile i.
//
// Loop-body variants of the staged path (config flags, bwd_config.h), same
// products and barriers in another order, chosen from the SASS: between the
// two barriers the 8 warps of a block (one block per SM) run the same phase,
// so non-mma work that sits alone between mma (the next tile's address math
// right after the first barrier, exp2 after S^T, the dS^T tail, the dQ
// atomics at the end) leaves the tensor pipes idle.
//   dpe: S^T, [mask on the exponent], dP^T, exp2 (scheduled under dP^T's mma),
//        P^T and dS^T stores;  dqe: dQ and its atomics first after the barrier,
//        then dV, dK;  pfs: the prefetch after S^T instead of before it;
//   hreg: dV/dK read only the other warp's half of P^T/dS^T from shared memory.
// Query rows past Sq load as zeros and their lse*log2e is +inf (padding of
// the workspace), so their P is 0 and they contribute nothing: only keys need
// an explicit tail mask.
//
// Head dimension: the kernels are compiled for a tile width D (Cfg::kHeadDim) and
// take the true head dimension p.headdim (a multiple of 8, <= D) at run time.
// Q, K, V, dO are loaded with the 16-byte chunks at or past p.headdim
// zero-filled (no address past it is formed, tiles.cuh), so every product over
// the D columns equals the product over the true ones and the columns past it
// of dK, dV, dQ come out 0; the stores of dK, dV, dq skip those columns, the
// preprocess reads only the true columns of O and dO. The dQ accumulator rows
// stay D wide (bwd_workspace_sizes with the tile width): the adds into it keep
// their compile-time offsets and no predicate, the columns past p.headdim just
// receive zeros that the convert kernel never reads. With p.headdim == D the
// extra work is one select per tile load and one compare per chunk stored.
//
// Deterministic mode: every key tile that visits query tile (head h, i) adds
// its dQ contribution in key-tile order. Tile n waits until
// dq_semaphore[b][h][i] == n - n_lo(i), adds, then increments it. The key tiles
// that see a query tile are a contiguous run n_lo(i)..n_hi(i) (the visible
// query range of a key tile moves monotonically with it, both bounds), n_lo(i)
// the tile of the first key row i*B_r's window reaches (0 without a left
// bound), so the count is exactly the number of earlier contributors; key tiles
// outside the run never touch the semaphore. Memory: one int
// per (batch, q head, query tile), O(Sq). Progress relies on blocks of one
// (batch, kv head) being dispatched in blockIdx.x order (key tile 0 first), as
// the hardware does: a waiting block only ever waits on lower-numbered blocks
// that are running or done. Query tiles are walked from the last one down:
// every key tile starts on the last query tile, which is also the first step
// of the key tile before it, so (causal or not) a key tile trails the previous
// one by about one step instead of waiting for it to sweep the diagonal.
//
// Without a GPU: defining FLASHOP_BWD_EMULATE compiles these kernels as host
// code on a CPU emulator of the instructions they use (bwd_emulate.cuh).

#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>

#include "../bwd_config.h"
#include "../bwd_params.h"
#include "../kernel_attributes.h"
#include "ptx.cuh"
#include "tiles.cuh"

#ifndef FLASHOP_BWD_EMULATE
#include <cuda_runtime.h>
#endif

namespace flashop {
namespace sm80 {
namespace bwd {

template <DType>
struct ElemOf;
template <>
struct ElemOf<DType::kFp16> {
  using type = __half;
};
template <>
struct ElemOf<DType::kBf16> {
  using type = __nv_bfloat16;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kAuxThreads = 256;  // preprocess and convert kernels

// bwd_main_kernel's instantiations (its kVar).
constexpr int kBwdDense = 0, kBwdLeft = 1, kBwdScoreMod = 2;

// tanh on the SFU (sm75+; max relative error 2^-10.99, fwd_kernel.cuh says what
// that means for a capped score), std::tanh on the emulator.
// log2 on the SFU (lg2.approx.ftz: log2(0) = -inf), std::log2 on the emulator.
constexpr float kLn2 = 0.6931471805599453f;
#ifdef FLASHOP_BWD_EMULATE
inline float tanh_approx(float x) { return std::tanh(x); }
inline float log2_approx(float x) { return std::log2(x); }
#else
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// Preprocess: a group of kLanes threads (power of two, <= 32, so a group never
// straddles a warp) reduces one row of D/8 16-byte chunks. Each group takes kRowsPerThread rows kGroups apart,
// their loads issued together: more bytes in flight per thread and fewer, longer blocks.
template <int D>
struct RowGroup {
  static constexpr int kChunks = D / 8;
  static constexpr int kLanes = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kGroups = kAuxThreads / kLanes;
  static constexpr int kRowsPerThread = kBwdSeqQPad / kGroups < 4 ? kBwdSeqQPad / kGroups : 4;
  static constexpr int kRowsPerBlock = kGroups * kRowsPerThread;
  static_assert(kBwdSeqQPad % kRowsPerBlock == 0, "preprocess blocks must tile the padded rows");
};

// Shared-memory map of the main kernel (byte offsets, all 128-byte aligned).
template <class Cfg>
struct BwdSmem {
  using KVTile = SmemTile<Cfg::kBlockN, Cfg::kHeadDim>;  // K, V: [key][d]
  using QTile = SmemTile<Cfg::kBlockM, Cfg::kHeadDim>;   // Q, dO: [query][d]
  using STile = SmemTile<Cfg::kBlockN, Cfg::kBlockM>;    // dS^T, P^T: [key][query]
  static constexpr uint32_t kK = 0;
  static constexpr uint32_t kV = kK + KVTile::kBytes;
  static constexpr uint32_t kQ = kV + KVTile::kBytes;
  static constexpr uint32_t kDO = kQ + Cfg::kStages * QTile::kBytes;
  static constexpr uint32_t kDS = kDO + Cfg::kStages * QTile::kBytes;
  static constexpr uint32_t kPT = kDS + STile::kBytes;
  static constexpr uint32_t kLse = kPT + (Cfg::kStagePT ? STile::kBytes : 0);
  static constexpr uint32_t kDsum = kLse + Cfg::kStages * Cfg::kBlockM * 4;
  static constexpr uint32_t kBytes = kDsum + Cfg::kStages * Cfg::kBlockM * 4;
  static_assert(kBytes == Cfg::kSmemBytes, "bwd_smem_bytes_for() and the kernel's map disagree");
};

// ---------------------------------------------------------------------------
// Warp-level products. Accumulators c[i][j] are m16n8 tiles; "KT"/"MT" count
// m16 row tiles, "NT"/"NQ"/"ND" n8 column tiles. Operands are addressed from
// lane bases (tiles.cuh); the n8 tiles of a warp come in pairs, pair np at
// a compile-time row/chunk step from the base (warps interleave: pair np of
// warp w covers columns 16*(w + warps*np), so the warp's own part stays in
// the base register and np only adds disjoint bits).

// c += A B^T, k over K. A: KT m16 tiles from a_base (tile [row][k], "a"
// pattern, rows +16 per tile). B^T: n-tile pairs from b_base (tile [n][k],
// "b" pattern, rows +kBRowStep per pair). S^T = K Q^T and dP^T = V dO^T.
template <int KT, int NT, int K, int kBRowStep, class TileA, class TileB, typename Elem>
FLASHOP_SM80_DEV void gemm_nt(float (&c)[KT][NT][4], uint32_t a_base, uint32_t b_base) {
  static_assert(NT % 2 == 0, "n8 tiles come in pairs");
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    uint32_t a[KT][4];
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) ldmatrix_x4(a[mt], TileA::at(a_base, 16 * mt, 2 * kc));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, TileB::at(b_base, kBRowStep * np, 2 * kc));
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
        mma_16816<Elem>(c[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<Elem>(c[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// c[mt][n] += a[mt] B for every n8 tile of one k16 row block of B (tile [k][n] at row `row`, read
// with .trans in n-tile pairs, chunks +kBChunkStep per pair): the inner step of gemm_rb, gemm_sb,
// gemm_half_regs and gemm_tb.
template <int KT, int ND, int kBChunkStep, class TileB, typename Elem>
FLASHOP_SM80_DEV void mma_row_of_b(float (&c)[KT][ND][4], const uint32_t (&a)[KT][4], uint32_t b_base, int row) {
  static_assert(ND % 2 == 0, "n8 tiles come in pairs");
#pragma unroll
  for (int np = 0; np < ND / 2; ++np) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, TileB::at(b_base, row, kBChunkStep * np));
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      mma_16816<Elem>(c[mt][2 * np], a[mt], b[0], b[1]);
      mma_16816<Elem>(c[mt][2 * np + 1], a[mt], b[2], b[3]);
    }
  }
}

// c += A B with A in registers: the fp32 accumulators of a product whose
// columns are this product's k (P^T or dS^T over all B_r queries, in order),
// re-packed to 16 bit. An m16n8 accumulator pair (columns 16kq..16kq+15) is
// exactly one m16k16 A fragment: a0 = tile 2kq rows g, a1 = tile 2kq rows g+8,
// a2/a3 = tile 2kq+1. B: n-tile pairs from b_base (tile [k][n], "a" pattern,
// .trans), chunks +kBChunkStep per pair.
template <int KT, int NQ, int ND, int kBChunkStep, class TileB, typename Elem>
FLASHOP_SM80_DEV void gemm_rb(float (&c)[KT][ND][4], const float (&a)[KT][NQ][4], uint32_t b_base) {
  static_assert(NQ % 2 == 0 && ND % 2 == 0, "n8 tiles come in pairs");
#pragma unroll
  for (int kq = 0; kq < NQ / 2; ++kq) {
    uint32_t af[KT][4];
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) {
      af[mt][0] = pack2<Elem>(a[mt][2 * kq][0], a[mt][2 * kq][1]);
      af[mt][1] = pack2<Elem>(a[mt][2 * kq][2], a[mt][2 * kq][3]);
      af[mt][2] = pack2<Elem>(a[mt][2 * kq + 1][0], a[mt][2 * kq + 1][1]);
      af[mt][3] = pack2<Elem>(a[mt][2 * kq + 1][2], a[mt][2 * kq + 1][3]);
    }
    mma_row_of_b<KT, ND, kBChunkStep, TileB, Elem>(c, af, b_base, 16 * kq);
  }
}

// c += A B, k over K. A: KT m16 tiles from a_base (tile [row][k], "a"
// pattern, plain). B: n-tile pairs from b_base (tile [k][n], "a" pattern,
// .trans), chunks +kBChunkStep per pair. dV += P^T dO and dK += dS^T Q when
// P^T/dS^T are staged in shared memory.
template <int KT, int K, int ND, int kBChunkStep, class TileA, class TileB, typename Elem>
FLASHOP_SM80_DEV void gemm_sb(float (&c)[KT][ND][4], uint32_t a_base, uint32_t b_base) {
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    uint32_t a[KT][4];
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) ldmatrix_x4(a[mt], TileA::at(a_base, 16 * mt, 2 * kc));
    mma_row_of_b<KT, ND, kBChunkStep, TileB, Elem>(c, a, b_base, 16 * kc);
  }
}

// c += A B over the B_r queries of a key slice shared by two warps (kWarpsD
// == 2), A = the slice's P^T or dS^T: the warp's own query blocks (16 wide,
// at 16*(wd + 2j)) from registers, own[mt][j] being the 16-bit accumulators of
// its S^T-shaped product (an m16k16 A fragment, see gemm_rb), the other warp's
// (at 16*(1 - wd + 2j)) through ldmatrix from the staged tile (a_oth: "a"
// pattern at the other warp's chunk, chunks +4j). B: tile [query][n], .trans,
// rows +32j from b_own / b_oth, chunks +kBChunkStep per pair. Half the A
// fragments of gemm_sb's ldmatrix.
template <int KT, int NJ, int ND, int kBChunkStep, class TileA, class TileB, typename Elem>
FLASHOP_SM80_DEV void gemm_half_regs(float (&c)[KT][ND][4], const uint32_t (&own)[KT][NJ][4], uint32_t a_oth,
                                    uint32_t b_own, uint32_t b_oth) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    uint32_t a[KT][4];
#pragma unroll
    for (int mt = 0; mt < KT; ++mt)
#pragma unroll
      for (int r = 0; r < 4; ++r) a[mt][r] = own[mt][j][r];
    mma_row_of_b<KT, ND, kBChunkStep, TileB, Elem>(c, a, b_own, 32 * j);
#pragma unroll
    for (int mt = 0; mt < KT; ++mt) ldmatrix_x4(a[mt], TileA::at(a_oth, 16 * mt, 4 * j));
    mma_row_of_b<KT, ND, kBChunkStep, TileB, Elem>(c, a, b_oth, 32 * j);
  }
}

// c += A B, k over K rows. A: the transpose of a tile stored [k][m] ("b"
// pattern, .trans), m16 tile mt at chunk +kAChunkStep*mt. B: n-tile pairs
// from a tile stored [k][n] ("a" pattern, .trans), chunk +kBChunkStep per
// pair. dQ = dS K from dS^T and K.
template <int MT, int NT, int K, int kAChunkStep, int kBChunkStep, class TileA, class TileB, typename Elem>
FLASHOP_SM80_DEV void gemm_tb(float (&c)[MT][NT][4], uint32_t a_base, uint32_t b_base) {
#pragma unroll
  for (int kc = 0; kc < K / 16; ++kc) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4_trans(a[mt], TileA::at(a_base, 16 * kc, kAChunkStep * mt));
    mma_row_of_b<MT, NT, kBChunkStep, TileB, Elem>(c, a, b_base, 16 * kc);
  }
}

template <int A, int B, int C>
FLASHOP_SM80_DEV void zero(float (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) x[i][j][k] = 0.f;
}

// ---------------------------------------------------------------------------
// 1. Preprocess. Grid (seqlen_q_rounded / rows per block, heads_q, batch).
template <class Cfg>
FLASHOP_SM80_GLOBAL void FLASHOP_SM80_LAUNCH_BOUNDS(kAuxThreads, 1) bwd_preprocess_kernel(const BwdParams p) {
  using Elem = typename ElemOf<Cfg::kDType>::type;
  constexpr int D = Cfg::kHeadDim;
  using G = RowGroup<D>;
  const int tid = thread_x();
  const int r = tid / G::kLanes, c = tid % G::kLanes;
  const int row0 = block_x() * G::kRowsPerBlock + r;  // the group's rows: row0 + kGroups i
  const int hq = block_y(), b = block_z();

  if (p.deterministic && block_x() == 0) {
    int* sem = p.dq_semaphore + (int64_t(b) * p.heads_q + hq) * p.num_m_blocks;
    for (int i = tid; i < p.num_m_blocks; i += kAuxThreads) sem[i] = 0;
  }
  // Packed: sequence b's used rows from q_start; its workspace rows from row_base, round_up(len, 128) of
  // them (the blocks past them belong to the next sequence).
  int seqlen_q = p.seqlen_q, q_start = 0;
  int64_t row_base = (int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded;
  if (p.packed.packed()) {
    const SequenceBounds sq = sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, b, p.packed.total_q,
                                              p.seqlen_q);
    if (block_x() * G::kRowsPerBlock >= bwd_round_up(sq.len, kBwdSeqQPad)) return;
    seqlen_q = sq.used;
    q_start = sq.start;
    row_base = hq * bwd_packed_ws_rows(p.packed.total_q, p.batch) + bwd_packed_ws_row0(sq.start, b);
  }

  // Only the true head dimension's chunks (p.headdim <= D, so this also bounds c by kChunks); rows past Sq
  // and chunks past the head dimension read as zeros.
  constexpr int R = G::kRowsPerThread;
  uint4 ov[R], dv[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = row0 + G::kGroups * i;
    ov[i] = dv[i] = uint4{0u, 0u, 0u, 0u};
    if (row < seqlen_q && c * 8 < p.headdim) {
      ov[i] = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.out) + b * p.o_batch_stride +
                                              (int64_t(q_start) + row) * p.o_row_stride + hq * p.o_head_stride + c * 8);
      dv[i] = *reinterpret_cast<const uint4*>(static_cast<const Elem*>(p.dout) + b * p.do_batch_stride +
                                              (int64_t(q_start) + row) * p.do_row_stride + hq * p.do_head_stride +
                                              c * 8);
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const uint32_t ow[4] = {ov[i].x, ov[i].y, ov[i].z, ov[i].w};
    const uint32_t dw[4] = {dv[i].x, dv[i].y, dv[i].z, dv[i].w};
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 a = unpack2<Elem>(ow[j]), e = unpack2<Elem>(dw[j]);
      sum += a.x * e.x + a.y * e.y;
    }
#pragma unroll
    for (int off = G::kLanes / 2; off > 0; off >>= 1) sum += shfl_xor(sum, off);
    if (c == 0) {  // row < seqlen_q_rounded: the grid tiles the padded rows exactly
      const int row = row0 + G::kGroups * i;
      const bool in = row < seqlen_q;
      p.dsum[row_base + row] = in ? sum : 0.f;
      const float l = in ? p.lse[b * p.lse_batch_stride + hq * p.lse_head_stride + q_start + row] : -INFINITY;
      // A row that saw no key has lse = -inf; +inf here makes its P = exp2(x - inf) = 0.
      p.lse_log2[row_base + row] = (l == -INFINITY) ? INFINITY : l * kLog2e;
    }
  }

  // Zero this block's rows of the dQ accumulator (the main kernel adds into it), all D columns: its
  // rows are D wide whatever the true head dimension (columns past it receive adds of 0).
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + (row_base + int64_t(block_x()) * G::kRowsPerBlock) * D);
  constexpr int kVecs = G::kRowsPerBlock * D / 4;
  const float4 z = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int i = tid; i < kVecs; i += kAuxThreads) acc[i] = z;
}

// ---------------------------------------------------------------------------
// 2. Main kernel. Grid (ceil(Sk / B_c), heads_k, batch); key tile fastest.
// kVar: kBwdDense (no left window bound, softcap or ALiBi), kBwdLeft (a left
// window bound), kBwdScoreMod (softcap or ALiBi, any window). Three
// instantiations: the left bound alone grows the masked path by 10-25% of the
// loop's instructions, the score modifications make the d64 loop spill, and
// sliding-window attention should pay for neither.
// kPacked (with kBwdScoreMod only, one more instantiation): a packed batch (p.packed,
// csrc/packed_sequences.h); b is the sequence, Sq and Sk below its used rows, the pointers start at its
// first rows, its workspace rows are bwd_packed_ws_row0's, and dK/dV rows it owns past seqused_k are
// written as zeros (their keys are masked: P = dS = 0).
template <class Cfg, int kVar, bool kPacked = false>
FLASHOP_SM80_GLOBAL void FLASHOP_SM80_LAUNCH_BOUNDS(Cfg::kThreads, 1) bwd_main_kernel(const BwdParams p) {
  static_assert(!kPacked || kVar == kBwdScoreMod, "packed batches run on the kBwdScoreMod instantiation");
  using Elem = typename ElemOf<Cfg::kDType>::type;
  using L = BwdSmem<Cfg>;
  using KVTile = typename L::KVTile;
  using QTile = typename L::QTile;
  using STile = typename L::STile;
  constexpr int N = Cfg::kBlockN, M = Cfg::kBlockM, D = Cfg::kHeadDim, T = Cfg::kThreads;
  constexpr int WD = Cfg::kWarpsD, WMQ = Cfg::kWarpsMdQ, WDQ = Cfg::kWarpsDdQ;
  constexpr int KT = Cfg::kKeyTiles;               // m16 key tiles per warp
  constexpr int NQ = Cfg::kQueriesPerWarp / 8;     // n8 query tiles of the warp's S^T
  constexpr int ND = Cfg::kDimsPerWarp / 8;        // n8 head-dim tiles of the warp's dK/dV
  constexpr int MTQ = Cfg::kRowsPerWarpdQ / 16;    // m16 query tiles of the warp's dQ
  constexpr int NTQ = Cfg::kColsPerWarpdQ / 8;     // n8 head-dim tiles of the warp's dQ
  static_assert(Cfg::kStagePT || NQ * 8 == M, "unstaged P^T needs each warp to hold all queries");
  static_assert(2 * (M / 4) <= T, "one 16-byte lse/D chunk per thread");
  static_assert(L::kK % 128 == 0 && L::kV % 128 == 0 && L::kQ % 128 == 0 && L::kDO % 128 == 0 &&
                    L::kDS % 128 == 0 && L::kPT % 128 == 0 && L::kLse % 128 == 0 && L::kDsum % 128 == 0,
                "tiles must start 128-byte aligned (the swizzled addressing XORs bits 4-6)");

  FLASHOP_SM80_DYNAMIC_SMEM(smem);
  const int tid = thread_x();
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma fragment row group / column pair
  int n_block = block_x(), hk = block_y(), b = block_z();
  if constexpr (Cfg::kLongestFirst) {
    if (p.causal) {  // lpt: the block's dispatch index (x fastest) read as (group, key tile, pair)
      const int64_t n_tiles = (p.seqlen_k + N - 1) / N;
      const int64_t pairs = int64_t(p.heads_k) * p.batch;
      const int64_t index = block_x() + n_tiles * (block_y() + int64_t(p.heads_k) * block_z());
      // Q and dO (16-bit) and the fp32 dQ accumulator rows of the pair's query heads.
      const int64_t pair_bytes = int64_t(p.seqlen_q_rounded) * D * p.head_ratio * 8;
      const int64_t group_pairs = bwd_lpt_group_pairs(p.sm_count, int(n_tiles), p.l2_bytes, pair_bytes);
      const int64_t group = index / (group_pairs * n_tiles);
      const int64_t first = group * group_pairs;
      const int64_t in_group = pairs - first < group_pairs ? pairs - first : group_pairs;
      const int64_t within = index - first * n_tiles;
      const int64_t pair = first + within % in_group;
      n_block = int(within / in_group);
      hk = int(pair % p.heads_k);
      b = int(pair / p.heads_k);
    }
  }
  const int key0 = n_block * N;

  // The sequence: used query rows seqlen_q from q_start, used keys seqlen_k from k_start of the k_len it
  // owns; ws_base(hq): workspace row of its first query (dense: the batch entry's).
  // (Accessors: the dense instantiations read p at each use, as ptxas schedules best; a value held
  // across the loop costs the kBwdScoreMod d64 kernel a spill slot.)
  int used_q = 0, used_k = 0, len_k = 0;
  int64_t q_start = 0, k_start = 0, ws_row0 = 0, ws_head_rows = 0;
  auto seqlen_q = [&]() -> int { if constexpr (kPacked) return used_q; else return p.seqlen_q; };
  auto seqlen_k = [&]() -> int { if constexpr (kPacked) return used_k; else return p.seqlen_k; };
  auto k_len = [&]() -> int { if constexpr (kPacked) return len_k; else return p.seqlen_k; };
  if constexpr (kPacked) {
    const SequenceBounds sq = sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, b, p.packed.total_q,
                                              p.seqlen_q);
    const SequenceBounds sk = sequence_bounds(p.packed.cu_seqlens_k, p.packed.seqused_k, b, p.packed.total_k,
                                              p.seqlen_k);
    if (key0 >= sk.len) return;  // the rows belong to the next sequence
    used_q = sq.used;
    used_k = sk.used;
    len_k = sk.len;
    q_start = sq.start;
    k_start = sk.start;
    ws_row0 = bwd_packed_ws_row0(sq.start, b);
    ws_head_rows = bwd_packed_ws_rows(p.packed.total_q, p.batch);
  }
  auto ws_base = [&](int hq) -> int64_t {
    if constexpr (kPacked) return ws_row0 + hq * ws_head_rows;
    return (int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded;
  };

  // Warp roles (bwd_config.h). S^T / dK / dV: warp (wn, wd) owns keys
  // [key_row0, key_row0 + kKeysPerWarp); with kWarpsD > 1 the n8-tile pairs of
  // its queries and head dims are interleaved with the other wd: pair np
  // covers columns 16*(wd + kWarpsD*np) .. +16. dQ: warp (wqm, wqd) owns m16
  // query tiles 16*(wqm + kWarpsMdQ*mt) and head-dim pairs 16*(wqd + kWarpsDdQ*np).
  const int wn = WD == 1 ? warp : warp % Cfg::kWarpsN;
  const int wd = WD == 1 ? 0 : warp / Cfg::kWarpsN;
  const int wqm = warp % WMQ, wqd = warp / WMQ;
  const int key_row0 = wn * Cfg::kKeysPerWarp;

  // Query tiles that can see this key tile. Query i sees key j iff
  // left_off <= j - i <= right_off (has_left / has_right; causal is
  // right_off = diag). The first query that sees key0 is key0 - right_off, the
  // last that sees the tile's last key is key_last - left_off, and the queries
  // between see some key of the tile: the visible tiles are [m_first, m_stop).
  const int diag = seqlen_k() - seqlen_q();
  const bool has_right = p.causal || p.variants.window_right >= 0;
  const int right_off = diag + (p.causal ? 0 : p.variants.window_right);
  const bool has_left = kVar != kBwdDense && p.variants.window_left >= 0;
  const int left_off = diag - p.variants.window_left;
  const int m_tiles = (seqlen_q() + M - 1) / M;
  int m_first = 0, m_stop = m_tiles;
  if constexpr (kPacked) {
    if (key0 >= seqlen_k()) m_stop = 0;  // keys past seqused_k: an empty walk, zero dK and dV
  }
  if (has_right) {
    const int i_min = key0 - right_off;
    m_first = i_min <= 0 ? 0 : (i_min >= seqlen_q() ? m_tiles : i_min / M);
  }
  if (has_left) {
    const int key_last = (key0 + N < seqlen_k() ? key0 + N : seqlen_k()) - 1;
    const int i_max = key_last - left_off;
    m_stop = i_max < 0 ? 0 : (i_max >= seqlen_q() ? m_tiles : i_max / M + 1);
  }
  const int per_head = m_stop > m_first ? m_stop - m_first : 0;
  // kScoreMod: S^T moves to score units (softcap or ALiBi), whose exp2 factor is log2(e).
  constexpr bool kScoreMod = kVar == kBwdScoreMod;
  const float softcap = kScoreMod ? p.variants.softcap : 0.f;
  const float cap_in = softcap > 0.f ? p.scale / softcap : 0.f;
  const bool alibi = kScoreMod && p.variants.alibi_slopes != nullptr;
  const bool score_units = kScoreMod && (softcap > 0.f || alibi);
  const float exp_scale = score_units ? kLog2e : p.scale_log2;
  // softcap: the derivative of the cap, 1 - tanh^2, for element e of accumulator [mt][nq] (key and
  // query as in the mask below), recovered from its P = exp2(score * log2e - lse_log2) rather than
  // kept from the forward pass over S^T (a register array as large as S^T, which spills):
  // softcap * tanh = score + slope * distance, score = (log2(P) + lse_log2) * ln 2. tanh is clamped
  // to [-1, 1]: P = 0 (masked keys, rows past Sq, underflow) gives -1, a factor 0, and dS = 0 as it
  // must be. log2(P) is exact to 2^-22 absolute, tanh to about that over softcap.
  const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
  auto cap_derivative = [&](float pv, float l2, int mt, int nq, int e, int q0, float slope) {
    float capped = (log2_approx(pv) + l2) * kLn2;
    if (alibi) {
      const int key = key0 + key_row0 + 16 * mt + g + 8 * (e >> 1);
      const int query = q0 + 16 * wd + 2 * t + 16 * WD * (nq >> 1) + 8 * (nq & 1) + (e & 1);
      capped = fmaf(slope, fabsf(float(query + diag - key)), capped);
    }
    const float th = fminf(fmaxf(capped * inv_cap, -1.f), 1.f);
    return fmaf(-th, th, 1.f);
  };
  const int total = per_head * p.head_ratio;  // steps: query heads of the group x visible tiles

  const uint32_t s0 = smem_u32(smem);
  const uint32_t uK = s0 + L::kK, uV = s0 + L::kV, uQ = s0 + L::kQ, uDO = s0 + L::kDO;
  const uint32_t uLse = s0 + L::kLse, uDsum = s0 + L::kDsum;
  constexpr uint32_t kVfromK = L::kV - L::kK, kDOfromQ = L::kDO - L::kQ, kPTfromDS = L::kPT - L::kDS;
  constexpr uint32_t kDsumFromLse = L::kDsum - L::kLse;

  // Lane bases (tiles.cuh), one per operand role.
  const uint32_t baseK_a = lane_base_a<KVTile>(uK, key_row0, 0, lane);      // A of S^T (+V: dP^T)
  const uint32_t offQ_b = lane_base_b<QTile>(0, 16 * wd, 0, lane);          // B of S^T, dP^T
  const uint32_t offQ_t = lane_base_a<QTile>(0, 0, 2 * wd, lane);           // B of dV, dK (.trans)
  const uint32_t baseS_a = lane_base_a<STile>(s0 + L::kDS, key_row0, 0, lane);   // A of staged dV, dK
  const uint32_t baseS_c = lane_base_c<STile>(s0 + L::kDS, key_row0, 2 * wd, lane);  // dS^T/P^T stores
  const uint32_t baseS_t = lane_base_b<STile>(s0 + L::kDS, 0, 2 * wqm, lane);   // A of dQ (.trans)
  const uint32_t baseK_t = lane_base_a<KVTile>(uK, 0, 2 * wqd, lane);          // B of dQ (.trans)
  const uint32_t offLse = uint32_t(16 * wd + 2 * t) * 4;                     // lse/D of column pair np
  // hreg (kWarpsD == 2): the other warp of the key slice holds query blocks
  // 16*(1 - wd + 2j); B of dV/dK for the warp's own blocks 16*(wd + 2j) and
  // for the other's, A (staged P^T/dS^T) for the other's.
  const int wo = WD == 2 ? 1 - wd : 0;
  const uint32_t offQ_own = lane_base_a<QTile>(0, 16 * wd, 2 * wd, lane);
  const uint32_t offQ_oth = lane_base_a<QTile>(0, 16 * wo, 2 * wd, lane);
  const uint32_t baseS_o = lane_base_a<STile>(s0 + L::kDS, key_row0, 2 * wo, lane);

  // K_j, V_j: once, for the whole walk.
  const Elem* gK = static_cast<const Elem*>(p.k) + b * p.k_batch_stride + k_start * p.k_row_stride +
                   hk * p.k_head_stride;
  const Elem* gV = static_cast<const Elem*>(p.v) + b * p.v_batch_stride + k_start * p.v_row_stride +
                   hk * p.v_head_stride;
  load_tile_async<KVTile, T>(uK, gK, p.k_row_stride, key0, seqlen_k(), p.headdim, tid);
  load_tile_async<KVTile, T>(uV, gV, p.v_row_stride, key0, seqlen_k(), p.headdim, tid);
  cp_async_commit();

  // Steps walk (query head of the group, query tile), tiles from the last one
  // down: step it+1 of (hq, m) is (hq, m-1), or (hq+1, last tile) after m_first.
  // qup (not deterministic): upward from m_start, wrapping from the last tile
  // to m_first; the next head starts when the walk is back at m_start.
  const bool walk_up = Cfg::kWalkUp && !p.deterministic;
  const int m_start =
      !walk_up ? m_stop - 1 : m_first + (has_right || has_left || per_head == 0 ? 0 : n_block % per_head);
  auto advance = [&](int& hq, int& m) {
    if constexpr (Cfg::kWalkUp) {
      if (walk_up) {
        m = m + 1 == m_stop ? m_first : m + 1;
        if (m == m_start) ++hq;
        return;
      }
    }
    if (m > m_first) {
      --m;
    } else {
      ++hq;
      m = m_stop - 1;
    }
  };
  // Q_i, dO_i (zero rows past Sq) and lse_log2/D of tile (hq, m) into `stage`.
  const Elem* gQ0 = static_cast<const Elem*>(p.q) + b * p.q_batch_stride + q_start * p.q_row_stride;
  const Elem* gDO0 = static_cast<const Elem*>(p.dout) + b * p.do_batch_stride + q_start * p.do_row_stride;
  auto load_step = [&](int hq, int m, int stage) {
    const int row0 = m * M;
    load_tile_async<QTile, T>(uQ + stage * QTile::kBytes, gQ0 + hq * p.q_head_stride, p.q_row_stride, row0,
                              seqlen_q(), p.headdim, tid);
    load_tile_async<QTile, T>(uDO + stage * QTile::kBytes, gDO0 + hq * p.do_head_stride, p.do_row_stride, row0,
                              seqlen_q(), p.headdim, tid);
    // The workspaces are padded to kBwdSeqQPad rows: the whole tile is in bounds.
    const int64_t row = ws_base(hq) + row0;
    constexpr int kVecs = M / 4;
    if (tid < kVecs)
      cp_async_16(uLse + stage * M * 4 + tid * 16, p.lse_log2 + row + tid * 4, true);
    else if (tid < 2 * kVecs)
      cp_async_16(uDsum + stage * M * 4 + (tid - kVecs) * 16, p.dsum + row + (tid - kVecs) * 4, true);
  };
  // pfs: the same copies without a branch (one 16-byte lse/D copy per thread
  // under a predicate), so that their address arithmetic can be scheduled
  // among the mma of S^T. enable = false (no next step) turns them into zero
  // fills of the idle stage; the source stays a mapped address.
  auto load_step_nobranch = [&](int hq, int m, int stage, bool enable) {
    const int row0 = m * M;
    load_tile_async<QTile, T>(uQ + stage * QTile::kBytes, gQ0 + hq * p.q_head_stride, p.q_row_stride, row0,
                              seqlen_q(), p.headdim, tid, enable);
    load_tile_async<QTile, T>(uDO + stage * QTile::kBytes, gDO0 + hq * p.do_head_stride, p.do_row_stride, row0,
                              seqlen_q(), p.headdim, tid, enable);
    const int64_t row = ws_base(hq) + row0;
    constexpr int kVecs = M / 4;
    const bool is_lse = tid < kVecs;
    const int v = is_lse ? tid : tid - kVecs;
    cp_async_16_if((is_lse ? uLse : uDsum) + stage * M * 4 + v * 16, (is_lse ? p.lse_log2 : p.dsum) + row + v * 4,
                   enable, tid < 2 * kVecs);
  };
  int hq = hk * p.head_ratio, m = m_start;  // the current step
  // Deterministic mode: wait until the key tiles before this one have added
  // their dQ to query tile (hq, m); returns its semaphore (nullptr otherwise),
  // released after this tile's atomics.
  auto wait_dq_turn = [&]() -> int* {
    if (!p.deterministic) return nullptr;
    int* sem = p.dq_semaphore + (int64_t(b) * p.heads_q + hq) * p.num_m_blocks + m;
    // n_lo: the first key tile that visits query tile m (see the header).
    const int first_key = m * M + left_off;
    const int n_lo = has_left && first_key > 0 ? first_key / N : 0;
    if (tid == 0)
      while (ld_acquire(sem) != n_block - n_lo) spin_pause();
    barrier();
    return sem;
  };
  if (total > 0) load_step(hq, m, 0);
  cp_async_commit();

  float acc_dv[KT][ND][4], acc_dk[KT][ND][4];
  zero(acc_dv);
  zero(acc_dk);

  for (int it = 0; it < total; ++it) {
    const int stage = Cfg::kDoubleBuffer ? (it & 1) : 0;
    int hq_next = hq, m_next = m;
    advance(hq_next, m_next);
    const int q0 = m * M;

    // Tile `it` has landed (this thread's copies); the barrier publishes
    // everyone's and guarantees all warps are done with step it-1 (its Q/dO
    // stage, dS^T, P^T), so the other stage and dS^T may be overwritten.
    cp_async_wait<0>();
    barrier();
    if (Cfg::kDoubleBuffer && !Cfg::kPrefetchS && it + 1 < total) {
      load_step(hq_next, m_next, stage ^ 1);
      cp_async_commit();
    }
    const uint32_t uQs = uQ + stage * QTile::kBytes;
    const uint32_t baseQ_b = uQs + offQ_b, baseQ_t = uQs + offQ_t;
    const uint32_t baseL = uLse + stage * M * 4 + offLse;

    // dpe: lse_log2 of the warp's queries, read ahead of S^T and of any
    // shared store or cp.async of this step (ptxas keeps a shared load behind
    // those), so the exponent can follow S^T's mma without waiting on it.
    float2 lse2[Cfg::kDPEarly ? NQ : 1];
    if constexpr (Cfg::kDPEarly) {
#pragma unroll
      for (int nq = 0; nq < NQ; ++nq) lse2[nq] = lds_f32x2(baseL + (16 * WD * (nq >> 1) + 8 * (nq & 1)) * 4);
    }

    // S^T = K Q^T for the warp's keys x queries.
    float s[KT][NQ][4];
    zero(s);
    gemm_nt<KT, NQ, D, 16 * WD, KVTile, QTile, Elem>(s, baseK_a, baseQ_b);

    if constexpr (Cfg::kPrefetchS) {
      // pfs: the next step's copies, after S^T's ldmatrix in program order
      // (their address arithmetic then runs under its mma). All reads of the
      // other stage retired at the barrier above. Without a next step they
      // zero-fill the idle stage.
      const bool has_next = it + 1 < total;
      load_step_nobranch(has_next ? hq_next : hq, has_next ? m_next : m, stage ^ 1, has_next);
      cp_async_commit();
    }

    // P^T = exp2(S^T * scale*log2e - lse_log2). Element e of accumulator
    // [mt][nq] is key (row) key_row0 + 16mt + g + 8(e/2), query (column)
    // 16(wd + WD(nq/2)) + 8(nq%2) + 2t + e%2.
    const bool need_mask = key0 + N > seqlen_k() || (has_right && key0 + N - 1 - q0 > right_off) ||
                           (has_left && key0 - (q0 + M - 1) < left_off);
    // kScoreMod: S^T in score units (softcap, ALiBi).
    float slope = 0.f;
    if constexpr (kScoreMod) {
      if (score_units) {
        if (alibi) slope = p.variants.alibi_slopes[b * p.variants.alibi_batch_stride + hq];
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq) {
          const int qc_step = 16 * WD * (nq >> 1) + 8 * (nq & 1);
#pragma unroll
          for (int mt = 0; mt < KT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float x = s[mt][nq][e];
              if (softcap > 0.f) {
                x = softcap * tanh_approx(x * cap_in);
              } else {
                x *= p.scale;
              }
              if (alibi) {
                const int key = key0 + key_row0 + 16 * mt + g + 8 * (e >> 1);
                const int query = q0 + 16 * wd + 2 * t + qc_step + (e & 1);
                x = fmaf(-slope, fabsf(float(query + diag - key)), x);
              }
              s[mt][nq][e] = x;
            }
        }
      }
    }
    if constexpr (Cfg::kDPEarly) {
      // dpe: the exponent only, -inf where masked (one branch); exp2 follows
      // dP^T's mma in the same basic block and is scheduled under it.
#pragma unroll
      for (int nq = 0; nq < NQ; ++nq)
#pragma unroll
        for (int mt = 0; mt < KT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nq][e] = fmaf(s[mt][nq][e], exp_scale, -((e & 1) ? lse2[nq].y : lse2[nq].x));
      if (need_mask) {
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq) {
          const int qc_step = 16 * WD * (nq >> 1) + 8 * (nq & 1);
#pragma unroll
          for (int mt = 0; mt < KT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + key_row0 + 16 * mt + g + 8 * (e >> 1);
              const int query = q0 + 16 * wd + 2 * t + qc_step + (e & 1);
              if (key >= seqlen_k() || (has_right && key > query + right_off) ||
                  (has_left && key < query + left_off))
                s[mt][nq][e] = -INFINITY;
            }
        }
      }
    } else {
#pragma unroll
    for (int nq = 0; nq < NQ; ++nq) {
      const int qc_step = 16 * WD * (nq >> 1) + 8 * (nq & 1);
      const float2 l2 = lds_f32x2(baseL + qc_step * 4);
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[mt][nq][e] = exp2_approx(fmaf(s[mt][nq][e], exp_scale, -((e & 1) ? l2.y : l2.x)));
        if (need_mask) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + key_row0 + 16 * mt + g + 8 * (e >> 1);
            const int query = q0 + 16 * wd + 2 * t + qc_step + (e & 1);
            if (key >= seqlen_k() || (has_right && key > query + right_off) ||
                (has_left && key < query + left_off))
              s[mt][nq][e] = 0.f;
          }
        }
      }
    }
    }  // !kDPEarly

    if constexpr (Cfg::kDPEarly) {
      // P^T goes to shared memory after dP^T (below).
    } else if constexpr (Cfg::kStagePT) {
#pragma unroll
      for (int mt = 0; mt < KT; ++mt)
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq) {
          const int chunk_c = 2 * WD * (nq >> 1) + (nq & 1);
          sts_u32(STile::at(baseS_c, 16 * mt, chunk_c) + kPTfromDS, pack2<Elem>(s[mt][nq][0], s[mt][nq][1]));
          sts_u32(STile::at(baseS_c, 16 * mt + 8, chunk_c) + kPTfromDS, pack2<Elem>(s[mt][nq][2], s[mt][nq][3]));
        }
    } else {
      // dV += P^T dO, P^T straight from registers.
      gemm_rb<KT, NQ, ND, 2 * WD, QTile, Elem>(acc_dv, s, baseQ_t + kDOfromQ);
    }

    // dP^T = V dO^T, then dS^T = P^T * (dP^T - D) in place, and to shared memory.
    float dp[KT][NQ][4];
    zero(dp);
    gemm_nt<KT, NQ, D, 16 * WD, KVTile, QTile, Elem>(dp, baseK_a + kVfromK, baseQ_b + kDOfromQ);
    // hreg: the warp's own P^T / dS^T, 16 bit, as the A fragments of the
    // second half's dV / dK products (query block j = accumulator pair 2j, 2j+1).
    uint32_t own_p[Cfg::kOwnHalfRegs ? KT : 1][Cfg::kOwnHalfRegs ? NQ / 2 : 1][4];
    uint32_t own_ds[Cfg::kOwnHalfRegs ? KT : 1][Cfg::kOwnHalfRegs ? NQ / 2 : 1][4];
    if constexpr (Cfg::kDPEarly) {
      // D_i first (a shared load cannot move above a shared store), then
      // exp2, and P^T, dS^T to shared memory.
      float2 dd[NQ];
#pragma unroll
      for (int nq = 0; nq < NQ; ++nq)
        dd[nq] = lds_f32x2(baseL + kDsumFromLse + (16 * WD * (nq >> 1) + 8 * (nq & 1)) * 4);
#pragma unroll
      for (int mt = 0; mt < KT; ++mt)
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nq][e] = exp2_approx(s[mt][nq][e]);
#pragma unroll
      for (int mt = 0; mt < KT; ++mt)
#pragma unroll
        for (int nq = 0; nq < NQ; ++nq) {
          const int chunk_c = 2 * WD * (nq >> 1) + (nq & 1);
          const uint32_t lo = pack2<Elem>(s[mt][nq][0], s[mt][nq][1]), hi = pack2<Elem>(s[mt][nq][2], s[mt][nq][3]);
          sts_u32(STile::at(baseS_c, 16 * mt, chunk_c) + kPTfromDS, lo);
          sts_u32(STile::at(baseS_c, 16 * mt + 8, chunk_c) + kPTfromDS, hi);
          if constexpr (Cfg::kOwnHalfRegs) {
            own_p[mt][nq >> 1][2 * (nq & 1)] = lo;
            own_p[mt][nq >> 1][2 * (nq & 1) + 1] = hi;
          }
        }
#pragma unroll
      for (int nq = 0; nq < NQ; ++nq) {
        const int chunk_c = 2 * WD * (nq >> 1) + (nq & 1);
#pragma unroll
        for (int mt = 0; mt < KT; ++mt) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dp[mt][nq][e] = s[mt][nq][e] * (dp[mt][nq][e] - ((e & 1) ? dd[nq].y : dd[nq].x));
          if constexpr (kScoreMod) {
            if (softcap > 0.f) {
              const float2 l2 = lds_f32x2(baseL + (16 * WD * (nq >> 1) + 8 * (nq & 1)) * 4);
#pragma unroll
              for (int e = 0; e < 4; ++e)
                dp[mt][nq][e] *= cap_derivative(s[mt][nq][e], (e & 1) ? l2.y : l2.x, mt, nq, e, q0, slope);
            }
          }
          const uint32_t lo = pack2<Elem>(dp[mt][nq][0], dp[mt][nq][1]), hi = pack2<Elem>(dp[mt][nq][2], dp[mt][nq][3]);
          sts_u32(STile::at(baseS_c, 16 * mt, chunk_c), lo);
          sts_u32(STile::at(baseS_c, 16 * mt + 8, chunk_c), hi);
          if constexpr (Cfg::kOwnHalfRegs) {
            own_ds[mt][nq >> 1][2 * (nq & 1)] = lo;
            own_ds[mt][nq >> 1][2 * (nq & 1) + 1] = hi;
          }
        }
      }
    } else {
#pragma unroll
    for (int nq = 0; nq < NQ; ++nq) {
      const int qc_step = 16 * WD * (nq >> 1) + 8 * (nq & 1);
      const float2 dd = lds_f32x2(baseL + kDsumFromLse + qc_step * 4);
      const int chunk_c = 2 * WD * (nq >> 1) + (nq & 1);
#pragma unroll
      for (int mt = 0; mt < KT; ++mt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[mt][nq][e] = s[mt][nq][e] * (dp[mt][nq][e] - ((e & 1) ? dd.y : dd.x));
        if constexpr (kScoreMod) {
          if (softcap > 0.f) {
            const float2 l2 = lds_f32x2(baseL + qc_step * 4);
#pragma unroll
            for (int e = 0; e < 4; ++e)
              dp[mt][nq][e] *= cap_derivative(s[mt][nq][e], (e & 1) ? l2.y : l2.x, mt, nq, e, q0, slope);
          }
        }
        sts_u32(STile::at(baseS_c, 16 * mt, chunk_c), pack2<Elem>(dp[mt][nq][0], dp[mt][nq][1]));
        sts_u32(STile::at(baseS_c, 16 * mt + 8, chunk_c), pack2<Elem>(dp[mt][nq][2], dp[mt][nq][3]));
      }
    }
    }  // !kDPEarly

    // dV += P^T dO and dK += dS^T Q from the staged P^T / dS^T: all from shared
    // memory, or (hreg) the warp's own query blocks from registers and only the
    // other warp's from shared memory.
    auto dv_dk_staged = [&] {
      if constexpr (Cfg::kOwnHalfRegs) {
        gemm_half_regs<KT, NQ / 2, ND, 2 * WD, STile, QTile, Elem>(acc_dv, own_p, baseS_o + kPTfromDS,
                                                                   uQs + offQ_own + kDOfromQ, uQs + offQ_oth + kDOfromQ);
        gemm_half_regs<KT, NQ / 2, ND, 2 * WD, STile, QTile, Elem>(acc_dk, own_ds, baseS_o, uQs + offQ_own,
                                                                   uQs + offQ_oth);
      } else {
        gemm_sb<KT, M, ND, 2 * WD, STile, QTile, Elem>(acc_dv, baseS_a + kPTfromDS, baseQ_t + kDOfromQ);
        gemm_sb<KT, M, ND, 2 * WD, STile, QTile, Elem>(acc_dk, baseS_a, baseQ_t);
      }
    };

    if constexpr (!Cfg::kStagePT) {
      // dK += dS^T Q, dS^T straight from registers.
      gemm_rb<KT, NQ, ND, 2 * WD, QTile, Elem>(acc_dk, dp, baseQ_t);
      barrier();  // dS^T complete for dQ; all reads of this Q/dO stage done
    } else if constexpr (Cfg::kDQEarly) {
      barrier();  // P^T, dS^T complete
      // dqe: the semaphore wait first (deterministic mode), then dQ_i += dS K_j
      // and its atomics, then dV and dK: the atomics and their address math sit
      // in the same basic block as the dV/dK mma and issue under them.
      int* sem = wait_dq_turn();
      {
        float dq[MTQ][NTQ][4];
        zero(dq);
        gemm_tb<MTQ, NTQ, N, 2 * WMQ, 2 * WDQ, STile, KVTile, Elem>(dq, baseS_t, baseK_t);
        const int lane_row = 16 * wqm + g;
        float* gacc = p.dq_accum + (ws_base(hq) + q0 + lane_row) * D +
                      (16 * wqd + 2 * t);
        // No row test: rows past Sq are padding rows of dq_accum (M divides
        // kBwdSeqQPad, so the whole tile is inside the workspace), which the
        // convert kernel never reads; their dS, hence their adds, are 0 anyway.
        // Unconditional adds keep this code free of branches.
#pragma unroll
        for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row_c = 16 * WMQ * mt + 8 * h;
#pragma unroll
            for (int nt = 0; nt < NTQ; ++nt) {
              const int col_c = 16 * WDQ * (nt >> 1) + 8 * (nt & 1);
              red_add_f32x2(gacc + row_c * D + col_c, dq[mt][nt][2 * h], dq[mt][nt][2 * h + 1]);
            }
          }
      }
      dv_dk_staged();
      if (p.deterministic) {
        thread_fence();  // this thread's adds are performed before the release below
        barrier();
        if (tid == 0) red_release_add(sem, 1);
      }
      if (!Cfg::kDoubleBuffer) barrier();  // all reads of the single Q/dO stage done
    } else {
      barrier();  // P^T, dS^T complete
      dv_dk_staged();
      if (!Cfg::kDoubleBuffer) barrier();  // all reads of the single Q/dO stage done
    }
    if (!Cfg::kDoubleBuffer && it + 1 < total) {
      // Single buffer: the next tile streams in under dQ and its atomics.
      load_step(hq_next, m_next, 0);
      cp_async_commit();
    }

    if constexpr (!Cfg::kDQEarly) {
    // dQ_i += dS K_j (unscaled; the convert kernel applies softmax_scale).
    float dq[MTQ][NTQ][4];
    zero(dq);
    gemm_tb<MTQ, NTQ, N, 2 * WMQ, 2 * WDQ, STile, KVTile, Elem>(dq, baseS_t, baseK_t);

    int* sem = wait_dq_turn();
    // This thread's fragment (row g, columns 2t, 2t+1 of the warp's first
    // tile); every other fragment is a compile-time offset from it.
    const int lane_row = 16 * wqm + g;
    float* gacc = p.dq_accum + (ws_base(hq) + q0 + lane_row) * D +
                  (16 * wqd + 2 * t);
    const int rows_left = seqlen_q() - q0 - lane_row;  // fragment rows below this are inside Sq
#pragma unroll
    for (int mt = 0; mt < MTQ; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row_c = 16 * WMQ * mt + 8 * h;
        if (row_c < rows_left) {
#pragma unroll
          for (int nt = 0; nt < NTQ; ++nt) {
            const int col_c = 16 * WDQ * (nt >> 1) + 8 * (nt & 1);
            red_add_f32x2(gacc + row_c * D + col_c, dq[mt][nt][2 * h], dq[mt][nt][2 * h + 1]);
          }
        }
      }
    if (p.deterministic) {
      thread_fence();  // this thread's adds are performed before the release below
      barrier();
      if (tid == 0) red_release_add(sem, 1);
    }
    }  // !kDQEarly
    hq = hq_next;
    m = m_next;
  }

  // Epilogue: dK * scale and dV through shared memory (K/V space) for 16-byte
  // coalesced stores. The barrier retires every read of sK/sV (and the K/V
  // copies themselves when the walk was empty).
  cp_async_wait<0>();
  barrier();
  const uint32_t baseK_c = lane_base_c<KVTile>(uK, key_row0, 2 * wd, lane);
#pragma unroll
  for (int mt = 0; mt < KT; ++mt)
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      const int chunk_c = 2 * WD * (nd >> 1) + (nd & 1);
      const uint32_t a0 = KVTile::at(baseK_c, 16 * mt, chunk_c), a1 = KVTile::at(baseK_c, 16 * mt + 8, chunk_c);
      sts_u32(a0, pack2<Elem>(acc_dk[mt][nd][0] * p.scale, acc_dk[mt][nd][1] * p.scale));
      sts_u32(a1, pack2<Elem>(acc_dk[mt][nd][2] * p.scale, acc_dk[mt][nd][3] * p.scale));
      sts_u32(a0 + kVfromK, pack2<Elem>(acc_dv[mt][nd][0], acc_dv[mt][nd][1]));
      sts_u32(a1 + kVfromK, pack2<Elem>(acc_dv[mt][nd][2], acc_dv[mt][nd][3]));
    }
  barrier();
  Elem* gdK = static_cast<Elem*>(p.dk) + b * p.dk_batch_stride + k_start * p.dk_row_stride + hk * p.dk_head_stride;
  Elem* gdV = static_cast<Elem*>(p.dv) + b * p.dv_batch_stride + k_start * p.dv_row_stride + hk * p.dv_head_stride;
  store_tile<KVTile, T>(uK, gdK, p.dk_row_stride, key0, k_len(), p.headdim, tid);
  store_tile<KVTile, T>(uV, gdV, p.dv_row_stride, key0, k_len(), p.headdim, tid);
}

// ---------------------------------------------------------------------------
// 3. dq = scale * dq_accum, in dtype. Grid (bwd_convert_units * D/8 / 256 rounded up, heads_q, batch): one
// thread per 16-byte chunk of a row (kRows, kPairedRows: the accumulator's order, bwd_params.h) or of the two
// rows r, r + 8 whose floats a kFragments float4 interleaves (64 contiguous bytes a thread); chunks past the
// true head dimension have nothing to do.
template <BwdDQLayout kLayout>
FLASHOP_HOST_DEVICE int64_t bwd_convert_units(int seqlen_q) {
  return kLayout == BwdDQLayout::kFragments ? int64_t(seqlen_q + 63) / 64 * 32 : seqlen_q;
}

template <class Cfg, BwdDQLayout kLayout = BwdDQLayout::kRows>
FLASHOP_SM80_GLOBAL void FLASHOP_SM80_LAUNCH_BOUNDS(kAuxThreads, 1) bwd_convert_dq_kernel(const BwdParams p) {
  using Elem = typename ElemOf<Cfg::kDType>::type;
  constexpr int D = Cfg::kHeadDim;
  constexpr int kCPR = D / 8;
  constexpr bool kFragments = kLayout == BwdDQLayout::kFragments;
  const int idx = block_x() * kAuxThreads + thread_x();
  const int unit = idx / kCPR, c = idx % kCPR;
  // The thread's first row; kFragments: unit = 32 tile + 8 w + g, rows 64 tile + 16 w + g and + 8.
  const int row0 = kFragments ? 64 * (unit / 32) + 16 * (unit % 32 / 8) + unit % 8 : unit;
  const int hq = block_y(), b = block_z();
  // Packed: the rows sequence b owns, from q_start; rows past seqused_q get zeros.
  int q_len = p.seqlen_q, q_start = 0, q_used = p.seqlen_q;
  int64_t ws = (int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded;
  if (p.packed.packed()) {
    const SequenceBounds sq = sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, b, p.packed.total_q,
                                              p.seqlen_q);
    q_len = sq.len;
    q_start = sq.start;
    q_used = sq.used;
    ws = hq * bwd_packed_ws_rows(p.packed.total_q, p.batch) + bwd_packed_ws_row0(sq.start, b);
  }
  if (row0 >= q_len || c * 8 >= p.headdim) return;
  float v[2][8];  // the thread's rows' 8 floats
  if constexpr (kFragments) {
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + (ws + row0 / 64 * 64) * D +
                                                        bwd_dq_fragment_offset(row0 % 64, c * 8));
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const float4 x = src[t];
      v[0][2 * t] = x.x, v[0][2 * t + 1] = x.y, v[1][2 * t] = x.z, v[1][2 * t + 1] = x.w;
    }
  } else {
    const int ws_row = kLayout == BwdDQLayout::kPairedRows ? bwd_dq_paired_row(row0) : row0;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + (ws + ws_row) * D + c * 8);
    const float4 x = src[0], y = src[1];
    v[0][0] = x.x, v[0][1] = x.y, v[0][2] = x.z, v[0][3] = x.w;
    v[0][4] = y.x, v[0][5] = y.y, v[0][6] = y.z, v[0][7] = y.w;
  }
#pragma unroll
  for (int h = 0; h < (kFragments ? 2 : 1); ++h) {
    const int row = row0 + 8 * h;
    if (row >= q_len) break;
    const float s = row < q_used ? p.scale : 0.f;
    uint4 out;
    out.x = pack2<Elem>(v[h][0] * s, v[h][1] * s);
    out.y = pack2<Elem>(v[h][2] * s, v[h][3] * s);
    out.z = pack2<Elem>(v[h][4] * s, v[h][5] * s);
    out.w = pack2<Elem>(v[h][6] * s, v[h][7] * s);
    Elem* dst = static_cast<Elem*>(p.dq) + b * p.dq_batch_stride + (int64_t(q_start) + row) * p.dq_row_stride +
                hq * p.dq_head_stride + c * 8;
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

// ---------------------------------------------------------------------------
// Launch geometry, shared by the CUDA launcher and the emulator.
struct BwdGrids {
  unsigned pre[3], main[3], conv[3];
};

template <class Cfg, BwdDQLayout kLayout = BwdDQLayout::kRows>
inline BwdGrids bwd_grids(const BwdParams& p) {
  constexpr int D = Cfg::kHeadDim;
  const unsigned hq = unsigned(p.heads_q), hk = unsigned(p.heads_k), bs = unsigned(p.batch);
  BwdGrids g{};
  g.pre[0] = unsigned(p.seqlen_q_rounded / RowGroup<D>::kRowsPerBlock);
  g.pre[1] = hq;
  g.pre[2] = bs;
  g.main[0] = unsigned((p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN);
  g.main[1] = hk;
  g.main[2] = bs;
  g.conv[0] = unsigned((bwd_convert_units<kLayout>(p.seqlen_q) * (D / 8) + kAuxThreads - 1) / kAuxThreads);
  g.conv[1] = hq;
  g.conv[2] = bs;
  return g;
}

// The main kernel's instantiation for a problem (bwd_main_kernel's kVar).
inline int bwd_variant(const BwdParams& p) {
  if (p.variants.softcap > 0.f || p.variants.alibi_slopes != nullptr) return kBwdScoreMod;
  return p.variants.window_left >= 0 ? kBwdLeft : kBwdDense;
}

// The arguments a kernel of this config can take (the glue checks too).
template <class Cfg>
inline bool bwd_params_ok(const BwdParams& p) {
  return p.headdim >= 8 && p.headdim <= Cfg::kHeadDim && p.headdim % 8 == 0 && p.seqlen_q >= 1 && p.seqlen_k >= 1 && p.heads_k >= 1 &&
         p.heads_q == p.heads_k * p.head_ratio &&
         p.seqlen_q_rounded == bwd_round_up(p.seqlen_q, kBwdSeqQPad) &&
         (!p.deterministic ||
          (p.dq_semaphore != nullptr && p.num_m_blocks == (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM));
}

#ifndef FLASHOP_BWD_EMULATE

template <class Cfg>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  if (!bwd_params_ok<Cfg>(p)) return cudaErrorInvalidValue;
  const BwdGrids g = bwd_grids<Cfg>(p);
  bwd_preprocess_kernel<Cfg><<<dim3(g.pre[0], g.pre[1], g.pre[2]), kAuxThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  constexpr std::size_t kSmem = Cfg::kSmemBytes;
  const int var = bwd_variant(p);
  auto* main_kernel = p.packed.packed()       ? &bwd_main_kernel<Cfg, kBwdScoreMod, true>
                      : var == kBwdScoreMod ? &bwd_main_kernel<Cfg, kBwdScoreMod>
                      : var == kBwdLeft   ? &bwd_main_kernel<Cfg, kBwdLeft>
                                          : &bwd_main_kernel<Cfg, kBwdDense>;
  if (kSmem > 48 * 1024) {  // dynamic shared memory beyond 48 KiB must be opted into
    static std::atomic<unsigned long long> configured[4] = {{0}, {0}, {0}, {0}};
    const int which = p.packed.packed() ? 3 : var == kBwdScoreMod ? 2 : var == kBwdLeft ? 1 : 0;
    err = set_kernel_smem_once(configured[which], main_kernel, int(kSmem));
    if (err != cudaSuccess) return err;
  }
  main_kernel<<<dim3(g.main[0], g.main[1], g.main[2]), Cfg::kThreads, kSmem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  bwd_convert_dq_kernel<Cfg><<<dim3(g.conv[0], g.conv[1], g.conv[2]), kAuxThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

#else  // FLASHOP_BWD_EMULATE: the same three launches on the CPU emulator.

template <class Cfg>
inline bool emulate_bwd(const BwdParams& p) {
  if (!bwd_params_ok<Cfg>(p)) return false;
  const BwdGrids g = bwd_grids<Cfg>(p);
  auto dims = [](const unsigned (&d)[3]) { return emu::Dim3{d[0], d[1], d[2]}; };
  emu::launch(dims(g.pre), kAuxThreads, 0, [&] { bwd_preprocess_kernel<Cfg>(p); });
  const int var = bwd_variant(p);
  emu::launch(dims(g.main), Cfg::kThreads, Cfg::kSmemBytes, [&] {
    if (p.packed.packed())
      bwd_main_kernel<Cfg, kBwdScoreMod, true>(p);
    else if (var == kBwdScoreMod)
      bwd_main_kernel<Cfg, kBwdScoreMod>(p);
    else if (var == kBwdLeft)
      bwd_main_kernel<Cfg, kBwdLeft>(p);
    else
      bwd_main_kernel<Cfg, kBwdDense>(p);
  });
  emu::launch(dims(g.conv), kAuxThreads, 0, [&] { bwd_convert_dq_kernel<Cfg>(p); });
  return true;
}

#endif

}  // namespace bwd

// The launcher the registry points at.
#ifndef FLASHOP_BWD_EMULATE
template <class Cfg>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  return bwd::launch_bwd<Cfg>(p, stream);
}
#endif

}  // namespace sm80
}  // namespace flashop

// FlashAttention-2 forward, mma.sync path (sm80 and newer).
//
// One thread block computes B_r query rows of one (batch, head):
//
//   O = 0, m = -inf, l = 0                       (registers, per query row)
//   for each key tile j (right to left; only the tiles some row's window reaches):
//     S   = Q K_j^T                               (mma, fp32 accumulators)
//    [S   = softcap * tanh(S * scale / softcap) - slope * |query + Sk - Sq - key|
//           (kVariants with softcap or ALiBi: S in score units from here on, c = log2(e))]
//     S   = -inf where key >= Sk or key is outside the query's window (edge tiles only)
//     m'  = max(m, rowmax S)
//     P   = exp2(S * c - m' * c),  c = scale * log2(e)    (one FMA + ex2)
//     l   = l * exp2((m - m') * c) + rowsum P
//     O   = O * exp2((m - m') * c) + P V_j        (P stays in registers)
//   O /= l;  lse = m * scale + ln l               (0 and -inf when no key is seen)
//   (sinks: exp(sink) joins l, with the max taken over m * scale and sink)
//
// Work split: warp w owns query rows [w * B_r/warps, (w+1) * B_r/warps) of the
// tile: one or two m16 mma row tiles. Every warp reads the whole K and V
// tile; a warp never reads another warp's Q rows, which the epilogue uses.
//
// Knows nothing of torch: pointers and strides in FwdParams, a cudaStream_t.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../fwd_config.h"
#include "../fwd_params.h"
#include "../kernel_attributes.h"
#include "ptx.cuh"
#include "tiles.cuh"

namespace flashop {
namespace sm80 {

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

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Compile-time constants derived from the config.
template <class Cfg>
struct FwdTraits {
  using Elem = typename ElemOf<Cfg::kDType>::type;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBM = Cfg::kBlockM;
  static constexpr int kBN = Cfg::kBlockN;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kMTiles = Cfg::kRowsPerWarp / 16;  // m16 row tiles per warp
  static constexpr int kSTiles = kBN / 8;                 // n8 tiles of S (keys)
  static constexpr int kOTiles = kD / 8;                  // n8 tiles of O (head dims)
  static constexpr int kQKSteps = kD / 16;                // k16 steps of Q K^T
  static constexpr int kPVSteps = kBN / 16;               // k16 steps of P V
  using QTile = SmemTile<kBM, kD, Cfg::kSwizzle>;
  using KVTile = SmemTile<kBN, kD, Cfg::kSwizzle>;
  static_assert(QTile::kBytes + 2 * Cfg::kStages * KVTile::kBytes == Cfg::kSmemBytes,
                "shared-memory plan and FwdConfig::kSmemBytes disagree");
};

// ---------------------------------------------------------------------------
// The pieces of one key-tile step, each on a warp's register tiles.

// S[mt][nt] += Q[rows of m tile mt] . K[keys of n tile nt]^T over the head dim.
// Q comes from shared memory or, with qreg, from the fragments in q_frag.
template <class Cfg>
__device__ __forceinline__ void gemm_qk(
    float (&s)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kSTiles][4],
    const uint32_t (&q_frag)[Cfg::kQInRegs ? FwdTraits<Cfg>::kMTiles : 1]
                            [Cfg::kQInRegs ? FwdTraits<Cfg>::kQKSteps : 1][4],
    const LdsmAddr<typename FwdTraits<Cfg>::QTile>& q_addr,
    const LdsmAddr<typename FwdTraits<Cfg>::KVTile>& k_addr) {
  using Tr = FwdTraits<Cfg>;
  using Elem = typename Tr::Elem;
#pragma unroll
  for (int ks = 0; ks < Tr::kQKSteps; ++ks) {
    uint32_t a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      if constexpr (Cfg::kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[mt][ks][i];
      } else {
        ldmatrix_x4(a[mt], q_addr.at(mt * 16, ks));
      }
    }
#pragma unroll
    for (int np = 0; np < Tr::kSTiles / 2; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, k_addr.at(np * 16, ks));
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        mma_16816<Elem>(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<Elem>(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Scores of keys a query row must not see become -inf: keys past the end of
// the sequence (the zero-filled tail rows of K are not absent keys) and keys
// outside the row's window: key - row > right_off (has_right: causal or a right
// window) or key - row < left_off (has_left). Called on edge tiles only.
// Thread (g = lane/4, t = lane%4) holds rows g and g+8 of each m tile and
// columns 2t, 2t+1 of each n8 tile.
template <class Cfg, bool kLeft>
__device__ __forceinline__ void mask_scores(
    float (&s)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kSTiles][4], int key0, int query0,
    int lane, int seqlen_k, bool has_right, int right_off, bool has_left, int left_off) {
  using Tr = FwdTraits<Cfg>;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = query0 + mt * 16 + (lane >> 2) + 8 * h;
      const int key_end = has_right ? min(seqlen_k, row + right_off + 1) : seqlen_k;  // first hidden key
      const int key_begin = kLeft && has_left ? row + left_off : 0;                   // first visible key
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + nt * 8 + 2 * (lane & 3) + e;
          if (key >= key_end || (kLeft && key < key_begin)) s[mt][nt][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

// tanh on the SFU (sm75+): max relative error 2^-10.99 (PTX ISA), so a capped
// score softcap * tanh(x) is off by at most |score| * 2^-11, a quarter of the
// rounding of a bf16 score.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// kVariants: raw q.k into the contract's score units: scale * q.k, capped
// (softcap > 0: softcap * tanh(scale * q.k / softcap)), minus the ALiBi bias
// slope * |row + diag - key| (slope != 0). Masking follows (it overwrites).
template <class Cfg>
__device__ __forceinline__ void modify_scores(
    float (&s)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kSTiles][4], int key0, int query0, int lane,
    int diag, float scale, float softcap, float cap_in, float slope) {
  using Tr = FwdTraits<Cfg>;
  if (softcap > 0.f) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][nt][i] = softcap * tanh_approx(s[mt][nt][i] * cap_in);
  } else {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][nt][i] *= scale;
  }
  if (slope != 0.f) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // distance = |row + diag - key|, formed relative to the thread's first key
        const int rel = query0 + mt * 16 + (lane >> 2) + 8 * h + diag - key0 - 2 * (lane & 3);
#pragma unroll
        for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float dist = fabsf(float(rel - nt * 8 - e));
            s[mt][nt][2 * h + e] = fmaf(-slope, dist, s[mt][nt][2 * h + e]);
          }
        }
      }
    }
  }
}

// Online softmax update. On exit s holds P = exp2(S*c - m_new*c) (fp32), O and
// the per-thread partial row sums are rescaled to the new max. The row max is
// reduced over the 4 lanes (a quad) that share a row; the row sum stays a
// per-lane partial until the epilogue (the rescale factor is quad-uniform, so
// partial sums rescale correctly and the shuffles happen once, not per tile).
template <class Cfg>
__device__ __forceinline__ void softmax_update(
    float (&s)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kSTiles][4],
    float (&o)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kOTiles][4],
    float (&row_max)[FwdTraits<Cfg>::kMTiles][2], float (&row_sum)[FwdTraits<Cfg>::kMTiles][2],
    float scale_log2) {
  using Tr = FwdTraits<Cfg>;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[mt][h];
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen only masked keys keeps m = -inf; use 0 as the
      // reference there so that -inf - -inf never makes a NaN: its P is then
      // exp2(-inf) = 0 and the rescale of its (still zero) O and l is 0.
      const float ref = (mx == -INFINITY) ? 0.f : mx;
      const float ref_scaled = ref * scale_log2;
      const float correction = exp2_approx(row_max[mt][h] * scale_log2 - ref_scaled);
      row_max[mt][h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2_approx(fmaf(s[mt][nt][2 * h + e], scale_log2, -ref_scaled));
          s[mt][nt][2 * h + e] = p;
          sum += p;
        }
      }
      row_sum[mt][h] = row_sum[mt][h] * correction + sum;
#pragma unroll
      for (int nt = 0; nt < Tr::kOTiles; ++nt) {
        o[mt][nt][2 * h] *= correction;
        o[mt][nt][2 * h + 1] *= correction;
      }
    }
  }
}

// O += P V. P never leaves registers: the accumulator fragment of two adjacent
// n8 tiles of S (rows g, g+8; columns 2t, 2t+1 of each) is exactly the A
// fragment of one k16 step once each pair is rounded to 16 bits and packed.
template <class Cfg>
__device__ __forceinline__ void gemm_pv(
    float (&o)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kOTiles][4],
    const float (&p)[FwdTraits<Cfg>::kMTiles][FwdTraits<Cfg>::kSTiles][4],
    const LdsmAddr<typename FwdTraits<Cfg>::KVTile>& v_addr) {
  using Tr = FwdTraits<Cfg>;
  using Elem = typename Tr::Elem;
  uint32_t a[Tr::kPVSteps][Tr::kMTiles][4];
#pragma unroll
  for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      a[kk][mt][0] = pack2<Elem>(p[mt][2 * kk][0], p[mt][2 * kk][1]);          // row g,   keys 2t..
      a[kk][mt][1] = pack2<Elem>(p[mt][2 * kk][2], p[mt][2 * kk][3]);          // row g+8, keys 2t..
      a[kk][mt][2] = pack2<Elem>(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);  // row g,   keys 8+2t..
      a[kk][mt][3] = pack2<Elem>(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);  // row g+8, keys 8+2t..
    }
  }
  // Head-dim pairs outer, keys inner: the swizzled column of the V fragment
  // changes only in the outer loop, the inner steps are plain row offsets.
#pragma unroll
  for (int dp = 0; dp < Tr::kOTiles / 2; ++dp) {
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, v_addr.at(kk * 16, dp));
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        mma_16816<Elem>(o[mt][2 * dp], a[kk][mt], b[0], b[1]);
        mma_16816<Elem>(o[mt][2 * dp + 1], a[kk][mt], b[2], b[3]);
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ typename FwdTraits<Cfg>::Elem* output_ptr(const FwdParams& p, int batch,
                                                                    int head) {
  return static_cast<typename FwdTraits<Cfg>::Elem*>(p.out) + batch * p.o_batch_stride +
         head * p.o_head_stride;
}

__device__ __forceinline__ float* lse_ptr(const FwdParams& p, int batch, int head) {
  return p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
}

// A query tile none of whose rows sees a key (causal with Sq > Sk, a window
// that misses every key): out = 0, lse = -inf (the sink with sinks), without
// touching shared memory. Rows [row0, row_end) are written; kPacked: rows from
// `used` on (past the sequence's seqused_q) get lse = -inf whatever the sink.
template <class Cfg, bool kPartialD, bool kPacked = false>
__device__ __forceinline__ void write_empty_tile(const FwdParams& p, typename FwdTraits<Cfg>::Elem* out,
                                                 float* lse, int row0, int tid, float lse_value, int row_end,
                                                 int used = 0) {
  using Tr = FwdTraits<Cfg>;
  constexpr int kChunksPerRow = Tr::kD / 8;
  for (int i = tid; i < Tr::kBM * kChunksPerRow; i += Tr::kThreads) {
    const int row = row0 + i / kChunksPerRow;
    if (row < row_end && (!kPartialD || (i % kChunksPerRow) * 8 < p.headdim)) {
      *reinterpret_cast<uint4*>(out + int64_t(row) * p.o_row_stride + (i % kChunksPerRow) * 8) =
          make_uint4(0u, 0u, 0u, 0u);
    }
  }
  for (int i = tid; i < Tr::kBM; i += Tr::kThreads) {
    if (row0 + i < row_end) lse[row0 + i] = !kPacked || row0 + i < used ? lse_value : -INFINITY;
  }
}

// ---------------------------------------------------------------------------
// kPartialD: p.headdim < the tile width; columns past it are zero-filled on load and never stored.
// A separate instantiation, so that full-width problems pay nothing for the column checks (the
// d128 kernels run at 255 registers; the checks would make them spill).
// kVariants: a left window bound, softcap or ALiBi (with the last two, the scores
// move to score units after Q K^T, modify_scores); another instantiation, so that
// the dense, causal and right-window loop keeps its registers (the left bound's
// loop limit and mask bound alone make the d128 kernels spill).
// kPacked (with kVariants only: one more instantiation, not two): a packed batch
// (p.packed, csrc/packed_sequences.h). blockIdx.z is the sequence; Sq and Sk below
// are its used rows, the pointers start at its first rows, and the rows it owns
// past seqused_q get out = 0, lse = -inf. The dense instantiations keep p's
// sizes and are unchanged.
template <class Cfg, bool kPartialD, bool kVariants, bool kPacked>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const __grid_constant__ FwdParams p) {
  static_assert(!kPacked || kVariants, "packed batches run on the variants instantiation");
  using Tr = FwdTraits<Cfg>;
  using Elem = typename Tr::Elem;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kBM = Tr::kBM, kBN = Tr::kBN, kThreads = Tr::kThreads;
  constexpr int kMT = Tr::kMTiles;

  // The kernel has no static shared memory, so the dynamic buffer starts at
  // shared address 0: every tile base is a multiple of 128 bytes, which
  // LdsmAddr's XOR addressing and the swizzle rely on.
  extern __shared__ __align__(128) unsigned char smem[];
  // [ Q | K stage 0 (| K stage 1) | V stage 0 (| V stage 1) ]
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK = sQ + QTile::kBytes;
  const uint32_t sV = sK + Cfg::kStages * KVTile::kBytes;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // Highest query tiles first: under causal masking they see the most keys,
  // so the long blocks start early and the short ones fill the tail.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  // head / head_ratio as a multiply-high (see FwdParams::head_ratio_magic).
  const int kv_head =
      p.head_ratio == 1 ? head : int(__umulhi(unsigned(head), p.head_ratio_magic));
  const int row0 = m_block * kBM;                    // first query row of the block
  const int warp_row0 = warp * Cfg::kRowsPerWarp;    // first row of this warp, within the block

  // The sequence's rows: [q_start, q_start + q_len) of q/out/lse, of which the first seqlen_q take part,
  // and seqlen_k keys from k_start (dense: the whole batch entry).
  // (Accessors: the dense instantiations read p at each use, as ptxas schedules best; a value held
  // across the loop makes the kv2 variants kernel spill.)
  int used_q = 0, used_k = 0, len_q = 0;
  int64_t q_start = 0, k_start = 0;
  auto seqlen_q = [&]() -> int { if constexpr (kPacked) return used_q; else return p.seqlen_q; };
  auto seqlen_k = [&]() -> int { if constexpr (kPacked) return used_k; else return p.seqlen_k; };
  auto q_len = [&]() -> int { if constexpr (kPacked) return len_q; else return p.seqlen_q; };
  if constexpr (kPacked) {
    const SequenceBounds sq = sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, batch,
                                              p.packed.total_q, p.seqlen_q);
    const SequenceBounds sk = sequence_bounds(p.packed.cu_seqlens_k, p.packed.seqused_k, batch,
                                              p.packed.total_k, p.seqlen_k);
    if (row0 >= sq.len) return;  // the rows belong to the next sequence (or to no tile)
    used_q = sq.used;
    used_k = sk.used;
    len_q = sq.len;
    q_start = sq.start;
    k_start = sk.start;
  }

  const Elem* q = static_cast<const Elem*>(p.q) + batch * p.q_batch_stride + q_start * p.q_row_stride +
                  head * p.q_head_stride;
  const Elem* k = static_cast<const Elem*>(p.k) + batch * p.k_batch_stride + k_start * p.k_row_stride +
                  kv_head * p.k_head_stride;
  const Elem* v = static_cast<const Elem*>(p.v) + batch * p.v_batch_stride + k_start * p.v_row_stride +
                  kv_head * p.v_head_stride;

  // The window as bounds on key - row (query row i sees key j iff
  // left_off <= j - i <= right_off; causal is right_off = diag). Key tiles
  // [n_first, n_last] hold every key some real row of the block sees: from the
  // first row's first key to the last row's last key; tiles outside are skipped.
  const int diag = seqlen_k() - seqlen_q();
  const bool has_right = p.causal || p.variants.window_right >= 0;
  const int right_off = diag + (p.causal ? 0 : p.variants.window_right);
  const bool has_left = kVariants && p.variants.window_left >= 0;
  const int left_off = diag - p.variants.window_left;
  const int row_last = min(seqlen_q(), row0 + kBM) - 1;
  const int key_end = has_right ? min(seqlen_k(), row_last + right_off + 1) : seqlen_k();
  const int key_begin = has_left ? max(0, row0 + left_off) : 0;
  // kPacked: a tile with no used row (row0 >= seqused_q) is empty too.
  if (key_end <= key_begin || (kPacked && row0 >= seqlen_q())) {
    const float empty_lse = p.variants.sinks != nullptr ? p.variants.sinks[head] : -INFINITY;
    write_empty_tile<Cfg, kPartialD, kPacked>(p, output_ptr<Cfg>(p, batch, head) + q_start * p.o_row_stride,
                                              lse_ptr(p, batch, head) + q_start, row0, tid, empty_lse, q_len(),
                                              seqlen_q());
    return;
  }
  const int n_first = kVariants ? key_begin / kBN : 0;

  // Prologue: Q and the first key tile. Tiles run right to left, so the tiles
  // that need masking (the ragged tail, the diagonal) come first.
  int n = ceil_div(key_end, kBN) - 1;
  load_tile_async<QTile, kThreads, kPartialD>(sQ, q, p.q_row_stride, row0, seqlen_q(), p.headdim, tid);
  load_tile_async<KVTile, kThreads, kPartialD>(sK, k, p.k_row_stride, n * kBN, seqlen_k(), p.headdim, tid);
  if constexpr (Cfg::kKVDoubleBuffer) {
    load_tile_async<KVTile, kThreads, kPartialD>(sV, v, p.v_row_stride, n * kBN, seqlen_k(), p.headdim, tid);
  }
  cp_async_commit();

  float o[kMT][Tr::kOTiles][4];
  float row_max[kMT][2];
  float row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kOTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[mt][nt][i] = 0.f;
    }
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  // Q (and the first K, and V with kv2) have landed for every thread.
  cp_async_wait<0>();
  __syncthreads();

  uint32_t q_frag[Cfg::kQInRegs ? kMT : 1][Cfg::kQInRegs ? Tr::kQKSteps : 1][4];
  // Per-lane ldmatrix addresses (one register each, see LdsmAddr).
  const LdsmAddr<QTile> q_addr = a_frag_addr<QTile>(sQ, warp_row0, lane);
  const LdsmAddr<KVTile> k_addr0 = b_frag_addr<KVTile>(sK, lane);
  const LdsmAddr<KVTile> v_addr0 = bt_frag_addr<KVTile>(sV, lane);
  if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int ks = 0; ks < Tr::kQKSteps; ++ks) ldmatrix_x4(q_frag[mt][ks], q_addr.at(mt * 16, ks));
    }
  }

  const int query0 = row0 + warp_row0;  // first query row of this warp

  // Tiles n >= n_plain need a mask: the ragged last tile (keys past Sk) and
  // those reaching right of the first row's last key (key > row0 + right_off).
  // Tiles n < n_left reach left of the last row's first key (a left window).
  // Iterating right to left, the right edge comes first, the left edge last;
  // the tiles between are entirely visible to every row of the block.
  const int visible_end = has_right ? min(seqlen_k(), row0 + right_off + 1) : seqlen_k();
  const int n_plain = visible_end > 0 ? visible_end / kBN : 0;
  const int left_need = has_left ? row_last + left_off : 0;
  const int n_left = kVariants && left_need > 0 ? ceil_div(left_need, kBN) : 0;

  // kVariants: per-block constants of modify_scores; score_units: S is in score
  // units after it (softcap or ALiBi), so its exp2 factor is log2(e), not scale * log2(e).
  const float softcap = kVariants ? p.variants.softcap : 0.f;
  const float cap_in = softcap > 0.f ? p.scale / softcap : 0.f;
  const float slope = kVariants && p.variants.alibi_slopes != nullptr
                          ? p.variants.alibi_slopes[batch * p.variants.alibi_batch_stride + head]
                          : 0.f;
  const bool score_units = kVariants && (softcap > 0.f || p.variants.alibi_slopes != nullptr);
  constexpr float kLog2e = 1.4426950408889634f;
  const float exp_scale = score_units ? kLog2e : p.scale_log2;

  // One key tile: loads for the next tile, S = Q K^T, (mask), softmax, O += P V.
  // A single loop with a block-uniform branch around the mask: peeling the
  // masked tiles into a loop of their own duplicates the body and costs
  // registers (ptxas then spills), for no gain in the unmasked steps.
  uint32_t stage_off = 0;  // kv2: byte offset of the stage holding tile n (toggles)
  for (; n >= n_first; --n) {
    const LdsmAddr<KVTile> k_addr = k_addr0.shifted(stage_off);
    const LdsmAddr<KVTile> v_addr = v_addr0.shifted(stage_off);

    if constexpr (Cfg::kKVDoubleBuffer) {
      // Prefetch tile n-1 into the other stage; the barrier that ended the
      // previous step guarantees every warp is done reading it.
      if (n > n_first) {
        const uint32_t other = stage_off ^ KVTile::kBytes;
        load_tile_async<KVTile, kThreads, kPartialD>(sK + other, k, p.k_row_stride, (n - 1) * kBN, seqlen_k(), p.headdim,
                                          tid);
        load_tile_async<KVTile, kThreads, kPartialD>(sV + other, v, p.v_row_stride, (n - 1) * kBN, seqlen_k(), p.headdim,
                                          tid);
      }
      cp_async_commit();
    } else {
      // V_n streams in under Q K_n^T; the barrier that ended the previous
      // step guarantees every warp is done with P V_{n+1}.
      load_tile_async<KVTile, kThreads, kPartialD>(sV, v, p.v_row_stride, n * kBN, seqlen_k(), p.headdim, tid);
      cp_async_commit();
    }

    float s[kMT][Tr::kSTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.f;
      }
    }
    gemm_qk<Cfg>(s, q_frag, q_addr, k_addr);
    if constexpr (kVariants) {
      if (score_units) modify_scores<Cfg>(s, n * kBN, query0, lane, diag, p.scale, softcap, cap_in, slope);
    }
    if (n >= n_plain || n < n_left) {
      mask_scores<Cfg, kVariants>(s, n * kBN, query0, lane, seqlen_k(), has_right, right_off, has_left, left_off);
    }

    if constexpr (!Cfg::kKVDoubleBuffer) {
      // V_n has landed for every thread, and every warp is done reading K_n,
      // so K_{n-1} may overwrite it; it streams in under softmax and P V_n.
      cp_async_wait<0>();
      __syncthreads();
      if (n > n_first) {
        load_tile_async<KVTile, kThreads, kPartialD>(sK, k, p.k_row_stride, (n - 1) * kBN, seqlen_k(), p.headdim, tid);
      }
      cp_async_commit();
    }

    softmax_update<Cfg>(s, o, row_max, row_sum, exp_scale);
    gemm_pv<Cfg>(o, s, v_addr);

    if (n > n_first) {
      // kv2: tile n-1 has landed for every thread, and every warp is done with
      // this step's stage, which the next step's prefetch overwrites.
      // Otherwise: K_{n-1} has landed, and every warp is done with P V_n, so
      // the next step's V load may overwrite the V buffer.
      cp_async_wait<0>();
      __syncthreads();
    }
    stage_off ^= Cfg::kKVDoubleBuffer ? KVTile::kBytes : 0u;
  }

  // ---- Epilogue: normalise, write lse, stage O through shared memory. ----
  // (Output pointers are formed only now so they hold no registers in the loop.)
  Elem* out = output_ptr<Cfg>(p, batch, head) + q_start * p.o_row_stride;
  float* lse = lse_ptr(p, batch, head) + q_start;
  const float* sinks = p.variants.sinks;
  const float sink = sinks != nullptr ? sinks[head] : 0.f;
  const float max_scale = score_units ? 1.f : p.scale;  // row_max in score units
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // sum >= 1 once the row has seen any key (its max contributes exp2(0));
      // sum == 0 means no visible key: out = 0, lse = -inf.
      const bool seen = sum > 0.f;
      float inv = seen ? 1.f / sum : 0.f;
      float row_lse = seen ? row_max[mt][h] * max_scale + __logf(sum) : -INFINITY;
      if (sinks != nullptr) {
        // l = sum * exp(m) + exp(sink), taken relative to the larger of the two
        // (m = -inf when no key is seen: out 0, lse = sink).
        const float m = seen ? row_max[mt][h] * max_scale : -INFINITY;
        const float top = fmaxf(m, sink);
        const float w = seen ? __expf(m - top) : 0.f;
        const float total = sum * w + __expf(sink - top);
        inv = top == -INFINITY ? 0.f : w / total;  // (a sink of -inf on a row without keys)
        row_lse = top == -INFINITY ? -INFINITY : top + __logf(total);
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kOTiles; ++nt) {
        o[mt][nt][2 * h] *= inv;
        o[mt][nt][2 * h + 1] *= inv;
      }
      const int row = query0 + mt * 16 + (lane >> 2) + 8 * h;
      if constexpr (kPacked) {
        // Rows past seqused_q (their Q loaded as zeros) are written as rows that take no part.
        if (row >= seqlen_q()) {
          row_lse = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < Tr::kOTiles; ++nt) o[mt][nt][2 * h] = o[mt][nt][2 * h + 1] = 0.f;
        }
      }
      if ((lane & 3) == 0 && row < q_len()) lse[row] = row_lse;
    }
  }

  // The output tile reuses this warp's own rows of the Q buffer. No other warp
  // reads them and no copy is in flight into Q, so a warp-level barrier (all
  // lanes' last ldmatrix of these rows done) is enough.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kOTiles; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + mt * 16 + (lane >> 2) + 8 * h;
        // Rows g = 0..7 at the same chunk land in 8 different bank groups
        // (swizzle) and the 4 lanes of a row fill one group: conflict-free.
        const uint32_t off = QTile::offset(row, nt) + (lane & 3) * 4;
        *reinterpret_cast<uint32_t*>(smem + off) =
            pack2<Elem>(o[mt][nt][2 * h], o[mt][nt][2 * h + 1]);
      }
    }
  }
  __syncwarp();

  // 16-byte chunks out, in the same block-row order as the loads: 8 (or 4)
  // consecutive lanes write one contiguous 128-byte (64-byte) global segment.
  constexpr int kCPB = QTile::kChunksPerBlockRow;
  constexpr int kRowsPerPass = 32 / kCPB;
  static_assert(Cfg::kRowsPerWarp % kRowsPerPass == 0, "warp rows must tile the store passes");
#pragma unroll
  for (int blk = 0; blk < QTile::kColBlocks; ++blk) {
#pragma unroll
    for (int pass = 0; pass < Cfg::kRowsPerWarp / kRowsPerPass; ++pass) {
      const int row = warp_row0 + pass * kRowsPerPass + lane / kCPB;
      const int chunk = blk * kCPB + lane % kCPB;
      const uint4 val = *reinterpret_cast<const uint4*>(smem + QTile::offset(row, chunk));
      if (row0 + row < q_len() && (!kPartialD || chunk * 8 < p.headdim)) {
        *reinterpret_cast<uint4*>(out + int64_t(row0 + row) * p.o_row_stride + chunk * 8) = val;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Host launcher; the generator instantiates it once per config.
// Sk == 0 needs no special case: every query tile is then empty and writes
// out = 0, lse = -inf (the sink).
template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  if (p.headdim > Cfg::kHeadDim || p.headdim < 8 || p.headdim % 8 != 0 || p.head_ratio < 1) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return cudaSuccess;  // nothing to write
  constexpr int kSmem = int(Cfg::kSmemBytes);
  const bool partial = p.headdim < Cfg::kHeadDim;
  const bool packed = p.packed.packed();
  const bool mod = p.variants.window_left >= 0 || p.variants.softcap > 0.f || p.variants.alibi_slopes != nullptr;
  auto* kernel = packed ? (partial ? &fwd_kernel<Cfg, true, true, true> : &fwd_kernel<Cfg, false, true, true>)
                 : partial ? (mod ? &fwd_kernel<Cfg, true, true, false> : &fwd_kernel<Cfg, true, false, false>)
                           : (mod ? &fwd_kernel<Cfg, false, true, false> : &fwd_kernel<Cfg, false, false, false>);
  const int which = packed ? 4 + int(partial) : 2 * int(partial) + int(mod);
  if (kSmem > 48 * 1024) {  // dynamic shared memory beyond 48 KiB must be opted into
    static std::atomic<unsigned long long> configured[6] = {{0}, {0}, {0}, {0}, {0}, {0}};
    const cudaError_t err = set_kernel_smem_once(configured[which], kernel, kSmem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(ceil_div(p.seqlen_q, Cfg::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Cfg::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sm80
}  // namespace flashop

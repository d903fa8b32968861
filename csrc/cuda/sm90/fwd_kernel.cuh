// FlashAttention-3-style forward for sm_90a: TMA loads, a 2-stage K/V ring
// guarded by mbarriers, warp specialisation (1 producer warpgroup + 2 consumer
// warpgroups of 64 query rows each), wgmma for S = Q K^T (both operands from
// shared memory) and O += P V (P from registers, V MN-major from shared memory).
//
// Per CTA: one query tile of kBlockM = 128 rows of one (batch, head).
//   producer (warpgroup 0, setmaxnreg.dec 24; one thread): Q once, then for
//     every key tile j: wait empty[s] (s = j % 2, from its 2nd use on) ->
//     expect_tx + TMA K_j -> full_k[s], expect_tx + TMA V_j -> full_v[s]
//   consumer c (warpgroups 1, 2; setmaxnreg.inc 240; rows 64c .. 64c+63):
//     tile 0:  [turn] S_0 = Q K_0^T [pass]; softmax_0 -> P_0
//     tile j:  [turn] issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1} [pass];
//              wait S_j; mask; softmax_j (under the PV GEMM);
//              wait PV; arrive empty[stage of j-1]; O *= corr_j; P_j -> regs
//     end:     O += P_{n-1} V_{n-1}; arrive empty
//   [turn]/[pass]: named barriers 1/2 ping-pong the two consumers so one's
//   softmax runs under the other's GEMMs.
//   epilogue: O /= l, lse = m*scale + ln l; plain stores (rows < Sq).
//
// Shared-memory tiles are rows of 64 elements (128 bytes) in the TMA/wgmma
// 128-byte swizzle; a head dimension of D is kept as D/64 such column blocks.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../fwd_params.h"
#include "primitives.cuh"
#include "wgmma.cuh"

namespace flashop {
namespace sm90 {

template <bool kBf16_, int kHeadDim_, int kBlockM_, int kBlockN_, bool kPingPong_ = true>
struct Sm90FwdTraits {
  static constexpr bool kBf16 = kBf16_;
  // Named-barrier ping-pong between the consumer warpgroups (off: "nopp"
  // variant, same loop without the turn barriers; an A/B and debugging aid).
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = 2;
  static constexpr int kConsumerWGs = kBlockM / 64;
  static constexpr int kThreads = 128 * (kConsumerWGs + 1);
  static constexpr int kDBlocks = kHeadDim / 64;  // 64-element (128-byte) column blocks

  static_assert(kBlockM == 128, "two consumer warpgroups of 64 rows");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 64 or 128");
  static_assert(kBlockN == 64 || kBlockN == 128, "wgmma N of S");

  static constexpr int kQBlockBytes = kBlockM * 128;  // one column block of Q
  static constexpr int kKVBlockBytes = kBlockN * 128;
  static constexpr int kQBytes = kQBlockBytes * kDBlocks;
  static constexpr int kKVBytes = kKVBlockBytes * kDBlocks;  // one K (or V) tile
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBytes;
  static constexpr int kVOff = kKOff + kStages * kKVBytes;
  static constexpr int kBarOff = kVOff + kStages * kKVBytes;
  // barriers: q_full, full_k[2], full_v[2], empty[2]
  static constexpr int kNumBars = 1 + 3 * kStages;
  static constexpr int kSmemUsed = kBarOff + 8 * kNumBars;
  static constexpr int kSmemBytes = kSmemUsed + 1024;  // + slack for 1024-byte alignment

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= 65536, "regs");
};

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// Number of key tiles the CTA visits (identical for producer and consumers).
template <class T>
__device__ __forceinline__ int num_key_tiles(const FwdParams& p, int q_tile) {
  int key_end = p.seqlen_k;
  if (p.causal) {
    const int last_row = min((q_tile + 1) * T::kBlockM, p.seqlen_q) - 1;
    // query i sees key j iff j <= i + Sk - Sq
    key_end = min(key_end, last_row + p.seqlen_k - p.seqlen_q + 1);
  }
  return key_end <= 0 ? 0 : (key_end + T::kBlockN - 1) / T::kBlockN;
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    fwd_kernel_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ FwdParams p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim;
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  const uint32_t sQ = base + T::kQOff;
  const uint32_t sK = base + T::kKOff;
  const uint32_t sV = base + T::kVOff;
  const uint32_t bar_q = base + T::kBarOff;
  auto bar_full_k = [&](int s) { return bar_q + 8u * (1 + s); };
  auto bar_full_v = [&](int s) { return bar_q + 8u * (1 + T::kStages + s); };
  auto bar_empty = [&](int s) { return bar_q + 8u * (1 + 2 * T::kStages + s); };

  // Highest query tiles first: under causal masking they see the most keys.
  const int q_tile = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / p.head_ratio;
  const int n_tiles = num_key_tiles<T>(p, q_tile);

  const int tid = threadIdx.x;
  const int wg = tid / 128;

  if (tid == 0) {
    tma_prefetch_desc(&tm_q);
    tma_prefetch_desc(&tm_k);
    tma_prefetch_desc(&tm_v);
    mbar_init(bar_q, 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(bar_full_k(s), 1);
      mbar_init(bar_full_v(s), 1);
      mbar_init(bar_empty(s), 4 * T::kConsumerWGs);  // one arrival per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0 && n_tiles > 0) {
      mbar_arrive_expect_tx(bar_q, T::kQBytes);
#pragma unroll
      for (int b = 0; b < T::kDBlocks; ++b)
        tma_load_4d(&tm_q, sQ + b * T::kQBlockBytes, bar_q, b * 64, q_tile * kBM, head, batch);
      for (int j = 0; j < n_tiles; ++j) {
        const int s = j % T::kStages;
        const int use = j / T::kStages;
        if (use > 0) mbar_wait(bar_empty(s), (use - 1) & 1);
        mbar_arrive_expect_tx(bar_full_k(s), T::kKVBytes);
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b)
          tma_load_4d(&tm_k, sK + s * T::kKVBytes + b * T::kKVBlockBytes, bar_full_k(s), b * 64,
                      j * kBN, kv_head, batch);
        mbar_arrive_expect_tx(bar_full_v(s), T::kKVBytes);
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b)
          tma_load_4d(&tm_v, sV + s * T::kKVBytes + b * T::kKVBlockBytes, bar_full_v(s), b * 64,
                      j * kBN, kv_head, batch);
      }
    }
    return;
  }

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = wg - 1;              // consumer index: rows 64c .. 64c+63 of the tile
  const int ctid = tid - 128 * wg;   // 0..127 within the warpgroup
  const int warp = ctid / 32;
  const int lane = ctid % 32;
  // This thread's two rows (within the CTA's query tile) and global query index.
  const int row_in_tile = 64 * c + 16 * warp + lane / 4;
  const int q_row0 = q_tile * kBM + row_in_tile;  // rows q_row0 and q_row0 + 8
  const int col_base = 2 * (lane % 4);

  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // per-thread partial row sums (reduced over the quad at the end)
  const float sl2 = p.scale_log2;
  const int diag = p.seqlen_k - p.seqlen_q;  // query i sees key j iff j <= i + diag

  // S = Q K_j^T for this warpgroup's 64 rows (issued, not waited for).
  auto issue_s = [&](float (&sacc)[kBN / 2], int s) {
    fence_regs(sacc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const int b = kk / 4, t = kk % 4;
      const uint64_t da =
          make_desc_sw128(sQ + b * T::kQBlockBytes + c * 64 * 128 + t * 32, 16, 1024);
      const uint64_t db =
          make_desc_sw128(sK + s * T::kKVBytes + b * T::kKVBlockBytes + t * 32, 16, 1024);
      wgmma_ss<T::kBf16, kBN, 0>(sacc, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // O += P V_j   (V: keys x D, D contiguous -> MN-major B; N = D spans D/64
  // column blocks kKVBlockBytes apart = LBO; 8 keys per 1024-byte atom = SBO).
  auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int s) {
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kBN / 16; ++t) {
      const uint64_t db = make_desc_sw128(sV + s * T::kKVBytes + t * 2048, T::kKVBlockBytes, 1024);
      wgmma_rs<T::kBf16, kD, 1>(o, pa[t], db, 1);
    }
    wgmma_commit();
  };
  // Keys past Sk, and (causal) keys past the diagonal, become -inf.
  auto mask = [&](float (&sacc)[kBN / 2], int j) {
    const int key0 = j * kBN;
    const bool need_mask = (key0 + kBN > p.seqlen_k) ||
                           (p.causal && key0 + kBN - 1 > q_tile * kBM + 64 * c + diag);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * i + col_base + (e & 1);
          const int row = q_row0 + 8 * (e >> 1);
          const bool bad = key >= p.seqlen_k || (p.causal && key > row + diag);
          if (bad) sacc[4 * i + e] = -INFINITY;
        }
      }
    }
  };
  // Online softmax on S (raw-score running max; exp2 with scale*log2e folded).
  // S becomes P in place; returns the rescale factors of the old O and l.
  auto softmax = [&](float (&sacc)[kBN / 2], float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i)
        mx = fmaxf(mx, fmaxf(sacc[4 * i + 2 * h], sacc[4 * i + 2 * h + 1]));
      mx = quad_max(mx);
      // -inf guard: a row that has only seen masked keys keeps m = -inf; its
      // reference is 0 so that -inf - -inf never makes a NaN (P = 0, O stays 0).
      const float ref = (mx == -INFINITY) ? 0.f : mx * sl2;
      corr[h] = (mx == -INFINITY) ? 1.f : exp2f(m[h] * sl2 - ref);
      m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
        const float p0 = exp2f(fmaf(sacc[4 * i + 2 * h], sl2, -ref));
        const float p1 = exp2f(fmaf(sacc[4 * i + 2 * h + 1], sl2, -ref));
        sacc[4 * i + 2 * h] = p0;
        sacc[4 * i + 2 * h + 1] = p1;
        sum += p0 + p1;
      }
      l[h] = l[h] * corr[h] + sum;
    }
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      o[4 * i + 0] *= corr[0];
      o[4 * i + 1] *= corr[0];
      o[4 * i + 2] *= corr[1];
      o[4 * i + 3] *= corr[1];
    }
  };
  // P (accumulator layout) -> A fragments: k16 step t takes n8 blocks 2t, 2t+1.
  auto convert_p = [&](const float (&sacc)[kBN / 2], uint32_t (&pa)[kBN / 16][4]) {
#pragma unroll
    for (int t = 0; t < kBN / 16; ++t) {
      pa[t][0] = pack2<T::kBf16>(sacc[8 * t + 0], sacc[8 * t + 1]);  // row r,   k 0..7
      pa[t][1] = pack2<T::kBf16>(sacc[8 * t + 2], sacc[8 * t + 3]);  // row r+8, k 0..7
      pa[t][2] = pack2<T::kBf16>(sacc[8 * t + 4], sacc[8 * t + 5]);  // row r,   k 8..15
      pa[t][3] = pack2<T::kBf16>(sacc[8 * t + 6], sacc[8 * t + 7]);  // row r+8, k 8..15
    }
  };
  // Release a K/V stage: one arrival per warp once its wgmmas are complete.
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_empty(s));
  };

  // Ping-pong between the two consumer warpgroups (named barriers 1 and 2, 256
  // threads): a warpgroup issues its GEMMs only on its turn, then hands the
  // turn over, so its softmax runs under the other warpgroup's GEMMs.
  // Turns alternate c=0, c=1, c=0, ...; warpgroup 1 opens the first turn of
  // warpgroup 0 and skips the hand-over after its last turn, so every bar.sync
  // meets exactly one bar.arrive.
  constexpr int kTurnThreads = 256;
  auto wait_turn = [&]() {
    if constexpr (T::kPingPong) {
      if (c == 0) named_bar_sync<1, kTurnThreads>();
      else named_bar_sync<2, kTurnThreads>();
    }
  };
  auto pass_turn = [&](bool last) {
    if constexpr (T::kPingPong) {
      if (c == 0) named_bar_arrive<2, kTurnThreads>();
      else if (!last) named_bar_arrive<1, kTurnThreads>();
    }
  };

  if (n_tiles > 0) {
    if constexpr (T::kPingPong) {
      if (c == 1) named_bar_arrive<1, kTurnThreads>();
    }
    mbar_wait(bar_q, 0);

    float sacc[kBN / 2];
    uint32_t pa[kBN / 16][4];
    float corr[2];

    // tile 0: S only
    mbar_wait(bar_full_k(0), 0);
    wait_turn();
    issue_s(sacc, 0);
    pass_turn(n_tiles == 1);
    wgmma_wait<0>();
    fence_regs(sacc);
    mask(sacc, 0);
    softmax(sacc, corr);  // O is still 0: no rescale needed
    convert_p(sacc, pa);

    for (int j = 1; j < n_tiles; ++j) {
      const int s = j % T::kStages;
      const int sp = (j - 1) % T::kStages;
      mbar_wait(bar_full_k(s), (j / T::kStages) & 1);
      mbar_wait(bar_full_v(sp), ((j - 1) / T::kStages) & 1);
      wait_turn();
      issue_s(sacc, s);   // S_j = Q K_j^T
      issue_pv(pa, sp);   // O += P_{j-1} V_{j-1}
      pass_turn(j == n_tiles - 1);
      wgmma_wait<1>();    // S_j done (PV may still run)
      fence_regs(sacc);
      mask(sacc, j);
      softmax(sacc, corr);
      wgmma_wait<0>();    // PV done: O and P_{j-1} free again
      fence_regs(o);
      release(sp);
      rescale_o(corr);
      convert_p(sacc, pa);
    }

    // last tile's P V
    const int sl = (n_tiles - 1) % T::kStages;
    mbar_wait(bar_full_v(sl), ((n_tiles - 1) / T::kStages) & 1);
    issue_pv(pa, sl);
    wgmma_wait<0>();
    fence_regs(o);
    release(sl);
  }

  // -------------------------------------------------------------- epilogue
  Elem* out = reinterpret_cast<Elem*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride;
  float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = q_row0 + 8 * h;
    const float sum = quad_sum(l[h]);
    const bool seen = sum > 0.f;  // no visible key: out = 0, lse = -inf
    const float inv = seen ? 1.f / sum : 0.f;
    if (row < p.seqlen_q) {
      Elem* orow = out + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        const uint32_t v = pack2<T::kBf16>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
        *reinterpret_cast<uint32_t*>(orow + 8 * i + col_base) = v;
      }
      if ((lane % 4) == 0) lse[row] = seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
    }
  }
#endif
}

}  // namespace sm90
}  // namespace flashop

// How much of the tensor pipe's peak a stream of wgmmas reaches per SM clock, by instruction shape and by
// the d128 forward's GEMM mix with no softmax between the GEMMs: the ceiling the attention kernel's own
// share of the peak (TFLOP/s per GHz over 132 x 4096 FLOP per clock) is measured against.
//
//   nvcc -arch=sm_90a -std=c++17 --use_fast_math -Icsrc -o /tmp/wgmma_rate tools/wgmma_rate.cu && /tmp/wgmma_rate
//
// One CTA per SM (one idle producer warpgroup, two consumer warpgroups with 240 registers, as the
// forward kernel). Each consumer issues `kIters` groups; a group is kSSteps wgmmas m64 n kSN k16 with
// both operands from shared memory (the S = Q K^T GEMM) then kPVSteps wgmmas m64 n kPVN k16 with A
// from registers and B MN-major (the P V GEMM), one commit, then a wait for the group. With kPingPong the two
// consumers issue their groups in turns on named barriers, as the forward kernel does. Cycles are
// clock64 (SM clocks, so the figure does not depend on the clock the power limit allows). Operands
// are random bf16 values; the results are summed into an output so nothing is optimised away.
// Then the d128 forward's loop with its softmax (attention_loop_body), resident (one CTA per SM) and as a
// grid of one-query-tile CTAs with their Q load and O store; and the resident loop in variants
// (attention_loop_variant): two or three consumer warpgroups, P V reading P from registers or from shared
// memory, the forward kernel's ring hand-shake, softmax guards and mask test added one at a time.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda/sm90/primitives.cuh"
#include "cuda/sm90/softmax.cuh"
#include "cuda/sm90/wgmma.cuh"

using namespace flashop::sm90;

constexpr int kIters = 4096;
// A: 64 x 64 bf16 (8 KiB), then B: 256 x 64 bf16 (32 KiB); 120 KiB asked for so one CTA runs per SM.
constexpr int kSmemBytes = 120 * 1024;

// Small random-looking bf16 values (magnitude 2^-7 to 2^-4; no NaN or Inf) in the A then B tiles.
__device__ __forceinline__ void fill_random_operands(uint8_t* smem) {
  for (int i = threadIdx.x; i < (8 + 32) * 1024 / 2; i += blockDim.x) {
    const uint32_t h = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    reinterpret_cast<uint16_t*>(smem)[i] = static_cast<uint16_t>(0x3c00 | (h & 0x80ff)) ^ 0x0100;
  }
}

// Descriptors of the operand tiles at `base` (1024-byte aligned): A (64 rows of K) at base, B K-major
// (rows of K) at base + 8 KiB, and the same bytes as P V's B operand V, MN-major (D contiguous): 64-column
// blocks 16 KiB apart, a k16 step = 2048 bytes.
struct OperandDescs {
  uint64_t a, b, v;
};
__device__ __forceinline__ OperandDescs operand_descs(uint32_t base) {
  return {make_desc_sw128(base, 16, 1024), make_desc_sw128(base + 8 * 1024, 16, 1024),
          make_desc_sw128(base + 8 * 1024, 16 * 1024, 1024)};
}

// The dynamic shared memory, 1024-byte aligned (the 128B swizzle's atom): its shared-space address.
__device__ __forceinline__ uint32_t aligned_smem_base(uint8_t* smem_raw, uint8_t*& smem) {
  const uint32_t base = (smem_u32(smem_raw) + 1023) & ~1023u;
  smem = smem_raw + (base - smem_u32(smem_raw));
  return base;
}

template <int kSN, int kSSteps, int kPVN, int kPVSteps, bool kPingPong>
__global__ void __launch_bounds__(384, 1) rate_kernel(long long* cycles, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = nullptr;
  const uint32_t base = aligned_smem_base(smem_raw, smem);
  fill_random_operands(smem);
  __syncthreads();
  // The producer warpgroup (idle here) gives its registers to the consumers, as in the forward kernel.
  // Kept inline: behind a helper that returns the role, ptxas ignores the setmaxnreg (C7507) and spills.
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
    return;
  }
  setmaxnreg_inc<240>();
  const int c = wg - 1;
  const auto [desc_a, desc_b, desc_v] = operand_descs(base);
  float s_acc[kSN > 0 ? kSN / 2 : 1] = {};
  float o_acc[kPVN > 0 ? kPVN / 2 : 1] = {};
  uint32_t a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f00u ^ (threadIdx.x * 0x00010001u & 0x007f007fu);

  // Turns: consumer c waits on barrier 1 + c and hands over on barrier 2 - c. The ids are registers, not
  // branches on c, so that no wgmma sits in a path ptxas sees as divergent (it then serialises them).
  const uint32_t my_turn = 1 + c, next_turn = 2 - c;
  named_bar_sync<3, 256>();
  const long long t0 = clock64();
  if (kPingPong && c == 1) named_bar_arrive<1, 256>();  // consumer 0 takes the first turn
  for (int it = 0; it < kIters; ++it) {
    if constexpr (kPingPong) asm volatile("bar.sync %0, 256;" ::"r"(my_turn) : "memory");
    wgmma_fence();
    if constexpr (kSN > 0) {
#pragma unroll
      for (int k = 0; k < kSSteps; ++k) wgmma_ss<true, kSN, 0>(s_acc, desc_a + 2 * (k % 4), desc_b + 2 * (k % 4), 1);
    }
    if constexpr (kPVN > 0) {
#pragma unroll
      for (int k = 0; k < kPVSteps; ++k) wgmma_rs<true, kPVN, 1>(o_acc, a, desc_v + 128 * (k % 4), 1);
    }
    wgmma_commit();
    if constexpr (kPingPong) asm volatile("bar.arrive %0, 256;" ::"r"(next_turn) : "memory");
    wgmma_wait<0>();
    if constexpr (kSN > 0) fence_regs(s_acc);
    if constexpr (kPVN > 0) fence_regs(o_acc);
  }
  if (kPingPong && c == 0) named_bar_sync<1, 256>();  // consumer 1's last hand-over
  named_bar_sync<3, 256>();
  const long long t1 = clock64();
  float sum = 0.f;
  for (float x : s_acc) sum += x;
  for (float x : o_acc) sum += x;
  atomicAdd(sink, sum);
  if (threadIdx.x == 128) cycles[blockIdx.x] = t1 - t0;
}

// S = Q K^T of one warpgroup turn at d128: 8 SS wgmmas (m64 n kBN k16) as one commit group.
template <int kBN>
__device__ __forceinline__ void issue_s_group(float (&s_acc)[kBN / 2], uint64_t desc_a, uint64_t desc_b) {
  fence_regs(s_acc);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 8; ++k) wgmma_ss<true, kBN, 0>(s_acc, desc_a + 2 * (k % 4), desc_b + 2 * (k % 4), k > 0);
  wgmma_commit();
}

// The d128 forward's main loop without its loads, masks and epilogue: in turns, S_j = Q K^T (8 SS
// m64 n kBN k16) and O += P_{j-1} V (kBN/16 RS m64n128k16) as two commit groups; then, as the kernel
// does, wait for S, the online softmax of its two rows per thread (max, quad max, exp2, sum), wait for
// P V, rescale O, and convert P to the A fragments of the next P V. Shows what the softmax between the
// GEMMs costs the tensor pipe when every operand is already in shared memory.
// As a grid (clock_ns not null): one CTA per query tile, `iters` key tiles each; with q_in and o_out, each CTA
// first copies 40 KiB of operands from global memory (as the kernel waits for Q and K_0) and at the end
// stores a 32 KiB "O"; thread 128 records its SM clock and the global timer at both ends (clock_ns: 4 per
// CTA) so the host can turn elapsed time into clocks.
template <int kBN>
__device__ __forceinline__ void attention_loop_body(long long* cycles, float* sink, int iters, const uint4* q_in,
                                                    uint4* o_out, unsigned long long* clock_ns, int prefetch_ahead) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = nullptr;
  const uint32_t base = aligned_smem_base(smem_raw, smem);
  unsigned long long clk0 = clock64(), ns0 = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns0));
  if (q_in != nullptr) {  // the operands (40 KiB: about Q's 32 KiB and part of K_0) from global memory
    for (int i = threadIdx.x; i < 2560; i += blockDim.x)
      reinterpret_cast<uint4*>(smem)[i] = q_in[static_cast<size_t>(blockIdx.x) * 2560 + i];
    fence_proxy_async_smem();  // generic-proxy writes, then wgmma (async proxy) reads
  } else if (clock_ns == nullptr) {  // resident: random operands
    fill_random_operands(smem);
  }  // else (a grid without memory traffic) whatever shared memory holds: the timing does not depend on it
  __syncthreads();
  // The producer warpgroup (idle here) gives its registers to the consumers, as in the forward kernel.
  // Kept inline: behind a helper that returns the role, ptxas ignores the setmaxnreg (C7507) and spills.
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
    return;
  }
  setmaxnreg_inc<240>();
  const int c = wg - 1;
  const auto [desc_a, desc_b, desc_v] = operand_descs(base);
  float s_acc[kBN / 2];
  float o_acc[64] = {};
  uint32_t pa[kBN / 16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = 0.1275f;  // 1/sqrt(128) * log2(e)

  const uint32_t my_turn = 1 + c, next_turn = 2 - c;
  named_bar_sync<3, 256>();
  const long long t0 = clock64();
  if (c == 1) named_bar_arrive<1, 256>();
  for (int it = 0; it < iters; ++it) {
    // prefetch_ahead > 0: halfway through, one thread asks L2 for the operands of CTA blockIdx.x +
    // prefetch_ahead (the one that will start about a wave later), so they do not come from DRAM then.
    if (prefetch_ahead > 0 && it == iters / 2 && threadIdx.x == 128 &&
        blockIdx.x + prefetch_ahead < gridDim.x) {
      const uint4* next = q_in + static_cast<size_t>(blockIdx.x + prefetch_ahead) * 2560;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(next), "r"(40 * 1024) : "memory");
    }
    asm volatile("bar.sync %0, 256;" ::"r"(my_turn) : "memory");
    issue_s_group<kBN>(s_acc, desc_a, desc_b);
#pragma unroll
    for (int t = 0; t < kBN / 16; ++t) wgmma_rs<true, 128, 1>(o_acc, pa[t], desc_v + 128 * (t % 4), 1);
    wgmma_commit();
    asm volatile("bar.arrive %0, 256;" ::"r"(next_turn) : "memory");
    wgmma_wait<1>();
    fence_regs(s_acc);
    // The online softmax as the kernel runs it (softmax.cuh), without the -inf guards this loop does not
    // need: every score here is finite.
    float corr[2];
    online_softmax<kBN, false>(s_acc, m, l, corr, sl2);
    wgmma_wait<0>();
    fence_regs(o_acc);
    rescale_rows<128>(o_acc, corr);
    p_to_a_fragments<true, kBN>(s_acc, pa);
  }
  if (c == 0) named_bar_sync<1, 256>();
  named_bar_sync<3, 256>();
  const long long t1 = clock64();
  if (o_out != nullptr) {  // 64 rows x 128 bf16 per warpgroup, 16 bytes a thread per store
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint4 v = make_uint4(pack2<true>(o_acc[8 * i], o_acc[8 * i + 1]), pack2<true>(o_acc[8 * i + 2], o_acc[8 * i + 3]),
                                 pack2<true>(o_acc[8 * i + 4], o_acc[8 * i + 5]), pack2<true>(o_acc[8 * i + 6], o_acc[8 * i + 7]));
      o_out[(static_cast<size_t>(blockIdx.x) * 8 + i) * 256 + (threadIdx.x - 128)] = v;
    }
  } else {
    float sum = l[0] + l[1];
    for (float x : o_acc) sum += x;
    if (clock_ns == nullptr) atomicAdd(sink, sum);
    else if (sum == 1234.5f) *sink = sum;  // a grid: kept live without thousands of atomics on one address
  }
  if (threadIdx.x == 128) {
    if (cycles != nullptr) cycles[blockIdx.x] = t1 - t0;
    if (clock_ns != nullptr) {
      unsigned long long ns1 = 0;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns1));
      clock_ns[4 * blockIdx.x + 0] = clk0;
      clock_ns[4 * blockIdx.x + 1] = clock64();
      clock_ns[4 * blockIdx.x + 2] = ns0;
      clock_ns[4 * blockIdx.x + 3] = ns1;
    }
  }
}

// The same loop, resident (one CTA per SM) and without loads, in variants:
// * kWGs consumer warpgroups (2 or 3: query rows 64 kWGs) taking turns.
// * kPSmem: the P V wgmma reads P from shared memory (SS) instead of registers (RS). After its softmax and its
//   own P V's completion, each warpgroup writes P (bf16) into its 64 x kBN buffer in the 128B-swizzled K-major
//   layout (4-byte st.shared, conflict-free), fences the async proxy and syncs its 128 threads. P then needs no
//   registers between the GEMMs, so three warpgroups fit at d128 (64 O + 64 S accumulators of 160 registers at
//   B_c = 128), and 1.5x the query rows share each K/V tile.
// * kPieces: the forward kernel's other pieces (bit flags), to find what makes the kernel lose more to its
//   softmax than this loop does:
//   kPieceRing: a producer thread and the kernel's K/V ring hand-shake without data: two stages of full
//     barriers (the producer arrives, as after a load) and empty barriers (one arrival per consumer warp, K's
//     after the S wait, V's after the P V wait); consumers wait for K_j and V_j before their turn.
//   kPieceGuards: the softmax with its -inf guards (rows that may have seen only masked keys).
//   kPieceMask: the kernel's per-tile mask test, true on the last tile only (keys from seqlen_k on become -inf).
//   Rearrangements of those pieces (candidate fixes for the kernel):
//   kPieceEarlyTest: the ring's K/V for the next turn tested (mbarrier.test_wait) right after the S wait; the
//     blocking waits before the turn run only when the test said no.
//   kPieceLateRelease: K's slot released together with V's, after the P V wait (one release point per turn).
//   kPieceMaskHoist: the mask test's condition computed before the S wait.
constexpr int kPieceRing = 1, kPieceGuards = 2, kPieceMask = 4;
constexpr int kPieceEarlyTest = 8, kPieceLateRelease = 16, kPieceMaskHoist = 32;
template <int kWGs, int kBN, bool kPSmem, int kPieces>
__global__ void __launch_bounds__(128 * (kWGs + 1), 1) attention_loop_variant(long long* cycles, float* sink,
                                                                             int seqlen_k) {
  static_assert(kPSmem || kWGs == 2, "three warpgroups at d128 fit only without P in registers");
  constexpr int kRegs = kWGs == 2 ? 240 : 160;
  constexpr int kThreads = 128 * kWGs;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = nullptr;
  const uint32_t base = aligned_smem_base(smem_raw, smem);
  // mbarriers after the operands and P buffers: full_k[2], full_v[2], empty_k[2], empty_v[2].
  const uint32_t bars = base + 96 * 1024;
  auto full_k = [&](int s) { return bars + 8 * s; };
  auto full_v = [&](int s) { return bars + 16 + 8 * s; };
  auto empty_k = [&](int s) { return bars + 32 + 8 * s; };
  auto empty_v = [&](int s) { return bars + 48 + 8 * s; };
  fill_random_operands(smem);
  if ((kPieces & kPieceRing) && threadIdx.x == 0) {
    for (int s = 0; s < 2; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(full_v(s), 1);
      mbar_init(empty_k(s), 4 * kWGs);
      mbar_init(empty_v(s), 4 * kWGs);
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<24>();
    if ((kPieces & kPieceRing) && threadIdx.x == 0) {
      // K_g then V_g into slot g % 2, each after the slot's previous use is released.
      for (int g = 0; g < kIters; ++g) {
        const int s = g % 2, use = g / 2;
        if (use > 0) mbar_wait(empty_k(s), (use - 1) & 1);
        mbar_arrive(full_k(s));
        if (use > 0) mbar_wait(empty_v(s), (use - 1) & 1);
        mbar_arrive(full_v(s));
      }
    }
    return;
  }
  setmaxnreg_inc<kRegs>();
  const int c = wg - 1;
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const auto [desc_a, desc_b, desc_v] = operand_descs(base);
  // P buffer of this warpgroup: kBN / 64 column blocks of 64 rows x 128 bytes, after the 40 KiB of operands.
  const uint32_t p_base = base + 40 * 1024 + c * (kBN / 64) * 8192;
  const uint64_t desc_p = make_desc_sw128(p_base, 16, 1024);
  float s_acc[kBN / 2];
  float o_acc[64] = {};
  uint32_t pa[kPSmem ? 1 : kBN / 16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = 0.1275f;
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  const uint32_t my_turn = 1 + c, next_turn = 1 + (c + 1) % kWGs;
  named_bar_sync<8, kThreads>();
  const long long t0 = clock64();
  if (c == kWGs - 1) asm volatile("bar.arrive %0, 256;" ::"r"(1u) : "memory");
  bool next_ready = false;  // kPieceEarlyTest: this turn's K/V tested ready during the previous softmax
  for (int it = 0; it < kIters; ++it) {
    const int s = it % 2;
    if ((kPieces & kPieceRing) && !next_ready) {
      mbar_wait(full_k(s), (it / 2) & 1);
      mbar_wait(full_v(s), (it / 2) & 1);
    }
    asm volatile("bar.sync %0, 256;" ::"r"(my_turn) : "memory");
    issue_s_group<kBN>(s_acc, desc_a, desc_b);
    if constexpr (kPSmem) {
#pragma unroll
      for (int t = 0; t < kBN / 16; ++t)
        wgmma_ss<true, 128, 1>(o_acc, desc_p + 512 * (t / 4) + 2 * (t % 4), desc_v + 128 * (t % 4), 1);
    } else {
#pragma unroll
      for (int t = 0; t < kBN / 16; ++t) wgmma_rs<true, 128, 1>(o_acc, pa[t], desc_v + 128 * (t % 4), 1);
    }
    wgmma_commit();
    asm volatile("bar.arrive %0, 256;" ::"r"(next_turn) : "memory");
    const bool need_mask = (kPieces & kPieceMaskHoist) && (it + 1) * kBN > seqlen_k;
    if (kPieces & kPieceMaskHoist) asm volatile("" ::"r"(static_cast<int>(need_mask)));  // computed here
    wgmma_wait<1>();
    fence_regs(s_acc);
    if ((kPieces & kPieceRing) && !(kPieces & kPieceLateRelease)) release(empty_k(s));
    if (kPieces & kPieceEarlyTest) {
      const int sn = (it + 1) % 2, ph = ((it + 1) / 2) & 1;
      next_ready = mbar_test_wait(full_k(sn), ph);
      next_ready = mbar_test_wait(full_v(sn), ph) && next_ready;
    }
    if (kPieces & kPieceMask) {
      const int key0 = it * kBN;
      if ((kPieces & kPieceMaskHoist) ? need_mask : key0 + kBN > seqlen_k) {
#pragma unroll
        for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (key0 + 8 * i + 2 * (lane % 4) + (e & 1) >= seqlen_k) s_acc[4 * i + e] = -INFINITY;
          }
        }
      }
    }
    float corr[2];
    online_softmax<kBN, (kPieces & kPieceGuards) != 0>(s_acc, m, l, corr, sl2);
    wgmma_wait<0>();
    fence_regs(o_acc);
    if ((kPieces & kPieceRing) && (kPieces & kPieceLateRelease)) {
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(empty_k(s));
        mbar_arrive(empty_v(s));
      }
    } else if (kPieces & kPieceRing) {
      release(empty_v(s));
    }
    rescale_rows<128>(o_acc, corr);
    if constexpr (kPSmem) {
      // n8 block i of rows r (h = 0) and r + 8 (h = 1): 16-byte chunk i % 8 of column block i / 8, swizzled by
      // r % 8 = lane / 4; this thread's 4 bytes at (lane % 4) * 4.
      const uint32_t row_addr = p_base + (16 * warp + lane / 4) * 128 + (lane % 4) * 4;
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
        const uint32_t addr = row_addr + (i / 8) * 8192 + (((i % 8) ^ (lane / 4)) * 16);
        st_shared_b32(addr, pack2<true>(s_acc[4 * i], s_acc[4 * i + 1]));
        st_shared_b32(addr + 8 * 128, pack2<true>(s_acc[4 * i + 2], s_acc[4 * i + 3]));
      }
      fence_proxy_async_smem();
      asm volatile("bar.sync %0, 128;" ::"r"(4u + c) : "memory");
    } else {
      p_to_a_fragments<true, kBN>(s_acc, pa);
    }
  }
  if (c == 0) asm volatile("bar.sync %0, 256;" ::"r"(1u) : "memory");  // the last warpgroup's last hand-over
  named_bar_sync<8, kThreads>();
  const long long t1 = clock64();
  float sum = l[0] + l[1];
  for (float x : o_acc) sum += x;
  atomicAdd(sink, sum);
  if (threadIdx.x == 128) cycles[blockIdx.x] = t1 - t0;
}

// launch(cycles, sink) runs one CTA per SM; the median SM's cycles of the second launch give the share.
template <class Launch>
void time_launch(const char* label, Launch launch, double flop_per_sm, int sms, long long* cycles_d, float* sink_d) {
  launch(cycles_d, sink_d);  // warm-up
  launch(cycles_d, sink_d);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("%s: %s\n", label, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  std::vector<long long> cycles(sms);
  cudaMemcpy(cycles.data(), cycles_d, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  std::sort(cycles.begin(), cycles.end());
  const double share = flop_per_sm / (cycles[sms / 2] * 4096.0);  // per SM per clock against 4096 FLOP
  std::printf("| %s | %.1f%% | %.1f |\n", label, 100.0 * share, share * sms * 4096.0 / 1e3);
}

template <class Kernel>
void time_kernel(const char* label, Kernel kernel, double flop_per_sm, int sms, long long* cycles_d, float* sink_d) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  time_launch(
      label, [&](long long* cycles, float* sink) { kernel<<<sms, 384, kSmemBytes>>>(cycles, sink); }, flop_per_sm,
      sms, cycles_d, sink_d);
}

template <int kSN, int kSSteps, int kPVN, int kPVSteps, bool kPingPong>
void run(const char* label, int sms, long long* cycles_d, float* sink_d) {
  const double flop = 2.0 * kIters * (kSSteps * 64.0 * kSN * 16 * 2 + kPVSteps * 64.0 * kPVN * 16 * 2);
  time_kernel(label, rate_kernel<kSN, kSSteps, kPVN, kPVSteps, kPingPong>, flop, sms, cycles_d, sink_d);
}

template <int kBN>
__global__ void __launch_bounds__(384, 1) attention_loop_resident(long long* cycles, float* sink) {
  attention_loop_body<kBN>(cycles, sink, kIters, nullptr, nullptr, nullptr, 0);
}
template <int kBN>
__global__ void __launch_bounds__(384, 1) attention_loop_kernel(long long* cycles, float* sink, int iters,
                                                                 const uint4* q_in, uint4* o_out,
                                                                 unsigned long long* clock_ns, int prefetch_ahead) {
  attention_loop_body<kBN>(cycles, sink, iters, q_in, o_out, clock_ns, prefetch_ahead);
}

template <int kBN>
void run_attention_loop(const char* label, int sms, long long* cycles_d, float* sink_d) {
  const double flop = 2.0 * kIters * 2 * (64.0 * kBN * 128 * 2);
  time_kernel(label, attention_loop_resident<kBN>, flop, sms, cycles_d, sink_d);
}

// The variant loop; with kPieceMask its last key tile holds 64 keys (as 8k keys in 192-key tiles end in 128).
template <int kWGs, int kBN, bool kPSmem, int kPieces = 0>
void run_attention_variant(const char* label, int sms, long long* cycles_d, float* sink_d) {
  auto kernel = attention_loop_variant<kWGs, kBN, kPSmem, kPieces>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  const double flop = 2.0 * kIters * kWGs * (64.0 * kBN * 128 * 2);
  time_launch(
      label, [&](long long* cycles, float* sink) {
        kernel<<<sms, 128 * (kWGs + 1), kSmemBytes>>>(cycles, sink, kIters * kBN - 128);
      },
      flop, sms, cycles_d, sink_d);
}

// The same loop as a grid of short CTAs: n_ctas query tiles of `iters` key tiles each (the 8k problem of the
// benchmark: 4 x 16 heads x 64 query tiles of 128 rows, 43 key tiles of 192). The share comes from the
// elapsed time (CUDA events) and the SM clock the CTAs saw (median of their clock64 / globaltimer rates), so
// it counts the CTAs' start, Q load, O store and the grid's last wave.
template <int kBN>
void run_attention_grid(const char* label, int sms, int n_ctas, int iters, bool memory, float* sink_d,
                        bool prefetch = false) {
  uint4 *q_in = nullptr, *o_out = nullptr;
  unsigned long long* clock_ns = nullptr;
  if (memory) {
    cudaMalloc(&q_in, static_cast<size_t>(n_ctas) * 40 * 1024);
    cudaMalloc(&o_out, static_cast<size_t>(n_ctas) * 32 * 1024);
    cudaMemset(q_in, 0x3c, static_cast<size_t>(n_ctas) * 40 * 1024);  // bf16 0x3c3c: 0.0115
  }
  cudaMalloc(&clock_ns, static_cast<size_t>(n_ctas) * 4 * sizeof(unsigned long long));
  auto kernel = attention_loop_kernel<kBN>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  float ms = 0.f;
  for (int rep = 0; rep < 3; ++rep) {  // the last of three back-to-back launches
    cudaEventRecord(start);
    kernel<<<n_ctas, 384, kSmemBytes>>>(nullptr, sink_d, iters, q_in, o_out, clock_ns, prefetch ? sms : 0);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&ms, start, stop);
  }
  if (cudaGetLastError() != cudaSuccess) {
    std::printf("%s: %s\n", label, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  std::vector<unsigned long long> rec(static_cast<size_t>(n_ctas) * 4);
  cudaMemcpy(rec.data(), clock_ns, rec.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost);
  std::vector<double> ghz;
  for (int b = 0; b < n_ctas; ++b) {
    if (rec[4 * b + 3] > rec[4 * b + 2]) ghz.push_back(double(rec[4 * b + 1] - rec[4 * b]) / (rec[4 * b + 3] - rec[4 * b + 2]));
  }
  std::sort(ghz.begin(), ghz.end());
  const double f = ghz[ghz.size() / 2];
  const double flop = double(n_ctas) * iters * 2 * 2 * (64.0 * kBN * 128 * 2);
  const double share = flop / (ms * 1e-3 * f * 1e9 * sms * 4096.0);
  std::printf("| %s | %.1f%% | %.1f | (%.0f TFLOP/s at %.0f MHz) |\n", label, 100.0 * share, share * sms * 4096.0 / 1e3,
              flop / (ms * 1e-3) / 1e12, f * 1e3);
  cudaFree(q_in);
  cudaFree(o_out);
  cudaFree(clock_ns);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  long long* cycles_d = nullptr;
  float* sink_d = nullptr;
  cudaMalloc(&cycles_d, sms * sizeof(long long));
  cudaMalloc(&sink_d, sizeof(float));
  std::printf("%s, %d SMs: bf16 wgmma streams, two consumer warpgroups per SM (median SM)\n\n", prop.name, sms);
  std::printf("| group per warpgroup turn | share of peak per clock | TFLOP/s per GHz |\n|---|---|---|\n");
  run<64, 8, 0, 0, false>("8 x SS n64", sms, cycles_d, sink_d);
  run<128, 8, 0, 0, false>("8 x SS n128", sms, cycles_d, sink_d);
  run<192, 8, 0, 0, false>("8 x SS n192", sms, cycles_d, sink_d);
  run<256, 8, 0, 0, false>("8 x SS n256", sms, cycles_d, sink_d);
  run<0, 0, 128, 8, false>("8 x RS n128", sms, cycles_d, sink_d);
  run<0, 0, 256, 8, false>("8 x RS n256", sms, cycles_d, sink_d);
  run<128, 8, 128, 8, false>("d128 B_c 128: 8 x SS n128 + 8 x RS n128", sms, cycles_d, sink_d);
  run<192, 8, 128, 12, false>("d128 B_c 192: 8 x SS n192 + 12 x RS n128", sms, cycles_d, sink_d);
  run<128, 8, 128, 8, true>("d128 B_c 128, turns", sms, cycles_d, sink_d);
  run<192, 8, 128, 12, true>("d128 B_c 192, turns", sms, cycles_d, sink_d);
  run_attention_loop<128>("d128 B_c 128, turns + softmax", sms, cycles_d, sink_d);
  run_attention_loop<192>("d128 B_c 192, turns + softmax", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false>("d128 B_c 192, turns + softmax (variant loop)", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceRing>("  + the K/V ring's barriers, no data", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceGuards>("  + the softmax's -inf guards", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceMask>("  + the per-tile mask test", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceRing | kPieceGuards | kPieceMask>("  + all three", sms, cycles_d,
                                                                              sink_d);
  run_attention_variant<2, 192, false, kPieceRing | kPieceEarlyTest>("  + ring, next K/V tested early", sms,
                                                                     cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceRing | kPieceLateRelease>("  + ring, one release point", sms,
                                                                       cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceRing | kPieceEarlyTest | kPieceLateRelease>(
      "  + ring, tested early, one release point", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, false, kPieceMask | kPieceMaskHoist>("  + mask test, hoisted", sms, cycles_d,
                                                                     sink_d);
  run_attention_variant<2, 192, false, kPieceRing | kPieceGuards | kPieceMask | kPieceEarlyTest | kPieceMaskHoist>(
      "  + all three, tested early, mask hoisted", sms, cycles_d, sink_d);
  run_attention_variant<2, 128, true>("d128 B_c 128, turns + softmax, P through shared memory", sms, cycles_d, sink_d);
  run_attention_variant<2, 192, true>("d128 B_c 192, turns + softmax, P through shared memory", sms, cycles_d, sink_d);
  run_attention_variant<3, 128, true>("d128 B_r 192 (3 warpgroups), B_c 128, P through shared memory", sms, cycles_d,
                                      sink_d);
  run_attention_variant<3, 64, true>("d128 B_r 192 (3 warpgroups), B_c 64, P through shared memory", sms, cycles_d,
                                     sink_d);
  // The benchmark's 8k problem: 4 x 16 heads x 64 query tiles = 4096 CTAs (31 waves of 132 and 4 CTAs), 43
  // key tiles of 192; 4092 = 31 whole waves.
  run_attention_grid<192>("B_c 192 as 4096 CTAs of 43 key tiles (8k), operands in, O out", sms, 4096, 43, true, sink_d);
  run_attention_grid<192>("B_c 192 as 4092 CTAs of 43 key tiles (whole waves), operands in, O out", sms, 4092, 43, true,
                          sink_d);
  run_attention_grid<192>("B_c 192 as 4092 CTAs of 43 key tiles, operands in (prefetched to L2 a wave ahead), O out",
                          sms, 4092, 43, true, sink_d, true);
  run_attention_grid<192>("B_c 192 as 4092 CTAs of 43 key tiles, no global memory", sms, 4092, 43, false, sink_d);
  run_attention_grid<192>("B_c 192 as 1023 CTAs of 172 key tiles (whole waves), operands in, O out", sms, 1023, 172,
                          true, sink_d);
  cudaFree(cycles_d);
  cudaFree(sink_d);
  return 0;
}

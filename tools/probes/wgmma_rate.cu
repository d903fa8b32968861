// How much of the tensor pipe's peak a stream of wgmmas reaches per SM clock: by instruction shape, in the
// d128 forward's GEMM mix (S = Q K^T, then P V) with no softmax between the GEMMs, and in the forward's
// loop with its online softmax (csrc/cuda/sm90/softmax.cuh) but no loads. The ceiling against which the
// forward's own share of the peak (TFLOP/s per GHz over SMs x 4096 FLOP per clock) is read.
//
//   nvcc -arch=sm_90a -std=c++17 --use_fast_math -Icsrc -o /tmp/wgmma_rate tools/probes/wgmma_rate.cu && /tmp/wgmma_rate
//
// One CTA per SM (one idle producer warpgroup, two consumer warpgroups with 240 registers, as the
// forward kernel). Each consumer issues `kIters` groups; a group is kSSteps wgmmas m64 n kSN k16 with
// both operands from shared memory (the S GEMM) then kPVSteps wgmmas m64 n kPVN k16 with A from
// registers and B MN-major (the P V GEMM), one commit, then a wait for the group. With kPingPong the two
// consumers issue their groups in turns on named barriers, as the forward kernel does. Cycles are
// clock64 (SM clocks, so the figure does not depend on the clock the power limit allows). Operands
// are random bf16 values; the results are summed into an output so nothing is optimised away.
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

// The d128 forward's main loop without its loads, masks and epilogue, resident (one CTA per SM): in turns,
// S_j = Q K^T (8 SS m64 n kBN k16) and O += P_{j-1} V (kBN/16 RS m64n128k16) as two commit groups; then, as
// the kernel does, wait for S, the online softmax of its two rows per thread, wait for P V, rescale O, and
// convert P to the A fragments of the next P V. Shows what the softmax between the GEMMs costs the tensor
// pipe when every operand is already in shared memory.
template <int kBN>
__global__ void __launch_bounds__(384, 1) attention_loop_resident(long long* cycles, float* sink) {
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
  float s_acc[kBN / 2];
  float o_acc[64] = {};
  uint32_t pa[kBN / 16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float sl2 = 0.1275f;  // 1/sqrt(128) * log2(e)

  const uint32_t my_turn = 1 + c, next_turn = 2 - c;
  named_bar_sync<3, 256>();
  const long long t0 = clock64();
  if (c == 1) named_bar_arrive<1, 256>();
  for (int it = 0; it < kIters; ++it) {
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
void run_attention_loop(const char* label, int sms, long long* cycles_d, float* sink_d) {
  const double flop = 2.0 * kIters * 2 * (64.0 * kBN * 128 * 2);
  time_kernel(label, attention_loop_resident<kBN>, flop, sms, cycles_d, sink_d);
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
  cudaFree(cycles_d);
  cudaFree(sink_d);
  return 0;
}

// The forward's online softmax on a warpgroup's m64 x N wgmma accumulator, in registers: each thread holds
// two rows (h = 0: r, h = 1: r + 8) of its quad, d[4i + 2h] and d[4i + 2h + 1] for n8 block i (wgmma.cuh).
// Shared by fwd_kernel.cuh and tools/probes/wgmma_rate.cu (the kernel's loop without loads), so the two stay the
// same code.
#pragma once

#include <cstdint>

#include "primitives.cuh"

namespace flashop {
namespace sm90 {

// Over the four threads of a quad (one accumulator row).
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

// One key tile: S (raw scores, N/2 per thread) becomes P = exp2(s * sl2 - m * sl2) in place, with m the
// running max of raw scores and sl2 = scale * log2(e); l (per-thread partial row sums) and m move on, and
// corr gets the factors that rescale the old O and l. kRowsMayBeEmpty: a row that has only seen masked
// (-inf) keys keeps m = -inf; its reference is 0 so that -inf - -inf never makes a NaN (P = 0, O stays 0).
template <int N, bool kRowsMayBeEmpty = true>
__device__ __forceinline__ void online_softmax(float (&sacc)[N / 2], float (&m)[2], float (&l)[2],
                                               float (&corr)[2], float sl2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m[h];
#pragma unroll
    for (int i = 0; i < N / 8; ++i) mx = fmaxf(mx, fmaxf(sacc[4 * i + 2 * h], sacc[4 * i + 2 * h + 1]));
    mx = quad_max(mx);
    const bool empty = kRowsMayBeEmpty && mx == -INFINITY;
    const float ref = empty ? 0.f : mx * sl2;
    corr[h] = empty ? 1.f : exp2f(m[h] * sl2 - ref);
    m[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const float p0 = exp2f(fmaf(sacc[4 * i + 2 * h], sl2, -ref));
      const float p1 = exp2f(fmaf(sacc[4 * i + 2 * h + 1], sl2, -ref));
      sacc[4 * i + 2 * h] = p0;
      sacc[4 * i + 2 * h + 1] = p1;
      sum += p0 + p1;
    }
    l[h] = l[h] * corr[h] + sum;
  }
}

// tanh.approx.f32 (MUFU.TANH, one instruction; maximum relative error 2^-10.987 per the PTX ISA), as
// FlashAttention-2 and -3 use for softcap (cutlass::fast_tanh).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// %laneid, read again at every use (volatile): for values cheaper to re-read than to keep in a register.
__device__ __forceinline__ int lane_id_volatile() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Softcap on raw scores (the loop's units, q.k before the softmax scale): s -> cap_out tanh(s cap_in),
// cap_in = scale / softcap, cap_out = softcap / scale, i.e. score = softcap tanh(score / softcap).
template <int N>
__device__ __forceinline__ void apply_softcap(float (&sacc)[N / 2], float cap_in, float cap_out) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) sacc[i] = cap_out * tanh_approx(sacc[i] * cap_in);
}

// ALiBi on raw scores: s -= slope |key - row - diag| (slope already divided by the softmax scale).
// rel: key - row - diag of the thread's element d[0] (row r, column 2 (lane % 4) of n8 block 0);
// element d[4i + 2h + e] is 8i + e - 8h further (row r + 8h, column + 8i + e). Exact in float below 2^24.
template <int N>
__device__ __forceinline__ void apply_alibi(float (&sacc)[N / 2], float slope, float rel) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float d = rel + static_cast<float>(8 * i + (e & 1) - 8 * (e >> 1));
      sacc[4 * i + e] = fmaf(-slope, fabsf(d), sacc[4 * i + e]);
    }
  }
}

// O (m64 x N accumulator) rows times their softmax correction.
template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N / 2], const float (&corr)[2]) {
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    o[4 * i + 0] *= corr[0];
    o[4 * i + 1] *= corr[0];
    o[4 * i + 2] *= corr[1];
    o[4 * i + 3] *= corr[1];
  }
}

// P (accumulator layout) -> the A fragments of the P V wgmma: k16 step t takes n8 blocks 2t, 2t+1.
template <bool kBf16, int N>
__device__ __forceinline__ void p_to_a_fragments(const float (&sacc)[N / 2], uint32_t (&pa)[N / 16][4]) {
#pragma unroll
  for (int t = 0; t < N / 16; ++t) {
    pa[t][0] = pack2<kBf16>(sacc[8 * t + 0], sacc[8 * t + 1]);  // row r,   k 0..7
    pa[t][1] = pack2<kBf16>(sacc[8 * t + 2], sacc[8 * t + 3]);  // row r+8, k 0..7
    pa[t][2] = pack2<kBf16>(sacc[8 * t + 4], sacc[8 * t + 5]);  // row r,   k 8..15
    pa[t][3] = pack2<kBf16>(sacc[8 * t + 6], sacc[8 * t + 7]);  // row r+8, k 8..15
  }
}

}  // namespace sm90
}  // namespace flashop

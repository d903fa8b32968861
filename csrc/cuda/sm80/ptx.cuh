// Thin wrappers over the sm80 instructions the forward kernel is built from.
// Each is one PTX instruction; the comments give the operand layouts the rest
// of the code relies on (PTX ISA: cp.async, ldmatrix, mma.m16n8k16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace flashop {
namespace sm80 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------
// cp.async: 16 bytes global -> shared, bypassing L1 (.cg). With src_bytes = 0
// nothing is read and the 16 destination bytes are zero-filled, which is how
// tail rows past the end of the sequence are loaded without a branch.
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}

// Close the group of cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
// Other threads' copies become visible only after a barrier that follows.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------
// ldmatrix.x4: four 8x8 matrices of 16-bit elements. Lane l supplies the
// address of row (l % 8) of matrix (l / 8); each row is 16 contiguous bytes.
// Result r[i] holds matrix i; lane l receives row l/4, columns 2*(l%4) and
// 2*(l%4)+1 (lower column in the low half).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Same, transposed: lane l receives rows 2*(l%4) and 2*(l%4)+1 of column l/4,
// i.e. two vertically adjacent elements; this is the mma B fragment of a
// matrix stored with its k dimension as the row (V stored key-major).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// ---------------------------------------------------------------------------
// D = A * B + D, m16n8k16, fp32 accumulators. With g = lane/4, t = lane%4:
//   A (16x16, row-major) a[0] = A[g][2t..2t+1]     a[1] = A[g+8][2t..2t+1]
//                        a[2] = A[g][2t+8..2t+9]   a[3] = A[g+8][2t+8..2t+9]
//   B (16x8, "col")      b[0] = B[2t..2t+1][g]     b[1] = B[2t+8..2t+9][g]
//   C/D (16x8)           d[0..1] = D[g][2t..2t+1]  d[2..3] = D[g+8][2t..2t+1]
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------
// Two floats -> one register of two 16-bit values, `lo` in the low half (the
// lower column), round to nearest: one cvt.rn.{f16x2,bf16x2}.f32.
template <typename Elem>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// 2^x on the SFU (ex2.approx.ftz): 2^-inf = +0, which masked scores rely on.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sm80
}  // namespace flashop

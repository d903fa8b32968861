// The instructions the mma.sync kernels (fwd_kernel.cuh, bwd_kernel.cuh) are built from, one
// wrapper each, with the operand layouts the rest of the code relies on (PTX ISA: cp.async, ldmatrix,
// mma.m16n8k16, red, ld.acquire). Each wrapper the backward uses has a CPU twin (bwd_emulate.cuh),
// selected by FLASHOP_BWD_EMULATE, so tests/test_bwd_emulator.py can run the backward's index math on
// the CPU; the forward is never compiled that way.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <cstdint>
#include <cstring>

#ifdef FLASHOP_BWD_EMULATE
#include <cmath>
#include <type_traits>

#include "bwd_emulate.cuh"
#define FLASHOP_SM80_DEV inline
#define FLASHOP_SM80_GLOBAL
#define FLASHOP_SM80_LAUNCH_BOUNDS(threads, blocks)
#define FLASHOP_SM80_DYNAMIC_SMEM(name) unsigned char* name = ::flashop::emu::smem_base()
#else
#define FLASHOP_SM80_DEV __device__ __forceinline__
#define FLASHOP_SM80_GLOBAL __global__
#define FLASHOP_SM80_LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
#define FLASHOP_SM80_DYNAMIC_SMEM(name)                                   \
  extern __shared__ __align__(128) unsigned char flashop_bwd_smem_[]; \
  unsigned char* name = flashop_bwd_smem_
#endif

namespace flashop {
namespace sm80 {

#ifdef FLASHOP_BWD_EMULATE

inline int thread_x() { return emu::thread_x(); }
inline int block_x() { return emu::block_x(); }
inline int block_y() { return emu::block_y(); }
inline int block_z() { return emu::block_z(); }
inline void barrier() { emu::syncthreads(); }
inline void thread_fence() {}
inline uint32_t smem_u32(const void* p) { return emu::smem_u32(p); }
inline void cp_async_16(uint32_t dst, const void* src, bool valid) { emu::cp_async_16(dst, src, valid); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() { emu::cp_async_wait(N); }
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, true); }
template <typename Elem>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::mma_16816(d, a, b0, b1, sizeof(Elem) == 2 && !std::is_same<Elem, __half>::value);
}
inline float exp2_approx(float x) { return std::exp2(x); }
inline float shfl_xor(float v, int mask) { return emu::shfl_xor(v, mask); }
inline float shfl_idx(float v, int src_lane) { return emu::shfl_idx(v, src_lane); }
inline void red_add_f32x2(float* p, float a, float b) {
  p[0] += a;
  p[1] += b;
}
inline void cp_async_16_if(uint32_t dst, const void* src, bool valid, bool pred) {
  if (pred) emu::cp_async_16(dst, src, valid);
}
inline void sts_u32(uint32_t addr, uint32_t v) {
  emu::check_smem(addr, 4, 4);
  std::memcpy(emu::smem_base() + addr, &v, 4);
}
inline uint4 lds_u128(uint32_t addr) {
  emu::check_smem(addr, 16, 16);
  uint4 v;
  std::memcpy(&v, emu::smem_base() + addr, 16);
  return v;
}
inline float2 lds_f32x2(uint32_t addr) {
  emu::check_smem(addr, 8, 8);
  float2 v;
  std::memcpy(&v, emu::smem_base() + addr, 8);
  return v;
}
inline int ld_acquire(const int* p) { return *p; }
inline void red_release_add(int* p, int v) { *p += v; }
inline void spin_pause() { emu::spin_pause(); }
// The emulator runs grids one after another: a dependent grid never starts early.
inline void launch_dependents() {}
inline void wait_for_prerequisite_grids() {}

#else  // device

FLASHOP_SM80_DEV int thread_x() { return int(threadIdx.x); }
FLASHOP_SM80_DEV int block_x() { return int(blockIdx.x); }
FLASHOP_SM80_DEV int block_y() { return int(blockIdx.y); }
FLASHOP_SM80_DEV int block_z() { return int(blockIdx.z); }
FLASHOP_SM80_DEV void barrier() { __syncthreads(); }
FLASHOP_SM80_DEV void thread_fence() { __threadfence(); }

FLASHOP_SM80_DEV uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async: 16 bytes global -> shared, bypassing L1 (.cg). valid = false reads
// nothing (src-size 0) and zero-fills the 16 destination bytes: rows past the
// end of a sequence load as zeros without a branch. `src` must still be a
// mapped address; callers pass the tile's first row.
FLASHOP_SM80_DEV void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The forward's loads: the same copy with the .L2::128B prefetch-size hint.
FLASHOP_SM80_DEV void cp_async_16_l2_128b(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
// The same under a predicate, inside the asm: no branch around it, so ptxas
// keeps it in the surrounding basic block and can schedule it among the mma.
// pred = false issues nothing (no copy, no zero fill).
FLASHOP_SM80_DEV void cp_async_16_if(uint32_t dst, const void* src, bool valid, bool pred) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q cp.async.cg.shared.global [%0], [%1], 16, %2;\n}\n" ::"r"(dst),
      "l"(src), "r"(src_bytes), "r"(int(pred))
      : "memory");
}
FLASHOP_SM80_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// At most N of this thread's committed groups still in flight; other threads'
// copies are visible only after a barrier that follows.
template <int N>
FLASHOP_SM80_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory accesses by 32-bit shared address (the address arithmetic of
// the swizzled tiles is done on these, see tiles.cuh).
FLASHOP_SM80_DEV void sts_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
FLASHOP_SM80_DEV uint4 lds_u128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
FLASHOP_SM80_DEV float2 lds_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}

// ldmatrix.x4: lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes each)
// of matrix i; r[i] holds matrix i. Plain: lane l gets row l/4, columns
// 2(l%4), 2(l%4)+1 (lower column in the low half). .trans: lane l gets rows
// 2(l%4), 2(l%4)+1 of column l/4 (lower row in the low half).
FLASHOP_SM80_DEV void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
FLASHOP_SM80_DEV void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A B, m16n8k16, fp32 accumulators. With g = lane/4, t = lane%4:
//   A (16x16) a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
//   B (16x8)  b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
//   C (16x8)  d[0..1] = C[g][2t..2t+1]  d[2..3] = C[g+8][2t..2t+1]
template <typename Elem>
FLASHOP_SM80_DEV void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
FLASHOP_SM80_DEV void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
FLASHOP_SM80_DEV void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the SFU (ex2.approx.ftz): 2^-inf = +0, which masked and empty rows rely on.
FLASHOP_SM80_DEV float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

FLASHOP_SM80_DEV float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
FLASHOP_SM80_DEV float shfl_idx(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }

// Fire-and-forget fp32 adds to global memory (performed in L2). Two adjacent
// floats (8-byte aligned): one vector red on sm90, two scalar ones before.
FLASHOP_SM80_DEV void red_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(b) : "memory");
#endif
}

// Programmatic dependent launch (sm90): a grid launched with the programmatic-serialization attribute may
// start once every CTA of the grid before it has called launch_dependents (or exited), and
// wait_for_prerequisite_grids holds it until that grid has finished and its writes are visible. No-ops
// before sm90, where the launcher never sets the attribute.
FLASHOP_SM80_DEV void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
FLASHOP_SM80_DEV void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Semaphore of the deterministic mode: acquire load / release add, gpu scope.
FLASHOP_SM80_DEV int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
FLASHOP_SM80_DEV void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
FLASHOP_SM80_DEV void spin_pause() { __nanosleep(64); }

#endif  // FLASHOP_BWD_EMULATE

// ---------------------------------------------------------------------------
// 16-bit element helpers (same code on both sides).

template <typename Elem>
FLASHOP_SM80_DEV uint32_t pack2(float lo, float hi);  // lo in the low half, round to nearest

template <>
FLASHOP_SM80_DEV uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

template <>
FLASHOP_SM80_DEV uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}

template <typename Elem>
FLASHOP_SM80_DEV float2 unpack2(uint32_t v);  // low half -> .x

template <>
FLASHOP_SM80_DEV float2 unpack2<__half>(uint32_t v) {
  __half2_raw raw;
  raw.x = static_cast<unsigned short>(v & 0xffffu);
  raw.y = static_cast<unsigned short>(v >> 16);
  return __half22float2(__half2(raw));
}

template <>
FLASHOP_SM80_DEV float2 unpack2<__nv_bfloat16>(uint32_t v) {
  // bf16 -> fp32 is exact: the bits go to the top half.
  const uint32_t lo = v << 16, hi = v & 0xffff0000u;
  float2 f;
  memcpy(&f.x, &lo, 4);
  memcpy(&f.y, &hi, 4);
  return f;
}

}  // namespace sm80
}  // namespace flashop

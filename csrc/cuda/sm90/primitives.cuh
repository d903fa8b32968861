// Hopper (sm_90a) building blocks for the forward kernel: mbarriers, TMA tensor
// loads and stores, proxy fences, wgmma shared-memory descriptors, warpgroup fences, setmaxnreg.
// Every asm body is compiled only for sm_90a (FLASHOP_SM90_ENABLED, set in
// wgmma.cuh); elsewhere the functions are empty so the host pass and other
// targets still parse the file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "wgmma.cuh"

namespace flashop {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes the barrier inits visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbar_init_fence() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// One arrival plus `bytes` expected transaction bytes (the TMA loads that follow).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// One arrival on the mbarrier at the same shared-memory offset in CTA `cta_rank` of this cluster. It
// only tells the peer's producer that this CTA's wgmmas have finished reading a slot (they are complete,
// wgmma.wait_group), so the default semantics suffice; no cluster-scope release fence.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta_rank) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta_rank)
      : "memory");
#endif
}

// Blocks until the phase with parity `phase` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
#ifdef FLASHOP_SM90_ENABLED
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  } while (!done);
#endif
}

// Whether the phase with parity `phase` has completed, without blocking (mbarrier.test_wait): issued
// early, its latency hides under other work, and the blocking wait runs only when it said no.
__device__ __forceinline__ bool mbar_test_wait(uint32_t bar, uint32_t phase) {
#ifdef FLASHOP_SM90_ENABLED
  uint32_t done = 0;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(phase)
      : "memory");
  return done != 0;
#else
  return true;
#endif
}

// ---------------------------------------------------------------- TMA
__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
#endif
}

// 4-D tiled load (coordinates innermost first: d, row, head, batch) into
// shared memory; completes `bytes` of transaction on the mbarrier.
__device__ __forceinline__ void tma_load_4d(const void* tmap, uint32_t smem_dst, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

// The same load multicast to the CTAs of this cluster named in `cta_mask` (bit i: cluster rank i): the
// box lands at offset `smem_dst` of each of them and completes its bytes on the mbarrier at offset `bar`
// of each of them.
__device__ __forceinline__ void tma_load_4d_multicast(const void* tmap, uint32_t smem_dst, uint32_t bar,
                                                      int c0, int c1, int c2, int c3, uint16_t cta_mask) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "h"(cta_mask)
      : "memory");
#endif
}

// 4-D tiled store (coordinates innermost first: d, row, head, batch) of a box
// from shared memory (laid out as the map's swizzle expects) to global memory,
// tracked by the issuing thread's bulk async-groups. Box elements outside the
// tensor's extent are not written (rows >= Sq of the last query tile).
// The shared-memory source must have been written before, by every writer:
// st.shared -> fence_proxy_async_smem() -> barrier -> this (one thread).
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t smem_src, int c0, int c1,
                                             int c2, int c3) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];" ::"l"(reinterpret_cast<uint64_t>(tmap)),
      "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

// 2-D tiled reduce-add (coordinates innermost first: column, row) of a box from shared memory (laid out as
// the map's swizzle expects) into global memory: each element is added atomically in L2 (fp32 maps: red.add
// without one instruction per element). Tracked by the issuing thread's bulk async-groups; the source is
// written as for tma_store_4d.
__device__ __forceinline__ void tma_reduce_add_2d(const void* tmap, uint32_t smem_src, int c0, int c1) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(smem_src), "r"(c0), "r"(c1)
               : "memory");
#endif
}

// Closes the issuing thread's pending bulk stores into one bulk async-group.
__device__ __forceinline__ void tma_store_commit() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of the issuing thread's bulk async-groups still read
// their shared-memory source (.read: the global writes may still be in flight,
// the source may be reused or freed).
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
#endif
}

// Waits until at most N of the issuing thread's bulk async-groups are incomplete (their global writes
// done too).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Orders this thread's earlier generic-proxy shared-memory accesses (st.shared)
// before later async-proxy accesses (TMA store reading them), and vice versa.
__device__ __forceinline__ void fence_proxy_async_smem() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float x, float y) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
#endif
}

__device__ __forceinline__ uint4 ld_shared_v4_b32(uint32_t addr) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
#endif
  return v;
}

__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v = 0;
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
#endif
  return v;
}

// A flag in global memory between CTAs of one grid (the persistent kernel's split tiles): the writer
// publishes data with a release store, the reader spins with acquire loads until it sees it.
__device__ __forceinline__ void st_release_gpu(int* flag, int v) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ int ld_acquire_gpu(const int* flag) {
  int v = 0;
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
#endif
  return v;
}

// ---------------------------------------------------------------- wgmma
// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"):
//   bits  0-13 start address >> 4
//   bits 16-29 leading dimension byte offset >> 4
//   bits 32-45 stride dimension byte offset >> 4
//   bits 49-51 base offset (0: every swizzle atom is 1024-byte aligned)
//   bits 62-63 swizzle: 0 none, 1 128B, 2 64B, 3 32B
// With the 128B swizzle, one atom is 8 rows x 128 bytes (1024 bytes).
//  K-major (rows of 64 contiguous K elements): SBO = 1024 (next 8-row group);
//    LBO unused (set to 1); stepping K by 16 elements adds 32 bytes to start.
//  MN-major (rows of 64 contiguous N elements, one row per K): SBO = 1024
//    (next 8 K rows), LBO = byte distance between 64-element N blocks;
//    stepping K by 16 adds 2048 bytes to start.
// kRowBytes: the swizzle's row (128, 64 or 32 bytes; swizzle field 1, 2 or 3), see below for 64 and 32.
template <int kRowBytes>
__device__ __forceinline__ uint64_t make_desc_sw(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  static_assert(kRowBytes == 128 || kRowBytes == 64 || kRowBytes == 32, "128B, 64B or 32B swizzle");
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(kRowBytes == 128 ? 1 : kRowBytes == 64 ? 2 : 3) << 62;
  return d;
}

__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_desc_sw<128>(smem_addr, lbo_bytes, sbo_bytes);
}

// Rows of 64 bytes (32 elements, the 64B swizzle, swizzle field 2): with the 64B swizzle one atom is 8 rows x 64 bytes (512 bytes;
// CUTLASS GMMA::Layout_K_SW64_Atom / Layout_MN_SW64_Atom, Swizzle<2,4,3>: 16-byte chunk q of row r at
// (q ^ (r / 2) % 4) * 16):
//  K-major: SBO = 512 (next 8-row group), LBO unused (1); K by 16 elements: start + 32 bytes (inside
//    the 64-byte row; a 32-element column block holds two k16 steps).
//  MN-major: SBO = 512 (next 8 K rows), LBO = byte distance between 32-element N blocks; K by 16:
//    start + 1024 bytes.
// In both the atoms start 512-byte aligned, so the base offset stays 0.

// The same for rows of 32 bytes (16 elements, the 32B swizzle, swizzle field 3): one atom is 8 rows x 32
// bytes (256 bytes; CUTLASS Layout_K_SW32_Atom / Layout_MN_SW32_Atom, Swizzle<1,4,3>: 16-byte chunk q of
// row r at (q ^ (r / 4) % 2) * 16).
//  K-major: SBO = 256 (next 8-row group), LBO unused (1); a 16-column block is exactly one k16 step.
//  MN-major: SBO = 256 (next 8 K rows), LBO = byte distance between 16-element N blocks (so N is any
//    multiple of 16 in canonical form); K by 16: start + 512 bytes.
// Atoms start 256-byte aligned, base offset 0.
__device__ __forceinline__ uint64_t make_desc_sw32(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return make_desc_sw<32>(smem_addr, lbo_bytes, sbo_bytes);
}

// The descriptor of the matrix `bytes` (a multiple of 16) after desc's start. The start field is the low
// 14 bits of address >> 4 and shared-memory addresses stay below 2^18, so the sum never carries out of
// it, and the high word (SBO, swizzle) is unchanged: one 32-bit add where make_desc_sw128 of the moved
// address would mask, shift and merge again (the forward issues a wgmma per 16 of K, 12-20 per key tile).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Two fp32 values as one 32-bit register of 16-bit elements (lo in the low half): wgmma A fragments.
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

// ---------------------------------------------------------------- registers
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
#endif
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
#endif
}

// ---------------------------------------------------------------- clusters
// Number of CTAs in this CTA's cluster (1 when the kernel was not launched with a cluster shape) and
// this CTA's rank in it.
__device__ __forceinline__ uint32_t cluster_num_ctas() {
  uint32_t n = 1;
#ifdef FLASHOP_SM90_ENABLED
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}
__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t r = 0;
#ifdef FLASHOP_SM90_ENABLED
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
// Every thread of every CTA of the cluster: what each wrote before (mbarrier inits included) is
// visible to all of them after.
__device__ __forceinline__ void cluster_sync() {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Named barriers over `threads` threads (a multiple of 32). id 0 is __syncthreads.
template <int kId, int kThreads>
__device__ __forceinline__ void named_bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_bar_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
// bar.sync that also ORs a predicate over the kThreads threads: true in all of them if true in any.
template <int kId, int kThreads>
__device__ __forceinline__ bool named_bar_sync_or(bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "n"(kId), "n"(kThreads)
      : "memory");
  return any != 0;
}

}  // namespace sm90
}  // namespace flashop

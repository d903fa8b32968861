// The fp32 matrix products of the CPU kernels: row-major C[M,N] (+)= A[M,K] B[K,N], brgemm's contract.
// oneDNN's fp32 brgemm micro-kernel is the fast one on AVX-512; its AVX2 kernel is not (fp32 d128 forward
// 0.74x torch's CPU SDPA under AVX2, where torch's own GEMMs run the BLAS it ships). So the AVX2 and generic
// copies call that BLAS's sgemm_ when the torch library exports it (a weak reference, resolved when the
// extension loads); without it, and on AVX-512, brgemm runs.
#pragma once

#include "isa_namespace.h"

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <limits>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE {

// Whether gemm_f32 runs the BLAS sgemm_ in this copy.
inline bool blas_sgemm_used() {
#if defined(CPU_CAPABILITY_AVX512)
  return false;
#else
  return sgemm_ != nullptr;
#endif
}

inline void gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                     const float* A, const float* B, float* C) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (blas_sgemm_used() && M <= kIntMax && N <= kIntMax && K <= kIntMax && lda <= kIntMax && ldb <= kIntMax &&
      ldc <= kIntMax) {
    if (M == 0 || N == 0) return;
    // Column-major BLAS: C^T[N,M] = B^T[N,K] A^T[K,M], each row-major operand read as its transpose.
    const int m = int(N), n = int(M), k = int(K), ld_b = int(ldb), ld_a = int(lda), ld_c = int(ldc);
    const float alpha = 1.f, beta = add_C ? 1.f : 0.f;
    sgemm_("N", "N", &m, &n, &k, &alpha, B, &ld_b, A, &ld_a, &beta, C, &ld_c);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, /*is_vnni=*/false);
}

// C[M,N] = A[M,K] B^T with B row-major [N,K] (row stride ldb): keys read in place, one product per key tile.
// Only where blas_sgemm_used(), with every size below 2^31 (the caller checks).
inline void gemm_f32_bt(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, const float* A,
                        const float* B, float* C) {
  if (M == 0 || N == 0) return;
  // Column-major BLAS: C^T[N,M] = B[N,K] A^T[K,M]; row-major B is B^T column-major, hence "T".
  const int m = int(N), n = int(M), k = int(K), ld_b = int(ldb), ld_a = int(lda), ld_c = int(ldc);
  const float alpha = 1.f, beta = 0.f;
  sgemm_("T", "N", &m, &n, &k, &alpha, B, &ld_b, A, &ld_a, &beta, C, &ld_c);
}

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

// The fp32 matrix products of the CPU kernels: row-major C[M,N] (+)= A[M,K] B[K,N], brgemm's contract.
// oneDNN's fp32 brgemm micro-kernel is the fast one on AVX-512; its AVX2 kernel is not (fp32 d128 forward
// 0.74x torch's CPU SDPA under AVX2, where torch's own GEMMs run the BLAS it ships). So the generic copy calls
// that BLAS's sgemm_ when the torch library exports it (a weak reference, resolved when the extension loads);
// without it, and on AVX-512, brgemm runs. The AVX2 copy's kernels run their own tile GEMM
// (attention_microkernel.h) instead.
#pragma once

#include "isa_namespace.h"

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <initializer_list>
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

// Whether every size of a product fits the BLAS's int arguments.
inline bool fits_blas_int(std::initializer_list<int64_t> sizes) {
  for (int64_t n : sizes) {
    if (n > std::numeric_limits<int>::max()) return false;
  }
  return true;
}

// Row-major C[M,N] (+)= op(A) op(B) through the BLAS sgemm_: op(A) is A[M,K] or, with trans_a, A[K,M]^T; op(B)
// is B[K,N] or, with trans_b, B[N,K]^T, each read in place (row strides lda, ldb). Only where blas_sgemm_used()
// and fits_blas_int(every size and stride) (the caller checks).
inline void blas_gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                          int64_t ldc, bool add_C, const float* A, const float* B, float* C) {
  if (M == 0 || N == 0) return;
  // Column-major BLAS: C^T[N,M] = op(B)^T op(A)^T, a row-major operand being its transpose column-major.
  const int m = int(N), n = int(M), k = int(K), ld_b = int(ldb), ld_a = int(lda), ld_c = int(ldc);
  const float alpha = 1.f, beta = add_C ? 1.f : 0.f;
  sgemm_(trans_b ? "T" : "N", trans_a ? "T" : "N", &m, &n, &k, &alpha, B, &ld_b, A, &ld_a, &beta, C, &ld_c);
}

inline void gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                     const float* A, const float* B, float* C) {
  if (blas_sgemm_used() && fits_blas_int({M, N, K, lda, ldb, ldc})) {
    blas_gemm_f32(false, false, M, N, K, lda, ldb, ldc, add_C, A, B, C);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, /*is_vnni=*/false);
}

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

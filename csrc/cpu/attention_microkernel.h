// The fp32 matrix products of the AVX2 copy: row-major C[M,N] (+)= A[M,K] B[K,N], A and B read in place with
// their strides. The BLAS sgemm_ packs both operands on every call, and the kernels call it once per (query
// tile, key tile) on the same Q rows and K/V tiles; this kernel reads them as they lie instead: K as K^T
// blocks packed once per thread and head or per tile (attention_pack.h, attention_backward.h), Q, P and V as
// rows.
// GotoBLAS's register tile: 6 rows x 16 columns in 12 ymm accumulators, each step one broadcast of A per
// row and two loads of B.
#pragma once

#include "isa_namespace.h"

#include <algorithm>
#include <cstdint>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE {

#if defined(CPU_CAPABILITY_AVX2)
inline constexpr bool kTileGemm = true;

namespace tile_gemm {

constexpr int kRows = 6, kCols = 16;

// Lane masks for the first n (0..8) floats of a ymm.
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One row's two accumulators, named (not an array: GCC keeps an array of vectors in memory, storing every
// accumulator on every step).
struct RowAcc {
  __m256 lo, hi;
};

template <bool kPartial>
inline RowAcc load_row(const float* c, bool add_C, __m256i m0, __m256i m1) {
  if (!add_C) return {_mm256_setzero_ps(), _mm256_setzero_ps()};
  if (kPartial) return {_mm256_maskload_ps(c, m0), _mm256_maskload_ps(c + 8, m1)};
  return {_mm256_loadu_ps(c), _mm256_loadu_ps(c + 8)};
}

template <bool kPartial>
inline void store_row(float* c, const RowAcc& r, __m256i m0, __m256i m1) {
  if (kPartial) {
    _mm256_maskstore_ps(c, m0, r.lo);
    _mm256_maskstore_ps(c + 8, m1, r.hi);
  } else {
    _mm256_storeu_ps(c, r.lo);
    _mm256_storeu_ps(c + 8, r.hi);
  }
}

inline void fma_row(RowAcc& r, const float* a, __m256 b0, __m256 b1) {
  const __m256 x = _mm256_broadcast_ss(a);
  r.lo = _mm256_fmadd_ps(x, b0, r.lo);
  r.hi = _mm256_fmadd_ps(x, b1, r.hi);
}

// C[MR x n] (+)= A[MR x K] B[K x n] for n <= 16 columns (kPartial: n < 16, B and C touched only in them);
// A's element (i, k) at A[i * a_row + k * a_col].
template <int MR, bool kPartial>
inline void tile(int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool add_C, int n) {
  static_assert(MR >= 1 && MR <= kRows);
  const __m256i m0 = first_lanes(kPartial ? std::min(n, 8) : 8), m1 = first_lanes(kPartial ? std::max(n - 8, 0) : 8);
  RowAcc r0{}, r1{}, r2{}, r3{}, r4{}, r5{};
  r0 = load_row<kPartial>(C, add_C, m0, m1);
  if constexpr (MR > 1) r1 = load_row<kPartial>(C + ldc, add_C, m0, m1);
  if constexpr (MR > 2) r2 = load_row<kPartial>(C + 2 * ldc, add_C, m0, m1);
  if constexpr (MR > 3) r3 = load_row<kPartial>(C + 3 * ldc, add_C, m0, m1);
  if constexpr (MR > 4) r4 = load_row<kPartial>(C + 4 * ldc, add_C, m0, m1);
  if constexpr (MR > 5) r5 = load_row<kPartial>(C + 5 * ldc, add_C, m0, m1);
  const float* a = A;
  for (int64_t k = 0; k < K; ++k, a += a_col) {
    const float* b = B + k * ldb;
    const __m256 b0 = kPartial ? _mm256_maskload_ps(b, m0) : _mm256_loadu_ps(b);
    const __m256 b1 = kPartial ? _mm256_maskload_ps(b + 8, m1) : _mm256_loadu_ps(b + 8);
    fma_row(r0, a, b0, b1);
    if constexpr (MR > 1) fma_row(r1, a + a_row, b0, b1);
    if constexpr (MR > 2) fma_row(r2, a + 2 * a_row, b0, b1);
    if constexpr (MR > 3) fma_row(r3, a + 3 * a_row, b0, b1);
    if constexpr (MR > 4) fma_row(r4, a + 4 * a_row, b0, b1);
    if constexpr (MR > 5) fma_row(r5, a + 5 * a_row, b0, b1);
  }
  store_row<kPartial>(C, r0, m0, m1);
  if constexpr (MR > 1) store_row<kPartial>(C + ldc, r1, m0, m1);
  if constexpr (MR > 2) store_row<kPartial>(C + 2 * ldc, r2, m0, m1);
  if constexpr (MR > 3) store_row<kPartial>(C + 3 * ldc, r3, m0, m1);
  if constexpr (MR > 4) store_row<kPartial>(C + 4 * ldc, r4, m0, m1);
  if constexpr (MR > 5) store_row<kPartial>(C + 5 * ldc, r5, m0, m1);
}

template <int MR>
inline void tile_cols(int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb, float* C,
                      int64_t ldc, bool add_C, int n) {
  if (n == kCols) {
    tile<MR, false>(K, A, a_row, a_col, B, ldb, C, ldc, add_C, n);
  } else {
    tile<MR, true>(K, A, a_row, a_col, B, ldb, C, ldc, add_C, n);
  }
}

}  // namespace tile_gemm

// Row-major C[M,N] (+)= op(A) B[K,N] (row strides lda, ldb, ldc): op(A) is A[M,K], or with trans_a A[K,M]^T
// (the backward's P^T and dS^T, broadcast from their rows as they lie). Each block of 6 rows of op(A) stays
// in L1 while it meets every 16-column panel of B.
inline void tile_gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                          const float* A, const float* B, float* C, bool trans_a = false) {
  using namespace tile_gemm;
  const int64_t a_row = trans_a ? 1 : lda, a_col = trans_a ? lda : 1;
  for (int64_t i0 = 0; i0 < M; i0 += kRows) {
    const int64_t mr = std::min<int64_t>(kRows, M - i0);
    const float* a = A + i0 * a_row;
    float* c = C + i0 * ldc;
    for (int64_t j0 = 0; j0 < N; j0 += kCols) {
      const int n = int(std::min<int64_t>(kCols, N - j0));
      switch (mr) {
        case 6: tile_cols<6>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
        case 5: tile_cols<5>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
        case 4: tile_cols<4>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
        case 3: tile_cols<3>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
        case 2: tile_cols<2>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
        default: tile_cols<1>(K, a, a_row, a_col, B + j0, ldb, c + j0, ldc, add_C, n); break;
      }
    }
  }
}
#else
inline constexpr bool kTileGemm = false;

// Declared only: callers reach it under `if constexpr (kTileGemm)`, which this copy discards.
void tile_gemm_f32(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C, const float* A,
                   const float* B, float* C, bool trans_a = false);
#endif

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

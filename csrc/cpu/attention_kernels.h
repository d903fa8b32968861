// FlashAttention on the CPU: forward (online softmax over key tiles) and backward
// (FlashAttention-2, recomputing P from the log-sum-exp). The kernels see raw
// pointers, element strides and sizes only; attention_cpu.cpp is the torch glue.
// These headers are compiled once per instruction set (csrc/cpu/isa/), each copy
// in its own namespace (isa_namespace.h); csrc/cpu/isa.cpp picks one at run time.
//
// Matrix products go through at::native::cpublas::brgemm, the one cpublas GEMM
// exported to extensions (cpublas::gemm is not), or for fp32 operands on AVX2 and
// generic CPUs the BLAS sgemm_ torch ships (attention_gemm.h). It computes the row-major
// C[M,N] (+)= A[M,K] B[K,N]; where oneDNN has a micro-kernel for the ISA it
// runs that (AVX2/AVX-512 for fp32, AVX512-BF16/AMX for 16-bit inputs in the
// "VNNI" layout), otherwise it falls back to the BLAS inside torch.
// It has no transpose flags, so the key side is repacked once per call
// (attention_pack.h) into the B-operand layouts; the query side is read in place.
#pragma once

#include "../attention_variants.h"
#include "attention_gemm.h"
#include "attention_microkernel.h"
#include "attention_pack.h"
#include "attention_params.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE {

// Tile sizes (build-time knobs, tuned on a 2-core AVX-512 machine). Queries per
// task x keys per step: the fp32 score tile (block_q x block_k) and the packed
// key/value tile stay in the L2 of one core.
#ifndef FLASHOP_CPU_FWD_BLOCK_Q
#define FLASHOP_CPU_FWD_BLOCK_Q 64
#endif
#ifndef FLASHOP_CPU_FWD_BLOCK_K
#define FLASHOP_CPU_FWD_BLOCK_K 512
#endif
#ifndef FLASHOP_CPU_BWD_BLOCK_Q
#define FLASHOP_CPU_BWD_BLOCK_Q 64
#endif
#ifndef FLASHOP_CPU_BWD_BLOCK_K
#define FLASHOP_CPU_BWD_BLOCK_K 128
#endif
struct ForwardTiles {
  static constexpr int64_t block_q = FLASHOP_CPU_FWD_BLOCK_Q;
  static constexpr int64_t block_k = FLASHOP_CPU_FWD_BLOCK_K;  // multiple of kKeyBlock
};
struct BackwardTiles {
  static constexpr int64_t block_q = FLASHOP_CPU_BWD_BLOCK_Q;
  static constexpr int64_t block_k = FLASHOP_CPU_BWD_BLOCK_K;
};
static_assert(ForwardTiles::block_k % kKeyBlock == 0, "key tiles are made of whole packed key blocks");
constexpr int64_t kBlasBlockQ = 256;  // forward query tile of the fp32 BLAS path (forward_impl)
#ifndef FLASHOP_CPU_TILE_BLOCK_Q
#define FLASHOP_CPU_TILE_BLOCK_Q 128
#endif
constexpr int64_t kTileBlockQ = FLASHOP_CPU_TILE_BLOCK_Q;  // forward query tile of the AVX2 tile_gemm_f32 path
#ifndef FLASHOP_CPU_TILE_BWD_BLOCK_Q
#define FLASHOP_CPU_TILE_BWD_BLOCK_Q 128
#endif
#ifndef FLASHOP_CPU_TILE_BWD_BLOCK_K
#define FLASHOP_CPU_TILE_BWD_BLOCK_K 256
#endif
constexpr int64_t kTileBwdBlockQ = FLASHOP_CPU_TILE_BWD_BLOCK_Q, kTileBwdBlockK = FLASHOP_CPU_TILE_BWD_BLOCK_K;
// Backward tiles of the BLAS path (backward_impl): larger than brgemm's, since each sgemm_ call packs its
// operands (docs/kernels.md gives the measured gain).
constexpr int64_t kBlasBwdBlockQ = 128, kBlasBwdBlockK = 256;

namespace detail {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The keys a query sees (csrc/attention_variants.h): with offset = Sk - Sq, query i sees key j iff
// i + offset - left <= j <= i + offset + right, a negative bound unbounded (causal: right = 0).
struct KeyWindow {
  int64_t left, right, offset, seqlen_k;

  // First key row `i` sees, and one past its last (empty when begin >= end).
  int64_t begin(int64_t i) const { return left < 0 ? 0 : std::clamp<int64_t>(i + offset - left, 0, seqlen_k); }
  int64_t end(int64_t i) const { return right < 0 ? seqlen_k : std::clamp<int64_t>(i + offset + right + 1, 0, seqlen_k); }
  // Keys [j0, j0 + len) all seen by every row of [i0, i0 + rows): no per-element mask needed.
  bool covers(int64_t i0, int64_t rows, int64_t j0, int64_t len) const {
    return (left < 0 || j0 >= i0 + rows - 1 + offset - left) && (right < 0 || j0 + len - 1 <= i0 + offset + right);
  }
};

inline KeyWindow key_window(const AttentionParams& p) {
  return {p.variants.window_left, p.variants.window_right, p.seqlen_k - p.seqlen_q, p.seqlen_k};
}

// The softmax logits of keys [lo, hi) of one row, in place: scale * s, soft-capped, minus the ALiBi bias
// slope * |diag - j| (diag: the row's diagonal key, i + Sk - Sq, minus the tile's first key). With
// `cap_grad`, also the derivative of the capped logit by s (the backward's chain factor).
inline void variant_logits(float* s, int64_t lo, int64_t hi, float scale, float softcap, float slope, int64_t diag,
                           float* cap_grad = nullptr) {
  int64_t j = lo;
  if (softcap > 0.f) {
    // softcap * tanh(scale * s / softcap); d/ds = scale * (1 - tanh^2)
    const Vec vin(scale / softcap), vcap(softcap), vone(1.f), vscale(scale);
    for (; j + Vec::size() <= hi; j += Vec::size()) {
      const Vec t = (Vec::loadu(s + j) * vin).tanh();
      (t * vcap).store(s + j);
      if (cap_grad) ((vone - t * t) * vscale).store(cap_grad + j);
    }
    for (; j < hi; ++j) {
      const float t = std::tanh(s[j] * (scale / softcap));
      s[j] = t * softcap;
      if (cap_grad) cap_grad[j] = (1.f - t * t) * scale;
    }
  } else {
    const Vec vscale(scale);
    for (; j + Vec::size() <= hi; j += Vec::size()) (Vec::loadu(s + j) * vscale).store(s + j);
    for (; j < hi; ++j) s[j] *= scale;
    if (cap_grad) std::fill(cap_grad + lo, cap_grad + hi, scale);
  }
  if (slope != 0.f) {
    const Vec vslope(slope), vdiag(static_cast<float>(diag));
    for (j = lo; j + Vec::size() <= hi; j += Vec::size()) {
      const Vec dist = (vdiag - Vec::arange(static_cast<float>(j), 1.f)).abs();
      (Vec::loadu(s + j) - dist * vslope).store(s + j);
    }
    for (; j < hi; ++j) s[j] -= slope * std::abs(static_cast<float>(diag - j));
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The AVX-512 copy of the kernels: the softmax inner loops below use it directly;
// at::vec covers the other copies.
#define FLASHOP_CPU_AVX512 1

// 2^t on 16 lanes: t = n + f with |f| <= 1/2, 2^f from a degree-5 minimax
// polynomial (relative error 8e-8, below fp32 rounding), 2^n applied by vscalefps.
// Results below the normal range are flushed to 0 (denormal operands slow down the
// P @ V product on some cores); NaN stays NaN. Cheaper than exp_u20 and as accurate.
inline __m512 exp2_avx512(__m512 t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.327646430581808e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675541892647743e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713464617729e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237350464e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440460205e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// 32 fp32 (lo, hi) -> 32 bf16 / fp16 in one register, rounded to nearest even (the
// values here are finite). Built in registers: the memory forms of vpmovdw and
// vcvtps2ph are slow on some cores.
template <typename P>
inline __m512i to_16bit(__m512 lo, __m512 hi) {
  if constexpr (std::is_same_v<P, c10::Half>) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(lo, kRound)), _mm512_cvtps_ph(hi, kRound), 1);
  } else {
    auto round = [](__m512 x) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    };
    // The upper halves of the 32 rounded words, in order.
    const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                               27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(round(lo), odd_words, round(hi));
  }
}
#endif

inline float reduce_max(const float* x, int64_t n) {
#ifdef FLASHOP_CPU_AVX512
  // Two accumulators hide the latency of vmaxps; NaN scores are not filtered here,
  // they reach the output through exp() anyway.
  __m512 m0 = _mm512_set1_ps(kNegInf), m1 = m0;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + j + 16));
  }
  for (; j + 16 <= n; j += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + j));
  if (j < n) m1 = _mm512_max_ps(m1, _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), tail_mask(n - j), x + j));
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
#else
  int64_t j = 0;
  float m = kNegInf;
  if (n >= Vec::size()) {
    Vec vm = Vec::loadu(x);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + j));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
#endif
}

inline float reduce_min(const float* x, int64_t n) {
  int64_t j = 0;
  float m = std::numeric_limits<float>::infinity();
  if (n >= Vec::size()) {
    Vec vm = Vec::loadu(x);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) vm = at::vec::minimum(vm, Vec::loadu(x + j));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::minimum(a, b); }, vm);
  }
  for (; j < n; ++j) m = std::min(m, x[j]);
  return m;
}

// p[j] = exp(s[j] * scale - shift) for j < n and 0 for n <= j < n_pad; returns the
// fp32 sum of the first n. p may alias s (fp32) or be the 16-bit operand of P @ V.
template <typename P>
inline float exp_row(const float* s, int64_t n, int64_t n_pad, float scale, float shift, P* p) {
#ifdef FLASHOP_CPU_AVX512
  constexpr float kLog2e = 1.4426950408889634f;
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e), vshift = _mm512_set1_ps(-shift * kLog2e);
  auto exp16 = [&](int64_t j, __mmask16 m) {
    return _mm512_maskz_mov_ps(m, exp2_avx512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, s + j), vscale, vshift)));
  };
  auto mask16 = [&](int64_t j) { return j >= n ? __mmask16(0) : n - j >= 16 ? __mmask16(0xffff) : tail_mask(n - j); };
  __m512 vsum = _mm512_setzero_ps();
  if constexpr (std::is_same_v<P, float>) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = mask16(j);
      const __m512 e = exp16(j, m);
      vsum = _mm512_add_ps(vsum, e);
      _mm512_mask_storeu_ps(p + j, m, e);
    }
  } else {
    for (int64_t j = 0; j < n; j += 32) {
      const __mmask16 m0 = mask16(j), m1 = mask16(j + 16);
      const __m512 e0 = exp16(j, m0), e1 = exp16(j + 16, m1);
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
      const __mmask32 m = static_cast<__mmask32>(m0) | (static_cast<__mmask32>(m1) << 16);
      _mm512_mask_storeu_epi16(p + j, m, to_16bit<P>(e0, e1));
    }
  }
  std::fill(p + n, p + n_pad, static_cast<P>(0.f));
  return _mm512_reduce_add_ps(vsum);
#else
  const Vec vscale(scale), vshift(-shift);
  Vec vsum(0.f);
  int64_t j = 0;
  if constexpr (std::is_same_v<P, float>) {
    for (; j + Vec::size() <= n; j += Vec::size()) {
      Vec e = at::vec::fmadd(Vec::loadu(s + j), vscale, vshift).exp_u20();
      vsum = vsum + e;
      e.store(p + j);
    }
  } else {
    // Two fp32 vectors make one 16-bit vector.
    for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
      Vec e0 = at::vec::fmadd(Vec::loadu(s + j), vscale, vshift).exp_u20();
      Vec e1 = at::vec::fmadd(Vec::loadu(s + j + Vec::size()), vscale, vshift).exp_u20();
      vsum = vsum + e0 + e1;
      at::vec::convert_from_float<P>(e0, e1).store(p + j);
    }
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; j < n; ++j) {
    const float e = std::exp(s[j] * scale - shift);
    sum += e;
    p[j] = static_cast<P>(e);
  }
  for (; j < n_pad; ++j) p[j] = static_cast<P>(0.f);
  return sum;
#endif
}

inline void scale_row(float* x, int64_t n, float a) {
  const Vec va(a);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * va).store(x + j);
  for (; j < n; ++j) x[j] *= a;
}

// dst[j] = T(src[j] * a)
template <typename T>
inline void store_scaled_row(const float* src, int64_t n, float a, T* dst) {
  const Vec va(a);
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(src + j) * va).store(dst + j);
  } else {
    for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
      at::vec::convert_from_float<T>(Vec::loadu(src + j) * va, Vec::loadu(src + j + Vec::size()) * va).store(dst + j);
    }
  }
  for (; j < n; ++j) dst[j] = static_cast<T>(src[j] * a);
}

template <typename T>
inline void load_row_to_float(const T* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

// How the matrix products of one dtype run.
enum class GemmPath {
  kFloat,      // fp32 inputs: fp32 brgemm, Q and V read in place
  kVnni,       // 16-bit inputs, 16-bit brgemm with fp32 accumulation (K^T and V repacked)
  kWidened,    // 16-bit inputs where no 16-bit micro-kernel runs: tiles widened to fp32
};

template <typename T>
GemmPath forward_gemm_path(int64_t headdim) {
  if constexpr (std::is_same_v<T, float>) {
    return GemmPath::kFloat;
  } else {
    // Pairs along headdim need an even headdim; 16-column multiples keep the
    // P @ V output blocks at sizes every oneDNN micro-kernel (AMX included) takes.
    // brgemm refuses the pair layout while oneDNN is switched off (torch.backends.mkldnn).
    const bool vnni = headdim % 16 == 0 && at::globalContext().userEnabledMkldnn() && vnni_brgemm_supported<T>();
    return vnni ? GemmPath::kVnni : GemmPath::kWidened;
  }
}

// ----------------------------------------------------------------------------
// Forward
// ----------------------------------------------------------------------------

// One task: block_q rows of one query head against every key it sees.
template <typename T, GemmPath path>
struct ForwardTask {
  using Tiles = ForwardTiles;
  using GemmT = std::conditional_t<path == GemmPath::kVnni, T, float>;  // A/B operand type

  const AttentionParams& p;
  const PackedKV<GemmT>& kv;
  // Per-thread scratch
  float* s;       // block_q x block_k scores (fp32 path: also P in place)
  T* p16;         // block_q x block_k P for the 16-bit product (kVnni only)
  float* acc;     // block_q x headdim output accumulator
  float* row_max; // running max of scale * s, per row
  float* row_sum; // running sum of exp(scale * s - row_max), per row
  float* alpha;   // per-row rescale of acc for the current key tile
  float* q_tile;  // block_q x headdim widened queries (kWidened, or kFloat with unusable strides)
  T* q16;         // block_q x headdim queries copied (kVnni with unusable strides)

  void run(int64_t b, int64_t h, int64_t q0, int64_t rows) {
    const int64_t D = p.headdim, Sk = p.seqlen_k, Sq = p.seqlen_q;
    const int64_t hk = h / (p.heads_q / p.heads_k);
    const int64_t offset = Sk - Sq;  // causal: query i sees keys j <= i + offset
    const float scale = p.softmax_scale;
    const int64_t ldS = Tiles::block_k;
    const int64_t ldA = D;

    // The query operand: in place when its row stride is a valid leading dimension.
    const T* q_src = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + q0 * p.q_row_stride;
    const GemmT* qa;
    int64_t lda;
    if constexpr (path == GemmPath::kWidened) {
      for (int64_t r = 0; r < rows; ++r) load_row_to_float(q_src + r * p.q_row_stride, D, q_tile + r * D);
      qa = q_tile, lda = D;
    } else if (rows == 1 || p.q_row_stride >= D) {
      qa = reinterpret_cast<const GemmT*>(q_src), lda = rows == 1 ? D : p.q_row_stride;
    } else {
      // Overlapping rows (e.g. a stride-0 expand): copy the tile, the product needs lda >= D.
      GemmT* dst = path == GemmPath::kVnni ? reinterpret_cast<GemmT*>(q16) : reinterpret_cast<GemmT*>(q_tile);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * D, q_src + r * p.q_row_stride, D * sizeof(T));
      qa = dst, lda = D;
    }

    for (int64_t r = 0; r < rows; ++r) row_max[r] = kNegInf, row_sum[r] = 0.f;

    // Keys seen by any row of the tile: tiles wholly outside the window (causal: right of the diagonal)
    // are skipped; the first tile starts at a packed key block.
    const AttentionVariants& var = p.variants;
    const KeyWindow window = key_window(p);
    const int64_t key_begin = window.begin(q0), key_end = window.end(q0 + rows - 1);
    // Softcap and ALiBi turn the scores into logits before the softmax (scale applied there).
    const bool logits = var.softcap > 0.f || var.alibi_slopes != nullptr;
    const float slope = var.alibi_slopes ? var.alibi_slopes[b * var.alibi_batch_stride + h] : 0.f;
    const float exp_scale = logits ? 1.f : scale;
    bool first = true;
    for (int64_t j0 = key_begin / kKeyBlock * kKeyBlock; j0 < key_end; j0 += Tiles::block_k) {
      const int64_t len = std::min(Tiles::block_k, key_end - j0);
      const int64_t len_pad = div_up(len, kKeyBlock) * kKeyBlock;

      // S = Q K^T: one product over the keys as rows (BLAS), or one brgemm per packed block of kKeyBlock keys.
      if constexpr (path != GemmPath::kVnni) {
        if (kv.keys_as_rows()) {
          blas_gemm_f32(false, true, rows, len, D, lda, kv.k_ld(), ldS, false, qa, kv.key_rows(b, hk, j0), s);
        }
      }
      if (!kv.keys_as_rows()) {
        for (int64_t kb = 0; kb < len_pad; kb += kKeyBlock) {
          const GemmT* key_block = kv.key_block(b, hk, (j0 + kb) / kKeyBlock);
          if constexpr (path == GemmPath::kVnni) {
            at::native::cpublas::brgemm(rows, kKeyBlock, kv.k_depth(), lda, kKeyBlock, ldS, /*add_C=*/false, qa,
                                        key_block, s + kb, /*is_vnni=*/true);
          } else if constexpr (kTileGemm) {
            // Only the columns of keys the tile has, rounded up to whole 16-column panels (zero keys past them).
            const int64_t cols = std::min(kKeyBlock, div_up(len - kb, 16) * 16);
            tile_gemm_f32(rows, cols, kv.k_depth(), lda, kKeyBlock, ldS, /*add_C=*/false, qa, key_block, s + kb);
          } else {
            gemm_f32(rows, kKeyBlock, kv.k_depth(), lda, kKeyBlock, ldS, /*add_C=*/false, qa, key_block, s + kb);
          }
        }
      }

      // Online softmax; only tiles that cross a window edge need the per-row mask.
      const bool full = window.covers(q0, rows, j0, len);
      for (int64_t r = 0; r < rows; ++r) {
        // The row sees keys [j0 + lo, j0 + lo + n) of this tile.
        const int64_t lo = full ? 0 : std::clamp<int64_t>(window.begin(q0 + r) - j0, 0, len);
        const int64_t n = full ? len : std::max<int64_t>(std::clamp<int64_t>(window.end(q0 + r) - j0, 0, len) - lo, 0);
        float* srow = s + r * ldS;
        // The product with V reads len (fp32) or len_pad (16-bit, zero-padded) columns.
        const int64_t n_pad = path == GemmPath::kVnni ? len_pad : len;
        if (n == 0) {
          // Nothing seen in this tile (causal): P row is 0, the running state stays.
          if constexpr (path == GemmPath::kVnni) {
            std::fill_n(p16 + r * ldS, n_pad, T(0.f));
          } else {
            std::fill_n(srow, n_pad, 0.f);
          }
          alpha[r] = 1.f;
          continue;
        }
        if (logits) variant_logits(srow, lo, lo + n, scale, var.softcap, slope, q0 + r + offset - j0);
        const float* xs = srow + lo;
        const float tile_max = logits ? reduce_max(xs, n)
                               : scale >= 0 ? scale * reduce_max(xs, n) : scale * reduce_min(xs, n);
        const float m_new = std::max(row_max[r], tile_max);
        // m_new is finite whenever the scores are: no -inf - -inf here.
        alpha[r] = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - m_new);
        float sum;
        if constexpr (path == GemmPath::kVnni) {
          std::fill_n(p16 + r * ldS, lo, T(0.f));
          sum = exp_row(xs, n, n_pad - lo, exp_scale, m_new, p16 + r * ldS + lo);
        } else {
          sum = exp_row(xs, n, n_pad - lo, exp_scale, m_new, srow + lo);
          std::fill_n(srow, lo, 0.f);
        }
        row_sum[r] = row_sum[r] * alpha[r] + sum;
        row_max[r] = m_new;
      }

      // acc = diag(alpha) acc + P V
      if (!first) {
        for (int64_t r = 0; r < rows; ++r) {
          if (alpha[r] != 1.f) scale_row(acc + r * ldA, ldA, alpha[r]);
        }
      }
      if constexpr (path == GemmPath::kVnni) {
        for (int64_t d0 = 0; d0 < D; d0 += kValueBlock) {
          at::native::cpublas::brgemm(rows, std::min(kValueBlock, D - d0), len_pad, ldS, kValueBlock, ldA, !first,
                                      p16, kv.value_block(b, hk, d0 / kValueBlock, j0), acc + d0, true);
        }
      } else if constexpr (kTileGemm) {
        tile_gemm_f32(rows, D, len, ldS, kv.v_ld(), ldA, !first, s, kv.value_rows(b, hk, j0), acc);
      } else {
        gemm_f32(rows, D, len, ldS, kv.v_ld(), ldA, !first, s, kv.value_rows(b, hk, j0), acc);
      }
      first = false;
    }

    // out = acc / row_sum; rows that saw no key give 0 and lse = -inf. A sink adds exp(sink) to the
    // row sum (a row without keys then has lse = sink).
    T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride + q0 * p.out_row_stride;
    float* lse = p.softmax_lse + b * p.lse_batch_stride + h * p.lse_head_stride + q0 * p.lse_row_stride;
    const float sink = var.sinks ? var.sinks[h] : kNegInf;
    for (int64_t r = 0; r < rows; ++r) {
      T* orow = out + r * p.out_row_stride;
      const bool empty = first || row_sum[r] == 0.f;
      if (var.sinks) {
        const float m = empty ? sink : std::max(row_max[r], sink);
        const float keys_part = empty ? 0.f : row_sum[r] * std::exp(row_max[r] - m);
        const float total = keys_part + std::exp(sink - m);
        if (empty) {
          std::fill_n(orow, D, T(0.f));
        } else {
          store_scaled_row(acc + r * ldA, D, std::exp(row_max[r] - m) / total, orow);
        }
        lse[r * p.lse_row_stride] = m + std::log(total);
      } else if (empty) {
        std::fill_n(orow, D, T(0.f));
        lse[r * p.lse_row_stride] = kNegInf;
      } else {
        store_scaled_row(acc + r * ldA, D, 1.f / row_sum[r], orow);
        lse[r * p.lse_row_stride] = row_max[r] + std::log(row_sum[r]);
      }
    }
  }
};

template <typename T, GemmPath path>
void forward_impl(const AttentionParams& p) {
  using Tiles = ForwardTiles;
  using GemmT = std::conditional_t<path == GemmPath::kVnni, T, float>;
  const int64_t B = p.batch, Hq = p.heads_q, Sq = p.seqlen_q, D = p.headdim;

  // fp32 products through the BLAS sgemm (AVX2, generic): keys as rows (in place, or widened once), one
  // product per key tile, and query tiles of kBlasBlockQ rows, as torch's CPU kernel takes for fp32 (fewer,
  // larger products: the fp32 non-causal forward about 1.0x torch's under AVX2 on 2 cores, 0.9x with packed
  // keys and 64-row tiles). brgemm keeps packed keys and block_q.
  const bool blas = path != GemmPath::kVnni && !kTileGemm && blas_sgemm_used() &&
                    fits_blas_int({D, p.q_row_stride, p.k_row_stride, p.v_row_stride});
  const int64_t block_q = blas ? kBlasBlockQ : (path != GemmPath::kVnni && kTileGemm) ? kTileBlockQ : Tiles::block_q;
  // The tile path reads V a 16-column panel at a time down a whole key tile: rows copied contiguous keep that in
  // a few pages (in place, rows heads x headdim apart spread it over a megabyte; docs/kernels.md has the cost).
  // It packs per thread, one (batch, kv head) at a time (PackedKV's one_head): the other paths pack every head
  // once per call, in parallel.
  constexpr bool per_thread_pack = path != GemmPath::kVnni && kTileGemm;
  const bool value_in_place = path == GemmPath::kFloat && !kTileGemm;
  PackedKV<GemmT> shared_kv;
  if (!per_thread_pack) shared_kv.template pack<T>(p, value_in_place, /*key_rows=*/blas);

  const int64_t n_qtiles = div_up(Sq, block_q);
  const int64_t head_ratio = Hq / p.heads_k;
  at::parallel_for(0, B * Hq * n_qtiles, 1, [&](int64_t begin, int64_t end) {
    PackedKV<GemmT> own_kv;
    if (per_thread_pack) own_kv.template pack<T>(p, value_in_place, /*key_rows=*/false, /*one_head=*/true);
    const PackedKV<GemmT>& kv = per_thread_pack ? own_kv : shared_kv;
    const int64_t ld = Tiles::block_k;
    AlignedBuffer<float> s(block_q * ld), acc(block_q * D), stats(3 * block_q);
    AlignedBuffer<T> p16(path == GemmPath::kVnni ? block_q * ld : 0);
    AlignedBuffer<float> q_tile(path == GemmPath::kVnni ? 0 : block_q * D);
    AlignedBuffer<T> q16(path == GemmPath::kVnni ? block_q * D : 0);
    ForwardTask<T, path> task{p,        kv,    s.data(),
                              p16.data(), acc.data(), stats.data(),
                              stats.data() + block_q, stats.data() + 2 * block_q,
                              q_tile.data(), q16.data()};
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / n_qtiles, i = t % n_qtiles;
      // Causal: interleave cheap (top) and expensive (bottom) query tiles so that
      // contiguous chunks of tasks cost about the same.
      const int64_t qt = p.causal ? ((i % 2 == 0) ? i / 2 : n_qtiles - 1 - i / 2) : i;
      const int64_t q0 = qt * block_q;
      if (per_thread_pack) own_kv.template pack_head<T>(p, bh / Hq, bh % Hq / head_ratio);
      task.run(bh / Hq, bh % Hq, q0, std::min(block_q, Sq - q0));
    }
    if constexpr (path == GemmPath::kVnni) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace detail

// out (strided as given) and softmax_lse (contiguous) are written for every row.
template <typename T>
void attention_forward(const AttentionParams& p) {
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0) return;
  if (p.seqlen_k == 0) {
    // No key at all: every row is empty.
    at::parallel_for(0, p.batch * p.heads_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
        T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
        for (int64_t r = 0; r < p.seqlen_q; ++r) std::fill_n(out + r * p.out_row_stride, p.headdim, T(0.f));
        float* lse = p.softmax_lse + b * p.lse_batch_stride + h * p.lse_head_stride;
        const float empty_lse = p.variants.sinks ? p.variants.sinks[h] : detail::kNegInf;
        for (int64_t r = 0; r < p.seqlen_q; ++r) lse[r * p.lse_row_stride] = empty_lse;
      }
    });
    return;
  }
  switch (detail::forward_gemm_path<T>(p.headdim)) {
    case detail::GemmPath::kFloat:
      if constexpr (std::is_same_v<T, float>) detail::forward_impl<T, detail::GemmPath::kFloat>(p);
      break;
    case detail::GemmPath::kVnni:
      if constexpr (!std::is_same_v<T, float>) detail::forward_impl<T, detail::GemmPath::kVnni>(p);
      break;
    case detail::GemmPath::kWidened:
      if constexpr (!std::is_same_v<T, float>) detail::forward_impl<T, detail::GemmPath::kWidened>(p);
      break;
  }
}

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

#include "attention_backward.h"

// Key/value operands of the CPU attention kernels, repacked for brgemm.
//
// brgemm multiplies row-major A[M,K] by B[K,N] and has no transpose flag, so
// S = Q K^T needs K^T. Every query tile of every head in a group reads the same
// keys, so K^T (and, for 16-bit inputs, V) is packed once per call, in parallel,
// in blocks of kKeyBlock keys (memory O(seqlen_k), like the inputs themselves);
// or, one_head, by each thread for the one (batch, kv head) its tasks read now.
//
// Layouts (per batch b and key/value head hk):
//   fp32 K^T      [key block][headdim][kKeyBlock]                      ldb = kKeyBlock
//   16-bit K^T    [key block][headdim/2][kKeyBlock][2]   ("VNNI": the two
//                 rows of a pair of the reduction dim sit side by side)  ldb = kKeyBlock
//   16-bit V      [headdim block][seqlen_k_padded/2][kValueBlock][2]    ldb = kValueBlock
//   fp32 V        read in place (row stride) or widened to [seqlen_k][headdim]
// Keys past seqlen_k are zero-filled up to the key block.
#pragma once

#include "isa_namespace.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE {

constexpr int64_t kKeyBlock = 64;    // keys per packed K^T block (N of one S = Q K^T brgemm)
constexpr int64_t kValueBlock = 64;  // headdim columns per packed 16-bit V block

// Uninitialised, 64-byte aligned scratch that the kernels own (no at::Tensor here).
template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t n) { reset(n); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }
  void reset(int64_t n) {
    release();
    if (n > 0) data_ = static_cast<T*>(::operator new(static_cast<size_t>(n) * sizeof(T), std::align_val_t{64}));
  }
  T* data() const { return data_; }

 private:
  void release() {
    if (data_) ::operator delete(data_, std::align_val_t{64});
    data_ = nullptr;
  }
  T* data_ = nullptr;
};

// Whether this build and CPU run 16-bit brgemm on pair-packed B (oneDNN's micro-kernel:
// AVX512-BF16 or AMX for bf16, AMX-FP16 for fp16). Checked once by running a small
// product and comparing with the exact result, so a layout mismatch also turns it off;
// without it the kernels widen 16-bit tiles to fp32.
template <typename T>
bool vnni_brgemm_supported() {
  static const bool supported = [] {
    constexpr int64_t M = 3, N = 48, K = 6;
    T a[M * K];
    T b[(K / 2) * kValueBlock * 2];
    float c[M * N];
    for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<T>(static_cast<float>(i % 7) - 3.f);
    std::fill_n(b, (K / 2) * kValueBlock * 2, static_cast<T>(0.f));
    auto b_val = [](int64_t k, int64_t n) { return static_cast<float>((k * 5 + n * 3) % 11) - 5.f; };
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) b[((k / 2) * kValueBlock + n) * 2 + (k % 2)] = static_cast<T>(b_val(k, n));
    try {
      at::native::cpublas::brgemm(M, N, K, K, kValueBlock, N, /*add_C=*/false, a, b, c, /*is_vnni=*/true);
      at::native::cpublas::brgemm(M, N, K, K, kValueBlock, N, /*add_C=*/true, a, b, c, /*is_vnni=*/true);
      at::native::cpublas::brgemm_release(true);
    } catch (const std::exception&) {
      return false;
    }
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        float ref = 0.f;
        for (int64_t k = 0; k < K; ++k) ref += static_cast<float>(a[m * K + k]) * b_val(k, n);
        if (c[m * N + n] != 2.f * ref) return false;
      }
    }
    return true;
  }();
  return supported;
}

// Packed keys (and values where they are not read in place) of one call.
// GemmT is the brgemm operand type: float, or the 16-bit input type.
template <typename GemmT>
class PackedKV {
 public:
  static constexpr bool kVnni = !std::is_same_v<GemmT, float>;

  // Inputs of type T (T == GemmT, or 16-bit T widened to float). Params has the
  // fields of AttentionParams used here. key_rows (fp32 products only): the caller reads keys as rows
  // (blas_gemm_f32 with B transposed), in place where their rows allow, else widened or copied into rows;
  // otherwise keys are packed into K^T blocks of kKeyBlock keys.
  // one_head: buffers for one (batch, kv head) only, packed by pack_head when the caller moves to it (a
  // thread's own copy: its query tiles' keys stay in its L2, and no buffer of every head is faulted in per call).
  template <typename T, typename Params>
  void pack(const Params& p, bool value_in_place, bool key_rows = false, bool one_head = false) {
    static_assert(std::is_same_v<T, GemmT> || std::is_same_v<GemmT, float>);
    one_head_ = one_head;
    head_b_ = head_hk_ = -1;
    B_ = one_head ? 1 : p.batch, Hk_ = one_head ? 1 : p.heads_k, Sk_ = p.seqlen_k, D_ = p.headdim;
    n_kblocks_ = (Sk_ + kKeyBlock - 1) / kKeyBlock;
    sk_pad_ = n_kblocks_ * kKeyBlock;
    n_dblocks_ = (D_ + kValueBlock - 1) / kValueBlock;
    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v);
    k_rows_ = key_rows && !kVnni;
    k_in_place_ = k_rows_ && std::is_same_v<T, GemmT> && (Sk_ == 1 || p.k_row_stride >= D_);
    if (k_in_place_) {
      k_direct_ = reinterpret_cast<const GemmT*>(k);
      k_batch_stride_ = p.k_batch_stride, k_head_stride_ = p.k_head_stride;
      k_ld_ = Sk_ == 1 ? D_ : p.k_row_stride;
    } else if (k_rows_) {
      keys_.reset(B_ * Hk_ * Sk_ * D_);
      k_direct_ = keys_.data();
      k_batch_stride_ = Hk_ * Sk_ * D_, k_head_stride_ = Sk_ * D_, k_ld_ = D_;
    } else {
      keys_.reset(B_ * Hk_ * sk_pad_ * D_);
    }
    // V's rows must be a valid leading dimension to be read in place.
    v_in_place_ = value_in_place && !kVnni && (Sk_ == 1 || p.v_row_stride >= D_);
    if (v_in_place_) {
      v_direct_ = reinterpret_cast<const GemmT*>(v);
      v_batch_stride_ = p.v_batch_stride, v_head_stride_ = p.v_head_stride;
      v_ld_ = Sk_ == 1 ? D_ : p.v_row_stride;
    } else {
      values_.reset(kVnni ? B_ * Hk_ * n_dblocks_ * sk_pad_ * kValueBlock : B_ * Hk_ * Sk_ * D_);
      v_ld_ = D_;
    }

    if (one_head || (k_in_place_ && v_in_place_)) return;
    at::parallel_for(0, B_ * Hk_ * n_kblocks_, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bh = t / n_kblocks_;
        pack_block<T>(p, bh / Hk_, bh % Hk_, t % n_kblocks_);
      }
    });
  }

  // one_head: the keys and values of (b, hk), unless they are the ones packed last.
  template <typename T, typename Params>
  void pack_head(const Params& p, int64_t b, int64_t hk) {
    if (!one_head_ || (b == head_b_ && hk == head_hk_) || (k_in_place_ && v_in_place_)) return;
    head_b_ = b, head_hk_ = hk;
    for (int64_t kb = 0; kb < n_kblocks_; ++kb) pack_block<T>(p, b, hk, kb);
  }

  // Reduction depth of S = Q K^T (headdim).
  int64_t k_depth() const { return D_; }
  // Keys as rows (pack's key_rows): rows from key j0, leading dimension k_ld().
  bool keys_as_rows() const { return k_rows_; }
  const GemmT* key_rows(int64_t b, int64_t hk, int64_t j0) const {
    return k_direct_ + b * k_batch_stride_ + hk * k_head_stride_ + j0 * k_ld_;
  }
  int64_t k_ld() const { return k_ld_; }
  const GemmT* key_block(int64_t b, int64_t hk, int64_t kb) const {
    return keys_.data() + (slot(b, hk) * n_kblocks_ + kb) * kKeyBlock * D_;
  }
  // 16-bit: the V block of headdim columns [db * kValueBlock, ...) starting at key j0 (even).
  const GemmT* value_block(int64_t b, int64_t hk, int64_t db, int64_t j0) const {
    return values_.data() + (slot(b, hk) * n_dblocks_ + db) * sk_pad_ * kValueBlock + j0 * kValueBlock;
  }
  // fp32: V rows from key j0, leading dimension v_ld().
  const float* value_rows(int64_t b, int64_t hk, int64_t j0) const {
    if constexpr (kVnni) {
      return nullptr;
    } else {
      if (v_in_place_) return v_direct_ + b * v_batch_stride_ + hk * v_head_stride_ + j0 * v_ld_;
      return values_.data() + (slot(b, hk) * Sk_ + j0) * D_;
    }
  }
  int64_t v_ld() const { return v_ld_; }

 private:
  // Index of (b, hk)'s packed keys and values in the buffers (one_head: the only ones).
  int64_t slot(int64_t b, int64_t hk) const { return one_head_ ? 0 : b * Hk_ + hk; }

  // Key block kb of (b, hk) into its slot: K^T (or key rows) and, unless read in place, the values.
  template <typename T, typename Params>
  void pack_block(const Params& p, int64_t b, int64_t hk, int64_t kb) {
    const int64_t bh = slot(b, hk);
    const int64_t j0 = kb * kKeyBlock, n = std::min(kKeyBlock, Sk_ - j0);
    const T* ksrc = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride + j0 * p.k_row_stride;
    const T* vsrc = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride + j0 * p.v_row_stride;
    if (k_rows_) {
      if constexpr (!kVnni) {
        if (!k_in_place_) copy_rows(ksrc, p.k_row_stride, n, keys_.data() + (bh * Sk_ + j0) * D_);
      }
    } else {
      pack_key_block(ksrc, p.k_row_stride, n, keys_.data() + (bh * n_kblocks_ + kb) * kKeyBlock * D_);
    }
    if (v_in_place_) return;
    if constexpr (kVnni) {
      pack_value_rows(vsrc, p.v_row_stride, n, bh, j0);
    } else {
      copy_rows(vsrc, p.v_row_stride, n, values_.data() + (bh * Sk_ + j0) * D_);
    }
  }

  // n rows of headdim elements (row stride ld) -> n contiguous fp32 rows.
  template <typename T>
  void copy_rows(const T* src, int64_t ld, int64_t n, float* dst) const {
    for (int64_t r = 0; r < n; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst + r * D_, src + r * ld, D_ * sizeof(float));
      } else {
        at::vec::convert(src + r * ld, dst + r * D_, D_);
      }
    }
  }

  // n (<= kKeyBlock) key rows -> one K^T block; keys n.. are zero.
  template <typename T>
  void pack_key_block(const T* src, int64_t ld, int64_t n, GemmT* dst) const {
    if constexpr (kVnni) {
      // A pair (d, d+1) of one key is one 32-bit unit: this is a 32-bit transpose
      // of the (keys x headdim/2) matrix, done as a float transpose (moves only).
      static_assert(sizeof(GemmT) == 2);
      const int64_t D2 = D_ / 2;
      float* out = reinterpret_cast<float*>(dst);
      if (ld % 2 == 0 || n == 1) {
        at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(src), n == 1 ? D2 : ld / 2, out, kKeyBlock,
                                      static_cast<int>(n), static_cast<int>(D2));
      } else {
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t d2 = 0; d2 < D2; ++d2) std::memcpy(out + d2 * kKeyBlock + j, src + j * ld + 2 * d2, 4);
        }
      }
      if (n < kKeyBlock) {
        for (int64_t d2 = 0; d2 < D2; ++d2) std::fill(out + d2 * kKeyBlock + n, out + (d2 + 1) * kKeyBlock, 0.f);
      }
    } else {
      if constexpr (std::is_same_v<T, float>) {
        at::vec::transpose_mxn<float>(src, ld, dst, kKeyBlock, static_cast<int>(n), static_cast<int>(D_));
      } else {
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t d = 0; d < D_; ++d) dst[d * kKeyBlock + j] = static_cast<float>(src[j * ld + d]);
        }
      }
      if (n < kKeyBlock) {
        for (int64_t d = 0; d < D_; ++d) std::fill(dst + d * kKeyBlock + n, dst + (d + 1) * kKeyBlock, 0.f);
      }
    }
  }

  // n value rows from key j0 (a multiple of kKeyBlock) into the pair-interleaved blocks.
  template <typename T>
  void pack_value_rows(const T* src, int64_t ld, int64_t n, int64_t bh, int64_t j0) {
    if constexpr (kVnni) {
      const T zero = static_cast<T>(0.f);
      for (int64_t db = 0; db < n_dblocks_; ++db) {
        const int64_t c0 = db * kValueBlock, cn = std::min(kValueBlock, D_ - c0);
        GemmT* dst = values_.data() + (bh * n_dblocks_ + db) * sk_pad_ * kValueBlock + j0 * kValueBlock;
        for (int64_t j = 0; j < kKeyBlock; j += 2) {
          const T* r0 = j < n ? src + j * ld + c0 : nullptr;
          const T* r1 = j + 1 < n ? src + (j + 1) * ld + c0 : nullptr;
          GemmT* out = dst + j * kValueBlock;  // pair row j/2: kValueBlock x 2 elements
          int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
          if (r0 && r1) {
            // Interleave 32 columns of the two rows: words (r0[c], r1[c]) side by side.
            const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
            const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                                54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
            for (; c + 32 <= cn; c += 32) {
              const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r1 + c);
              _mm512_storeu_si512(out + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
              _mm512_storeu_si512(out + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
            }
          }
#endif
          for (; c < cn; ++c) {
            out[2 * c] = r0 ? r0[c] : zero;
            out[2 * c + 1] = r1 ? r1[c] : zero;
          }
          for (int64_t c = cn; c < kValueBlock; ++c) out[2 * c] = zero, out[2 * c + 1] = zero;
        }
      }
    }
  }

  int64_t B_ = 0, Hk_ = 0, Sk_ = 0, D_ = 0, n_kblocks_ = 0, sk_pad_ = 0, n_dblocks_ = 0;
  bool one_head_ = false;
  int64_t head_b_ = -1, head_hk_ = -1;
  AlignedBuffer<GemmT> keys_;
  AlignedBuffer<GemmT> values_;
  bool v_in_place_ = false;
  const GemmT* v_direct_ = nullptr;
  int64_t v_batch_stride_ = 0, v_head_stride_ = 0, v_ld_ = 0;
  bool k_rows_ = false, k_in_place_ = false;
  const GemmT* k_direct_ = nullptr;
  int64_t k_batch_stride_ = 0, k_head_stride_ = 0, k_ld_ = 0;
};

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

// Backward of the CPU attention kernel (FlashAttention-2): P is recomputed from
// the saved log-sum-exp, nothing of size seqlen_q x seqlen_k is ever stored.
//
//   D_i = rowsum(dO_i * O_i)
//   per key tile j, query tile i:  S = Q_i K_j^T,  P = exp(scale S - lse),
//     dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = scale P (dP - D_i),
//     dQ_i += dS K_j,  dK_j += dS^T Q_i
//
// One task owns a (batch, key/value head) pair and loops over the query heads of
// its group, so dK/dV of a group are summed without races and without repeating
// K/V in memory. All products run in fp32 (16-bit inputs are widened tile by tile).
#pragma once

#include "attention_kernels.h"

#include <tuple>
#include <utility>
#include <vector>

namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE {
namespace detail {

// rows x cols (leading dimension ld_src) -> cols x rows (ld_dst).
inline void transpose(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst) {
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(rows), static_cast<int>(cols));
}

// rows of type T (row stride ld) -> rows x cols fp32, transposed: dst[c * ld_dst + r].
template <typename T>
inline void transpose_to_float(const T* src, int64_t ld, int64_t rows, int64_t cols, float* dst, int64_t ld_dst) {
  if constexpr (std::is_same_v<T, float>) {
    transpose(src, ld, rows, cols, dst, ld_dst);
  } else {
    constexpr int64_t kSub = 16;  // sub-blocks keep the strided side in L1
    for (int64_t r = 0; r < rows; r += kSub) {
      const int64_t rn = std::min(kSub, rows - r);
      for (int64_t c = 0; c < cols; c += kSub) {
        const int64_t cn = std::min(kSub, cols - c);
        for (int64_t rr = 0; rr < rn; ++rr) {
          const T* s = src + (r + rr) * ld + c;
          for (int64_t cc = 0; cc < cn; ++cc) dst[(c + cc) * ld_dst + r + rr] = static_cast<float>(s[cc]);
        }
      }
    }
  }
}

// P row and dS row of one query: p[j] = exp(scale s[j] - lse) for j < n (else 0),
// ds[j] = scale p[j] (dp[j] - d_i). p overwrites s, ds overwrites dp.
inline void softmax_grad_row(float* s, float* dp, int64_t n, int64_t len, float scale, float lse, float d_i) {
  int64_t j = 0;
#ifdef FLASHOP_CPU_AVX512
  // Same exponential as the forward, so P matches the saved log-sum-exp.
  constexpr float kLog2e = 1.4426950408889634f;
  const __m512 vscale2 = _mm512_set1_ps(scale * kLog2e), vshift = _mm512_set1_ps(-lse * kLog2e);
  const __m512 vscale = _mm512_set1_ps(scale), vd = _mm512_set1_ps(d_i);
  for (; j + 16 <= n; j += 16) {
    const __m512 pv = exp2_avx512(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vscale2, vshift));
    _mm512_storeu_ps(s + j, pv);
    _mm512_storeu_ps(dp + j, _mm512_mul_ps(_mm512_mul_ps(pv, vscale), _mm512_sub_ps(_mm512_loadu_ps(dp + j), vd)));
  }
#else
  const Vec vscale(scale), vlse(-lse), vd(d_i);
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec pv = at::vec::fmadd(Vec::loadu(s + j), vscale, vlse).exp_u20();
    pv.store(s + j);
    (pv * (Vec::loadu(dp + j) - vd) * vscale).store(dp + j);
  }
#endif
  for (; j < n; ++j) {
    const float pv = std::exp(s[j] * scale - lse);
    s[j] = pv;
    dp[j] = scale * pv * (dp[j] - d_i);
  }
  for (; j < len; ++j) s[j] = 0.f, dp[j] = 0.f;
}

// softmax_grad_row for logits that are not scale * s (softcap, ALiBi: variant_logits), over keys [lo, hi)
// of a tile of len: p = exp(logit - lse), ds = p (dp - d_i) dlogit/ds; zero elsewhere. `grad` is scratch.
inline void softmax_grad_row_logits(float* s, float* dp, int64_t lo, int64_t hi, int64_t len, float scale,
                                    float softcap, float slope, int64_t diag, float lse, float d_i, float* grad) {
  variant_logits(s, lo, hi, scale, softcap, slope, diag, grad);
  const Vec vlse(-lse), vd(d_i);
  int64_t j = lo;
  for (; j + Vec::size() <= hi; j += Vec::size()) {
    const Vec pv = (Vec::loadu(s + j) + vlse).exp_u20();
    pv.store(s + j);
    (pv * (Vec::loadu(dp + j) - vd) * Vec::loadu(grad + j)).store(dp + j);
  }
  for (; j < hi; ++j) {
    const float pv = std::exp(s[j] - lse);
    s[j] = pv;
    dp[j] = pv * (dp[j] - d_i) * grad[j];
  }
  std::fill(s, s + lo, 0.f), std::fill(dp, dp + lo, 0.f);
  std::fill(s + std::max(hi, lo), s + len, 0.f), std::fill(dp + std::max(hi, lo), dp + len, 0.f);
}

// fp32 operand rows of one head: in place when T is float and the row stride is a
// valid leading dimension, else widened/copied into `buf` (rows x D).
template <typename T>
inline std::pair<const float*, int64_t> float_rows(const T* src, int64_t ld, int64_t rows, int64_t D, float* buf,
                                                   bool contiguous = false) {
  if constexpr (std::is_same_v<T, float>) {
    if (rows == 1 || ld == D) return {src, D};
    if (ld > D && !contiguous) return {src, ld};
  }
  for (int64_t r = 0; r < rows; ++r) load_row_to_float(src + r * ld, D, buf + r * D);
  return {buf, D};
}

template <typename T>
void backward_impl(const BackwardParams& p) {
  const int64_t B = p.batch, Sq = p.seqlen_q, Sk = p.seqlen_k, Hq = p.heads_q, Hk = p.heads_k, D = p.headdim;
  const int64_t G = Hq / Hk;
  const float scale = p.softmax_scale;
  const AttentionVariants& var = p.variants;
  const KeyWindow window = key_window(p);
  const bool logits = var.softcap > 0.f || var.alibi_slopes != nullptr;
  // Three ways to the products. The AVX2 copy's tile GEMM (attention_microkernel.h) reads P^T and dS^T as
  // they lie and K^T, V^T from copies per key tile, with Q, dO and K as contiguous rows (rows heads x headdim
  // apart would spread its panels over many pages). Through the BLAS sgemm (generic) the transposed operands
  // are its transpose flags, K and V read in place. brgemm (AVX-512) has no such flags, so K^T, V^T, P^T and
  // dS^T are copied there.
  constexpr bool tile = kTileGemm;
  const bool blas = !tile && blas_sgemm_used() &&
                    fits_blas_int({D, p.q_row_stride, p.dout_row_stride, p.k_row_stride, p.v_row_stride});
  const int64_t BQ = tile ? kTileBwdBlockQ : blas ? kBlasBwdBlockQ : BackwardTiles::block_q;
  const int64_t BK = tile ? kTileBwdBlockK : blas ? kBlasBwdBlockK : BackwardTiles::block_k;
  const int64_t n_ktiles = div_up(Sk, BK);

  // A task owns the key tiles of one (batch, kv head) whose index is = c mod n_chunks:
  // dK/dV need no synchronisation. With fewer (batch, kv head) pairs than threads the
  // key tiles are split into chunks (interleaved, so causal chunks cost the same),
  // each with its own fp32 dQ partial sum, reduced afterwards.
  const int64_t n_chunks =
      std::clamp<int64_t>(div_up(at::get_num_threads(), B * Hk), 1, std::max<int64_t>(n_ktiles, 1));
  const int64_t group_size = G * Sq * D;  // fp32 dQ of one (batch, kv head) group
  AlignedBuffer<float> dq_acc(B * Hk * n_chunks * group_size);
  const bool widen_q = !std::is_same_v<T, float> || (Sq > 1 && (tile ? p.q_row_stride != D : p.q_row_stride < D));
  const bool widen_do = !std::is_same_v<T, float> || (Sq > 1 && (tile ? p.dout_row_stride != D : p.dout_row_stride < D));

  at::parallel_for(0, B * Hk * n_chunks, 1, [&](int64_t begin, int64_t end) {
    // Per-thread scratch: O(G * seqlen_q * headdim) for the query side, O(tile) for the rest.
    AlignedBuffer<float> q_buf(widen_q ? group_size : 0), do_buf(widen_do ? group_size : 0), d_rows(G * Sq);
    AlignedBuffer<float> k_buf(BK * D), v_buf(blas ? BK * D : 0), dk_acc(BK * D), dv_acc(BK * D);
    AlignedBuffer<float> s(BQ * BK), dp(BQ * BK), o_row(D), grad(BK);
    // The transposed copies: K^T, V^T (headdim x BK; brgemm and the tile GEMM), P^T, dS^T (BK x BQ; brgemm).
    const int64_t kv_copy = blas ? 0 : D * BK, ps_copy = blas || tile ? 0 : BK * BQ;
    AlignedBuffer<float> kt(kv_copy), vt(kv_copy), pt(ps_copy), dst(ps_copy);
    std::vector<const float*> q_rows(G), do_rows(G);
    std::vector<int64_t> ld_q(G), ld_do(G);

    for (int64_t task = begin; task < end; ++task) {
      const int64_t bhk = task / n_chunks, chunk = task % n_chunks;
      const int64_t b = bhk / Hk, hk = bhk % Hk;
      float* dq_part = dq_acc.data() + task * group_size;
      std::fill_n(dq_part, group_size, 0.f);

      // Query side of the group's heads: fp32 rows of Q and dO, D_i = rowsum(dO * O).
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
        const T* dout = static_cast<const T*>(p.dout) + b * p.dout_batch_stride + h * p.dout_head_stride;
        const T* out = static_cast<const T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
        auto [qp, lq] = float_rows(q, p.q_row_stride, Sq, D, q_buf.data() + g * Sq * D, tile);
        auto [dop, ldo] = float_rows(dout, p.dout_row_stride, Sq, D, do_buf.data() + g * Sq * D, tile);
        q_rows[g] = qp, do_rows[g] = dop, ld_q[g] = lq, ld_do[g] = ldo;
        for (int64_t i = 0; i < Sq; ++i) {
          load_row_to_float(out + i * p.out_row_stride, D, o_row.data());
          const float* dorow = dop + i * ldo;
          Vec acc(0.f);
          int64_t d = 0;
          for (; d + Vec::size() <= D; d += Vec::size()) {
            acc = at::vec::fmadd(Vec::loadu(dorow + d), Vec::loadu(o_row.data() + d), acc);
          }
          float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
          for (; d < D; ++d) sum += dorow[d] * o_row.data()[d];
          d_rows.data()[g * Sq + i] = sum;
        }
      }

      const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
      const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
      T* dk = static_cast<T*>(p.dk) + b * p.dk_batch_stride + hk * p.dk_head_stride;
      T* dv = static_cast<T*>(p.dv) + b * p.dv_batch_stride + hk * p.dv_head_stride;

      for (int64_t kt_idx = chunk; kt_idx < n_ktiles; kt_idx += n_chunks) {
        const int64_t j0 = kt_idx * BK, L = std::min(BK, Sk - j0);
        // K_j^T and V_j^T (headdim x L) are the B operands of S and dP; K_j (L x headdim) of dQ.
        auto [kj, ld_k] = float_rows(k + j0 * p.k_row_stride, p.k_row_stride, L, D, k_buf.data(), tile);
        const float* vj = nullptr;
        int64_t ld_v = 0;
        if (blas) {
          std::tie(vj, ld_v) = float_rows(v + j0 * p.v_row_stride, p.v_row_stride, L, D, v_buf.data());
        } else {
          transpose_to_float(k + j0 * p.k_row_stride, p.k_row_stride, L, D, kt.data(), BK);
          transpose_to_float(v + j0 * p.v_row_stride, p.v_row_stride, L, D, vt.data(), BK);
        }
        std::fill_n(dk_acc.data(), L * D, 0.f);
        std::fill_n(dv_acc.data(), L * D, 0.f);

        // Queries [i_first, i_end) see some of these keys: the tiles outside the window are skipped.
        const int64_t i_first = window.right < 0 ? 0 : std::clamp<int64_t>(j0 - window.offset - window.right, 0, Sq);
        const int64_t i_end =
            window.left < 0 ? Sq : std::clamp<int64_t>(j0 + L - 1 - window.offset + window.left + 1, 0, Sq);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hk * G + g;
          const float* lse = p.softmax_lse + b * p.lse_batch_stride + h * p.lse_head_stride;
          const float* drow = d_rows.data() + g * Sq;
          const float slope = var.alibi_slopes ? var.alibi_slopes[b * var.alibi_batch_stride + h] : 0.f;
          for (int64_t q0 = (i_first / BQ) * BQ; q0 < i_end; q0 += BQ) {
            const int64_t M = std::min(BQ, Sq - q0);
            const float* qi = q_rows[g] + q0 * ld_q[g];
            const float* doi = do_rows[g] + q0 * ld_do[g];
            if constexpr (tile) {
              tile_gemm_f32(M, L, D, ld_q[g], BK, BK, false, qi, kt.data(), s.data());
              tile_gemm_f32(M, L, D, ld_do[g], BK, BK, false, doi, vt.data(), dp.data());
            } else if (blas) {
              blas_gemm_f32(false, true, M, L, D, ld_q[g], ld_k, BK, false, qi, kj, s.data());
              blas_gemm_f32(false, true, M, L, D, ld_do[g], ld_v, BK, false, doi, vj, dp.data());
            } else {
              gemm_f32(M, L, D, ld_q[g], BK, BK, false, qi, kt.data(), s.data());
              gemm_f32(M, L, D, ld_do[g], BK, BK, false, doi, vt.data(), dp.data());
            }
            const bool full = window.covers(q0, M, j0, L);
            for (int64_t r = 0; r < M; ++r) {
              const int64_t i = q0 + r;
              // The row sees keys [j0 + lo, j0 + hi) of this tile.
              const int64_t lo = full ? 0 : std::clamp<int64_t>(window.begin(i) - j0, 0, L);
              const int64_t hi = full ? L : std::max(lo, std::clamp<int64_t>(window.end(i) - j0, 0, L));
              // A row that saw no key in the forward has lse = -inf and P = 0.
              const float lse_i = lse[i * p.lse_row_stride];
              float* srow = s.data() + r * BK;
              float* dprow = dp.data() + r * BK;
              if (hi == lo || lse_i == kNegInf) {
                softmax_grad_row(srow, dprow, 0, L, scale, lse_i, drow[i]);
              } else if (logits) {
                softmax_grad_row_logits(srow, dprow, lo, hi, L, scale, var.softcap, slope, i + window.offset - j0,
                                        lse_i, drow[i], grad.data());
              } else {
                softmax_grad_row(srow + lo, dprow + lo, hi - lo, L - lo, scale, lse_i, drow[i]);
                std::fill_n(srow, lo, 0.f), std::fill_n(dprow, lo, 0.f);
              }
            }
            // P^T and dS^T (L x M) are the A operands of dV and dK.
            if constexpr (tile) {
              tile_gemm_f32(L, D, M, BK, ld_do[g], D, true, s.data(), doi, dv_acc.data(), /*trans_a=*/true);
              tile_gemm_f32(L, D, M, BK, ld_q[g], D, true, dp.data(), qi, dk_acc.data(), /*trans_a=*/true);
            } else if (blas) {
              blas_gemm_f32(true, false, L, D, M, BK, ld_do[g], D, true, s.data(), doi, dv_acc.data());
              blas_gemm_f32(true, false, L, D, M, BK, ld_q[g], D, true, dp.data(), qi, dk_acc.data());
            } else {
              transpose(s.data(), BK, M, L, pt.data(), BQ);
              transpose(dp.data(), BK, M, L, dst.data(), BQ);
              gemm_f32(L, D, M, BQ, ld_do[g], D, true, pt.data(), doi, dv_acc.data());
              gemm_f32(L, D, M, BQ, ld_q[g], D, true, dst.data(), qi, dk_acc.data());
            }
            float* dq_rows = dq_part + (g * Sq + q0) * D;
            if constexpr (tile) {
              tile_gemm_f32(M, D, L, BK, ld_k, D, true, dp.data(), kj, dq_rows);
            } else {
              gemm_f32(M, D, L, BK, ld_k, D, true, dp.data(), kj, dq_rows);
            }
          }
        }
        for (int64_t r = 0; r < L; ++r) {
          store_scaled_row(dk_acc.data() + r * D, D, 1.f, dk + (j0 + r) * p.dk_row_stride);
          store_scaled_row(dv_acc.data() + r * D, D, 1.f, dv + (j0 + r) * p.dv_row_stride);
        }
      }
    }
  });

  // dQ = sum of the chunks' partial sums, in the output dtype.
  at::parallel_for(0, B * Hq * Sq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t % Sq, bh = t / Sq, b = bh / Hq, h = bh % Hq, hk = h / G, g = h % G;
      float* row = dq_acc.data() + ((b * Hk + hk) * n_chunks) * group_size + (g * Sq + i) * D;
      for (int64_t c = 1; c < n_chunks; ++c) {
        const float* part = row + c * group_size;
        for (int64_t d = 0; d < D; ++d) row[d] += part[d];
      }
      store_scaled_row(row, D, 1.f, static_cast<T*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride +
                                        i * p.dq_row_stride);
    }
  });
}

}  // namespace detail

// dq, dk, dv are written for every element.
template <typename T>
void attention_backward(const BackwardParams& p) {
  if (p.batch == 0 || p.heads_q == 0) return;
  detail::backward_impl<T>(p);
}

}  // namespace flashop::cpu::FLASHOP_CPU_ISA_NAMESPACE

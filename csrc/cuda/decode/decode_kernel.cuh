// Split-KV decode: a few query rows per sequence (one new token, or a short draft, times the query heads
// that share a KV head) against a long KV cache. The work is reading K and V once, so the kernel is built
// around the loads, not the tensor cores: each CTA takes one (split of the keys, KV head, sequence), all
// the query rows of that KV head's group at once (GQA packing: every K/V byte is read once per group),
// and its 128 threads stream the split's keys with 16-byte loads.
//
//   lanes:   a key's headdim is spread over kWidth / 8 lanes (8 columns, one 16-byte load each), so a
//            warp holds 32 / (kWidth / 8) keys at a time and the CTA kGroups keys (its key slots);
//   scores:  each lane's partial dot products for every row, summed over the key's lanes by shuffles;
//   softmax: every key slot keeps its own running max, sum and output (no barrier in the loop), merged
//            through shared memory at the end;
//   splits:  with num_splits > 1 every CTA writes its normalised partial output and log-sum-exp, and
//            combine_kernel merges the splits of each row (and adds the sink).
// Plain data in (decode_params.h); every index read from a tensor is clamped into the cache.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_params.h"

namespace flashop {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ void widen8(const uint4& raw, float (&f)[8]);

template <>
__device__ __forceinline__ void widen8<__half>(const uint4& raw, float (&f)[8]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <>
__device__ __forceinline__ void widen8<__nv_bfloat16>(const uint4& raw, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <typename T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ int clamp_index(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Element offset of position `pos` of sequence b in a cache (head and columns are the caller's).
__device__ __forceinline__ int64_t cache_offset(const DecodeParams& p, int b, int cache_row, int pos,
                                                int64_t batch_stride, int64_t row_stride) {
  if (p.block_table != nullptr) {
    const int page = clamp_index(p.block_table[b * p.block_table_stride + pos / p.page_size], 0, p.num_blocks - 1);
    return int64_t(page) * batch_stride + int64_t(pos % p.page_size) * row_stride;
  }
  return int64_t(cache_row) * batch_stride + int64_t(pos) * row_stride;
}

// exp(x) for x <= 0, and 0 for x = -inf.
__device__ __forceinline__ float exp_nonpositive(float x) { return exp2f(x * kLog2e); }

// The log-sum-exp and output scale of a row once its sink joins the keys' sum: lse over the keys (-inf
// when it saw none) becomes log(exp(lse) + exp(sink)), and the output, normalised over the keys, is
// multiplied by exp(lse) / (exp(lse) + exp(sink)).
__device__ __forceinline__ float add_sink(float& lse, float sink) {
  const float top = fmaxf(lse, sink);
  const float keys = exp_nonpositive(lse - top), total = keys + exp_nonpositive(sink - top);
  lse = top + logf(total);
  return keys / total;
}

template <typename T, int kWidth, int kRows>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p) {
  constexpr int kLanesPerKey = kWidth / 8;
  constexpr int kKeysPerWarp = 32 / kLanesPerKey;
  constexpr int kGroups = kWarps * kKeysPerWarp;
  __shared__ float s_out[kGroups][kRows][kWidth];
  __shared__ float s_max[kGroups][kRows];
  __shared__ float s_sum[kGroups][kRows];

  const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int slot = lane / kLanesPerKey;
  const int col0 = (lane % kLanesPerKey) * 8;
  const int group = warp * kKeysPerWarp + slot;
  const bool has_cols = col0 < p.headdim;
  // Rows r = g * seqlen_q + i: query head kv_head * head_ratio + g, query i (rows <= kRows: the launcher).
  const int rows = p.head_ratio * p.seqlen_q;

  const int key_end = p.key_end != nullptr ? clamp_index(p.key_end[b], 0, p.capacity) : p.capacity;
  const int key_begin = p.key_begin != nullptr ? clamp_index(p.key_begin[b], 0, key_end) : 0;
  const int n_keys = key_end - key_begin;
  const int per_split = (n_keys + p.num_splits - 1) / p.num_splits;
  const int first = key_begin + min(split * per_split, n_keys);
  const int last = key_begin + min((split + 1) * per_split, n_keys);
  const int cache_row = p.cache_batch_idx != nullptr ? clamp_index(p.cache_batch_idx[b], 0, p.num_blocks - 1) : b;
  // Query i's keys end at relative position i + diag (+ window_right), bottom-right aligned.
  const int diag = n_keys - p.seqlen_q;
  const int left = p.variants.window_left, right = p.variants.window_right;
  const float softcap = p.variants.softcap;

  // The rows' queries in score units (times the softmax scale), 8 columns per lane.
  // diag_of[r]: the last key (relative) row r's query sees without a window, i + diag.
  float q[kRows][8], slope[kRows];
  int diag_of[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < 8; ++c) q[r][c] = 0.f;
    slope[r] = 0.f;
    diag_of[r] = r % p.seqlen_q + diag;
    if (r < rows) {
      const int head = kv_head * p.head_ratio + r / p.seqlen_q, i = r % p.seqlen_q;
      if (has_cols) {
        const T* src = static_cast<const T*>(p.q) + b * p.q_batch_stride + i * p.q_row_stride +
                       head * p.q_head_stride + col0;
        widen8<T>(*reinterpret_cast<const uint4*>(src), q[r]);
#pragma unroll
        for (int c = 0; c < 8; ++c) q[r][c] *= p.scale;
      }
      if (p.variants.alibi_slopes != nullptr) slope[r] = p.variants.alibi_slopes[b * p.variants.alibi_batch_stride + head];
    }
  }

  float row_max[kRows], row_sum[kRows], acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
  }

  const T* k_head = static_cast<const T*>(p.k) + kv_head * p.k_head_stride + col0;
  const T* v_head = static_cast<const T*>(p.v) + kv_head * p.v_head_stride + col0;
  // K and V of the slot's key at `base` (zeros past the split or past headdim).
  auto load = [&](int base, uint4& k_raw, uint4& v_raw) {
    const int key = base + slot;
    k_raw = v_raw = make_uint4(0, 0, 0, 0);
    if (key < last && has_cols) {
      k_raw = *reinterpret_cast<const uint4*>(k_head + cache_offset(p, b, cache_row, key, p.k_batch_stride,
                                                                      p.k_row_stride));
      v_raw = *reinterpret_cast<const uint4*>(v_head + cache_offset(p, b, cache_row, key, p.v_batch_stride,
                                                                      p.v_row_stride));
    }
  };
  // The loop bound is the warp's (a slot past the split joins the shuffles with a masked key). The next
  // step's loads are issued before this step's arithmetic, so two keys per slot are in flight.
  uint4 k_next, v_next;
  load(first + warp * kKeysPerWarp, k_next, v_next);
  for (int base = first + warp * kKeysPerWarp; base < last; base += kGroups) {
    const int key = base + slot;
    const bool valid = key < last;
    const uint4 k_raw = k_next, v_raw = v_next;
    if (base + kGroups < last) load(base + kGroups, k_next, v_next);
    float kf[8], vf[8];
    widen8<T>(k_raw, kf);
    widen8<T>(v_raw, vf);
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      s[r] = 0.f;
#pragma unroll
      for (int c = 0; c < 8; ++c) s[r] = fmaf(q[r][c], kf[c], s[r]);
    }
#pragma unroll
    for (int offset = kLanesPerKey / 2; offset >= 1; offset /= 2) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] += __shfl_xor_sync(0xffffffffu, s[r], offset);
    }
    const int rel = key - key_begin;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      const bool seen = valid && (left < 0 || rel >= diag_of[r] - left) && (right < 0 || rel <= diag_of[r] + right);
      if (!seen) continue;
      float score = s[r];
      if (softcap > 0.f) score = softcap * tanhf(score / softcap);
      score -= slope[r] * fabsf(float(diag_of[r] - rel));
      const float new_max = fmaxf(row_max[r], score);
      const float rescale = exp_nonpositive(row_max[r] - new_max);
      const float prob = exp_nonpositive(score - new_max);
      row_sum[r] = row_sum[r] * rescale + prob;
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(acc[r][c], rescale, prob * vf[c]);
      row_max[r] = new_max;
    }
  }

  // Merge the key slots: each publishes its state, then every thread finishes some (row, column) outputs.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (col0 == 0) {
      s_max[group][r] = row_max[r];
      s_sum[group][r] = row_sum[r];
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) s_out[group][r][col0 + c] = acc[r][c];
  }
  __syncthreads();

  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  for (int idx = threadIdx.x; idx < rows * kWidth; idx += kThreads) {
    const int r = idx / kWidth, c = idx % kWidth;
    if (c >= p.headdim) continue;
    float top = -INFINITY;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) top = fmaxf(top, s_max[g][r]);
    float sum = 0.f, out = 0.f;
    if (top != -INFINITY) {
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        const float w = exp_nonpositive(s_max[g][r] - top);
        sum = fmaf(s_sum[g][r], w, sum);
        out = fmaf(s_out[g][r][c], w, out);
      }
      out /= sum;
    }
    float lse = top == -INFINITY ? -INFINITY : top + logf(sum);
    const int head = kv_head * p.head_ratio + r / p.seqlen_q, i = r % p.seqlen_q;
    const int64_t row = (int64_t(b) * p.heads_q + head) * p.seqlen_q + i;  // in (B, Hq, Sq)
    if (p.num_splits > 1) {
      p.partial_out[(split * rows_total + row) * kWidth + c] = out;
      if (c == 0) p.partial_lse[split * rows_total + row] = lse;
      continue;
    }
    if (p.variants.sinks != nullptr) out *= add_sink(lse, p.variants.sinks[head]);
    static_cast<T*>(p.out)[b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride + c] = narrow<T>(out);
    if (c == 0) p.lse[row] = lse;
  }
}

// Merges the splits of every row: lse = log(sum over splits of exp(lse_s)) (plus the sink), out = sum of
// exp(lse_s - lse) * out_s. One CTA per row of (B, Hq, Sq).
template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads) combine_kernel(const DecodeParams p) {
  const int64_t row = blockIdx.x;
  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int i = int(row % p.seqlen_q), head = int(row / p.seqlen_q % p.heads_q), b = int(row / p.seqlen_q / p.heads_q);
  float top = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) top = fmaxf(top, p.partial_lse[s * rows_total + row]);
  float lse = -INFINITY;
  if (top != -INFINITY) {
    float sum = 0.f;
    for (int s = 0; s < p.num_splits; ++s) sum += exp_nonpositive(p.partial_lse[s * rows_total + row] - top);
    lse = top + logf(sum);
  }
  const float keys_lse = lse;
  const float sink_scale = p.variants.sinks != nullptr ? add_sink(lse, p.variants.sinks[head]) : 1.f;
  for (int c = threadIdx.x; c < p.headdim; c += kThreads) {
    float out = 0.f;
    if (keys_lse != -INFINITY) {
      for (int s = 0; s < p.num_splits; ++s) {
        out = fmaf(exp_nonpositive(p.partial_lse[s * rows_total + row] - keys_lse),
                   p.partial_out[(s * rows_total + row) * kWidth + c], out);
      }
    }
    static_cast<T*>(p.out)[b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride + c] =
        narrow<T>(out * sink_scale);
  }
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace decode
}  // namespace flashop

// Split-KV decode: a few query rows per sequence (one new token, or a short draft, times the query heads
// that share a KV head) against a long KV cache. The work is reading K and V once at the memory's speed, so
// the kernel is built around the loads: each CTA takes one (split of the keys, KV head, sequence) and all
// the query rows of that KV head's group at once (GQA packing: every K/V byte is read once per group).
//
//   loads:   blocks of kBlockKeys keys of K and V stream into shared memory through a kStages-deep
//            cp.async pipeline (16-byte copies, swizzled rows as the mma.sync kernels keep them), each
//            row's address looked up on its own (paged caches: any page size), one block ahead;
//   scores:  each warp takes 16 keys of a block: S = Q K^T with mma.m16n8k16, the group's (at most 8)
//            query rows as M (rows 8-15 are zero registers), keys as N;
//   softmax: every warp keeps its own running max, sum and output per row (no barrier but the
//            pipeline's), merged through shared memory at the end;
//   output:  O^T += V^T P^T, head dimensions as M and the rows as N, so the scores' accumulator is P's
//            operand as it stands and no register holds a padding row;
//   splits:  with num_splits > 1 every CTA writes its normalised partial output and log-sum-exp, and
//            combine_kernel merges the splits of each row (and adds the sink), launched on sm90 as a
//            programmatic dependent so its CTAs are resident when the last split finishes.
// Plain data in (decode_params.h); every index read from a tensor is clamped into the cache. Built from the
// sm80 instruction wrappers, so tests/decode_emulator runs it on the CPU emulator as well.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../sm80/tiles.cuh"
#include "decode_params.h"

namespace flashop {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerGroup = 8;  // the mma's N: query rows per KV head a CTA takes at most
constexpr int kKeysPerWarp = 16;
constexpr int kBlockKeys = kWarps * kKeysPerWarp;
constexpr int kStages = 3;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory of one CTA: kStages blocks of K and V (kBlockKeys x kWidth each), reused after the loop for
// the warps' merge (their rows' max, sum and output).
template <int kWidth>
struct DecodeSmem {
  using Tile = sm80::SmemTile<kBlockKeys, kWidth>;
  static constexpr uint32_t kStageBytes = 2 * Tile::kBytes;  // K, then V
  static constexpr uint32_t kMergeOut = 0;
  static constexpr uint32_t kMergeMax = kMergeOut + sizeof(float) * kWarps * kRowsPerGroup * kWidth;
  static constexpr uint32_t kMergeSum = kMergeMax + sizeof(float) * kWarps * kRowsPerGroup;
  static constexpr uint32_t kMergeBytes = kMergeSum + sizeof(float) * kWarps * kRowsPerGroup;
  static constexpr uint32_t kBytes = std::max(kStages * kStageBytes, kMergeBytes);
};

FLASHOP_SM80_DEV int clamp_index(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

// exp(x) for x <= 0, and 0 for x = -inf.
FLASHOP_SM80_DEV float exp_nonpositive(float x) { return sm80::exp2_approx(x * kLog2e); }

// The log-sum-exp and output scale of a row once its sink joins the keys' sum: lse over the keys (-inf
// when it saw none) becomes log(exp(lse) + exp(sink)), and the output, normalised over the keys, is
// multiplied by exp(lse) / (exp(lse) + exp(sink)).
FLASHOP_SM80_DEV float add_sink(float& lse, float sink) {
  const float top = fmaxf(lse, sink);
  const float keys = exp_nonpositive(lse - top), total = keys + exp_nonpositive(sink - top);
  lse = top + logf(total);
  return keys / total;
}

template <typename T>
FLASHOP_SM80_DEV T narrow(float x);
template <>
FLASHOP_SM80_DEV __half narrow<__half>(float x) { return __float2half_rn(x); }
template <>
FLASHOP_SM80_DEV __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// How the threads share the copies of a block: thread t copies chunk t % (kWidth / 8) of every
// (kThreads / (kWidth / 8))-th row from row t / (kWidth / 8), so consecutive lanes read consecutive 16-byte
// pieces of a row.
template <int kWidth>
struct BlockCopies {
  static constexpr int kChunksPerRow = kWidth / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = kBlockKeys / kRowsPerPass;
  static_assert(kThreads % kChunksPerRow == 0 && kBlockKeys % kRowsPerPass == 0, "the threads must share the copies evenly");
};

// The pages (paged caches) of the rows of one block a thread copies; keys at or past key_end read the
// sequence's first key instead, which exists, and are zero-filled.
template <int kWidth>
struct BlockPages {
  int page[BlockCopies<kWidth>::kPasses];
};

FLASHOP_SM80_DEV int source_key(int key, int key_first, int key_end) { return key < key_end ? key : key_first; }

// Looks up the pages of the block starting at key0: global loads whose values are used only when the block
// is issued, two blocks of work later, so the block table's latency stays hidden.
template <int kWidth>
FLASHOP_SM80_DEV void find_pages(const DecodeParams& p, int b, int key0, int key_first, int key_end, int tid,
                                 BlockPages<kWidth>& pages) {
  using Copies = BlockCopies<kWidth>;
  const int row0 = tid / Copies::kChunksPerRow;
#pragma unroll
  for (int pass = 0; pass < Copies::kPasses; ++pass) {
    const int pos = source_key(key0 + row0 + pass * Copies::kRowsPerPass, key_first, key_end);
    pages.page[pass] = clamp_index(p.block_table[b * p.block_table_stride + pos / p.page_size], 0, p.num_blocks - 1);
  }
}

// Issues the copies of one block's keys (starting at key0; paged: their pages from find_pages) of K and V
// into a stage. Keys at or past key_end and columns at or past headdim are zero-filled (zeros add nothing
// to a score, and a zero V row times a zero probability stays zero); their source is an existing key and
// column.
template <typename T, int kWidth>
FLASHOP_SM80_DEV void load_block(const DecodeParams& p, uint32_t stage, const T* k_head, const T* v_head,
                                 int cache_row, int key0, int key_first, int key_end, const BlockPages<kWidth>& pages,
                                 int tid) {
  using Tile = typename DecodeSmem<kWidth>::Tile;
  using Copies = BlockCopies<kWidth>;
  const int chunk = tid % Copies::kChunksPerRow, row0 = tid / Copies::kChunksPerRow;
  const bool col_valid = chunk * 8 < p.headdim;
  const bool paged = p.block_table != nullptr;
#pragma unroll
  for (int pass = 0; pass < Copies::kPasses; ++pass) {
    const int row = row0 + pass * Copies::kRowsPerPass;
    const bool valid = key0 + row < key_end && col_valid;
    const int pos = source_key(key0 + row, key_first, key_end);
    const int64_t block = paged ? pages.page[pass] : cache_row;
    const int64_t at = paged ? pos % p.page_size : pos;
    const int col = valid ? chunk * 8 : 0;
    const uint32_t dst = stage + Tile::offset(row, chunk);
    sm80::cp_async_16(dst, k_head + block * p.k_batch_stride + at * p.k_row_stride + col, valid);
    sm80::cp_async_16(dst + Tile::kBytes, v_head + block * p.v_batch_stride + at * p.v_row_stride + col, valid);
  }
}

template <typename T, int kWidth>
FLASHOP_SM80_GLOBAL void FLASHOP_SM80_LAUNCH_BOUNDS(kThreads, 1) decode_kernel(const DecodeParams p) {
  using Smem = DecodeSmem<kWidth>;
  using Tile = typename Smem::Tile;
  constexpr int kSteps = kWidth / 16;  // mma k-steps of Q K^T, and m-tiles of O^T
  FLASHOP_SM80_DYNAMIC_SMEM(smem);
  const uint32_t smem_base = sm80::smem_u32(smem);

  const int split = sm80::block_x(), kv_head = sm80::block_y(), b = sm80::block_z();
  const int tid = sm80::thread_x(), lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;  // the mma fragments' row group and thread in group
  // Rows r = h * seqlen_q + i: query head kv_head * head_ratio + h, query i (rows <= 8: the launcher).
  const int rows = p.head_ratio * p.seqlen_q;

  // The dependent combine grid may be scheduled now; it waits for this grid's results itself.
  sm80::launch_dependents();
  const int key_end = p.key_end != nullptr ? clamp_index(p.key_end[b] + p.key_end_offset, 0, p.capacity) : p.capacity;
  const int key_begin = p.key_begin != nullptr ? clamp_index(p.key_begin[b], 0, key_end) : 0;
  const int n_keys = key_end - key_begin;
  // Splits own whole blocks of keys.
  const int n_blocks = (n_keys + kBlockKeys - 1) / kBlockKeys;
  const int per_split = (n_blocks + p.num_splits - 1) / p.num_splits;
  const int block_first = std::min(split * per_split, n_blocks);
  const int my_blocks = std::min(block_first + per_split, n_blocks) - block_first;
  const int cache_row = p.cache_batch_idx != nullptr ? clamp_index(p.cache_batch_idx[b], 0, p.num_blocks - 1) : b;
  // Query i's keys end at relative position i + diag (+ window_right), bottom-right aligned.
  const int diag = n_keys - p.seqlen_q;
  const int left = p.variants.window_left, right = p.variants.window_right;
  const float softcap = p.variants.softcap;

  const T* k_head = static_cast<const T*>(p.k) + kv_head * p.k_head_stride;
  const T* v_head = static_cast<const T*>(p.v) + kv_head * p.v_head_stride;
  auto first_key = [&](int block) { return key_begin + (block_first + block) * kBlockKeys; };
  // Paged: the pages of the next two blocks to issue, looked up two issues ahead (the first two together).
  BlockPages<kWidth> pages_next, pages_after;
  auto find = [&](int block, BlockPages<kWidth>& pages) {
    if (p.block_table != nullptr && block < my_blocks) {
      find_pages<kWidth>(p, b, first_key(block), key_begin, key_end, tid, pages);
    }
  };
  find(0, pages_next);
  find(1, pages_after);
  auto issue = [&](int block) {
    if (block < my_blocks) {
      load_block<T, kWidth>(p, smem_base + uint32_t(block % kStages) * Smem::kStageBytes, k_head, v_head, cache_row,
                            first_key(block), key_begin, key_end, pages_next, tid);
      pages_next = pages_after;
      find(block + 2, pages_after);
    }
    sm80::cp_async_commit();  // one group per block, empty past the end: the waits count blocks
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s);

  // Q as the A operand of S = Q K^T: row g's columns 2t, 2t+1 (+8) of every k-step; rows 8-15 are zero.
  uint32_t qa[kSteps][2];
  const bool row_used = g < rows;
  const int head_of_row = kv_head * p.head_ratio + g / p.seqlen_q, query_of_row = g % p.seqlen_q;
  const T* q_row = static_cast<const T*>(p.q) + b * p.q_batch_stride + query_of_row * p.q_row_stride +
                   head_of_row * p.q_head_stride;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = ks * 16 + half * 8 + 2 * t;
      uint32_t pair = 0;
      if (row_used && col < p.headdim) pair = *reinterpret_cast<const uint32_t*>(q_row + col);
      qa[ks][half] = pair;
    }
  }
  const float slope = row_used && p.variants.alibi_slopes != nullptr
                          ? p.variants.alibi_slopes[b * p.variants.alibi_batch_stride + head_of_row]
                          : 0.f;
  const int row_diag = query_of_row + diag;  // the last key (relative) row g sees without a window

  // Row g's running max and this thread's share of its sum; O^T for dims 16 mt + g (+8), rows 2t, 2t+1.
  float row_max = -INFINITY, row_sum = 0.f;
  float acc[kSteps][4];
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  // Lane addresses: K as S's B operand (plain ldmatrix), V as O^T's A operand (the same 16 keys x 16
  // dims blocks, transposed): both read this warp's 16 keys of the stage.
  const sm80::LdsmAddr<Tile> k_frag = sm80::b_frag_addr<Tile>(smem_base, lane);
  const sm80::LdsmAddr<Tile> v_frag = k_frag.shifted(Tile::kBytes);

  for (int block = 0; block < my_blocks; ++block) {
    sm80::cp_async_wait<kStages - 2>();
    sm80::barrier();  // the block has landed for everyone, and everyone is done with the stage refilled next
    issue(block + kStages - 1);
    const uint32_t stage = uint32_t(block % kStages) * Smem::kStageBytes;

    float s[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks) {
      uint32_t kb[4];
      sm80::ldmatrix_x4(kb, k_frag.shifted(stage).at(warp * kKeysPerWarp, ks));
      const uint32_t a[4] = {qa[ks][0], 0u, qa[ks][1], 0u};
      sm80::mma_16816<T>(s[0], a, kb[0], kb[1]);
      sm80::mma_16816<T>(s[1], a, kb[2], kb[3]);
    }

    // Scores of row g at keys 8 nt + 2t + e of this warp's 16, in natural-log units; masked ones -inf.
    const int rel0 = (block_first + block) * kBlockKeys + warp * kKeysPerWarp + 2 * t;
    float block_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int rel = rel0 + 8 * nt + e;
        const bool seen = rel < n_keys && (left < 0 || rel >= row_diag - left) && (right < 0 || rel <= row_diag + right);
        float score = s[nt][e] * p.scale;
        if (softcap > 0.f) score = softcap * tanhf(score / softcap);
        score -= slope * fabsf(float(row_diag - rel));
        s[nt][e] = seen ? score : -INFINITY;
        block_max = fmaxf(block_max, s[nt][e]);
      }
    }
    block_max = fmaxf(block_max, sm80::shfl_xor(block_max, 1));
    block_max = fmaxf(block_max, sm80::shfl_xor(block_max, 2));
    const float new_max = fmaxf(row_max, block_max);
    const float base = new_max == -INFINITY ? 0.f : new_max;  // a row with no key yet keeps p = 0
    const float rescale = exp_nonpositive(row_max - base);
    row_max = new_max;
    float probs[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) probs[nt][e] = exp_nonpositive(s[nt][e] - base);
    }
    row_sum = row_sum * rescale + (probs[0][0] + probs[0][1]) + (probs[1][0] + probs[1][1]);

    // O^T's columns are rows 2t and 2t + 1, whose rescales live in row groups 2t and 2t + 1.
    const float rescale_lo = sm80::shfl_idx(rescale, 8 * t), rescale_hi = sm80::shfl_idx(rescale, 8 * t + 4);
    const uint32_t pb0 = sm80::pack2<T>(probs[0][0], probs[0][1]), pb1 = sm80::pack2<T>(probs[1][0], probs[1][1]);
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt) {
      acc[mt][0] *= rescale_lo;
      acc[mt][1] *= rescale_hi;
      acc[mt][2] *= rescale_lo;
      acc[mt][3] *= rescale_hi;
      uint32_t va[4];
      sm80::ldmatrix_x4_trans(va, v_frag.shifted(stage).at(warp * kKeysPerWarp, mt));
      // A = V^T (dims 16 mt .. +15 x the warp's 16 keys): the matrices come as (keys 0-7, dims 0-7),
      // (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, dims 8-15); mma order is a0 = dims 0-7 /
      // keys 0-7, a1 = dims 8-15 / keys 0-7, a2 = dims 0-7 / keys 8-15, a3 = dims 8-15 / keys 8-15.
      const uint32_t a[4] = {va[0], va[1], va[2], va[3]};
      sm80::mma_16816<T>(acc[mt], a, pb0, pb1);
    }
  }

  // Merge the warps: each publishes its rows' state, then every thread finishes some (row, column) outputs.
  row_sum += sm80::shfl_xor(row_sum, 1);
  row_sum += sm80::shfl_xor(row_sum, 2);
  sm80::cp_async_wait<0>();
  sm80::barrier();  // the stages are free for the merge
  float* merge_out = reinterpret_cast<float*>(smem + Smem::kMergeOut);  // [warp][row][kWidth]
  float* merge_max = reinterpret_cast<float*>(smem + Smem::kMergeMax);  // [warp][row]
  float* merge_sum = reinterpret_cast<float*>(smem + Smem::kMergeSum);
  if (t == 0) {
    merge_max[warp * kRowsPerGroup + g] = row_max;
    merge_sum[warp * kRowsPerGroup + g] = row_sum;
  }
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) {
    float* lo = merge_out + (warp * kRowsPerGroup + 2 * t) * kWidth + 16 * mt + g;
    float* hi = lo + kWidth;  // row 2t + 1
    lo[0] = acc[mt][0];
    hi[0] = acc[mt][1];
    lo[8] = acc[mt][2];
    hi[8] = acc[mt][3];
  }
  sm80::barrier();

  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  for (int idx = tid; idx < rows * kWidth; idx += kThreads) {
    const int r = idx / kWidth, c = idx % kWidth;
    if (c >= p.headdim) continue;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, merge_max[w * kRowsPerGroup + r]);
    float sum = 0.f, out = 0.f;
    if (top != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp_nonpositive(merge_max[w * kRowsPerGroup + r] - top);
        sum = fmaf(merge_sum[w * kRowsPerGroup + r], weight, sum);
        out = fmaf(merge_out[(w * kRowsPerGroup + r) * kWidth + c], weight, out);
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
// exp(lse_s - lse) * out_s. One CTA per row of (B, Hq, Sq): thread s weighs split s (num_splits <=
// kThreads), then every thread sums its columns over the splits. Launched as a dependent of the decode grid
// (sm90: it starts while that grid finishes, and waits for its results here).
constexpr int kCombineSmemBytes = sizeof(float) * (kThreads + 2 * kWarps);

template <typename T, int kWidth>
FLASHOP_SM80_GLOBAL void FLASHOP_SM80_LAUNCH_BOUNDS(kThreads, 1) combine_kernel(const DecodeParams p) {
  FLASHOP_SM80_DYNAMIC_SMEM(smem);
  float* weight = reinterpret_cast<float*>(smem);  // [kThreads]: exp(lse_s - lse) of split s
  float* warp_max = weight + kThreads;             // [kWarps]
  float* warp_sum = warp_max + kWarps;             // [kWarps]
  const int64_t row = sm80::block_x();
  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  const int i = int(row % p.seqlen_q), head = int(row / p.seqlen_q % p.heads_q), b = int(row / p.seqlen_q / p.heads_q);
  const int tid = sm80::thread_x(), lane = tid % 32, warp = tid / 32;
  sm80::wait_for_prerequisite_grids();

  const float split_lse = tid < p.num_splits ? p.partial_lse[tid * rows_total + row] : -INFINITY;
  float top = split_lse;
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) top = fmaxf(top, sm80::shfl_xor(top, mask));
  if (lane == 0) warp_max[warp] = top;
  sm80::barrier();
  top = warp_max[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) top = fmaxf(top, warp_max[w]);
  float e = top == -INFINITY ? 0.f : exp_nonpositive(split_lse - top);
  float sum = e;
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) sum += sm80::shfl_xor(sum, mask);
  if (lane == 0) warp_sum[warp] = sum;
  sm80::barrier();
  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += warp_sum[w];
  weight[tid] = top == -INFINITY ? 0.f : e / sum;
  float lse = top == -INFINITY ? -INFINITY : top + logf(sum);
  const float sink_scale = p.variants.sinks != nullptr ? add_sink(lse, p.variants.sinks[head]) : 1.f;
  sm80::barrier();

  for (int c = tid; c < p.headdim; c += kThreads) {
    const float* column = p.partial_out + row * kWidth + c;
    const int64_t split_stride = rows_total * kWidth;
    // Four independent sums, so four loads are in flight at once.
    float part[4] = {0.f, 0.f, 0.f, 0.f};
    int s = 0;
    for (; s + 4 <= p.num_splits; s += 4) {
#pragma unroll
      for (int u = 0; u < 4; ++u) part[u] = fmaf(weight[s + u], column[(s + u) * split_stride], part[u]);
    }
    for (; s < p.num_splits; ++s) part[0] = fmaf(weight[s], column[s * split_stride], part[0]);
    const float out = (part[0] + part[1]) + (part[2] + part[3]);
    static_cast<T*>(p.out)[b * p.o_batch_stride + i * p.o_row_stride + head * p.o_head_stride + c] =
        narrow<T>(out * sink_scale);
  }
  if (tid == 0) p.lse[row] = lse;
}

}  // namespace decode
}  // namespace flashop

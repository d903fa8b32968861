// Arguments of the decode kernels (decode_kernel.cuh): plain data, no torch. A few query rows per
// sequence (decoding: one new token, or a short draft) attend to a KV cache, contiguous or paged, whose
// keys are split over CTAs; decode_cuda.cpp fills it from validated tensors.
#pragma once

#include <cstdint>

#include "../../attention_variants.h"

namespace flashop {

struct DecodeParams {
  // q (B, Sq, Hq, D) and out (B, Sq, Hq, D): fp16 or bf16, last dimension contiguous, base pointers and
  // every stride 16-byte aligned (8 elements).
  const void* q;
  void* out;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // softmax_lse (B, Hq, Sq) float32, contiguous.
  float* lse;

  // The caches, with the same 16-byte alignment. Contiguous: (B_cache, capacity, Hk, D), sequence b's
  // position p at row cache_batch_idx[b] (b when null), p. Paged (block_table non-null): (num_blocks,
  // page_size, Hk, D) pages, position p of sequence b in page block_table[b * block_table_stride +
  // p / page_size] at row p % page_size.
  const void* k;
  const void* v;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  const int32_t* cache_batch_idx;
  const int32_t* block_table;
  int64_t block_table_stride;
  int page_size;
  int num_blocks;  // pages in the cache (paged) or rows (contiguous): indices are clamped to it
  int capacity;    // positions one sequence's cache holds

  // Sequence b attends to its positions [key_begin[b], key_end[b] + key_end_offset) (cache_leftpad,
  // cache_seqlens + seqlen_new; null: 0 and capacity), clamped to [0, capacity]; causal and windows align
  // bottom-right there.
  const int32_t* key_begin;
  const int32_t* key_end;
  int key_end_offset;

  int batch, seqlen_q, heads_q, heads_k, head_ratio, headdim;
  float scale;  // softmax_scale
  // Windows (causal is the (-1, 0) window), softcap, ALiBi and sinks (csrc/attention_variants.h).
  AttentionVariants variants;

  // Split-KV: each sequence's keys are cut into num_splits ranges, one CTA each; with more than one, every
  // CTA writes its rows' normalised partial output and log-sum-exp to partial_out (num_splits, B, Hq, Sq,
  // kWidth) and partial_lse (num_splits, B, Hq, Sq), and the combine kernel merges them.
  int num_splits;
  float* partial_out;
  float* partial_lse;
};

}  // namespace flashop

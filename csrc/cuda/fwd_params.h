// Arguments of the forward kernels: plain data, no torch, no CUDA headers.
// The glue (forward_cuda.cpp) fills it from validated tensors; every kernel
// config reads the same struct.
#pragma once

#include <cstdint>

#include "../attention_variants.h"
#include "../packed_sequences.h"

namespace flashop {

struct FwdParams {
  // q (B, Sq, Hq, D), k and v (B, Sk, Hk, D), out (B, Sq, Hq, D): fp16 or bf16,
  // last dimension contiguous. Base pointers are 16-byte aligned and every
  // stride below is a multiple of 8 elements (16 bytes), so each 8-element
  // chunk of a row can move with one 16-byte cp.async / store.
  const void* q;
  const void* k;
  const void* v;
  void* out;
  // softmax_lse (B, Hq, Sq) float32, natural log; row (query) stride is 1.
  float* lse;

  // Strides in elements. Row (sequence) strides must be below 2^24: the
  // kernels form a thread's offset within a tile in 32 bits.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  int batch;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_k;
  int head_ratio;  // heads_q / heads_k: kv_head = q_head / head_ratio (GQA/MQA)
  // ceil(2^32 / head_ratio) when head_ratio >= 2 (fwd_head_ratio_magic): the
  // kernel divides with one multiply-high, exact for heads below 2^16, and
  // keeps kv_head in uniform registers (a real division would not).
  uint32_t head_ratio_magic;
  int headdim;     // a multiple of 8, at most the kernel's tile width (Cfg::kHeadDim)

  float scale;       // softmax_scale (> 0; the glue folds a negative scale into q)
  float scale_log2;  // softmax_scale * log2(e): exp(x*scale) = exp2(x*scale_log2)
  bool causal;       // bottom-right aligned: query i sees key j iff j <= i + Sk - Sq
  // Windows, softcap, ALiBi, sinks (csrc/attention_variants.h); causal above is variants' (-1, 0) window.
  AttentionVariants variants;
  // Packed batches (csrc/packed_sequences.h); packed.packed() false for a dense batch.
  PackedSequences packed;

  // Set by the sm_90a launchers, unused elsewhere. Split tail: with stream_k, the
  // query tiles from stream_k_tile0 on are shared out over the CTAs in equal runs of key tiles, and a
  // tile cut in two is finished by the CTA that holds its last keys, from the other part's partial O,
  // max and sum in `workspace` (layout: fwd_kernel.cuh). "pers.dyn": `workspace` holds the counter of
  // tiles taken.
  bool stream_k;
  int stream_k_tile0;
  void* workspace;
  // Split last wave of the sm_90a one-tile-per-CTA kernels (with stream_k): the tiles from
  // stream_k_tile0 on (split_tiles of them) run as split_pieces pieces of their key range each, one CTA
  // per piece; the last to finish a row block merges the others' partial results from `workspace`.
  int split_pieces;
  int split_tiles;
};

inline uint32_t fwd_head_ratio_magic(int head_ratio) {
  return head_ratio >= 2 ? uint32_t(((uint64_t(1) << 32) + uint64_t(head_ratio) - 1) /
                                    uint64_t(head_ratio))
                         : 0u;
}

}  // namespace flashop

// The problem the CPU kernels solve, as plain data: pointers, element strides and sizes. The same
// layout in every instruction set's copy of the kernels (csrc/cpu/isa.h), so it lives outside them.
#pragma once

#include "../attention_variants.h"

#include <cstdint>

namespace flashop::cpu {

// Problem description shared by forward and backward. Strides are in elements;
// the last (headdim) dimension of every tensor is contiguous.
struct AttentionParams {
  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_k = 0, headdim = 0;
  float softmax_scale = 1.f;
  bool causal = false;  // variants' (-1, 0) window
  AttentionVariants variants;

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;

  // Forward outputs / backward inputs. softmax_lse is (batch, heads_q, seqlen_q), fp32.
  void* out = nullptr;
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  float* softmax_lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 0;
};

struct BackwardParams : AttentionParams {
  const void* dout = nullptr;
  int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
};

}  // namespace flashop::cpu

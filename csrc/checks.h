// Argument rules shared by every backend. The fake kernels in flashop/meta.py
// enforce the same rules with the same messages, so tracing fails like eager.
#pragma once

#include <ATen/core/Tensor.h>

#include "attention_variants.h"
#include <c10/util/Optional.h>

#include <optional>

namespace flashop {

// Problem sizes read off validated (B, S, H, D) inputs.
struct AttentionDims {
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t heads_q;
  int64_t heads_k;
  int64_t headdim;
};

constexpr int64_t kMaxHeadDim = 256;

// q (B, Sq, Hq, D), k and v (B, Sk, Hk, D): same dtype (float32/float16/bfloat16),
// same device, Hq % Hk == 0, 1 <= D <= 256, last dimension contiguous.
AttentionDims check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// dout and out shaped like q, softmax_lse (B, Hq, Sq) float32 (packed batches: (Hq, total_q), dims from
// check_varlen_inputs), all on q's device.
void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                           const at::Tensor& softmax_lse, const AttentionDims& dims, bool packed = false);

// The variant arguments (window_size_left/right, softcap, alibi_slopes, learnable_sink; sinks absent in
// the backward), checked and normalised: causal sets window_right = 0, a window bound that excludes no
// key becomes -1, and `causal` on return is true exactly for the (-1, 0) window. Pointers are those of
// the given tensors (float32 and contiguous: checked).
AttentionVariants check_variants(const AttentionDims& dims, const at::Tensor& q, bool& causal, int64_t window_left,
                                 int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks);

// Variable-length (packed) batches: q (total_q, Hq, D), k and v (total_k, Hk, D), sequence b being rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (and of k/v likewise); cu_seqlens_* int32 (batch + 1,),
// seqused_* int32 (batch,) (only the first seqused[b] tokens of sequence b take part). The tensor rules
// (dtype, device, rank, sizes) hold at trace time too. Returns dims with batch = number of sequences and
// seqlen_q / seqlen_k = the total tokens.
struct VarlenArgs {
  const at::Tensor& cu_seqlens_q;
  const at::Tensor& cu_seqlens_k;
  const std::optional<at::Tensor>& seqused_q;
  const std::optional<at::Tensor>& seqused_k;
};
AttentionDims check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const VarlenArgs& args);
// The values, on the host (eager only): cu_seqlens start at 0, do not decrease and end at the total
// tokens; max_seqlen (if given) is at least every sequence's length; seqused at most its sequence's length.
void check_varlen_values(const at::Tensor& cu_seqlens, const char* name, int64_t total_tokens,
                         std::optional<int64_t> max_seqlen, const char* max_name,
                         const std::optional<at::Tensor>& seqused, const char* seqused_name);

// A preallocated output (flashop::forward.with_out): q's shape, dtype and device (flashop/meta.py
// check_kvcache_out says the same). Compares symbolic sizes, so a traced call keeps its dynamic shapes.
void check_out(const at::Tensor& out, const at::Tensor& q);

// softmax_scale defaults to 1/sqrt(D); an explicit value must be finite.
double resolve_softmax_scale(std::optional<double> softmax_scale, int64_t headdim);

}  // namespace flashop

// Host glue shared by the two forward entry points, the mma.sync one (forward_cuda.cpp) and the
// Hopper one (sm90/bindings_sm90.cpp): the outputs of empty problems, the positive-scale fold,
// and FwdParams from tensors the kernel can read. Knows tensors, not tiles.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "../checks.h"
#include "fwd_params.h"

namespace flashop {

// Allocates out (B, Sq, Hq, D) and lse (B, Hq, Sq). Returns true when the problem is empty and
// they are already final: no query rows, or no keys (every row sees nothing: 0 and -inf).
inline bool allocate_forward_outputs(const at::Tensor& q, const AttentionDims& dims, at::Tensor& out,
                                     at::Tensor& lse) {
  out = at::empty({dims.batch, dims.seqlen_q, dims.heads_q, dims.headdim}, q.options());
  lse = at::empty({dims.batch, dims.heads_q, dims.seqlen_q}, q.options().dtype(at::kFloat));
  if (dims.batch == 0 || dims.heads_q == 0 || dims.seqlen_q == 0) return true;
  if (dims.seqlen_k == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return true;
  }
  return false;
}

// The kernels keep a running max of raw scores, so they assume a positive scale. A negative
// scale is folded into q ((-q) k^T |s| == q k^T s); a zero scale (uniform attention) becomes the
// smallest normal float, which gives the same probabilities to float precision and keeps
// -inf masks from turning into 0 * -inf = NaN. Returns the q to use; updates `scale`.
inline at::Tensor fold_scale_into_q(const at::Tensor& q, double& scale) {
  at::Tensor folded = q;
  if (scale < 0) {
    folded = q.neg();
    scale = -scale;
  }
  if (scale < static_cast<double>(std::numeric_limits<float>::min())) {
    scale = static_cast<double>(std::numeric_limits<float>::min());
  }
  return folded;
}

// A stride the kernel may use: size-1 dimensions get 0 (their stride is arbitrary).
inline int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }

inline FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                 at::Tensor& lse, const AttentionDims& dims, double scale, bool causal) {
  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_batch_stride = stride_or_zero(q, 0);
  p.q_row_stride = stride_or_zero(q, 1);
  p.q_head_stride = stride_or_zero(q, 2);
  p.k_batch_stride = stride_or_zero(k, 0);
  p.k_row_stride = stride_or_zero(k, 1);
  p.k_head_stride = stride_or_zero(k, 2);
  p.v_batch_stride = stride_or_zero(v, 0);
  p.v_row_stride = stride_or_zero(v, 1);
  p.v_head_stride = stride_or_zero(v, 2);
  p.o_batch_stride = out.stride(0);
  p.o_row_stride = out.stride(1);
  p.o_head_stride = out.stride(2);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.batch = static_cast<int>(dims.batch);
  p.seqlen_q = static_cast<int>(dims.seqlen_q);
  p.seqlen_k = static_cast<int>(dims.seqlen_k);
  p.heads_q = static_cast<int>(dims.heads_q);
  p.heads_k = static_cast<int>(dims.heads_k);
  p.head_ratio = static_cast<int>(dims.heads_q / dims.heads_k);
  p.head_ratio_magic = fwd_head_ratio_magic(p.head_ratio);
  p.headdim = static_cast<int>(dims.headdim);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
  p.causal = causal;
  return p;
}

}  // namespace flashop

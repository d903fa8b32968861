// CPU kernels of flashop::forward and flashop::backward: argument checks, output
// allocation, and the dtype switch into the tile kernels of attention_kernels.h.
#include "../checks.h"
#include "attention_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace flashop {
namespace {

// The CPU backend has a single kernel; a CUDA config string is an error, not a hint.
void check_cpu_config(const std::optional<c10::string_view>& config, const char* op) {
  if (config.has_value() && *config != "cpu") {
    TORCH_CHECK(false, op, ": config '", std::string(config->data(), config->size()),
                "' is not a CPU kernel config; the CPU backend has one kernel, config=None or 'cpu'");
  }
}

void set_common(cpu::AttentionParams& p, const AttentionDims& dims, const at::Tensor& q, const at::Tensor& k,
                const at::Tensor& v, double scale, bool causal, const AttentionVariants& variants) {
  p.batch = dims.batch, p.seqlen_q = dims.seqlen_q, p.seqlen_k = dims.seqlen_k;
  p.heads_q = dims.heads_q, p.heads_k = dims.heads_k, p.headdim = dims.headdim;
  p.softmax_scale = static_cast<float>(scale);
  p.causal = causal;
  p.variants = variants;
  p.q = q.const_data_ptr(), p.k = k.const_data_ptr(), p.v = v.const_data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_row_stride = k.stride(1), p.k_head_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_row_stride = v.stride(1), p.v_head_stride = v.stride(2);
}

template <typename F>
void dispatch_dtype(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(c10::Half{});
    case at::kBFloat16: return f(c10::BFloat16{});
    default: TORCH_CHECK(false, "flashop: unsupported dtype ", dtype);  // check_forward_inputs rules this out
  }
}

// `deterministic` needs nothing here: every output element is reduced by one
// thread in a fixed order (run to run, for a given number of threads).
std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               std::optional<double> softmax_scale, bool causal,
                                               std::optional<c10::string_view> config, bool /*deterministic*/,
                                               int64_t window_size_left, int64_t window_size_right, double softcap,
                                               const std::optional<at::Tensor>& alibi_slopes,
                                               const std::optional<at::Tensor>& learnable_sink) {
  const AttentionDims dims = check_forward_inputs(q, k, v);
  const AttentionVariants variants = check_variants(dims, q, causal, window_size_left, window_size_right, softcap,
                                                    alibi_slopes, learnable_sink);
  check_cpu_config(config, "flashop.forward");
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({dims.batch, dims.heads_q, dims.seqlen_q}, q.options().dtype(at::kFloat));

  cpu::AttentionParams p;
  set_common(p, dims, q, k, v, scale, causal, variants);
  p.out = out.data_ptr();
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.softmax_lse = lse.data_ptr<float>();
  p.lse_batch_stride = lse.stride(0), p.lse_head_stride = lse.stride(1), p.lse_row_stride = lse.stride(2);
  dispatch_dtype(q.scalar_type(), [&](auto tag) { cpu::attention_forward<decltype(tag)>(p); });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(const at::Tensor& dout, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& softmax_lse,
                                                            std::optional<double> softmax_scale, bool causal,
                                                            std::optional<c10::string_view> config, bool /*deterministic*/,
                                                            int64_t window_size_left, int64_t window_size_right,
                                                            double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const AttentionDims dims = check_forward_inputs(q, k, v);
  check_backward_inputs(dout, q, out, softmax_lse, dims);
  const AttentionVariants variants = check_variants(dims, q, causal, window_size_left, window_size_right, softcap,
                                                    alibi_slopes, std::nullopt);
  check_cpu_config(config, "flashop.backward");
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());

  cpu::BackwardParams p;
  set_common(p, dims, q, k, v, scale, causal, variants);
  p.out = const_cast<void*>(out.const_data_ptr());
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.softmax_lse = const_cast<float*>(softmax_lse.const_data_ptr<float>());  // read only
  p.lse_batch_stride = softmax_lse.stride(0), p.lse_head_stride = softmax_lse.stride(1);
  p.lse_row_stride = softmax_lse.stride(2);
  p.dout = dout.const_data_ptr();
  p.dout_batch_stride = dout.stride(0), p.dout_row_stride = dout.stride(1), p.dout_head_stride = dout.stride(2);
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);
  dispatch_dtype(q.scalar_type(), [&](auto tag) { cpu::attention_backward<decltype(tag)>(p); });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flashop

TORCH_LIBRARY_IMPL(flashop, CPU, m) {
  m.impl("forward", &flashop::forward_cpu);
  m.impl("backward", &flashop::backward_cpu);
}

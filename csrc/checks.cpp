#include "checks.h"

#include <c10/util/Exception.h>

#include <c10/core/ScalarType.h>

#include <cmath>
#include <string>
#include <vector>

namespace flashop {
namespace {

// "torch.float32", as Python prints it, so eager and traced errors read the same.
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// Messages are mirrored word for word by flashop/meta.py (the fake kernels).
void check_rank4(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, "flashop: ", name,
              " must be a 4-D tensor (batch, seqlen, nheads, headdim), got a ", t.dim(), "-D tensor");
}

void check_same_dtype_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flashop: ", name, " must have the dtype of q (",
              dtype_name(q.scalar_type()), "), got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == q.device(), "flashop: ", name, " must be on the device of q (", q.device(),
              "), got ", t.device());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "flashop: ", name,
              " must be contiguous in its last dimension (stride 1), got stride ", t.stride(-1));
}

}  // namespace

AttentionDims check_forward_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_rank4(q, "q");
  check_rank4(k, "k");
  check_rank4(v, "v");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got ", dtype_name(dtype));
  check_same_dtype_device(k, "k", q);
  check_same_dtype_device(v, "v", q);
  TORCH_CHECK(k.sizes() == v.sizes(), "flashop: k and v must have the same shape (batch, seqlen_k, nheads_k, headdim), got k ",
              k.sizes(), " and v ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0), "flashop: k must have the batch size of q (", q.size(0), "), got ", k.size(0));
  TORCH_CHECK(k.size(3) == q.size(3), "flashop: k must have the headdim of q (", q.size(3), "), got ", k.size(3));
  const int64_t headdim = q.size(3);
  TORCH_CHECK(headdim >= 1 && headdim <= kMaxHeadDim, "flashop: headdim must be between 1 and ", kMaxHeadDim,
              ", got ", headdim);
  const int64_t heads_q = q.size(2), heads_k = k.size(2);
  TORCH_CHECK(heads_k >= 1 && heads_q % heads_k == 0,
              "flashop: the number of query heads (", heads_q, ") must be a multiple of the number of key/value heads (",
              heads_k, ")");
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  return {q.size(0), q.size(1), k.size(1), heads_q, heads_k, headdim};
}

void check_backward_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                           const at::Tensor& softmax_lse, const AttentionDims& dims, bool packed) {
  TORCH_CHECK(dout.sizes() == q.sizes(), "flashop: dout must have the shape of q ", q.sizes(), ", got ", dout.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), "flashop: out must have the shape of q ", q.sizes(), ", got ", out.sizes());
  check_same_dtype_device(dout, "dout", q);
  check_same_dtype_device(out, "out", q);
  check_last_dim_contiguous(dout, "dout");
  check_last_dim_contiguous(out, "out");
  const std::vector<int64_t> lse_shape = packed ? std::vector<int64_t>{dims.heads_q, dims.seqlen_q}
                                                 : std::vector<int64_t>{dims.batch, dims.heads_q, dims.seqlen_q};
  TORCH_CHECK(softmax_lse.sizes() == at::IntArrayRef(lse_shape), "flashop: softmax_lse must have shape ",
              packed ? "(nheads, total_q)" : "(batch, nheads, seqlen_q)", " = ", at::IntArrayRef(lse_shape), ", got ",
              softmax_lse.sizes());
  TORCH_CHECK(softmax_lse.scalar_type() == at::kFloat, "flashop: softmax_lse must have dtype torch.float32, got ",
              dtype_name(softmax_lse.scalar_type()));
  TORCH_CHECK(softmax_lse.device() == q.device(), "flashop: softmax_lse must be on the device of q (", q.device(),
              "), got ", softmax_lse.device());
}

namespace {

// A float32 tensor of one of the given shapes on q's device, contiguous (the kernels index it flat).
void check_variant_tensor(const at::Tensor& t, const char* name, const at::Tensor& q,
                          const std::vector<std::vector<int64_t>>& shapes, const char* shape_text) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "flashop: ", name, " must have dtype torch.float32, got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == q.device(), "flashop: ", name, " must be on the device of q (", q.device(), "), got ",
              t.device());
  bool shape_ok = false;
  for (const auto& s : shapes) shape_ok = shape_ok || t.sizes() == at::IntArrayRef(s);
  TORCH_CHECK(shape_ok, "flashop: ", name, " must have shape ", shape_text, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "flashop: ", name, " must be contiguous");
}

}  // namespace

AttentionVariants check_variants(const AttentionDims& dims, const at::Tensor& q, bool& causal, int64_t window_left,
                                 int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                 const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window_left >= -1, "flashop: window_size_left must be -1 (unbounded) or >= 0, got ", window_left);
  TORCH_CHECK(window_right >= -1, "flashop: window_size_right must be -1 (unbounded) or >= 0, got ", window_right);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "flashop: softcap must be a finite number >= 0 (0 is off), got ",
              softcap);
  const int64_t B = dims.batch, Hq = dims.heads_q;
  AttentionVariants v;
  if (alibi_slopes.has_value()) {
    const std::string shapes = "(nheads,) = (" + std::to_string(Hq) + ",) or (batch, nheads) = (" + std::to_string(B) +
                               ", " + std::to_string(Hq) + ")";
    check_variant_tensor(*alibi_slopes, "alibi_slopes", q, {{Hq}, {B, Hq}}, shapes.c_str());
    v.alibi_slopes = alibi_slopes->const_data_ptr<float>();
    v.alibi_batch_stride = alibi_slopes->dim() == 2 ? Hq : 0;
  }
  if (sinks.has_value()) {
    const std::string shapes = "(nheads,) = (" + std::to_string(Hq) + ",)";
    check_variant_tensor(*sinks, "learnable_sink", q, {{Hq}}, shapes.c_str());
    v.sinks = sinks->const_data_ptr<float>();
  }
  v.softcap = static_cast<float>(softcap);
  // Normalised bounds: a left bound >= Sk - 1 or a right bound >= Sq - 1 excludes no key of any row.
  if (causal) window_right = 0;
  if (window_left >= dims.seqlen_k - 1) window_left = -1;
  if (window_right >= dims.seqlen_q - 1) window_right = -1;
  v.window_left = static_cast<int>(window_left);
  v.window_right = static_cast<int>(window_right);
  causal = window_left < 0 && window_right == 0;
  return v;
}

namespace {

void check_index_tensor(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t size, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "flashop: ", name, " must have dtype torch.int32, got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.device() == q.device(), "flashop: ", name, " must be on the device of q (", q.device(), "), got ",
              t.device());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size, "flashop: ", name, " must have shape ", what, " = (", size,
              ",), got ", t.sizes());
}

void check_rank3(const at::Tensor& t, const char* name, const char* rows) {
  TORCH_CHECK(t.dim() == 3, "flashop: with cu_seqlens, ", name, " must be a 3-D tensor (", rows,
              ", nheads, headdim), got a ", t.dim(), "-D tensor");
}

}  // namespace

AttentionDims check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const VarlenArgs& args) {
  check_rank3(q, "q", "total_q");
  check_rank3(k, "k", "total_k");
  check_rank3(v, "v", "total_k");
  // The dense rules on the packed tensors seen as one batch entry.
  AttentionDims dims = check_forward_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0));
  TORCH_CHECK(args.cu_seqlens_q.dim() == 1 && args.cu_seqlens_q.size(0) >= 1, "flashop: cu_seqlens_q must have shape "
              "(batch + 1,), got ", args.cu_seqlens_q.sizes());
  const int64_t batch = args.cu_seqlens_q.size(0) - 1;
  check_index_tensor(args.cu_seqlens_q, "cu_seqlens_q", q, batch + 1, "(batch + 1,)");
  check_index_tensor(args.cu_seqlens_k, "cu_seqlens_k", q, batch + 1, "(batch + 1,)");
  if (args.seqused_q.has_value()) check_index_tensor(*args.seqused_q, "seqused_q", q, batch, "(batch,)");
  if (args.seqused_k.has_value()) check_index_tensor(*args.seqused_k, "seqused_k", q, batch, "(batch,)");
  dims.batch = batch;
  return dims;
}

void check_varlen_values(const at::Tensor& cu_seqlens, const char* name, int64_t total_tokens,
                         std::optional<int64_t> max_seqlen, const char* max_name,
                         const std::optional<at::Tensor>& seqused, const char* seqused_name) {
  const at::Tensor cu = cu_seqlens.cpu().contiguous();
  const int32_t* c = cu.const_data_ptr<int32_t>();
  const int64_t batch = cu.size(0) - 1;
  TORCH_CHECK(c[0] == 0, "flashop: ", name, " must start at 0, got ", c[0]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], "flashop: ", name, " must not decrease, got ", c[b], " then ", c[b + 1],
                " at index ", b);
    TORCH_CHECK(!max_seqlen.has_value() || c[b + 1] - c[b] <= *max_seqlen, "flashop: ", max_name, " (", *max_seqlen,
                ") is smaller than sequence ", b, "'s length ", c[b + 1] - c[b]);
  }
  TORCH_CHECK(c[batch] == total_tokens, "flashop: the last entry of ", name, " (", c[batch],
              ") must be the number of tokens (", total_tokens, ")");
  if (seqused.has_value()) {
    const at::Tensor used = seqused->cpu().contiguous();
    const int32_t* u = used.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(u[b] >= 0 && u[b] <= c[b + 1] - c[b], "flashop: ", seqused_name, "[", b, "] (", u[b],
                  ") must be between 0 and the sequence's length ", c[b + 1] - c[b]);
    }
  }
}

void check_out(const at::Tensor& out, const at::Tensor& q) {
  TORCH_CHECK(out.sym_sizes() == q.sym_sizes(), "flashop: out must have the shape of q ", q.sym_sizes(), ", got ",
              out.sym_sizes());
  check_same_dtype_device(out, "out", q);
}

double resolve_softmax_scale(std::optional<double> softmax_scale, int64_t headdim) {
  if (!softmax_scale.has_value()) return 1.0 / std::sqrt(static_cast<double>(headdim));
  TORCH_CHECK(std::isfinite(*softmax_scale), "flashop: softmax_scale must be a finite number, got ", *softmax_scale);
  return *softmax_scale;
}

}  // namespace flashop

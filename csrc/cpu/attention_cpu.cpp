// CPU kernels of flashop::forward and flashop::backward: argument checks, output
// allocation, and the call into the tile kernels (attention_kernels.h) of the
// instruction set that runs (isa.h).
#include "../checks.h"
#include "../packed_sequences.h"
#include "isa.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>
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

// The kernels on (B, S, H, D) views: out and lse (B, Hq, Sq) are written for every row.
void run_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                 const AttentionDims& dims, double scale, bool causal, const AttentionVariants& variants) {
  cpu::AttentionParams p;
  set_common(p, dims, q, k, v, scale, causal, variants);
  p.out = out.data_ptr();
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.softmax_lse = lse.data_ptr<float>();
  p.lse_batch_stride = lse.stride(0), p.lse_head_stride = lse.stride(1), p.lse_row_stride = lse.stride(2);
  cpu::forward(p, q.scalar_type());
}

void run_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                  const AttentionDims& dims, double scale, bool causal, const AttentionVariants& variants) {
  cpu::BackwardParams p;
  set_common(p, dims, q, k, v, scale, causal, variants);
  p.out = const_cast<void*>(out.const_data_ptr());
  p.out_batch_stride = out.stride(0), p.out_row_stride = out.stride(1), p.out_head_stride = out.stride(2);
  p.softmax_lse = const_cast<float*>(lse.const_data_ptr<float>());  // read only
  p.lse_batch_stride = lse.stride(0), p.lse_head_stride = lse.stride(1), p.lse_row_stride = lse.stride(2);
  p.dout = dout.const_data_ptr();
  p.dout_batch_stride = dout.stride(0), p.dout_row_stride = dout.stride(1), p.dout_head_stride = dout.stride(2);
  p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_row_stride = dq.stride(1), p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_row_stride = dk.stride(1), p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_row_stride = dv.stride(1), p.dv_head_stride = dv.stride(2);
  cpu::backward(p, q.scalar_type());
}

// A packed batch's sequences: rows [q0, q0 + len_q) of q and [k0, k0 + len_k) of k/v take part (the first
// seqused tokens of each sequence); the other rows of a sequence give zero output and lse = -inf, and get
// zero gradients. The bounds are sequence_bounds' (csrc/packed_sequences.h), as the CUDA kernels read them.
struct Sequence {
  int64_t q0, len_q, k0, len_k;
};

std::vector<Sequence> varlen_sequences(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       const std::optional<at::Tensor>& seqused_q,
                                       const std::optional<at::Tensor>& seqused_k, const AttentionDims& dims,
                                       std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k) {
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  const at::Tensor used_q = seqused_q ? seqused_q->contiguous() : at::Tensor();
  const at::Tensor used_k = seqused_k ? seqused_k->contiguous() : at::Tensor();
  const int32_t* uq = seqused_q ? used_q.const_data_ptr<int32_t>() : nullptr;
  const int32_t* uk = seqused_k ? used_k.const_data_ptr<int32_t>() : nullptr;
  const int total_q = static_cast<int>(dims.seqlen_q), total_k = static_cast<int>(dims.seqlen_k);
  const int max_q = static_cast<int>(max_seqlen_q.value_or(total_q));
  const int max_k = static_cast<int>(max_seqlen_k.value_or(total_k));
  std::vector<Sequence> seqs(cu_q.size(0) - 1);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const SequenceBounds sq = sequence_bounds(cu_q.const_data_ptr<int32_t>(), uq, int(b), total_q, max_q);
    const SequenceBounds sk = sequence_bounds(cu_k.const_data_ptr<int32_t>(), uk, int(b), total_k, max_k);
    seqs[b] = {sq.start, sq.used, sk.start, sk.used};
  }
  return seqs;
}

struct VarlenOptions {
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k;
  std::optional<int64_t> max_seqlen_q;
  std::optional<int64_t> max_seqlen_k;
  const std::optional<at::Tensor>& seqused_q;
  const std::optional<at::Tensor>& seqused_k;

  bool packed() const {
    TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                "flashop: cu_seqlens_q and cu_seqlens_k must be given together");
    TORCH_CHECK(cu_seqlens_q.has_value() || (!max_seqlen_q && !max_seqlen_k && !seqused_q && !seqused_k),
                "flashop: max_seqlen_q/k and seqused_q/k need cu_seqlens_q and cu_seqlens_k");
    return cu_seqlens_q.has_value();
  }
  // The tensor rules, then the values (eager).
  AttentionDims check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
    const AttentionDims dims = check_varlen_inputs(q, k, v, {*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k});
    check_varlen_values(*cu_seqlens_q, "cu_seqlens_q", dims.seqlen_q, max_seqlen_q, "max_seqlen_q", seqused_q,
                        "seqused_q");
    check_varlen_values(*cu_seqlens_k, "cu_seqlens_k", dims.seqlen_k, max_seqlen_k, "max_seqlen_k", seqused_k,
                        "seqused_k");
    return dims;
  }
};

// One sequence's problem (batch 1): its window normalised on its own lengths is not needed (the kernels take
// any bounds), its ALiBi slopes row is b's.
AttentionVariants sequence_variants(AttentionVariants v, int64_t b) {
  if (v.alibi_slopes) v.alibi_slopes += b * v.alibi_batch_stride, v.alibi_batch_stride = 0;
  return v;
}

// `deterministic` needs nothing here: every output element is reduced by one
// thread in a fixed order (run to run, for a given number of threads).
std::tuple<at::Tensor, at::Tensor> forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> softmax_scale, bool causal,
    std::optional<c10::string_view> config, bool /*deterministic*/, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& seqused_k) {
  const VarlenOptions varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k};
  const bool packed = varlen.packed();
  const AttentionDims dims = packed ? varlen.check(q, k, v) : check_forward_inputs(q, k, v);
  const AttentionVariants variants = check_variants(dims, q, causal, window_size_left, window_size_right, softcap,
                                                    alibi_slopes, learnable_sink);
  check_cpu_config(config, "flashop.forward");
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  at::Tensor out = at::empty(q.sizes(), q.options());
  if (!packed) {
    at::Tensor lse = at::empty({dims.batch, dims.heads_q, dims.seqlen_q}, q.options().dtype(at::kFloat));
    run_forward(q, k, v, out, lse, dims, scale, causal, variants);
    return {out, lse};
  }
  // Packed: lse (Hq, total_q); each sequence is a batch-1 problem on views.
  at::Tensor lse = at::full({dims.heads_q, dims.seqlen_q}, -std::numeric_limits<float>::infinity(),
                            q.options().dtype(at::kFloat));
  out.zero_();
  const auto seqs =
      varlen_sequences(*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k, dims, max_seqlen_q, max_seqlen_k);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = seqs[b];
    if (s.len_q == 0) continue;
    const AttentionDims seq{1, s.len_q, s.len_k, dims.heads_q, dims.heads_k, dims.headdim};
    at::Tensor out_b = out.narrow(0, s.q0, s.len_q).unsqueeze(0);
    at::Tensor lse_b = lse.narrow(1, s.q0, s.len_q).unsqueeze(0);
    run_forward(q.narrow(0, s.q0, s.len_q).unsqueeze(0), k.narrow(0, s.k0, s.len_k).unsqueeze(0),
                v.narrow(0, s.k0, s.len_k).unsqueeze(0), out_b, lse_b, seq, scale, causal,
                sequence_variants(variants, static_cast<int64_t>(b)));
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, std::optional<double> softmax_scale, bool causal,
    std::optional<c10::string_view> config, bool /*deterministic*/, int64_t window_size_left,
    int64_t window_size_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
    const std::optional<at::Tensor>& seqused_q, const std::optional<at::Tensor>& seqused_k) {
  const VarlenOptions varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k};
  const bool packed = varlen.packed();
  const AttentionDims dims = packed ? varlen.check(q, k, v) : check_forward_inputs(q, k, v);
  check_backward_inputs(dout, q, out, softmax_lse, dims, packed);
  const AttentionVariants variants = check_variants(dims, q, causal, window_size_left, window_size_right, softcap,
                                                    alibi_slopes, std::nullopt);
  check_cpu_config(config, "flashop.backward");
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  if (!packed) {
    at::Tensor dq = at::empty(q.sizes(), q.options());
    at::Tensor dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    run_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dims, scale, causal, variants);
    return {dq, dk, dv};
  }
  // Packed: rows outside every sequence's used tokens keep zero gradients.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  const auto seqs =
      varlen_sequences(*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k, dims, max_seqlen_q, max_seqlen_k);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = seqs[b];
    if (s.len_q == 0 || s.len_k == 0) continue;  // no pair: every gradient of the sequence is zero
    const AttentionDims seq{1, s.len_q, s.len_k, dims.heads_q, dims.heads_k, dims.headdim};
    auto rows_q = [&](const at::Tensor& t) { return t.narrow(0, s.q0, s.len_q).unsqueeze(0); };
    auto rows_k = [&](const at::Tensor& t) { return t.narrow(0, s.k0, s.len_k).unsqueeze(0); };
    at::Tensor dq_b = rows_q(dq), dk_b = rows_k(dk), dv_b = rows_k(dv);
    run_backward(rows_q(dout), rows_q(q), rows_k(k), rows_k(v), rows_q(out),
                 softmax_lse.narrow(1, s.q0, s.len_q).unsqueeze(0), dq_b, dk_b, dv_b, seq, scale, causal,
                 sequence_variants(variants, static_cast<int64_t>(b)));
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flashop

TORCH_LIBRARY_IMPL(flashop, CPU, m) {
  m.impl("forward", &flashop::forward_cpu);
  m.impl("backward", &flashop::backward_cpu);
}

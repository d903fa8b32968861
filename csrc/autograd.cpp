// How flashop::forward composes above the kernels, for every backend, in C++ so a call pays no Python on its
// way through the dispatcher: its autograd formula, and its out= overload. The forward saves q, k, v, out and softmax_lse; the gradient of q, k and v is
// flashop::backward's, and the sinks' is formed here: a sink's logit has no value vector, so its dP is 0 and
// dS_sink = P_sink * (0 - D) with D = rowsum(dO * O), summed over the rows it sits in.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"

namespace flashop {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;
using OptSymInt = std::optional<c10::SymInt>;

// The ops' C++ signatures (csrc/flashop.cpp defines their schemas).
using ForwardSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, std::optional<double>, bool, std::optional<c10::string_view>,
    bool, int64_t, int64_t, double, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, OptSymInt,
    OptSymInt, const OptTensor&, const OptTensor&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    std::optional<double>, bool, std::optional<c10::string_view>, bool, int64_t, int64_t, double, const OptTensor&,
    const OptTensor&, const OptTensor&, OptSymInt, OptSymInt, const OptTensor&, const OptTensor&);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashop::forward", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("flashop::backward", "").typed<BackwardSig>();
  return op;
}

OptTensor saved_or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// d loss / d sink_h = -sum over rows of P_sink * D, P_sink = exp(sink - lse) (the lse includes the sink).
// dout/out (B, Sq, Hq, D) and lse (B, Hq, Sq), or packed (total_q, Hq, D) and (Hq, total_q); rows that take no
// part (lse = -inf) add nothing.
at::Tensor sink_grad(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sink) {
  const at::Tensor d_rows = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1).transpose(-1, -2);
  at::Tensor p_sink = at::exp(sink.unsqueeze(-1) - lse);
  p_sink = at::where(at::isneginf(lse), at::zeros({}, p_sink.options()), p_sink);
  const at::Tensor per_head = (p_sink * d_rows).sum(-1);  // (B, Hq) or (Hq,)
  return -(per_head.dim() == 2 ? per_head.sum(0) : per_head);
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               std::optional<double> softmax_scale, bool causal,
                               std::optional<c10::string_view> config, bool deterministic, int64_t window_left,
                               int64_t window_right, double softcap, const OptTensor& alibi_slopes,
                               const OptTensor& learnable_sink, const OptTensor& cu_seqlens_q,
                               const OptTensor& cu_seqlens_k, OptSymInt max_seqlen_q, OptSymInt max_seqlen_k,
                               const OptTensor& seqused_q, const OptTensor& seqused_k) {
    at::Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse) = forward_op().call(q, k, v, softmax_scale, causal, config, deterministic, window_left,
                                             window_right, softcap, alibi_slopes, learnable_sink, cu_seqlens_q,
                                             cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
    }
    const at::Tensor none;
    ctx->save_for_backward({q, k, v, out, lse, alibi_slopes.value_or(none), learnable_sink.value_or(none),
                            cu_seqlens_q.value_or(none), cu_seqlens_k.value_or(none), seqused_q.value_or(none),
                            seqused_k.value_or(none)});
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["sink_grad"] = learnable_sink.has_value() && learnable_sink->requires_grad();
    // The LSE is an auxiliary output, as in FlashAttention: no gradient flows through it. Undefined gradients stay
    // undefined, so no call allocates and fills a zeros tensor for the LSE ahead of the backward's kernels.
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    // One gradient per forward argument: q, k, v, then learnable_sink (index 11); the others have none.
    variable_list result(18);
    at::Tensor dout = grads[0];
    if (!dout.defined()) return result;  // no gradient reached out: every input's is zero (undefined)
    // Incoming gradients can be expanded or transposed; the kernels need unit stride in headdim only.
    // (sym_size, not size: under tracing, size() on a tensor with symbolic sizes fixes all of them.)
    if (dout.sym_size(-1) > 1 && dout.sym_stride(-1) != 1) dout = dout.contiguous();
    const auto& data = ctx->saved_data;
    // Outside create_graph the call records nothing: it goes below the autograd keys, past their fallback.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    auto [dq, dk, dv] = backward_op().call(
        dout, q, k, v, out, lse, data.at("softmax_scale").toOptional<double>(), data.at("causal").toBool(),
        std::nullopt, data.at("deterministic").toBool(), data.at("window_left").toInt(),
        data.at("window_right").toInt(), data.at("softcap").toDouble(), saved_or_none(saved[5]),
        saved_or_none(saved[7]), saved_or_none(saved[8]), data.at("max_seqlen_q").toOptional<c10::SymInt>(),
        data.at("max_seqlen_k").toOptional<c10::SymInt>(), saved_or_none(saved[9]), saved_or_none(saved[10]));
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (data.at("sink_grad").toBool()) result[11] = sink_grad(dout, out, lse, saved[6]);
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> softmax_scale, bool causal,
    std::optional<c10::string_view> config, bool deterministic, int64_t window_left, int64_t window_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& learnable_sink, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, OptSymInt max_seqlen_q, OptSymInt max_seqlen_k, const OptTensor& seqused_q,
    const OptTensor& seqused_k) {
  const bool needs_grad = at::GradMode::is_enabled() &&
                          (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                           (learnable_sink.has_value() && learnable_sink->requires_grad()));
  if (!needs_grad) {  // inference: no graph node, nothing saved (a few microseconds of a small call)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(q, k, v, softmax_scale, causal, config, deterministic, window_left, window_right,
                             softcap, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k,
                             std::move(max_seqlen_q), std::move(max_seqlen_k), seqused_q, seqused_k);
  }
  const variable_list result = AttentionFunction::apply(
      q, k, v, softmax_scale, causal, config, deterministic, window_left, window_right, softcap, alibi_slopes,
      learnable_sink, cu_seqlens_q, cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k), seqused_q,
      seqused_k);
  return {result[0], result[1]};
}

// forward.with_out: the functional forward, then a copy into `out`. Registered as CompositeImplicitAutograd, so
// autograd, tracing and every backend see those two ops (the copy costs one pass over the output).
at::Tensor forward_with_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::optional<double> softmax_scale, bool causal, std::optional<c10::string_view> config,
                            bool deterministic, int64_t window_left, int64_t window_right, double softcap,
                            const OptTensor& alibi_slopes, const OptTensor& learnable_sink,
                            const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, OptSymInt max_seqlen_q,
                            OptSymInt max_seqlen_k, const OptTensor& seqused_q, const OptTensor& seqused_k,
                            const at::Tensor& out) {
  check_out(out, q);
  auto [result, lse] = forward_op().call(q, k, v, softmax_scale, causal, config, deterministic, window_left,
                                         window_right, softcap, alibi_slopes, learnable_sink, cu_seqlens_q,
                                         cu_seqlens_k, std::move(max_seqlen_q), std::move(max_seqlen_k), seqused_q,
                                         seqused_k);
  out.copy_(result);
  return lse;
}

}  // namespace
}  // namespace flashop

TORCH_LIBRARY_IMPL(flashop, Autograd, m) { m.impl("forward", &flashop::forward_autograd); }
TORCH_LIBRARY_IMPL(flashop, CompositeImplicitAutograd, m) { m.impl("forward.with_out", &flashop::forward_with_out); }

// The forward and backward entry points of each CUDA kernel module, with one signature: tensors already
// checked against the op's rules, the window normalised (csrc/checks.h check_variants), a kernel config named.
// flashop._C's CUDA ops (ops_cuda.cpp) call the mma.sync ones directly and the Hopper module's
// (flashop._C_sm90, a separate library) through the function pointers it hands over in a capsule, so a call
// crosses no Python.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace flashop {
namespace glue {

using OptTensor = std::optional<at::Tensor>;

// Function types: `ForwardEntry f;` declares a function, `ForwardEntry*` points to one.
using ForwardEntry = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale, bool causal,
    const std::string& config, int64_t window_left, int64_t window_right, double softcap,
    const OptTensor& alibi_slopes, const OptTensor& sinks, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
    const OptTensor& seqused_q, const OptTensor& seqused_k);

using BackwardEntry = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, double softmax_scale, bool causal, bool deterministic, const std::string& config,
    int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
    std::optional<int64_t> max_seqlen_k, const OptTensor& seqused_q, const OptTensor& seqused_k);

struct KernelEntries {
  ForwardEntry* forward;
  BackwardEntry* backward;
};

// The name of the capsule flashop._C_sm90.entry_points, which holds a KernelEntries.
constexpr const char* kHopperEntriesCapsule = "flashop._C_sm90.entry_points";

}  // namespace glue
}  // namespace flashop

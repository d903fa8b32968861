// flashop._C_sm90: the Hopper (sm_90a) forward and backward kernels behind the same bindings as
// flashop._C's (forward, backward, built_*_configs, *_config_smem), plus forward_config_workspace and
// backward_config_tail_split.
// Tensors in, params out, a kernel of the sm90 registry (registry_sm90.cuh) launched on the current
// stream; the shared steps are in ../glue.h. The kernels (fwd_launch.cuh, bwd_launch.cuh) encode
// their TMA tensor maps from the params.
//
// Numbers in this module's error messages go in as strings (std::to_string). On the GPU machine's
// toolchain, inserting an integer into the message stream from this module crashed the process (the
// stream's number facet came from a different libstdc++ than the code using it); strings do not
// touch that facet. flashop/ops.py also validates tensors in Python before it calls here.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "../../checks.h"
#include "../fwd_params.h"
#include "../glue.h"
#include "registry_sm90.cuh"

namespace flashop {
namespace glue {
namespace {

using std::to_string;
using sm90::Sm90BwdKernel;
using sm90::Sm90FwdKernel;
using sm90::Sm90FwdPlan;

constexpr const char* kFwd = "flashop.forward";
constexpr const char* kBwd = "flashop.backward";

const Sm90FwdKernel& forward_kernel(const std::string& name) {
  return kernel_or_throw(sm90::sm90_fwd_kernels(), sm90::num_sm90_fwd_kernels(), name, kFwd);
}

const Sm90BwdKernel& backward_kernel(const std::string& name) {
  return kernel_or_throw(sm90::sm90_bwd_kernels(), sm90::num_sm90_bwd_kernels(), name, kBwd);
}

// The kernels are built for sm_90a alone.
const Device& hopper_device(const at::Tensor& q, const char* op) {
  const Device& dev = device(q.get_device(), op);
  TORCH_CHECK(dev.sm == 90, op, " (sm90): kernels are built for sm_90a; ", q.device(), " is ", to_string(dev.sm / 10),
              ".", to_string(dev.sm % 10));
  return dev;
}

// The forward of a packed batch (dims from check_varlen_inputs: batch = sequences, seqlen_q/k = total
// rows). The value checks of cu_seqlens, max_seqlen and seqused (check_varlen_values) are the caller's
// (flashop/ops.py, eager only); whatever they hold, the kernels stay inside the tensors
// (sequence_bounds). Out (total_q, Hq, D), lse (Hq, total_q).
std::tuple<at::Tensor, at::Tensor> forward_packed(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const AttentionDims& vdims,
    double softmax_scale, bool causal, const std::string& config, int64_t window_left, int64_t window_right,
    double softcap, const c10::optional<at::Tensor>& alibi_slopes, const c10::optional<at::Tensor>& sinks,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const c10::optional<at::Tensor>& seqused_q, const c10::optional<at::Tensor>& seqused_k) {
  const DType dt = check_cuda_inputs(q_in, softmax_scale, kFwd, "sm90");
  const Sm90FwdKernel& kernel = forward_kernel(config);
  TORCH_CHECK(kernel.supports_variants, "flashop.forward: kernel config '", config,
              "' does not run packed batches (cu_seqlens); its HopperConfig.supports_packed is False. Pick another "
              "config or config=None.");
  // Sequence b's ALiBi slopes are row b of (batch, heads_q) slopes: vdims.batch is the number of sequences.
  const AttentionVariants variants =
      check_variants(vdims, q_in, causal, window_left, window_right, softcap, alibi_slopes, sinks);
  TORCH_CHECK(softmax_scale != 0.0 || (variants.softcap == 0.f && variants.alibi_slopes == nullptr),
              "flashop.forward (sm90): softmax_scale = 0 with softcap or alibi_slopes is not supported");
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0 && max_seqlen_q < std::numeric_limits<int>::max() &&
                  max_seqlen_k < std::numeric_limits<int>::max(),
              "flashop.forward (sm90): max_seqlen_q and max_seqlen_k must be in [0, 2^31)");

  c10::cuda::CUDAGuard guard(q_in.device());
  const Device& dev = hopper_device(q_in, kFwd);
  check_kernel_fits(kFwd, config, kernel.dtype, kernel.headdim, kernel.smem_bytes, 90, dt, vdims.headdim, dev,
                    q_in.device());

  // One batch of total rows: (1, total, H, D) views, out (1, total_q, Hq, D), lse (1, Hq, total_q).
  const AttentionDims dims{1, vdims.seqlen_q, vdims.seqlen_k, vdims.heads_q, vdims.heads_k, vdims.headdim};
  at::Tensor out = at::empty({1, dims.seqlen_q, dims.heads_q, dims.headdim}, q_in.options());
  at::Tensor lse = at::empty({1, dims.heads_q, dims.seqlen_q}, q_in.options().dtype(at::kFloat));
  if (vdims.batch == 0 || dims.heads_q == 0 || dims.seqlen_q == 0) return {out.squeeze(0), lse.squeeze(0)};
  if (dims.seqlen_k == 0 || max_seqlen_k == 0 || max_seqlen_q == 0) {
    // No key anywhere (or a grid without rows): every used row sees nothing (0, lse = -inf or its sink),
    // every other row is 0 and -inf. (max_seqlen_q = 0 with rows: the checks reject it in eager mode.)
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    if (sinks.has_value() && max_seqlen_q > 0) {
      const at::Tensor rows = at::arange(dims.seqlen_q, cu_seqlens_q.options().dtype(at::kLong));
      const at::Tensor cu = cu_seqlens_q.to(at::kLong);
      const at::Tensor seq = at::searchsorted(cu.slice(0, 1), rows, /*out_int32=*/false, /*right=*/true)
                                 .clamp_max(vdims.batch - 1);
      at::Tensor used = cu.slice(0, 1) - cu.slice(0, 0, vdims.batch);
      if (seqused_q.has_value()) used = at::minimum(used, seqused_q->to(at::kLong));
      const at::Tensor live = (rows - cu.index_select(0, seq)) < used.index_select(0, seq);
      const at::Tensor sink_rows = sinks->to(at::kFloat).view({1, dims.heads_q, 1}).expand_as(lse);
      lse.copy_(at::where(live.view({1, 1, dims.seqlen_q}), sink_rows, lse));
    }
    return {out.squeeze(0), lse.squeeze(0)};
  }
  check_forward_sizes(dims, "sm90");

  double scale = softmax_scale;  // positive only: see fold_scale_into_q
  const at::Tensor q = readable(fold_scale_into_q(q_in, scale).unsqueeze(0), kTmaStrides);
  const at::Tensor k = readable(k_in.unsqueeze(0), kTmaStrides);
  const at::Tensor v = readable(v_in.unsqueeze(0), kTmaStrides);
  FwdParams p = make_fwd_params(q, k, v, out, lse, dims, scale, causal, variants);
  // The sequences: the grid spans max_seqlen_q rows of every sequence; rows are addressed from each
  // sequence's start (the batch strides are unused).
  p.batch = static_cast<int>(vdims.batch);
  p.seqlen_q = static_cast<int>(max_seqlen_q);
  p.seqlen_k = static_cast<int>(max_seqlen_k);
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = p.lse_batch_stride = 0;
  p.packed.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.packed.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
  p.packed.seqused_q = seqused_q.has_value() ? seqused_q->data_ptr<int32_t>() : nullptr;
  p.packed.seqused_k = seqused_k.has_value() ? seqused_k->data_ptr<int32_t>() : nullptr;
  p.packed.total_q = static_cast<int>(dims.seqlen_q);
  p.packed.total_k = static_cast<int>(dims.seqlen_k);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  Sm90FwdPlan plan;
  cudaError_t err = kernel.plan(p, &plan);
  TORCH_CHECK(err != cudaErrorNotSupported, "flashop.forward: kernel config '", kernel.name,
              "' does not run this packed batch (more than 65535 sequences on a one-tile-per-CTA config, or a "
              "config without the variants build)");
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: planning kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  at::Tensor workspace;
  if (plan.workspace_bytes > 0)
    workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes)}, q.options().dtype(at::kByte));
  err = kernel.launch(p, plan, plan.workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  return {out.squeeze(0), lse.squeeze(0)};
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           double softmax_scale, bool causal, const std::string& config,
                                           int64_t window_left, int64_t window_right, double softcap,
                                           const c10::optional<at::Tensor>& alibi_slopes,
                                           const c10::optional<at::Tensor>& sinks,
                                           const c10::optional<at::Tensor>& cu_seqlens_q,
                                           const c10::optional<at::Tensor>& cu_seqlens_k,
                                           c10::optional<int64_t> max_seqlen_q, c10::optional<int64_t> max_seqlen_k,
                                           const c10::optional<at::Tensor>& seqused_q,
                                           const c10::optional<at::Tensor>& seqused_k) {
  // Packed batch (csrc/packed_sequences.h): q (total_q, Hq, D), k and v (total_k, Hk, D); the kernels see
  // them as one batch of total rows (the unsqueezed views below), the params carry the sequences.
  const bool packed = cu_seqlens_q.has_value();
  TORCH_CHECK(packed == cu_seqlens_k.has_value() && packed == max_seqlen_q.has_value() &&
                  packed == max_seqlen_k.has_value() && (packed || (!seqused_q.has_value() && !seqused_k.has_value())),
              "flashop.forward (sm90): a packed batch takes cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
              "max_seqlen_k together (seqused_q/k only with them)");
  const AttentionDims dims =
      packed ? check_varlen_inputs(q_in, k_in, v_in, VarlenArgs{*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k})
             : check_forward_inputs(q_in, k_in, v_in);
  if (packed) return forward_packed(q_in, k_in, v_in, dims, softmax_scale, causal, config, window_left, window_right,
                                    softcap, alibi_slopes, sinks, *cu_seqlens_q, *cu_seqlens_k, *max_seqlen_q,
                                    *max_seqlen_k, seqused_q, seqused_k);
  const DType dt = check_cuda_inputs(q_in, softmax_scale, kFwd, "sm90");
  const Sm90FwdKernel& kernel = forward_kernel(config);
  // The checks and normal form of every backend (csrc/checks.cpp): causal becomes exactly the (-1, 0) window.
  const AttentionVariants variants =
      check_variants(dims, q_in, causal, window_left, window_right, softcap, alibi_slopes, sinks);
  const bool use_variants = sm90::fwd_variants_requested(variants);
  TORCH_CHECK(!use_variants || kernel.supports_variants, "flashop.forward: kernel config '", config,
              "' is built without the attention variants (window, softcap, alibi_slopes, sinks); "
              "its HopperConfig.supports_variants is False. Pick another config or config=None.");
  // The kernels keep scores in units of score / softmax_scale; a zero scale (run as the smallest normal
  // float) would overflow the softcap and ALiBi factors there.
  TORCH_CHECK(softmax_scale != 0.0 || (variants.softcap == 0.f && variants.alibi_slopes == nullptr),
              "flashop.forward (sm90): softmax_scale = 0 with softcap or alibi_slopes is not supported");

  c10::cuda::CUDAGuard guard(q_in.device());
  const Device& dev = hopper_device(q_in, kFwd);
  check_kernel_fits(kFwd, config, kernel.dtype, kernel.headdim, kernel.smem_bytes, 90, dt, dims.headdim, dev,
                    q_in.device());

  at::Tensor out, lse;
  if (allocate_forward_outputs(q_in, dims, out, lse, sinks)) return {out, lse};
  check_forward_sizes(dims, "sm90");

  double scale = softmax_scale;  // positive only: see fold_scale_into_q
  const at::Tensor q = readable(fold_scale_into_q(q_in, scale), kTmaStrides);
  const at::Tensor k = readable(k_in, kTmaStrides);
  const at::Tensor v = readable(v_in, kTmaStrides);
  const FwdParams p = make_fwd_params(q, k, v, out, lse, dims, scale, causal, variants);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  // The persistent kernels' split tail, the one-tile-per-CTA kernels' split last wave and "pers.dyn" need a
  // scratch buffer (from the caching allocator: stream-ordered, so freeing it here while the kernel runs is
  // safe).
  Sm90FwdPlan plan;
  cudaError_t err = kernel.plan(p, &plan);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: planning kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  at::Tensor workspace;
  if (plan.workspace_bytes > 0)
    workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes)}, q.options().dtype(at::kByte));
  err = kernel.launch(p, plan, plan.workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(err != cudaErrorNotSupported, "flashop.forward: kernel config '", kernel.name,
              "' does not run the attention variants (window, softcap, alibi_slopes, sinks)");
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  return {out, lse};
}

std::vector<std::string> built_forward_configs() {
  return kernel_names(sm90::sm90_fwd_kernels(), sm90::num_sm90_fwd_kernels());
}

int64_t forward_config_smem(const std::string& name) { return static_cast<int64_t>(forward_kernel(name).smem_bytes); }

// Scratch bytes a forward launch of a built config takes for these sizes on the current device (0: none;
// > 0: the persistent kernel splits its last waves' tiles, or a one-tile-per-CTA kernel its last wave; see
// fwd_launch.cuh). For tests and tools.
int64_t forward_config_workspace(const std::string& name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                                 int64_t heads_q, bool causal) {
  const Sm90FwdKernel& k = forward_kernel(name);
  TORCH_CHECK(batch > 0 && seqlen_q > 0 && seqlen_k >= 0 && heads_q > 0 && batch <= 65535 && heads_q <= 65535 &&
                  seqlen_q < std::numeric_limits<int>::max() && seqlen_k < std::numeric_limits<int>::max(),
              "forward_config_workspace: sizes out of range");
  FwdParams p{};
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.heads_q = static_cast<int>(heads_q);
  p.headdim = k.headdim;
  p.causal = causal;
  Sm90FwdPlan plan;
  const cudaError_t err = k.plan(p, &plan);
  TORCH_CHECK(err == cudaSuccess, "forward_config_workspace: planning '", name, "' failed: ",
              cudaGetErrorString(err));
  return static_cast<int64_t>(plan.workspace_bytes);
}

// The tail split (sm90/bwd_tail.h) a backward call of a built config makes on the current device:
// (first_block, blocks, pieces), pieces = 0 for none.
std::tuple<int64_t, int64_t, int64_t> backward_config_tail_split(const std::string& name, int64_t batch,
                                                                 int64_t seqlen_q, int64_t seqlen_k,
                                                                 int64_t heads_q, int64_t heads_k, bool causal) {
  const Sm90BwdKernel& k = backward_kernel(name);
  TORCH_CHECK(batch > 0 && seqlen_q > 0 && seqlen_k > 0 && heads_k > 0 && heads_q % heads_k == 0 &&
                  batch <= 65535 && heads_q <= 65535 && seqlen_q < std::numeric_limits<int>::max() - 1024 &&
                  seqlen_k < std::numeric_limits<int>::max() - 1024,
              "backward_config_tail_split: sizes out of range");
  BwdParams p{};
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.heads_q = static_cast<int>(heads_q);
  p.heads_k = static_cast<int>(heads_k);
  p.head_ratio = static_cast<int>(heads_q / heads_k);
  p.headdim = k.headdim;
  p.causal = causal;
  if (causal) p.variants.window_right = 0;
  p.sm_count = device(c10::cuda::current_device(), "backward_config_tail_split").sm_count;
  k.plan(p);
  return {p.tail.first_block, p.tail.blocks, p.tail.pieces};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& softmax_lse,
                                                        double softmax_scale, bool causal, bool deterministic,
                                                        const std::string& config, int64_t window_left,
                                                        int64_t window_right, double softcap,
                                                        const c10::optional<at::Tensor>& alibi_slopes,
                                                        const c10::optional<at::Tensor>& cu_seqlens_q,
                                                        const c10::optional<at::Tensor>& cu_seqlens_k,
                                                        c10::optional<int64_t> max_seqlen_q,
                                                        c10::optional<int64_t> max_seqlen_k,
                                                        const c10::optional<at::Tensor>& seqused_q,
                                                        const c10::optional<at::Tensor>& seqused_k) {
  // Packed batch (csrc/packed_sequences.h): as forward's; the value checks are the caller's (flashop/ops.py
  // through flashop._C.check_packed, eager only), and whatever the values the kernels stay inside the
  // tensors (sequence_bounds).
  const bool is_packed = cu_seqlens_q.has_value();
  TORCH_CHECK(is_packed == cu_seqlens_k.has_value() && is_packed == max_seqlen_q.has_value() &&
                  is_packed == max_seqlen_k.has_value() &&
                  (is_packed || (!seqused_q.has_value() && !seqused_k.has_value())),
              "flashop.backward (sm90): a packed batch takes cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
              "max_seqlen_k together (seqused_q/k only with them)");
  const AttentionDims dims =
      is_packed ? check_varlen_inputs(q, k, v, VarlenArgs{*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k})
                : check_forward_inputs(q, k, v);
  check_backward_inputs(dout, q, out, softmax_lse, dims, is_packed);
  const DType dt = check_cuda_inputs(q, softmax_scale, kBwd, "sm90");
  const Sm90BwdKernel& kernel = backward_kernel(config);
  TORCH_CHECK(!is_packed || kernel.supports_packed, "flashop.backward: kernel config '", config,
              "' does not run packed batches (cu_seqlens); its HopperBackwardConfig.supports_packed is False. Pick "
              "another config or config=None.");
  PackedBatch packed;
  if (is_packed) {
    TORCH_CHECK(*max_seqlen_q >= 0 && *max_seqlen_k >= 0 && *max_seqlen_q < std::numeric_limits<int>::max() &&
                    *max_seqlen_k < std::numeric_limits<int>::max(),
                "flashop.backward (sm90): max_seqlen_q and max_seqlen_k must be in [0, 2^31)");
    packed.cu_seqlens_q = cu_seqlens_q->contiguous();
    packed.cu_seqlens_k = cu_seqlens_k->contiguous();
    if (seqused_q.has_value()) packed.seqused_q = seqused_q->contiguous();
    if (seqused_k.has_value()) packed.seqused_k = seqused_k->contiguous();
    // A max_seqlen above the tokens sizes the grid only (as check_packed_inputs).
    packed.max_seqlen_q = std::min(*max_seqlen_q, dims.seqlen_q);
    packed.max_seqlen_k = std::min(*max_seqlen_k, dims.seqlen_k);
  }
  TORCH_CHECK(!deterministic, "flashop.backward: kernel config '", config,
              "' adds dQ with atomics in any order; deterministic=True needs an mma.sync backward config (bwd.*)");
  const AttentionVariants variants =
      check_variants(dims, q, causal, window_left, window_right, softcap, alibi_slopes, std::nullopt);

  c10::cuda::CUDAGuard guard(q.device());
  const Device& dev = hopper_device(q, kBwd);
  check_kernel_fits(kBwd, config, kernel.dtype, kernel.headdim, kernel.smem_bytes, 90, dt, dims.headdim, dev,
                    q.device());
  return run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, dims, dev,
                      kernel.block_m, kernel.headdim, kernel.launch, kernel.name, variants,
                      is_packed ? &packed : nullptr, kernel.plan);
}

std::vector<std::string> built_backward_configs() {
  return kernel_names(sm90::sm90_bwd_kernels(), sm90::num_sm90_bwd_kernels());
}

int64_t backward_config_smem(const std::string& name) {
  return static_cast<int64_t>(backward_kernel(name).smem_bytes);
}

}  // namespace
}  // namespace glue
}  // namespace flashop

PYBIND11_MODULE(_C_sm90, m) {
  namespace py = pybind11;
  namespace glue = flashop::glue;
  m.doc() = "flashop Hopper (sm_90a) kernels: TMA + wgmma + warp specialisation (forward, backward)";
  // flashop._C's CUDA ops call the kernels through these pointers (csrc/cuda/kernel_entry.h).
  static const glue::KernelEntries entries{&glue::forward, &glue::backward};
  m.attr("entry_points") = py::capsule(&entries, glue::kHopperEntriesCapsule);
  m.def("forward", &glue::forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("softmax_scale"),
        py::arg("causal"), py::arg("config"), py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
        py::arg("cu_seqlens_q") = py::none(), py::arg("cu_seqlens_k") = py::none(),
        py::arg("max_seqlen_q") = py::none(), py::arg("max_seqlen_k") = py::none(),
        py::arg("seqused_q") = py::none(), py::arg("seqused_k") = py::none(),
        "FlashAttention forward on sm_90a. Arguments and result as flashop._C.forward; config: a name from "
        "built_forward_configs(). window_left / window_right (-1: unbounded; causal is (-1, 0)), softcap "
        "(0: off), alibi_slopes (float32 (heads_q,) or (batch, heads_q)) and sinks (float32 (heads_q,)): "
        "csrc/attention_variants.h; a config whose HopperConfig.supports_variants is False refuses them. "
        "Packed batch: cu_seqlens_q/k (int32 (batch + 1,)), max_seqlen_q/k and optional seqused_q/k (int32 "
        "(batch,)) with q (total_q, Hq, D), k and v (total_k, Hk, D); returns out (total_q, Hq, D) and lse "
        "(Hq, total_q); the values are the caller's to check (csrc/checks.h check_varlen_values).");
  m.def("built_forward_configs", &glue::built_forward_configs,
        "Names of the sm90 forward kernel configs compiled into this module, in registry order.");
  m.def("forward_config_smem", &glue::forward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built sm90 forward config.");
  m.def("forward_config_workspace", &glue::forward_config_workspace, py::arg("name"), py::arg("batch"),
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("heads_q"), py::arg("causal"),
        "Scratch bytes of a forward launch of a built sm90 config on the current device (0: none; "
        "> 0: the split tail or split last wave runs).");
  m.def("backward", &glue::backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("softmax_lse"), py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic"),
        py::arg("config"), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(), py::arg("max_seqlen_q") = py::none(),
        py::arg("max_seqlen_k") = py::none(), py::arg("seqused_q") = py::none(), py::arg("seqused_k") = py::none(),
        "FlashAttention backward on sm_90a (wgmma + TMA main kernel). Arguments and result as "
        "flashop._C.backward; config: a name from built_backward_configs(); not deterministic. "
        "window_left / window_right (-1: unbounded; causal is (-1, 0)), softcap (0: off) and alibi_slopes "
        "(float32 (heads_q,) or (batch, heads_q)): csrc/attention_variants.h, as forward's (sinks need "
        "nothing in the backward). Packed batch: as forward's (a config whose supports_packed is False "
        "refuses it); the values are the caller's to check.");
  m.def("built_backward_configs", &glue::built_backward_configs,
        "Names of the sm90 backward kernel configs compiled into this module, in registry order.");
  m.def("backward_config_smem", &glue::backward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built sm90 backward config.");
  m.def("backward_config_tail_split", &glue::backward_config_tail_split, py::arg("name"), py::arg("batch"),
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("heads_q"), py::arg("heads_k"), py::arg("causal"),
        "The tail split of a backward call of a built sm90 config on the current device: (first_block, blocks, "
        "pieces); pieces = 0: none (csrc/cuda/sm90/bwd_tail.h).");
}

// flashop._C's forward on the mma.sync kernels: tensors in, FwdParams out, a kernel of the
// generated registry (fwd_registry.h) launched on the current stream. The config name is chosen by
// the Python policy (flashop/dispatch.py); the glue only checks that the named kernel takes q.
//
// Compiled by the host compiler; the kernels live in csrc/cuda/instantiations/.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "fwd_params.h"
#include "fwd_registry.h"
#include "glue.h"

namespace flashop {
namespace glue {
namespace {

constexpr const char* kOp = "flashop.forward";

const FwdKernel& forward_kernel(const std::string& name) {
  return kernel_or_throw(fwd_kernels(), num_fwd_kernels(), name, kOp);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mma_sync_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           double softmax_scale, bool causal, const std::string& config,
                                           int64_t window_left, int64_t window_right, double softcap,
                                           const std::optional<at::Tensor>& alibi_slopes,
                                           const std::optional<at::Tensor>& sinks,
                                           const std::optional<at::Tensor>& cu_seqlens_q,
                                           const std::optional<at::Tensor>& cu_seqlens_k,
                                           std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                                           const std::optional<at::Tensor>& seqused_q,
                                           const std::optional<at::Tensor>& seqused_k) {
  // Packed batches (cu_seqlens given): q (total_q, Hq, D), k/v (total_k, Hk, D); dims.batch is the
  // number of sequences and dims.seqlen_q/k the tokens.
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flashop: cu_seqlens_q and cu_seqlens_k must be given together");
  PackedBatch packed;
  const bool is_packed = cu_seqlens_q.has_value();
  const AttentionDims dims = is_packed ? check_packed_inputs(q_in, k_in, v_in, *cu_seqlens_q, *cu_seqlens_k,
                                                             max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, packed)
                                       : check_forward_inputs(q_in, k_in, v_in);
  const DType dt = check_cuda_inputs(q_in, softmax_scale, kOp, "CUDA");
  // The checks and normal form of every backend (csrc/checks.cpp): causal becomes exactly the (-1, 0) window.
  const AttentionVariants variants =
      check_variants(dims, q_in, causal, window_left, window_right, softcap, alibi_slopes, sinks);

  c10::cuda::CUDAGuard guard(q_in.device());
  const Device& dev = device(q_in.get_device(), kOp);
  TORCH_CHECK(dev.sm >= 80, "flashop.forward (CUDA): needs compute capability 8.0 or newer; ", q_in.device(), " is ",
              std::to_string(dev.sm / 10), ".", std::to_string(dev.sm % 10));
  const FwdKernel& kernel = forward_kernel(config);
  check_kernel_fits(kOp, config, kernel.config.dtype, kernel.config.headdim, kernel.smem_bytes, kernel.min_sm, dt,
                    dims.headdim, dev, q_in.device());

  at::Tensor out, lse;
  if (is_packed) {
    // (total_q, Hq, D) and (Hq, total_q); the kernel writes every row of every sequence (no shortcut for
    // Sk = 0: rows past seqused_q get lse = -inf, the others the sink).
    out = at::empty(q_in.sizes(), q_in.options());
    lse = at::empty({dims.heads_q, dims.seqlen_q}, q_in.options().dtype(at::kFloat));
    if (dims.batch == 0 || dims.heads_q == 0 || dims.seqlen_q == 0) return {out, lse};
  } else if (allocate_forward_outputs(q_in, dims, out, lse, sinks)) {
    return {out, lse};
  }
  const AttentionDims kdims = is_packed ? packed_kernel_dims(dims, packed) : dims;
  check_forward_sizes(kdims, "CUDA");

  // A negative scale is folded into q: the kernel's scale * q.k is still the user's score, which
  // softcap and ALiBi act on (make_fwd_params).
  double scale = softmax_scale;
  // Packed tensors are seen as one batch entry: (1, total, H, D), lse (1, Hq, total_q).
  auto rows = [&](const at::Tensor& t) { return is_packed ? as_batch1(t) : t; };
  const at::Tensor q = readable(rows(fold_scale_into_q(q_in, scale)), kSm80FwdStrides);
  const at::Tensor k = readable(rows(k_in), kSm80FwdStrides);
  const at::Tensor v = readable(rows(v_in), kSm80FwdStrides);
  at::Tensor out4 = rows(out), lse3 = is_packed ? lse.unsqueeze(0) : lse;
  FwdParams p = make_fwd_params(q, k, v, out4, lse3, kdims, scale, causal, variants);
  if (is_packed) set_packed(p, packed_sequences(packed, dims.seqlen_q, dims.seqlen_k));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const cudaError_t err = kernel.launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  return {out, lse};
}

namespace {


// The checks of a packed batch (tensors, then values: eager only) for callers of other kernel modules (the
// Hopper forward): (max_seqlen_q, max_seqlen_k), read from cu_seqlens where not given.
std::tuple<int64_t, int64_t> check_packed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                          std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                                          const std::optional<at::Tensor>& seqused_q,
                                          const std::optional<at::Tensor>& seqused_k) {
  PackedBatch packed;
  check_packed_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, packed);
  return {packed.max_seqlen_q, packed.max_seqlen_k};
}

std::vector<std::string> built_forward_configs() { return kernel_names(fwd_kernels(), num_fwd_kernels()); }

int64_t forward_config_smem(const std::string& name) { return static_cast<int64_t>(forward_kernel(name).smem_bytes); }

}  // namespace

void bind_forward(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("forward", &mma_sync_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("config"), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(), py::arg("max_seqlen_q") = py::none(),
        py::arg("max_seqlen_k") = py::none(), py::arg("seqused_q") = py::none(), py::arg("seqused_k") = py::none(),
        "FlashAttention forward on CUDA (mma.sync kernels). q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), fp16/bf16. "
        "config: a name from built_forward_configs(). window_left/window_right (-1: unbounded), softcap (0: off), "
        "alibi_slopes (float32 (Hq,) or (B, Hq)), sinks (float32 (Hq,)): csrc/attention_variants.h, normalised by "
        "the caller. Packed batches (cu_seqlens_q/k int32 (B + 1,), max_seqlen_q/k, seqused_q/k int32 (B,)): q "
        "(total_q, Hq, D), k/v (total_k, Hk, D), out likewise and softmax_lse (Hq, total_q). Returns (out (B, Sq, "
        "Hq, D), softmax_lse (B, Hq, Sq) float32, natural log).");
  m.def("check_packed", &check_packed, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("seqused_q"),
        py::arg("seqused_k"),
        "The checks of a packed batch's tensors and values (reads them: eager only); returns (max_seqlen_q, "
        "max_seqlen_k), computed from cu_seqlens where None.");
  m.def("built_forward_configs", &built_forward_configs,
        "Names of the forward kernel configs compiled into this module, in registry order.");
  m.def("forward_config_smem", &forward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built forward kernel config.");
}

}  // namespace glue
}  // namespace flashop

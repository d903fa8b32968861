// flashop._C's backward on the mma.sync kernels: tensors in, a kernel of the generated registry
// (bwd_registry.h) run through glue::run_backward on the current stream. The config name is chosen
// by the Python policy (flashop/dispatch.py); the glue only checks that the named kernel takes q.
//
// Compiled by the host compiler; the kernels live in csrc/cuda/instantiations/.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "bwd_registry.h"
#include "glue.h"

namespace flashop {
namespace glue {
namespace {

constexpr const char* kOp = "flashop.backward";

const BwdKernel& backward_kernel(const std::string& name) {
  return kernel_or_throw(bwd_kernels(), num_bwd_kernels(), name, kOp);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> mma_sync_backward(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& softmax_lse,
                                                        double softmax_scale, bool causal, bool deterministic,
                                                        const std::string& config, int64_t window_left,
                                                        int64_t window_right, double softcap,
                                                        const std::optional<at::Tensor>& alibi_slopes,
                                                        const std::optional<at::Tensor>& cu_seqlens_q,
                                                        const std::optional<at::Tensor>& cu_seqlens_k,
                                                        std::optional<int64_t> max_seqlen_q,
                                                        std::optional<int64_t> max_seqlen_k,
                                                        const std::optional<at::Tensor>& seqused_q,
                                                        const std::optional<at::Tensor>& seqused_k) {
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flashop: cu_seqlens_q and cu_seqlens_k must be given together");
  PackedBatch packed;
  const bool is_packed = cu_seqlens_q.has_value();
  const AttentionDims dims = is_packed ? check_packed_inputs(q, k, v, *cu_seqlens_q, *cu_seqlens_k, max_seqlen_q,
                                                             max_seqlen_k, seqused_q, seqused_k, packed)
                                       : check_forward_inputs(q, k, v);
  check_backward_inputs(dout, q, out, softmax_lse, dims, is_packed);
  const DType dt = check_cuda_inputs(q, softmax_scale, kOp, "CUDA");
  // Sinks need nothing here: softmax_lse carries them.
  const AttentionVariants variants =
      check_variants(dims, q, causal, window_left, window_right, softcap, alibi_slopes, std::nullopt);

  c10::cuda::CUDAGuard guard(q.device());
  const Device& dev = device(q.get_device(), kOp);
  TORCH_CHECK(dev.sm >= 80, "flashop.backward (CUDA): needs compute capability 8.0 or newer; ", q.device(), " is ",
              std::to_string(dev.sm / 10), ".", std::to_string(dev.sm % 10));
  const BwdKernel& kernel = backward_kernel(config);
  check_kernel_fits(kOp, config, kernel.desc.dtype, kernel.desc.headdim, kernel.smem_bytes, 80, dt, dims.headdim,
                    dev, q.device());
  return run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, dims, dev,
                      kernel.desc.block_m, kernel.desc.headdim, kernel.launch, kernel.name, variants,
                      is_packed ? &packed : nullptr);
}

namespace {


std::vector<std::string> built_backward_configs() { return kernel_names(bwd_kernels(), num_bwd_kernels()); }

int64_t backward_config_smem(const std::string& name) {
  return static_cast<int64_t>(backward_kernel(name).smem_bytes);
}

}  // namespace

void bind_backward(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("backward", &mma_sync_backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("softmax_lse"), py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic"),
        py::arg("config"), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("cu_seqlens_q") = py::none(),
        py::arg("cu_seqlens_k") = py::none(), py::arg("max_seqlen_q") = py::none(),
        py::arg("max_seqlen_k") = py::none(), py::arg("seqused_q") = py::none(), py::arg("seqused_k") = py::none(),
        "FlashAttention backward on CUDA (mma.sync kernels). dout/q/out (B, Sq, Hq, D), k/v (B, Sk, Hk, D), "
        "softmax_lse (B, Hq, Sq) float32 (natural log), fp16/bf16. deterministic: bit-identical dq run to run "
        "(key tiles add to dq in a fixed order). config: a name from built_backward_configs(). "
        "window_left/window_right, softcap, alibi_slopes, packed batches: as forward's. Returns (dq, dk, dv), contiguous, in q's "
        "dtype.");
  m.def("built_backward_configs", &built_backward_configs,
        "Names of the backward kernel configs compiled into this module, in registry order.");
  m.def("backward_config_smem", &backward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built backward kernel config.");
}

}  // namespace glue
}  // namespace flashop

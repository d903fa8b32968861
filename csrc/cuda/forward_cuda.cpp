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

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           double softmax_scale, bool causal, const std::string& config,
                                           int64_t window_left, int64_t window_right, double softcap,
                                           const std::optional<at::Tensor>& alibi_slopes,
                                           const std::optional<at::Tensor>& sinks) {
  const AttentionDims dims = check_forward_inputs(q_in, k_in, v_in);
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
  if (allocate_forward_outputs(q_in, dims, out, lse, sinks)) return {out, lse};
  check_forward_sizes(dims, "CUDA");

  // A negative scale is folded into q: the kernel's scale * q.k is still the user's score, which
  // softcap and ALiBi act on (make_fwd_params).
  double scale = softmax_scale;
  const at::Tensor q = readable(fold_scale_into_q(q_in, scale), kSm80FwdStrides);
  const at::Tensor k = readable(k_in, kSm80FwdStrides);
  const at::Tensor v = readable(v_in, kSm80FwdStrides);
  const FwdParams p = make_fwd_params(q, k, v, out, lse, dims, scale, causal, variants);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const cudaError_t err = kernel.launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  return {out, lse};
}

std::vector<std::string> built_forward_configs() { return kernel_names(fwd_kernels(), num_fwd_kernels()); }

int64_t forward_config_smem(const std::string& name) { return static_cast<int64_t>(forward_kernel(name).smem_bytes); }

}  // namespace

void bind_forward(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("config"), py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
        "FlashAttention forward on CUDA (mma.sync kernels). q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), fp16/bf16. "
        "config: a name from built_forward_configs(). window_left/window_right (-1: unbounded), softcap (0: off), "
        "alibi_slopes (float32 (Hq,) or (B, Hq)), sinks (float32 (Hq,)): csrc/attention_variants.h, normalised by "
        "the caller. Returns (out (B, Sq, Hq, D), softmax_lse (B, Hq, Sq) float32, natural log).");
  m.def("built_forward_configs", &built_forward_configs,
        "Names of the forward kernel configs compiled into this module, in registry order.");
  m.def("forward_config_smem", &forward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built forward kernel config.");
}

}  // namespace glue
}  // namespace flashop

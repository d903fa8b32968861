// CUDA glue of flashop::backward: tensors in, BwdParams out, a registry kernel
// launched on the current stream. Knows nothing of tiles: which backward
// kernels exist, their shared memory and head dimension come from the
// generated registry (csrc/cuda/bwd_registry.h); the config name is chosen by
// the Python policy (an empty name takes the first built kernel that fits).
//
// Compiled by the host compiler; the kernels live in csrc/cuda/instantiations/.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "bwd_config.h"
#include "bwd_glue.h"
#include "bwd_params.h"
#include "bwd_registry.h"

namespace flashop {

// Empty registry for a build that compiles this file without the generated
// registry_bwd.cu (tools/gen_bwd_kernels.py): weak, so the generated strong
// definitions win at link time whenever they are there.
__attribute__((weak)) const BwdKernel* bwd_kernels() { return nullptr; }
__attribute__((weak)) int num_bwd_kernels() { return 0; }

namespace {

using bwd_glue::BwdDevice;
using bwd_glue::bwd_device;

std::string built_backward_list() {
  std::ostringstream os;
  for (int i = 0; i < num_bwd_kernels(); ++i) os << (i ? ", " : "") << bwd_kernels()[i].name;
  return num_bwd_kernels() ? os.str() : std::string("(none)");
}

DType bwd_dtype_code(at::ScalarType t) { return t == at::kHalf ? DType::kFp16 : DType::kBf16; }

const BwdKernel& pick_kernel(const std::string& config, DType dt, int64_t D, const BwdDevice& dev,
                             const at::Device& device) {
  if (config.empty()) {
    bool any_headdim = false;
    for (int i = 0; i < num_bwd_kernels(); ++i) {
      const BwdKernel& k = bwd_kernels()[i];
      if (k.desc.dtype != dt || k.desc.headdim != D) continue;
      any_headdim = true;
      if (static_cast<long long>(k.smem_bytes) <= dev.smem_optin) return k;
    }
    TORCH_CHECK(false, "flashop.backward (CUDA): no built ", dtype_name(dt), " backward kernel ",
                any_headdim ? "fits this device" : "for head dimension " + std::to_string(D),
                "; built configs: ", built_backward_list());
  }
  const BwdKernel* k = find_bwd_kernel(config);
  TORCH_CHECK(k != nullptr, "flashop.backward: unknown kernel config '", config, "'; built configs: ",
              built_backward_list());
  TORCH_CHECK(k->desc.dtype == dt, "flashop.backward: kernel config '", config, "' is for ",
              dtype_name(k->desc.dtype), " but q is ", dtype_name(dt));
  TORCH_CHECK(k->desc.headdim == D, "flashop.backward: kernel config '", config, "' is for head dimension ",
              k->desc.headdim, " but q has head dimension ", D);
  TORCH_CHECK(static_cast<long long>(k->smem_bytes) <= dev.smem_optin, "flashop.backward: kernel config '",
              config, "' needs ", k->smem_bytes, " bytes of shared memory per block; ", device, " allows ",
              dev.smem_optin);
  return *k;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                             const at::Tensor& k_in, const at::Tensor& v_in,
                                                             const at::Tensor& out_in,
                                                             const at::Tensor& softmax_lse, double softmax_scale,
                                                             bool causal, bool deterministic,
                                                             const std::string& config) {
  const AttentionDims dims = check_forward_inputs(q_in, k_in, v_in);
  check_backward_inputs(dout_in, q_in, out_in, softmax_lse, dims);

  TORCH_CHECK(q_in.is_cuda(), "flashop.backward (CUDA): tensors must be CUDA tensors, got ", q_in.device());
  const at::ScalarType st = q_in.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16,
              "flashop.backward (CUDA): dtype must be float16 or bfloat16, got ", st);
  TORCH_CHECK(std::isfinite(softmax_scale), "flashop.backward: softmax_scale must be finite, got ", softmax_scale);
  const DType dt = bwd_dtype_code(st);
  const int64_t D = dims.headdim;

  c10::cuda::CUDAGuard guard(q_in.device());
  const BwdDevice dev = bwd_device(q_in.get_device());
  TORCH_CHECK(dev.sm >= 80, "flashop.backward (CUDA): needs compute capability 8.0 or newer; ", q_in.device(),
              " is ", dev.sm / 10, ".", dev.sm % 10);
  const BwdKernel& kernel = pick_kernel(config, dt, D, dev, q_in.device());

  return bwd_glue::run_backward(dout_in, q_in, k_in, v_in, out_in, softmax_lse, softmax_scale, causal, deterministic,
                                dims, dev, kernel.desc.block_m, kernel.launch, kernel.name);
}

std::vector<std::string> built_backward_configs() {
  std::vector<std::string> names;
  names.reserve(num_bwd_kernels());
  for (int i = 0; i < num_bwd_kernels(); ++i) names.emplace_back(bwd_kernels()[i].name);
  return names;
}

int64_t backward_config_smem(const std::string& name) {
  const BwdKernel* k = find_bwd_kernel(name);
  TORCH_CHECK(k != nullptr, "flashop.backward: unknown kernel config '", name, "'; built configs: ",
              built_backward_list());
  return static_cast<int64_t>(k->smem_bytes);
}

void register_cuda_backward_bindings(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cuda_backward", &cuda_backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("softmax_lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("deterministic"), py::arg("config"),
        "FlashAttention backward on CUDA (mma.sync kernels). dout/q/out (B, Sq, Hq, D), k/v (B, Sk, Hk, D), "
        "softmax_lse (B, Hq, Sq) float32 (natural log), fp16/bf16. deterministic: bit-identical dq run to "
        "run (key tiles add to dq in a fixed order). config: a built backward kernel name (see "
        "built_backward_configs()), or '' for the first built kernel of q's dtype and head dim that fits "
        "the device. Returns (dq, dk, dv), contiguous, in q's dtype.");
  m.def("built_backward_configs", &built_backward_configs,
        "Names of the backward kernel configs compiled into this build, in registry order.");
  m.def("backward_config_smem", &backward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built backward kernel config.");
}

}  // namespace flashop

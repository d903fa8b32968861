// CUDA glue of flashop::forward: tensors in, FwdParams out, a registry kernel
// launched on the current stream. Knows nothing of tiles: which kernels exist,
// their shared memory and head dimension come from the generated registry
// (csrc/cuda/registry.h); the config name is chosen by the Python policy.
//
// Compiled by the host compiler; the kernels live in csrc/cuda/instantiations/.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "forward_glue.h"
#include "fwd_params.h"
#include "kernel_config.h"
#include "registry.h"

namespace flashop {
namespace {

std::string built_config_list() {
  std::ostringstream os;
  for (int i = 0; i < num_fwd_kernels(); ++i) os << (i ? ", " : "") << fwd_kernels()[i].name;
  return num_fwd_kernels() ? os.str() : std::string("(none)");
}

const FwdKernel* find_kernel(const std::string& name) {
  for (int i = 0; i < num_fwd_kernels(); ++i) {
    if (name == fwd_kernels()[i].name) return &fwd_kernels()[i];
  }
  return nullptr;
}

const FwdKernel& kernel_or_throw(const std::string& name) {
  const FwdKernel* k = find_kernel(name);
  TORCH_CHECK(k != nullptr, "flashop.forward: unknown kernel config '", name,
              "'; built configs: ", built_config_list());
  return *k;
}

DType dtype_code(at::ScalarType t) {
  return t == at::kHalf ? DType::kFp16 : DType::kBf16;
}

// Per-device facts, read once: compute capability and the opt-in shared
// memory per block (227 KiB on H100, 163 KiB on A100, 99 KiB on sm86/89).
struct DeviceFacts {
  int sm;
  int smem_optin;
};

DeviceFacts device_facts(int device) {
  static std::array<std::atomic<long long>, 64> cache{};  // 0: unknown, else sm << 32 | smem
  if (device >= 0 && device < 64) {
    const long long c = cache[device].load(std::memory_order_relaxed);
    if (c != 0) return {int(c >> 32), int(c & 0xffffffff)};
  }
  int major = 0, minor = 0, smem = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: cannot query CUDA device ", device, ": ",
              cudaGetErrorString(err));
  const DeviceFacts f{major * 10 + minor, smem};
  if (device >= 0 && device < 64) {
    cache[device].store((static_cast<long long>(f.sm) << 32) | f.smem_optin,
                        std::memory_order_relaxed);
  }
  return f;
}

bool fits_device(const FwdKernel& k, const DeviceFacts& dev) {
  return dev.sm >= k.min_sm && static_cast<long long>(k.smem_bytes) <= dev.smem_optin;
}

// The kernels move 8-element (16-byte) chunks with cp.async and 16-byte
// stores, so every row of q, k, v must start on a 16-byte boundary: base
// pointer 16-byte aligned, batch/seq/head strides multiples of 8 elements,
// head dim contiguous. They also form a thread's offset inside a tile in 32
// bits, which needs a row (sequence) stride below 2^24 elements.
constexpr int64_t kMaxRowStride = int64_t(1) << 24;

bool kernel_can_read(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  if (t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  }
  return t.size(1) <= 1 || t.stride(1) < kMaxRowStride;
}

// A fresh contiguous copy (clone, not .contiguous(): a contiguous tensor at a
// misaligned storage offset must be copied too). Fresh allocations are
// 256-byte aligned and their strides are multiples of D (itself a multiple of 8).
at::Tensor readable(const at::Tensor& t) {
  return kernel_can_read(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

}  // namespace

// Public entry points live in flashop::cuda (csrc/flashop.cpp declares
// register_cuda_bindings there).
namespace cuda {

std::tuple<at::Tensor, at::Tensor> cuda_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                const at::Tensor& v_in, double softmax_scale,
                                                bool causal, const std::string& config) {
  const AttentionDims dims = check_forward_inputs(q_in, k_in, v_in);

  TORCH_CHECK(q_in.is_cuda() && k_in.is_cuda() && v_in.is_cuda(),
              "flashop.forward (CUDA): q, k and v must be CUDA tensors");
  TORCH_CHECK(k_in.device() == q_in.device() && v_in.device() == q_in.device(),
              "flashop.forward (CUDA): q, k and v must be on one device; got ", q_in.device(),
              ", ", k_in.device(), ", ", v_in.device());
  const at::ScalarType st = q_in.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16,
              "flashop.forward (CUDA): dtype must be float16 or bfloat16, got ", st);
  TORCH_CHECK(std::isfinite(softmax_scale), "flashop.forward: softmax_scale must be finite, got ",
              softmax_scale);
  const DType dt = dtype_code(st);
  const int64_t D = dims.headdim;

  c10::cuda::CUDAGuard guard(q_in.device());
  const DeviceFacts dev = device_facts(q_in.get_device());
  TORCH_CHECK(dev.sm >= 80, "flashop.forward (CUDA): needs compute capability 8.0 or newer; ",
              q_in.device(), " is ", dev.sm / 10, ".", dev.sm % 10);

  // Which kernel: the named one (it must exist and match q), or, for an empty
  // name, the first built kernel for (dtype, head dim) that fits the device.
  const FwdKernel* kernel = nullptr;
  if (config.empty()) {
    bool any_headdim = false;
    for (int i = 0; i < num_fwd_kernels() && kernel == nullptr; ++i) {
      const FwdKernel& k = fwd_kernels()[i];
      if (k.config.dtype != dt || k.config.headdim != D) continue;
      any_headdim = true;
      if (fits_device(k, dev)) kernel = &k;
    }
    if (kernel == nullptr) {
      std::ostringstream dims_built;
      for (int i = 0; i < num_fwd_kernels(); ++i) {
        const FwdKernel& k = fwd_kernels()[i];
        if (k.config.dtype == dt) dims_built << " " << k.config.headdim;
      }
      TORCH_CHECK(false, "flashop.forward (CUDA): no built ", dtype_name(dt), " kernel ",
                  any_headdim ? "fits this device" : "for head dimension " + std::to_string(D),
                  "; built ", dtype_name(dt), " head dims:", dims_built.str(),
                  "; built configs: ", built_config_list());
    }
  } else {
    kernel = &kernel_or_throw(config);
    TORCH_CHECK(kernel->config.dtype == dt, "flashop.forward: kernel config '", config, "' is for ",
                dtype_name(kernel->config.dtype), " but q is ", dtype_name(dt));
    TORCH_CHECK(kernel->config.headdim == D, "flashop.forward: kernel config '", config,
                "' is for head dimension ", kernel->config.headdim, " but q has head dimension ", D);
    TORCH_CHECK(dev.sm >= kernel->min_sm, "flashop.forward: kernel config '", config,
                "' needs compute capability ", kernel->min_sm / 10, ".", kernel->min_sm % 10);
    TORCH_CHECK(static_cast<long long>(kernel->smem_bytes) <= dev.smem_optin,
                "flashop.forward: kernel config '", config, "' needs ", kernel->smem_bytes,
                " bytes of shared memory per block; ", q_in.device(), " allows ", dev.smem_optin);
  }

  at::Tensor out, lse;
  if (allocate_forward_outputs(q_in, dims, out, lse)) return {out, lse};
  TORCH_CHECK(dims.seqlen_q < std::numeric_limits<int>::max() && dims.seqlen_k < std::numeric_limits<int>::max(),
              "flashop.forward (CUDA): sequence lengths must be below 2^31");
  TORCH_CHECK(dims.heads_q <= 65535 && dims.batch <= 65535,
              "flashop.forward (CUDA): at most 65535 heads and 65535 batch entries (grid limits); "
              "got heads ", dims.heads_q, ", batch ", dims.batch);

  double scale = softmax_scale;
  const at::Tensor q = readable(fold_scale_into_q(q_in, scale));
  const at::Tensor k = readable(k_in);
  const at::Tensor v = readable(v_in);
  const FwdParams p = make_fwd_params(q, k, v, out, lse, dims, scale, causal);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const cudaError_t err = kernel->launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel->name,
              "' failed: ", cudaGetErrorString(err));
  return {out, lse};
}

std::vector<std::string> built_forward_configs() {
  std::vector<std::string> names;
  names.reserve(num_fwd_kernels());
  for (int i = 0; i < num_fwd_kernels(); ++i) names.emplace_back(fwd_kernels()[i].name);
  return names;
}

int64_t forward_config_smem(const std::string& name) {
  return static_cast<int64_t>(kernel_or_throw(name).smem_bytes);
}

void register_cuda_bindings(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("cuda_forward", &cuda_forward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("config"),
        "FlashAttention forward on CUDA (mma.sync kernels). q (B, Sq, Hq, D), k/v (B, Sk, Hk, "
        "D), fp16/bf16. config: a built kernel name (see built_forward_configs()), or '' for "
        "the first built kernel of q's dtype and head dim that fits the device. Returns "
        "(out (B, Sq, Hq, D), softmax_lse (B, Hq, Sq) float32, natural log).");
  m.def("built_forward_configs", &built_forward_configs,
        "Names of the forward kernel configs compiled into this build, in registry order.");
  m.def("forward_config_smem", &forward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built forward kernel config.");
}

}  // namespace cuda
}  // namespace flashop

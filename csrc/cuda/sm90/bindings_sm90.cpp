// flashop._C_sm90: host glue of the Hopper (sm_90a) forward kernels. Tensors in,
// FwdParams out, a kernel from the sm90 registry launched on the current stream.
// The kernels (forward_sm90.cu) encode their TMA tensor maps from FwdParams.

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

#include "../../checks.h"
#include "../bwd_glue.h"
#include "../forward_glue.h"
#include "../fwd_params.h"
#include "registry_sm90.cuh"

namespace flashop {
namespace sm90 {
namespace {

std::string built_config_list() {
  std::ostringstream os;
  for (int i = 0; i < num_sm90_fwd_kernels(); ++i)
    os << (i ? ", " : "") << sm90_fwd_kernels()[i].name;
  return num_sm90_fwd_kernels() ? os.str() : std::string("(none)");
}

// Numbers in this module's error messages go in as strings. On the GPU machine's toolchain,
// inserting an integer into the message stream from this module crashed the process (the
// stream's number facet came from a different libstdc++ than the code using it); strings do
// not touch that facet. flashop/ops.py also validates tensors in Python before it calls here.
template <class T>
std::string num(T value) {
  return std::to_string(value);
}

const Sm90FwdKernel* find_kernel(const std::string& name) {
  for (int i = 0; i < num_sm90_fwd_kernels(); ++i)
    if (name == sm90_fwd_kernels()[i].name) return &sm90_fwd_kernels()[i];
  return nullptr;
}

// TMA needs a 16-byte aligned base and byte strides that are multiples of 16
// (element strides multiples of 8) below 2^40 bytes, with the head dim contiguous.
bool tma_can_read(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  if (t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && (t.stride(d) % 8 != 0 || t.stride(d) >= (int64_t(1) << 38))) return false;
  }
  return true;
}

at::Tensor readable(const at::Tensor& t) {
  return tma_can_read(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}


std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, double softmax_scale,
                                           bool causal, const std::string& config) {
  const AttentionDims dims = check_forward_inputs(q_in, k_in, v_in);
  TORCH_CHECK(q_in.is_cuda() && k_in.is_cuda() && v_in.is_cuda(),
              "flashop.forward (sm90): q, k and v must be CUDA tensors");
  TORCH_CHECK(k_in.device() == q_in.device() && v_in.device() == q_in.device(),
              "flashop.forward (sm90): q, k and v must be on one device; got ", q_in.device(),
              ", ", k_in.device(), ", ", v_in.device());
  const at::ScalarType st = q_in.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16,
              "flashop.forward (sm90): dtype must be float16 or bfloat16, got ", st);
  TORCH_CHECK(std::isfinite(softmax_scale),
              "flashop.forward: softmax_scale must be finite, got ", softmax_scale);
  const Sm90FwdKernel* kernel = find_kernel(config);
  TORCH_CHECK(kernel != nullptr, "flashop.forward: unknown kernel config '", config,
              "'; built configs: ", built_config_list());
  const DType dt = st == at::kHalf ? DType::kFp16 : DType::kBf16;
  TORCH_CHECK(kernel->dtype == dt, "flashop.forward: kernel config '", config, "' is for ",
              dtype_name(kernel->dtype), " but q is ", dtype_name(dt));
  TORCH_CHECK(kernel->headdim == dims.headdim, "flashop.forward: kernel config '", config,
              "' is for head dimension ", num(kernel->headdim), " but q has head dimension ",
              num(dims.headdim), "; built configs: ", built_config_list());

  c10::cuda::CUDAGuard guard(q_in.device());
  int major = 0, smem = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                           q_in.get_device());
  int minor = 0;
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q_in.get_device());
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                 q_in.get_device());
  TORCH_CHECK(err == cudaSuccess, "flashop.forward (sm90): cannot query device: ",
              cudaGetErrorString(err));
  TORCH_CHECK(major == 9 && minor == 0, "flashop.forward (sm90): kernels are built for sm_90a; ",
              q_in.device(), " is ", num(major), ".", num(minor));
  TORCH_CHECK(static_cast<long long>(kernel->smem_bytes) <= smem, "flashop.forward: kernel config '",
              config, "' needs ", num(kernel->smem_bytes), " bytes of shared memory; device allows ",
              num(smem));

  at::Tensor out, lse;
  if (allocate_forward_outputs(q_in, dims, out, lse)) return {out, lse};
  TORCH_CHECK(dims.seqlen_q < std::numeric_limits<int>::max() && dims.seqlen_k < std::numeric_limits<int>::max(),
              "flashop.forward (sm90): sequence lengths must be below 2^31");
  TORCH_CHECK(dims.heads_q <= 65535 && dims.batch <= 65535,
              "flashop.forward (sm90): at most 65535 heads and 65535 batch entries");

  double scale = softmax_scale;  // positive only: see forward_glue.h
  const at::Tensor q = readable(fold_scale_into_q(q_in, scale));
  const at::Tensor k = readable(k_in);
  const at::Tensor v = readable(v_in);
  const FwdParams p = make_fwd_params(q, k, v, out, lse, dims, scale, causal);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  // The persistent kernels' split tail, the one-tile-per-CTA kernels' split last wave and "pers.dyn" need a
  // scratch buffer (from the caching allocator: stream-ordered, so freeing it here while the kernel runs is
  // safe).
  Sm90FwdPlan plan;
  err = kernel->plan(p, &plan);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: planning kernel '", kernel->name,
              "' failed: ", cudaGetErrorString(err));
  at::Tensor workspace;
  if (plan.workspace_bytes > 0)
    workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes)}, q.options().dtype(at::kByte));
  err = kernel->launch(p, plan, plan.workspace_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.forward: launching kernel '", kernel->name,
              "' failed: ", cudaGetErrorString(err));
  return {out, lse};
}

std::vector<std::string> built_configs() {
  std::vector<std::string> names;
  for (int i = 0; i < num_sm90_fwd_kernels(); ++i) names.emplace_back(sm90_fwd_kernels()[i].name);
  return names;
}

int64_t config_smem(const std::string& name) {
  const Sm90FwdKernel* k = find_kernel(name);
  TORCH_CHECK(k != nullptr, "flashop.forward: unknown kernel config '", name,
              "'; built configs: ", built_config_list());
  return static_cast<int64_t>(k->smem_bytes);
}

// Scratch bytes a forward launch of a built config takes for these sizes on the current device (0: none;
// > 0: the persistent kernel splits its last waves' tiles, or a one-tile-per-CTA kernel its last wave; see
// forward_sm90.cu). For tests and tools.
int64_t config_workspace(const std::string& name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k,
                         int64_t heads_q, bool causal) {
  const Sm90FwdKernel* k = find_kernel(name);
  TORCH_CHECK(k != nullptr, "flashop.forward: unknown kernel config '", name,
              "'; built configs: ", built_config_list());
  TORCH_CHECK(batch > 0 && seqlen_q > 0 && seqlen_k >= 0 && heads_q > 0 && batch <= 65535 && heads_q <= 65535 &&
                  seqlen_q < std::numeric_limits<int>::max() && seqlen_k < std::numeric_limits<int>::max(),
              "config_workspace: sizes out of range");
  FwdParams p{};
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.heads_q = static_cast<int>(heads_q);
  p.headdim = k->headdim;
  p.causal = causal;
  Sm90FwdPlan plan;
  const cudaError_t err = k->plan(p, &plan);
  TORCH_CHECK(err == cudaSuccess, "config_workspace: planning '", name, "' failed: ", cudaGetErrorString(err));
  return static_cast<int64_t>(plan.workspace_bytes);
}

const Sm90BwdKernel* find_bwd_kernel(const std::string& name) {
  for (int i = 0; i < num_sm90_bwd_kernels(); ++i)
    if (name == sm90_bwd_kernels()[i].name) return &sm90_bwd_kernels()[i];
  return nullptr;
}

std::string built_bwd_list() {
  std::ostringstream os;
  for (int i = 0; i < num_sm90_bwd_kernels(); ++i) os << (i ? ", " : "") << sm90_bwd_kernels()[i].name;
  return os.str();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& softmax_lse,
                                                        double softmax_scale, bool causal, bool deterministic,
                                                        const std::string& config) {
  const AttentionDims dims = check_forward_inputs(q, k, v);
  check_backward_inputs(dout, q, out, softmax_lse, dims);
  TORCH_CHECK(q.is_cuda(), "flashop.backward (sm90): tensors must be CUDA tensors");
  const at::ScalarType st = q.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16, "flashop.backward (sm90): dtype must be float16 or bfloat16");
  TORCH_CHECK(std::isfinite(softmax_scale), "flashop.backward: softmax_scale must be finite");
  const Sm90BwdKernel* kernel = find_bwd_kernel(config);
  TORCH_CHECK(kernel != nullptr, "flashop.backward: unknown kernel config '", config, "'; built sm90 configs: ",
              built_bwd_list());
  TORCH_CHECK(!deterministic, "flashop.backward: kernel config '", config,
              "' adds dQ with atomics in any order; deterministic=True needs an mma.sync backward config (bwd.*)");
  const DType dt = st == at::kHalf ? DType::kFp16 : DType::kBf16;
  TORCH_CHECK(kernel->dtype == dt, "flashop.backward: kernel config '", config, "' is for ",
              dtype_name(kernel->dtype), " but q is ", dtype_name(dt));
  TORCH_CHECK(kernel->headdim == dims.headdim, "flashop.backward: kernel config '", config,
              "' is for head dimension ", num(kernel->headdim), " but q has head dimension ", num(dims.headdim));
  c10::cuda::CUDAGuard guard(q.device());
  const bwd_glue::BwdDevice dev = bwd_glue::bwd_device(q.get_device());
  TORCH_CHECK(dev.sm == 90, "flashop.backward (sm90): kernels are built for sm_90a; the device is ",
              num(dev.sm / 10), ".", num(dev.sm % 10));
  TORCH_CHECK(static_cast<long long>(kernel->smem_bytes) <= dev.smem_optin, "flashop.backward: kernel config '",
              config, "' needs ", num(kernel->smem_bytes), " bytes of shared memory; device allows ",
              num(dev.smem_optin));
  return bwd_glue::run_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, dims, dev,
                                kernel->block_m, kernel->launch, kernel->name);
}

std::vector<std::string> built_backward_configs() {
  std::vector<std::string> names;
  for (int i = 0; i < num_sm90_bwd_kernels(); ++i) names.emplace_back(sm90_bwd_kernels()[i].name);
  return names;
}

int64_t backward_config_smem(const std::string& name) {
  const Sm90BwdKernel* k = find_bwd_kernel(name);
  TORCH_CHECK(k != nullptr, "flashop.backward: unknown kernel config '", name, "'; built sm90 configs: ",
              built_bwd_list());
  return static_cast<int64_t>(k->smem_bytes);
}

}  // namespace
}  // namespace sm90
}  // namespace flashop

PYBIND11_MODULE(_C_sm90, m) {
  namespace py = pybind11;
  m.doc() = "flashop Hopper (sm_90a) kernels: TMA + wgmma + warp specialisation (forward, backward)";
  m.def("forward", &flashop::sm90::forward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("softmax_scale"), py::arg("causal"), py::arg("config"),
        "FlashAttention forward on sm_90a. q (B, Sq, Hq, D), k/v (B, Sk, Hk, D), fp16/bf16. "
        "config: a name from built_configs(). Returns (out (B, Sq, Hq, D), softmax_lse "
        "(B, Hq, Sq) float32, natural log).");
  m.def("built_configs", &flashop::sm90::built_configs,
        "Names of the sm90 forward kernel configs compiled into this module.");
  m.def("config_smem", &flashop::sm90::config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built sm90 config.");
  m.def("config_workspace", &flashop::sm90::config_workspace, py::arg("name"), py::arg("batch"),
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("heads_q"), py::arg("causal"),
        "Scratch bytes of a forward launch of a built sm90 config on the current device (0: none; "
        "> 0: the persistent kernel's split tail runs).");
  m.def("backward", &flashop::sm90::backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("softmax_lse"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("deterministic"), py::arg("config"),
        "FlashAttention backward on sm_90a (wgmma + TMA main kernel). Arguments and result as "
        "flashop._C.cuda_backward; config: a name from built_backward_configs(); not deterministic.");
  m.def("built_backward_configs", &flashop::sm90::built_backward_configs,
        "Names of the sm90 backward kernel configs compiled into this module.");
  m.def("backward_config_smem", &flashop::sm90::backward_config_smem, py::arg("name"),
        "Dynamic shared memory per block (bytes) of a built sm90 backward config.");
}

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
#include "bwd_params.h"
#include "bwd_registry.h"

namespace flashop {

// Empty registry for a build that compiles this file without the generated
// registry_bwd.cu (tools/gen_bwd_kernels.py): weak, so the generated strong
// definitions win at link time whenever they are there.
__attribute__((weak)) const BwdKernel* bwd_kernels() { return nullptr; }
__attribute__((weak)) int num_bwd_kernels() { return 0; }

namespace {

std::string built_backward_list() {
  std::ostringstream os;
  for (int i = 0; i < num_bwd_kernels(); ++i) os << (i ? ", " : "") << bwd_kernels()[i].name;
  return num_bwd_kernels() ? os.str() : std::string("(none)");
}

DType bwd_dtype_code(at::ScalarType t) { return t == at::kHalf ? DType::kFp16 : DType::kBf16; }

// The opt-in shared memory per block of a device (227 KiB on H100, 163 KiB on
// A100, 99 KiB on sm86/89), its compute capability and multiprocessor count.
struct BwdDevice {
  int sm;
  int smem_optin;
  int sm_count;
  int l2_bytes;
};

BwdDevice bwd_device(int device) {
  int major = 0, minor = 0, smem = 0, sms = 0, l2 = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  TORCH_CHECK(err == cudaSuccess, "flashop.backward: cannot query CUDA device ", device, ": ",
              cudaGetErrorString(err));
  return {major * 10 + minor, smem, sms, l2};
}

// The kernels move 8-element (16-byte) chunks with cp.async and 16-byte loads
// and stores, so every row of q, k, v, out and dout must start on a 16-byte
// boundary: base pointer 16-byte aligned, batch/seq/head strides multiples of
// 8 elements, head dim contiguous. Strides themselves are 64-bit in the
// kernels: no other limit.
bool kernel_can_read(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  }
  return true;
}

// A fresh contiguous copy when the kernels cannot read a tensor in place
// (clone, not .contiguous(): a contiguous tensor at a misaligned storage
// offset must be copied too). Fresh allocations are 256-byte aligned and
// their strides are multiples of D, itself a multiple of 8 for every built
// head dimension.
at::Tensor readable(const at::Tensor& t) { return kernel_can_read(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }

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
  const int64_t B = dims.batch, Sq = dims.seqlen_q, Sk = dims.seqlen_k;
  const int64_t Hq = dims.heads_q, Hk = dims.heads_k, D = dims.headdim;

  c10::cuda::CUDAGuard guard(q_in.device());
  const BwdDevice dev = bwd_device(q_in.get_device());
  TORCH_CHECK(dev.sm >= 80, "flashop.backward (CUDA): needs compute capability 8.0 or newer; ", q_in.device(),
              " is ", dev.sm / 10, ".", dev.sm % 10);
  const BwdKernel& kernel = pick_kernel(config, dt, D, dev, q_in.device());

  // Outputs: contiguous, like the inputs they are gradients of.
  at::Tensor dq = at::empty({B, Sq, Hq, D}, q_in.options());
  at::Tensor dk = at::empty({B, Sk, Hk, D}, k_in.options());
  at::Tensor dv = at::empty({B, Sk, Hk, D}, v_in.options());
  // Empty problems: no query row -> dK = dV = 0; no key -> every row saw
  // nothing and dQ = 0.
  if (B == 0 || Hq == 0 || Sq == 0 || Sk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  TORCH_CHECK(Sq <= std::numeric_limits<int>::max() - 1024 && Sk <= std::numeric_limits<int>::max() - 1024,
              "flashop.backward (CUDA): sequence lengths must be below 2^31 - 1024");
  TORCH_CHECK(Hq <= 65535 && B <= 65535,
              "flashop.backward (CUDA): at most 65535 heads and 65535 batch entries (grid limits); got heads ", Hq,
              ", batch ", B);

  // Inputs the kernels cannot read in place are copied (see kernel_can_read).
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
  const at::Tensor out = readable(out_in), dout = readable(dout_in);
  // softmax_lse is read with a unit row stride (any batch/head strides).
  const at::Tensor lse = (Sq <= 1 || softmax_lse.stride(2) == 1) ? softmax_lse : softmax_lse.contiguous();

  // Workspaces from the caching allocator; the preprocess kernel initialises
  // them (no memset). dq_accum is B*Hq*round_up(Sq,128)*D floats.
  const BwdWorkspaceSizes ws = bwd_workspace_sizes(int(B), int(Hq), int(Sq), int(D), kernel.desc.block_m,
                                                   deterministic);
  const auto f32 = q_in.options().dtype(at::kFloat);
  at::Tensor dq_accum = at::empty({static_cast<int64_t>(ws.dq_accum)}, f32);
  at::Tensor dsum = at::empty({static_cast<int64_t>(ws.dsum)}, f32);
  at::Tensor lse_log2 = at::empty({static_cast<int64_t>(ws.lse_log2)}, f32);
  at::Tensor semaphore;
  if (deterministic) semaphore = at::empty({static_cast<int64_t>(ws.dq_semaphore)}, q_in.options().dtype(at::kInt));

  BwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.dsum = dsum.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dq_semaphore = deterministic ? semaphore.data_ptr<int>() : nullptr;
  p.q_batch_stride = stride_or_zero(q, 0);
  p.q_row_stride = stride_or_zero(q, 1);
  p.q_head_stride = stride_or_zero(q, 2);
  p.k_batch_stride = stride_or_zero(k, 0);
  p.k_row_stride = stride_or_zero(k, 1);
  p.k_head_stride = stride_or_zero(k, 2);
  p.v_batch_stride = stride_or_zero(v, 0);
  p.v_row_stride = stride_or_zero(v, 1);
  p.v_head_stride = stride_or_zero(v, 2);
  p.o_batch_stride = stride_or_zero(out, 0);
  p.o_row_stride = stride_or_zero(out, 1);
  p.o_head_stride = stride_or_zero(out, 2);
  p.do_batch_stride = stride_or_zero(dout, 0);
  p.do_row_stride = stride_or_zero(dout, 1);
  p.do_head_stride = stride_or_zero(dout, 2);
  p.dq_batch_stride = dq.stride(0);
  p.dq_row_stride = dq.stride(1);
  p.dq_head_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0);
  p.dk_row_stride = dk.stride(1);
  p.dk_head_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0);
  p.dv_row_stride = dv.stride(1);
  p.dv_head_stride = dv.stride(2);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.batch = static_cast<int>(B);
  p.seqlen_q = static_cast<int>(Sq);
  p.seqlen_k = static_cast<int>(Sk);
  p.seqlen_q_rounded = ws.seqlen_q_rounded;
  p.heads_q = static_cast<int>(Hq);
  p.heads_k = static_cast<int>(Hk);
  p.head_ratio = static_cast<int>(Hq / Hk);
  p.headdim = static_cast<int>(D);
  p.num_m_blocks = ws.num_m_blocks;
  p.sm_count = dev.sm_count;
  p.l2_bytes = dev.l2_bytes;
  p.scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * 1.4426950408889634);  // log2(e)
  p.causal = causal;
  p.deterministic = deterministic;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.get_device()).stream();
  const cudaError_t err = kernel.launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.backward: launching kernel '", kernel.name, "' failed: ",
              cudaGetErrorString(err));
  return {dq, dk, dv};
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

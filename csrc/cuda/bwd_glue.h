// The backward glue shared by flashop._C (mma.sync kernels, backward_cuda.cpp) and flashop._C_sm90
// (wgmma kernels, sm90/bindings_sm90.cpp): device queries, which tensors the kernels read in place,
// and run_backward: outputs, workspaces, BwdParams and the launch of one registry kernel on the
// current stream. Knows nothing of tiles: the caller validates the arguments and picks the kernel.
// Numbers go into error messages as strings (see sm90/bindings_sm90.cpp).
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "../checks.h"
#include "bwd_params.h"

namespace flashop {
namespace bwd_glue {

// The opt-in shared memory per block of a device (227 KiB on H100, 163 KiB on
// A100, 99 KiB on sm86/89), its compute capability and multiprocessor count.
struct BwdDevice {
  int sm;
  int smem_optin;
  int sm_count;
  int l2_bytes;
};

inline BwdDevice bwd_device(int device) {
  int major = 0, minor = 0, smem = 0, sms = 0, l2 = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  TORCH_CHECK(err == cudaSuccess, "flashop.backward: cannot query CUDA device ", std::to_string(device), ": ",
              cudaGetErrorString(err));
  return {major * 10 + minor, smem, sms, l2};
}

// The kernels move 8-element (16-byte) chunks with cp.async and 16-byte loads
// and stores, so every row of q, k, v, out and dout must start on a 16-byte
// boundary: base pointer 16-byte aligned, batch/seq/head strides multiples of
// 8 elements, head dim contiguous. Strides themselves are 64-bit in the
// kernels: no other limit.
inline bool kernel_can_read(const at::Tensor& t) {
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
inline at::Tensor readable(const at::Tensor& t) { return kernel_can_read(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

inline int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }


using BwdLaunch = cudaError_t (*)(const BwdParams&, cudaStream_t);

// Gradients of validated inputs (check_forward_inputs / check_backward_inputs, CUDA, fp16/bf16,
// finite scale) through `launch`, a kernel whose query tile is block_m rows.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& softmax_lse, double softmax_scale, bool causal, bool deterministic,
    const AttentionDims& dims, const BwdDevice& dev, int block_m, BwdLaunch launch, const char* kernel_name) {
  const int64_t B = dims.batch, Sq = dims.seqlen_q, Sk = dims.seqlen_k;
  const int64_t Hq = dims.heads_q, Hk = dims.heads_k, D = dims.headdim;
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
              "flashop.backward (CUDA): at most 65535 heads and 65535 batch entries (grid limits); got heads ",
              std::to_string(Hq), ", batch ", std::to_string(B));

  // Inputs the kernels cannot read in place are copied (see kernel_can_read).
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in);
  const at::Tensor out = readable(out_in), dout = readable(dout_in);
  // softmax_lse is read with a unit row stride (any batch/head strides).
  const at::Tensor lse = (Sq <= 1 || softmax_lse.stride(2) == 1) ? softmax_lse : softmax_lse.contiguous();

  // Workspaces from the caching allocator; the preprocess kernel initialises
  // them (no memset). dq_accum is B*Hq*round_up(Sq,128)*D floats.
  const BwdWorkspaceSizes ws = bwd_workspace_sizes(int(B), int(Hq), int(Sq), int(D), block_m,
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
  const cudaError_t err = launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.backward: launching kernel '", kernel_name, "' failed: ",
              cudaGetErrorString(err));
  return {dq, dk, dv};
}

}  // namespace bwd_glue
}  // namespace flashop

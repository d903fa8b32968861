#include "glue.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>

#include "bwd_params.h"

namespace flashop {
namespace glue {
namespace {

using std::to_string;

Device query_device(int index, const char* op) {
  int major = 0, minor = 0, smem = 0, sms = 0, l2 = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, index);
  TORCH_CHECK(err == cudaSuccess, op, ": cannot query CUDA device ", to_string(index), ": ", cudaGetErrorString(err));
  return {major * 10 + minor, smem, sms, l2};
}

// A stride the kernel may use: size-1 dimensions get 0 (their stride is arbitrary).
int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }

// Batch, row and head strides of a (B, S, H, D) tensor: the inputs' through stride_or_zero, the
// outputs' (fresh, contiguous) as they are.
void input_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
  batch = stride_or_zero(t, 0);
  row = stride_or_zero(t, 1);
  head = stride_or_zero(t, 2);
}

void output_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
  batch = t.stride(0);
  row = t.stride(1);
  head = t.stride(2);
}

constexpr double kLog2e = 1.4426950408889634;

}  // namespace

const Device& device(int index, const char* op) {
  constexpr int kCached = 64;
  if (index < 0 || index >= kCached) {
    thread_local Device uncached;
    uncached = query_device(index, op);
    return uncached;
  }
  static std::array<std::once_flag, kCached> once;
  static std::array<Device, kCached> devices;
  std::call_once(once[index], [&] { devices[index] = query_device(index, op); });
  return devices[index];
}

DType check_cuda_inputs(const at::Tensor& q, double softmax_scale, const char* op, const char* backend) {
  TORCH_CHECK(q.is_cuda(), op, " (", backend, "): tensors must be CUDA tensors, got ", q.device());
  const at::ScalarType st = q.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16, op, " (", backend, "): dtype must be float16 or bfloat16, got ",
              c10::toString(st));
  TORCH_CHECK(std::isfinite(softmax_scale), op, ": softmax_scale must be finite, got ", to_string(softmax_scale));
  return st == at::kHalf ? DType::kFp16 : DType::kBf16;
}

void check_kernel_fits(const char* op, const std::string& config, DType kernel_dtype, int kernel_headdim,
                       std::size_t smem_bytes, int min_sm, DType dtype, int64_t headdim, const Device& dev,
                       const at::Device& where) {
  TORCH_CHECK(kernel_dtype == dtype, op, ": kernel config '", config, "' is for ", dtype_name(kernel_dtype),
              " but q is ", dtype_name(dtype));
  TORCH_CHECK(headdim <= kernel_headdim, op, ": kernel config '", config, "' is for head dimensions up to ",
              to_string(kernel_headdim), " but q has head dimension ", to_string(headdim));
  TORCH_CHECK(headdim % 8 == 0, op, ": the CUDA kernels take head dimensions that are multiples of 8 (16-byte rows); ",
              "got ", to_string(headdim), " (the flashop ops pad other head dimensions)");
  TORCH_CHECK(dev.sm >= min_sm, op, ": kernel config '", config, "' needs compute capability ", to_string(min_sm / 10),
              ".", to_string(min_sm % 10));
  TORCH_CHECK(static_cast<long long>(smem_bytes) <= dev.smem_optin, op, ": kernel config '", config, "' needs ",
              to_string(smem_bytes), " bytes of shared memory per block; ", where, " allows ",
              to_string(dev.smem_optin));
}

void throw_unknown_config(const char* op, const std::string& name, const std::vector<std::string>& built) {
  std::string list;
  for (const std::string& b : built) list += (list.empty() ? "" : ", ") + b;
  TORCH_CHECK(false, op, ": unknown kernel config '", name, "'; built configs: ", list);
}

bool kernel_can_read(const at::Tensor& t, StrideLimits limits) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) <= 1) continue;
    if (t.stride(d) % 8 != 0 || t.stride(d) >= limits.any) return false;
    if (d == 1 && t.stride(d) >= limits.row) return false;
  }
  return true;
}

at::Tensor readable(const at::Tensor& t, StrideLimits limits) {
  return kernel_can_read(t, limits) ? t : t.clone(at::MemoryFormat::Contiguous);
}

AttentionDims check_packed_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                                  const std::optional<at::Tensor>& seqused_q,
                                  const std::optional<at::Tensor>& seqused_k, PackedBatch& packed) {
  const AttentionDims dims = check_varlen_inputs(q, k, v, {cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k});
  check_varlen_values(cu_seqlens_q, "cu_seqlens_q", dims.seqlen_q, max_seqlen_q, "max_seqlen_q", seqused_q,
                      "seqused_q");
  check_varlen_values(cu_seqlens_k, "cu_seqlens_k", dims.seqlen_k, max_seqlen_k, "max_seqlen_k", seqused_k,
                      "seqused_k");
  auto longest = [](const at::Tensor& cu) -> int64_t {
    return cu.size(0) < 2 ? 0 : (cu.narrow(0, 1, cu.size(0) - 1) - cu.narrow(0, 0, cu.size(0) - 1)).max().item<int64_t>();
  };
  packed.cu_seqlens_q = cu_seqlens_q.contiguous();
  packed.cu_seqlens_k = cu_seqlens_k.contiguous();
  packed.seqused_q = seqused_q.has_value() ? std::optional<at::Tensor>(seqused_q->contiguous()) : std::nullopt;
  packed.seqused_k = seqused_k.has_value() ? std::optional<at::Tensor>(seqused_k->contiguous()) : std::nullopt;
  packed.max_seqlen_q = max_seqlen_q.has_value() ? *max_seqlen_q : longest(packed.cu_seqlens_q);
  packed.max_seqlen_k = max_seqlen_k.has_value() ? *max_seqlen_k : longest(packed.cu_seqlens_k);
  TORCH_CHECK(dims.seqlen_q < std::numeric_limits<int>::max() - 1024 &&
                  dims.seqlen_k < std::numeric_limits<int>::max() - 1024,
              "flashop (CUDA): a packed batch must have fewer than 2^31 - 1024 tokens");
  // A max_seqlen above the tokens sizes the grid only; the tokens bound every sequence.
  packed.max_seqlen_q = std::min(packed.max_seqlen_q, dims.seqlen_q);
  packed.max_seqlen_k = std::min(packed.max_seqlen_k, dims.seqlen_k);
  return dims;
}

PackedSequences packed_sequences(const PackedBatch& packed, int64_t total_q, int64_t total_k) {
  PackedSequences s;
  s.cu_seqlens_q = packed.cu_seqlens_q.const_data_ptr<int32_t>();
  s.cu_seqlens_k = packed.cu_seqlens_k.const_data_ptr<int32_t>();
  s.seqused_q = packed.seqused_q.has_value() ? packed.seqused_q->const_data_ptr<int32_t>() : nullptr;
  s.seqused_k = packed.seqused_k.has_value() ? packed.seqused_k->const_data_ptr<int32_t>() : nullptr;
  s.total_q = static_cast<int>(total_q);
  s.total_k = static_cast<int>(total_k);
  return s;
}

AttentionDims packed_kernel_dims(const AttentionDims& dims, const PackedBatch& packed) {
  AttentionDims d = dims;
  d.seqlen_q = packed.max_seqlen_q;
  d.seqlen_k = packed.max_seqlen_k;
  return d;
}

void set_packed(FwdParams& p, const PackedSequences& seqs) {
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = p.lse_batch_stride = 0;
  p.packed = seqs;
}

void set_packed(BwdParams& p, const PackedSequences& seqs) {
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = p.do_batch_stride = 0;
  p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = p.lse_batch_stride = 0;
  p.packed = seqs;
}

bool allocate_forward_outputs(const at::Tensor& q, const AttentionDims& dims, at::Tensor& out, at::Tensor& lse,
                              const std::optional<at::Tensor>& sinks) {
  out = at::empty({dims.batch, dims.seqlen_q, dims.heads_q, dims.headdim}, q.options());
  lse = at::empty({dims.batch, dims.heads_q, dims.seqlen_q}, q.options().dtype(at::kFloat));
  if (dims.batch == 0 || dims.heads_q == 0 || dims.seqlen_q == 0) return true;
  if (dims.seqlen_k == 0) {
    out.zero_();
    if (sinks.has_value()) {
      lse.copy_(sinks->to(at::kFloat).view({1, dims.heads_q, 1}).expand_as(lse));
    } else {
      lse.fill_(-std::numeric_limits<float>::infinity());
    }
    return true;
  }
  return false;
}

at::Tensor fold_scale_into_q(const at::Tensor& q, double& scale) {
  at::Tensor folded = q;
  if (scale < 0) {
    folded = q.neg();
    scale = -scale;
  }
  if (scale < static_cast<double>(std::numeric_limits<float>::min())) {
    scale = static_cast<double>(std::numeric_limits<float>::min());
  }
  return folded;
}

void check_forward_sizes(const AttentionDims& dims, const char* backend) {
  TORCH_CHECK(dims.seqlen_q < std::numeric_limits<int>::max() && dims.seqlen_k < std::numeric_limits<int>::max(),
              "flashop.forward (", backend, "): sequence lengths must be below 2^31");
  TORCH_CHECK(dims.heads_q <= 65535 && dims.batch <= 65535, "flashop.forward (", backend,
              "): at most 65535 heads and 65535 batch entries (grid limits); got heads ", to_string(dims.heads_q),
              ", batch ", to_string(dims.batch));
}

FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          at::Tensor& lse, const AttentionDims& dims, double scale, bool causal,
                          const AttentionVariants& variants) {
  FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  input_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  input_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  input_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  output_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  p.lse_batch_stride = lse.stride(0);
  p.lse_head_stride = lse.stride(1);
  p.batch = static_cast<int>(dims.batch);
  p.seqlen_q = static_cast<int>(dims.seqlen_q);
  p.seqlen_k = static_cast<int>(dims.seqlen_k);
  p.heads_q = static_cast<int>(dims.heads_q);
  p.heads_k = static_cast<int>(dims.heads_k);
  p.head_ratio = static_cast<int>(dims.heads_q / dims.heads_k);
  p.head_ratio_magic = fwd_head_ratio_magic(p.head_ratio);
  p.headdim = static_cast<int>(dims.headdim);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * kLog2e);
  p.causal = causal;
  p.variants = variants;
  if (causal) {  // the contract's (-1, 0) window, also for callers that pass no variants
    p.variants.window_left = -1;
    p.variants.window_right = 0;
  }
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& softmax_lse, double softmax_scale, bool causal, bool deterministic,
    const AttentionDims& dims, const Device& dev, int block_m, int tile_width, BwdLaunch launch,
    const char* kernel_name, const AttentionVariants& variants, const PackedBatch* packed, BwdPlan plan) {
  // Packed: B sequences of at most Sq / Sk rows (the kernels' grid) in tensors of total_q / total_k rows.
  const int64_t B = dims.batch, Sq = packed ? packed->max_seqlen_q : dims.seqlen_q;
  const int64_t Sk = packed ? packed->max_seqlen_k : dims.seqlen_k;
  const int64_t total_q = dims.seqlen_q, total_k = dims.seqlen_k;
  const int64_t Hq = dims.heads_q, Hk = dims.heads_k, D = dims.headdim;
  // Outputs: contiguous, like the inputs they are gradients of.
  at::Tensor dq = packed ? at::empty({total_q, Hq, D}, q_in.options()) : at::empty({B, Sq, Hq, D}, q_in.options());
  at::Tensor dk = packed ? at::empty({total_k, Hk, D}, k_in.options()) : at::empty({B, Sk, Hk, D}, k_in.options());
  at::Tensor dv = packed ? at::empty({total_k, Hk, D}, v_in.options()) : at::empty({B, Sk, Hk, D}, v_in.options());
  // Empty problems: no query row -> dK = dV = 0; no key -> every row saw nothing and dQ = 0.
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
              to_string(Hq), ", batch ", to_string(B));

  // Inputs the kernels cannot read in place are copied (see kernel_can_read).
  // Packed tensors are seen as one batch entry, (1, total, H, D), and their lse as (1, Hq, total_q).
  auto rows = [&](const at::Tensor& t) { return packed ? as_batch1(t) : t; };
  const at::Tensor q = readable(rows(q_in), kSm80BwdStrides), k = readable(rows(k_in), kSm80BwdStrides);
  const at::Tensor v = readable(rows(v_in), kSm80BwdStrides);
  const at::Tensor out = readable(rows(out_in), kSm80BwdStrides), dout = readable(rows(dout_in), kSm80BwdStrides);
  const at::Tensor lse_in = packed ? softmax_lse.unsqueeze(0) : softmax_lse;
  // softmax_lse is read with a unit row stride (any batch/head strides).
  const at::Tensor lse = (lse_in.size(2) <= 1 || lse_in.stride(2) == 1) ? lse_in : lse_in.contiguous();

  // Workspaces from the caching allocator; the preprocess kernel initialises them (no memset).
  // dq_accum is B*Hq*round_up(Sq,128)*W floats: the kernels index its rows with their tile width W
  // (>= D, checked by check_kernel_fits), so that their dQ adds need no column predicate.
  TORCH_CHECK(D <= tile_width, "flashop.backward (CUDA): head dimension ", to_string(D), " exceeds the kernel's tile "
              "width ", to_string(tile_width));
  const BwdWorkspaceSizes ws = bwd_workspace_sizes(int(B), int(Hq), int(Sq), tile_width, block_m, deterministic,
                                                   packed ? int(total_q) : -1);
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
  input_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
  input_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
  input_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  input_strides(out, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  input_strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
  output_strides(rows(dq), p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
  output_strides(rows(dk), p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
  output_strides(rows(dv), p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
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
  p.scale_log2 = static_cast<float>(softmax_scale * kLog2e);
  p.causal = causal;
  p.variants = variants;
  if (causal) {  // the contract's (-1, 0) window, also for callers that pass no variants
    p.variants.window_left = -1;
    p.variants.window_right = 0;
  }
  p.deterministic = deterministic;
  if (packed) set_packed(p, packed_sequences(*packed, total_q, total_k));
  at::Tensor plan_workspace;
  if (plan != nullptr) {
    const std::size_t floats = plan(p);
    if (floats > 0) {
      plan_workspace = at::empty({static_cast<int64_t>(floats)}, f32);
      p.dkv_tail = plan_workspace.data_ptr<float>();
    }
  }

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.get_device()).stream();
  const cudaError_t err = launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "flashop.backward: launching kernel '", kernel_name, "' failed: ",
              cudaGetErrorString(err));
  return {dq, dk, dv};
}

}  // namespace glue
}  // namespace flashop

// The host glue of both CUDA extension modules, flashop._C (mma.sync kernels: forward_cuda.cpp,
// backward_cuda.cpp) and flashop._C_sm90 (wgmma + TMA kernels: sm90/bindings_sm90.cpp): the device
// query, the argument checks every CUDA kernel shares, the lookup of a kernel in a registry by config
// name, which tensors a kernel reads in place, and the params structs filled from tensors. Knows
// tensors and registries, not tiles. glue.cpp is compiled into both modules.
//
// Numbers go into error messages as strings (std::to_string): sm90/bindings_sm90.cpp says why.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "fwd_config.h"
#include "bwd_params.h"
#include "fwd_params.h"
#include "kernel_entry.h"

namespace flashop {
namespace glue {

// What the glue needs to know of a device: compute capability (major * 10 + minor), the opt-in
// shared memory per block (227 KiB on H100, 163 KiB on A100, 99 KiB on sm86/89), the
// multiprocessor count and the L2 size (the backward's block order uses both). Read once per device.
struct Device {
  int sm;
  int smem_optin;
  int sm_count;
  int l2_bytes;
};

// `op` ("flashop.forward", "flashop.backward") names the operator in the error message.
const Device& device(int index, const char* op);

// The checks every CUDA kernel adds to check_forward_inputs / check_backward_inputs: q on a CUDA
// device, fp16 or bf16, a finite scale. Returns q's dtype. `backend` ("CUDA", "sm90") goes into the
// messages.
DType check_cuda_inputs(const at::Tensor& q, double softmax_scale, const char* op, const char* backend);

// A kernel config named explicitly must take q's dtype, be at least as wide as q's head dimension (a
// kernel of tile width W takes every head dimension up to W that is a multiple of 8), run on the
// device's compute capability (min_sm) and fit its shared memory.
void check_kernel_fits(const char* op, const std::string& config, DType kernel_dtype, int kernel_headdim,
                       std::size_t smem_bytes, int min_sm, DType dtype, int64_t headdim, const Device& dev,
                       const at::Device& where);

// ---------------------------------------------------------------- registry lookup
// A registry is an array of entries with a `name` (fwd_registry.h, bwd_registry.h,
// sm90/registry_sm90.cuh).

template <class Kernel>
const Kernel* find_kernel(const Kernel* table, int n, const std::string& name) {
  for (int i = 0; i < n; ++i)
    if (name == table[i].name) return &table[i];
  return nullptr;
}

template <class Kernel>
std::vector<std::string> kernel_names(const Kernel* table, int n) {
  std::vector<std::string> names;
  names.reserve(n);
  for (int i = 0; i < n; ++i) names.emplace_back(table[i].name);
  return names;
}

// "unknown kernel config" with the list of built configs.
[[noreturn]] void throw_unknown_config(const char* op, const std::string& name, const std::vector<std::string>& built);

template <class Kernel>
const Kernel& kernel_or_throw(const Kernel* table, int n, const std::string& name, const char* op) {
  const Kernel* k = find_kernel(table, n, name);
  if (k == nullptr) throw_unknown_config(op, name, kernel_names(table, n));
  return *k;
}

// ---------------------------------------------------------------- tensors the kernels read
// Every kernel moves 8-element (16-byte) chunks (cp.async, TMA, 16-byte loads and stores), so each
// row of q, k, v (out, dout) must start on a 16-byte boundary: base pointer 16-byte aligned,
// batch/seq/head strides multiples of 8 elements, head dim contiguous. On top of that a kernel
// family may bound the strides (in elements): the row (sequence) stride, and every stride.
struct StrideLimits {
  int64_t row;  // dimension 1
  int64_t any;  // dimensions 0, 1, 2
};
constexpr int64_t kNoStrideLimit = std::numeric_limits<int64_t>::max();
// The sm80 forward forms a thread's offset inside a tile in 32 bits.
constexpr StrideLimits kSm80FwdStrides{int64_t(1) << 24, kNoStrideLimit};
// The sm80 backward keeps 64-bit strides.
constexpr StrideLimits kSm80BwdStrides{kNoStrideLimit, kNoStrideLimit};
// TMA: byte strides below 2^40.
constexpr StrideLimits kTmaStrides{kNoStrideLimit, int64_t(1) << 38};

bool kernel_can_read(const at::Tensor& t, StrideLimits limits);

// t itself when the kernel can read it, else a fresh contiguous copy (clone, not .contiguous(): a
// contiguous tensor at a misaligned storage offset must be copied too). Fresh allocations are
// 256-byte aligned and their strides are multiples of D, itself a multiple of 8 for every built
// head dimension.
at::Tensor readable(const at::Tensor& t, StrideLimits limits);

// ---------------------------------------------------------------- packed batches

// A packed batch's index tensors and maximum lengths (flashop.forward's cu_seqlens_q/k, max_seqlen_q/k,
// seqused_q/k).
struct PackedBatch {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  std::optional<at::Tensor> seqused_q, seqused_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
};

// The rules of csrc/checks.cpp for a packed batch: the tensors (check_varlen_inputs), then the values
// (check_varlen_values; the glue runs in eager mode only, the fakes are in flashop/meta.py). A maximum
// length not given is read from cu_seqlens. Returns the dims of check_varlen_inputs (batch = sequences,
// seqlen_q / seqlen_k = tokens) and fills `packed`.
AttentionDims check_packed_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                                  const std::optional<at::Tensor>& seqused_q,
                                  const std::optional<at::Tensor>& seqused_k, PackedBatch& packed);

// What the kernels read of a packed batch (csrc/packed_sequences.h), tokens total_q / total_k.
PackedSequences packed_sequences(const PackedBatch& packed, int64_t total_q, int64_t total_k);

// The dims the kernels take for a packed batch: batch = sequences, seqlen_q / seqlen_k = the maximum
// lengths (they size the grid).
AttentionDims packed_kernel_dims(const AttentionDims& dims, const PackedBatch& packed);

// A packed (total, H, D) tensor as the (1, total, H, D) the kernels' params are filled from (the batch
// stride of a size-1 dimension is 0 for the inputs; the params' batch strides are set to 0 for all).
inline at::Tensor as_batch1(const at::Tensor& t) { return t.unsqueeze(0); }

// Sets every batch stride of packed params to 0 and their packed member (fwd and bwd params alike).
void set_packed(FwdParams& p, const PackedSequences& seqs);
void set_packed(BwdParams& p, const PackedSequences& seqs);

// ---------------------------------------------------------------- forward

// Allocates out (B, Sq, Hq, D) and lse (B, Hq, Sq). Returns true when the problem is empty and
// they are already final: no query rows, or no keys (every row sees nothing: 0 and -inf, or the
// row's sink when `sinks` (heads_q,) is given).
bool allocate_forward_outputs(const at::Tensor& q, const AttentionDims& dims, at::Tensor& out, at::Tensor& lse,
                              const std::optional<at::Tensor>& sinks = std::nullopt);

// The forward kernels keep a running max of raw scores, so they assume a positive scale. A negative
// scale is folded into q ((-q) k^T |s| == q k^T s); a zero scale (uniform attention) becomes the
// smallest normal float, which gives the same probabilities to float precision and keeps -inf masks
// from turning into 0 * -inf = NaN. Returns the q to use; updates `scale`.
at::Tensor fold_scale_into_q(const at::Tensor& q, double& scale);

// The checks a non-empty forward problem must pass before its params are filled (int sizes, grid).
void check_forward_sizes(const AttentionDims& dims, const char* backend);

// FwdParams from tensors the kernel can read (see readable). `scale` is the kernel's (after
// fold_scale_into_q): the variants are in the units of the user's scale, and scale * q.k with the
// folded q and scale is the user's score, so they need no change.
FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                          at::Tensor& lse, const AttentionDims& dims, double scale, bool causal,
                          const AttentionVariants& variants = AttentionVariants{});

// ---------------------------------------------------------------- backward

using BwdLaunch = cudaError_t (*)(const BwdParams&, cudaStream_t);
// A kernel's plan of a call: sets its parts of the params and returns the workspace floats they need
// (BwdParams::dkv_tail; the Hopper kernels' tail split), 0 for none.
using BwdPlan = std::size_t (*)(BwdParams&);

// Gradients of validated inputs (check_forward_inputs / check_backward_inputs, check_cuda_inputs;
// packed: check_packed_inputs, dims its result, q/k/v/out/dout (total, H, D), softmax_lse (Hq, total_q))
// through `launch`, a kernel whose query tile is block_m rows and whose tile width (the config name's
// d<W>, >= the true head dimension) is tile_width: outputs, workspaces, BwdParams and the launch on
// the current stream; `plan`, when given, before the launch.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, double softmax_scale, bool causal, bool deterministic, const AttentionDims& dims,
    const Device& dev, int block_m, int tile_width, BwdLaunch launch, const char* kernel_name,
    const AttentionVariants& variants = AttentionVariants{}, const PackedBatch* packed = nullptr,
    BwdPlan plan = nullptr);

// ---------------------------------------------------------------- flashop._C's kernels

// The mma.sync forward and backward (forward_cuda.cpp, backward_cuda.cpp; also flashop._C.forward/backward).
ForwardEntry mma_sync_forward;
BackwardEntry mma_sync_backward;

// The split-KV decode kernels (decode_cuda.cpp): whether they run q (B, Sq, Hq, D) over caches (B, Sk, Hk, D),
// and the forward over them (the window normalised; key_begin/key_end, cache_batch_idx and block_table as
// csrc/cuda/decode/decode_params.h has them; out written in place when given).
bool decode_supported(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache);
std::tuple<at::Tensor, at::Tensor> decode_forward(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const OptTensor& key_begin,
    const OptTensor& key_end, int64_t key_end_offset, const OptTensor& cache_batch_idx, const OptTensor& block_table, double softmax_scale,
    int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    int64_t num_splits, const OptTensor& out);

}  // namespace glue
}  // namespace flashop

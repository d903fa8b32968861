// The tables of compiled sm_90a kernels: forward (forward_sm90.cu) and backward (backward_sm90.cu).
// Plain C++ (no device code): bindings_sm90.cpp includes it with the host compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../bwd_params.h"
#include "../fwd_params.h"
#include "../kernel_config.h"

namespace flashop {
namespace sm90 {

// How one forward launch of a config runs for given sizes on the current device, worked out once per
// launch by the config's `plan` and carried out by its `launch`: the grid, whether CTAs pair up in clusters,
// the split schedule, and the scratch buffer it takes.
struct Sm90FwdPlan {
  dim3 grid{1, 1, 1};
  bool cluster_pairs = false;  // multicast configs: clusters of two CTAs
  // The split tail (persistent) or split last wave (one tile per CTA); the FwdParams fields of those names.
  bool stream_k = false;
  int stream_k_tile0 = 0;
  int split_tiles = 0;
  int split_pieces = 0;
  // Scratch bytes (0: none), and the byte range of it that must be zero when the kernel starts (flags,
  // counters; launch clears it on the stream, so it holds inside a CUDA graph too).
  std::size_t workspace_bytes = 0;
  std::size_t zero_offset = 0;
  std::size_t zero_bytes = 0;
};

struct Sm90FwdKernel {
  const char* name;  // e.g. "sm90.bf16.d128.br128.bc128", "sm90.bf16.d128.br128.bc128.pers"
  // The launch's plan for these params (persistent configs: one CTA per SM of the current device);
  // cudaErrorInvalidValue for params the config does not take.
  cudaError_t (*plan)(const FwdParams&, Sm90FwdPlan*);
  // Encodes the q/k/v (and, for the TMA-store configs, o) tensor maps from the params (pointers, sizes,
  // strides), sets the shared-memory opt-in and launches `plan` on `stream`; returns the status.
  // Needs: 16-byte aligned base pointers, strides (in bytes) multiples of 16, and a device buffer of
  // plan.workspace_bytes bytes when that is not 0 (the persistent kernels' split tail, the one-tile-per-CTA
  // kernels' split last wave, the "pers.dyn" tile counter).
  cudaError_t (*launch)(const FwdParams&, const Sm90FwdPlan&, void* workspace, cudaStream_t);
  DType dtype;
  int headdim;
  int block_m;
  int block_n;
  std::size_t smem_bytes;
  int threads;
};

const Sm90FwdKernel* sm90_fwd_kernels();
int num_sm90_fwd_kernels();

struct Sm90BwdKernel {
  const char* name;  // "sm90.bwd.<dtype>.d128.bc128.br64"
  // Preprocess, main and dQ conversion kernels on `stream`, from params filled by the backward glue
  // (csrc/cuda/bwd_glue.h); cudaErrorInvalidValue for arguments the kernel does not take
  // (another head dimension, deterministic mode).
  cudaError_t (*launch)(const BwdParams&, cudaStream_t);
  DType dtype;
  int headdim;
  int block_m;
  int block_n;
  std::size_t smem_bytes;
};

const Sm90BwdKernel* sm90_bwd_kernels();
int num_sm90_bwd_kernels();

}  // namespace sm90
}  // namespace flashop

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

struct Sm90FwdKernel {
  const char* name;  // e.g. "sm90.bf16.d128.br128.bc128", "sm90.bf16.d128.br128.bc128.pers"
  // Encodes the q/k/v (and, for the TMA-store configs, o) tensor maps from the
  // params (pointers, sizes, strides), sets the shared-memory opt-in, launches
  // on `stream` (persistent configs: one CTA per SM of the current device);
  // returns the status.
  // Needs: 16-byte aligned base pointers, strides (in bytes) multiples of 16, and a device buffer of
  // workspace_bytes(params) bytes when that is not 0 (the persistent kernels' split tail, the
  // one-tile-per-CTA kernels' split last wave, the "pers.dyn" tile counter).
  cudaError_t (*launch)(const FwdParams&, void* workspace, cudaStream_t);
  std::size_t (*workspace_bytes)(const FwdParams&);
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

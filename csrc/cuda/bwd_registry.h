// The built backward kernels: one entry per generated instantiation
// (tools/codegen.py writes registry_bwd.cu defining the table).
// Host-only header: the glue includes it without pulling in any kernel code.
#pragma once

#include <cuda_runtime_api.h>  // cudaError_t, cudaStream_t

#include <cstddef>

#include "bwd_config.h"
#include "bwd_params.h"

namespace flashop {

namespace sm80 {
// Defined in sm80/bwd_kernel.cuh; instantiated once per config.
template <class Cfg>
cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream);
}  // namespace sm80

struct BwdKernel {
  const char* name;  // short form, e.g. "bwd.bf16.d128.br64.bc128.w8"
  BwdConfigDesc desc;
  cudaError_t (*launch)(const BwdParams&, cudaStream_t);
  std::size_t smem_bytes;  // dynamic shared memory of the main kernel
};

// All built backward kernels (defined by the generated registry_bwd.cu).
const BwdKernel* bwd_kernels();
int num_bwd_kernels();

}  // namespace flashop

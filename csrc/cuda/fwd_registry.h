// The table of compiled forward kernels. tools/codegen.py writes
// csrc/cuda/instantiations/registry_fwd.cu, which defines fwd_kernels() with
// one entry per built config, and one fwd_<config>.cu per config with the
// explicit instantiation of sm80::launch_fwd. The glue looks kernels up here
// by name; it never sees a template.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "fwd_params.h"
#include "fwd_config.h"

namespace flashop {

struct FwdKernel {
  const char* name;  // short form, e.g. "bf16.d128.br128.bc64.w4.kv2"
  // Sets the >48 KiB shared-memory opt-in on first use per device, launches
  // on `stream` and returns the launch status (cudaGetLastError).
  cudaError_t (*launch)(const FwdParams&, cudaStream_t);
  FwdConfigDesc config;  // dtype, headdim, block_m, block_n, warps, flags
  int min_sm;            // lowest compute capability (major*10 + minor) it runs on
  std::size_t smem_bytes;
  int threads;
};

// All built forward kernels (defined by the generated registry_fwd.cu).
const FwdKernel* fwd_kernels();
int num_fwd_kernels();

namespace sm80 {
// Defined in sm80/fwd_kernel.cuh; explicitly instantiated per config.
template <class Cfg>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream);
}  // namespace sm80

}  // namespace flashop

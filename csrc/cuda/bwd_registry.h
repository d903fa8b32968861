// The built backward kernels: one entry per generated instantiation
// (tools/gen_bwd_kernels.py writes registry_bwd.cu defining the table).
// Host-only header: the glue includes it without pulling in any kernel code.
#pragma once

#include <cuda_runtime_api.h>  // cudaError_t, cudaStream_t

#include <cstddef>
#include <string>

#include "bwd_config.h"
#include "bwd_params.h"

namespace flashop {

namespace sm80 {
// Defined in sm80/bwd_kernel.cuh; instantiated once per config.
template <class Cfg>
cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream);
}  // namespace sm80

struct BwdKernel {
  const char* name;  // bwd_config_name(desc)
  BwdConfigDesc desc;
  cudaError_t (*launch)(const BwdParams&, cudaStream_t);
  std::size_t smem_bytes;  // dynamic shared memory of the main kernel
};

const BwdKernel* bwd_kernels();
int num_bwd_kernels();

inline const BwdKernel* find_bwd_kernel(const std::string& name) {
  const BwdKernel* k = bwd_kernels();
  for (int i = 0, n = num_bwd_kernels(); i < n; ++i)
    if (name == k[i].name) return &k[i];
  return nullptr;
}

}  // namespace flashop

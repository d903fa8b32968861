// Kernel attributes (the opt-in to more than 48 KiB of dynamic shared memory, the shared-memory carveout) belong
// to a kernel on a device, and setting one costs host time on every call: each launcher sets them on a
// kernel's first launch on each device and remembers that in a bit per device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace flashop {

// `configured`: the launcher's own flags for this kernel (a static), one bit per device; devices 64 and up
// set the attributes on every launch. max_carveout asks for the largest shared-memory carveout too (kernels
// sized for several CTAs per SM).
template <class Kernel>
cudaError_t set_kernel_smem_once(std::atomic<unsigned long long>& configured, Kernel kernel, int smem_bytes,
                                 bool max_carveout = false) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
  if (bit != 0 && (configured.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess && max_carveout)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err == cudaSuccess) configured.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

}  // namespace flashop

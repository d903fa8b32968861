// How many clusters of 1, 2, 4 and 8 CTAs run at once on this GPU, for a CTA shaped like the Hopper
// forward's one-tile-per-CTA kernels (threads, dynamic shared memory): cudaOccupancyMaxActiveClusters.
// The split-last-wave plan (csrc/cuda/sm90/fwd_launch.cuh) assumes one CTA per SM and a cluster of 2 on
// every pair of SMs; this checks that on a new GPU.
//
//   nvcc -arch=sm_90a -o /tmp/cluster_occupancy tools/probes/cluster_occupancy.cu && /tmp/cluster_occupancy
#include <cstdio>
#include <cuda_runtime.h>

__global__ void __launch_bounds__(384, 1) probe_kernel(int* out) {
  extern __shared__ int smem[];
  if (out != nullptr) out[blockIdx.x] = smem[threadIdx.x];
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s: %d SMs\n", prop.name, sms);
  cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int threads : {256, 384}) {
    for (int smem_kib : {96, 160, 214, 226}) {
      const int smem = smem_kib * 1024;
      cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      std::printf("threads %d, shared %3d KiB:", threads, smem_kib);
      for (int size : {1, 2, 4, 8}) {
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = size;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(size * 1024);
        config.blockDim = dim3(threads);
        config.dynamicSmemBytes = smem;
        config.attrs = &attr;
        config.numAttrs = 1;
        int clusters = -1;
        cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, probe_kernel, &config);
        std::printf("  size %d: %d clusters (%d CTAs)%s", size, clusters, clusters * size,
                    err == cudaSuccess ? "" : cudaGetErrorString(err));
      }
      std::printf("\n");
    }
  }
  return 0;
}

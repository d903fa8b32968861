// The decode kernels' instantiations and launcher (decode_kernel.cuh): fp16 and bf16 at tile widths 64, 128
// and 256 (a headdim up to the width, a multiple of 8), up to 8 query rows per KV head.
#include <atomic>

#include "../kernel_attributes.h"
#include "decode.h"
#include "decode_kernel.cuh"

namespace flashop {
namespace decode {
namespace {

static_assert(kMaxRows == kRowsPerGroup, "the launcher's row limit is the kernel's mma width");
static_assert(kMaxSplits <= kThreads, "the combine kernel weighs one split per thread");

// Dynamic shared memory beyond 48 KiB must be opted into, per device and kernel.
template <typename T, int kWidth>
cudaError_t configure() {
  static std::atomic<unsigned long long> configured{0};
  return set_kernel_smem_once(configured, decode_kernel<T, kWidth>, int(DecodeSmem<kWidth>::kBytes));
}

// Whether the combine kernel, as loaded for this device, waits for its prerequisite grid itself (its sm90
// build does), so that it may be launched as a programmatic dependent of the decode grid.
template <typename T, int kWidth>
bool combine_waits() {
  static std::atomic<int> known[64];  // per device; 0: not asked yet, 1: no, 2: yes
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return false;
  }
  int answer = known[dev].load(std::memory_order_relaxed);
  if (answer == 0) {
    cudaFuncAttributes attributes{};
    const bool waits =
        cudaFuncGetAttributes(&attributes, combine_kernel<T, kWidth>) == cudaSuccess && attributes.binaryVersion >= 90;
    (void)cudaGetLastError();
    answer = waits ? 2 : 1;
    known[dev].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

template <typename T, int kWidth>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  const cudaError_t err = configure<T, kWidth>();
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_splits, p.heads_k, p.batch);
  decode_kernel<T, kWidth><<<grid, kThreads, DecodeSmem<kWidth>::kBytes, stream>>>(p);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) return launched;
  if (p.num_splits > 1) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(int64_t(p.batch) * p.heads_q * p.seqlen_q));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kCombineSmemBytes;
    config.stream = stream;
    // The combine's CTAs start while the last splits run, instead of after the decode grid drains.
    cudaLaunchAttribute dependent;
    dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent.val.programmaticStreamSerializationAllowed = 1;
    if (combine_waits<T, kWidth>()) {
      config.attrs = &dependent;
      config.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&config, combine_kernel<T, kWidth>, p);
  }
  return cudaGetLastError();
}

template <typename T, int kWidth>
int resident(int dev) {
  static std::atomic<int> known[64];  // per device; 0: not asked yet
  std::atomic<int>* slot = dev >= 0 && dev < 64 ? &known[dev] : nullptr;
  if (slot != nullptr && slot->load(std::memory_order_acquire) > 0) return slot->load(std::memory_order_relaxed);
  int blocks = 0;
  if (configure<T, kWidth>() != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_kernel<T, kWidth>, kThreads,
                                                    DecodeSmem<kWidth>::kBytes) != cudaSuccess) {
    (void)cudaGetLastError();  // the heuristic falls back to one CTA per SM; a launch reports real errors
  }
  blocks = std::max(blocks, 1);
  if (slot != nullptr) slot->store(blocks, std::memory_order_release);
  return blocks;
}

template <typename T>
cudaError_t launch_width(const DecodeParams& p, cudaStream_t stream) {
  if (p.headdim <= 64) return launch<T, 64>(p, stream);
  if (p.headdim <= 128) return launch<T, 128>(p, stream);
  return launch<T, 256>(p, stream);
}

}  // namespace

int tile_width(int headdim) { return headdim <= 64 ? 64 : (headdim <= 128 ? 128 : 256); }

int resident_ctas(int headdim, bool bf16, int device) {
  const int width = tile_width(headdim);
  if (bf16) return width == 64 ? resident<__nv_bfloat16, 64>(device) : width == 128 ? resident<__nv_bfloat16, 128>(device)
                                                                                   : resident<__nv_bfloat16, 256>(device);
  return width == 64 ? resident<__half, 64>(device) : width == 128 ? resident<__half, 128>(device)
                                                                   : resident<__half, 256>(device);
}

cudaError_t launch_decode(const DecodeParams& p, bool bf16, cudaStream_t stream) {
  return bf16 ? launch_width<__nv_bfloat16>(p, stream) : launch_width<__half>(p, stream);
}

}  // namespace decode
}  // namespace flashop

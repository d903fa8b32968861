// The decode kernels' instantiations and launcher (decode_kernel.cuh): fp16 and bf16 at tile widths 64, 128
// and 256 (a headdim up to the width, a multiple of 8), up to 8 query rows per KV head.
#include <atomic>

#include "decode.h"
#include "decode_kernel.cuh"

namespace flashop {
namespace decode {
namespace {

static_assert(kMaxRows == kRowsPerGroup, "the launcher's row limit is the kernel's mma width");

template <typename T, int kWidth>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  constexpr uint32_t kSmem = DecodeSmem<kWidth>::kBytes;
  // Dynamic shared memory beyond 48 KiB must be opted into, per device and kernel.
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  static std::atomic<unsigned long long> configured{0};  // one bit per device
  const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
  if (bit == 0 || (configured.load(std::memory_order_acquire) & bit) == 0) {
    err = cudaFuncSetAttribute(decode_kernel<T, kWidth>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_acq_rel);
  }
  const dim3 grid(p.num_splits, p.heads_k, p.batch);
  decode_kernel<T, kWidth><<<grid, kThreads, kSmem, stream>>>(p);
  if (p.num_splits > 1) {
    const unsigned rows = unsigned(int64_t(p.batch) * p.heads_q * p.seqlen_q);
    combine_kernel<T, kWidth><<<rows, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_width(const DecodeParams& p, cudaStream_t stream) {
  if (p.headdim <= 64) return launch<T, 64>(p, stream);
  if (p.headdim <= 128) return launch<T, 128>(p, stream);
  return launch<T, 256>(p, stream);
}

}  // namespace

int tile_width(int headdim) { return headdim <= 64 ? 64 : (headdim <= 128 ? 128 : 256); }

cudaError_t launch_decode(const DecodeParams& p, bool bf16, cudaStream_t stream) {
  return bf16 ? launch_width<__nv_bfloat16>(p, stream) : launch_width<__half>(p, stream);
}

}  // namespace decode
}  // namespace flashop

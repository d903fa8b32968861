// The decode kernels' instantiations and launcher (decode_kernel.cuh): fp16 and bf16, tile widths 64, 128
// and 256 (a headdim up to the width, a multiple of 8), and 1, 2, 4 or 8 query rows per KV head.
#include "decode.h"
#include "decode_kernel.cuh"

namespace flashop {
namespace decode {
namespace {

template <typename T, int kWidth, int kRows>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_splits, p.heads_k, p.batch);
  decode_kernel<T, kWidth, kRows><<<grid, kThreads, 0, stream>>>(p);
  if (p.num_splits > 1) {
    const unsigned rows = unsigned(int64_t(p.batch) * p.heads_q * p.seqlen_q);
    combine_kernel<T, kWidth><<<rows, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, int kWidth>
cudaError_t launch_rows(const DecodeParams& p, cudaStream_t stream) {
  const int rows = p.head_ratio * p.seqlen_q;
  if (rows <= 1) return launch<T, kWidth, 1>(p, stream);
  if (rows <= 2) return launch<T, kWidth, 2>(p, stream);
  if (rows <= 4) return launch<T, kWidth, 4>(p, stream);
  return launch<T, kWidth, 8>(p, stream);
}

template <typename T>
cudaError_t launch_width(const DecodeParams& p, cudaStream_t stream) {
  if (p.headdim <= 64) return launch_rows<T, 64>(p, stream);
  if (p.headdim <= 128) return launch_rows<T, 128>(p, stream);
  return launch_rows<T, 256>(p, stream);
}

}  // namespace

int tile_width(int headdim) { return headdim <= 64 ? 64 : (headdim <= 128 ? 128 : 256); }

cudaError_t launch_decode(const DecodeParams& p, bool bf16, cudaStream_t stream) {
  return bf16 ? launch_width<__nv_bfloat16>(p, stream) : launch_width<__half>(p, stream);
}

}  // namespace decode
}  // namespace flashop

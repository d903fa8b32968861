// The decode kernels' launcher (decode.cu), for the host glue (decode_cuda.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include "decode_params.h"

namespace flashop {
namespace decode {

// Query rows per KV head (head_ratio * seqlen_q) the kernels take at most, and the head dimensions.
constexpr int kMaxRows = 8;
constexpr int kMaxHeadDim = 256;
// The splits a call may ask for: the partial results of up to this many are merged per row.
constexpr int kMaxSplits = 128;

// The tile width the kernels run a head dimension at (partial_out's last extent).
int tile_width(int headdim);

// How many decode CTAs of this head dimension's kernel one SM holds at once (the split heuristic's wave).
int resident_ctas(int headdim, bool bf16, int device);

// Launches the decode kernel (and, with num_splits > 1, the combine kernel) on `stream`.
cudaError_t launch_decode(const DecodeParams& p, bool bf16, cudaStream_t stream);

}  // namespace decode
}  // namespace flashop

// Host side of the sm_90a kernels' TMA: CUtensorMap encoding through the runtime's driver entry
// point, so the extension does not link libcuda. Shared by the forward and backward launchers.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

namespace flashop {
namespace sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 get_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult qres{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                         cudaEnableDefault, &qres) == cudaSuccess &&
        qres == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}

// A row-major fp32 matrix (rows x cols, contiguous) as a 2-D tensor map (cols, rows) with box (32 columns =
// 128 bytes, box_rows) in the 128-byte swizzle: the backward's dQ accumulator, reduce-added a tile at a time.
inline cudaError_t encode_rows_f32(CUtensorMap* map, void* ptr, int64_t rows, int64_t cols, int box_rows) {
  auto fn = get_encode_fn();
  if (fn == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * 4)};
  const cuuint32_t box[2] = {32u, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t estr[2] = {1u, 1u};
  const CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, ptr, dims, strides, box, estr,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A (B, S, H, D) tensor with element strides (batch, row, head), D contiguous,
// as a 4-D tensor map (D, S, H, B) with box (box_cols, box_rows, 1, 1): 64 columns (128 bytes) in the
// 128-byte swizzle, 32 columns (64 bytes) in the 64-byte swizzle, or 16 columns (32 bytes) in the 32-byte
// swizzle (a box row is one swizzle span).
// dims[0] = headdim, the true head dimension: a load's columns >= headdim are zero-filled (a box that
// starts at or past it arrives as all zeros, with its full byte count) and a store's are dropped.
// A stride of 0 (a dimension of size 1) is replaced by a harmless 16-byte multiple.
inline cudaError_t encode_bshd(CUtensorMap* map, bool bf16, const void* ptr, int64_t batch, int64_t seqlen,
                        int64_t heads, int64_t headdim, int64_t batch_stride, int64_t row_stride,
                        int64_t head_stride, int box_rows, int box_cols = 64) {
  if (box_cols != 64 && box_cols != 32 && box_cols != 16) return cudaErrorInvalidValue;
  auto fn = get_encode_fn();
  if (fn == nullptr) return cudaErrorNotSupported;
  auto bytes = [&](int64_t s) -> cuuint64_t {
    const int64_t b = s * 2;
    return b > 0 ? static_cast<cuuint64_t>(b) : static_cast<cuuint64_t>(headdim * 2);
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(headdim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {bytes(row_stride), bytes(head_stride), bytes(batch_stride)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1u, 1u};
  const cuuint32_t estr[4] = {1u, 1u, 1u, 1u};
  const CUresult r =
      fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
         const_cast<void*>(ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
         box_cols == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
         : box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                          : CU_TENSOR_MAP_SWIZZLE_32B,
         CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace sm90
}  // namespace flashop

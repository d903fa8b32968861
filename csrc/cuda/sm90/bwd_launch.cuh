// sm_90a backward: the host side of a launch (tensor maps, the three kernels of one backward call) as a
// template over the kernel's traits. tools/codegen.py writes one instantiation file per Hopper backward
// config of flashop/configs.py (csrc/cuda/instantiations/sm90_bwd_*.cu) and the registry table. Build with
// -gencode=arch=compute_90a,code=sm_90a. The preprocess and dQ conversion kernels are the mma.sync path's
// (one instantiation per dtype and head dimension).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../sm80/bwd_kernel.cuh"
#include "bwd_kernel.cuh"
#include "registry_sm90.cuh"
#include "tensor_maps.h"

namespace flashop {
namespace sm90 {

template <class T>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  // The aux kernels read only the head dimension and dtype of their config.
  using Aux = BwdConfig<T::kBf16 ? DType::kBf16 : DType::kFp16, T::kHeadDim, T::kBlockN, T::kBlockM, 8>;
  if (p.deterministic || !sm80::bwd::bwd_params_ok<Aux>(p)) return cudaErrorInvalidValue;  // incl. headdim
  CUtensorMap tq, tk, tv, tdo;
  cudaError_t err = encode_bshd(&tq, T::kBf16, p.q, p.batch, p.seqlen_q, p.heads_q, p.headdim, p.q_batch_stride,
                                p.q_row_stride, p.q_head_stride, T::kBlockM, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tdo, T::kBf16, p.dout, p.batch, p.seqlen_q, p.heads_q, p.headdim, p.do_batch_stride,
                      p.do_row_stride, p.do_head_stride, T::kBlockM, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tk, T::kBf16, p.k, p.batch, p.seqlen_k, p.heads_k, p.headdim, p.k_batch_stride,
                      p.k_row_stride, p.k_head_stride, T::kBlockN, T::kKColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tv, T::kBf16, p.v, p.batch, p.seqlen_k, p.heads_k, p.headdim, p.v_batch_stride,
                      p.v_row_stride, p.v_head_stride, T::kBlockN, T::kColBlock);
  if (err != cudaSuccess) return err;

  const sm80::bwd::BwdGrids g = sm80::bwd::bwd_grids<Aux>(p);
  sm80::bwd::bwd_preprocess_kernel<Aux><<<dim3(g.pre[0], g.pre[1], g.pre[2]), sm80::bwd::kAuxThreads, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  auto kernel = [] {
    if constexpr (T::kWide) return bwd_kernel_sm90_wide<T>;
    else return bwd_kernel_sm90<T>;
  }();
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.seqlen_k + T::kBlockN - 1) / T::kBlockN, p.heads_k, p.batch);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(tq, tk, tv, tdo, p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  sm80::bwd::bwd_convert_dq_kernel<Aux><<<dim3(g.conv[0], g.conv[1], g.conv[2]), sm80::bwd::kAuxThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace flashop

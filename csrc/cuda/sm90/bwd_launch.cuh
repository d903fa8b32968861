// sm_90a backward: the host side of a launch (tensor maps, the three kernels of one backward call) as a
// template over the kernel's traits. tools/codegen.py writes one instantiation file per Hopper backward
// config of flashop/configs.py (csrc/cuda/instantiations/sm90_bwd_*.cu) and the registry table. Build with
// -gencode=arch=compute_90a,code=sm_90a. The preprocess and dQ conversion kernels are the mma.sync path's
// (one instantiation per dtype and head dimension).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../kernel_attributes.h"
#include "../sm80/bwd_kernel.cuh"
#include "bwd_kernel.cuh"
#include "registry_sm90.cuh"
#include "tensor_maps.h"

namespace flashop {
namespace sm90 {

// The main kernel of the dense traits T or of their variants or packed builds Sm90BwdVariants<T>,
// Sm90BwdPacked<T> (the same maps, grid and shared memory; packed: the grid spans max_seqlen_k keys of every
// sequence).
// tdq: the dQ accumulator's map (bwd_kernel_sm90 only; the wide kernels add with red.global.add).
template <class K>
cudaError_t launch_bwd_main(const BwdParams& p, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv,
                            const CUtensorMap& tdo, const CUtensorMap& tdq, cudaStream_t stream) {
  auto kernel = [] {
    if constexpr (K::kWide && K::kKeySplit) return bwd_kernel_sm90_wide_keys<K>;
    else if constexpr (K::kWide && K::kTransposedKV) return bwd_kernel_sm90_wide_kv_transposed<K>;
    else if constexpr (K::kWide) return bwd_kernel_sm90_wide<K>;
    else return bwd_kernel_sm90<K>;
  }();
  static std::atomic<unsigned long long> configured{0};
  // One consumer (B_c = 64 narrow) is sized for two CTAs per SM: ask for the largest shared-memory carveout.
  const bool two_ctas = [] {
    if constexpr (K::kWide) return false;
    else return K::kCtasPerSm > 1;
  }();
  const cudaError_t err = set_kernel_smem_once(configured, kernel, K::kSmemBytes, two_ctas);
  if (err != cudaSuccess) return err;
  // Sm90BwdTail: one CTA per piece of the split blocks (bwd_tail.h).
  const dim3 grid = K::kTail ? dim3(unsigned(p.tail.blocks * p.tail.pieces))
                             : dim3((p.seqlen_k + K::kBlockN - 1) / K::kBlockN, p.heads_k, p.batch);
  if constexpr (K::kTail) {
    // A programmatic dependent of the dense grid launched just before it (see Sm90BwdTail).
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(K::kThreads);
    config.dynamicSmemBytes = K::kSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute dependent;
    dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    dependent.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &dependent;
    config.numAttrs = 1;
    return cudaLaunchKernelEx(&config, kernel, tq, tk, tv, tdo, tdq, p);
  } else if constexpr (K::kWide) {
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(tq, tk, tv, tdo, p);
  } else {
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(tq, tk, tv, tdo, tdq, p);
  }
  return cudaGetLastError();
}

// The floats of the tail split's dK/dV workspace (p.dkv_tail): [tail.blocks][2][B_c][W].
template <class T>
std::size_t bwd_tail_workspace_floats(const BwdTailSplit& tail) {
  return std::size_t(tail.blocks) * 2 * T::kBlockN * T::kHeadDim;
}

// The tail split of a call (bwd_tail.h): set into p.tail, with the workspace floats it needs (p.dkv_tail, which
// the glue allocates; launch_bwd zeroes it). Dense non-causal calls of the dense build only: their blocks cost
// alike.
template <class T>
std::size_t plan_bwd(BwdParams& p) {
  p.tail = BwdTailSplit{0, 0, 0};
  if constexpr (bwd_takes_tail_split<T>) {
    if (p.causal || p.deterministic || p.packed.packed() || bwd_variants_requested(p.variants) || p.sm_count < 1)
      return 0;
    const int64_t blocks = int64_t((p.seqlen_k + T::kBlockN - 1) / T::kBlockN) * p.heads_k * p.batch;
    const int64_t steps = int64_t((p.seqlen_q + T::kBlockM - 1) / T::kBlockM) * p.head_ratio;
    if (steps > 0x7fffffff) return 0;
    p.tail = bwd_tail_split(blocks, p.sm_count * T::kCtasPerSm, int(steps));
    return bwd_tail_workspace_floats<T>(p.tail);
  }
  return 0;
}

// p.variants (windows, softcap, ALiBi) run the variants build when bwd_variants_requested, a packed batch
// (p.packed) the packed build with any variants; a config built without them (T::kSupportsVariants false)
// returns cudaErrorNotSupported for either. Packed: the TMA maps are one batch of all packed rows
// (total_q / total_k, at least 1: the glue returns earlier for an empty side); the kernel starts each load
// at its sequence's first row.
template <class T>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  // The aux kernels read only the head dimension and dtype of their config.
  using Aux = BwdConfig<T::kBf16 ? DType::kBf16 : DType::kFp16, T::kHeadDim, T::kWide ? 64 : 128, 64, 8>;
  if (p.deterministic || !sm80::bwd::bwd_params_ok<Aux>(p)) return cudaErrorInvalidValue;  // incl. headdim
  const bool variants = bwd_variants_requested(p.variants);
  const bool packed = p.packed.packed();
  if ((variants || packed) && !T::kSupportsVariants) return cudaErrorNotSupported;
  if (packed && (p.packed.total_q < 1 || p.packed.total_k < 1)) return cudaErrorInvalidValue;
  const bool split = p.tail.pieces > 0;
  if (split && (!bwd_takes_tail_split<T> || variants || packed || p.causal || p.dkv_tail == nullptr))
    return cudaErrorInvalidValue;
  // The preprocess first: its launch runs while the host encodes the tensor maps.
  const sm80::bwd::BwdGrids g = sm80::bwd::bwd_grids<Aux, T::kDQLayout>(p);
  sm80::bwd::bwd_preprocess_kernel<Aux><<<dim3(g.pre[0], g.pre[1], g.pre[2]), sm80::bwd::kAuxThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t maps_batch = packed ? 1 : p.batch;
  const int64_t rows_q = packed ? p.packed.total_q : p.seqlen_q, rows_k = packed ? p.packed.total_k : p.seqlen_k;
  CUtensorMap tq, tk, tv, tdo;
  err = encode_bshd(&tq, T::kBf16, p.q, maps_batch, rows_q, p.heads_q, p.headdim, p.q_batch_stride, p.q_row_stride,
                    p.q_head_stride, T::kBlockM, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tdo, T::kBf16, p.dout, maps_batch, rows_q, p.heads_q, p.headdim, p.do_batch_stride,
                      p.do_row_stride, p.do_head_stride, T::kBlockM, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tk, T::kBf16, p.k, maps_batch, rows_k, p.heads_k, p.headdim, p.k_batch_stride,
                      p.k_row_stride, p.k_head_stride, T::kBlockN, T::kKColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tv, T::kBf16, p.v, maps_batch, rows_k, p.heads_k, p.headdim, p.v_batch_stride,
                      p.v_row_stride, p.v_head_stride, T::kBlockN, T::kColBlock);
  CUtensorMap tdq{};
  if constexpr (!T::kWide) {
    if (err == cudaSuccess)
      err = encode_rows_f32(&tdq, p.dq_accum,
                            bwd_ws_rows(int(p.batch), int(p.heads_q), p.seqlen_q_rounded, packed ? p.packed.total_q : -1),
                            T::kHeadDim, T::kDQRows);
  }
  if (err != cudaSuccess) return err;
  if (split) {
    err = cudaMemsetAsync(p.dkv_tail, 0, bwd_tail_workspace_floats<T>(p.tail) * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  err = cudaErrorNotSupported;
  if constexpr (T::kSupportsVariants) {
    if (packed) err = launch_bwd_main<Sm90BwdPacked<T>>(p, tq, tk, tv, tdo, tdq, stream);
    else if (variants) err = launch_bwd_main<Sm90BwdVariants<T>>(p, tq, tk, tv, tdo, tdq, stream);
  }
  if (!variants && !packed) err = launch_bwd_main<T>(p, tq, tk, tv, tdo, tdq, stream);
  if constexpr (bwd_takes_tail_split<T>) {
    // The pieces right after the dense grid, as its programmatic dependent.
    if (split && err == cudaSuccess) err = launch_bwd_main<Sm90BwdTail<T>>(p, tq, tk, tv, tdo, tdq, stream);
  }
  if (err != cudaSuccess) return err;
  sm80::bwd::bwd_convert_dq_kernel<Aux, T::kDQLayout>
      <<<dim3(g.conv[0], g.conv[1], g.conv[2]), sm80::bwd::kAuxThreads, 0, stream>>>(p);
  if constexpr (bwd_takes_tail_split<T>) {
    if (split) bwd_convert_tail_kernel<T><<<p.tail.blocks, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace sm90
}  // namespace flashop

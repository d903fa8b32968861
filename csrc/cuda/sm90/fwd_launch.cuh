// sm_90a forward: the host side of a launch (CUtensorMap encoding through the runtime's driver
// entry point, so the extension does not link libcuda; grid and schedule; the launch itself), as
// templates over the kernel's traits. tools/codegen.py writes one instantiation file per Hopper config
// of flashop/configs.py (csrc/cuda/instantiations/sm90_fwd_*.cu) and the registry table. Build with
// -gencode=arch=compute_90a,code=sm_90a.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../kernel_attributes.h"
#include "fwd_kernel.cuh"
#include "registry_sm90.cuh"
#include "tensor_maps.h"

namespace flashop {
namespace sm90 {

// Persistent configs: one CTA per SM of the current device (384 threads x 168 registers and the smem
// allow only one), or one per tile when there are fewer tiles.
template <class T>
cudaError_t persistent_grid(const FwdParams& p, int64_t* tiles, int* grid) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  *tiles = static_cast<int64_t>((p.seqlen_q + T::kBlockM - 1) / T::kBlockM) * p.heads_q * p.batch;
  // The kernel counts tiles in int (t + gridDim.x must not overflow; both tile orders divide t < tiles
  // by n_q_tiles or Hq * B, each <= tiles); so many tiles cannot fit in memory anyway.
  if (*tiles + sms >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  *grid = static_cast<int>(*tiles < sms ? *tiles : sms);
  return cudaSuccess;
}

// Split tail (T::kStreamK; fwd_kernel.cuh, walk): when the tiles do not fill the last wave, the
// tiles of the last two waves are shared out over all CTAs by key tiles, so every CTA ends within one
// key tile of the others. Non-causal only (every tile has the same key tiles), and only where the
// idle share of the plain schedule is at least 1% (below that, the extra split costs as much) and
// a tile has two key tiles or more (else nothing can be split).
struct StreamKPlan {
  bool on = false;
  int tile0 = 0;  // the first tile that is shared out; the tiles before it run whole, round robin
};

template <class T>
StreamKPlan stream_k_plan(const FwdParams& p, int64_t tiles, int grid) {
  StreamKPlan plan;
  // Windows give tiles key ranges of their own (the split assumes one range 0 .. n-1 for all tiles).
  // Packed batches: tiles of one problem differ in length (and some are skipped).
  if (!T::kStreamK || p.causal || p.variants.local() || p.seqlen_k <= 0 || tiles <= grid || p.packed.packed())
    return plan;
  const int64_t waves = tiles / grid, rest = tiles % grid;
  const int64_t key_tiles = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  // Idle share of the plain schedule: (grid - rest) tile slots of (waves + 1) * grid.
  if (rest == 0 || key_tiles < 2 || (grid - rest) * 100 < grid * (waves + 1)) return plan;
  const int64_t tile0 = (waves - 1) * grid;  // >= 0; grid <= tiles - tile0 < 2 grid
  if ((tiles - tile0) * key_tiles >= (int64_t(1) << 31)) return plan;  // the kernel's units are int
  plan.on = true;
  plan.tile0 = static_cast<int>(tile0);
  return plan;
}

// Split last wave (T::kSplitTail; fwd_kernel.cuh): a one-tile-per-CTA grid of equal (non-causal) tiles
// runs in rounds of one tile per SM, and a last round that is only partly filled leaves SMs idle (4096
// tiles on 132 SMs: 31 full rounds and 4 tiles, 3% of the time). The last tiles are instead run as k
// pieces of their key range each, in CTAs launched after all whole tiles, so the last round is short.
// Multicast builds launched in clusters count pairs of tiles and pairs of SMs.
// The plan is the cheapest of: no split; the last `rest` tiles (tiles % SMs) in k pieces; the last
// rest + SMs tiles in k pieces (2 <= k <= min(key tiles, 32)), by a model of the time per SM in key
// tiles: a CTA costs its key tiles + kSplitFixed (set-up, first loads, the first S alone, epilogue;
// ~10% of a 2k-key CTA), a piece also kSplitMerge per piece of its tile (its partial store and the last
// warp's merge). It is taken when it saves at least 1% of the plain time. Measured (docs/hopper.md, Split
// last wave): it gains what the model says, less ~0.3 of a round, where the last round is partly empty,
// and nothing where a long grid ends a few tiles past whole rounds (the hardware's dispatch already
// leaves that end ragged).
constexpr double kSplitFixed = 1.5, kSplitMerge = 0.25;
constexpr int kSplitMaxPieces = 32;
constexpr int64_t kSplitMaxWorkspace = int64_t(64) << 20;

struct SplitTailPlan {
  bool on = false;
  int whole = 0;        // tiles run whole (CTAs 0 .. whole-1)
  int split_tiles = 0;  // the tiles after them, in `pieces` pieces each
  int pieces = 0;
};

template <class T>
cudaError_t split_tail_plan(const FwdParams& p, SplitTailPlan* plan) {
  *plan = SplitTailPlan{};
  // Windows give tiles key ranges of their own (pieces are cut from one range 0 .. n-1 for all tiles).
  if (!T::kSplitTail || p.causal || p.variants.local() || p.seqlen_k <= 0 || p.packed.packed()) return cudaSuccess;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const int64_t q_tiles = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  const int64_t pair = T::kMulticast && q_tiles % 2 == 0 ? 2 : 1;  // as launch_fwd's cluster_pairs
  const int64_t units = q_tiles * p.heads_q * p.batch / pair, slots = sms / pair;
  const int64_t n = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;
  if (n < 2 || slots < 1) return cudaSuccess;
  auto rounds = [&](int64_t ctas) { return static_cast<double>((ctas + slots - 1) / slots); };
  const double plain = rounds(units) * (n + kSplitFixed);
  double best = plain;
  for (const int64_t split : {units % slots, units % slots + slots}) {
    if (split == 0 || split > units) continue;
    const double whole_time = static_cast<double>((units - split) / slots) * (n + kSplitFixed);
    for (int64_t k = 2; k <= std::min<int64_t>(n, kSplitMaxPieces); ++k) {
      const int64_t ctas = (units - split + split * k) * pair;
      if (split * pair * k * T::kPartialFloat4s * 16 > kSplitMaxWorkspace || ctas >= (int64_t(1) << 31)) break;
      const double time = whole_time + rounds(split * k) * ((n + k - 1) / k + kSplitFixed + kSplitMerge * k);
      if (time < best) {
        best = time;
        plan->whole = static_cast<int>((units - split) * pair);
        plan->split_tiles = static_cast<int>(split * pair);
        plan->pieces = static_cast<int>(k);
      }
    }
  }
  plan->on = best <= 0.99 * plain;
  return cudaSuccess;
}

// The launch's grid and schedule (registry_sm90.cuh): one CTA per tile (the split last wave: per whole
// tile, then per piece), or one per SM (persistent, with the split tail where it pays).
template <class T>
cudaError_t plan_fwd(const FwdParams& p, Sm90FwdPlan* plan) {
  *plan = Sm90FwdPlan{};
  // The true head dimension: a multiple of 8 up to the tile width (columns >= headdim are zero-filled
  // by the loads and dropped by the stores; fwd_epilogue.cuh predicates the register stores).
  if (p.headdim > T::kHeadDim || p.headdim % 8 != 0 || p.headdim < 8) return cudaErrorInvalidValue;
  const int q_tiles = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  // Multicast configs run as clusters of two adjacent query tiles of one head when both walk the same
  // key tiles (non-causal) and the tiles pair up (an even count); then each CTA's K/V box is half a
  // tile (fwd_kernel.cuh). Otherwise they launch as the plain one-tile-per-CTA kernel.
  // (A window gives adjacent query tiles different key tiles, as causal masking does.)
  // (Packed: the sequences' tiles of one grid column differ, as do their key tiles.)
  plan->cluster_pairs = T::kMulticast && !p.causal && !p.variants.local() && q_tiles % 2 == 0 && !p.packed.packed();
  // Packed batches run on the variants build (the one-tile grid's z extent is the number of sequences).
  if (p.packed.packed() && (!T::kSupportsVariants || (!T::kPersistent && p.batch > 65535)))
    return cudaErrorNotSupported;
  plan->grid = dim3(q_tiles, p.heads_q, p.batch);
  if constexpr (T::kSplitTail) {
    SplitTailPlan split;
    const cudaError_t err = split_tail_plan<T>(p, &split);
    if (err != cudaSuccess) return err;
    if (split.on) {
      plan->stream_k = true;
      plan->stream_k_tile0 = split.whole;
      plan->split_tiles = split.split_tiles;
      plan->split_pieces = split.pieces;
      // Partial results per piece, then one arrival counter per (split tile, consumer warpgroup).
      plan->zero_offset = static_cast<std::size_t>(split.split_tiles) * split.pieces * T::kPartialFloat4s * 16;
      plan->zero_bytes = static_cast<std::size_t>(split.split_tiles) * T::kConsumerWGs * 4;
      plan->workspace_bytes = plan->zero_offset + plan->zero_bytes;
      plan->grid = dim3(static_cast<unsigned>(split.whole + split.split_tiles * split.pieces), 1, 1);
    }
  }
  if constexpr (T::kPersistent) {
    // Each CTA walks tiles blockIdx.x, +gridDim.x, ... (fwd_kernel.cuh; "pers.lpt" numbers the same
    // tiles in another order), and with the split tail shares the last waves' key tiles.
    int64_t tiles = 0;
    int ctas = 0;
    const cudaError_t err = persistent_grid<T>(p, &tiles, &ctas);
    if (err != cudaSuccess) return err;
    plan->grid = dim3(static_cast<unsigned>(ctas), 1, 1);
    if constexpr (T::kDynamic) {
      plan->workspace_bytes = 16;  // the counter of tiles taken
      plan->zero_bytes = sizeof(int);
    }
    const StreamKPlan split = stream_k_plan<T>(p, tiles, ctas);
    if (split.on) {
      plan->stream_k = true;
      plan->stream_k_tile0 = split.tile0;
      // Partial results per CTA, then one flag per (CTA, consumer warpgroup).
      plan->zero_offset = static_cast<std::size_t>(ctas) * T::kPartialFloat4s * 16;
      plan->zero_bytes = static_cast<std::size_t>(ctas) * T::kConsumerWGs * 4;
      plan->workspace_bytes = plan->zero_offset + plan->zero_bytes;
    }
  }
  return cudaSuccess;
}

// The kernel launch proper, for the dense traits T or their variants build Sm90FwdVariants<T> (the same
// maps, grid and shared memory).
template <class K>
cudaError_t launch_kernel(const FwdParams& p, const Sm90FwdPlan& plan, const CUtensorMap& tq, const CUtensorMap& tk,
                          const CUtensorMap& tv, cudaStream_t stream) {
  const bool cluster_pairs = plan.cluster_pairs;
  const dim3 grid = plan.grid;
  cudaError_t err = cudaSuccess;
  if constexpr (!K::kTmaStore) {
    auto kernel = fwd_kernel_sm90<K>;
    static std::atomic<unsigned long long> configured{0};
    err = set_kernel_smem_once(configured, kernel, K::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(tq, tk, tv, p);
  } else {
    // O: always a fresh contiguous (B, Sq, Hq, headdim) tensor (allocate_forward_outputs),
    // 16-byte aligned, strides (Sq*Hq*headdim, Hq*headdim, headdim) elements: multiples of 16 bytes.
    // Row extent = the true Sq and column extent = headdim, so the TMA store drops rows >= Sq of the
    // last query tile (and never spills into the next head) and columns >= headdim (never into the
    // next row); box = 64 rows x kColBlock columns, one per consumer warpgroup and column block; same
    // swizzle as the loads (the kernel stages O in that layout).
    // Packed: one batch of total_q rows; the kernel stores only boxes that lie within their sequence.
    CUtensorMap to;
    const bool packed = p.packed.packed();
    err = encode_bshd(&to, K::kBf16, p.out, packed ? 1 : p.batch, packed ? p.packed.total_q : p.seqlen_q, p.heads_q,
                      p.headdim, p.o_batch_stride, p.o_row_stride, p.o_head_stride, K::kOStageRows, K::kColBlock);
    if (err != cudaSuccess) return err;
    auto kernel = fwd_kernel_sm90_tmao<K>;
    // B_r = 64 is sized for two or three CTAs per SM: ask for the largest shared-memory carveout so they fit.
    static std::atomic<unsigned long long> configured{0};
    err = set_kernel_smem_once(configured, kernel, K::kSmemBytes, K::kCtasPerSm > 1);
    if (err != cudaSuccess) return err;
    if (cluster_pairs) {
      // blockIdx.x 2i and 2i+1 (query tiles n-1-2i and n-2-2i, fwd_kernel.cuh; split last wave: the same
      // piece of two such tiles) form a cluster.
      cudaLaunchAttribute cluster;
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 2;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = grid;
      config.blockDim = dim3(K::kThreads);
      config.dynamicSmemBytes = K::kSmemBytes;
      config.stream = stream;
      config.attrs = &cluster;
      config.numAttrs = 1;
      return cudaLaunchKernelEx(&config, kernel, tq, tk, tv, to, p);
    }
    kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(tq, tk, tv, to, p);
  }
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_fwd(const FwdParams& params, const Sm90FwdPlan& plan, void* workspace, cudaStream_t stream) {
  if (params.headdim > T::kHeadDim || params.headdim % 8 != 0 || params.headdim < 8) return cudaErrorInvalidValue;
  // A config built without the variants refuses them (the binding names it; configs.py supports_variants).
  // Packed batches run on the variants build too (per-sequence offsets and bounds; fwd_scheduler.cuh).
  const bool packed = params.packed.packed();
  const bool variants = fwd_variants_requested(params.variants) || packed;
  if (variants && !T::kSupportsVariants) return cudaErrorNotSupported;
  if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  FwdParams p = params;
  p.stream_k = plan.stream_k;
  p.stream_k_tile0 = plan.stream_k_tile0;
  p.split_tiles = plan.split_tiles;
  p.split_pieces = plan.split_pieces;
  if (plan.workspace_bytes > 0) p.workspace = workspace;
  const int kv_box_rows = plan.cluster_pairs ? T::kKVHalfRows : T::kBlockN;
  // Packed: maps of one batch over all rows (total_q, total_k); a tile's rows start at its sequence's,
  // and a box's rows past the sequence (the next sequence's, or the zero fill past the last) are masked
  // (keys) or never stored (queries) by the kernel.
  const int64_t maps_batch = packed ? 1 : p.batch;
  const int64_t rows_q = packed ? p.packed.total_q : p.seqlen_q, rows_k = packed ? p.packed.total_k : p.seqlen_k;
  CUtensorMap tq, tk, tv;
  cudaError_t err = encode_bshd(&tq, T::kBf16, p.q, maps_batch, rows_q, p.heads_q, p.headdim,
                                p.q_batch_stride, p.q_row_stride, p.q_head_stride, T::kQBoxRows, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tk, T::kBf16, p.k, maps_batch, rows_k, p.heads_k, p.headdim,
                      p.k_batch_stride, p.k_row_stride, p.k_head_stride, kv_box_rows, T::kColBlock);
  if (err == cudaSuccess)
    err = encode_bshd(&tv, T::kBf16, p.v, maps_batch, rows_k, p.heads_k, p.headdim,
                      p.v_batch_stride, p.v_row_stride, p.v_head_stride, kv_box_rows, T::kColBlock);
  if (err == cudaSuccess && plan.zero_bytes > 0)
    err = cudaMemsetAsync(static_cast<char*>(workspace) + plan.zero_offset, 0, plan.zero_bytes, stream);
  if (err != cudaSuccess) return err;
  if constexpr (T::kSupportsVariants) {
    if (variants) return launch_kernel<Sm90FwdVariants<T>>(p, plan, tq, tk, tv, stream);
  }
  return launch_kernel<T>(p, plan, tq, tk, tv, stream);
}

}  // namespace sm90
}  // namespace flashop

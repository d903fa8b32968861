// sm_90a forward: host launchers (CUtensorMap encoding through the runtime's
// driver entry point, so the extension does not link libcuda), explicit
// instantiations and the registry table. Build with
// -gencode=arch=compute_90a,code=sm_90a.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "fwd_kernel.cuh"
#include "registry_sm90.cuh"
#include "tensor_maps.h"

namespace flashop {
namespace sm90 {
namespace {

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
  if (!T::kStreamK || p.causal || p.seqlen_k <= 0 || tiles <= grid) return plan;
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
// FLASHOP_SM90_SPLIT_LAST_WAVE=0 in the environment turns it off (A/B runs).
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
  if (!T::kSplitTail || p.causal || p.seqlen_k <= 0) return cudaSuccess;
  static const bool disabled = [] {
    const char* env = std::getenv("FLASHOP_SM90_SPLIT_LAST_WAVE");
    return env != nullptr && std::strcmp(env, "0") == 0;
  }();
  if (disabled) return cudaSuccess;
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
  if (p.headdim != T::kHeadDim) return cudaErrorInvalidValue;
  const int q_tiles = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  // Multicast configs run as clusters of two adjacent query tiles of one head when both walk the same
  // key tiles (non-causal) and the tiles pair up (an even count); then each CTA's K/V box is half a
  // tile (fwd_kernel.cuh). Otherwise they launch as the plain one-tile-per-CTA kernel.
  plan->cluster_pairs = T::kMulticast && !p.causal && q_tiles % 2 == 0;
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

template <class T>
cudaError_t launch_fwd(const FwdParams& params, const Sm90FwdPlan& plan, void* workspace, cudaStream_t stream) {
  if (params.headdim != T::kHeadDim) return cudaErrorInvalidValue;
  if (plan.workspace_bytes > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  FwdParams p = params;
  p.stream_k = plan.stream_k;
  p.stream_k_tile0 = plan.stream_k_tile0;
  p.split_tiles = plan.split_tiles;
  p.split_pieces = plan.split_pieces;
  if (plan.workspace_bytes > 0) p.workspace = workspace;
  const bool cluster_pairs = plan.cluster_pairs;
  const dim3 grid = plan.grid;
  const int kv_box_rows = cluster_pairs ? T::kKVHalfRows : T::kBlockN;
  CUtensorMap tq, tk, tv;
  cudaError_t err = encode_bshd(&tq, T::kBf16, p.q, p.batch, p.seqlen_q, p.heads_q, p.headdim,
                                p.q_batch_stride, p.q_row_stride, p.q_head_stride, T::kQBoxRows);
  if (err == cudaSuccess)
    err = encode_bshd(&tk, T::kBf16, p.k, p.batch, p.seqlen_k, p.heads_k, p.headdim,
                      p.k_batch_stride, p.k_row_stride, p.k_head_stride, kv_box_rows);
  if (err == cudaSuccess)
    err = encode_bshd(&tv, T::kBf16, p.v, p.batch, p.seqlen_k, p.heads_k, p.headdim,
                      p.v_batch_stride, p.v_row_stride, p.v_head_stride, kv_box_rows);
  if (err == cudaSuccess && plan.zero_bytes > 0)
    err = cudaMemsetAsync(static_cast<char*>(workspace) + plan.zero_offset, 0, plan.zero_bytes, stream);
  if (err != cudaSuccess) return err;

  if constexpr (!T::kTmaStore) {
    auto kernel = fwd_kernel_sm90<T>;
    // The attribute is per device; setting it on every launch is cheap and safe.
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(tq, tk, tv, p);
  } else {
    // O: always a fresh contiguous (B, Sq, Hq, D) tensor (allocate_forward_outputs),
    // 16-byte aligned, strides (Sq*Hq*D, Hq*D, D) elements: multiples of 16 bytes.
    // Row extent = the true Sq, so the TMA store drops rows >= Sq of the last
    // query tile (and never spills into the next head); box = 64 rows x 64
    // columns, one per consumer warpgroup and column block; same 128B swizzle
    // as the loads (the kernel stages O in that layout).
    CUtensorMap to;
    err = encode_bshd(&to, T::kBf16, p.out, p.batch, p.seqlen_q, p.heads_q, p.headdim,
                      p.o_batch_stride, p.o_row_stride, p.o_head_stride, T::kOStageRows);
    if (err != cudaSuccess) return err;
    auto kernel = fwd_kernel_sm90_tmao<T>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    // B_r = 64 is sized for two or three CTAs per SM: ask for the largest shared-memory carveout so they fit.
    if (err == cudaSuccess && T::kCtasPerSm > 1)
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared);
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
      config.blockDim = dim3(T::kThreads);
      config.dynamicSmemBytes = T::kSmemBytes;
      config.stream = stream;
      config.attrs = &cluster;
      config.numAttrs = 1;
      return cudaLaunchKernelEx(&config, kernel, tq, tk, tv, to, p);
    }
    kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(tq, tk, tv, to, p);
  }
  return cudaGetLastError();
}

using Bf16D64 = Sm90FwdTraits<true, 64, 128, 128>;
using Fp16D64 = Sm90FwdTraits<false, 64, 128, 128>;
using Bf16D128 = Sm90FwdTraits<true, 128, 128, 128>;
using Fp16D128 = Sm90FwdTraits<false, 128, 128, 128>;
// O through shared memory and a TMA store ("tmao"); persistent tile scheduler ("pers").
using Bf16D128Tmao = Sm90FwdTraits<true, 128, 128, 128, true, true>;
using Fp16D128Tmao = Sm90FwdTraits<false, 128, 128, 128, true, true>;
using Bf16D64Tmao = Sm90FwdTraits<true, 64, 128, 128, true, true>;
using Fp16D64Tmao = Sm90FwdTraits<false, 64, 128, 128, true, true>;
using Bf16D128Pers = Sm90FwdTraits<true, 128, 128, 128, true, true, true>;
using Fp16D128Pers = Sm90FwdTraits<false, 128, 128, 128, true, true, true>;
using Bf16D64Pers = Sm90FwdTraits<true, 64, 128, 128, true, true, true>;
using Fp16D64Pers = Sm90FwdTraits<false, 64, 128, 128, true, true, true>;
// D = 256: B_c = 64 (Q 64 KiB + 2 stages x (K + V) 32 KiB each = 192 KiB of the 227 KiB);
// S = Q K^T as 16 m64n64k16 SS steps, O += P V as 4 m64n256k16 RS steps.
using Bf16D256 = Sm90FwdTraits<true, 256, 128, 64>;
using Fp16D256 = Sm90FwdTraits<false, 256, 128, 64>;
using Bf16D256Tmao = Sm90FwdTraits<true, 256, 128, 64, true, true>;
using Fp16D256Tmao = Sm90FwdTraits<false, 256, 128, 64, true, true>;
using Bf16D256Pers = Sm90FwdTraits<true, 256, 128, 64, true, true, true>;
using Fp16D256Pers = Sm90FwdTraits<false, 256, 128, 64, true, true, true>;
// D = 128, B_c = 176 (FlashAttention-3's non-causal d128 tile): S = Q K^T as 8 m64n176k16 SS steps,
// O += P V as 11 m64n128k16 RS steps; Q 32 KiB + 2 stages x (K + V) 44 KiB each = 208 KiB.
// TMA-store and persistent variants only.
using Bf16D128Bc176Tmao = Sm90FwdTraits<true, 128, 128, 176, true, true>;
using Fp16D128Bc176Tmao = Sm90FwdTraits<false, 128, 128, 176, true, true>;
using Bf16D128Bc176Pers = Sm90FwdTraits<true, 128, 128, 176, true, true, true>;
using Fp16D128Bc176Pers = Sm90FwdTraits<false, 128, 128, 176, true, true, true>;
// Persistent, longest query tiles of all heads first ("pers.lpt"): the same kernels with the
// query tile varying slowest in the tile order (causal load balance across the SMs).
using Bf16D128PersLpt = Sm90FwdTraits<true, 128, 128, 128, true, true, true, true>;
using Fp16D128PersLpt = Sm90FwdTraits<false, 128, 128, 128, true, true, true, true>;
using Bf16D128Bc176PersLpt = Sm90FwdTraits<true, 128, 128, 176, true, true, true, true>;
using Fp16D128Bc176PersLpt = Sm90FwdTraits<false, 128, 128, 176, true, true, true, true>;
using Bf16D256PersLpt = Sm90FwdTraits<true, 256, 128, 64, true, true, true, true>;
using Fp16D256PersLpt = Sm90FwdTraits<false, 256, 128, 64, true, true, true, true>;
using Bf16D64PersLpt = Sm90FwdTraits<true, 64, 128, 128, true, true, true, true>;
using Fp16D64PersLpt = Sm90FwdTraits<false, 64, 128, 128, true, true, true, true>;
// One tile per CTA, TMA store, a 3-stage K/V ring ("st3"; d64 and d128 at B_c = 128, where it fits).
using Bf16D128St3Tmao = Sm90FwdTraits<true, 128, 128, 128, true, true, false, false, 3>;
using Fp16D128St3Tmao = Sm90FwdTraits<false, 128, 128, 128, true, true, false, false, 3>;
using Bf16D64St3Tmao = Sm90FwdTraits<true, 64, 128, 128, true, true, false, false, 3>;
using Fp16D64St3Tmao = Sm90FwdTraits<false, 64, 128, 128, true, true, false, false, 3>;
// D = 256 with 80 keys per tile, one tile per CTA, TMA store.
using Bf16D256Bc80Tmao = Sm90FwdTraits<true, 256, 128, 80, true, true>;
using Fp16D256Bc80Tmao = Sm90FwdTraits<false, 256, 128, 80, true, true>;
// D = 64 with 192 query rows per tile (three consumer warpgroups), one tile per CTA, TMA store.
using Bf16D64Br192Tmao = Sm90FwdTraits<true, 64, 192, 128, true, true>;
using Fp16D64Br192Tmao = Sm90FwdTraits<false, 64, 192, 128, true, true>;
// K/V multicast to a cluster of two CTAs ("mc"): the one-tile-per-CTA TMA-store kernels of d128 (B_c 176
// and 128), d256 (B_c 80) and d64 (B_r 192).
using Bf16D128Bc176McTmao = Sm90FwdTraits<true, 128, 128, 176, true, true, false, false, 2, true>;
using Fp16D128Bc176McTmao = Sm90FwdTraits<false, 128, 128, 176, true, true, false, false, 2, true>;
using Bf16D128McTmao = Sm90FwdTraits<true, 128, 128, 128, true, true, false, false, 2, true>;
using Fp16D128McTmao = Sm90FwdTraits<false, 128, 128, 128, true, true, false, false, 2, true>;
using Bf16D256Bc80McTmao = Sm90FwdTraits<true, 256, 128, 80, true, true, false, false, 2, true>;
using Fp16D256Bc80McTmao = Sm90FwdTraits<false, 256, 128, 80, true, true, false, false, 2, true>;
using Bf16D64Br192McTmao = Sm90FwdTraits<true, 64, 192, 128, true, true, false, false, 2, true>;
using Fp16D64Br192McTmao = Sm90FwdTraits<false, 64, 192, 128, true, true, false, false, 2, true>;
// 64 query rows per CTA (one consumer warpgroup), two CTAs per SM: d64 at B_c = 128, d128 at B_c = 64
// (where two CTAs' shared memory fits).
using Bf16D64Br64Tmao = Sm90FwdTraits<true, 64, 64, 128, true, true>;
using Fp16D64Br64Tmao = Sm90FwdTraits<false, 64, 64, 128, true, true>;
using Bf16D128Br64Tmao = Sm90FwdTraits<true, 128, 64, 64, true, true>;
using Fp16D128Br64Tmao = Sm90FwdTraits<false, 128, 64, 64, true, true>;
using Bf16D64Br64Bc64Tmao = Sm90FwdTraits<true, 64, 64, 64, true, true>;
using Fp16D64Br64Bc64Tmao = Sm90FwdTraits<false, 64, 64, 64, true, true>;
// Three such CTAs per SM (d64, B_c = 64).
using Bf16D64Br64Bc64Cta3Tmao = Sm90FwdTraits<true, 64, 64, 64, true, true, false, false, 2, false, 3>;
using Fp16D64Br64Bc64Cta3Tmao = Sm90FwdTraits<false, 64, 64, 64, true, true, false, false, 2, false, 3>;
// D = 128 with 192 keys per tile (one tile per CTA, TMA store).
using Bf16D128Bc192Tmao = Sm90FwdTraits<true, 128, 128, 192, true, true>;
using Fp16D128Bc192Tmao = Sm90FwdTraits<false, 128, 128, 192, true, true>;
using Bf16D128Bc192McTmao = Sm90FwdTraits<true, 128, 128, 192, true, true, false, false, 2, true>;
using Fp16D128Bc192McTmao = Sm90FwdTraits<false, 128, 128, 192, true, true, false, false, 2, true>;
// Persistent with tiles taken at run time ("pers.dyn"): d128 and d64 at B_c = 128 (own O tile, two Q buffers).
using Bf16D128PersDyn = Sm90FwdTraits<true, 128, 128, 128, true, true, true, false, 2, false, 0, true>;
using Fp16D128PersDyn = Sm90FwdTraits<false, 128, 128, 128, true, true, true, false, 2, false, 0, true>;
using Bf16D64PersDyn = Sm90FwdTraits<true, 64, 128, 128, true, true, true, false, 2, false, 0, true>;
using Fp16D64PersDyn = Sm90FwdTraits<false, 64, 128, 128, true, true, true, false, 2, false, 0, true>;
// Persistent 192-key d128 kernel storing O from registers ("pers.rego"): Q loaded and freed by halves.
using Bf16D128Bc192PersRego = Sm90FwdTraits<true, 128, 128, 192, true, false, true>;
using Fp16D128Bc192PersRego = Sm90FwdTraits<false, 128, 128, 192, true, false, true>;

template <class T>
constexpr Sm90FwdKernel entry(const char* name) {
  return Sm90FwdKernel{name,          &plan_fwd<T>, &launch_fwd<T>, T::kBf16 ? DType::kBf16 : DType::kFp16,
                       T::kHeadDim,   T::kBlockM,     T::kBlockN,
                       T::kSmemBytes, T::kThreads};
}

const Sm90FwdKernel kKernels[] = {
    entry<Bf16D128>("sm90.bf16.d128.br128.bc128"),
    entry<Fp16D128>("sm90.fp16.d128.br128.bc128"),
    entry<Bf16D64>("sm90.bf16.d64.br128.bc128"),
    entry<Fp16D64>("sm90.fp16.d64.br128.bc128"),
    // The policy's picks on compute capability 9.0 (flashop/dispatch.py): the
    // TMA-store configs below, one tile per CTA; the others are tuner candidates.
    entry<Bf16D128Tmao>("sm90.bf16.d128.br128.bc128.tmao"),
    entry<Fp16D128Tmao>("sm90.fp16.d128.br128.bc128.tmao"),
    entry<Bf16D64Tmao>("sm90.bf16.d64.br128.bc128.tmao"),
    entry<Fp16D64Tmao>("sm90.fp16.d64.br128.bc128.tmao"),
    entry<Bf16D128Pers>("sm90.bf16.d128.br128.bc128.pers"),
    entry<Fp16D128Pers>("sm90.fp16.d128.br128.bc128.pers"),
    entry<Bf16D64Pers>("sm90.bf16.d64.br128.bc128.pers"),
    entry<Fp16D64Pers>("sm90.fp16.d64.br128.bc128.pers"),
    // Head dim 256.
    entry<Bf16D256>("sm90.bf16.d256.br128.bc64"),
    entry<Fp16D256>("sm90.fp16.d256.br128.bc64"),
    entry<Bf16D256Tmao>("sm90.bf16.d256.br128.bc64.tmao"),
    entry<Fp16D256Tmao>("sm90.fp16.d256.br128.bc64.tmao"),
    entry<Bf16D256Pers>("sm90.bf16.d256.br128.bc64.pers"),
    entry<Fp16D256Pers>("sm90.fp16.d256.br128.bc64.pers"),
    // D = 128 with 176 keys per tile.
    entry<Bf16D128Bc176Tmao>("sm90.bf16.d128.br128.bc176.tmao"),
    entry<Fp16D128Bc176Tmao>("sm90.fp16.d128.br128.bc176.tmao"),
    entry<Bf16D128Bc176Pers>("sm90.bf16.d128.br128.bc176.pers"),
    entry<Fp16D128Bc176Pers>("sm90.fp16.d128.br128.bc176.pers"),
    // Persistent with the longest-first tile order.
    entry<Bf16D128PersLpt>("sm90.bf16.d128.br128.bc128.pers.lpt"),
    entry<Fp16D128PersLpt>("sm90.fp16.d128.br128.bc128.pers.lpt"),
    entry<Bf16D128Bc176PersLpt>("sm90.bf16.d128.br128.bc176.pers.lpt"),
    entry<Fp16D128Bc176PersLpt>("sm90.fp16.d128.br128.bc176.pers.lpt"),
    entry<Bf16D256PersLpt>("sm90.bf16.d256.br128.bc64.pers.lpt"),
    entry<Fp16D256PersLpt>("sm90.fp16.d256.br128.bc64.pers.lpt"),
    entry<Bf16D64PersLpt>("sm90.bf16.d64.br128.bc128.pers.lpt"),
    entry<Fp16D64PersLpt>("sm90.fp16.d64.br128.bc128.pers.lpt"),
    // A 3-stage K/V ring.
    entry<Bf16D128St3Tmao>("sm90.bf16.d128.br128.bc128.st3.tmao"),
    entry<Fp16D128St3Tmao>("sm90.fp16.d128.br128.bc128.st3.tmao"),
    entry<Bf16D64St3Tmao>("sm90.bf16.d64.br128.bc128.st3.tmao"),
    entry<Fp16D64St3Tmao>("sm90.fp16.d64.br128.bc128.st3.tmao"),
    // D = 256, 80 keys per tile.
    entry<Bf16D256Bc80Tmao>("sm90.bf16.d256.br128.bc80.tmao"),
    entry<Fp16D256Bc80Tmao>("sm90.fp16.d256.br128.bc80.tmao"),
    // D = 64, 192 query rows per tile.
    entry<Bf16D64Br192Tmao>("sm90.bf16.d64.br192.bc128.tmao"),
    entry<Fp16D64Br192Tmao>("sm90.fp16.d64.br192.bc128.tmao"),
    // K/V multicast to a cluster of two CTAs.
    entry<Bf16D128Bc176McTmao>("sm90.bf16.d128.br128.bc176.mc.tmao"),
    entry<Fp16D128Bc176McTmao>("sm90.fp16.d128.br128.bc176.mc.tmao"),
    entry<Bf16D128McTmao>("sm90.bf16.d128.br128.bc128.mc.tmao"),
    entry<Fp16D128McTmao>("sm90.fp16.d128.br128.bc128.mc.tmao"),
    entry<Bf16D256Bc80McTmao>("sm90.bf16.d256.br128.bc80.mc.tmao"),
    entry<Fp16D256Bc80McTmao>("sm90.fp16.d256.br128.bc80.mc.tmao"),
    entry<Bf16D64Br192McTmao>("sm90.bf16.d64.br192.bc128.mc.tmao"),
    entry<Fp16D64Br192McTmao>("sm90.fp16.d64.br192.bc128.mc.tmao"),
    // 64 query rows per CTA, two CTAs per SM.
    entry<Bf16D64Br64Tmao>("sm90.bf16.d64.br64.bc128.tmao"),
    entry<Fp16D64Br64Tmao>("sm90.fp16.d64.br64.bc128.tmao"),
    entry<Bf16D128Br64Tmao>("sm90.bf16.d128.br64.bc64.tmao"),
    entry<Fp16D128Br64Tmao>("sm90.fp16.d128.br64.bc64.tmao"),
    entry<Bf16D64Br64Bc64Tmao>("sm90.bf16.d64.br64.bc64.tmao"),
    entry<Fp16D64Br64Bc64Tmao>("sm90.fp16.d64.br64.bc64.tmao"),
    // Three CTAs per SM.
    entry<Bf16D64Br64Bc64Cta3Tmao>("sm90.bf16.d64.br64.bc64.cta3.tmao"),
    entry<Fp16D64Br64Bc64Cta3Tmao>("sm90.fp16.d64.br64.bc64.cta3.tmao"),
    // D = 128, 192 keys per tile.
    entry<Bf16D128Bc192Tmao>("sm90.bf16.d128.br128.bc192.tmao"),
    entry<Fp16D128Bc192Tmao>("sm90.fp16.d128.br128.bc192.tmao"),
    entry<Bf16D128Bc192McTmao>("sm90.bf16.d128.br128.bc192.mc.tmao"),
    entry<Fp16D128Bc192McTmao>("sm90.fp16.d128.br128.bc192.mc.tmao"),
    // Persistent, tiles taken at run time.
    entry<Bf16D128PersDyn>("sm90.bf16.d128.br128.bc128.pers.dyn"),
    entry<Fp16D128PersDyn>("sm90.fp16.d128.br128.bc128.pers.dyn"),
    entry<Bf16D64PersDyn>("sm90.bf16.d64.br128.bc128.pers.dyn"),
    entry<Fp16D64PersDyn>("sm90.fp16.d64.br128.bc128.pers.dyn"),
    // Persistent, O stored from registers.
    entry<Bf16D128Bc192PersRego>("sm90.bf16.d128.br128.bc192.pers.rego"),
    entry<Fp16D128Bc192PersRego>("sm90.fp16.d128.br128.bc192.pers.rego"),
};

}  // namespace

const Sm90FwdKernel* sm90_fwd_kernels() { return kKernels; }
int num_sm90_fwd_kernels() { return static_cast<int>(sizeof(kKernels) / sizeof(kKernels[0])); }

}  // namespace sm90
}  // namespace flashop

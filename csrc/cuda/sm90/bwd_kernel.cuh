// Hopper (sm_90a) backward main kernel: FlashAttention-2's algorithm (one CTA per key tile, walking
// the query tiles that see it) on wgmma + TMA with warp specialisation. The preprocess
// (D = rowsum(dO O), lse * log2 e, dQ accumulator zeroed) and dQ conversion kernels are the
// mma.sync path's (sm80/bwd_kernel.cuh); only the main kernel differs.
//
// One CTA per (key tile of 128 rows, kv head, batch); 384 threads:
//   producer (warpgroup 0, setmaxnreg.dec 24; one thread): K_j, V_j once, then per step Q_i, dO_i,
//     lse_log2_i and D_i into a 2-stage ring (full/empty mbarriers); its warp 1 is the dQ writer (D = 64, 128);
//   consumer c (warpgroups 1, 2; setmaxnreg.inc 240): keys 64c .. 64c+63 of the tile.
// D = 64 is also built with key tiles of 64 rows (Sm90BwdTraits<kBf16, 64, 64>): 256 threads, one consumer
// (setmaxnreg.inc 232), two CTAs per SM (82 KiB of shared memory each), so that one CTA's K/V loads and dK/dV
// stores run under the other's steps; the policy takes it for short problems (dispatch.py).
// Per step (query tile i of B_r = 64 rows, one query head of the kv head's group):
//   S^T  = K_c Q_i^T            SS wgmma m64n64, K = D     (both K-major)
//   dP^T = V_c dO_i^T           SS wgmma m64n64            (issued right after S^T)
//   P^T  = exp2(S^T scale log2e - lse_log2_i), masked      (under dP^T's wgmma)
//   dV_c += P^T dO_i            RS wgmma m64nD, K = 64 queries (dO MN-major; issued before dP^T is
//                               waited for, so it runs under the next line)
//   dS^T = P^T (dP^T - D_i)
//   dK_c += dS^T Q_i            RS wgmma m64nD
//   dS_i -> shared memory ([query][key], stmatrix.trans), both consumers' halves, double-buffered
//   D = 128, 96: dQ_i[:, cD/2 : (c+1)D/2] = dS_i K[:, cD/2 : (c+1)D/2]   SS wgmma m64n(D/2), K = 128 keys
//                (K MN-major)
//   D = 64:      dQ_i += dS_i[:, keys of c] K[keys of c, :]     SS wgmma m64n64, K = 64 keys
//   dQ fragments -> D = 64, 128: shared memory, then one TMA reduce-add per 32-column box issued by the dQ
//                   writer (cp.reduce.async.bulk.tensor; rows of 16-query groups paired, see bwd_dq_paired_row),
//                   so that no consumer waits for the adds (the backward 1.01-1.07x at d64 and d128, H200);
//                   D = 96: red.global.add.v2.f32. Into the fp32 accumulator, unscaled.
// dK (times softmax_scale) and dV are written at the end, through the K and V tiles at D = 64 and 128 (16-byte
// row stores), from registers at D = 96. GQA: the walk covers every
// query head of the kv head's group, so dK/dV are summed over the group without atomics.
// D = 96 tiles are 32-column blocks in the 64B swizzle, K 16-column blocks in the 32B swizzle
// (Sm90BwdTraits::kColBlock, kKColBlock; 130 KiB).
// Shared memory (128B-swizzled tiles of 64 columns, as the TMA maps write them), D = 128 (64): K, V
// 2 x 32 (16) KiB; Q, dO 2 stages x 16 (8) KiB each; dS 2 buffers x 16 KiB; dQ 2 consumers x 16 KiB; lse/D
// 2 stages x 512 B: 193 (129) KiB.
// Head dimension: the kernel is compiled for a tile width kHeadDim (64, 96 or 128) and takes the true head
// dimension p.headdim (a multiple of 8, <= kHeadDim) at run time. The TMA maps' dim 0 is p.headdim, so
// the columns past it of the Q, dO, K, V tiles arrive as zeros (out-of-bounds fill; a column box
// wholly past it is all zeros) and every product over kHeadDim equals the product over the true
// columns; the dK/dV stores skip the columns past p.headdim. The dQ accumulator rows are kHeadDim
// wide (bwd_params.h): dQ adds past p.headdim (D = 64, 128) add zeros to padding the convert kernel
// never reads.
// Not deterministic (dQ atomics): the glue routes deterministic=True to the mma.sync kernels.
// Block order: blockIdx (x, y, z) = (key tile, kv head, batch); the ".lpt" build Sm90BwdLpt<traits> takes a
// causal problem's blocks longest first instead ("block order" below).
// Tile widths 160 .. 256: bwd_kernel_sm90_wide below (64 keys per CTA, the consumers split the columns);
// at 192 also bwd_kernel_sm90_wide_keys (96 keys per CTA, the consumers split the keys), at 256
// bwd_kernel_sm90_wide_kv_transposed (80 keys per CTA, dK^T and dV^T, the consumers split D).
// Windows, softcap and ALiBi: the second instantiation Sm90BwdVariants<traits> of both kernels (query-tile
// range from both window bounds, bwd_variant_probs for P and softcap's dS factor); see "attention
// variants" below. Packed batches: a third, Sm90BwdPacked<traits> (see "packed batches" below).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../bwd_params.h"
#include "bwd_lpt.h"
#include "bwd_tail.h"
#include "primitives.cuh"
#include "softmax.cuh"

namespace flashop {
namespace sm90 {

template <bool kBf16_, int kHeadDim_, int kBlockN_ = 128, int kBlockM_ = 64>
struct Sm90BwdTraits {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;  // the tile width: 64, 96 or 128
  // Keys per CTA: 128 (two consumer warpgroups of 64 keys), or 64 at D = 64 (one consumer warpgroup, 256
  // threads, two CTAs per SM, so that one CTA's K/V loads and dK/dV stores run under the other's steps).
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumers = kBlockN / 64;
  static_assert(kBlockN == 128 || (kBlockN == 64 && kHeadDim == 64), "B_c = 128, or 64 at D = 64");
  // Queries per step: 64, or 128 at D = 64 with B_c = 128 (FlashAttention-3's d64 tile: S^T and dP^T are m64n128,
  // twice the tensor work per step's fixed costs). There each thread's 32 query columns of lse and D come by
  // shuffles (bwd_load_cols_shuffled), dV is issued after dS (P^T, dP^T and dV, dK are 192 registers), and dQ
  // splits the queries between the consumers (kDQSplitRows). No variants or packed build.
  static constexpr int kBlockM = kBlockM_;
  static_assert(kBlockM == 64 || (kBlockM == 128 && kHeadDim == 64 && kBlockN == 128),
                "B_r = 64, or 128 at D = 64 with B_c = 128");
  static constexpr bool kShuffledCols = kBlockM == 128;
  static constexpr bool kWide = false;        // bwd_kernel_sm90 (Sm90BwdWideTraits: bwd_kernel_sm90_wide)
  static constexpr bool kKeySplit = false;    // see Sm90BwdWideTraits
  static constexpr bool kTransposedKV = false;  // see Sm90BwdWideTraits
  // The attention variants are a second instantiation, Sm90BwdVariants<traits> (below).
  static constexpr bool kVariants = false;
  static constexpr bool kSupportsVariants = kBlockM == 64;
  // Packed batches are a third instantiation, Sm90BwdPacked<traits> (below).
  static constexpr bool kPacked = false;
  // The longest-first block order is the build Sm90BwdLpt<traits> (below).
  static constexpr bool kLongestFirst = false;
  // The pieces of a tail split are the build Sm90BwdTail<traits> (below).
  static constexpr bool kTail = false;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the sm90 backward takes D = 64, 96 or 128");
  // Q, dO and V tiles (K too, except at D = 96: kKColBlock below) are column blocks of kColBlock
  // elements, one swizzle span per row, as the TMA maps write them (the forward's layouts, fwd_traits.cuh): 64 (128 bytes, 128B swizzle, 1024-byte
  // atoms of 8 rows) at D = 64 and 128; 32 (64 bytes, 64B swizzle, 512-byte atoms) at D = 96. K-major
  // operands (S^T, dP^T) take two k16 steps of 32 bytes per 32-column block, four per 64-column one;
  // MN-major operands (dV, dK, dQ) walk D in column blocks one block apart (LBO).
  static constexpr int kColBlock = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kRowBytes = 2 * kColBlock;
  static constexpr int kAtomBytes = 8 * kRowBytes;
  static constexpr int kDBlocks = kHeadDim / kColBlock;  // column blocks of a Q, dO or V tile
  // dQ_i = dS K over the 128 keys: at D = 128 and 96 each consumer computes half of the columns from
  // both consumers' dS (one barrier over 256 threads); at D = 64 each consumer adds the partial product of
  // its own 64 keys (twice the bytes added, a barrier of its own warpgroup): splitting the columns there
  // (K in 64B-swizzled 32-column blocks) ran at 0.86x cuDNN against 0.87-0.91x (H200, bf16, 1k-16k). D = 96
  // splits the columns for the atomics: 12 red.v2 per thread and step instead of 24 over split keys.
  // B_r = 128: consumer c computes dQ for queries 64c .. 64c+63 over all 128 keys (one barrier over 256 threads).
  static constexpr bool kDQSplitRows = kBlockM == 128;
  static constexpr bool kDQSplitKeys = (kHeadDim == 64 || kConsumers == 1) && !kDQSplitRows;
  // dK's k16 steps issued before the dS barrier; the rest follow dQ and run under dQ's stores
  // (FlashAttention-3's order; within noise of all of dK first, d128 bf16 on an H100).
  static constexpr int kDKEarlySteps = 2;
  static constexpr int kDQCols = kDQSplitKeys || kDQSplitRows ? kHeadDim : kHeadDim / 2;  // N of the dQ wgmma
  // K is dQ's MN-major B operand as well as S^T's K-major A. At D = 96 its blocks are 16 columns in the
  // 32B swizzle (32-byte rows, 256-byte atoms), so that each consumer's 48 dQ columns are three whole
  // blocks: the canonical MN-major layouts have N = 16m in the 32B swizzle but 32m in the 64B one, where
  // the second consumer's columns 48 .. 95 would start inside a block. S^T then takes one k16 step per
  // K block. Elsewhere K has the tile's blocks.
  static constexpr int kKColBlock = kHeadDim == 96 ? 16 : kColBlock;
  static constexpr int kKRowBytes = 2 * kKColBlock;
  static constexpr int kKAtomBytes = 8 * kKRowBytes;
  static constexpr int kKBlocks = kHeadDim / kKColBlock;
  static_assert(kDQSplitKeys || kDQCols % kKColBlock == 0, "each consumer's dQ columns are whole K blocks");
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kCtasPerSm = kConsumers == 1 ? 2 : 1;
  static constexpr int kProducerRegs = 24;
  // All of the CTA's share of the register file (65536 / kCtasPerSm) goes to its warpgroups.
  static constexpr int kConsumerRegs = kConsumers == 1 ? 232 : 240;
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536 / kCtasPerSm, "register file");
  // A column block of a tile: 16 (8) KiB of K or V, 8 (4) KiB of Q or dO with 128-byte (64-byte) rows.
  static constexpr uint32_t kKVBlock = kBlockN * kRowBytes;
  static constexpr uint32_t kKBlock = kBlockN * kKRowBytes;  // a column block of K
  static constexpr uint32_t kQBlock = kBlockM * kRowBytes;
  // One 64-key block of dS ([query][key], 128-byte rows, 128B swizzle whatever D): 8 KiB (16 KiB at B_r = 128).
  static constexpr uint32_t kDSBlock = kBlockM * 64 * 2;
  static constexpr uint32_t kKVTile = kDBlocks * kKVBlock;
  static constexpr uint32_t kQTile = kDBlocks * kQBlock;
  static constexpr uint32_t kKOff = 0;
  static constexpr uint32_t kVOff = kKOff + kKVTile;
  static constexpr uint32_t kQOff = kVOff + kKVTile;               // stage s at + s * kQTile
  static constexpr uint32_t kDOOff = kQOff + kStages * kQTile;
  static constexpr uint32_t kDSOff = kDOOff + kStages * kQTile;    // buffer u, key block c at + (kConsumers u + c) kDSBlock
  // dQ leaves through shared memory at D = 64 and 128 (kDQBulk): each consumer stores its m64 x kDQCols fp32
  // fragments into 32-column boxes (128-byte rows, 128B swizzle), one thread reduce-adds them into the
  // accumulator (TMA), and the next step's barrier before dQ frees them. D = 96 (48 columns a consumer) keeps
  // red.global.add.
  static constexpr bool kDQBulk = kHeadDim != 96;
  static constexpr BwdDQLayout kDQLayout = kDQBulk ? BwdDQLayout::kPairedRows : BwdDQLayout::kRows;
  // With kDQBulk, warp 1 of the producer warpgroup issues the reduce-adds (FlashAttention-3's dQ writer): consumer c
  // arrives on named barrier kDQFullBar + c once its boxes are written, and syncs on kDQEmptyBar + c, which the writer
  // arrives on once the adds have read them, before it writes the next step's (barriers of 128 + 32 threads).
  static constexpr int kDQFullBar = 4, kDQEmptyBar = 6, kDQBarThreads = 128 + 32;
  static constexpr int kDQRows = 64;                 // rows of a consumer's dQ tile
  static constexpr uint32_t kDQBox = kDQRows * 128;  // 64 rows x 32 fp32 columns
  static constexpr uint32_t kDQConsumerBytes = kDQBulk ? kDQCols / 32 * kDQBox : 0;
  static constexpr uint32_t kDQOff = kDSOff + 2 * kConsumers * kDSBlock;  // consumer c at + c * kDQConsumerBytes
  static constexpr uint32_t kLseOff = kDQOff + kConsumers * kDQConsumerBytes;  // stage s at + s * 256
  static constexpr uint32_t kDsumOff = kLseOff + kStages * kBlockM * 4;
  static constexpr uint32_t kBarOff = kDsumOff + kStages * kBlockM * 4;
  static constexpr uint32_t kBars = 1 + 2 * kStages;  // kv_full, full[s], empty[s]
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes in the kernel.
  static constexpr uint32_t kSmemBytes = kBarOff + 8 * kBars + 1024;
  static constexpr uint32_t kStepTxBytes = 2 * kQTile + 2 * kBlockM * 4;  // Q, dO, lse, D
  // Every tile and column block starts on a swizzle atom (the TMA's and the descriptors' patterns agree
  // with base offset 0); dS's 128B-swizzled blocks on 1024 bytes. D = 96: K, V 2 x 24 KiB; Q, dO 2 stages
  // x 12 KiB each; dS 2 x 16 KiB; lse/D 1 KiB: 130 KiB + barriers + slack.
  static_assert(kKVBlock % kAtomBytes == 0 && kQBlock % kAtomBytes == 0 && kVOff % kAtomBytes == 0 &&
                    kQOff % kAtomBytes == 0 && kDOOff % kAtomBytes == 0 && kDSOff % 1024 == 0 && kDQOff % 1024 == 0 &&
                    kKBlock % kKAtomBytes == 0,
                "swizzle atoms");
  static_assert(kKBlocks * kKBlock == kKVTile, "K and V tiles of one size");
  static_assert(kSmemBytes + 1024 <= 228 * 1024 / kCtasPerSm, "shared memory (1 KiB of each CTA's is reserved)");
};

// The wgmma descriptor of a Q, dO, K or V operand at smem_addr in column blocks of kRowBytes-byte rows
// (128, 64 or 32: the 128B, 64B or 32B swizzle; SBO = one atom of 8 rows).
template <int kRowBytes>
__device__ __forceinline__ uint64_t bwd_tile_desc(uint32_t smem_addr, uint32_t lbo_bytes) {
  if constexpr (kRowBytes == 128) return make_desc_sw128(smem_addr, lbo_bytes, 8 * kRowBytes);
  else if constexpr (kRowBytes == 64) return make_desc_sw<64>(smem_addr, lbo_bytes, 8 * kRowBytes);
  else return make_desc_sw32(smem_addr, lbo_bytes, 8 * kRowBytes);
}

// 1-D bulk copy global -> shared (16-byte multiples), completing on an mbarrier.
__device__ __forceinline__ void bulk_load(uint32_t smem_dst, const void* src, uint32_t bytes, uint32_t bar) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
#endif
}

// Four 8x8 16-bit matrices stored transposed (row r of matrix i from lane 8i + r's address).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

// Four 8x8 16-bit matrices (row r of matrix i from lane 8i + r's address).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#endif
}

// Two 8x8 16-bit matrices (row r of matrix i from lane 8i + r's address; lanes 16-31 give none).
__device__ __forceinline__ void stmatrix_x2(uint32_t addr, uint32_t r0, uint32_t r1) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1) : "memory");
#endif
}

// Pairs, not quads: red.v4 with lanes t and t ^ 1 trading pairs (half the red instructions, two shuffles per n8 block)
// ran the d96 backward at 0.92x cuDNN against 0.95x (H200, bf16, 1k-16k), d256 within noise.
__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
#endif
}

// Four floats of a kFragments dQ accumulator (Sm90BwdWideTraits::kDQLayout): a warp's 512 contiguous bytes.
__device__ __forceinline__ void red_add_v4(float* addr, float a, float b, float c, float d) {
#ifdef FLASHOP_SM90_ENABLED
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#endif
}

// dQ of an m64 x kN wgmma accumulator of consumer c (0 or 1), columns kConsumerCols c + col_offset + 8 i + 2 t
// and + 1 of n8 block i, queries 16 warp + g and + 8, added into a 64-query tile of the fp32 accumulator in
// fragment order (BwdDQLayout::kFragments, bwd_dq_fragment_offset): one red.global.add.v4 an n8 block, a warp's
// 512 contiguous bytes. The n8 blocks at or past the head dimension hold zeros and are not added (one uniform
// compare a block). All 64 rows are added: rows past the sequence have dS = 0 exactly (Q, dO rows zero-filled or
// zeroed, lse_log2 = +inf, D = 0) and land in the tile's own workspace rows, which the convert kernel does not read.
// col_offset is a constant after unrolling: the offsets are then constants selected by c (a column offset computed
// at run time cost the B_c = 80 build 8 bytes of spills).
template <int kN, int kConsumerCols>
__device__ __forceinline__ void bwd_add_dq_fragments(float* tile, const float (&dq)[kN / 2], int c, int col_offset,
                                                     int headdim, int warp, int g, int t) {
  float* thread_tile = tile + bwd_dq_fragment_offset(16 * warp + g, 2 * t);
  if constexpr (kConsumerCols % 64 == 0) thread_tile += c * (kConsumerCols / 64 * 4096);
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
    const int col = kConsumerCols * c + col_offset + 8 * i;
    if (col >= headdim) break;
    int offset = bwd_dq_fragment_offset(0, col_offset + 8 * i);
    if constexpr (kConsumerCols % 64 != 0)
      offset = c == 0 ? offset : bwd_dq_fragment_offset(0, kConsumerCols + col_offset + 8 * i);
    red_add_v4(thread_tile + offset, dq[4 * i], dq[4 * i + 1], dq[4 * i + 2], dq[4 * i + 3]);
  }
}

__device__ __forceinline__ void fence_regs_u32(uint32_t (&r)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// First query tile of B_r rows that sees key `key0` (bottom-right causal: query i sees key j iff
// j <= i + Sk - Sq); 0 when not causal. May be >= the number of query tiles (no work).
__device__ __forceinline__ int bwd_first_query_tile(const BwdParams& p, int key0, int block_m) {
  if (!p.causal) return 0;
  const int64_t q = int64_t(key0) - (int64_t(p.seqlen_k) - p.seqlen_q);
  return q <= 0 ? 0 : static_cast<int>(q / block_m);
}

// The per-column values (lse_log2 or D) of an accumulator's columns 8i + 2t, +1 (n8 blocks i < kBlocks) from a
// row of floats in shared memory at `addr` (the step's first column).
template <int kBlocks>
__device__ __forceinline__ void bwd_load_cols(float (&cols)[2 * kBlocks], uint32_t addr, int t) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                 : "=f"(cols[2 * i]), "=f"(cols[2 * i + 1])
                 : "r"(addr + (8 * i + 2 * t) * 4));
}

// The same values held one eighth per lane (B_r = 128: 32 columns a thread would take 32 registers each for lse
// and D): lane 4g + t loads the pairs of n8 blocks g, g + 8, ... (own[2j], own[2j + 1]: block g + 8j), and
// bwd_shuffled_col hands block i's pair to the lanes 4g' + t from lane 4 (i % 8) + t.
template <int kBlocks>
__device__ __forceinline__ void bwd_load_cols_shuffled(float (&own)[kBlocks / 4], uint32_t addr, int g, int t) {
  static_assert(kBlocks % 8 == 0, "whole groups of 8 n8 blocks");
#pragma unroll
  for (int j = 0; j < kBlocks / 8; ++j)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                 : "=f"(own[2 * j]), "=f"(own[2 * j + 1])
                 : "r"(addr + (8 * (g + 8 * j) + 2 * t) * 4));
}

// Column 8i + 2t + odd's value from the lanes' bwd_load_cols_shuffled (every lane of the warp calls it alike).
template <int kBlocks>
__device__ __forceinline__ float bwd_shuffled_col(const float (&own)[kBlocks / 4], int i, int odd, int t) {
  return __shfl_sync(0xffffffffu, own[2 * (i / 8) + odd], 4 * (i % 8) + t);
}

// Zeroes the scores of keys past Sk and right of the causal diagonal in an m64 x 8 kBlocks accumulator (rows: keys
// key_lo, key_lo + 8; columns: queries q_lo + 8i, +1). Element (i, e) is column 8i + (e & 1) of key row h = e >> 1:
// visible iff that column is at least first[h] (key < Sk, and causal key <= query + Sk - Sq), computed once, so
// that each element's test compares an immediate.
template <int kBlocks>
__device__ __forceinline__ void bwd_dense_mask(float (&st)[4 * kBlocks], const BwdParams& p, int key_lo, int64_t q_lo) {
  int first[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_lo + 8 * h;
    int64_t f = p.causal ? int64_t(key) - q_lo - (int64_t(p.seqlen_k) - p.seqlen_q) : 0;
    if (key >= p.seqlen_k) f = 8 * kBlocks;
    first[h] = static_cast<int>(max(min(f, int64_t(8 * kBlocks)), int64_t(0)));
  }
#pragma unroll
  for (int i = 0; i < kBlocks; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (8 * i + (e & 1) < first[e >> 1]) st[4 * i + e] = 0.f;
}

// P^T = exp2(S^T scale log2(e) - lse_log2) in place on an m64 x 8 kBlocks accumulator of raw scores (rows: keys
// key_lo, key_lo + 8; columns: queries q_lo + 8i, +1 with lse_log2 lse_cols[2i], [2i + 1]). With need_mask (the
// tile crosses Sk or, causal, the diagonal: the caller's test, uniform per warp), keys past Sk and right of the
// diagonal are zeroed in a pass of their own: behind one branch, where a test per element branched 32 times.
template <int kBlocks>
__device__ __forceinline__ void bwd_dense_probs(float (&st)[4 * kBlocks], const float (&lse_cols)[2 * kBlocks],
                                                const BwdParams& p, int key_lo, int64_t q_lo, bool need_mask) {
#pragma unroll
  for (int i = 0; i < 4 * kBlocks; ++i) st[i] = exp2f(st[i] * p.scale_log2 - lse_cols[2 * (i / 4) + (i & 1)]);
  if (need_mask) bwd_dense_mask<kBlocks>(st, p, key_lo, q_lo);
}

// bwd_dense_probs with the lse_log2 of the columns from the lanes' bwd_load_cols_shuffled.
template <int kBlocks>
__device__ __forceinline__ void bwd_dense_probs_shuffled(float (&st)[4 * kBlocks], const float (&lse_own)[kBlocks / 4],
                                                         const BwdParams& p, int key_lo, int64_t q_lo, int t,
                                                         bool need_mask) {
#pragma unroll
  for (int i = 0; i < kBlocks; ++i) {
    const float l0 = bwd_shuffled_col<kBlocks>(lse_own, i, 0, t), l1 = bwd_shuffled_col<kBlocks>(lse_own, i, 1, t);
#pragma unroll
    for (int e = 0; e < 4; ++e) st[4 * i + e] = exp2f(st[4 * i + e] * p.scale_log2 - ((e & 1) ? l1 : l0));
  }
  if (need_mask) bwd_dense_mask<kBlocks>(st, p, key_lo, q_lo);
}

// Whether keys key0 .. key0 + n_keys - 1 against queries from q_first need bwd_dense_probs' mask.
__device__ __forceinline__ bool bwd_dense_need_mask(const BwdParams& p, int key0, int n_keys, int64_t q_first) {
  return key0 + n_keys > p.seqlen_k ||
         (p.causal && int64_t(key0) + n_keys - 1 > q_first + (int64_t(p.seqlen_k) - p.seqlen_q));
}

// ------------------------------------------------------------------ block order
// The ".lpt" build of a config (configs.py HopperBackwardConfig.longest_first): the same kernel, the
// blocks of a causal problem taken in the longest-first order of bwd_lpt_block (key-tile major within
// groups of (batch, kv head) pairs sized by bwd_lpt_pairs), read from the dispatch index (blockIdx.x
// fastest, then y, then z). Other problems (dense, windows) keep the plain order: their key tiles cost
// about the same. The order only permutes which CTA computes which (key tile, kv head, batch): every
// CTA's work is a function of that triple alone, so results are those of the plain build.
// The variants build of bwd_kernel_sm90 (causal with softcap or ALiBi) keeps the plain order: it is at
// R237 of 240, and the computed coordinates (blockIdx is reread where needed) spilled 44 bytes in its
// loop; the wide kernel's variants build takes the order (R227 at d256, no spills).
template <class T>
struct Sm90BwdLpt : T {
  static constexpr bool kLongestFirst = true;
};

// The (key tile, kv head, batch) of this CTA; the producer and the consumers compute it alike.
template <class T>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParams& p) {
  if constexpr (T::kLongestFirst && (T::kWide || !T::kVariants)) {
    const uint32_t n_tiles = gridDim.x, heads = gridDim.y, batch = gridDim.z;
    // 32-bit: exact below 2^32 blocks (bwd_lpt.h), far beyond any problem's memory.
    if (p.causal && uint64_t(n_tiles) * heads * batch <= 0xffffffffu) {
      const uint32_t index = blockIdx.x + n_tiles * (blockIdx.y + heads * blockIdx.z);
      return bwd_lpt_block<uint32_t>(
          index, n_tiles, heads, batch,
          bwd_lpt_pairs(p.sm_count, n_tiles, p.l2_bytes, p.seqlen_q_rounded, T::kHeadDim, p.head_ratio));
    }
  }
  return BwdBlock{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}

// ------------------------------------------------------------------ tail split
// A dense non-causal call whose last wave of blocks is at most half full (bwd_tail.h; the launch's p.tail) runs
// those blocks as pieces over runs of their query steps: Sm90BwdTail<traits>, a kernel of their own launched
// after the dense build as its programmatic dependent (its CTAs fill the SMs the dense grid's last wave frees);
// the dense build's CTAs for those blocks return at once. A piece adds its dK and dV into a workspace
// (p.dkv_tail) that bwd_convert_tail_kernel writes out; dQ it adds as every block does. The dense build's walk
// is unchanged (its code differs only in its first lines: the return, and the trigger of the pieces' launch).
template <class T>
constexpr bool bwd_takes_tail_split = !T::kWide && !T::kVariants && !T::kLongestFirst && !T::kTail;

template <class T>
struct Sm90BwdTail : T {
  static_assert(bwd_takes_tail_split<T>, "the tail split runs the dense build's blocks");
  static constexpr bool kTail = true;
};

// The consumer index of warpgroup wg (warpgroup 1 is consumer 0), through a shuffle so that the compiler knows it is
// warp-uniform: addresses and branches on it keep the uniform datapath. The variants and packed builds take the plain
// value: with the shuffle their loops spill (4-8 bytes at d128).
template <class T>
__device__ __forceinline__ int bwd_consumer_index(int wg) {
  if constexpr (T::kVariants) return wg - 1;
  else return __shfl_sync(0xffffffffu, wg - 1, 0);
}

// ------------------------------------------------------------------ attention variants
// Windows, softcap and ALiBi (csrc/attention_variants.h) are compiled into a second instantiation of
// each backward kernel, Sm90BwdVariants<traits>, which launch_bwd runs only for a call that asks for
// one (bwd_variants_requested); the dense build's code is unchanged. Sinks need nothing here: the
// forward's lse includes them, and P = exp(score - lse) is all the backward recomputes.
template <class T>
struct Sm90BwdVariants : T {
  static constexpr bool kVariants = true;
};

// A window other than plain causal (the dense kernels' p.causal), softcap or ALiBi.
inline bool bwd_variants_requested(const AttentionVariants& v) {
  return v.local() || v.softcap > 0.f || v.alibi_slopes != nullptr;
}

constexpr float kBwdLog2e = 1.4426950408889634f;

// The query tiles of B_r rows that see some key of the CTA's keys key0 .. key0 + B_c - 1:
// m_first .. m_first + count - 1, the same for the producer and the consumers. Dense: from the first
// tile on the causal diagonal (0 when not causal) to the last. Variants: with off = Sk - Sq, query i
// sees key j iff j - off - window_right <= i <= j - off + window_left (a bound of -1: none; causal is
// (-1, 0)), so keys k0 .. k1 are seen by the queries k0 - off - window_right .. k1 - off + window_left
// (one run: each key's run is its predecessor's shifted by one), clipped to 0 .. Sq - 1. None: count 0
// (the CTA writes dK = dV = 0). A query tile no CTA visits keeps the zeros the preprocess wrote into
// its dQ accumulator rows, and the convert kernel writes dQ = 0 there. sq, sk: Sq and Sk of the variants
// build (a packed batch's sequence: its used queries and keys; keys past sk have no query tile).
template <class T>
__device__ __forceinline__ void bwd_query_tiles(const BwdParams& p, int key0, int sq, int sk, int& m_first,
                                                int& count) {
  constexpr int kBM = T::kBlockM;
  if constexpr (!T::kVariants) {
    const int m_tiles = (p.seqlen_q + kBM - 1) / kBM;
    m_first = bwd_first_query_tile(p, key0, kBM);
    count = m_first < m_tiles ? m_tiles - m_first : 0;
  } else if constexpr (!T::kPacked) {
    const int wl = p.variants.window_left, wr = p.variants.window_right;
    const int64_t off = int64_t(p.seqlen_k) - p.seqlen_q;
    const int64_t k1 = min(key0 + T::kBlockN, p.seqlen_k) - 1;  // key0 < Sk: the grid's tiles
    const int64_t q_begin = wr >= 0 ? max(int64_t(key0) - off - wr, int64_t(0)) : int64_t(0);
    const int64_t q_end = wl >= 0 ? min(k1 - off + wl + 1, int64_t(p.seqlen_q)) : int64_t(p.seqlen_q);
    if (q_end <= q_begin) {
      m_first = 0;
      count = 0;
    } else {
      m_first = static_cast<int>(q_begin / kBM);
      count = static_cast<int>((q_end + kBM - 1) / kBM) - m_first;
    }
  } else {  // the same over the sequence's sq queries and sk keys; none for a key tile past them
    const int wl = p.variants.window_left, wr = p.variants.window_right;
    const int64_t off = int64_t(sk) - sq;
    const int64_t k1 = min(key0 + T::kBlockN, sk) - 1;
    const int64_t q_begin = wr >= 0 ? max(int64_t(key0) - off - wr, int64_t(0)) : int64_t(0);
    const int64_t q_end = wl >= 0 ? min(k1 - off + wl + 1, int64_t(sq)) : int64_t(sq);
    if (q_end <= q_begin || key0 >= sk) {
      m_first = 0;
      count = 0;
    } else {
      m_first = static_cast<int>(q_begin / kBM);
      count = static_cast<int>((q_end + kBM - 1) / kBM) - m_first;
    }
  }
}

// The variants build's P^T on an m64 x (8 kBlocks) S^T accumulator of raw scores x = q.k (rows: keys,
// columns: queries), in place, with its 16-bit A fragments (the layout of the dense kernels' fragment():
// n8 block i, rows h = 0 / 1 into pf[i / 2][2 (i % 2) + h]) for the P^T dO product. Element (i, e) is key
// key_lo + 8 (e >> 1) and query q_lo + 8i + (e & 1) (q_lo: the thread's query of column 2t in block 0),
// its lse_log2 at sLse + 4 (8i + 2t + (e & 1)). In units of log2:
//   z = score log2(e) = softcap log2(e) tanh(x scale / softcap)  (softcap > 0; else x scale log2(e))
//       - slope log2(e) |query + off - key|                       (ALiBi; slope 0 without)
//   P = exp2(z - lse_log2), 0 outside the window and for keys >= Sk.
// The same tanh.approx and argument as the forward's (its lse is the normaliser P must agree with).
// Softcap's chain rule: d score / d x = scale (1 - tanh^2(x scale / softcap)); scale is applied to dK and
// dQ at the end as in the dense kernels, so dS = P (dP - D) (1 - tanh^2). The factor rides in st: after
// the fragments are packed from P, st holds P (1 - tanh^2), and the dense dS^T = st (dP^T - D) line
// gives the capped dS with no register of its own. ALiBi's bias is constant in q, k: no gradient.
// need_mask: this thread's tile crosses a window edge or Sk (decided by the caller, uniform per warp).
// kPacked: Sq and Sk are sq and sk, a packed batch's sequence's used queries and keys (keys and queries
// are the sequence's own indices); else the params' (read where used, as ptxas schedules best).
template <bool kBf16, bool kSoftcap, int kBlocks, bool kPacked>
__device__ __forceinline__ void bwd_variant_probs(float (&st)[4 * kBlocks], uint32_t (&pf)[kBlocks / 2][4],
                                                  const BwdParams& p, uint32_t sLse, int t, int key_lo,
                                                  int q_lo, float slope_l2, bool need_mask, int sq, int sk) {
  const float cap_in = kSoftcap ? p.scale / p.variants.softcap : 0.f;
  const float cap_l2 = p.variants.softcap * kBwdLog2e;
  // |query + off - key| of element (i, e) = |dist0 + 8i + (e & 1) - 8 (e >> 1)|: exact in float below 2^24.
  const float dist0 = static_cast<float>(int64_t(q_lo) + (kPacked ? sk : p.seqlen_k) - (kPacked ? sq : p.seqlen_q) -
                                         key_lo);
  // Visible iff lo <= key - query <= hi and key < Sk (key - query of element (i, e) = rel0 - 8i - (e & 1)
  // + 8 (e >> 1)); off + window_right and off - window_left clipped to the range of int.
  const int wl = p.variants.window_left, wr = p.variants.window_right;
  const int64_t off = int64_t(kPacked ? sk : p.seqlen_k) - (kPacked ? sq : p.seqlen_q);
  const int hi = wr >= 0 ? static_cast<int>(min(off + wr, int64_t(INT32_MAX))) : INT32_MAX;
  const int lo = wl >= 0 ? static_cast<int>(max(off - wl, int64_t(INT32_MIN))) : INT32_MIN;
  const int rel0 = key_lo - q_lo;
#pragma unroll
  for (int i = 0; i < kBlocks; ++i) {
    float lse0, lse1;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(lse0), "=f"(lse1) : "r"(sLse + (8 * i + 2 * t) * 4));
    float pr[4], dt[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = st[4 * i + e];
      float z;
      dt[e] = 1.f;
      if constexpr (kSoftcap) {
        const float th = tanh_approx(x * cap_in);
        z = th * cap_l2;
        dt[e] = fmaf(-th, th, 1.f);
      } else {
        z = x * p.scale_log2;
      }
      z = fmaf(-slope_l2, fabsf(dist0 + static_cast<float>(8 * i + (e & 1) - 8 * (e >> 1))), z);
      float pv = exp2f(z - ((e & 1) ? lse1 : lse0));
      if (need_mask) {
        const int key = key_lo + ((e & 2) ? 8 : 0);
        const int rel = rel0 - 8 * i - (e & 1) + ((e & 2) ? 8 : 0);
        if (key >= (kPacked ? sk : p.seqlen_k) || rel > hi || rel < lo) pv = 0.f;
      }
      pr[e] = pv;
    }
    pf[i / 2][2 * (i % 2)] = pack2<kBf16>(pr[0], pr[1]);
    pf[i / 2][2 * (i % 2) + 1] = pack2<kBf16>(pr[2], pr[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) st[4 * i + e] = kSoftcap ? pr[e] * dt[e] : pr[e];
  }
}

// Whether the variants build masks a step: keys k0 .. k0 + 63 (a consumer's) against queries
// q0 .. q0 + nq - 1 cross Sk or a window edge (some pair outside the window). Queries past Sq count as
// rows (conservative: their P is 0 anyway, lse_log2 = +inf on the padding). kPacked, sq, sk as
// bwd_variant_probs'.
template <bool kPacked>
__device__ __forceinline__ bool bwd_variant_need_mask(const BwdParams& p, int k0, int q0, int nq, int sq, int sk) {
  const int wl = p.variants.window_left, wr = p.variants.window_right;
  const int64_t off = int64_t(kPacked ? sk : p.seqlen_k) - (kPacked ? sq : p.seqlen_q);
  return k0 + 64 > (kPacked ? sk : p.seqlen_k) || (wr >= 0 && int64_t(k0) + 63 > int64_t(q0) + off + wr) ||
         (wl >= 0 && int64_t(k0) < int64_t(q0) + nq - 1 + off - wl);
}

// The slope of (batch b, query head hq) times log2(e); 0 without ALiBi.
__device__ __forceinline__ float bwd_alibi_slope_l2(const BwdParams& p, int b, int hq) {
  const float* slopes = p.variants.alibi_slopes;
  return slopes != nullptr ? __ldg(slopes + b * p.variants.alibi_batch_stride + hq) * kBwdLog2e : 0.f;
}

// ------------------------------------------------------------------ packed batches
// Packed batches (p.packed, csrc/packed_sequences.h) run on a third instantiation, Sm90BwdPacked<traits>:
// the variants build (causal is its (-1, 0) window) with b the sequence. The TMA maps cover all packed
// rows as one batch (bwd_launch.cuh) and every load starts at the sequence's first row; queries and keys
// are the sequence's own indices, so masks, windows and ALiBi distances are those of a batch-1 problem of
// its used_q queries and used_k keys. A box may reach past them (rows past seqused, or the next sequence's
// rows): the consumers zero those rows of the K, V tiles once and of a Q, dO stage when its query tile
// crosses used_q (bwd_zero_rows), so that they contribute exactly nothing whatever they hold, and keys
// past used_k are masked as keys past Sk. The stores are register stores inside the sequence: dQ
// accumulator adds for its used rows (workspace rows of bwd_packed_ws_row0), dK and dV for the rows it owns
// (zeros past used_k). A CTA whose key tile starts past the rows its sequence owns returns at once.
template <class T>
struct Sm90BwdPacked : Sm90BwdVariants<T> {
  static constexpr bool kPacked = true;
};

// The CTA's sequence (T::kPacked): query rows from q_start of q and dO, keys from k_start of k, v, dk and
// dv; the walk runs over its used_q queries and used_k keys, and dK, dV rows are written up to len_k.
struct BwdSequence {
  int q_start, k_start, used_q, used_k, len_k;
};

__device__ __forceinline__ BwdSequence bwd_sequence(const BwdParams& p, int b) {
  const SequenceBounds sq =
      sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, b, p.packed.total_q, p.seqlen_q);
  const SequenceBounds sk =
      sequence_bounds(p.packed.cu_seqlens_k, p.packed.seqused_k, b, p.packed.total_k, p.seqlen_k);
  return BwdSequence{sq.start, sk.start, sq.used, sk.used, sk.len};
}

// Workspace row (dq_accum, dsum, lse_log2) of the first query of sequence b (packed; q_start its first row)
// or batch entry b (dense) in query head hq's rows.
template <class T>
__device__ __forceinline__ int64_t bwd_ws_row(const BwdParams& p, int b, int hq, int q_start) {
  if constexpr (T::kPacked)
    return int64_t(hq) * bwd_packed_ws_rows(p.packed.total_q, p.batch) + bwd_packed_ws_row0(q_start, b);
  else
    return (int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded;
}

// Zeroes rows r0 .. kRows - 1 of a tile of kBlocks column blocks (kBlockBytes apart, kRowBytes per row):
// those rows are one byte range of each block whatever the swizzle (it permutes 16-byte chunks within a
// row). i: the thread's index among the kThreads consumer threads. The caller fences (fence_proxy_async_smem)
// and syncs the consumers before a wgmma reads the tile.
template <int kBlocks, uint32_t kBlockBytes, int kRowBytes, int kRows, int kThreads = 256>
__device__ __forceinline__ void bwd_zero_rows(uint32_t tile, int r0, int i) {
  const uint32_t end = kRows * kRowBytes;
#pragma unroll 1
  for (int h = 0; h < kBlocks; ++h)
#pragma unroll 1
    for (uint32_t off = uint32_t(r0) * kRowBytes + 16u * i; off < end; off += 16u * kThreads) {
#ifdef FLASHOP_SM90_ENABLED
      asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(tile + h * kBlockBytes + off), "r"(0u)
                   : "memory");
#endif
    }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    bwd_kernel_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                    const __grid_constant__ CUtensorMap tm_dq, const __grid_constant__ BwdParams p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim;
  constexpr int kConsumerThreads = 128 * T::kConsumers;
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  if constexpr (bwd_takes_tail_split<T>) {
    // Blocks of a tail split run as the pieces of Sm90BwdTail<T>, a grid launched after this one as its programmatic
    // dependent: once every CTA here has started (or returned), its CTAs take the SMs this grid's last wave frees.
    if (p.tail.pieces > 0) {
      if (int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)) >= p.tail.first_block) return;
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
  }
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = base + T::kKOff, sV = base + T::kVOff;
  const uint32_t bar_kv = base + T::kBarOff;
  auto bar_full = [&](int s) { return bar_kv + 8u * (1 + s); };
  auto bar_empty = [&](int s) { return bar_kv + 8u * (1 + T::kStages + s); };

  // Sm90BwdTail: CTA i is piece i % pieces of split block i / pieces (bwd_tail.h).
  const BwdBlock block = T::kTail ? bwd_tail_work<uint32_t>(uint32_t(p.tail.first_block) + blockIdx.x, p.tail,
                                                            uint32_t(p.seqlen_k + kBN - 1) / kBN, uint32_t(p.heads_k))
                                        .block
                                  : bwd_block<T>(p);
  const int n_block = block.n_block, hk = block.hk, b = block.b;
  const int key0 = n_block * kBN;
  // Packed: the sequence; a key tile past the rows it owns is the next sequence's (nothing to do).
  [[maybe_unused]] BwdSequence seq{};
  if constexpr (T::kPacked) {
    seq = bwd_sequence(p, b);
    if (key0 >= seq.len_k) return;
  }
  // Sq and Sk of the walk; the TMA maps' batch coordinate and the first query and key rows of b.
  auto seqlen_q = [&]() -> int { if constexpr (T::kPacked) return seq.used_q; else return p.seqlen_q; };
  auto seqlen_k = [&]() -> int { if constexpr (T::kPacked) return seq.used_k; else return p.seqlen_k; };
  const int tma_b = T::kPacked ? 0 : b;
  const int q_row0 = T::kPacked ? seq.q_start : 0, k_row0 = T::kPacked ? seq.k_start : 0;
  int m_first, per_head;  // query tiles m_first .. m_first + per_head - 1 of each query head
  bwd_query_tiles<T>(p, key0, seqlen_q(), seqlen_k(), m_first, per_head);
  // Steps (query head of the group, query tile) step_begin .. total - 1: all of them, or a piece's (Sm90BwdTail;
  // from a multiple of kBwdTailQuantum, so that the stage indices and phases below, counted from step 0, hold).
  int step_begin = 0, total = per_head * p.head_ratio;
  if constexpr (T::kTail) bwd_tail_steps(total, p.tail.pieces, int(blockIdx.x) % p.tail.pieces, step_begin, total);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    tma_prefetch_desc(&tm_q);
    tma_prefetch_desc(&tm_k);
    tma_prefetch_desc(&tm_v);
    tma_prefetch_desc(&tm_do);
    mbar_init(bar_kv, 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(bar_full(s), 1);
      mbar_init(bar_empty(s), T::kThreads - 128);  // one arrival per consumer thread
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0 && total > step_begin) {
      mbar_arrive_expect_tx(bar_kv, 2 * T::kKVTile);
      for (int h = 0; h < T::kKBlocks; ++h) {
        tma_load_4d(&tm_k, sK + h * T::kKBlock, bar_kv, T::kKColBlock * h, k_row0 + key0, hk, tma_b);
        if (h < T::kDBlocks)
          tma_load_4d(&tm_v, sV + h * T::kKVBlock, bar_kv, T::kColBlock * h, k_row0 + key0, hk, tma_b);
      }
      for (int it = step_begin; it < total; ++it) {
        const int s = it % T::kStages;
        const uint32_t use = it / T::kStages;
        if (T::kTail ? it >= step_begin + T::kStages : use > 0) mbar_wait(bar_empty(s), (use - 1) & 1);
        const int hq = hk * p.head_ratio + it / per_head;
        const int m = m_first + it % per_head;
        const uint32_t full = bar_full(s);
        mbar_arrive_expect_tx(full, T::kStepTxBytes);
        const uint32_t sQ = base + T::kQOff + s * T::kQTile, sDO = base + T::kDOOff + s * T::kQTile;
        for (int h = 0; h < T::kDBlocks; ++h) {
          tma_load_4d(&tm_q, sQ + h * T::kQBlock, full, T::kColBlock * h, q_row0 + m * kBM, hq, tma_b);
          tma_load_4d(&tm_do, sDO + h * T::kQBlock, full, T::kColBlock * h, q_row0 + m * kBM, hq, tma_b);
        }
        // The workspaces are padded to kBwdSeqQPad rows (packed: each sequence's, bwd_params.h): the whole
        // tile is in bounds.
        const int64_t row = bwd_ws_row<T>(p, b, hq, seq.q_start) + int64_t(m) * kBM;
        bulk_load(base + T::kLseOff + s * kBM * 4, p.lse_log2 + row, kBM * 4, full);
        bulk_load(base + T::kDsumOff + s * kBM * 4, p.dsum + row, kBM * 4, full);
      }
    }
    if constexpr (T::kDQBulk) {
      // The dQ writer (warp 1): per step, each consumer's boxes reduce-added into the fp32 accumulator (see add_dq
      // below), and handed back once read.
      if (tid / 32 == 1 && total > step_begin) {
        const bool lane0 = tid % 32 == 0;
        named_bar_arrive<T::kDQEmptyBar, T::kDQBarThreads>();  // the boxes start free
        if (T::kConsumers > 1) named_bar_arrive<T::kDQEmptyBar + 1, T::kDQBarThreads>();
        for (int it = step_begin; it < total; ++it) {
          const int hq = hk * p.head_ratio + it / per_head;
          const int q0 = (m_first + it % per_head) * kBM;
#pragma unroll
          for (int c = 0; c < T::kConsumers; ++c) {
            if (c == 0) named_bar_sync<T::kDQFullBar, T::kDQBarThreads>();  // consumer c's boxes written
            else named_bar_sync<T::kDQFullBar + 1, T::kDQBarThreads>();
            if (lane0) {
              const int dq_col0 = T::kDQSplitKeys || T::kDQSplitRows ? 0 : T::kDQCols * c;
              const int ws_row = int(bwd_ws_row<T>(p, b, hq, seq.q_start) + q0 + (T::kDQSplitRows ? T::kDQRows * c : 0));
              const uint32_t boxes = base + T::kDQOff + c * T::kDQConsumerBytes;
#pragma unroll
              for (int box = 0; box < T::kDQCols / 32; ++box)
                tma_reduce_add_2d(&tm_dq, boxes + box * T::kDQBox, dq_col0 + 32 * box, ws_row);
              tma_store_commit();
            }
          }
#pragma unroll
          for (int c = 0; c < T::kConsumers; ++c) {
            if (lane0) {
              if (c + 1 < T::kConsumers) tma_store_wait_read<T::kConsumers - 1>();  // consumer c's group of adds
              else tma_store_wait_read<0>();
            }
            __syncwarp();
            if (it + 1 < total) {
              if (c == 0) named_bar_arrive<T::kDQEmptyBar, T::kDQBarThreads>();
              else named_bar_arrive<T::kDQEmptyBar + 1, T::kDQBarThreads>();
            }
          }
        }
      }
    }
    return;
  }

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = T::kConsumers == 1 ? 0 : bwd_consumer_index<T>(wg);  // keys 64c .. 64c+63 of the tile
  const int ctid = tid - 128 * wg;
  const int warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;
  // Accumulator fragments (m64 x N): rows 16 warp + g (+8), columns 8i + 2t (+1) of n8 block i.
  const int key_lo = key0 + 64 * c + 16 * warp + g;  // this thread's keys: key_lo, key_lo + 8

  float acc_dv[kD / 2], acc_dk[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) acc_dv[i] = acc_dk[i] = 0.f;

  if (total > step_begin) mbar_wait(bar_kv, 0);
  if constexpr (T::kPacked) {
    // Keys past used_k in the tile (rows past seqused_k, or the next sequence's): zero rows of K and V.
    if (total > step_begin && key0 + kBN > seq.used_k) {
      bwd_zero_rows<T::kKBlocks, T::kKBlock, T::kKRowBytes, kBN, kConsumerThreads>(sK, seq.used_k - key0, tid - 128);
      bwd_zero_rows<T::kDBlocks, T::kKVBlock, T::kRowBytes, kBN, kConsumerThreads>(sV, seq.used_k - key0, tid - 128);
      fence_proxy_async_smem();
      named_bar_sync<1, kConsumerThreads>();  // every consumer reads all keys (dQ)
    }
  }

  constexpr uint32_t kDOFromQ = T::kDOOff - T::kQOff;  // dO's descriptors: Q's, moved by this

  for (int it = step_begin; it < total; ++it) {
    const int s = it % T::kStages;
    const int hq = hk * p.head_ratio + it / per_head;
    const int m = m_first + it % per_head;
    const int q0 = m * kBM;
    const uint32_t sQ = base + T::kQOff + s * T::kQTile, sDO = base + T::kDOOff + s * T::kQTile;
    mbar_wait(bar_full(s), (it / T::kStages) & 1);
    if constexpr (T::kPacked) {
      // Query rows past used_q in the tile: zero rows of this stage's Q and dO.
      if (q0 + kBM > seq.used_q) {
        bwd_zero_rows<T::kDBlocks, T::kQBlock, T::kRowBytes, kBM, kConsumerThreads>(sQ, seq.used_q - q0, tid - 128);
        bwd_zero_rows<T::kDBlocks, T::kQBlock, T::kRowBytes, kBM, kConsumerThreads>(sDO, seq.used_q - q0, tid - 128);
        fence_proxy_async_smem();
        named_bar_sync<1, kConsumerThreads>();
      }
    }

    // S^T = K_c Q^T and dP^T = V_c dO^T: D/16 k16 steps each, (column block)/16 per column block.
    // Every product's k steps move one descriptor per operand with desc_advance (rebuilding each from its
    // address took about ten dependent instructions per wgmma, slower than the tensor core drained them).
    // acc = A_c B^T with A = K or V (this consumer's 64 rows, desc_a) and B = Q or dO (desc_b), both K-major
    // over D; a_is_k (K's column blocks, else V's) is a constant at each (inlined) call.
    auto gemm_nt = [&](float (&acc)[kBM / 2], uint64_t desc_a, uint64_t desc_b, bool a_is_k) {
      constexpr int kSteps = T::kColBlock / 16, kKSteps = T::kKColBlock / 16;
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        const uint32_t aoff = a_is_k ? (k / kKSteps) * T::kKBlock + (k % kKSteps) * 32
                                     : (k / kSteps) * T::kKVBlock + (k % kSteps) * 32;
        const uint32_t boff = (k / kSteps) * T::kQBlock + (k % kSteps) * 32;
        wgmma_ss<T::kBf16, kBM, 0>(acc, desc_advance(desc_a, aoff), desc_advance(desc_b, boff), k > 0);
      }
      wgmma_commit();
    };
    float st[kBM / 2], dpt[kBM / 2];
    const uint64_t desc_q_kmajor = bwd_tile_desc<T::kRowBytes>(sQ, 16);
    wgmma_fence();
    gemm_nt(st, bwd_tile_desc<T::kKRowBytes>(sK + 64 * c * T::kKRowBytes, 16), desc_q_kmajor, true);
    gemm_nt(dpt, bwd_tile_desc<T::kRowBytes>(sV + 64 * c * T::kRowBytes, 16), desc_advance(desc_q_kmajor, kDOFromQ), false);

    // P^T while dP^T runs. Columns (queries) of n8 block i: q0 + 8i + 2t (+1); their lse_log2 are read
    // while the wgmmas run (a read after the wait stalled on the shared memory the wgmmas load).
    const uint32_t sLse = base + T::kLseOff + s * kBM * 4, sDsum = base + T::kDsumOff + s * kBM * 4;
    // T::kShuffledCols (B_r = 128): an eighth of the columns' lse and D per lane, the rest
    // by shuffles.
    [[maybe_unused]] float lse_cols[T::kShuffledCols ? 1 : kBM / 4];
    [[maybe_unused]] float lse_own[kBM / 32], dsum_own[kBM / 32];
    if constexpr (T::kShuffledCols) {
      if constexpr (!T::kVariants) bwd_load_cols_shuffled<kBM / 8>(lse_own, sLse, g, t);  // variants: read by P's pass
      bwd_load_cols_shuffled<kBM / 8>(dsum_own, sDsum, g, t);
    } else if constexpr (!T::kVariants) {
      bwd_load_cols<kBM / 8>(lse_cols, sLse, t);
    }
    wgmma_wait<1>();
    fence_regs(st);
    uint32_t pa[kBM / 16][4], da[kBM / 16][4];
    if constexpr (T::kShuffledCols && !T::kVariants) {
      bwd_dense_probs_shuffled<kBM / 8>(st, lse_own, p, key_lo, int64_t(q0) + 2 * t, t,
                                         bwd_dense_need_mask(p, key0 + 64 * c, 64, q0));
    } else if constexpr (!T::kVariants) {
      // The mask pass only where this consumer's 64 keys cross Sk or the diagonal.
      bwd_dense_probs<kBM / 8>(st, lse_cols, p, key_lo, int64_t(q0) + 2 * t,
                               bwd_dense_need_mask(p, key0 + 64 * c, 64, q0));
      // st holds P^T from here on.
    } else {
      // P^T into pa and, softcap, P^T (1 - tanh^2) into st (bwd_variant_probs); masked where this
      // consumer's 64 keys cross Sk or a window edge for some of the 64 queries.
      const bool need_mask =
          bwd_variant_need_mask<T::kPacked>(p, key0 + 64 * c, q0, kBM, seq.used_q, seq.used_k);
      const float slope_l2 = bwd_alibi_slope_l2(p, b, hq);
      if (p.variants.softcap > 0.f)
        bwd_variant_probs<T::kBf16, true, kBM / 8, T::kPacked>(st, pa, p, sLse, t, key_lo, q0 + 2 * t, slope_l2,
                                                                 need_mask, seq.used_q, seq.used_k);
      else
        bwd_variant_probs<T::kBf16, false, kBM / 8, T::kPacked>(st, pa, p, sLse, t, key_lo, q0 + 2 * t, slope_l2,
                                                                 need_mask, seq.used_q, seq.used_k);
    }
    // 16-bit A fragments of P^T for k16 step j (queries 16j..16j+15): r = 0: n8 block 2j rows g;
    // 1: block 2j rows g+8; 2, 3: block 2j+1. dV += P^T dO is issued before dP^T is waited for, so
    // that it runs under the dS^T arithmetic (B = dO MN-major: 16 query rows per k step = two
    // atoms, column blocks kQBlock apart).
    auto fragment = [](const float (&acc)[kBM / 2], int j, int r) {
      const int idx = 4 * (2 * j + r / 2) + 2 * (r % 2);
      return pack2<T::kBf16>(acc[idx], acc[idx + 1]);
    };
    const uint64_t desc_q_mnmajor = bwd_tile_desc<T::kRowBytes>(sQ, T::kQBlock);
    auto gemm_dv = [&] {
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_rs<T::kBf16, kD, 1>(acc_dv, pa[j], desc_advance(desc_q_mnmajor, kDOFromQ + j * 2 * T::kAtomBytes), 1);
      wgmma_commit();
    };
    if constexpr (T::kShuffledCols) {
      // T::kShuffledCols: dS^T from P^T and dP^T first, then both packed and dV issued (P^T, dP^T, pa and dV, dK
      // together would not fit the registers).
      wgmma_wait<0>();  // dP^T done
      fence_regs(dpt);
      // Per k16 step j (n8 blocks 2j, 2j + 1): dS^T, then both fragments packed, so that each 16 columns of
      // P^T and dP^T die as their 16-bit fragments are made.
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j) {
#pragma unroll
        for (int i = 2 * j; i < 2 * j + 2; ++i) {
          const float d0 = bwd_shuffled_col<kBM / 8>(dsum_own, i, 0, t);
          const float d1 = bwd_shuffled_col<kBM / 8>(dsum_own, i, 1, t);
#pragma unroll
          for (int e = 0; e < 4; ++e) dpt[4 * i + e] = st[4 * i + e] * (dpt[4 * i + e] - ((e & 1) ? d1 : d0));
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if constexpr (!T::kVariants) pa[j][r] = fragment(st, j, r);  // variants: bwd_variant_probs made pa
          da[j][r] = fragment(dpt, j, r);
        }
      }
      gemm_dv();
    } else {
      if constexpr (!T::kVariants) {
#pragma unroll
        for (int j = 0; j < kBM / 16; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) pa[j][r] = fragment(st, j, r);
      }
      gemm_dv();

      wgmma_wait<1>();  // dP^T done (dV may still run)
      fence_regs(dpt);
      // dS^T = P^T (dP^T - D), then dK += dS^T Q.
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i) {
        float d0, d1;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(d0), "=f"(d1) : "r"(sDsum + (8 * i + 2 * t) * 4));
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[4 * i + e] = st[4 * i + e] * (dpt[4 * i + e] - ((e & 1) ? d1 : d0));
      }
    }
    if constexpr (!T::kShuffledCols) {
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) da[j][r] = fragment(dpt, j, r);
    }
    // dK += dS^T Q in two parts: k steps 0 .. kDKEarlySteps - 1 run under the dS stores and the barrier,
    // the rest after dQ, under dQ's stores (see Sm90BwdTraits::kDKEarlySteps).
    auto gemm_dk = [&](int j0, int j1) {
      wgmma_fence();
#pragma unroll
      for (int j = j0; j < j1; ++j)
        wgmma_rs<T::kBf16, kD, 1>(acc_dk, da[j], desc_advance(desc_q_mnmajor, j * 2 * T::kAtomBytes), 1);
      wgmma_commit();
    };
    if constexpr (T::kDKEarlySteps > 0) gemm_dk(0, T::kDKEarlySteps);

    // dS (this consumer's 64 keys = key block c of the [query][key] tile) through stmatrix.trans:
    // matrix mi of k step j holds keys 16 warp + 8 (mi % 2) .. +7 x queries 16j + 8 (mi / 2) .. +7.
    const uint32_t sDS = base + T::kDSOff + (it & 1) * T::kConsumers * T::kDSBlock;
    {
      const int mi = lane / 8, r = lane % 8;
      const int chunk = 2 * warp + (mi % 2);  // 16-byte chunk (8 keys) of the 128-byte row
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j) {
        const int q = 16 * j + 8 * (mi / 2) + r;
        stmatrix_x4_trans(sDS + c * T::kDSBlock + q * 128 + ((chunk ^ (q & 7)) << 4), da[j]);
      }
    }
    fence_proxy_async_smem();
    // The dQ writer's adds of the last step have read this consumer's dQ boxes before it writes them again.
    if (T::kDQBulk) {
      if (c == 0) named_bar_sync<T::kDQEmptyBar, T::kDQBarThreads>();
      else named_bar_sync<T::kDQEmptyBar + 1, T::kDQBarThreads>();
    }
    // dQ fragments of this step (m64 x kDQCols fp32) into the accumulator.
    auto add_dq = [&](const float (&dq)[T::kDQCols / 2]) {
      // Packed: rows past used_q have dS = 0 exactly (Q, dO rows zeroed, lse_log2 = +inf, D = 0) and add
      // zeros to workspace rows the sequence owns (the tile ends inside its round_up(len, kBwdSeqQPad)),
      // which the convert kernel does not read; no predicate keeps used_q live through the step.
      // dQ fragments into the fp32 accumulator (rows >= Sq have dS = 0: skipped). Its rows are kD wide
      // (bwd_params.h): the columns past the head dimension are padding and receive adds of 0 (K's
      // columns there are 0). At D = 64 and 128 they are added unpredicated: a column test there spilled
      // 16 bytes at d128 (168 registers, ptxas -v, sm_90a).
      const int dq_col0 = T::kDQSplitKeys || T::kDQSplitRows ? 0 : T::kDQCols * c;
      const int dq_row0 = q0 + (T::kDQSplitRows ? T::kDQRows * c : 0);  // the tile's first query
      if constexpr (T::kDQBulk) {
        // Whole 64-row boxes: rows past Sq (dense) or used_q (packed) add dS = 0 exactly (Q, dO rows zero-filled
        // or zeroed, lse_log2 = +inf and D = 0 there) to the padding rows of the workspace (within
        // seqlen_q_rounded, or the sequence's own rows), which the convert kernel does not read.
        // Box rows hold the queries of each 16-row group paired (bwd_dq_paired_row: query 16 w + g + 8 h at box row
        // 16 w + 2 g + h), and the convert kernel reads them back in that order: a half-warp's float2 stores of one
        // n8 block (rows g = 0..3 or 4..7, columns 8i + 2t, +1) then fall in four different 128B-swizzle phases
        // 2 g + h and fill all 32 banks, where rows in query order (phases g) met two ways per bank.
        // Element (box row j, col) of box col / 32 is at j * 128 + 16 (chunk ^ j % 8) + 4 (col % 4),
        // chunk = col % 32 / 4 = 2 (i % 4) + t / 2: for row 16 w + 2 g + h that is a per-thread base (h = 0)
        // plus (32 (i % 4)) ^ (32 (g % 4)), and for h = 1 the next row with the chunk's low bit (address bit 4)
        // flipped with the phase's.
        const uint32_t sDQ = base + T::kDQOff + c * T::kDQConsumerBytes + (16 * warp + 2 * g) * 128 + (t / 2) * 16 +
                             (t % 2) * 8;
        const uint32_t swz = 32u * (g & 3);
#pragma unroll
        for (int i = 0; i < T::kDQCols / 8; ++i) {
          const uint32_t addr = sDQ + (i / 4) * T::kDQBox + ((32u * (i % 4)) ^ swz);
          st_shared_v2_f32(addr, dq[4 * i], dq[4 * i + 1]);
          st_shared_v2_f32((addr ^ 16u) + 128, dq[4 * i + 2], dq[4 * i + 3]);
        }
        fence_proxy_async_smem();
        if (c == 0) named_bar_arrive<T::kDQFullBar, T::kDQBarThreads>();  // to the dQ writer
        else named_bar_arrive<T::kDQFullBar + 1, T::kDQBarThreads>();
      } else {
        float* gacc = p.dq_accum + (bwd_ws_row<T>(p, b, hq, seq.q_start) + dq_row0) * kD + dq_col0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * warp + g + 8 * h;
          if (T::kPacked || dq_row0 + row < p.seqlen_q) {  // packed: rows past used_q add exact zeros (see below)
#pragma unroll
            for (int i = 0; i < T::kDQCols / 8; ++i) {
              // D = 96: the n8 blocks at or past the head dimension hold zeros and are not added (one uniform
              // compare per block; headdim 80: consumer 1 adds 4 of its 6).
              if (T::kColBlock == 32 && T::kDQCols * c + 8 * i >= p.headdim) break;
              red_add_v2(gacc + row * kD + 8 * i + 2 * t, dq[4 * i + 2 * h], dq[4 * i + 2 * h + 1]);
            }
          }
        }
      }
    };
    float dq[T::kDQCols / 2];
    if constexpr (T::kDQSplitRows) {
      named_bar_sync<1, 256>();  // both key blocks of dS written
      // dQ[64c .. 64c+63, :] = dS[64c .. 64c+63, :] K: A = query rows 64c .. of dS (K-major over the 128 keys, key
      // blocks kDSBlock apart), B = K (MN-major: 16 key rows per k step, one 64-column block).
      const uint64_t desc_ds = make_desc_sw128(sDS + T::kDQRows * c * 128, 16, 1024);
      const uint64_t desc_k = make_desc_sw128(sK, T::kKBlock, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma_ss<T::kBf16, T::kDQCols, 1>(dq, desc_advance(desc_ds, (k / 4) * T::kDSBlock + (k % 4) * 32),
                                          desc_advance(desc_k, k * 16 * 128), k > 0);
    } else if constexpr (!T::kDQSplitKeys) {
      static_assert(T::kConsumers == 2, "the column split takes both consumers' dS");
      named_bar_sync<1, 256>();  // both key blocks of dS written
      // dQ[:, n0 .. n0 + D/2 - 1] = dS K[:, n0 ..], n0 = c D/2: A = dS (K-major over the 128 keys, key
      // blocks kDSBlock apart), B = K's column blocks from n0 on (MN-major: 16 key rows per k step, blocks
      // kKBlock apart).
      const uint64_t desc_ds = make_desc_sw128(sDS, 16, 1024);
      const uint64_t desc_k =
          bwd_tile_desc<T::kKRowBytes>(sK + c * (T::kDQCols / T::kKColBlock) * T::kKBlock, T::kKBlock);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma_ss<T::kBf16, T::kDQCols, 1>(dq, desc_advance(desc_ds, (k / 4) * T::kDSBlock + (k % 4) * 32),
                                          desc_advance(desc_k, k * 16 * T::kKRowBytes), k > 0);
    } else {
      if (c == 0) named_bar_sync<2, 128>();  // this consumer's key block of dS written
      else named_bar_sync<3, 128>();
      // dQ (partial) = dS[:, 64c .. 64c+63] K[64c .. 64c+63, :]: A = key block c of dS, B = rows
      // 64c .. of K (MN-major, one 64-column block).
      const uint64_t desc_ds = make_desc_sw128(sDS + c * T::kDSBlock, 16, 1024);
      const uint64_t desc_k = make_desc_sw128(sK + 64 * c * 128, T::kKBlock, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_ss<T::kBf16, T::kDQCols, 1>(dq, desc_advance(desc_ds, k * 32), desc_advance(desc_k, 16 * k * 128), k > 0);
    }
    wgmma_commit();
    gemm_dk(T::kDKEarlySteps, kBM / 16);
    wgmma_wait<1>();  // dQ done (dK may still run)
    fence_regs(dq);
    add_dq(dq);
    wgmma_wait<0>();
    fence_regs(acc_dv);
    fence_regs(acc_dk);
    // The RS wgmma read pa/da after their issue: keep the registers alive (unreused) until here.
#pragma unroll
    for (int j = 0; j < kBM / 16; ++j) {
      fence_regs_u32(pa[j]);
      fence_regs_u32(da[j]);
    }
    // Every read of this stage's Q, dO, lse, D is done: hand it back to the producer. Each thread arrives,
    // so each one's release covers its own shared-memory reads of lse and D.
    mbar_arrive(bar_empty(s));
  }

  if constexpr (T::kTail) {
    // A piece: its dK (unscaled) and dV added into its split block's workspace rows (fp32), which
    // bwd_convert_tail_kernel scales and writes.
    float* wdk = p.dkv_tail + int64_t(int(blockIdx.x) / p.tail.pieces) * 2 * kBN * kD;
    float* wdv = wdk + kBN * kD;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * c + 16 * warp + g + 8 * h;
      if (key0 + row < p.seqlen_k) {
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          if (8 * i >= p.headdim) break;
          red_add_v2(wdk + row * kD + 8 * i + 2 * t, acc_dk[4 * i + 2 * h], acc_dk[4 * i + 2 * h + 1]);
          red_add_v2(wdv + row * kD + 8 * i + 2 * t, acc_dv[4 * i + 2 * h], acc_dv[4 * i + 2 * h + 1]);
        }
      }
    }
    // The pieces' grid ends only after the dense grid has (and its dQ adds are visible), so that the kernels
    // launched after it see both.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    return;
  }

  // dK * scale and dV from registers (rows = keys key_lo, key_lo + 8; columns 8i + 2t, n8 blocks
  // at or past the head dimension skipped).
  // Packed: the sequence's rows from k_start, those it owns (len_k) written, zeros past used_k. Its bounds
  // are read again here rather than held through the loop, which has no register to spare.
  if constexpr (T::kPacked) seq = bwd_sequence(p, b);
  Elem* gdk = static_cast<Elem*>(p.dk) +
              (T::kPacked ? int64_t(seq.k_start) * p.dk_row_stride : int64_t(b) * p.dk_batch_stride) +
              int64_t(hk) * p.dk_head_stride;
  Elem* gdv = static_cast<Elem*>(p.dv) +
              (T::kPacked ? int64_t(seq.k_start) * p.dv_row_stride : int64_t(b) * p.dv_batch_stride) +
              int64_t(hk) * p.dv_head_stride;
  const int len_k = T::kPacked ? seq.len_k : p.seqlen_k;  // rows written: the sequence's own
  if constexpr (T::kColBlock == 64) {
    // Through shared memory: this consumer's 64 rows of dK and dV into the K and V tiles (their own layout: 64-column
    // blocks of 128-byte rows, 128B swizzle; conflict-free 4-byte stores), then 16-byte rows out, a half-warp per
    // 256 bytes of a row, in place of 4-byte stores that each touch 8 rows. Both consumers' K reads (dQ takes all
    // keys) are done before either overwrites it.
    if constexpr (T::kConsumers > 1) named_bar_sync<1, 256>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * c + 16 * warp + g + 8 * h;  // of the tile
      const bool live = !T::kPacked || key_lo + 8 * h < seq.used_k;
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        const uint32_t off = (i / 8) * T::kKVBlock + row * 128 + (((i % 8) ^ (row % 8)) << 4) + 4 * t;
        st_shared_b32(sK + off, live ? pack2<T::kBf16>(acc_dk[4 * i + 2 * h] * p.scale,
                                                       acc_dk[4 * i + 2 * h + 1] * p.scale) : 0u);
        st_shared_b32(sV + off, live ? pack2<T::kBf16>(acc_dv[4 * i + 2 * h], acc_dv[4 * i + 2 * h + 1]) : 0u);
      }
    }
    if (c == 0) named_bar_sync<2, 128>();
    else named_bar_sync<3, 128>();
    constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
#pragma unroll
    for (int j = 0; j < 64 * kChunks / 128; ++j) {
      const int idx = j * 128 + ctid, chunk = idx % kChunks;
      const int row = 64 * c + idx / kChunks, key = key0 + row;
      if (key < len_k && 8 * chunk < p.headdim) {
        const uint32_t off = (chunk / 8) * T::kKVBlock + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
        *reinterpret_cast<uint4*>(gdk + int64_t(key) * p.dk_row_stride + 8 * chunk) = ld_shared_v4_b32(sK + off);
        *reinterpret_cast<uint4*>(gdv + int64_t(key) * p.dv_row_stride + 8 * chunk) = ld_shared_v4_b32(sV + off);
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key_lo + 8 * h;
      if (key < len_k) {
        const bool live = !T::kPacked || key < seq.used_k;
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          if (8 * i >= p.headdim) break;
          const int col = 8 * i + 2 * t;
          *reinterpret_cast<uint32_t*>(gdk + int64_t(key) * p.dk_row_stride + col) =
              live ? pack2<T::kBf16>(acc_dk[4 * i + 2 * h] * p.scale, acc_dk[4 * i + 2 * h + 1] * p.scale) : 0u;
          *reinterpret_cast<uint32_t*>(gdv + int64_t(key) * p.dv_row_stride + col) =
              live ? pack2<T::kBf16>(acc_dv[4 * i + 2 * h], acc_dv[4 * i + 2 * h + 1]) : 0u;
        }
      }
    }
  }
#endif
}

// The split blocks' dK (times softmax_scale) and dV from the workspace (bwd_tail.h) into dk and dv: one CTA per
// split block, a thread per 8 columns of a row (16-byte stores), rows past Sk and columns past the head dimension
// skipped. Runs after the main kernel (stream order).
template <class T>
__global__ void __launch_bounds__(256) bwd_convert_tail_kernel(const __grid_constant__ BwdParams p) {
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;
  constexpr int kBN = T::kBlockN, kD = T::kHeadDim, kChunks = kD / 8;
  const int unit = blockIdx.x;
  const BwdBlock block = bwd_plain_block<uint32_t>(uint32_t(p.tail.first_block + unit),
                                                   uint32_t(p.seqlen_k + kBN - 1) / kBN, uint32_t(p.heads_k));
  const float* wdk = p.dkv_tail + int64_t(unit) * 2 * kBN * kD;
  const float* wdv = wdk + kBN * kD;
  Elem* gdk = static_cast<Elem*>(p.dk) + int64_t(block.b) * p.dk_batch_stride + int64_t(block.hk) * p.dk_head_stride;
  Elem* gdv = static_cast<Elem*>(p.dv) + int64_t(block.b) * p.dv_batch_stride + int64_t(block.hk) * p.dv_head_stride;
  for (int idx = threadIdx.x; idx < kBN * kChunks; idx += blockDim.x) {
    const int row = idx / kChunks, col = 8 * (idx % kChunks), key = block.n_block * kBN + row;
    if (key >= p.seqlen_k || col >= p.headdim) continue;
    const float4* sk = reinterpret_cast<const float4*>(wdk + row * kD + col);
    const float4* sv = reinterpret_cast<const float4*>(wdv + row * kD + col);
    const float4 k0 = sk[0], k1 = sk[1], v0 = sv[0], v1 = sv[1];
    const float sc = p.scale;
    *reinterpret_cast<uint4*>(gdk + int64_t(key) * p.dk_row_stride + col) =
        make_uint4(pack2<T::kBf16>(k0.x * sc, k0.y * sc), pack2<T::kBf16>(k0.z * sc, k0.w * sc),
                   pack2<T::kBf16>(k1.x * sc, k1.y * sc), pack2<T::kBf16>(k1.z * sc, k1.w * sc));
    *reinterpret_cast<uint4*>(gdv + int64_t(key) * p.dv_row_stride + col) =
        make_uint4(pack2<T::kBf16>(v0.x, v0.y), pack2<T::kBf16>(v0.z, v0.w), pack2<T::kBf16>(v1.x, v1.y),
                   pack2<T::kBf16>(v1.z, v1.w));
  }
}

// ------------------------------------------------------------------ wide tiles (D = 160 .. 256)
// At D >= 160 the 128-key CTA does not fit: dV_c + dK_c over 64 keys and all D columns would be D fp32
// registers per consumer thread (192 at D = 192) beside S^T, dP^T and dQ. The wide kernel takes B_c = 64
// keys per CTA and splits the work of each step (64 queries) between the two consumers by columns and
// by queries, so that no product is computed twice:
//   S^T_c  = K Q_c^T, dP^T_c = V dO_c^T      SS wgmma m64n32: all 64 keys x queries 32c .. 32c+31
//   P^T_c, dS^T_c in registers -> shared memory ([query][key], 128B swizzle, stmatrix.trans), so
//   that each consumer sees both halves of the queries (named barrier over 256 threads):
//   dV[:, half c] += P^T dO[:, half c]       SS wgmma m64n(D/2), A = P MN-major (tnspA), K = 64 queries
//   dK[:, half c] += dS^T Q[:, half c]       SS wgmma m64n(D/2), A = dS MN-major
//   dQ[:, half c]  = dS K[:, half c]         SS wgmma m64n(D/2), A = dS K-major, K = 64 keys
// Registers per consumer thread: dV, dK D/4 each, dQ D/4, S^T, dP^T 16 each (D = 256: 224 at most, and
// S^T, dP^T are dead once stored, before dQ's accumulator is live).
// Columns are blocks of kColBlock elements with D/2 a whole number of blocks (each consumer's half starts
// on a block): 64 (128B swizzle) at D = 256, 32 (64B) at 192, 16 (32B) at 160 and 224. K and V have
// the same blocks as Q and dO.
// Shared memory: K, V 64 x D each; Q, dO 2 stages x 64 x D each; P, dS 2 buffers x 8 KiB each; lse/D
// 2 stages x 512 B: D = 256 226 KiB, D = 192 177 KiB (+ barriers + 1 KiB alignment slack).
// Head dimension: as bwd_kernel_sm90 (TMA maps' dim 0 = p.headdim zero-fills the columns past it;
// dK/dV stores and dQ adds skip the n8 blocks at or past p.headdim).
// kBlockN_ = 96 (D = 192 only): bwd_kernel_sm90_wide_keys below, the consumers split the keys.
// kBlockN_ = 80 (D = 256 only): bwd_kernel_sm90_wide_kv_transposed below, the consumers split D of dK^T, dV^T;
// one dO stage.
template <bool kBf16_, int kHeadDim_, int kBlockN_ = 64>
struct Sm90BwdWideTraits {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;  // the tile width: 160, 192, 224 or 256
  static constexpr bool kWide = true;
  static constexpr bool kKeySplit = kBlockN_ == 96;  // bwd_kernel_sm90_wide_keys
  static constexpr bool kTransposedKV = kBlockN_ == 80;  // bwd_kernel_sm90_wide_kv_transposed
  static constexpr bool kVariants = false;  // see Sm90BwdTraits
  static constexpr bool kSupportsVariants = !kKeySplit && !kTransposedKV;
  static constexpr bool kPacked = false;  // see Sm90BwdTraits; built where the variants are
  static constexpr bool kLongestFirst = false;  // see Sm90BwdTraits
  static constexpr bool kTail = false;          // see Sm90BwdTraits
  static constexpr bool kDQBulk = false;        // dQ adds from registers (kDQLayout below)
  // red.global.add.v4 in the accumulator's fragment order (bwd_params.h, bwd_add_dq_fragments): half the add
  // instructions of row order's v2 and 512 contiguous bytes a warp instruction.
  static constexpr BwdDQLayout kDQLayout = BwdDQLayout::kFragments;
  static constexpr bool kRoleSplit = false;     // Sm90BwdRoleSplit<traits> (below)
  static_assert(kHeadDim == 160 || kHeadDim == 192 || kHeadDim == 224 || kHeadDim == 256,
                "the sm90 wide backward takes D = 160, 192, 224 or 256");
  static_assert(kBlockN_ == 64 || (kBlockN_ == 96 && kHeadDim == 192) || (kBlockN_ == 80 && kHeadDim == 256),
                "B_c = 64, or 96 at D = 192, or 80 at D = 256");
  static constexpr int kHalf = kHeadDim / 2;  // columns of dK, dV, dQ per consumer
  static constexpr int kColBlock = kHalf % 64 == 0 ? 64 : kHalf % 32 == 0 ? 32 : 16;
  static constexpr int kRowBytes = 2 * kColBlock;
  static constexpr int kAtomBytes = 8 * kRowBytes;
  static constexpr int kDBlocks = kHeadDim / kColBlock;
  static constexpr int kHalfBlocks = kHalf / kColBlock;
  static constexpr int kKColBlock = kColBlock;  // the launcher's K map (K and V alike here)
  static constexpr int kBlockN = kBlockN_;  // keys per CTA: at 128, dV + dK would be D (160-256) fp32 registers per thread
  static constexpr int kBlockM = 64;             // queries per step (32 per consumer in S^T, dP^T)
  static constexpr int kStages = 2;
  static constexpr int kDOStages = kTransposedKV ? 1 : kStages;  // B_c = 80: two would not fit
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr uint32_t kKVBlock = kBlockN * kRowBytes;  // a column block of K or V
  static constexpr uint32_t kQBlock = kBlockM * kRowBytes;   // a column block of Q or dO
  static constexpr uint32_t kPBlock = kBlockM * kBlockN * 2;  // P or dS: [query][key], 128-byte rows (B_c 96: kSBlock)
  // B_c = 96 and 80: P and dS are blocks of 16 keys (32-byte rows, 32B swizzle, 256-byte atoms), so that each
  // consumer's 48 keys (all 80 keys) are whole blocks of the MN-major B operand (as K's at D = 96 in Sm90BwdTraits).
  static constexpr uint32_t kSBlock = kBlockM * 16 * 2;
  static constexpr uint32_t kKVTile = kDBlocks * kKVBlock;
  static constexpr uint32_t kQTile = kDBlocks * kQBlock;
  static constexpr uint32_t kKOff = 0;
  static constexpr uint32_t kVOff = kKOff + kKVTile;
  static constexpr uint32_t kQOff = kVOff + kKVTile;               // stage s at + s * kQTile
  static constexpr uint32_t kDOOff = kQOff + kStages * kQTile;
  static constexpr uint32_t kPOff = kDOOff + kDOStages * kQTile;   // buffer u at + u * kPBlock
  static constexpr uint32_t kDSOff = kPOff + 2 * kPBlock;          // buffer u at + u * kPBlock
  static constexpr uint32_t kLseOff = kDSOff + 2 * kPBlock;        // stage s at + s * 256
  static constexpr uint32_t kDsumOff = kLseOff + kStages * kBlockM * 4;
  static constexpr uint32_t kBarOff = kDsumOff + kStages * kBlockM * 4;
  // kv_full, full[s], empty[s]; B_c = 80 also do_full, do_empty (dO's own stage)
  static constexpr uint32_t kBars = 1 + 2 * kStages + (kTransposedKV ? 2 : 0);
  static constexpr uint32_t kSmemBytes = kBarOff + 8 * kBars + 1024;
  static constexpr uint32_t kStepTxBytes = 2 * kQTile + 2 * kBlockM * 4;  // Q, dO, lse, D
  static_assert(kHalf % kColBlock == 0 && kHalf % 16 == 0, "each consumer's half is whole column blocks");
  static_assert(kKVBlock % kAtomBytes == 0 && kQBlock % kAtomBytes == 0 && kVOff % kAtomBytes == 0 &&
                    kQOff % kAtomBytes == 0 && kDOOff % kAtomBytes == 0 && kPOff % 1024 == 0 &&
                    kDSOff % 1024 == 0,
                "swizzle atoms");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};

// ------------------------------------------------------------------ wide tiles, consumer roles (".rs")
// Sm90BwdRoleSplit<Sm90BwdWideTraits<kBf16, D>>: the wide kernel's producer, shared memory and grid (64 keys per
// CTA, 64 queries per step), but the consumers split each step by role rather than by queries and columns:
//   consumer 0: S^T  = K Q^T       SS wgmma m64n64, K = D
//               P^T  = exp2(S^T scale log2e - lse), masked; fp32 P^T -> shared memory (for consumer 1)
//               dV  += P^T dO      RS wgmma m64nD, K = 64 queries (all D columns: dV stays in its registers)
//   consumer 1: dP^T = V dO^T      SS wgmma m64n64, K = D
//               dS^T = P^T (dP^T - D_i)   (P^T from shared memory, in its own fragment layout)
//               dK  += dS^T Q      RS wgmma m64nD
//               dS -> shared memory ([query][key], stmatrix.trans)
//   both:       dQ[:, half c] = dS K[:, half c]   SS wgmma m64n(D/2), red.global.add.v4 in fragment order
// Each of S^T and dP^T is one m64n64 product instead of two m64n32 halves that both read all of K or V, and dV,
// dK take A from registers: about 344 KB of shared-memory traffic a step at D = 256 against 416 for the column
// split. Registers per consumer thread: dV or dK D/2 (128 at D = 256), S^T or dP^T 32, P^T 32 (consumer 1), dQ
// D/4. Dense problems only (kSupportsVariants false: a window, softcap, ALiBi or packed batch runs the plain
// wide build). Barriers: 2 (P^T written: consumer 0 arrives, consumer 1 waits) and 3 (dS written: both wait,
// consumer 0 having nothing to do meanwhile). P^T has one buffer (consumer 0 writes the next step's only after
// dS, which consumer 1 writes after reading it); dS two (its readers are the wgmmas of both consumers).
template <class T>
struct Sm90BwdRoleSplit : T {
  static constexpr bool kRoleSplit = true;
  static constexpr bool kSupportsVariants = false;
  static_assert(T::kWide && !T::kKeySplit && T::kBlockN == 64, "the role split is a wide B_c = 64 build");
  static_assert(2 * T::kPBlock >= 64 * 64 * 4, "fp32 P^T fits both P buffers");
};

// dQ (m64 x kN columns) = dS K over the tile's 64 keys, issued as one commit group: A = dS K-major (desc_ds: one
// 128-byte row span, four k16 steps of 32 bytes), B = K's column blocks from desc_k (MN-major: 16 key rows per
// k step, blocks T::kKVBlock apart). For the wide kernels (the column split and the role split).
template <class T, int kN>
__device__ __forceinline__ void bwd_wide_dq_gemm(float (&dq)[kN / 2], uint64_t desc_ds, uint64_t desc_k) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < T::kBlockN / 16; ++k)
    wgmma_ss<T::kBf16, kN, 1>(dq, desc_advance(desc_ds, k * 32), desc_advance(desc_k, k * 16 * T::kRowBytes), k > 0);
  wgmma_commit();
}

template <class T>
__device__ __forceinline__ void bwd_wide_roles_consumer(const BwdParams& p, uint32_t base, int hk, int b, int key0,
                                                        int m_first, int per_head, int total) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim, kH = T::kHalf;
  static_assert(kBM == 64 && kBN == 64, "m64n64 S^T and dP^T");
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;
  const uint32_t sK = base + T::kKOff, sV = base + T::kVOff;
  const uint32_t bar_kv = base + T::kBarOff;
  auto bar_full = [&](int s) { return bar_kv + 8u * (1 + s); };
  auto bar_empty = [&](int s) { return bar_kv + 8u * (1 + T::kStages + s); };
  const int tid = threadIdx.x;
  const int c = bwd_consumer_index<T>(tid / 128);  // 0: S^T, P^T, dV; 1: dP^T, dS, dK
  const int ctid = tid % 128;
  const int warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;
  const int key_lo = key0 + 16 * warp + g;  // accumulator rows of this thread: key_lo, key_lo + 8
  constexpr uint32_t kDOFromQ = T::kDOOff - T::kQOff;
  constexpr int kSteps = T::kColBlock / 16;
  // fp32 P^T, thread-major: element group q (four floats) of consumer thread i at 16 (128 q + i), so that each
  // warp's 16-byte accesses are contiguous; consumer 1's thread i reads what consumer 0's thread i wrote.
  const uint32_t sPT = base + T::kPOff + 16u * ctid;

  float acc[kD / 2];  // dV (consumer 0) or dK (consumer 1): rows key_lo (+8), columns 8i + 2t (+1)
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) acc[i] = 0.f;
  if (total > 0) mbar_wait(bar_kv, 0);

  auto fragment = [](const float (&x)[kBM / 2], int j, int r) {
    const int idx = 4 * (2 * j + r / 2) + 2 * (r % 2);
    return pack2<T::kBf16>(x[idx], x[idx + 1]);
  };

  for (int it = 0; it < total; ++it) {
    const int s = it % T::kStages;
    const int hq = hk * p.head_ratio + it / per_head;
    const int q0 = (m_first + it % per_head) * kBM;
    const uint32_t sQ = base + T::kQOff + s * T::kQTile;
    const uint32_t sDS = base + T::kDSOff + (it & 1) * T::kPBlock;
    mbar_wait(bar_full(s), (it / T::kStages) & 1);

    // S^T = K Q^T (consumer 0) or dP^T = V dO^T (consumer 1): all 64 keys x all 64 queries, K-major both.
    const uint64_t desc_a = bwd_tile_desc<T::kRowBytes>(c == 0 ? sK : sV, 16);
    const uint64_t desc_b = bwd_tile_desc<T::kRowBytes>(c == 0 ? sQ : sQ + kDOFromQ, 16);
    float sc[kBM / 2];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kD / 16; ++k)
      wgmma_ss<T::kBf16, kBM, 0>(sc, desc_advance(desc_a, (k / kSteps) * T::kKVBlock + (k % kSteps) * 32),
                                 desc_advance(desc_b, (k / kSteps) * T::kQBlock + (k % kSteps) * 32), k > 0);
    wgmma_commit();
    // dV += P^T dO (consumer 0) and dK += dS^T Q (consumer 1): B = dO or Q MN-major, all D columns (blocks
    // kQBlock apart), 16 query rows per k step.
    const uint64_t desc_rs = bwd_tile_desc<T::kRowBytes>(c == 0 ? sQ + kDOFromQ : sQ, T::kQBlock);
    uint32_t fr[kBM / 16][4];
    // acc += x dO or x Q: x (P^T or dS^T) packed to 16-bit A fragments, kept in fr until the wgmma is waited for.
    auto accumulate = [&](const float (&x)[kBM / 2]) {
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) fr[j][r] = fragment(x, j, r);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_rs<T::kBf16, kD, 1>(acc, fr[j], desc_advance(desc_rs, j * 2 * T::kAtomBytes), 1);
      wgmma_commit();
    };
    if (c == 0) {
      float lse_cols[kBM / 4];  // read while S^T runs
      bwd_load_cols<kBM / 8>(lse_cols, base + T::kLseOff + s * kBM * 4, t);
      wgmma_wait<0>();
      fence_regs(sc);
      bwd_dense_probs<kBM / 8>(sc, lse_cols, p, key_lo, int64_t(q0) + 2 * t, bwd_dense_need_mask(p, key0, kBN, q0));
      // P^T to consumer 1, then dV += P^T dO.
#pragma unroll
      for (int q = 0; q < kBM / 8; ++q)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(sPT + q * 2048u), "f"(sc[4 * q]),
                     "f"(sc[4 * q + 1]), "f"(sc[4 * q + 2]), "f"(sc[4 * q + 3])
                     : "memory");
      named_bar_arrive<2, 256>();
      accumulate(sc);
      named_bar_sync<3, 256>();  // dS written
    } else {
      float dsum_cols[kBM / 4];
      bwd_load_cols<kBM / 8>(dsum_cols, base + T::kDsumOff + s * kBM * 4, t);
      wgmma_wait<0>();
      fence_regs(sc);
      named_bar_sync<2, 256>();  // P^T written
      // dS^T = P^T (dP^T - D), P^T in this thread's own fragment layout.
#pragma unroll
      for (int q = 0; q < kBM / 8; ++q) {
        float p0, p1, p2, p3;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(p0), "=f"(p1), "=f"(p2), "=f"(p3)
                     : "r"(sPT + q * 2048u));
        sc[4 * q] = p0 * (sc[4 * q] - dsum_cols[2 * q]);
        sc[4 * q + 1] = p1 * (sc[4 * q + 1] - dsum_cols[2 * q + 1]);
        sc[4 * q + 2] = p2 * (sc[4 * q + 2] - dsum_cols[2 * q]);
        sc[4 * q + 3] = p3 * (sc[4 * q + 3] - dsum_cols[2 * q + 1]);
      }
      accumulate(sc);
      // dS through stmatrix.trans into [query][key] (128-byte rows, 128B swizzle): matrix mi of k step j holds keys
      // 16 warp + 8 (mi % 2) .. +7 x queries 16j + 8 (mi / 2) .. +7.
      {
        const int mi = lane / 8, r = lane % 8;
        const int chunk = 2 * warp + (mi % 2);
#pragma unroll
        for (int j = 0; j < kBM / 16; ++j) {
          const int q = 16 * j + 8 * (mi / 2) + r;
          stmatrix_x4_trans(sDS + q * 128 + ((chunk ^ (q & 7)) << 4), fr[j]);
        }
      }
      fence_proxy_async_smem();
      named_bar_sync<3, 256>();  // a sync here too: this consumer's own dQ wgmma reads what all its warps wrote
    }

    // dV or dK done before dQ is issued: its A fragments are then dead when dQ's accumulators are live (with
    // both in flight ptxas serialized every wgmma at D = 256 for want of registers). Every read of this stage's Q,
    // dO, lse and D is then done: the stage goes back to the producer.
    wgmma_wait<0>();
    fence_regs(acc);
#pragma unroll
    for (int j = 0; j < kBM / 16; ++j) fence_regs_u32(fr[j]);
    mbar_arrive(bar_empty(s));

    // dQ[:, half c] = dS K[:, half c] in chunks of kDQChunk columns (64 at D = 256: 32 accumulators beside dV or
    // dK's 128): A = dS K-major over the 64 keys, B = K's column blocks of the chunk (MN-major).
    constexpr int kDQChunk = kH % 64 == 0 ? 64 : kH;
    static_assert(kDQChunk % T::kColBlock == 0, "a dQ chunk is whole column blocks");
    const uint64_t desc_ds = make_desc_sw128(sDS, 16, 1024);
    float* dq_tile = p.dq_accum + ((int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded + q0) * kD;
#pragma unroll
    for (int chunk = 0; chunk < kH / kDQChunk; ++chunk) {
      const int col0 = kH * c + kDQChunk * chunk;
      float dq[kDQChunk / 2];
      bwd_wide_dq_gemm<T, kDQChunk>(
          dq, desc_ds, bwd_tile_desc<T::kRowBytes>(sK + (col0 / T::kColBlock) * T::kKVBlock, T::kKVBlock));
      wgmma_wait<0>();
      fence_regs(dq);
      bwd_add_dq_fragments<kDQChunk, kH>(dq_tile, dq, c, kDQChunk * chunk, p.headdim, warp, g, t);
    }
  }

  // dV (consumer 0) or dK * scale (consumer 1) from registers: rows key_lo, key_lo + 8; columns 8i + 2t, the n8
  // blocks at or past the head dimension skipped.
  const float scale = c == 0 ? 1.f : p.scale;
  Elem* out = static_cast<Elem*>(c == 0 ? p.dv : p.dk) +
              int64_t(b) * (c == 0 ? p.dv_batch_stride : p.dk_batch_stride) +
              int64_t(hk) * (c == 0 ? p.dv_head_stride : p.dk_head_stride);
  const int64_t row_stride = c == 0 ? p.dv_row_stride : p.dk_row_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_lo + 8 * h;
    if (key < p.seqlen_k) {
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        if (8 * i >= p.headdim) break;
        *reinterpret_cast<uint32_t*>(out + int64_t(key) * row_stride + 8 * i + 2 * t) =
            pack2<T::kBf16>(acc[4 * i + 2 * h] * scale, acc[4 * i + 2 * h + 1] * scale);
      }
    }
  }
#endif
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    bwd_kernel_sm90_wide(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                         const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                         const __grid_constant__ BwdParams p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim, kH = T::kHalf;
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = base + T::kKOff, sV = base + T::kVOff;
  const uint32_t bar_kv = base + T::kBarOff;
  auto bar_full = [&](int s) { return bar_kv + 8u * (1 + s); };
  auto bar_empty = [&](int s) { return bar_kv + 8u * (1 + T::kStages + s); };

  const BwdBlock block = bwd_block<T>(p);
  const int n_block = block.n_block, hk = block.hk, b = block.b;
  const int key0 = n_block * kBN;
  // Packed: the sequence; a key tile past the rows it owns is the next sequence's (nothing to do).
  [[maybe_unused]] BwdSequence seq{};
  if constexpr (T::kPacked) {
    seq = bwd_sequence(p, b);
    if (key0 >= seq.len_k) return;
  }
  // Sq and Sk of the walk; the TMA maps' batch coordinate and the first query and key rows of b.
  auto seqlen_q = [&]() -> int { if constexpr (T::kPacked) return seq.used_q; else return p.seqlen_q; };
  auto seqlen_k = [&]() -> int { if constexpr (T::kPacked) return seq.used_k; else return p.seqlen_k; };
  const int tma_b = T::kPacked ? 0 : b;
  const int q_row0 = T::kPacked ? seq.q_start : 0, k_row0 = T::kPacked ? seq.k_start : 0;
  int m_first, per_head;  // query tiles m_first .. m_first + per_head - 1 of each query head
  bwd_query_tiles<T>(p, key0, seqlen_q(), seqlen_k(), m_first, per_head);
  const int total = per_head * p.head_ratio;  // steps: (query head of the group, query tile)

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  if (tid == 0) {
    tma_prefetch_desc(&tm_q);
    tma_prefetch_desc(&tm_k);
    tma_prefetch_desc(&tm_v);
    tma_prefetch_desc(&tm_do);
    mbar_init(bar_kv, 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(bar_full(s), 1);
      mbar_init(bar_empty(s), T::kThreads - 128);  // one arrival per consumer thread
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0 && total > 0) {
      mbar_arrive_expect_tx(bar_kv, 2 * T::kKVTile);
      for (int h = 0; h < T::kDBlocks; ++h) {
        tma_load_4d(&tm_k, sK + h * T::kKVBlock, bar_kv, T::kColBlock * h, k_row0 + key0, hk, tma_b);
        tma_load_4d(&tm_v, sV + h * T::kKVBlock, bar_kv, T::kColBlock * h, k_row0 + key0, hk, tma_b);
      }
      for (int it = 0; it < total; ++it) {
        const int s = it % T::kStages;
        const uint32_t use = it / T::kStages;
        if (use > 0) mbar_wait(bar_empty(s), (use - 1) & 1);
        const int hq = hk * p.head_ratio + it / per_head;
        const int m = m_first + it % per_head;
        const uint32_t full = bar_full(s);
        mbar_arrive_expect_tx(full, T::kStepTxBytes);
        const uint32_t sQ = base + T::kQOff + s * T::kQTile, sDO = base + T::kDOOff + s * T::kQTile;
        for (int h = 0; h < T::kDBlocks; ++h) {
          tma_load_4d(&tm_q, sQ + h * T::kQBlock, full, T::kColBlock * h, q_row0 + m * kBM, hq, tma_b);
          tma_load_4d(&tm_do, sDO + h * T::kQBlock, full, T::kColBlock * h, q_row0 + m * kBM, hq, tma_b);
        }
        // The workspaces are padded to kBwdSeqQPad rows (packed: each sequence's, bwd_params.h): the whole
        // tile is in bounds.
        const int64_t row = bwd_ws_row<T>(p, b, hq, seq.q_start) + int64_t(m) * kBM;
        bulk_load(base + T::kLseOff + s * kBM * 4, p.lse_log2 + row, kBM * 4, full);
        bulk_load(base + T::kDsumOff + s * kBM * 4, p.dsum + row, kBM * 4, full);
      }
    }
    return;
  }

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  if constexpr (T::kRoleSplit) {
    bwd_wide_roles_consumer<T>(p, base, hk, b, key0, m_first, per_head, total);
    return;
  }
  // queries 32c .. 32c+31 of S^T, dP^T; columns kH c .. kH c + kH-1 of dK, dV, dQ
  const int c = bwd_consumer_index<T>(wg);
  const int ctid = tid - 128 * wg;
  const int warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;
  const int qc = 32 * c;                   // this consumer's first query of the step
  const int key_lo = key0 + 16 * warp + g;  // S^T rows of this thread: key_lo, key_lo + 8
  const uint32_t col_c = c * T::kHalfBlocks;  // first column block of this consumer's half

  float acc_dv[kH / 2], acc_dk[kH / 2];
#pragma unroll
  for (int i = 0; i < kH / 2; ++i) acc_dv[i] = acc_dk[i] = 0.f;

  if (total > 0) mbar_wait(bar_kv, 0);
  if constexpr (T::kPacked) {
    // Keys past used_k in the tile (rows past seqused_k, or the next sequence's): zero rows of K and V.
    if (total > 0 && key0 + kBN > seq.used_k) {
      bwd_zero_rows<T::kDBlocks, T::kKVBlock, T::kRowBytes, kBN>(sK, seq.used_k - key0, tid - 128);
      bwd_zero_rows<T::kDBlocks, T::kKVBlock, T::kRowBytes, kBN>(sV, seq.used_k - key0, tid - 128);
      fence_proxy_async_smem();
      named_bar_sync<1, 256>();  // both consumers read all keys (dQ)
    }
  }

  constexpr uint32_t kDOFromQ = T::kDOOff - T::kQOff;  // dO's descriptors: Q's, moved by this

  for (int it = 0; it < total; ++it) {
    const int s = it % T::kStages;
    const int hq = hk * p.head_ratio + it / per_head;
    const int m = m_first + it % per_head;
    const int q0 = m * kBM;
    const uint32_t sQ = base + T::kQOff + s * T::kQTile, sDO = base + T::kDOOff + s * T::kQTile;
    const uint32_t sP = base + T::kPOff + (it & 1) * T::kPBlock, sDS = base + T::kDSOff + (it & 1) * T::kPBlock;
    mbar_wait(bar_full(s), (it / T::kStages) & 1);
    if constexpr (T::kPacked) {
      // Query rows past used_q in the tile: zero rows of this stage's Q and dO.
      if (q0 + kBM > seq.used_q) {
        bwd_zero_rows<T::kDBlocks, T::kQBlock, T::kRowBytes, kBM>(sQ, seq.used_q - q0, tid - 128);
        bwd_zero_rows<T::kDBlocks, T::kQBlock, T::kRowBytes, kBM>(sDO, seq.used_q - q0, tid - 128);
        fence_proxy_async_smem();
        named_bar_sync<1, 256>();
      }
    }

    // S^T = K Q_c^T and dP^T = V dO_c^T over D (K-major both): A = all 64 rows of K or V, B = rows
    // qc .. qc+31 of Q or dO (four atoms into each column block). Each product moves one descriptor per
    // operand with desc_advance (as bwd_kernel_sm90's); V's and dO's are K's and Q's moved.
    auto gemm_nt = [&](float (&acc)[16], uint64_t desc_a, uint64_t desc_b) {
      constexpr int kSteps = T::kColBlock / 16;
#pragma unroll
      for (int k = 0; k < kD / 16; ++k) {
        const uint32_t koff = (k % kSteps) * 32;
        wgmma_ss<T::kBf16, 32, 0>(acc, desc_advance(desc_a, (k / kSteps) * T::kKVBlock + koff),
                                  desc_advance(desc_b, (k / kSteps) * T::kQBlock + koff), k > 0);
      }
      wgmma_commit();
    };
    float st[16], dpt[16];
    const uint64_t desc_k_kmajor = bwd_tile_desc<T::kRowBytes>(sK, 16);
    const uint64_t desc_q_kmajor = bwd_tile_desc<T::kRowBytes>(sQ + qc * T::kRowBytes, 16);
    wgmma_fence();
    gemm_nt(st, desc_k_kmajor, desc_q_kmajor);
    gemm_nt(dpt, desc_advance(desc_k_kmajor, T::kVOff - T::kKOff), desc_advance(desc_q_kmajor, kDOFromQ));

    // Fragments of an m64n32 accumulator as the 16-bit A layout of k16 step j (queries 16j .. 16j+15):
    // r = 0: n8 block 2j rows g; 1: block 2j rows g+8; 2, 3: block 2j+1.
    auto fragment = [](const float (&acc)[16], int j, int r) {
      const int idx = 4 * (2 * j + r / 2) + 2 * (r % 2);
      return pack2<T::kBf16>(acc[idx], acc[idx + 1]);
    };
    // Stores 16-bit fragments into a [query][key] buffer (128-byte rows, 128B swizzle) through
    // stmatrix.trans: matrix mi of k step j holds keys 16 warp + 8 (mi % 2) .. +7 x queries
    // qc + 16j + 8 (mi / 2) .. +7.
    auto store_t = [&](uint32_t buf, const uint32_t (&fr)[2][4]) {
      const int mi = lane / 8, r = lane % 8;
      const int chunk = 2 * warp + (mi % 2);  // 16-byte chunk (8 keys) of the 128-byte row
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int q = qc + 16 * j + 8 * (mi / 2) + r;
        stmatrix_x4_trans(buf + q * 128 + ((chunk ^ (q & 7)) << 4), fr[j]);
      }
    };

    // P^T while dP^T runs. Columns (queries) of n8 block i: q0 + qc + 8i + 2t (+1); their lse_log2 are
    // read while the wgmmas run (as bwd_kernel_sm90's).
    const uint32_t sLse = base + T::kLseOff + s * kBM * 4 + qc * 4, sDsum = base + T::kDsumOff + s * kBM * 4 + qc * 4;
    [[maybe_unused]] float lse_cols[8];
    if constexpr (!T::kVariants) bwd_load_cols<4>(lse_cols, sLse, t);
    wgmma_wait<1>();
    fence_regs(st);
    uint32_t fr[2][4];
    if constexpr (!T::kVariants) {
      bwd_dense_probs<4>(st, lse_cols, p, key_lo, int64_t(q0) + qc + 2 * t, bwd_dense_need_mask(p, key0, kBN, q0 + qc));
      // st holds P^T from here on.
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) fr[j][r] = fragment(st, j, r);
    } else {
      // P^T into fr and, softcap, P^T (1 - tanh^2) into st (bwd_variant_probs); masked where the 64 keys
      // cross Sk or a window edge for some of this consumer's 32 queries.
      const bool need_mask = bwd_variant_need_mask<T::kPacked>(p, key0, q0 + qc, 32, seq.used_q, seq.used_k);
      const float slope_l2 = bwd_alibi_slope_l2(p, b, hq);
      if (p.variants.softcap > 0.f)
        bwd_variant_probs<T::kBf16, true, 4, T::kPacked>(st, fr, p, sLse, t, key_lo, q0 + qc + 2 * t, slope_l2,
                                                                 need_mask, seq.used_q, seq.used_k);
      else
        bwd_variant_probs<T::kBf16, false, 4, T::kPacked>(st, fr, p, sLse, t, key_lo, q0 + qc + 2 * t, slope_l2,
                                                                 need_mask, seq.used_q, seq.used_k);
    }
    store_t(sP, fr);
    fence_proxy_async_smem();
    named_bar_sync<1, 256>();  // both consumers' queries of P written
    // dV[:, half c] += P^T dO[:, half c]: A = P^T (M = 64 keys = one 128-byte row span, MN-major; 16 query
    // rows per k step = two atoms), B = dO's column blocks of half c (MN-major, blocks kQBlock apart).
    // The MN-major descriptors of P / dS (A) and of this consumer's half of Q / dO (B): dV's and dK's.
    const uint64_t desc_p_mnmajor = make_desc_sw128(sP, T::kPBlock, 1024);
    const uint64_t desc_q_mnmajor = bwd_tile_desc<T::kRowBytes>(sQ + col_c * T::kQBlock, T::kQBlock);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < kBM / 16; ++j)
      wgmma_ss<T::kBf16, kH, 1, 1>(acc_dv, desc_advance(desc_p_mnmajor, j * 2048),
                                   desc_advance(desc_q_mnmajor, kDOFromQ + j * 2 * T::kAtomBytes), 1);
    wgmma_commit();

    wgmma_wait<1>();  // dP^T done (dV may still run)
    fence_regs(dpt);
    // dS^T = P^T (dP^T - D).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 8 * i + 2 * t;
      float d0, d1;
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(d0), "=f"(d1) : "r"(sDsum + col * 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[4 * i + e] = st[4 * i + e] * (dpt[4 * i + e] - ((e & 1) ? d1 : d0));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) fr[j][r] = fragment(dpt, j, r);
    store_t(sDS, fr);
    fence_proxy_async_smem();
    named_bar_sync<1, 256>();  // both consumers' queries of dS written
    // dQ[:, half c] = dS K[:, half c], then dK[:, half c] += dS^T Q[:, half c] (as dV), two commit groups so
    // that the dQ atomics issue while dK runs. dQ: A = dS K-major over the 64 keys (one 128-byte row span:
    // four k16 steps of 32 bytes), B = K's column blocks of half c (MN-major: 16 key rows per k step,
    // blocks kKVBlock apart).
    float dq[kH / 2];
    bwd_wide_dq_gemm<T, kH>(dq, make_desc_sw128(sDS, 16, 1024),
                            bwd_tile_desc<T::kRowBytes>(sK + col_c * T::kKVBlock, T::kKVBlock));
#pragma unroll
    for (int j = 0; j < kBM / 16; ++j)
      wgmma_ss<T::kBf16, kH, 1, 1>(acc_dk, desc_advance(desc_p_mnmajor, T::kDSOff - T::kPOff + j * 2048),
                                   desc_advance(desc_q_mnmajor, j * 2 * T::kAtomBytes), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ done (dK may still run)
    fence_regs(dq);

    bwd_add_dq_fragments<kH, kH>(p.dq_accum + (bwd_ws_row<T>(p, b, hq, seq.q_start) + q0) * kD, dq, c, 0,
                                 p.headdim, warp, g, t);

    wgmma_wait<0>();
    fence_regs(acc_dv);
    fence_regs(acc_dk);
    // Every read of this stage's Q, dO, lse, D is done: hand it back to the producer. Each thread arrives,
    // so each one's release covers its own shared-memory reads of lse and D.
    mbar_arrive(bar_empty(s));
  }

  // dK * scale and dV from registers (rows = keys key_lo, key_lo + 8; columns kH c + 8i + 2t, n8 blocks
  // at or past the head dimension skipped).
  // Packed: the sequence's rows from k_start, those it owns (len_k) written, zeros past used_k. Its bounds
  // are read again here rather than held through the loop, which has no register to spare.
  if constexpr (T::kPacked) seq = bwd_sequence(p, b);
  Elem* gdk = static_cast<Elem*>(p.dk) +
              (T::kPacked ? int64_t(seq.k_start) * p.dk_row_stride : int64_t(b) * p.dk_batch_stride) +
              int64_t(hk) * p.dk_head_stride + kH * c;
  Elem* gdv = static_cast<Elem*>(p.dv) +
              (T::kPacked ? int64_t(seq.k_start) * p.dv_row_stride : int64_t(b) * p.dv_batch_stride) +
              int64_t(hk) * p.dv_head_stride + kH * c;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_lo + 8 * h;
    if (key < (T::kPacked ? seq.len_k : p.seqlen_k)) {
      const bool live = !T::kPacked || key < seq.used_k;
#pragma unroll
      for (int i = 0; i < kH / 8; ++i) {
        if (kH * c + 8 * i >= p.headdim) break;
        const int col = 8 * i + 2 * t;
        *reinterpret_cast<uint32_t*>(gdk + int64_t(key) * p.dk_row_stride + col) =
            live ? pack2<T::kBf16>(acc_dk[4 * i + 2 * h] * p.scale, acc_dk[4 * i + 2 * h + 1] * p.scale) : 0u;
        *reinterpret_cast<uint32_t*>(gdv + int64_t(key) * p.dv_row_stride + col) =
            live ? pack2<T::kBf16>(acc_dv[4 * i + 2 * h], acc_dv[4 * i + 2 * h + 1]) : 0u;
      }
    }
  }
#endif
}

// ------------------------------------------------------------------ steps of the B_c = 96 and 80 kernels
// The barriers of the B_c = 96 and 80 kernels after kBarOff: kv_full, full[s], empty[s] (Q, lse, D, and dO where
// it has kStages stages), then with one dO stage do_full, do_empty.
template <class T>
struct BwdWideKeysBars {
  uint32_t kv;
  __device__ __forceinline__ uint32_t full(int s) const { return kv + 8u * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return kv + 8u * (1 + T::kStages + s); }
  __device__ __forceinline__ uint32_t do_full() const { return kv + 8u * (1 + 2 * T::kStages); }
  __device__ __forceinline__ uint32_t do_empty() const { return do_full() + 8u; }
};

// Thread 0 of the B_c = 96 and 80 kernels: the maps' descriptors prefetched, the barriers initialised (an empty
// barrier takes one arrival per consumer thread).
template <class T>
__device__ __forceinline__ void bwd_wide_keys_init(const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                   const CUtensorMap* tm_v, const CUtensorMap* tm_do,
                                                   const BwdWideKeysBars<T>& bars) {
  tma_prefetch_desc(tm_q);
  tma_prefetch_desc(tm_k);
  tma_prefetch_desc(tm_v);
  tma_prefetch_desc(tm_do);
  mbar_init(bars.kv, 1);
  for (int s = 0; s < T::kStages; ++s) {
    mbar_init(bars.full(s), 1);
    mbar_init(bars.empty(s), T::kThreads - 128);
  }
  if constexpr (T::kDOStages == 1) {
    mbar_init(bars.do_full(), 1);
    mbar_init(bars.do_empty(), T::kThreads - 128);
  }
  mbar_init_fence();
}

// The producer thread of the B_c = 96 and 80 kernels: K and V once, then per step (query head of the group, query
// tile) Q, lse and D into the ring's stage, and dO with them, or with one dO stage into it once the consumers hand
// it back (they do so mid-step, so the load runs under the rest of their step).
template <class T>
__device__ __forceinline__ void bwd_wide_keys_producer(const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                       const CUtensorMap* tm_v, const CUtensorMap* tm_do,
                                                       const BwdParams& p, uint32_t base,
                                                       const BwdWideKeysBars<T>& bars, int key0, int hk, int b,
                                                       int m_first, int per_head, int total) {
  constexpr int kBM = T::kBlockM;
  constexpr bool kOwnDO = T::kDOStages == 1;
  mbar_arrive_expect_tx(bars.kv, 2 * T::kKVTile);
  for (int h = 0; h < T::kDBlocks; ++h) {
    tma_load_4d(tm_k, base + T::kKOff + h * T::kKVBlock, bars.kv, T::kColBlock * h, key0, hk, b);
    tma_load_4d(tm_v, base + T::kVOff + h * T::kKVBlock, bars.kv, T::kColBlock * h, key0, hk, b);
  }
  for (int it = 0; it < total; ++it) {
    const int s = it % T::kStages;
    const uint32_t use = it / T::kStages;
    if (use > 0) mbar_wait(bars.empty(s), (use - 1) & 1);
    const int hq = hk * p.head_ratio + it / per_head;
    const int m = m_first + it % per_head;
    const uint32_t full = bars.full(s);
    mbar_arrive_expect_tx(full, kOwnDO ? T::kQTile + 2 * kBM * 4 : T::kStepTxBytes);
    const uint32_t sQ = base + T::kQOff + s * T::kQTile, sDO = base + T::kDOOff + (kOwnDO ? 0 : s * T::kQTile);
    for (int h = 0; h < T::kDBlocks; ++h) {
      tma_load_4d(tm_q, sQ + h * T::kQBlock, full, T::kColBlock * h, m * kBM, hq, b);
      if constexpr (!kOwnDO) tma_load_4d(tm_do, sDO + h * T::kQBlock, full, T::kColBlock * h, m * kBM, hq, b);
    }
    // The workspaces are padded to kBwdSeqQPad rows: the whole tile is in bounds.
    const int64_t row = (int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded + int64_t(m) * kBM;
    bulk_load(base + T::kLseOff + s * kBM * 4, p.lse_log2 + row, kBM * 4, full);
    bulk_load(base + T::kDsumOff + s * kBM * 4, p.dsum + row, kBM * 4, full);
    if constexpr (kOwnDO) {
      if (it > 0) mbar_wait(bars.do_empty(), (it - 1) & 1);
      mbar_arrive_expect_tx(bars.do_full(), T::kQTile);
      for (int h = 0; h < T::kDBlocks; ++h)
        tma_load_4d(tm_do, sDO + h * T::kQBlock, bars.do_full(), T::kColBlock * h, m * kBM, hq, b);
    }
  }
}

// The work of a CTA of the B_c = 96 and 80 kernels: its key tile, kv head and batch, and its steps (query head of
// the group, query tile): query tiles m_first .. m_first + per_head - 1 of each query head, total in all.
struct BwdWideKeysWork {
  int hk, b, key0, m_first, per_head, total;
};

template <class T>
__device__ __forceinline__ BwdWideKeysWork bwd_wide_keys_work(const BwdParams& p) {
  const BwdBlock block = bwd_block<T>(p);
  BwdWideKeysWork w{block.hk, block.b, block.n_block * T::kBlockN, 0, 0, 0};
  bwd_query_tiles<T>(p, w.key0, p.seqlen_q, p.seqlen_k, w.m_first, w.per_head);
  w.total = w.per_head * p.head_ratio;
  return w;
}

// Step it of the walk (query head of the group, query tile): its Q stage, query head, first query, and its P and dS
// buffers (two each, alternating).
struct BwdWideKeysStep {
  int s, hq, q0;
  uint32_t sQ, sP, sDS;
};

template <class T>
__device__ __forceinline__ BwdWideKeysStep bwd_wide_keys_step(const BwdParams& p, const BwdWideKeysWork& w,
                                                              uint32_t base, int it) {
  const int s = it % T::kStages;
  return {s, w.hk * p.head_ratio + it / w.per_head, (w.m_first + it % w.per_head) * T::kBlockM,
          base + T::kQOff + s * T::kQTile, base + T::kPOff + (it & 1) * T::kPBlock,
          base + T::kDSOff + (it & 1) * T::kPBlock};
}

// The start of the B_c = 96 and 80 kernels: barriers initialised, then the producer warpgroup (warpgroup 0) gives
// up registers and its thread 0 runs the loads. True in the producer warpgroup, which then has nothing left to do.
template <class T>
__device__ __forceinline__ bool bwd_wide_keys_start(const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                                    const CUtensorMap* tm_v, const CUtensorMap* tm_do,
                                                    const BwdParams& p, uint32_t base, const BwdWideKeysBars<T>& bars,
                                                    const BwdWideKeysWork& w) {
  const int tid = threadIdx.x;
  if (tid == 0) bwd_wide_keys_init<T>(tm_q, tm_k, tm_v, tm_do, bars);
  __syncthreads();
  if (tid >= 128) return false;
  setmaxnreg_dec<T::kProducerRegs>();
  if (tid == 0 && w.total > 0)
    bwd_wide_keys_producer<T>(tm_q, tm_k, tm_v, tm_do, p, base, bars, w.key0, w.hk, w.b, w.m_first, w.per_head,
                              w.total);
  return true;
}

// S = Q K_c^T or dP = dO V_c^T over D (K-major both): A = the step's 64 rows of Q or dO at sA, B = kN rows of K or
// V at sB (in each column block: the caller's first row), in column blocks kQBlock / kKVBlock apart; committed.
template <class T, int kN>
__device__ __forceinline__ void bwd_wide_gemm_nt(float (&acc)[kN / 2], uint32_t sA, uint32_t sB) {
  constexpr int kSteps = T::kColBlock / 16;
#pragma unroll
  for (int k = 0; k < T::kHeadDim / 16; ++k) {
    const uint32_t koff = (k % kSteps) * 32;
    wgmma_ss<T::kBf16, kN, 0>(acc, bwd_tile_desc<T::kRowBytes>(sA + (k / kSteps) * T::kQBlock + koff, 16),
                              bwd_tile_desc<T::kRowBytes>(sB + (k / kSteps) * T::kKVBlock + koff, 16), k > 0);
  }
  wgmma_commit();
}

// P = exp2(S scale log2(e) - lse) in place, for an m64 x kN accumulator whose n8 block i holds keys key_lo + 8i
// (+1) of rows (queries) q0 + row_lo and q0 + row_lo + 8 (their lse at sLse and sLse + 32), and 0 past Sk and,
// causal, past the diagonal.
template <int kN>
__device__ __forceinline__ void bwd_wide_probs(float (&sp)[kN / 2], const BwdParams& p, uint32_t sLse, int q0,
                                               int row_lo, int key_lo, int64_t causal_shift) {
  float lse[2];
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(lse[0]) : "r"(sLse));
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(lse[1]) : "r"(sLse + 32));
  // Element (i, e) is key key_lo + 8i + (e & 1) of row h = e >> 1: visible iff 8i + (e & 1) <= last[h]
  // (key < Sk, and causal key <= query + Sk - Sq), so that the masks compare immediates.
  int last[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int64_t l = int64_t(p.seqlen_k) - 1 - key_lo;
    if (p.causal) l = min(l, int64_t(q0) + row_lo + 8 * h + causal_shift - key_lo);
    last[h] = static_cast<int>(max(min(l, int64_t(kN)), int64_t(-1)));
  }
#pragma unroll
  for (int i = 0; i < kN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = exp2f(sp[4 * i + e] * p.scale_log2 - lse[e >> 1]);
      sp[4 * i + e] = 8 * i + (e & 1) <= last[e >> 1] ? x : 0.f;
    }
  }
}

// dS = P (dP - D) in place in dp, rows as bwd_wide_probs (their D at sDsum and sDsum + 32).
template <int kN>
__device__ __forceinline__ void bwd_wide_dsoftmax(float (&dp)[kN / 2], const float (&sp)[kN / 2], uint32_t sDsum) {
  float dsum[2];
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(dsum[0]) : "r"(sDsum));
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(dsum[1]) : "r"(sDsum + 32));
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) dp[i] = sp[i] * (dp[i] - dsum[(i >> 1) & 1]);
}

// dK^T or dV^T (kMT m64 tiles of columns col0 + 64r .., kN keys) times scale into [key][column] rows at sOut
// (kOutRow bytes apart), by stmatrix.x4.trans of 16 keys (n8 blocks 2j, 2j+1) x 16 columns: matrix mi holds columns
// col0 + 64r + 16 warp + 8 (mi % 2) .. +7 of keys 16j + 8 (mi / 2) .. +7, row lane % 8 of it from this lane.
template <class T, int kMT, int kN, uint32_t kOutRow>
__device__ __forceinline__ void bwd_wide_stage_transposed(const float (&acc)[kMT][kN / 2], float scale, uint32_t sOut,
                                                          int col0, int warp, int lane) {
  const int mi = lane / 8;
#pragma unroll
  for (int r = 0; r < kMT; ++r)
#pragma unroll
    for (int j = 0; j < kN / 16; ++j) {
      uint32_t fr[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int idx = 4 * (2 * j + k / 2) + 2 * (k % 2);
        fr[k] = pack2<T::kBf16>(acc[r][idx] * scale, acc[r][idx + 1] * scale);
      }
      const int key = 16 * j + 8 * (mi / 2) + lane % 8;
      stmatrix_x4_trans(sOut + key * kOutRow + (col0 + 64 * r + 16 * warp + 8 * (mi % 2)) * 2, fr);
    }
}

// kRows rows of dK or dV staged [key][column] at sOut (kOutRow bytes apart) into gout rows first_key .., 16 bytes
// per thread and turn over kThreads threads (thread index idx0); rows past Sk and columns past the head dimension
// are not written.
template <class Elem, int kD, int kRows, int kThreads, uint32_t kOutRow>
__device__ __forceinline__ void bwd_wide_copy_out(uint32_t sOut, Elem* gout, int first_key, int idx0,
                                                  const BwdParams& p, int64_t row_stride) {
  constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
#pragma unroll 1
  for (int idx = idx0; idx < kRows * kChunks; idx += kThreads) {
    const int key = idx / kChunks, col = 8 * (idx % kChunks);
    const int gkey = first_key + key;
    if (gkey < p.seqlen_k && col < p.headdim) {
      *reinterpret_cast<uint4*>(gout + int64_t(gkey) * row_stride + col) =
          ld_shared_v4_b32(sOut + key * kOutRow + col * 2);
    }
  }
}

// ------------------------------------------------------------------ wide tiles, 96 keys (D = 192)
// Sm90BwdWideTraits<kBf16, 192, 96>: 96 keys per CTA, half again as many as bwd_kernel_sm90_wide, so a third
// fewer dQ atomics and Q, dO, lse, D loads per key. An m64 wgmma cannot have 96 keys as its M, so the
// consumers split the keys (48 each) rather than the columns of dK and dV, and those are computed
// transposed, with D as M (three m64 tiles):
//   S_c  = Q K_c^T, dP_c = dO V_c^T          SS wgmma m64n48: the 64 queries x keys 48c .. 48c+47
//   P_c, dS_c in registers -> shared memory ([query][key], 16-key blocks, 32B swizzle, stmatrix)
//   dV^T_c += dO^T P_c                      SS wgmma m64n48 x 3, A = dO MN-major, B = P MN-major, K = 64 queries
//   dK^T_c += Q^T dS_c                      SS wgmma m64n48 x 3 (as dV)
//   dQ[:, half c] = dS K[:, half c]         SS wgmma m64n96, A = dS K-major over the 96 keys (both
//                                           consumers' blocks: a barrier over 256 threads), B = K MN-major
// Registers per consumer thread: dV^T, dK^T 72 each, S, dP 24 each, dQ 48 (S, dP dead before dQ is live).
// Shared memory: K, V 96 x 192 each (72 KiB); Q, dO 2 stages x 24 KiB each; P, dS 2 buffers x 12 KiB each;
// lse/D 1 KiB: 217 KiB + barriers + 1 KiB alignment slack. dK and dV leave through a free Q or dO stage
// (transposed by stmatrix.trans), in 16-byte stores.
// The attention variants are not built for it (kSupportsVariants false), nor packed batches (their build is the
// variants one); .lpt takes it as any wide build.
template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    bwd_kernel_sm90_wide_keys(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_do,
                              const __grid_constant__ BwdParams p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim, kH = T::kHalf;
  constexpr int kNK = kBN / 2;         // keys per consumer: 48
  constexpr int kMT = kD / 64;         // m64 tiles of dV^T, dK^T: 3
  constexpr int kMB = 64 / T::kColBlock;  // column blocks per m64 tile: 2
  static_assert(T::kKeySplit && kNK == 48 && kD % 64 == 0 && T::kSBlock == 2048, "B_c = 96 at D = 192");
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = base + T::kKOff, sV = base + T::kVOff;
  const BwdWideKeysBars<T> bars{base + T::kBarOff};

  const BwdWideKeysWork work = bwd_wide_keys_work<T>(p);
  const int hk = work.hk, b = work.b, key0 = work.key0, total = work.total;
  if (bwd_wide_keys_start<T>(&tm_q, &tm_k, &tm_v, &tm_do, p, base, bars, work)) return;  // the producer's part
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = bwd_consumer_index<T>(wg);  // keys 48c .. 48c+47 of S, dP, dV, dK; columns kH c .. kH c + kH-1 of dQ
  const int ctid = tid - 128 * wg;
  const int warp = ctid / 32, lane = ctid % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_lo = 16 * warp + g;             // S, dP rows (queries of the step): row_lo, row_lo + 8
  const int key_lo = key0 + kNK * c + 2 * t;    // S, dP columns of n8 block i: key_lo + 8i (+1)
  constexpr int kSB = kNK / 16;                 // this consumer's 16-key blocks of P and dS: 3
  const uint32_t sblk_c = c * kSB * T::kSBlock;  // their offset

  float acc_dv[kMT][kNK / 2], acc_dk[kMT][kNK / 2];
#pragma unroll
  for (int r = 0; r < kMT; ++r)
#pragma unroll
    for (int i = 0; i < kNK / 2; ++i) acc_dv[r][i] = acc_dk[r][i] = 0.f;

  if (total > 0) mbar_wait(bars.kv, 0);
  const int64_t causal_shift = int64_t(p.seqlen_k) - p.seqlen_q;

  for (int it = 0; it < total; ++it) {
    const BwdWideKeysStep step = bwd_wide_keys_step<T>(p, work, base, it);
    const int s = step.s, hq = step.hq, q0 = step.q0;
    const uint32_t sQ = step.sQ, sP = step.sP, sDS = step.sDS, sDO = base + T::kDOOff + s * T::kQTile;
    mbar_wait(bars.full(s), (it / T::kStages) & 1);

    // S = Q K_c^T and dP = dO V_c^T: B = rows 48c .. 48c+47 of K or V (six atoms into each column block).
    float sp[kNK / 2], dp[kNK / 2];
    wgmma_fence();
    bwd_wide_gemm_nt<T, kNK>(sp, sQ, sK + kNK * c * T::kRowBytes);
    bwd_wide_gemm_nt<T, kNK>(dp, sDO, sV + kNK * c * T::kRowBytes);

    // 16-bit fragments of an m64n48 accumulator, 16 keys (two n8 blocks) per x4: r = 0: block 2j rows g;
    // 1: block 2j rows g+8; 2, 3: block 2j+1. stmatrix (not transposed) stores them as [query][key]:
    // matrix mi holds queries 16 warp + 8 (mi % 2) .. +7 x keys 16j + 8 (mi / 2) .. +7, the 16-byte chunk
    // mi / 2 of the 32-byte row of 16-key block j (32B swizzle: chunk ^= bit 2 of the row).
    auto fragment = [](const float (&acc)[kNK / 2], int j, int r) {
      const int idx = 4 * (2 * j + r / 2) + 2 * (r % 2);
      return pack2<T::kBf16>(acc[idx], acc[idx + 1]);
    };
    auto store = [&](uint32_t buf, const float (&acc)[kNK / 2]) {
      const int mi = lane / 8, r = lane % 8;
      const int q = 16 * warp + 8 * (mi % 2) + r;
      const uint32_t off = q * 32 + (((mi / 2) ^ ((q >> 2) & 1)) << 4);
#pragma unroll
      for (int j = 0; j < kSB; ++j) {
        uint32_t fr[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) fr[k] = fragment(acc, j, k);
        stmatrix_x4(buf + sblk_c + j * T::kSBlock + off, fr);
      }
    };

    // P while dP runs. Rows (queries) q0 + row_lo (+8): lse and D are one value per row.
    wgmma_wait<1>();
    fence_regs(sp);
    const uint32_t sLse = base + T::kLseOff + s * kBM * 4 + row_lo * 4;
    const uint32_t sDsum = base + T::kDsumOff + s * kBM * 4 + row_lo * 4;
    bwd_wide_probs<kNK>(sp, p, sLse, q0, row_lo, key_lo, causal_shift);  // P from here on
    store(sP, sp);
    fence_proxy_async_smem();
    // This consumer's keys of P written (it alone reads them).
    if (c == 0) named_bar_sync<2, 128>();
    else named_bar_sync<3, 128>();
    // dV^T[64r .. 64r+63, keys of c] += dO^T P_c: A = dO's column blocks 2r, 2r+1 (MN-major, blocks kQBlock
    // apart; 16 query rows per k step = two atoms), B = P's blocks of c (MN-major, blocks kSBlock apart).
    wgmma_fence();
#pragma unroll
    for (int r = 0; r < kMT; ++r)
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_ss<T::kBf16, kNK, 1, 1>(
            acc_dv[r], bwd_tile_desc<T::kRowBytes>(sDO + kMB * r * T::kQBlock + j * 2 * T::kAtomBytes, T::kQBlock),
            make_desc_sw32(sP + sblk_c + j * 512, T::kSBlock, 256), 1);
    wgmma_commit();

    wgmma_wait<1>();  // dP done (dV may still run)
    fence_regs(dp);
    bwd_wide_dsoftmax<kNK>(dp, sp, sDsum);  // dS
    store(sDS, dp);
    fence_proxy_async_smem();
    named_bar_sync<1, 256>();  // both consumers' keys of dS written
    // dQ[:, half c] = dS K[:, half c]: A = dS K-major over the 96 keys (one 16-key block per k step),
    // B = K's column blocks of half c (MN-major: 16 key rows per k step, blocks kKVBlock apart). Then
    // dK^T += Q^T dS_c (as dV), two commit groups so that the dQ atomics issue while dK runs.
    float dq[kH / 2];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBN / 16; ++k)
      wgmma_ss<T::kBf16, kH, 1>(dq, make_desc_sw32(sDS + k * T::kSBlock, 16, 256),
                                bwd_tile_desc<T::kRowBytes>(sK + c * T::kHalfBlocks * T::kKVBlock + k * 16 * T::kRowBytes,
                                                            T::kKVBlock),
                                k > 0);
    wgmma_commit();
#pragma unroll
    for (int r = 0; r < kMT; ++r)
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_ss<T::kBf16, kNK, 1, 1>(
            acc_dk[r], bwd_tile_desc<T::kRowBytes>(sQ + kMB * r * T::kQBlock + j * 2 * T::kAtomBytes, T::kQBlock),
            make_desc_sw32(sDS + sblk_c + j * 512, T::kSBlock, 256), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ done (dK may still run)
    fence_regs(dq);

    bwd_add_dq_fragments<kH, kH>(p.dq_accum + ((int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded + q0) * kD, dq, c,
                                 0, p.headdim, warp, g, t);

    wgmma_wait<0>();
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      fence_regs(acc_dv[r]);
      fence_regs(acc_dk[r]);
    }
    // Every read of this stage's Q, dO, lse, D is done: hand it back to the producer.
    mbar_arrive(bars.empty(s));
  }

  // dK^T * scale and dV^T through shared memory into [key][column] rows, then 16-byte stores. Consumer c
  // stages its 48 keys in the Q (c = 0) or dO (c = 1) stage of the ring that the last step did not use
  // (total % 2; no load is pending there, and both consumers finished reading it before the last step's
  // barrier): rows of 2D + 16 bytes, so that the eight rows of an stmatrix land in distinct banks.
  constexpr uint32_t kOutRow = 2 * kD + 16;
  static_assert(kNK * kOutRow <= T::kQTile, "a consumer's dK or dV rows fit one Q stage");
  const uint32_t sOut = base + (c == 0 ? T::kQOff : T::kDOOff) + (total % 2) * T::kQTile;
  auto write_out = [&](const float (&acc)[kMT][kNK / 2], float scale, void* out, int64_t batch_stride,
                       int64_t head_stride, int64_t row_stride) {
    bwd_wide_stage_transposed<T, kMT, kNK, kOutRow>(acc, scale, sOut, 0, warp, lane);
    if (c == 0) named_bar_sync<2, 128>();
    else named_bar_sync<3, 128>();
    bwd_wide_copy_out<Elem, kD, kNK, 128, kOutRow>(
        sOut, static_cast<Elem*>(out) + int64_t(b) * batch_stride + int64_t(hk) * head_stride, key0 + kNK * c, ctid, p,
        row_stride);
    if (c == 0) named_bar_sync<2, 128>();  // the rows are read before the next tensor's overwrite them
    else named_bar_sync<3, 128>();
  };
  write_out(acc_dk, p.scale, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
  write_out(acc_dv, 1.f, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
#endif
}

// ------------------------------------------------------------------ wide tiles, 80 keys (D = 256)
// Sm90BwdWideTraits<kBf16, 256, 80>: FlashAttention-3's d256 tile. 80 keys per CTA, a quarter more than
// bwd_kernel_sm90_wide, so a fifth fewer Q, dO, lse, D loads and dQ atomics per key. dK and dV are computed
// transposed, with D as M, and the consumers split D (two m64 tiles each), each over all 80 keys:
//   S_c = Q K_c^T, dP_c = dO V_c^T       SS wgmma m64n40: the 64 queries x keys 40c .. 40c+39
//   P_c, dS_c in registers -> shared memory ([query][key], 16-key blocks, 32B swizzle, stmatrix; key block 2
//                                        holds consumer 0's last 8 keys and consumer 1's first 8)
//   dV^T[128c + 64r ..] += dO^T P        SS wgmma m64n80, r = 0, 1: A = dO's column block 2c + r MN-major, B = P
//                                        MN-major over all 80 keys (a barrier over both consumers first)
//   dK^T[128c + 64r ..] += Q^T dS        (as dV)
//   dQ[:, 128c + 64h ..] = dS K[:, ..]   SS wgmma m64n64, h = 0 then 1 in the same 32 registers (64 beside dV^T
//                                        and dK^T's 160 would not fit): A = dS K-major over the 80 keys, B = K
//                                        MN-major; each slice's red.global.add issue while the next GEMM runs
// Registers per consumer thread: dV^T, dK^T 80 each, S, dP 20 each, dQ 32 (S, dP dead before dQ is live).
// Shared memory: K, V 80 x 256 each (80 KiB); Q 2 stages, dO one (96 KiB); P, dS 2 buffers x 10 KiB each;
// lse/D 1 KiB: 218 KiB + barriers + 1 KiB alignment slack. dO's one stage goes back to the producer as soon as
// both consumers' dV^T is done, so the next step's dO loads under this step's dQ and dK. dK and dV leave through
// the Q and dO stages (free once both consumers are past their last step), transposed by stmatrix.trans, in
// 16-byte stores.
// The attention variants are not built for it (kSupportsVariants false), nor packed batches.
template <class T>
__global__ void __launch_bounds__(T::kThreads, 1)
    bwd_kernel_sm90_wide_kv_transposed(const __grid_constant__ CUtensorMap tm_q,
                                       const __grid_constant__ CUtensorMap tm_k,
                                       const __grid_constant__ CUtensorMap tm_v,
                                       const __grid_constant__ CUtensorMap tm_do,
                                       const __grid_constant__ BwdParams p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim, kH = T::kHalf;
  constexpr int kNK = kBN / 2;  // keys per consumer in S, dP: 40
  constexpr int kMT = kH / 64;  // m64 tiles of dV^T, dK^T per consumer: 2
  constexpr int kQSlice = 64;   // dQ columns per slice
  static_assert(T::kTransposedKV && kNK == 40 && kD == 256 && T::kColBlock == 64 && T::kDOStages == 1 &&
                    T::kSBlock == 2048 && kBN % 16 == 0,
                "B_c = 80 at D = 256");
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = base + T::kKOff, sV = base + T::kVOff, sDO = base + T::kDOOff;
  const BwdWideKeysBars<T> bars{base + T::kBarOff};

  const BwdWideKeysWork work = bwd_wide_keys_work<T>(p);
  const int hk = work.hk, b = work.b, key0 = work.key0, total = work.total;
  if (bwd_wide_keys_start<T>(&tm_q, &tm_k, &tm_v, &tm_do, p, base, bars, work)) return;  // the producer's part
  const int tid = threadIdx.x;
  const int wg = tid / 128;

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = bwd_consumer_index<T>(wg);  // keys 40c .. 40c+39 of S, dP; columns 128c .. 128c+127 of dV, dK, dQ
  const int ctid = tid - 128;  // 0 .. 255 over both consumers
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_lo = 16 * warp + g;           // S, dP rows (queries of the step): row_lo, row_lo + 8
  const int key_lo = key0 + kNK * c + 2 * t;  // S, dP columns of n8 block i: key_lo + 8i (+1)

  float acc_dv[kMT][kBN / 2], acc_dk[kMT][kBN / 2];
#pragma unroll
  for (int r = 0; r < kMT; ++r)
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) acc_dv[r][i] = acc_dk[r][i] = 0.f;

  if (total > 0) mbar_wait(bars.kv, 0);
  const int64_t causal_shift = int64_t(p.seqlen_k) - p.seqlen_q;

  for (int it = 0; it < total; ++it) {
    const BwdWideKeysStep step = bwd_wide_keys_step<T>(p, work, base, it);
    const int s = step.s, hq = step.hq, q0 = step.q0;
    const uint32_t sQ = step.sQ, sP = step.sP, sDS = step.sDS;

    // S = Q K_c^T and dP = dO V_c^T: B = rows 40c .. 40c+39 of K or V (five atoms into each column block).
    float sp[kNK / 2], dp[kNK / 2];
    mbar_wait(bars.full(s), (it / T::kStages) & 1);
    wgmma_fence();
    bwd_wide_gemm_nt<T, kNK>(sp, sQ, sK + kNK * c * T::kRowBytes);
    mbar_wait(bars.do_full(), it & 1);
    wgmma_fence();  // the wait's loop would have ptxas inject one
    bwd_wide_gemm_nt<T, kNK>(dp, sDO, sV + kNK * c * T::kRowBytes);

    // An m64n40 accumulator as [query][key]: n8 block i (keys 40c + 8i ..) is the 16-byte chunk (5c + i) % 2 of
    // the 32-byte rows of 16-key block (40c + 8i) / 16 (32B swizzle: chunk ^= bit 2 of the row); stmatrix.x2:
    // matrix 0 queries 16 warp .. +7 (registers 4i, 4i+1), matrix 1 queries +8 .. +15 (4i+2, 4i+3).
    auto store = [&](uint32_t buf, const float (&acc)[kNK / 2]) {
      const int q = 16 * warp + 8 * ((lane / 8) % 2) + lane % 8;
#pragma unroll
      for (int i = 0; i < kNK / 8; ++i) {
        const int kk = kNK * c + 8 * i;
        const uint32_t off = (kk / 16) * T::kSBlock + q * 32 + ((((kk / 8) % 2) ^ ((q >> 2) & 1)) << 4);
        stmatrix_x2(buf + off, pack2<T::kBf16>(acc[4 * i], acc[4 * i + 1]),
                    pack2<T::kBf16>(acc[4 * i + 2], acc[4 * i + 3]));
      }
    };

    // P while dP runs. Rows (queries) q0 + row_lo (+8): lse and D are one value per row.
    wgmma_wait<1>();
    fence_regs(sp);
    const uint32_t sLse = base + T::kLseOff + s * kBM * 4 + row_lo * 4;
    const uint32_t sDsum = base + T::kDsumOff + s * kBM * 4 + row_lo * 4;
    bwd_wide_probs<kNK>(sp, p, sLse, q0, row_lo, key_lo, causal_shift);  // P from here on
    store(sP, sp);
    fence_proxy_async_smem();
    named_bar_sync<2, 256>();  // both consumers' keys of P written
    // dV^T[128c + 64r .., :] += dO^T P: A = dO's column block 2c + r (MN-major; 16 query rows per k step =
    // two atoms), B = P over all 80 keys (MN-major, 16-key blocks kSBlock apart).
    wgmma_fence();
#pragma unroll
    for (int r = 0; r < kMT; ++r)
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_ss<T::kBf16, kBN, 1, 1>(
            acc_dv[r], bwd_tile_desc<T::kRowBytes>(sDO + (kMT * c + r) * T::kQBlock + j * 2 * T::kAtomBytes, T::kQBlock),
            make_desc_sw32(sP + j * 512, T::kSBlock, 256), 1);
    wgmma_commit();

    wgmma_wait<1>();  // dP done (dV may still run)
    fence_regs(dp);
    bwd_wide_dsoftmax<kNK>(dp, sp, sDsum);  // dS
    store(sDS, dp);
    fence_proxy_async_smem();
    named_bar_sync<1, 256>();  // both consumers' keys of dS written

    // dQ[:, 128c + 64h ..] = dS K[:, ..]: A = dS K-major over the 80 keys (one 16-key block per k step), B = K's
    // column block 2c + h (MN-major: 16 key rows per k step). Added into the fp32 accumulator in fragment order
    // (bwd_add_dq_fragments).
    float dq[kQSlice / 2];
    auto issue_dq = [&](int h) {
#pragma unroll
      for (int k = 0; k < kBN / 16; ++k)
        wgmma_ss<T::kBf16, kQSlice, 1>(dq, make_desc_sw32(sDS + k * T::kSBlock, 16, 256),
                                       bwd_tile_desc<T::kRowBytes>(sK + (kMT * c + h) * T::kKVBlock +
                                                                       k * 16 * T::kRowBytes,
                                                                   T::kKVBlock),
                                       k > 0);
      wgmma_commit();
    };
    float* dq_tile = p.dq_accum + ((int64_t(b) * p.heads_q + hq) * p.seqlen_q_rounded + q0) * kD;
    auto add_dq = [&](int h) { bwd_add_dq_fragments<kQSlice, kH>(dq_tile, dq, c, kQSlice * h, p.headdim, warp, g, t); };
    wgmma_fence();
    issue_dq(0);
    // dK^T[128c + 64r .., :] += Q^T dS (as dV)
#pragma unroll
    for (int r = 0; r < kMT; ++r)
#pragma unroll
      for (int j = 0; j < kBM / 16; ++j)
        wgmma_ss<T::kBf16, kBN, 1, 1>(
            acc_dk[r], bwd_tile_desc<T::kRowBytes>(sQ + (kMT * c + r) * T::kQBlock + j * 2 * T::kAtomBytes, T::kQBlock),
            make_desc_sw32(sDS + j * 512, T::kSBlock, 256), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dV and the first dQ slice done (dK may still run)
    fence_regs(dq);
    mbar_arrive(bars.do_empty());  // this consumer's reads of dO (dP, dV) are done
    add_dq(0);
    wgmma_fence();  // the adds read dq before the next slice overwrites it
    issue_dq(1);
    wgmma_wait<0>();
    fence_regs(dq);
    add_dq(1);
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      fence_regs(acc_dv[r]);
      fence_regs(acc_dk[r]);
    }
    // Every read of this stage's Q, lse, D is done: hand it back to the producer.
    mbar_arrive(bars.empty(s));
  }

  // dK^T * scale and dV^T through shared memory into [key][column] rows, then 16-byte stores. Once both consumers
  // are past their last step, nothing reads the Q and dO stages and no load is pending: dK's 80 rows go at the
  // start of that region and dV's after them, rows of 2D + 16 bytes (the eight rows of an stmatrix in distinct
  // banks).
  constexpr uint32_t kOutRow = 2 * kD + 16;
  static_assert(2 * kBN * kOutRow <= T::kStages * T::kQTile + T::kDOStages * T::kQTile && T::kDOOff ==
                    T::kQOff + T::kStages * T::kQTile,
                "dK and dV rows fit the Q and dO stages");
  named_bar_sync<1, 256>();
  const uint32_t sOutK = base + T::kQOff, sOutV = sOutK + kBN * kOutRow;
  bwd_wide_stage_transposed<T, kMT, kBN, kOutRow>(acc_dk, p.scale, sOutK, kH * c, warp, lane);
  bwd_wide_stage_transposed<T, kMT, kBN, kOutRow>(acc_dv, 1.f, sOutV, kH * c, warp, lane);
  named_bar_sync<1, 256>();
  auto write_out = [&](uint32_t sOut, void* out, int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
    bwd_wide_copy_out<Elem, kD, kBN, 256, kOutRow>(
        sOut, static_cast<Elem*>(out) + int64_t(b) * batch_stride + int64_t(hk) * head_stride, key0, ctid, p,
        row_stride);
  };
  write_out(sOutK, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
  write_out(sOutV, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
#endif
}

}  // namespace sm90
}  // namespace flashop

// The backward kernel configuration: a compile-time struct (BwdConfig) that the
// kernels turn into constants, and its short string form
//   "bwd.<dtype>.d<D>.br<B_r>.bc<B_c>.w<warps>[.<flag>...]", e.g. "bwd.bf16.d128.br64.bc128.w8".
// B_c (block_n) is the number of key/value rows a thread block owns for the
// whole kernel; B_r (block_m) is the number of query rows per step of its loop.
// Plain C++17: no torch, no CUDA headers. DType comes from kernel_config.h, as
// for every kernel family.
//
// Warp layout (derived, not configured):
//   Each warp owns kKeysPerWarp key rows (16, or 32 with the "k32" flag) of
//   S^T = K Q^T, dP^T = V dO^T, dV and dK. kWarpsN = B_c / kKeysPerWarp warps
//   cover the key tile; the kWarpsD = warps / kWarpsN warps that share a key
//   slice split the queries of S^T/dP^T and the head dimension of dK/dV,
//   interleaved in 16-column pairs (warp wd takes pairs wd, wd + kWarpsD, ...,
//   which keeps the swizzled addressing to one base register per operand).
//   kWarpsD == 1: P^T and dS^T go from the S^T accumulators straight into the
//   A operand of dV += P^T dO and dK += dS^T Q (no shared-memory round trip).
//   kWarpsD > 1: P^T and dS^T are staged in shared memory (as FlashAttention-2
//   does for every head dimension) because each warp needs all queries.
//   dQ = dS K is always computed from dS^T in shared memory, by a second warp
//   grid over (B_r, D) chosen to make the per-warp tile as square as possible.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_config.h"  // DType

namespace flashop {

enum BwdFlag : unsigned {
  // k32: each warp owns 32 key rows (two m16 tiles) instead of 16. Halves the
  // shared-memory traffic per mma of S^T/dP^T (FlashAttention-2's 32x32 warp
  // tiles) at the price of staging P^T/dS^T in shared memory when warps must
  // split the queries.
  kBwdFlagKeys32 = 1u << 0,
  // q1: one Q/dO buffer instead of two. The loads of query tile i+1 start once
  // tile i's last read of Q/dO is done and run under the dQ product and its
  // atomics. Saves M*D*4 bytes of shared memory (d256 on sm80's 163 KB).
  kBwdFlagSingleBuffer = 1u << 1,
  // The next flags change the loop body of the staged path (kWarpsD > 1, the
  // k32 rows) so that less work runs between the barriers with the tensor
  // pipes idle. Same products, same shared memory, same barriers per query tile.
  // dpe: dP^T = V dO^T is issued right after S^T = K Q^T, before P^T goes to
  // shared memory: exp2 of P^T runs under the dP^T mma, and no st.shared stands
  // between the two products (ptxas does not hoist an ldmatrix above a shared
  // store). lse and D are read from shared memory before any store, the
  // causal/tail mask is applied to the exponent (-inf), before exp2.
  kBwdFlagDPEarly = 1u << 2,
  // dqe: after the barrier, dQ = dS K comes first and its red.global.adds are
  // issued (unconditionally: rows past Sq are padding rows of dq_accum) in the
  // same basic block as dV += P^T dO and dK += dS^T Q, under their mma,
  // instead of ending the tile. Deterministic mode waits before dQ and
  // releases after dK.
  kBwdFlagDQEarly = 1u << 3,
  // pfs: the next query tile's Q/dO/lse/D cp.async is issued after the S^T
  // product (branch-free) instead of before it, where its address arithmetic
  // delays the first ldmatrix. Needs two Q/dO stages (not q1).
  kBwdFlagPrefetchS = 1u << 4,
  // hreg (with dpe, kWarpsD == 2): dV += P^T dO and dK += dS^T Q take the
  // warp's own half of P^T/dS^T (its own S^T queries) from registers, kept
  // 16-bit across the barrier, and only the other warp's half through
  // ldmatrix: half the A-operand ldmatrix of those two products (per warp and
  // query tile d64 br128: 144 -> 128 ldmatrix, d128 br64: 144 -> 136), for
  // 2*KT*NQ registers held across the barrier.
  kBwdFlagOwnHalfRegs = 1u << 5,
  // qup: query tiles walked upward (non-deterministic mode only): causal from
  // the first visible tile (the diagonal), otherwise from a start rotated by
  // the key tile, wrapping. Concurrent key tiles then add their dQ to
  // different query tiles instead of all to the same one. Deterministic mode
  // keeps the downward walk its dQ semaphores rely on.
  kBwdFlagWalkUp = 1u << 6,
  // lpt (causal only): the blocks are numbered key-tile major within groups of
  // (batch, kv head) pairs (bwd_lpt_group_pairs), so the longest key tiles
  // (tile 0 sees every query tile) of a group start first and the short ones
  // fill the last wave, instead of the last heads' long tiles starting late.
  // Dispatch order still puts key tile n-1 of a pair before key tile n
  // (deterministic mode's progress rule).
  kBwdFlagLongestFirst = 1u << 7,
};

// (batch, kv head) pairs per longest-first group (figures: the causal d64/d128
// benchmark shapes on an H200):
// - enough pairs for kBwdLptGroupWaves waves of blocks (one block per SM), so
//   the long key tiles of a group start together and its short ones fill the
//   gaps (1 or 2 waves: up to 4% slower than head-major order at 2k-4k keys);
// - at most as many pairs as 3/8 of the L2 holds the Q, dO and dQ rows of
//   (pair_bytes each), since a group's pairs are read at once (uncapped, or a
//   fixed 32 pairs, lost 2-5% at 16k keys);
// - one pair (head-major order) below kBwdLptMinKeyTiles key tiles, where the
//   blocks of a pair sharing Q/dO in L2 matters more (1-2.5% at 1k keys).
inline constexpr int kBwdLptGroupWaves = 4;
#ifndef FLASHOP_BWD_LPT_MIN_KEY_TILES  // the emulator test lowers it: its problems are small
#define FLASHOP_BWD_LPT_MIN_KEY_TILES 16
#endif
inline constexpr int kBwdLptMinKeyTiles = FLASHOP_BWD_LPT_MIN_KEY_TILES;

inline constexpr int64_t bwd_lpt_group_pairs(int sm_count, int key_tiles, int64_t l2_bytes, int64_t pair_bytes) {
  if (key_tiles < kBwdLptMinKeyTiles) return 1;
  const int64_t blocks = int64_t(kBwdLptGroupWaves) * sm_count;
  int64_t pairs = (blocks + key_tiles - 1) / key_tiles;
  const int64_t fit = pair_bytes > 0 ? l2_bytes * 3 / 8 / pair_bytes : pairs;
  if (pairs > fit) pairs = fit;
  return pairs < 1 ? 1 : pairs;
}

// Shared-memory footprint of the compile-time struct (the generated
// instantiations static_assert it equals the generator's figure).
inline constexpr std::size_t bwd_smem_bytes_for(int headdim, int block_n, int block_m, int warps,
                                                unsigned flags) {
  const int keys_per_warp = (flags & kBwdFlagKeys32) ? 32 : 16;
  const int warps_n = block_n / keys_per_warp;
  const int warps_d = warps_n > 0 ? warps / warps_n : 1;
  const int stages = (flags & kBwdFlagSingleBuffer) ? 1 : 2;
  return std::size_t(2) * headdim * block_n * 2                 // K, V tiles (resident)
         + std::size_t(stages) * 2 * headdim * block_m * 2      // Q, dO tiles per stage
         + std::size_t(2) * block_n * block_m                   // dS^T
         + (warps_d > 1 ? std::size_t(2) * block_n * block_m : 0)  // P^T (split warps only)
         + std::size_t(stages) * 2 * block_m * 4;               // lse*log2e and D per stage
}

template <DType kDType_, int kHeadDim_, int kBlockN_, int kBlockM_, int kWarps_, unsigned kFlags_ = 0>
struct BwdConfig {
  static constexpr DType kDType = kDType_;
  // D: the tile width (32, 64, 96, 128, 160, 192, 224 or 256); the kernels take any head dimension
  // up to it that is a multiple of 8 (BwdParams::headdim).
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;    // B_c: key rows per thread block
  static constexpr int kBlockM = kBlockM_;    // B_r: query rows per loop step
  static constexpr int kWarps = kWarps_;
  static constexpr unsigned kFlags = kFlags_;

  static constexpr bool kKeys32 = (kFlags & kBwdFlagKeys32) != 0;
  static constexpr bool kDoubleBuffer = (kFlags & kBwdFlagSingleBuffer) == 0;
  static constexpr int kStages = kDoubleBuffer ? 2 : 1;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr bool kDPEarly = (kFlags & kBwdFlagDPEarly) != 0;
  static constexpr bool kDQEarly = (kFlags & kBwdFlagDQEarly) != 0;
  static constexpr bool kPrefetchS = (kFlags & kBwdFlagPrefetchS) != 0;
  static constexpr bool kOwnHalfRegs = (kFlags & kBwdFlagOwnHalfRegs) != 0;
  static constexpr bool kWalkUp = (kFlags & kBwdFlagWalkUp) != 0;
  static constexpr bool kLongestFirst = (kFlags & kBwdFlagLongestFirst) != 0;

  // S^T / dP^T / dK / dV warp grid.
  static constexpr int kKeysPerWarp = kKeys32 ? 32 : 16;
  static constexpr int kKeyTiles = kKeysPerWarp / 16;      // m16 tiles per warp
  static constexpr int kWarpsN = kBlockN / kKeysPerWarp;
  static constexpr int kWarpsD = kWarps / kWarpsN;
  static constexpr bool kStagePT = kWarpsD > 1;            // P^T through shared memory
  static constexpr int kQueriesPerWarp = kBlockM / kWarpsD;  // columns of the warp's S^T tile
  static constexpr int kDimsPerWarp = kHeadDim / kWarpsD;    // columns of the warp's dK/dV tile

  // dQ = dS K warp grid: kWarpsMdQ x kWarpsDdQ warps over (B_r, D). Pick the
  // split whose warp tile has the smallest perimeter (fewest ldmatrix bytes per
  // mma); each side must be a multiple of 16 (m16 rows, pairs of n8 columns).
  static constexpr int pick_warps_m_dq() {
    int best = 0, best_cost = 1 << 30;
    for (int wm = 1; wm <= kWarps; wm *= 2) {
      const int wd = kWarps / wm;
      if (wm * wd != kWarps || kBlockM % (16 * wm) != 0 || kHeadDim % (16 * wd) != 0) continue;
      const int cost = kBlockM / wm + kHeadDim / wd;
      if (cost < best_cost) best = wm, best_cost = cost;
    }
    return best;
  }
  static constexpr int kWarpsMdQ = pick_warps_m_dq();
  static constexpr int kWarpsDdQ = kWarpsMdQ > 0 ? kWarps / kWarpsMdQ : 1;
  static constexpr int kRowsPerWarpdQ = kWarpsMdQ > 0 ? kBlockM / kWarpsMdQ : 16;
  static constexpr int kColsPerWarpdQ = kHeadDim / kWarpsDdQ;

  static constexpr std::size_t kSmemBytes = bwd_smem_bytes_for(kHeadDim, kBlockN, kBlockM, kWarps, kFlags);

  static_assert(kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 160 ||
                    kHeadDim == 192 || kHeadDim == 224 || kHeadDim == 256,
                "unsupported tile width");
  static_assert(kWarps == 2 || kWarps == 4 || kWarps == 8, "warps: 2, 4 or 8");
  static_assert(kBlockM == 32 || kBlockM == 64 || kBlockM == 128,
                "B_r: 32, 64 or 128 (must divide 128: the lse/D workspaces are padded to 128 rows)");
  static_assert(kBlockN % kKeysPerWarp == 0 && kWarpsN >= 1 && kWarpsN * kWarpsD == kWarps,
                "B_c / keys-per-warp must divide the warp count");
  static_assert(kWarpsD == 1 || kWarpsD == 2 || kWarpsD == 4, "warps sharing a key slice: 1, 2 or 4");
  static_assert(kQueriesPerWarp % 16 == 0, "each warp's S^T tile needs a multiple of 16 queries");
  static_assert(kDimsPerWarp % 16 == 0, "each warp's dK/dV tile needs a multiple of 16 head dims");
  static_assert(kWarpsMdQ > 0, "no warp grid for dQ = dS K fits (B_r, D)");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory beyond any sm80+ device");
  static_assert(!(kDPEarly || kDQEarly || kPrefetchS || kOwnHalfRegs) || kStagePT,
                "dpe, dqe, pfs, hreg change the staged path: they need warps sharing a key slice (kWarpsD > 1)");
  static_assert(!kPrefetchS || kDoubleBuffer, "pfs needs two Q/dO stages (not q1)");
  static_assert(!kOwnHalfRegs || (kDPEarly && kWarpsD == 2), "hreg needs dpe and exactly two warps per key slice");
};

// The same configuration as run-time values (registry entries).
struct BwdConfigDesc {
  DType dtype;
  int headdim;  // the tile width (the name's d<W>)
  int block_n;
  int block_m;
  int warps;
  unsigned flags;
};

}  // namespace flashop

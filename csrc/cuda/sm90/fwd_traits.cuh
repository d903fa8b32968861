// The forward kernel's compile-time configuration (Sm90FwdTraits: tile sizes, pipeline options, the
// shared-memory layout and register budgets derived from them) and the addresses of that layout in a
// running CTA (FwdSmem).
#pragma once

#include <cstdint>

namespace flashop {
namespace sm90 {

template <bool kBf16_, int kHeadDim_, int kBlockM_, int kBlockN_, bool kPingPong_ = true,
          bool kTmaStore_ = false, bool kPersistent_ = false, bool kLongestFirst_ = false, int kStages_ = 2,
          bool kMulticast_ = false, int kCtasPerSm_ = 0, bool kDynamic_ = false>
struct Sm90FwdTraits {
  static constexpr bool kBf16 = kBf16_;
  // Named-barrier ping-pong between the consumer warpgroups (off: "nopp",
  // the same loop without the turn barriers).
  static constexpr bool kPingPong = kPingPong_;
  // Epilogue through shared memory (the dead Q tile) and a TMA store ("tmao").
  static constexpr bool kTmaStore = kTmaStore_;
  // Persistent CTAs with a static round-robin tile scheduler ("pers").
  static constexpr bool kPersistent = kPersistent_;
  // Persistent tile order with the query tile varying slowest ("pers.lpt", longest processing time
  // first over all heads and batches); default: query tile fastest (see fwd_scheduler.cuh).
  static constexpr bool kLongestFirst = kLongestFirst_;
  // K/V tiles shared by a cluster of two CTAs through TMA multicast ("mc"; see fwd_kernel.cuh).
  // Launched with a cluster shape of 2 or none; the kernel reads which from %cluster_nctarank.
  static constexpr bool kMulticast = kMulticast_;
  // Persistent tiles taken at run time ("pers.dyn"): each CTA's producer takes its next tile from a
  // global counter (atomicAdd) and hands the tile number to its consumers with the tile's Q (see
  // fwd_producer.cuh), so CTAs that drew short (causal) tiles simply take more of them.
  static constexpr bool kDynamic = kDynamic_;
  // The attention variants (csrc/attention_variants.h: windows, softcap, ALiBi, sinks) are compiled
  // into a second instantiation of the kernel, Sm90FwdVariants<traits> below, which launch_fwd runs
  // when a problem asks for any of them: the dense kernel's main loop stays exactly as it was.
  static constexpr bool kVariants = false;
  // Whether that build exists for this config (configs.py HopperConfig.supports_variants says the same):
  // all but the one-tile-per-CTA kernels at B_c = 192 ("bc192.tmao", "bc192.mc.tmao"), whose variants
  // build spills in the main loop (28 / 60 bytes of spill stores / loads against the dense build's 8 / 12;
  // their persistent sibling "bc192.pers.rego" does not spill and runs them).
  static constexpr bool kSupportsVariants = !(kBlockN_ == 192 && !kPersistent_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // K/V ring depth ("st3": 3). Every ring index below is g % kStages, phase g / kStages.
  static constexpr int kStages = kStages_;
  static_assert(kStages >= 2, "the producer issues K_0, K_1, V_0 before it may wait on this tile");
  static constexpr int kConsumerWGs = kBlockM / 64;
  static constexpr int kThreads = 128 * (kConsumerWGs + 1);
  // Resident CTAs per SM the registers (and the shared memory, asserted below) are budgeted for:
  // 1 with two or three consumer warpgroups; with one (B_r = 64) 2 by default, 3 where asked ("cta3").
  static constexpr int kCtasPerSm = kCtasPerSm_ ? kCtasPerSm_ : kConsumerWGs == 1 ? 2 : 1;
  static_assert(kCtasPerSm == 1 || (kConsumerWGs == 1 && (kCtasPerSm == 2 || kCtasPerSm == 3)),
                "more than one CTA per SM only with one consumer warpgroup (B_r = 64), at most three");
  // Shared-memory tiles are column blocks of kColBlock elements, one swizzle span per row: 64 (128
  // bytes, 128B swizzle) where D is a multiple of 64, else 32 (64 bytes, 64B swizzle: D = 96, 160, 224).
  // One width for all of Q, K and V, so the P V wgmma (N = D) walks V's blocks at one LBO.
  static constexpr int kColBlock = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kRowBytes = kColBlock * 2;
  static constexpr int kAtomBytes = 8 * kRowBytes;  // one swizzle atom: 8 rows (1024 or 512 bytes)
  static constexpr int kDBlocks = kHeadDim / kColBlock;
  static_assert(kHeadDim % 32 == 0, "whole 32-column blocks");

  // Two consumer warpgroups of 64 rows; three (B_r = 192, FlashAttention-3's d64 tile: more rows
  // per K/V tile and per producer) at D = 64, one tile per CTA only.
  static_assert(kBlockM == 128 || (kBlockM == 192 && kHeadDim_ == 64 && !kPersistent_) ||
                    (kBlockM == 64 && !kPersistent_ && !kMulticast_),
                "B_r 128, 192 at D = 64 without the persistent scheduler, or 64 (one tile per CTA)");
  // D is the N of the P V wgmma (m64nDk16, D/2 accumulator registers per consumer thread: 128 at
  // D = 256, within the 240-register consumer budget next to S (B_c/2) and P (B_c/4)) and
  // D/kColBlock column blocks everywhere else (TMA boxes, descriptors, O staging). The tile width;
  // the true head dimension (FwdParams::headdim, a multiple of 8 up to D) is a run-time value.
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 160 || kHeadDim == 192 ||
                    kHeadDim == 224 || kHeadDim == 256,
                "tile width 64, 96, 128, 160, 192, 224 or 256");
  // B_c is the N of the S = Q K^T wgmma (m64nB_ck16, B_c/2 accumulator registers) and B_c/16 k-steps
  // of P V. 176 (FlashAttention-3's non-causal d128 tile: 1.375x the work of 128 per softmax, O
  // rescale and barrier round) at D = 128 only: 88 S + 44 P + 64 O registers of the 240; at D = 256
  // the shared memory does not fit, D = 64 is not built. 80 (FlashAttention-3's d256 tile) at
  // D = 256: 40 S + 20 P + 128 O registers; Q 64 KiB + 2 x (K + V) 40 KiB each = 224 KiB.
  // 192 at D = 128: 96 S + 48 P + 64 O registers; Q 32 KiB + 2 x (K + V) 48 KiB each = 224 KiB.
  // 112 at D = 192 (FlashAttention-3's d192 tile): 56 S + 28 P + 96 O; Q 48 KiB + 2 x (K + V) 42 KiB
  // each = 216 KiB (128 keys would need 240 KiB). 80 at D = 224 as at 256: 40 S + 20 P + 112 O;
  // Q 56 KiB + 2 x (K + V) 35 KiB each = 196 KiB. D = 96 and 160 take 128 (S 64 + P 32 + O 48 / 80).
  static_assert(kBlockN == 64 || kBlockN == 128 || ((kBlockN == 176 || kBlockN == 192) && kHeadDim == 128) ||
                    (kBlockN == 80 && (kHeadDim == 256 || kHeadDim == 224)) || (kBlockN == 112 && kHeadDim == 192),
                "wgmma N of S: B_c 64 or 128 (176 or 192 at D = 128, 80 at D = 224 and 256, 112 at D = 192)");
  static_assert(kBlockN % 16 == 0, "P V takes B_c/16 k16 steps");
  // Persistent without the TMA store ("pers.rego"): O goes from registers straight to global memory, so
  // a consumer warpgroup's half of the Q tile is dead after its last S of a tile (kQHalves below).
  static_assert(!kPersistent || kTmaStore || (!kLongestFirst && !kDynamic),
                "the persistent kernel with O stored from registers walks the tiles in the plain order");
  static_assert(!kLongestFirst || kPersistent, "the longest-first order is a persistent tile order");
  static_assert(!kMulticast || (kTmaStore && !kPersistent), "multicast: one tile per CTA, TMA store");

  static constexpr int kQBlockBytes = kBlockM * kRowBytes;  // one column block of Q
  // One column block of a K or V stage: B_c rows of kRowBytes, no padding. The swizzle needs every
  // 8-row atom to start on a multiple of its size (1024 bytes with 128B, 512 with 64B): B_c is a
  // multiple of 16, so B_c * 128 is a multiple of 2048 (B_c = 176: 22 528 B = 22 atoms) and B_c * 64
  // of 1024, and every offset below is a sum of such blocks (static_assert further down). The TMA box
  // is exactly B_c rows by kColBlock columns, so the expect_tx count (kKVBytes) is the bytes written:
  // zero-filled rows >= Sk and columns >= headdim included (PTX ISA, tensor out-of-bound access: the
  // box's elements outside the tensor are set to 0 in shared memory), also for a box that lies wholly
  // past headdim or Sk (the multicast half tiles of a short last key tile already rely on that).
  static constexpr int kKVBlockBytes = kBlockN * kRowBytes;
  static constexpr int kQBytes = kQBlockBytes * kDBlocks;
  static constexpr int kKVBytes = kKVBlockBytes * kDBlocks;  // one K (or V) tile
  // Multicast: CTA r of the pair loads rows r * B_c/2 .. of every column block (a box of B_c/2 rows).
  // B_c/2 is a multiple of 8, so the second half starts on a 1024-byte swizzle atom as well.
  static constexpr int kKVHalfRows = kBlockN / 2;
  static constexpr int kKVHalfBytes = kKVHalfRows * kRowBytes;
  static_assert(kKVHalfBytes % kAtomBytes == 0, "multicast half tiles start on a swizzle atom");
  static constexpr int kKVRingBytes = 2 * kStages * kKVBytes;  // the K and the V ring
  // Persistent kernel with a separate O staging tile (where it fits: d64 and d128 at B_c = 128):
  // Q is then free once a tile's last S = Q K^T is complete, so the producer loads the next tile's Q
  // under the last P V and the epilogue instead of after the O store has read the staging.
  static constexpr bool kSeparateO =
      kPersistent && kTmaStore && 2 * kQBytes + kKVRingBytes + 8 * (2 + 4 * kStages) + 1024 <= 227 * 1024;
  // And where a second Q buffer fits too (d64, and d128 at B_c = 128: 3 x 32 KiB + 128 KiB), tiles
  // alternate between the two: the producer loads tile k+1's Q as soon as it has issued tile k's
  // last K/V load, two key tiles or more before the consumers need it, instead of after tile k's
  // last S (when the first consumer to finish tile k already wants it). Its own q_full / q_empty pair.
  static constexpr bool kDoubleQ =
      kSeparateO && 3 * kQBytes + kKVRingBytes + 8 * (4 + 4 * kStages) + 1024 <= 227 * 1024;
  static constexpr int kQBuffers = kDoubleQ ? 2 : 1;
  // Persistent, O stored from registers ("pers.rego"): one Q buffer, loaded and released in two halves,
  // the 64 rows of each consumer warpgroup (the only rows its S wgmma reads), each with its own q_full /
  // q_empty pair (the slots kDoubleQ's second buffer uses). Half c of tile k+1 loads as soon as consumer
  // c's last S of tile k is complete, under that warpgroup's last softmax, P V and O store, instead of
  // after both consumers' last S (the first warpgroup to finish a tile would wait for it).
  static constexpr bool kQHalves = kPersistent && !kTmaStore;
  static_assert(!kQHalves || kConsumerWGs == 2, "Q halves: two consumer warpgroups");
  static constexpr int kQPairs = kDoubleQ || kQHalves ? 2 : 1;  // q_full / q_empty pairs
  // Rows of one Q load (the Q tensor map's box).
  static constexpr int kQBoxRows = kQHalves ? 64 : kBlockM;
  // Split tail (non-causal, where the launcher asks for it; see FwdTileScheduler::walk): the tiles of
  // the last two waves are shared out over the CTAs by key tiles. Persistent kernels in the plain tile order.
  static constexpr bool kStreamK = kPersistent && !kLongestFirst && !kDynamic;
  // Split last wave (non-causal, where the launcher asks for it; see FwdTileScheduler::set_cta_tile):
  // the last tiles run as pieces of their key range, one CTA each. One-tile-per-CTA TMA-store kernels
  // at one CTA per SM, d64 and d128 (d256 is built without it: 1.6-2.7% slower with it, H100).
  static constexpr bool kSplitTail =
      !kPersistent && kTmaStore && kCtasPerSm == 1 && kHeadDim <= 128;
  static_assert(!kDynamic || (kPersistent && !kLongestFirst && kSeparateO),
                "tiles taken at run time: the persistent kernel with its own O tile, in the plain tile order");
  // A part's partial result in the workspace, per CTA (kStreamK) or per piece (kSplitTail): for each
  // consumer warpgroup, D/8 float4 of O (unnormalised) and one float4 (m0, m1, l0, l1) for each of its
  // 128 threads, thread-fastest; then after all the data one int flag per (CTA, warpgroup) (kStreamK)
  // or one arrival counter per (split tile, consumer warpgroup) (kSplitTail).
  static constexpr int kPartialFloat4s = kConsumerWGs * (kHeadDim / 8 + 1) * 128;
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBuffers * kQBytes;
  static constexpr int kVOff = kKOff + kStages * kKVBytes;
  static constexpr int kOOff = kVOff + kStages * kKVBytes;  // kSeparateO: same layout as the Q tile
  static constexpr int kBarOff = kOOff + (kSeparateO ? kQBytes : 0);
  // O staging (kTmaStore): consumer c, column block b at
  //   kQOff + b * kQBlockBytes + c * kOStageBytes   (kOOff instead of kQOff when kSeparateO),
  // i.e. rows 64c .. 64c+63 of Q column block b: exactly the rows consumer c's
  // S wgmma reads (A descriptor start + c * 64 * kRowBytes), so neither consumer ever
  // touches the other's half. Every staging box starts on a swizzle atom, so the
  // swizzle (16-byte chunk ^= row % 8 with 128B, ^= (row / 2) % 4 with 64B) is the same as the loads'.
  static constexpr int kOStageRows = 64;
  static constexpr int kOStageBytes = kOStageRows * kRowBytes;  // one 64-row box
  static_assert(kQBlockBytes % kAtomBytes == 0 && kKVBlockBytes % kAtomBytes == 0 && kOStageBytes % kAtomBytes == 0,
                "swizzle atoms");
  static_assert(kKOff % kAtomBytes == 0 && kVOff % kAtomBytes == 0 && kOOff % kAtomBytes == 0 &&
                    kKVBytes % kAtomBytes == 0,
                "every K/V stage and column block starts on a swizzle atom");
  // barriers: q_full, full_k[S], full_v[S], empty_k[S], empty_v[S] (S = kStages; + q_empty when persistent;
  // + q_full and q_empty of the second Q buffer)
  static constexpr int kNumBars = 1 + 4 * kStages + (kPersistent ? 1 : 0) + (kQPairs == 2 ? 2 : 0);
  // kDynamic: after the barriers, the tile number of each Q buffer's tile (int; >= the tile count: no more).
  static constexpr int kSmemUsed = kBarOff + 8 * kNumBars + (kDynamic ? 8 : 0);
  static constexpr int kSmemBytes = kSmemUsed + 1024;  // + slack for 1024-byte alignment
  // sm_90 opt-in maximum per block (227 KiB). D = 256: Q 64 KiB + 2 x (K + V) 32 KiB each at
  // B_c = 64 = 192 KiB (+ barriers + slack = 197 704 B); B_c = 128 would need 320 KiB.
  // D = 128, B_c = 176: Q 32 KiB + 2 x (K + V) 44 KiB each = 208 KiB (212 992 B) + 72 / 80 B of
  // barriers + 1 KiB slack = 214 088 B (tmao) / 214 096 B (pers).
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  // Two or three CTAs per SM (B_r = 64): 228 KiB per SM, 1 KiB of it reserved per CTA by the hardware.
  static_assert(kCtasPerSm == 1 || kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "CTAs per SM");
  // Descriptor fields are 14 bits of (bytes >> 4): start addresses (below 256 KiB, masked to 18
  // bits) and V's LBO = kKVBlockBytes (8 KiB at B_c = 64, 22 528 B = 1408 units at B_c = 176) fit;
  // mbarrier tx-count < 2^20 (K or V tile: 45 056 B at B_c = 176).
  static_assert(kKVBlockBytes >> 4 < (1 << 14) && kQBytes < (1 << 20) && kKVBytes < (1 << 20),
                "descriptor / tx range");

  static constexpr int kProducerRegs = 24;
  // 512 threads at B_r = 192: 24 x 128 + 160 x 384 = 64 512 of the 65 536 registers. B_r = 64: two
  // CTAs of 256 threads launch with 128 each (65 536 / 512); the producer's 104 released per thread go
  // to the consumer: 232. Three CTAs: 80 each at launch (65 536 / 768 = 85, in steps of 8), the
  // consumer gets 80 + 56 = 136 (32 S + 16 P + 32 O at D = 64, B_c = 64). ptxas compiles each wgmma
  // within the launch limit of 80, though: at D = 128 (P V m64n128, 64 accumulators next to S and P)
  // it refuses ("insufficient registers (80)"), so D = 128 has no three-CTA build.
  static constexpr int kConsumerRegs =
      kConsumerWGs == 2 ? 240 : kConsumerWGs == 3 ? 160 : kCtasPerSm == 3 ? 136 : 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <= 65536 / kCtasPerSm, "regs");
};

// The same kernel with the attention variants compiled in (T::kVariants): key-tile ranges from both
// window bounds, softcap and ALiBi on the scores, window masks on the tiles that cross a window edge,
// sinks in the epilogue. Every other constant is the dense traits'.
template <class T>
struct Sm90FwdVariants : T {
  static constexpr bool kVariants = true;
};

// The CTA's shared memory: Q buffer(s), the K and V rings, the O staging tile (kSeparateO), the
// mbarriers and (kDynamic) the tile-number slots, at the traits' offsets from `base` (1024-byte aligned).
template <class T>
struct FwdSmem {
  uint32_t base;
  uint32_t sK;
  uint32_t sV;
  uint32_t bar_q;

  __device__ __forceinline__ explicit FwdSmem(uint32_t base_)
      : base(base_), sK(base_ + T::kKOff), sV(base_ + T::kVOff), bar_q(base_ + T::kBarOff) {}

  // Q buffer of this CTA's tile number k (k = 0 without persistence).
  __device__ uint32_t q_buffer(uint32_t k) const {
    return base + T::kQOff + (T::kDoubleQ ? (k & 1) * T::kQBytes : 0);
  }
  // The K/V ring's barriers of slot s.
  __device__ uint32_t bar_full_k(int s) const { return bar_q + 8u * (1 + s); }
  __device__ uint32_t bar_full_v(int s) const { return bar_q + 8u * (1 + T::kStages + s); }
  __device__ uint32_t bar_empty_k(int s) const { return bar_q + 8u * (1 + 2 * T::kStages + s); }
  __device__ uint32_t bar_empty_v(int s) const { return bar_q + 8u * (1 + 3 * T::kStages + s); }
  // The q_full / q_empty pair of tile k's Q buffer (kDoubleQ), or of consumer warpgroup `half`'s rows of
  // the one buffer (kQHalves). This and the parities below need no address: static (as members taking
  // the object they inline differently, and ptxas schedules the main loop differently).
  static __device__ uint32_t q_pair(uint32_t k, int half) {
    return T::kDoubleQ ? (k & 1) : T::kQHalves ? half : 0;
  }
  __device__ uint32_t bar_q_full(uint32_t pair) const {
    return pair ? bar_q + 8u * (2 + 4 * T::kStages) : bar_q;
  }
  __device__ uint32_t bar_q_empty(uint32_t pair) const {  // kPersistent only
    return bar_q + 8u * (pair ? 3 + 4 * T::kStages : 1 + 4 * T::kStages);
  }
  // The phase parity of tile k's q_full (consumers) and, for k >= kQBuffers, of the q_empty phase the
  // producer waits for before it reloads the buffer: the buffer's use number k / kQBuffers.
  static __device__ uint32_t q_full_parity(uint32_t k) { return (k / T::kQBuffers) & 1; }
  static __device__ uint32_t q_empty_parity(uint32_t k) { return (k / T::kQBuffers - 1) & 1; }
  // kDynamic: the tile number of Q buffer k % kQBuffers's current tile.
  __device__ uint32_t tile_slot(uint32_t k) const {
    return bar_q + 8u * T::kNumBars + 4u * (k % T::kQBuffers);
  }
};

}  // namespace sm90
}  // namespace flashop

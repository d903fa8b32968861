// FlashAttention-3-style forward for sm_90a: TMA loads, a K/V ring (2 stages; 3 in "st3")
// guarded by mbarriers, warp specialisation (1 producer warpgroup + 2 consumer
// warpgroups of 64 query rows each; 3 at B_r = 192), wgmma for S = Q K^T (both operands from
// shared memory) and O += P V (P from registers, V MN-major from shared memory).
//
// Per tile: one query tile of kBlockM = 128 rows of one (batch, head).
//   producer (warpgroup 0, setmaxnreg.dec 24; one thread): Q once, then
//     K_0, K_1, V_0, K_2, V_1, ..., K_{n-1}, V_{n-2}, V_{n-1} (K one key tile
//     ahead of V: the order the consumers need them in). K_j: wait empty_k[s]
//     (s = j % kStages, from its 2nd use on) -> expect_tx + TMA -> full_k[s]; V_j the
//     same on empty_v[s] / full_v[s].
//   consumer c (warpgroups 1, 2; setmaxnreg.inc 240; rows 64c .. 64c+63):
//     tile 0:  [turn] S_0 = Q K_0^T [pass]; softmax_0 -> P_0
//     tile j:  [turn] issue S_j = Q K_j^T, issue O += P_{j-1} V_{j-1} [pass];
//              wait S_j; arrive empty_k[stage of j]; mask; softmax_j (under
//              the PV GEMM); wait PV; arrive empty_v[stage of j-1];
//              O *= corr_j; P_j -> regs
//     end:     O += P_{n-1} V_{n-1}; arrive empty_v
//   K and V have their own empty barriers: K_j's slot is free as soon as S_j
//   is complete, so K_{j+2} loads under two iterations instead of under the
//   tail of one (with one barrier per stage the slot would wait for P_j V_j,
//   and the consumers would stall on K).
//   [turn]/[pass]: named barriers 1/2 ping-pong the two consumers so one's
//   softmax runs under the other's GEMMs.
//   epilogue: O /= l, lse = m*scale + ln l;
//     default: plain stores (rows < Sq);
//     kTmaStore ("tmao"): O -> this warpgroup's own 64-row half of the Q tile in
//       shared memory (128B swizzle) -> fence.proxy.async -> named barrier 3+c
//       -> one thread: TMA store (box 64 rows, clipped at Sq), wait for the read.
//   kPersistent ("pers"; with kTmaStore, except "pers.rego"): grid = #SMs, each CTA walks tiles
//     blockIdx.x, +gridDim.x, ...; the K/V ring's load counter, the q_full /
//     q_empty phases and the consumers' ping-pong run on across tiles (see
//     fwd_sm90_body), so one consumer starts tile k+1 while the other stores tile k. With
//     its own O tile (d64, d128 at B_c = 128) it also keeps two Q buffers (tile k+1's Q
//     loads during tile k) and waits for an O store's read only before the next one.
//   kQHalves ("pers.rego": persistent, plain stores; d128 at B_c = 192, where no O tile or second Q
//     fits): O goes from registers to global memory, and each consumer warpgroup's 64 rows of Q have
//     their own q_full / q_empty pair, so the next tile's half loads right after that warpgroup's
//     last S of this tile.
//   B_c > 128: the last key tile's P V runs only over the 64-key blocks that hold
//     a visible key (the "narrow last key tile").
//   kStreamK (the plain "pers" order, non-causal, when the launcher asks): the tiles of the
//     last two waves are dealt out over all CTAs in equal runs of key tiles; a tile cut in two
//     is finished by the CTA holding its last keys, from the other part's partial O, max and
//     sum in a global workspace (flag per CTA; see walk in fwd_sm90_body).
//   kSplitTail (one tile per CTA, TMA store, one CTA per SM, D <= 128, non-causal, when the launcher
//     asks): the last tiles (those that would leave the last wave partly idle) run as pieces of
//     their key range in CTAs of their own, launched after the whole tiles; each consumer
//     warpgroup of a piece stores its partial O, max and sum, and the last one to finish a row
//     block merges all parts in piece order and stores O and lse (an arrival counter per row
//     block: nobody waits for another CTA).
//   kDynamic ("pers.dyn"): the producer takes each next tile from a global counter and hands
//     its number to the consumers in shared memory with the tile's Q (causal balance).
//   kLongestFirst ("pers.lpt", implies kPersistent): the same kernel, tiles
//     numbered with the query tile varying slowest (longest causal tiles of all
//     heads first), so every step of the static stride hands the CTAs tiles of
//     (nearly) equal length.
//   kMulticast ("mc", one tile per CTA, TMA store): launched as clusters of two
//     CTAs (two adjacent query tiles of one head, non-causal, so both walk the
//     same key tiles), each producer loads half the rows of every K/V tile and
//     multicasts it to both CTAs: half the L2 -> SM traffic per FLOP. A slot is
//     free when the consumers of both CTAs have released it (empty barriers
//     count both CTAs' warps; each warp also arrives on the peer's barrier).
//     Launched without a cluster (causal, odd number of query tiles) it is the
//     plain "tmao" kernel.
//   B_r = 64 ("br64", one tile per CTA): one consumer warpgroup (256 threads), so
//     two CTAs share an SM: one CTA's prologue (Q and first K/V loads, the first
//     S without a P V beside it) and epilogue run under the other's GEMMs, which
//     is what short (and causal) problems lack at one CTA per SM. No ping-pong
//     (the other CTA plays that part); consumers get 232 registers. "cta3": three
//     such CTAs per SM (d64, B_c = 64: 42 KiB of shared memory each), 136 registers.
//
// Shared-memory tiles are rows of 64 elements (128 bytes) in the TMA/wgmma
// 128-byte swizzle; a head dimension of D is kept as D/64 such column blocks.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../fwd_params.h"
#include "primitives.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

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
  // first over all heads and batches); default: query tile fastest (see fwd_sm90_body).
  static constexpr bool kLongestFirst = kLongestFirst_;
  // K/V tiles shared by a cluster of two CTAs through TMA multicast ("mc"; see the top of the file).
  // Launched with a cluster shape of 2 or none; the kernel reads which from %cluster_nctarank.
  static constexpr bool kMulticast = kMulticast_;
  // Persistent tiles taken at run time ("pers.dyn"): each CTA's producer takes its next tile from a
  // global counter (atomicAdd) and hands the tile number to its consumers with the tile's Q (see
  // fwd_sm90_body), so CTAs that drew short (causal) tiles simply take more of them.
  static constexpr bool kDynamic = kDynamic_;
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
  static constexpr int kDBlocks = kHeadDim / 64;  // 64-element (128-byte) column blocks

  // Two consumer warpgroups of 64 rows; three (B_r = 192, FlashAttention-3's d64 tile: more rows
  // per K/V tile and per producer) at D = 64, one tile per CTA only.
  static_assert(kBlockM == 128 || (kBlockM == 192 && kHeadDim_ == 64 && !kPersistent_) ||
                    (kBlockM == 64 && !kPersistent_ && !kMulticast_),
                "B_r 128, 192 at D = 64 without the persistent scheduler, or 64 (one tile per CTA)");
  // D is the N of the P V wgmma (m64nDk16, D/2 accumulator registers per consumer thread: 128 at
  // D = 256, within the 240-register consumer budget next to S (B_c/2) and P (B_c/4)) and
  // D/64 column blocks everywhere else (TMA boxes, descriptors, O staging).
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
  // B_c is the N of the S = Q K^T wgmma (m64nB_ck16, B_c/2 accumulator registers) and B_c/16 k-steps
  // of P V. 176 (FlashAttention-3's non-causal d128 tile: 1.375x the work of 128 per softmax, O
  // rescale and barrier round) at D = 128 only: 88 S + 44 P + 64 O registers of the 240; at D = 256
  // the shared memory does not fit, D = 64 is not built. 80 (FlashAttention-3's d256 tile) at
  // D = 256 only: 40 S + 20 P + 128 O registers; Q 64 KiB + 2 x (K + V) 40 KiB each = 224 KiB.
  // 192 at D = 128: 96 S + 48 P + 64 O registers; Q 32 KiB + 2 x (K + V) 48 KiB each = 224 KiB.
  static_assert(kBlockN == 64 || kBlockN == 128 || ((kBlockN == 176 || kBlockN == 192) && kHeadDim == 128) ||
                    (kBlockN == 80 && kHeadDim == 256),
                "wgmma N of S: B_c 64 or 128 (176 or 192 at D = 128, 80 at D = 256)");
  static_assert(kBlockN % 16 == 0, "P V takes B_c/16 k16 steps");
  // Persistent without the TMA store ("pers.rego"): O goes from registers straight to global memory, so
  // a consumer warpgroup's half of the Q tile is dead after its last S of a tile (kQHalves below).
  static_assert(!kPersistent || kTmaStore || (!kLongestFirst && !kDynamic),
                "the persistent kernel with O stored from registers walks the tiles in the plain order");
  static_assert(!kLongestFirst || kPersistent, "the longest-first order is a persistent tile order");
  static_assert(!kMulticast || (kTmaStore && !kPersistent), "multicast: one tile per CTA, TMA store");

  static constexpr int kQBlockBytes = kBlockM * 128;  // one column block of Q
  // One column block of a K or V stage: B_c rows of 128 bytes, no padding. The 128B swizzle needs
  // every block (and so every 8-row, 1024-byte atom in it) to start 1024-byte aligned: B_c is a
  // multiple of 16, so B_c * 128 is a multiple of 2048 (B_c = 176: 22 528 B = 22 atoms), and every
  // offset below is a sum of such blocks (static_assert further down). The TMA box is exactly B_c
  // rows, so the expect_tx count (kKVBytes) is the bytes written, zero-filled rows >= Sk included.
  static constexpr int kKVBlockBytes = kBlockN * 128;
  static constexpr int kQBytes = kQBlockBytes * kDBlocks;
  static constexpr int kKVBytes = kKVBlockBytes * kDBlocks;  // one K (or V) tile
  // Multicast: CTA r of the pair loads rows r * B_c/2 .. of every column block (a box of B_c/2 rows).
  // B_c/2 is a multiple of 8, so the second half starts on a 1024-byte swizzle atom as well.
  static constexpr int kKVHalfRows = kBlockN / 2;
  static constexpr int kKVHalfBytes = kKVHalfRows * 128;
  static_assert(kKVHalfBytes % 1024 == 0, "multicast half tiles start on a swizzle atom");
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
  // Split tail (non-causal, where the launcher asks for it; see fwd_sm90_body): the tiles of the last
  // two waves are shared out over the CTAs by key tiles. Persistent kernels in the plain tile order.
  static constexpr bool kStreamK = kPersistent && !kLongestFirst && !kDynamic;
  // Split last wave (non-causal, where the launcher asks for it; see fwd_sm90_body): the last tiles run
  // as pieces of their key range, one CTA each. One-tile-per-CTA TMA-store kernels at one CTA per SM, d64
  // and d128 (d256 is built without it: 1.6-2.7% slower with it, H100).
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
  // S wgmma reads (A descriptor start + c * 64 * 128), so neither consumer ever
  // touches the other's half. Every staging box is 1024-byte aligned, so the
  // 128B swizzle (16-byte chunk ^= row % 8) is the same as the loads'.
  static constexpr int kOStageRows = 64;
  static constexpr int kOStageBytes = kOStageRows * 128;  // one 64 x 64 box
  static_assert(kQBlockBytes % 1024 == 0 && kKVBlockBytes % 1024 == 0 && kOStageBytes % 1024 == 0,
                "swizzle atoms");
  static_assert(kKOff % 1024 == 0 && kVOff % 1024 == 0 && kOOff % 1024 == 0 && kKVBytes % 1024 == 0,
                "every K/V stage and column block starts 1024-byte aligned");
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

// S = Q K^T for one consumer warpgroup's 64 rows (issued and committed, not waited for).
// q_rows: the warpgroup's rows of the Q tile; k_stage: the K tile (B_c rows).
template <class T>
__device__ __forceinline__ void issue_s_wgmma(float (&sacc)[T::kBlockN / 2], uint32_t q_rows, uint32_t k_stage) {
  fence_regs(sacc);
  wgmma_fence();
  const uint64_t da0 = make_desc_sw128(q_rows, 16, 1024), db0 = make_desc_sw128(k_stage, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
    const int b = kk / 4, t = kk % 4;
    const uint64_t da = desc_advance(da0, b * T::kQBlockBytes + t * 32);
    const uint64_t db = desc_advance(db0, b * T::kKVBlockBytes + t * 32);
    wgmma_ss<T::kBf16, T::kBlockN, 0>(sacc, da, db, kk > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// O += P V over the first 16 kSteps keys of the V tile v_stage (issued and committed, not waited
// for). V: keys x D, D contiguous -> MN-major B; N = D spans D/64 column blocks kKVBlockBytes apart =
// LBO (the wgmma walks block n/64 at start + (n/64) * LBO); 8 keys per 1024-byte atom = SBO. k16
// step t = keys 16t..16t+15 = two atoms = start + 2048 t, and t < B_c/16 stays inside the first
// column block (B_c * 128 bytes).
template <class T, int kSteps>
__device__ __forceinline__ void issue_pv_wgmma(float (&o)[T::kHeadDim / 2],
                                               const uint32_t (&pa)[T::kBlockN / 16][4], uint32_t v_stage) {
  static_assert(kSteps <= T::kBlockN / 16, "keys within the tile");
  fence_regs(o);
  wgmma_fence();
  const uint64_t db0 = make_desc_sw128(v_stage, T::kKVBlockBytes, 1024);
#pragma unroll
  for (int t = 0; t < kSteps; ++t) {
    const uint64_t db = desc_advance(db0, t * 2048);
    wgmma_rs<T::kBf16, T::kHeadDim, 1>(o, pa[t], db, 1);
  }
  wgmma_commit();
}

// Number of key tiles the CTA visits (identical for producer and consumers).
template <class T>
__device__ __forceinline__ int num_key_tiles(const FwdParams& p, int q_tile) {
  int key_end = p.seqlen_k;
  if (p.causal) {
    const int last_row = min((q_tile + 1) * T::kBlockM, p.seqlen_q) - 1;
    // query i sees key j iff j <= i + Sk - Sq
    key_end = min(key_end, last_row + p.seqlen_k - p.seqlen_q + 1);
  }
  return key_end <= 0 ? 0 : (key_end + T::kBlockN - 1) / T::kBlockN;
}

// The kernel body, shared by both entry points below. tm_o is used only when
// T::kTmaStore (nullptr otherwise).
//
// Persistent scheduler (T::kPersistent): tile t in [0, n_q_tiles * Hq * B) is
//   q_tile = n_q_tiles - 1 - t % n_q_tiles, head = (t / n_q_tiles) % Hq,
//   batch = t / (n_q_tiles * Hq)
// (the order in which the non-persistent grid's blocks are numbered: heaviest
// causal tiles of a head first); CTA b takes t = b, b + gridDim.x, ...
// T::kLongestFirst ("pers.lpt"): the query tile varies slowest instead,
//   q_tile = n_q_tiles - 1 - t / (Hq * B), head = t % (Hq * B) % Hq,
//   batch = t % (Hq * B) / Hq,
// so under causal masking tiles come in non-increasing length over all heads
// and batches, and the CTAs of one step of the stride (t = s * gridDim.x + b)
// hold tiles of equal (or adjacent) query index. Both orders are bijections of
// [0, n_q_tiles * Hq * B) onto the (q_tile, head, batch) triples, and both are
// computed by the one set_tile below from t alone.
// Producer and consumers walk the same t (the same loop header) through the
// same set_tile and compute the same n_tiles per tile, so they enumerate the
// same sequence of K/V loads g = 0, 1, 2, ...
// (running over tile boundaries), once for K and once for V (two rings with the
// same numbering): with S = kStages, load g uses slot g % S for the (g / S)-th
// time, so full_k/full_v[g % S] complete their phase g / S with it (consumer
// waits parity (g / S) & 1) and empty_k/empty_v[g % S] must have completed
// phase g/S - 1 before it is issued (producer waits parity (g / S - 1) & 1
// when g >= S).
// The ring never re-initialises a barrier.
// Q / O-staging hand-over, k = index of the tile within this CTA (0, 1, ...):
//   q_full  (count 1): exactly one phase per tile, phase k. The producer
//     completes it with expect_tx + TMA Q when the tile has key tiles, with a
//     plain arrive when it has none. Both consumers wait parity k & 1 on every
//     tile (also on tiles without keys, where it is only a hand-shake).
//   q_empty (count 2): exactly one phase per tile, phase k: one arrival per
//     consumer warpgroup, by the thread that issued its TMA store, after
//     cp.async.bulk.wait_group.read 0 (the staging = Q smem is free again).
//     The producer waits parity (k-1) & 1 before it completes q_full phase k
//     (k >= 1), i.e. before a TMA load may overwrite Q.
//   No parity aliasing: a consumer reaching q_full phase k has seen phase k-1
//   complete, and phase k+1 needs q_empty phase k, i.e. its own arrival after
//   this wait: the barrier is at phase k or k+1 when it waits. The producer
//   reaching tile k has seen q_empty phase k-2 complete (at tile k-1), and
//   q_empty phase k needs q_full phase k, which it has not yet completed: the
//   barrier is at phase k-1 or k. (The q_full hand-shake on key-less tiles is
//   what keeps consumers from running two q_empty phases ahead.)
// T::kDoubleQ: tile k uses Q buffer k % 2 with its own q_full / q_empty pair, so
//   each pair completes one phase per use of its buffer (use k / 2): consumers
//   wait q_full parity (k / 2) & 1, the producer waits q_empty parity
//   (k / 2 - 1) & 1 before it reloads the buffer (k >= 2), and the argument above
//   holds per buffer. q_empty then only means "tile k's last S is complete" (the
//   O staging has its own tile), so the producer issues Q_k first, right after
//   tile k-1's last K/V load.
template <class T>
__device__ __forceinline__ void fwd_sm90_body(const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                              const CUtensorMap* tm_v, const CUtensorMap* tm_o,
                                              const FwdParams& p) {
#ifdef FLASHOP_SM90_ENABLED
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim;
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const uint32_t base = (raw_addr + 1023u) & ~1023u;
  // Q buffer, q_full and q_empty barrier of this CTA's tile number k (k = 0 without persistence).
  auto q_buffer = [&](uint32_t k) { return base + T::kQOff + (T::kDoubleQ ? (k & 1) * T::kQBytes : 0); };
  const uint32_t sK = base + T::kKOff;
  const uint32_t sV = base + T::kVOff;
  const uint32_t bar_q = base + T::kBarOff;
  auto bar_full_k = [&](int s) { return bar_q + 8u * (1 + s); };
  auto bar_full_v = [&](int s) { return bar_q + 8u * (1 + T::kStages + s); };
  auto bar_empty_k = [&](int s) { return bar_q + 8u * (1 + 2 * T::kStages + s); };
  auto bar_empty_v = [&](int s) { return bar_q + 8u * (1 + 3 * T::kStages + s); };
  // The q_full / q_empty pair of tile k's Q buffer (kDoubleQ), or of consumer warpgroup `half`'s rows of
  // the one buffer (kQHalves).
  auto q_pair = [&](uint32_t k, int half) -> uint32_t { return T::kDoubleQ ? (k & 1) : T::kQHalves ? half : 0; };
  auto bar_q_full = [&](uint32_t pair) { return pair ? bar_q + 8u * (2 + 4 * T::kStages) : bar_q; };
  auto bar_q_empty = [&](uint32_t pair) {  // kPersistent only
    return bar_q + 8u * (pair ? 3 + 4 * T::kStages : 1 + 4 * T::kStages);
  };
  // The phase parity of tile k's q_full (consumers) and, for k >= kQBuffers, of the q_empty phase the
  // producer waits for before it reloads the buffer: the buffer's use number k / kQBuffers.
  auto q_full_parity = [&](uint32_t k) { return (k / T::kQBuffers) & 1; };
  // kDynamic: the tile number of Q buffer k % kQBuffers's current tile.
  auto tile_slot = [&](uint32_t k) { return bar_q + 8u * T::kNumBars + 4u * (k % T::kQBuffers); };
  auto q_empty_parity = [&](uint32_t k) { return (k / T::kQBuffers - 1) & 1; };

  // The current tile. Non-persistent: one per CTA, highest query tiles first
  // (under causal masking they see the most keys).
  int q_tile = 0, head = 0, batch = 0, n_tiles = 0;
  int key_tile0 = 0;  // the first key tile of the work item (> 0 only for a split tile's later parts)
  // Persistent: tile t -> (q_tile, head, batch, n_tiles); see above. The host
  // guarantees n_q_tiles * Hq * B + gridDim.x < 2^31. set_tile runs only for
  // t < total_tiles, hence n_q_tiles >= 1 and Hq * B <= total_tiles: no
  // product below overflows.
  const int n_q_tiles = (p.seqlen_q + kBM - 1) / kBM;
  const int total_tiles = n_q_tiles * p.heads_q * p.batch;
  auto set_tile = [&](int t) {
    if constexpr (T::kLongestFirst) {
      const int n_hb = p.heads_q * p.batch;  // (head, batch) pairs per query tile
      const int qi = t / n_hb;
      const int hb = t - qi * n_hb;
      q_tile = n_q_tiles - 1 - qi;
      batch = hb / p.heads_q;
      head = hb - batch * p.heads_q;
    } else {
      const int hb = t / n_q_tiles;
      q_tile = n_q_tiles - 1 - (t - hb * n_q_tiles);
      batch = hb / p.heads_q;
      head = hb - batch * p.heads_q;
    }
    n_tiles = num_key_tiles<T>(p, q_tile);
    key_tile0 = 0;
  };

  // A persistent CTA's work items, in order; item(role) runs once the tile variables above are set.
  // Roles: a whole tile (key tiles 0 .. n_tiles-1), or a part of a split tile (below).
  constexpr int kWholeTile = 0, kPartOut = 1, kPartIn = 2;
  // Without the split: tiles blockIdx.x, + gridDim.x, ... With it (T::kStreamK and p.stream_k, set by
  // the launcher for non-causal problems whose tile count is not a multiple of the grid): the tiles
  // below p.stream_k_tile0 the same way (a multiple of gridDim.x: the same number for every CTA), then
  // the rest, the last one or two waves, as units u = (t - stream_k_tile0) * n + j (key tile j of tile
  // t, n key tiles per tile, the same for all tiles when non-causal), dealt out in equal runs:
  // CTA b takes [u0, u1), u1 - u0 = per or per + 1 >= n (the launcher keeps at least one tile per CTA
  // in this part), so each run holds at most one tile's end part and one tile's start part, and a tile
  // is cut at most once. The run is walked from its last tile down:
  //   kPartOut: keys 0 .. x-1 of a tile whose other keys are the start of CTA b+1's run, the first
  //     item of b's split part; stores its unnormalised O, running max and sum in b's workspace slot
  //     and raises b's flag instead of writing O.
  //   kPartIn: keys x .. n-1 of a tile that CTA b-1 started, the last item of b's run; waits for b-1's
  //     flag, merges its partial into its own and writes O and lse.
  // CTA b only ever waits for CTA b-1, which raised its flag after its first split item, so the waits
  // form a chain that ends at CTA 0 (which never waits); the grid is at most one CTA per SM.
  // One call site of item (the tile body is inlined once).
  auto walk = [&](auto&& item) {
    if constexpr (!T::kStreamK) {
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        set_tile(t);
        item(kWholeTile);
      }
    } else {
      const bool split = p.stream_k;
      const int b = blockIdx.x;
      const int whole_end = split ? p.stream_k_tile0 : total_tiles;
      const int n_whole = b < whole_end ? (whole_end - b + gridDim.x - 1) / gridDim.x : 0;
      int n_items = n_whole;
      int n = 0, u0 = 0, u1 = 0;  // the split part's key tiles per tile and this CTA's run [u0, u1)
      if (split) {
        n = num_key_tiles<T>(p, 0);
        const int units = (total_tiles - p.stream_k_tile0) * n;  // < 2^31 (launcher)
        const int per = units / gridDim.x, extra = units - per * gridDim.x;
        u0 = b * per + min(b, extra);
        u1 = u0 + per + (b < extra ? 1 : 0);
        n_items += (u1 - 1) / n - u0 / n + 1;
      }
      for (int i = 0; i < n_items; ++i) {
        int role = kWholeTile;
        if (i < n_whole) {
          set_tile(b + i * gridDim.x);
        } else {
          const int tt = (u1 - 1) / n - (i - n_whole);  // from the run's last tile down
          set_tile(p.stream_k_tile0 + tt);
          const int kb = max(u0 - tt * n, 0), ke = min(u1 - tt * n, n);
          key_tile0 = kb;
          n_tiles = ke - kb;
          role = ke < n ? kPartOut : kb > 0 ? kPartIn : kWholeTile;
        }
        item(role);
      }
    }
  };

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  // Multicast pair (T::kMulticast launched with a cluster of two): this CTA's rank and its peer's.
  // A multicast kernel launched without a cluster (or any other kernel) has cluster_ctas == 1.
  const uint32_t cluster_ctas = T::kMulticast ? cluster_num_ctas() : 1u;
  const bool multicast = cluster_ctas > 1;
  const uint32_t cta_rank = multicast ? cluster_cta_rank() : 0u;
  const uint32_t peer_rank = cta_rank ^ 1u;

  // One tile per CTA. Plain grid (q tiles reversed, Hq, B): highest query tiles first (under causal
  // masking they see the most keys). Split last wave (T::kSplitTail and p.stream_k, non-causal): a 1-D
  // grid, CTA b < stream_k_tile0 runs tile b whole (the plain order, set_tile), the CTAs after it run
  // the pieces of the tiles from stream_k_tile0 on: piece i of k = split_pieces holds key tiles
  // [i n / k, (i + 1) n / k) of the tile's n. Launched in clusters of two (multicast), a cluster runs
  // the same piece of two adjacent tiles (one head: the tile count per head is even), so both CTAs
  // walk the same key tiles; stream_k_tile0 is even then and b % 2 is the CTA's rank.
  // (piece, split tile index) of a piece CTA, decoded again where needed rather than kept live
  // through the main loop (the B_c = 192 and d256 kernels have no register to spare).
  auto piece_of_cta = [&](int& piece, int& split_tile) {
    const int pair = multicast ? 2 : 1;
    const int e = static_cast<int>(blockIdx.x) - p.stream_k_tile0;
    const int group = e / pair;  // (split tile or pair of them, piece)
    piece = group % p.split_pieces;
    split_tile = (group / p.split_pieces) * pair + (e - group * pair);
  };
  auto is_piece_cta = [&]() { return T::kSplitTail && p.stream_k && static_cast<int>(blockIdx.x) >= p.stream_k_tile0; };
  if constexpr (!T::kPersistent) {
    if (T::kSplitTail && p.stream_k) {
      if (!is_piece_cta()) {
        set_tile(blockIdx.x);
      } else {
        int piece, split_tile;
        piece_of_cta(piece, split_tile);
        set_tile(p.stream_k_tile0 + split_tile);
        const int n = n_tiles;  // >= split_pieces (launcher)
        key_tile0 = piece * n / p.split_pieces;
        n_tiles = (piece + 1) * n / p.split_pieces - key_tile0;
      }
    } else {
      q_tile = gridDim.x - 1 - blockIdx.x;
      head = blockIdx.y;
      batch = blockIdx.z;
      n_tiles = num_key_tiles<T>(p, q_tile);
    }
  }

  if (tid == 0) {
    tma_prefetch_desc(tm_q);
    tma_prefetch_desc(tm_k);
    tma_prefetch_desc(tm_v);
    if constexpr (T::kTmaStore) tma_prefetch_desc(tm_o);
    for (uint32_t q = 0; q < T::kQPairs; ++q) mbar_init(bar_q_full(q), 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(bar_full_k(s), 1);
      mbar_init(bar_full_v(s), 1);
      // One arrival per consumer warp (of both CTAs when multicast: this CTA's producer writes both).
      mbar_init(bar_empty_k(s), 4 * T::kConsumerWGs * cluster_ctas);
      mbar_init(bar_empty_v(s), 4 * T::kConsumerWGs * cluster_ctas);
    }
    // q_empty: one arrival per consumer warpgroup after its O store has read the staging in Q, or
    // (kSeparateO) one per consumer warp after its last S of the tile, or (kQHalves) one per warp of
    // the half's consumer warpgroup.
    if constexpr (T::kPersistent) {
      for (uint32_t q = 0; q < T::kQPairs; ++q)
        mbar_init(bar_q_empty(q), T::kQHalves ? 4 : T::kSeparateO ? 4 * T::kConsumerWGs : T::kConsumerWGs);
    }
    mbar_init_fence();
  }
  // Multicast: the peer's TMA and its consumers' arrivals reach this CTA's barriers, so both CTAs'
  // inits must be done before either producer starts.
  if constexpr (T::kMulticast) cluster_sync();
  else __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0) {
      // Key tile j of the current work item (key tile key_tile0 + j of the tile) as K (is_v false) or V
      // load number g of this CTA.
      auto load_tile = [&](bool is_v, uint32_t g, int j, int kv_head) {
        const int s = g % T::kStages;
        const uint32_t use = g / T::kStages;
        if (use > 0) mbar_wait(is_v ? bar_empty_v(s) : bar_empty_k(s), (use - 1) & 1);
        const uint32_t full = is_v ? bar_full_v(s) : bar_full_k(s);
        const uint32_t dst = (is_v ? sV : sK) + s * T::kKVBytes;
        // Multicast: the whole tile's bytes land here, half from this CTA's load, half from the peer's.
        mbar_arrive_expect_tx(full, T::kKVBytes);
        const CUtensorMap* map = is_v ? tm_v : tm_k;
        if (multicast) {
          const uint32_t half = cta_rank * T::kKVHalfBytes;
          const int row = (key_tile0 + j) * kBN + static_cast<int>(cta_rank) * T::kKVHalfRows;
#pragma unroll
          for (int b = 0; b < T::kDBlocks; ++b)
            tma_load_4d_multicast(map, dst + b * T::kKVBlockBytes + half, full, b * 64, row, kv_head, batch, 0x3);
        } else {
#pragma unroll
          for (int b = 0; b < T::kDBlocks; ++b)
            tma_load_4d(map, dst + b * T::kKVBlockBytes, full, b * 64, (key_tile0 + j) * kBN, kv_head, batch);
        }
      };
      // Item i of a tile's K/V sequence K_0, K_1, V_0, K_2, V_1, ..., K_{n-1}, V_{n-2}, V_{n-1}:
      // item 0 = K_0, item 2n-1 = V_{n-1}, odd i = K_{(i+1)/2}, even i = V_{i/2-1}.
      auto load_item = [&](uint32_t g0, int i, int n, int kv_head) {
        const bool is_v = i == 2 * n - 1 || (i > 0 && (i & 1) == 0);
        const int j = i == 0 ? 0 : (i == 2 * n - 1 ? n - 1 : ((i & 1) ? (i + 1) / 2 : i / 2 - 1));
        load_tile(is_v, g0 + j, j, kv_head);
      };
      // Q of the CTA's tile k (kQHalves: its rows 64 half .. 64 half + 63 only).
      auto load_q = [&](uint32_t k, int half) {
        const uint32_t full = bar_q_full(q_pair(k, half));
        const int row0 = T::kQHalves ? 64 * half : 0;
        mbar_arrive_expect_tx(full, T::kQBoxRows * 128 * T::kDBlocks);
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b)
          tma_load_4d(tm_q, q_buffer(k) + b * T::kQBlockBytes + row0 * 128, full, b * 64, q_tile * kBM + row0,
                      head, batch);
      };
      if constexpr (T::kPersistent) {
        uint32_t g0 = 0;  // K/V loads issued by this CTA before the current tile
        uint32_t k = 0;   // index of the current tile within this CTA
        // The current tile's loads; slot_tile: its number for the consumers (kDynamic).
        auto produce_tile = [&](int slot_tile) {
          const int kv_head = head / p.head_ratio;
          // Two Q buffers: Q first, its buffer was freed by tile k-2's last S, long
          // before. One: K_0, K_1, V_0 first, they do not wait for anything of this
          // tile (their ring slots are freed before the previous tile's epilogue),
          // so they load while the consumers still store the previous O.
          // Q halves: K_0 first (its slot was freed by both consumers' S two key tiles before the end of
          // the previous tile), then each half as soon as its consumer's last S is complete; K_1 and V_0
          // wait for the previous tile's last S and P V of both consumers anyway.
          const int pre = T::kDoubleQ ? 0 : T::kQHalves ? min(1, n_tiles) : min(3, 2 * n_tiles);
          for (int i = 0; i < pre; ++i) load_item(g0, i, n_tiles, kv_head);
          for (int half = 0; half < (T::kQHalves ? 2 : 1); ++half) {
            const uint32_t pair = q_pair(k, half);
            // Wait until the consumers are done with the buffer's previous tile
            // (k-1, or k-2 with two buffers): their epilogue is complete (the O
            // staging lives in Q), or (kSeparateO, kQHalves) their last S.
            if (k >= T::kQBuffers) mbar_wait(bar_q_empty(pair), q_empty_parity(k));
            // The tile number, after that wait (the consumers have read the slot's previous number), published
            // by the q_full phase below (arrive: release; the consumers' wait: acquire).
            if constexpr (T::kDynamic) st_shared_b32(tile_slot(k), static_cast<uint32_t>(slot_tile));
            // A half entirely past Sq (the second of a short last query tile) is not loaded: its rows
            // are computed from whatever the buffer holds and never stored.
            if (n_tiles > 0 && (!T::kQHalves || q_tile * kBM + 64 * half < p.seqlen_q)) load_q(k, half);
            else mbar_arrive(bar_q_full(pair));  // q_full phase k without Q (hand-shake only)
          }
          // K_2 onwards waits for slots that S_0, S_1, ... of this tile free
          // (they need Q, issued just above), V_1 onwards for P V of this tile.
          for (int i = pre; i < 2 * n_tiles; ++i) load_item(g0, i, n_tiles, kv_head);
          g0 += n_tiles;
          ++k;
        };
        if constexpr (T::kDynamic) {
          // Tiles blockIdx.x first, then gridDim.x + (the counter's count of earlier takes): every tile
          // exactly once, in the plain order (a head's heaviest causal tiles first, the heads in turn).
          int* taken = static_cast<int*>(p.workspace);  // zeroed by the launcher
          for (int t = blockIdx.x; t < total_tiles;) {
            const int next = atomicAdd(taken, 1) + static_cast<int>(gridDim.x);  // used after this tile's loads
            set_tile(t);
            produce_tile(t);
            t = next;
          }
          // No more: a last q_full phase with a tile number past the end (the buffer's previous tile has
          // been read, as before any load into it).
          if (k >= T::kQBuffers) mbar_wait(bar_q_empty(q_pair(k, 0)), q_empty_parity(k));
          st_shared_b32(tile_slot(k), static_cast<uint32_t>(total_tiles));
          mbar_arrive(bar_q_full(q_pair(k, 0)));
        } else {
          walk([&](int) { produce_tile(0); });
        }
      } else if (n_tiles > 0) {
        const int kv_head = head / p.head_ratio;
        load_q(0, 0);
        for (int i = 0; i < 2 * n_tiles; ++i) load_item(0, i, n_tiles, kv_head);
        if (multicast) {
          // The peer's consumers arrive on this CTA's empty barriers until their last P V: stay alive
          // until every slot's last use has been released by both CTAs.
          for (int g = max(0, n_tiles - T::kStages); g < n_tiles; ++g) {
            mbar_wait(bar_empty_k(g % T::kStages), (g / T::kStages) & 1);
            mbar_wait(bar_empty_v(g % T::kStages), (g / T::kStages) & 1);
          }
        }
      }
    }
    return;
  }

  // -------------------------------------------------------------- consumer
  setmaxnreg_inc<T::kConsumerRegs>();
  // Consumer index: rows 64c .. 64c+63 of the tile. Persistent kernels broadcast it from lane 0 so that ptxas
  // knows it is warp-uniform (it cannot tell from threadIdx.x / 128): the Q descriptors and barrier addresses
  // derived from it then live in uniform registers (without it the "pers.rego" main loop spills). The
  // one-tile kernels keep the plain index (the broadcast costs the d256 B_c = 80 multicast kernel 2% at 8k).
  const int c = T::kPersistent ? __shfl_sync(0xffffffffu, wg, 0) - 1 : wg - 1;
  const int ctid = tid - 128 * wg;   // 0..127 within the warpgroup
  const int warp = ctid / 32;
  const int lane = ctid % 32;
  // This thread's two rows (within the CTA's query tile) and global query index.
  const int row_in_tile = 64 * c + 16 * warp + lane / 4;
  int q_row0 = 0;  // q_tile * kBM + row_in_tile: rows q_row0 and q_row0 + 8
  const int col_base = 2 * (lane % 4);

  float o[kD / 2];
  float m[2];
  float l[2];  // per-thread partial row sums (reduced over the quad at the end)
  const float sl2 = p.scale_log2;
  const int diag = p.seqlen_k - p.seqlen_q;  // query i sees key j iff j <= i + diag

  // Narrow last key tile: a tile's last key tile often holds fewer than B_c visible keys (2048 keys
  // in 192-key tiles: 11 tiles, the last with 128). There P V runs only over the 64-key blocks that
  // hold a key some row of this warpgroup sees (64, 128 or B_c keys): the P of every key past them
  // is 0 (masked to -inf), so the skipped k-steps would have added 0.
  // Only for B_c > 128 (176, 192; +1% at 2k keys, d128 B_c = 192): the 128-key kernels keep the plain
  // P V (3-4% slower with the narrow one, H100).
  constexpr bool kNarrowLast = kBN > 128;
  // S = Q K_j^T for this warpgroup's rows, always over the whole tile (a narrower S wgmma on the
  // last tile made ptxas serialise every wgmma of the kernel, C7511: the accumulator registers of
  // the alternative widths).
  uint32_t sQ = q_buffer(0);  // the current tile's Q buffer
  auto issue_s = [&](float (&sacc)[kBN / 2], int s) {
    issue_s_wgmma<T>(sacc, sQ + c * 64 * 128, sK + s * T::kKVBytes);
  };
  // O += P V_j over the first `width` keys of the tile (rounded up to 64; B_c unless narrowed).
  auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int s, int width) {
    if constexpr (kNarrowLast) {
      if (width <= 64) return issue_pv_wgmma<T, 4>(o, pa, sV + s * T::kKVBytes);
      if (width <= 128) return issue_pv_wgmma<T, 8>(o, pa, sV + s * T::kKVBytes);
    }
    issue_pv_wgmma<T, kBN / 16>(o, pa, sV + s * T::kKVBytes);
  };
  // Keys of the tile's last key tile that some row of this warpgroup sees (<= 0: none; its P is
  // then all 0). Computed where needed rather than kept live through the loop.
  auto last_tile_keys = [&]() {
    int key_end = p.seqlen_k;
    if (p.causal) key_end = min(key_end, min(q_tile * kBM + 64 * c + 63, p.seqlen_q - 1) + diag + 1);
    return key_end - (key_tile0 + n_tiles - 1) * kBN;
  };
  // Keys past Sk, and (causal) keys past the diagonal, become -inf.
  auto mask = [&](float (&sacc)[kBN / 2], int j) {
    const int key0 = (key_tile0 + j) * kBN;
    const bool need_mask = (key0 + kBN > p.seqlen_k) ||
                           (p.causal && key0 + kBN - 1 > q_tile * kBM + 64 * c + diag);
    if (need_mask) {
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * i + col_base + (e & 1);
          const int row = q_row0 + 8 * (e >> 1);
          const bool bad = key >= p.seqlen_k || (p.causal && key > row + diag);
          if (bad) sacc[4 * i + e] = -INFINITY;
        }
      }
    }
  };
  // Online softmax on S (softmax.cuh): S becomes P in place; corr gets the rescale factors of the old O and l.
  auto softmax = [&](float (&sacc)[kBN / 2], float (&corr)[2]) { online_softmax<kBN>(sacc, m, l, corr, sl2); };
  auto rescale_o = [&](const float (&corr)[2]) { rescale_rows<kD>(o, corr); };
  auto convert_p = [&](const float (&sacc)[kBN / 2], uint32_t (&pa)[kBN / 16][4]) {
    p_to_a_fragments<T::kBf16, kBN>(sacc, pa);
  };
  // One arrival per warp once its wgmmas reading the slot (or Q) are complete.
  auto release = [&](uint32_t empty_bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);
  };
  // A K or V slot: multicast, the peer's producer writes it too, so its barrier gets the arrival as well.
  auto release_kv = [&](uint32_t empty_bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);
    if constexpr (T::kMulticast) {
      if (multicast && lane == 1) mbar_arrive_cluster(empty_bar, peer_rank);
    }
  };

  // Ping-pong between the two consumer warpgroups (named barriers 1 and 2, 256
  // threads): a warpgroup issues its GEMMs only on its turn, then hands the
  // turn over, so its softmax runs under the other warpgroup's GEMMs.
  // Three consumers (B_r = 192): the same as a ring 0 -> 1 -> 2 -> 0 on
  // barriers 1..3, warpgroup 2 opening and skipping its last hand-over.
  // Turns alternate c=0, c=1, c=0, ...; warpgroup 1 opens the first turn of
  // warpgroup 0 and skips the hand-over after its last turn, so every bar.sync
  // meets exactly one bar.arrive.
  // Persistent (kTurnsAcrossTiles): the alternation runs on across the CTA's
  // tiles (both warpgroups take n_tiles turns per tile): warpgroup 1 opens once
  // before the first tile and hands over after every turn, its last turn of
  // tile k included, so warpgroup 0 starts tile k+1 while warpgroup 1 still
  // runs its last P V and epilogue of tile k; warpgroup 0 takes the one
  // hand-over left after the last tile. At most one bar.arrive is pending per
  // barrier: warpgroup 1's next arrival on bar 1 needs bar 2, i.e. warpgroup 0's
  // arrival after its bar.sync 1.
  constexpr int kTurnThreads = 256;
  constexpr int kWGs = T::kConsumerWGs;
  // One consumer warpgroup (B_r = 64): no turns to take.
  constexpr bool kTurns = T::kPingPong && kWGs > 1;
  constexpr bool kTurnsAcrossTiles = kTurns && T::kPersistent;
  static_assert(!kTurnsAcrossTiles || kWGs == 2, "the persistent kernel has two consumer warpgroups");
  auto wait_turn = [&]() {
    if constexpr (kTurns) {
      if (c == 0) named_bar_sync<1, kTurnThreads>();
      else if (kWGs == 2 || c == 1) named_bar_sync<2, kTurnThreads>();
      else named_bar_sync<3, kTurnThreads>();
    }
  };
  auto pass_turn = [&](bool last) {
    if constexpr (kTurns) {
      if (c == 0) named_bar_arrive<2, kTurnThreads>();
      else if (kWGs == 3 && c == 1) named_bar_arrive<3, kTurnThreads>();
      else if (!last || kTurnsAcrossTiles) named_bar_arrive<1, kTurnThreads>();
    }
  };

  // Only with the separate O tile: otherwise the staging is Q, which the producer needs back (q_empty)
  // as early as possible for the next tile's load.
  constexpr bool kDeferStoreWait = T::kSeparateO;
  // Persistent kernels whose O never touches Q (own O tile, or O stored from registers): a consumer
  // warp releases Q (q_empty) right after the wgmma that completes its last S of the tile.
  constexpr bool kQFreeAfterLastS = T::kSeparateO || T::kQHalves;

  // The 128 threads of this consumer warpgroup (kTmaStore epilogue): named
  // barrier 3 (consumer 0) or 4 (consumer 1); 4, 5, 6 with three consumers.
  // Compile-time ids, so ptxas reserves 5 (7) barriers, not all 16.
  auto epilogue_bar = [&]() {
    if constexpr (kWGs == 2) {
      if (c == 0) named_bar_sync<3, 128>();
      else named_bar_sync<4, 128>();
    } else {
      if (c == 0) named_bar_sync<4, 128>();
      else if (c == 1) named_bar_sync<5, 128>();
      else named_bar_sync<6, 128>();
    }
  };

  auto epilogue_bar_or = [&](bool pred) {
    if constexpr (kWGs == 2) {
      return c == 0 ? named_bar_sync_or<3, 128>(pred) : named_bar_sync_or<4, 128>(pred);
    } else {
      return c == 0 ? named_bar_sync_or<4, 128>(pred) : c == 1 ? named_bar_sync_or<5, 128>(pred)
                                                               : named_bar_sync_or<6, 128>(pred);
    }
  };

  // Split tail (T::kStreamK): this warpgroup's partial result of a split tile in CTA cta's workspace
  // slot (layout: the traits' kPartialFloat4s), and the flag that says it is complete.
  auto partial_slot = [&](int cta) {
    return reinterpret_cast<float4*>(p.workspace) + cta * T::kPartialFloat4s + c * (kD / 8 + 1) * 128 + ctid;
  };
  auto partial_flag = [&](int cta) {
    return reinterpret_cast<int*>(reinterpret_cast<float4*>(p.workspace) + gridDim.x * T::kPartialFloat4s) +
           cta * kWGs + c;
  };
  // kPartOut: O (unnormalised), m and l as they stand, then the flag once all 128 threads have stored.
  // This thread's O (unnormalised), m and l into a partial-result slot (layout: kPartialFloat4s).
  auto write_partial = [&](float4* slot) {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) __stcg(slot + i * 128, make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]));
    __stcg(slot + (kD / 8) * 128, make_float4(m[0], m[1], l[0], l[1]));
  };
  auto store_partial = [&]() {
    write_partial(partial_slot(blockIdx.x));
    epilogue_bar();
    if (ctid == 0) {
      __threadfence();
      st_release_gpu(partial_flag(blockIdx.x), 1);
    }
  };
  // kPartIn: wait for CTA b-1's part of this tile and fold it in (the online softmax's merge of two
  // key ranges: both sides rescaled to the larger running max). m is the same in the four threads of a
  // row, so the per-thread partial sums l merge as they are and are reduced over the quad as usual.
  auto merge_from = [&](const float4* slot) {
    const float4 ml = __ldcg(slot + (kD / 8) * 128);
    const float m_in[2] = {ml.x, ml.y}, l_in[2] = {ml.z, ml.w};
    float f_own[2], f_in[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx = fmaxf(m[h], m_in[h]);
      f_own[h] = m[h] == -INFINITY ? 0.f : exp2f((m[h] - mx) * sl2);
      f_in[h] = m_in[h] == -INFINITY ? 0.f : exp2f((m_in[h] - mx) * sl2);
      m[h] = mx;
      l[h] = l[h] * f_own[h] + l_in[h] * f_in[h];
    }
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      const float4 v = __ldcg(slot + i * 128);
      o[4 * i + 0] = o[4 * i + 0] * f_own[0] + v.x * f_in[0];
      o[4 * i + 1] = o[4 * i + 1] * f_own[0] + v.y * f_in[0];
      o[4 * i + 2] = o[4 * i + 2] * f_own[1] + v.z * f_in[1];
      o[4 * i + 3] = o[4 * i + 3] * f_own[1] + v.w * f_in[1];
    }
  };
  auto merge_partial = [&]() {
    while (ld_acquire_gpu(partial_flag(blockIdx.x - 1)) == 0) __nanosleep(32);
    merge_from(partial_slot(blockIdx.x - 1));
  };

  // Split last wave (T::kSplitTail): piece q of split tile st keeps its partial result in slot
  // st * split_pieces + q; each consumer warpgroup of each split tile has an arrival counter (zeroed by
  // the launcher). A warpgroup stores its partial, then counts itself in; the one that arrives last (the
  // others' stores are visible: each made them, with a fence, before its arrival) merges all pieces'
  // parts in piece order (deterministic) and goes on to the epilogue; the others are done. Nobody
  // waits for another CTA, whatever order the CTAs run in. Returns whether this warpgroup writes the
  // rows.
  auto finish_piece = [&]() -> bool {
    const int k = p.split_pieces;
    int piece, split_tile;
    piece_of_cta(piece, split_tile);
    const float4* const slots = reinterpret_cast<const float4*>(p.workspace) +
                                static_cast<int64_t>(split_tile) * k * T::kPartialFloat4s +
                                c * (kD / 8 + 1) * 128 + ctid;
    write_partial(const_cast<float4*>(slots) + piece * T::kPartialFloat4s);
    __threadfence();
    epilogue_bar();  // all 128 stores made before the arrival
    int before = 0;
    if (ctid == 0) {
      int* const counters = reinterpret_cast<int*>(reinterpret_cast<float4*>(p.workspace) +
                                                   static_cast<int64_t>(p.split_tiles) * k * T::kPartialFloat4s);
      before = atomicAdd(counters + split_tile * kWGs + c, 1);
    }
    if (!epilogue_bar_or(ctid == 0 && before == k - 1)) return false;  // a later piece writes the rows
    __threadfence();
    // All k parts, its own too, in piece order: the result does not depend on which piece came last.
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    for (int q = 0; q < k; ++q) merge_from(slots + q * T::kPartialFloat4s);
    return true;
  };

  // One tile: main loop and epilogue. g0: number of K/V loads of this CTA
  // before this tile (0 without persistence); k: the tile's number within this CTA (its Q buffer and
  // q_full phase); role: kWholeTile, or a split tile's part (kPartOut, kPartIn; see walk).
  auto run_tile = [&](auto g0, uint32_t k, int role) {
    if constexpr (T::kPersistent) {
      // The tile's numbers are the same in every thread, but the persistent walk computes them with integer
      // divisions, which have no uniform-datapath form, so ptxas would keep them, and everything derived
      // from them in the main loop (ring slots, phases, wgmma descriptors), in per-thread registers. A
      // broadcast from lane 0 tells it they are warp-uniform.
      g0 = __shfl_sync(0xffffffffu, g0, 0);
      n_tiles = __shfl_sync(0xffffffffu, n_tiles, 0);
      key_tile0 = __shfl_sync(0xffffffffu, key_tile0, 0);
      q_tile = __shfl_sync(0xffffffffu, q_tile, 0);
    }
    sQ = q_buffer(k);
    q_row0 = q_tile * kBM + row_in_tile;
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    m[0] = -INFINITY;
    m[1] = -INFINITY;
    l[0] = 0.f;
    l[1] = 0.f;
    // Persistent: the q_full hand-shake happens on every tile (see above).
    if constexpr (T::kPersistent && !T::kDynamic) mbar_wait(bar_q_full(q_pair(k, c)), q_full_parity(k));

    if (n_tiles > 0) {
      if constexpr (kTurns && !kTurnsAcrossTiles) {
        if (c == kWGs - 1) named_bar_arrive<1, kTurnThreads>();
      }
      if constexpr (!T::kPersistent) mbar_wait(bar_q_full(q_pair(k, c)), q_full_parity(k));

      float sacc[kBN / 2];
      uint32_t pa[kBN / 16][4];
      float corr[2];

      // tile 0: S only (load g0 -> slot g0 % kStages, phase g0 / kStages)
      {
        const int s0 = g0 % T::kStages;
        mbar_wait(bar_full_k(s0), (g0 / T::kStages) & 1);
        wait_turn();
        issue_s(sacc, s0);
      }
      pass_turn(n_tiles == 1);
      wgmma_wait<0>();
      fence_regs(sacc);
      release_kv(bar_empty_k(g0 % T::kStages));
      if constexpr (kQFreeAfterLastS) {
        if (n_tiles == 1) release(bar_q_empty(q_pair(k, c)));  // the tile's last read of Q
      }
      mask(sacc, 0);
      softmax(sacc, corr);  // O is still 0: no rescale needed
      convert_p(sacc, pa);

      // Two consumer warpgroups: each one's softmax must end within the other's GEMMs, and the blocking
      // waits for K_j and V_{j-1} before its turn add their latency to that path. So K_{j+1} and V_j are
      // tested (without blocking) right after S_j, the result hidden under the softmax, and the blocking
      // waits run only if they were not there yet (d128 +1-2%; d256 and three-warpgroup d64, which have
      // the slack, keep the blocking waits: 1-4% slower with the test, H100).
      constexpr bool kEarlyReady = kTurns && kWGs == 2 && kD <= 128;
      bool turn_ready = false;  // kEarlyReady: this turn's K and V found loaded during the last softmax
      for (int j = 1; j < n_tiles; ++j) {
        const auto g = g0 + j;  // K_j's load number; V_{j-1}'s is g - 1
        const int s = g % T::kStages;
        const int sp = (g - 1) % T::kStages;
        if (!turn_ready) {
          mbar_wait(bar_full_k(s), (g / T::kStages) & 1);
          mbar_wait(bar_full_v(sp), ((g - 1) / T::kStages) & 1);
        }
        wait_turn();
        issue_s(sacc, s);        // S_j = Q K_j^T
        issue_pv(pa, sp, kBN);   // O += P_{j-1} V_{j-1}
        pass_turn(j == n_tiles - 1);
        wgmma_wait<1>();    // S_j done (PV may still run): K_j's slot is free
        fence_regs(sacc);
        release_kv(bar_empty_k(s));
        if constexpr (kQFreeAfterLastS) {
          if (j == n_tiles - 1) release(bar_q_empty(q_pair(k, c)));  // the tile's last read of Q
        }
        if constexpr (kEarlyReady) {  // the next turn's K_{j+1} and V_j (unused after the last tile)
          const auto gn = g + 1;
          turn_ready = mbar_test_wait(bar_full_k(gn % T::kStages), (gn / T::kStages) & 1);
          turn_ready = mbar_test_wait(bar_full_v(s), (g / T::kStages) & 1) && turn_ready;
        }
        mask(sacc, j);
        softmax(sacc, corr);
        wgmma_wait<0>();    // PV done: O and P_{j-1} free again, and V_{j-1}'s slot
        fence_regs(o);
        release_kv(bar_empty_v(sp));
        rescale_o(corr);
        convert_p(sacc, pa);
      }

      // last tile's P V
      const auto gl = g0 + (n_tiles - 1);
      const int sl = gl % T::kStages;
      mbar_wait(bar_full_v(sl), (gl / T::kStages) & 1);
      issue_pv(pa, sl, kNarrowLast ? last_tile_keys() : kBN);
      wgmma_wait<0>();  // also: every wgmma of this warpgroup (reads of Q) is complete
      fence_regs(o);
      release_kv(bar_empty_v(sl));
    }
    if constexpr (kQFreeAfterLastS) {
      if (n_tiles == 0) release(bar_q_empty(q_pair(k, c)));  // no key tile: Q was not even loaded
    }

    // ------------------------------------------------------------ epilogue
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
    if constexpr (T::kSplitTail) {
      if (is_piece_cta() && !finish_piece()) return;
    }
    if constexpr (T::kStreamK) {
      if (role == kPartOut) {  // no O, no lse: the tile's other part writes them
        store_partial();
        // O staged in Q: this part stages nothing, and its wgmmas (Q's readers) are complete.
        if constexpr (T::kTmaStore && !T::kSeparateO) {
          if (ctid == 0) mbar_arrive(bar_q_empty(q_pair(k, c)));
        }
        return;
      }
      if (role == kPartIn) merge_partial();
    }
    if constexpr (!T::kTmaStore) {
      Elem* out =
          reinterpret_cast<Elem*>(p.out) + batch * p.o_batch_stride + head * p.o_head_stride;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + 8 * h;
        const float sum = quad_sum(l[h]);
        const bool seen = sum > 0.f;  // no visible key: out = 0, lse = -inf
        const float inv = seen ? 1.f / sum : 0.f;
        if (row < p.seqlen_q) {
          Elem* orow = out + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll
          for (int i = 0; i < kD / 8; ++i) {
            const uint32_t v = pack2<T::kBf16>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
            *reinterpret_cast<uint32_t*>(orow + 8 * i + col_base) = v;
          }
          if ((lane % 4) == 0) lse[row] = seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
        }
      }
    } else {
      // Staging = rows 64c..64c+63 of every Q column block (see the traits).
      // Q smem is free for this warpgroup: its own wgmmas, the only readers of
      // these rows, are complete (wait_group 0 above; a wgmma's completion
      // includes an implicit generic-async proxy fence), the TMA write of Q
      // completed before they started (q_full), and the previous tile's TMA
      // store has read it (persistent: wait_group.read + bar 3+c, below, or
      // with the deferred wait just below). With no key tile, Q was not loaded
      // at all.
      const uint32_t stage = (T::kSeparateO ? base + T::kOOff : sQ) + c * T::kOStageBytes;
      // Deferred store wait (persistent, own O tile): the previous tile's store of this warpgroup
      // may still be reading the staging; wait here, just before it is written again, rather than
      // at the end of that tile's epilogue, where the wait would hold the warpgroup (and, through the
      // ping-pong, the other one's next turn) off the tensor cores for the store's whole read.
      if constexpr (kDeferStoreWait) {
        if (ctid == 0) tma_store_wait_read<0>();
        epilogue_bar();
      }
      // 128B swizzle: row r of a 64 x 64 box at r * 128, 16-byte chunk q at
      // (q ^ (r % 8)) * 16. This thread's rows r = 16 warp + lane/4 (+8):
      // r % 8 = lane / 4. n8 block i holds columns 8i + 2(lane%4) + {0,1}: column
      // block i / 8, chunk i % 8, bytes 4(lane%4) .. +3 of the chunk. For a fixed
      // i the 8 rows of a warp hit 8 distinct chunks: 32 distinct banks.
      const int rsw = lane / 4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = q_row0 + 8 * h;
        const int r = 16 * warp + lane / 4 + 8 * h;  // row within this warpgroup's 64
        const float sum = quad_sum(l[h]);
        const bool seen = sum > 0.f;  // no visible key: out = 0, lse = -inf
        const float inv = seen ? 1.f / sum : 0.f;
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          const uint32_t v = pack2<T::kBf16>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
          const uint32_t addr = stage + (i / 8) * T::kQBlockBytes + r * 128 +
                                ((((i % 8) ^ rsw) << 4) | (4 * (lane % 4)));
          st_shared_b32(addr, v);
        }
        if (row < p.seqlen_q && (lane % 4) == 0)
          lse[row] = seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
      }
      // Every writer: its st.shared before the async proxy's reads; then all
      // 128 threads of this warpgroup (bar 3 + c; 1 and 2 are the turns).
      fence_proxy_async_smem();
      epilogue_bar();
      if (ctid == 0) {
        const int orow0 = q_tile * kBM + 64 * c;
        // The map's row extent is Sq: rows >= Sq of the box are not written.
        // A box entirely past Sq (second half of a short last tile) is skipped.
        if (orow0 < p.seqlen_q) {
#pragma unroll
          for (int b = 0; b < T::kDBlocks; ++b)
            tma_store_4d(tm_o, stage + b * T::kQBlockBytes, b * 64, orow0, head, batch);
          tma_store_commit();
          // Staging must stay valid (CTA alive; persistent: not overwritten)
          // until the store has read it (deferred: at the next tile's epilogue,
          // or after the CTA's last tile).
          if constexpr (!kDeferStoreWait) tma_store_wait_read<0>();
        }
        if constexpr (T::kPersistent && !T::kSeparateO) mbar_arrive(bar_q_empty(q_pair(k, c)));  // tile's q_empty arrival
      }
      // Persistent: nobody in this warpgroup writes the staging of the next
      // tile before the store above has read this one (deferred: the barrier
      // after the wait at the top of the next epilogue).
      if constexpr (T::kPersistent && !kDeferStoreWait) epilogue_bar();
    }
  };

  if constexpr (T::kPersistent) {
    uint32_t g0 = 0;  // K/V loads of this CTA before the current tile (as the producer's)
    uint32_t k = 0;   // index of the current tile within this CTA: q_full phase k
    if constexpr (kTurnsAcrossTiles) {
      if (c == 1) named_bar_arrive<1, kTurnThreads>();  // opens warpgroup 0's first turn
    }
    if constexpr (T::kDynamic) {
      // The producer's tile numbers, one per q_full phase, until one past the end. Lane 0 reads the slot
      // for its warp: it is the lane whose q_empty arrival (after the tile's last S) releases the slot
      // for the producer's next write, so that arrival orders the read before it.
      while (true) {
        mbar_wait(bar_q_full(q_pair(k, c)), q_full_parity(k));
        const int t = static_cast<int>(__shfl_sync(0xffffffffu, lane == 0 ? ld_shared_b32(tile_slot(k)) : 0u, 0));
        if (t >= total_tiles) break;
        set_tile(t);
        run_tile(g0, k, kWholeTile);
        g0 += n_tiles;
        ++k;
      }
    } else {
      walk([&](int role) {
        run_tile(g0, k, role);
        g0 += n_tiles;
        ++k;
      });
    }
    if constexpr (kTurnsAcrossTiles) {
      if (c == 0) named_bar_sync<1, kTurnThreads>();  // warpgroup 1's hand-over after its last turn
    }
    // The CTA's last store must have read the staging before the CTA exits.
    if constexpr (kDeferStoreWait) {
      if (ctid == 0) tma_store_wait_read<0>();
    }
  } else {
    run_tile(0, 0u, kWholeTile);
  }
#endif
}

// Entry point of the plain-store configs (one tile per CTA, or persistent "pers.rego").
template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    fwd_kernel_sm90(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ FwdParams p) {
  static_assert(!T::kTmaStore, "TMA-store configs launch fwd_kernel_sm90_tmao");
  fwd_sm90_body<T>(&tm_q, &tm_k, &tm_v, nullptr, p);
}

// Entry point of the TMA-store configs ("tmao", "pers", "pers.lpt"): also the map of O.
template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    fwd_kernel_sm90_tmao(const __grid_constant__ CUtensorMap tm_q,
                         const __grid_constant__ CUtensorMap tm_k,
                         const __grid_constant__ CUtensorMap tm_v,
                         const __grid_constant__ CUtensorMap tm_o,
                         const __grid_constant__ FwdParams p) {
  static_assert(T::kTmaStore, "plain-store configs launch fwd_kernel_sm90");
  fwd_sm90_body<T>(&tm_q, &tm_k, &tm_v, &tm_o, p);
}

}  // namespace sm90
}  // namespace flashop

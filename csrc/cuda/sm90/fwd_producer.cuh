// The forward kernel's producer warpgroup (one thread issues everything): Q and the K/V ring by TMA,
// in the order the consumers use them, each load behind the barrier that frees its slot.
//
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
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../fwd_params.h"
#include "fwd_scheduler.cuh"
#include "fwd_traits.cuh"
#include "primitives.cuh"

namespace flashop {
namespace sm90 {

// The producer thread's work for the whole CTA: every tile's Q and K/V loads (persistent: every tile of
// the walk; kDynamic: tiles taken from the global counter, and a last q_full phase that says "no more").
// multicast / cta_rank: this CTA's place in a cluster of two (T::kMulticast), else false / 0.
template <class T>
__device__ __forceinline__ void fwd_producer(const FwdSmem<T> smem, FwdTileScheduler<T>& sched,
                                             const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                             const CUtensorMap* tm_v, const FwdParams& p, bool multicast,
                                             uint32_t cta_rank) {
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN;
  int& q_tile = sched.q_tile;
  int& head = sched.head;
  int& n_tiles = sched.n_tiles;
  int& key_tile0 = sched.key_tile0;
  // Key tile j of the current work item (key tile key_tile0 + j of the tile) as K (is_v false) or V
  // load number g of this CTA.
  auto load_tile = [&](bool is_v, uint32_t g, int j, int kv_head) {
    const int s = g % T::kStages;
    const uint32_t use = g / T::kStages;
    if (use > 0) mbar_wait(is_v ? smem.bar_empty_v(s) : smem.bar_empty_k(s), (use - 1) & 1);
    const uint32_t full = is_v ? smem.bar_full_v(s) : smem.bar_full_k(s);
    const uint32_t dst = (is_v ? smem.sV : smem.sK) + s * T::kKVBytes;
    // Multicast: the whole tile's bytes land here, half from this CTA's load, half from the peer's.
    mbar_arrive_expect_tx(full, T::kKVBytes);
    const CUtensorMap* map = is_v ? tm_v : tm_k;
    if (multicast) {
      const uint32_t half = cta_rank * T::kKVHalfBytes;
      const int row = sched.k_row_base() + (key_tile0 + j) * kBN + static_cast<int>(cta_rank) * T::kKVHalfRows;
#pragma unroll
      for (int b = 0; b < T::kDBlocks; ++b)
        tma_load_4d_multicast(map, dst + b * T::kKVBlockBytes + half, full, b * T::kColBlock, row, kv_head,
                              sched.tma_batch(),
                              0x3);
    } else {
#pragma unroll
      for (int b = 0; b < T::kDBlocks; ++b)
        tma_load_4d(map, dst + b * T::kKVBlockBytes, full, b * T::kColBlock,
                    sched.k_row_base() + (key_tile0 + j) * kBN, kv_head, sched.tma_batch());
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
    const uint32_t full = smem.bar_q_full(smem.q_pair(k, half));
    const int row0 = T::kQHalves ? 64 * half : 0;
    mbar_arrive_expect_tx(full, T::kQBoxRows * T::kRowBytes * T::kDBlocks);
#pragma unroll
    for (int b = 0; b < T::kDBlocks; ++b)
      tma_load_4d(tm_q, smem.q_buffer(k) + b * T::kQBlockBytes + row0 * T::kRowBytes, full, b * T::kColBlock,
                  sched.q_row_base() + q_tile * kBM + row0, head, sched.tma_batch());
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
        const uint32_t pair = smem.q_pair(k, half);
        // Wait until the consumers are done with the buffer's previous tile
        // (k-1, or k-2 with two buffers): their epilogue is complete (the O
        // staging lives in Q), or (kSeparateO, kQHalves) their last S.
        if (k >= T::kQBuffers) mbar_wait(smem.bar_q_empty(pair), smem.q_empty_parity(k));
        // The tile number, after that wait (the consumers have read the slot's previous number), published
        // by the q_full phase below (arrive: release; the consumers' wait: acquire).
        if constexpr (T::kDynamic) st_shared_b32(smem.tile_slot(k), static_cast<uint32_t>(slot_tile));
        // A half entirely past Sq (the second of a short last query tile) is not loaded: its rows
        // are computed from whatever the buffer holds and never stored.
        if (n_tiles > 0 && (!T::kQHalves || q_tile * kBM + 64 * half < sched.seqlen_q())) load_q(k, half);
        else mbar_arrive(smem.bar_q_full(pair));  // q_full phase k without Q (hand-shake only)
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
      for (int t = blockIdx.x; t < sched.total_tiles;) {
        const int next = atomicAdd(taken, 1) + static_cast<int>(gridDim.x);  // used after this tile's loads
        sched.set_tile(t);
        if (!sched.tile_outside()) produce_tile(t);  // packed: skipped by the consumers too (never handed over)
        t = next;
      }
      // No more: a last q_full phase with a tile number past the end (the buffer's previous tile has
      // been read, as before any load into it).
      if (k >= T::kQBuffers) mbar_wait(smem.bar_q_empty(smem.q_pair(k, 0)), smem.q_empty_parity(k));
      st_shared_b32(smem.tile_slot(k), static_cast<uint32_t>(sched.total_tiles));
      mbar_arrive(smem.bar_q_full(smem.q_pair(k, 0)));
    } else {
      sched.walk([&](int) { produce_tile(0); });
    }
  } else if (n_tiles > 0) {
    const int kv_head = head / p.head_ratio;
    load_q(0, 0);
    for (int i = 0; i < 2 * n_tiles; ++i) load_item(0, i, n_tiles, kv_head);
    if (multicast) {
      // The peer's consumers arrive on this CTA's empty barriers until their last P V: stay alive
      // until every slot's last use has been released by both CTAs.
      for (int g = max(0, n_tiles - T::kStages); g < n_tiles; ++g) {
        mbar_wait(smem.bar_empty_k(g % T::kStages), (g / T::kStages) & 1);
        mbar_wait(smem.bar_empty_v(g % T::kStages), (g / T::kStages) & 1);
      }
    }
  }
}

}  // namespace sm90
}  // namespace flashop

// The forward kernel's consumer warpgroups: per key tile S = Q K^T (wgmma, both operands in shared
// memory), mask, online softmax, O += P V (P from registers), in turns with the other consumer
// warpgroup so that one's softmax runs under the other's GEMMs; then the epilogue (fwd_epilogue.cuh).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "../fwd_params.h"
#include "fwd_epilogue.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_traits.cuh"
#include "primitives.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace flashop {
namespace sm90 {

// S = Q K^T for one consumer warpgroup's 64 rows (issued and committed, not waited for).
// q_rows: the warpgroup's rows of the Q tile; k_stage: the K tile (B_c rows).
// K-major operands: k16 step kk is column block kk / (kColBlock / 16), 32 bytes per step inside it.
template <class T>
__device__ __forceinline__ void issue_s_wgmma(float (&sacc)[T::kBlockN / 2], uint32_t q_rows, uint32_t k_stage) {
  fence_regs(sacc);
  wgmma_fence();
  const uint64_t da0 = make_desc_sw<T::kRowBytes>(q_rows, 16, T::kAtomBytes);
  const uint64_t db0 = make_desc_sw<T::kRowBytes>(k_stage, 16, T::kAtomBytes);
  constexpr int kStepsPerBlock = T::kColBlock / 16;
#pragma unroll
  for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
    const int b = kk / kStepsPerBlock, t = kk % kStepsPerBlock;
    const uint64_t da = desc_advance(da0, b * T::kQBlockBytes + t * 32);
    const uint64_t db = desc_advance(db0, b * T::kKVBlockBytes + t * 32);
    wgmma_ss<T::kBf16, T::kBlockN, 0>(sacc, da, db, kk > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// O += P V over the first 16 kSteps keys of the V tile v_stage (issued and committed, not waited
// for). V: keys x D, D contiguous -> MN-major B; N = D spans D/kColBlock column blocks kKVBlockBytes
// apart = LBO (the wgmma walks block n/kColBlock at start + (n/kColBlock) * LBO); 8 keys per atom
// (kAtomBytes: 1024, or 512 with the 64B swizzle) = SBO. k16 step t = keys 16t..16t+15 = two atoms
// = start + 2 t kAtomBytes, and t < B_c/16 stays inside the first column block (B_c * kRowBytes).
template <class T, int kSteps>
__device__ __forceinline__ void issue_pv_wgmma(float (&o)[T::kHeadDim / 2],
                                               const uint32_t (&pa)[T::kBlockN / 16][4], uint32_t v_stage) {
  static_assert(kSteps <= T::kBlockN / 16, "keys within the tile");
  fence_regs(o);
  wgmma_fence();
  const uint64_t db0 = make_desc_sw<T::kRowBytes>(v_stage, T::kKVBlockBytes, T::kAtomBytes);
#pragma unroll
  for (int t = 0; t < kSteps; ++t) {
    const uint64_t db = desc_advance(db0, t * 2 * T::kAtomBytes);
    wgmma_rs<T::kBf16, T::kHeadDim, 1>(o, pa[t], db, 1);
  }
  wgmma_commit();
}

// A consumer warpgroup's work for the whole CTA: every tile of the walk (persistent), the tile the
// producer hands over (kDynamic), or the CTA's one tile. wg: this thread's warpgroup (1 ..); multicast /
// peer_rank: this CTA's cluster of two (T::kMulticast), whose producers both wait for this one's releases.
template <class T>
__device__ __forceinline__ void fwd_consumer(const FwdSmem<T> smem, FwdTileScheduler<T>& sched,
                                             const CUtensorMap* tm_o, const FwdParams& p, int tid, int wg,
                                             bool multicast, uint32_t peer_rank) {
  constexpr int kBM = T::kBlockM, kBN = T::kBlockN, kD = T::kHeadDim;
  int& q_tile = sched.q_tile;
  int& head = sched.head;
  int& batch = sched.batch;
  int& n_tiles = sched.n_tiles;
  int& key_tile0 = sched.key_tile0;
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
  // query i sees key j iff j <= i + diag. T::kVariants: the tile's sequence's (packed batches), set per tile.
  int diag = p.seqlen_k - p.seqlen_q;

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
  uint32_t sQ = smem.q_buffer(0);  // the current tile's Q buffer
  auto issue_s = [&](float (&sacc)[kBN / 2], int s) {
    issue_s_wgmma<T>(sacc, sQ + c * 64 * T::kRowBytes, smem.sK + s * T::kKVBytes);
  };
  // O += P V_j over the first `width` keys of the tile (rounded up to 64; B_c unless narrowed).
  auto issue_pv = [&](const uint32_t (&pa)[kBN / 16][4], int s, int width) {
    if constexpr (kNarrowLast) {
      if (width <= 64) return issue_pv_wgmma<T, 4>(o, pa, smem.sV + s * T::kKVBytes);
      if (width <= 128) return issue_pv_wgmma<T, 8>(o, pa, smem.sV + s * T::kKVBytes);
    }
    issue_pv_wgmma<T, kBN / 16>(o, pa, smem.sV + s * T::kKVBytes);
  };
  // Keys of the tile's last key tile that some row of this warpgroup sees (<= 0: none; its P is
  // then all 0). Computed where needed rather than kept live through the loop. T::kVariants: the
  // right window bound in place of the diagonal (the left one never narrows the last tile).
  auto last_tile_keys = [&]() {
    int key_end = sched.seqlen_k();
    if constexpr (T::kVariants) {
      const int wr = p.variants.window_right;
      // (the sequence's used queries: sched.seqlen_k() - diag, which keeps used_q out of the loop)
      if (wr >= 0)
        key_end = min(key_end, min(q_tile * kBM + 64 * c + 63, sched.seqlen_k() - diag - 1) + diag + wr + 1);
    } else {
      if (p.causal) key_end = min(key_end, min(q_tile * kBM + 64 * c + 63, p.seqlen_q - 1) + diag + 1);
    }
    return key_end - (key_tile0 + n_tiles - 1) * kBN;
  };
  // Keys past Sk, and (causal) keys past the diagonal, become -inf.
  // T::kVariants: keys outside the window, i.e. right of row + diag + window_right or left of
  // row + diag - window_left (a bound of -1: none; causal is (-1, 0)). Only a tile that crosses an
  // edge for some row of this warp is masked: the right edge if its last key is right of a row's bound,
  // the left edge if its first key is left of a row's bound. Key key0 + col_base + t (t = 8i + e, a
  // constant) of row h is visible iff lo <= t <= hi.
  auto mask = [&](float (&sacc)[kBN / 2], int j) {
    const int key0 = (key_tile0 + j) * kBN;
    if constexpr (T::kVariants) {
      const int wl = p.variants.window_left, wr = p.variants.window_right;
      // Decided per warp from its lanes' rows (q_row0 and q_row0 + 8, live anyway): a tile-uniform bound
      // from the warpgroup's first row would be one more register through the loop.
      const bool edge =
          (wr >= 0 && key0 + kBN - 1 > q_row0 + diag + wr) || (wl >= 0 && key0 < q_row0 + 8 + diag - wl);
      const bool need_mask = (key0 + kBN > sched.seqlen_k()) || __any_sync(0xffffffffu, edge);
      if (need_mask) {
        // Tile-uniform parts of the bounds (relative to key0) apart from the thread's row and column.
        const int right = wr >= 0 ? diag + wr - key0 : sched.seqlen_k();
        const int left = wl >= 0 ? diag - wl - key0 : diag - sched.seqlen_k() - kBM;  // -Sq - kBM: none
        // col_base again from %laneid: ptxas would otherwise hoist q_row0 - col_base out of the loop
        // into a register of its own (spilled in the d256 B_c = 80 kernel).
        const int col = 2 * (lane_id_volatile() % 4);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // one row at a time: two bounds live, not four
          const int x = q_row0 + 8 * h - col;
          const int hi = min(sched.seqlen_k() - 1 - key0 - col, x + right);
          const int lo = x + left;
#pragma unroll
          for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int t = 8 * i + e;
              if (t < lo || t > hi) sacc[4 * i + 2 * h + e] = -INFINITY;
            }
          }
        }
      }
    } else {
      const bool need_mask = (key0 + kBN > p.seqlen_k) ||
                             (p.causal && key0 + kBN - 1 > q_tile * kBM + 64 * c + diag);
      if (need_mask) {
        // Per row, the last visible key relative to the thread's first column; each element's test is then one
        // compare with its constant offset t = 8i + e (as the variants' mask above).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int last = p.causal ? min(p.seqlen_k - 1, q_row0 + 8 * h + diag) : p.seqlen_k - 1;
          const int hi = last - key0 - col_base;
#pragma unroll
          for (int i = 0; i < kBN / 8; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (8 * i + e > hi) sacc[4 * i + 2 * h + e] = -INFINITY;
            }
          }
        }
      }
    }
  };
  // T::kVariants: softcap and ALiBi on S, before the mask (tanh would turn a masked -inf into a finite
  // score). The loop keeps raw scores q.k (the softmax scale is applied in exp2 and in lse = m * scale +
  // ln l), so both act in those units: score / scale = (softcap / scale) tanh(q.k * scale / softcap)
  // - (slope / scale) |row + diag - key| (softmax.cuh). Nothing of them stays in a register through the
  // loop (the B_c = 192 and d256 consumers have none to spare): the softcap factors come from the params
  // at each tile (a reciprocal per tile), the slope from global memory (an L1 hit after the first tile),
  // and the column within the quad from %laneid (volatile, so that it is not hoisted out of the loop).
  auto score_mods = [&](float (&sacc)[kBN / 2], int j) {
    if constexpr (T::kVariants) {
      const float softcap = p.variants.softcap;
      if (softcap > 0.f) apply_softcap<kBN>(sacc, p.scale / softcap, softcap / p.scale);
      const float* slopes = p.variants.alibi_slopes;
      if (slopes != nullptr) {
        const float slope = __ldg(slopes + batch * p.variants.alibi_batch_stride + head) / p.scale;
        // key - row - diag of the thread's element 0 (column 2 (lane % 4), row q_row0)
        const int rel = (key_tile0 + j) * kBN + 2 * (lane_id_volatile() % 4) - q_row0 - diag;
        apply_alibi<kBN>(sacc, slope, static_cast<float>(rel));
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


  // Persistent kernels whose O never touches Q (own O tile, or O stored from registers): a consumer
  // warp releases Q (q_empty) right after the wgmma that completes its last S of the tile.
  constexpr bool kQFreeAfterLastS = T::kSeparateO || T::kQHalves;

  FwdEpilogue<T> epi{p, smem, sched, o, m, l, c, ctid, warp, lane, q_row0, col_base, sl2, multicast};

  // One tile: main loop and epilogue. g0: number of K/V loads of this CTA
  // before this tile (0 without persistence); k: the tile's number within this CTA (its Q buffer and
  // q_full phase); role: kWholeTile, or a split tile's part (kPartOut, kPartIn; see FwdTileScheduler::walk).
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
    sQ = smem.q_buffer(k);
    q_row0 = q_tile * kBM + row_in_tile;
    if constexpr (T::kVariants) diag = sched.seqlen_k() - sched.seqlen_q();
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    m[0] = -INFINITY;
    m[1] = -INFINITY;
    l[0] = 0.f;
    l[1] = 0.f;
    // Persistent: the q_full hand-shake happens on every tile (see fwd_producer.cuh).
    if constexpr (T::kPersistent && !T::kDynamic) mbar_wait(smem.bar_q_full(smem.q_pair(k, c)), smem.q_full_parity(k));

    if (n_tiles > 0) {
      if constexpr (kTurns && !kTurnsAcrossTiles) {
        if (c == kWGs - 1) named_bar_arrive<1, kTurnThreads>();
      }
      if constexpr (!T::kPersistent) mbar_wait(smem.bar_q_full(smem.q_pair(k, c)), smem.q_full_parity(k));

      float sacc[kBN / 2];
      uint32_t pa[kBN / 16][4];
      float corr[2];

      // tile 0: S only (load g0 -> slot g0 % kStages, phase g0 / kStages)
      {
        const int s0 = g0 % T::kStages;
        mbar_wait(smem.bar_full_k(s0), (g0 / T::kStages) & 1);
        wait_turn();
        issue_s(sacc, s0);
      }
      pass_turn(n_tiles == 1);
      wgmma_wait<0>();
      fence_regs(sacc);
      release_kv(smem.bar_empty_k(g0 % T::kStages));
      if constexpr (kQFreeAfterLastS) {
        if (n_tiles == 1) release(smem.bar_q_empty(smem.q_pair(k, c)));  // the tile's last read of Q
      }
      score_mods(sacc, 0);
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
          mbar_wait(smem.bar_full_k(s), (g / T::kStages) & 1);
          mbar_wait(smem.bar_full_v(sp), ((g - 1) / T::kStages) & 1);
        }
        wait_turn();
        issue_s(sacc, s);        // S_j = Q K_j^T
        issue_pv(pa, sp, kBN);   // O += P_{j-1} V_{j-1}
        pass_turn(j == n_tiles - 1);
        wgmma_wait<1>();    // S_j done (PV may still run): K_j's slot is free
        fence_regs(sacc);
        release_kv(smem.bar_empty_k(s));
        if constexpr (kQFreeAfterLastS) {
          if (j == n_tiles - 1) release(smem.bar_q_empty(smem.q_pair(k, c)));  // the tile's last read of Q
        }
        if constexpr (kEarlyReady) {  // the next turn's K_{j+1} and V_j (unused after the last tile)
          const auto gn = g + 1;
          turn_ready = mbar_test_wait(smem.bar_full_k(gn % T::kStages), (gn / T::kStages) & 1);
          turn_ready = mbar_test_wait(smem.bar_full_v(s), (g / T::kStages) & 1) && turn_ready;
        }
        score_mods(sacc, j);
        mask(sacc, j);
        softmax(sacc, corr);
        wgmma_wait<0>();    // PV done: O and P_{j-1} free again, and V_{j-1}'s slot
        fence_regs(o);
        release_kv(smem.bar_empty_v(sp));
        rescale_o(corr);
        convert_p(sacc, pa);
      }

      // last tile's P V
      const auto gl = g0 + (n_tiles - 1);
      const int sl = gl % T::kStages;
      mbar_wait(smem.bar_full_v(sl), (gl / T::kStages) & 1);
      issue_pv(pa, sl, kNarrowLast ? last_tile_keys() : kBN);
      wgmma_wait<0>();  // also: every wgmma of this warpgroup (reads of Q) is complete
      fence_regs(o);
      release_kv(smem.bar_empty_v(sl));
    }
    if constexpr (kQFreeAfterLastS) {
      if (n_tiles == 0) release(smem.bar_q_empty(smem.q_pair(k, c)));  // no key tile: Q was not even loaded
    }

    // ------------------------------------------------------------ epilogue
    if constexpr (T::kVariants) sched.set_sequence();  // q_start, len_q, used_q again (see set_sequence)
    // Packed: lse is (Hq, total_q), the sequence's rows from q_start on (lse_batch_stride 0).
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + sched.q_row_base();
    if constexpr (T::kSplitTail) {
      if (sched.is_piece_cta() && !epi.finish_piece()) return;
    }
    if constexpr (T::kStreamK) {
      if (role == kPartOut) {  // no O, no lse: the tile's other part writes them
        epi.store_partial();
        // O staged in Q: this part stages nothing, and its wgmmas (Q's readers) are complete.
        if constexpr (T::kTmaStore && !T::kSeparateO) {
          if (ctid == 0) mbar_arrive(smem.bar_q_empty(smem.q_pair(k, c)));
        }
        return;
      }
      if (role == kPartIn) epi.merge_partial();
    }
    if constexpr (!T::kTmaStore) epi.store_o_regs(lse);
    else epi.store_o_tma(lse, tm_o, sQ, k);
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
        mbar_wait(smem.bar_q_full(smem.q_pair(k, c)), smem.q_full_parity(k));
        const int t = static_cast<int>(__shfl_sync(0xffffffffu, lane == 0 ? ld_shared_b32(smem.tile_slot(k)) : 0u, 0));
        if (t >= sched.total_tiles) break;
        sched.set_tile(t);
        run_tile(g0, k, kWholeTile);
        g0 += n_tiles;
        ++k;
      }
    } else {
      sched.walk([&](int role) {
        run_tile(g0, k, role);
        g0 += n_tiles;
        ++k;
      });
    }
    if constexpr (kTurnsAcrossTiles) {
      if (c == 0) named_bar_sync<1, kTurnThreads>();  // warpgroup 1's hand-over after its last turn
    }
    // The CTA's last store must have read the staging before the CTA exits.
    if constexpr (FwdEpilogue<T>::kDeferStoreWait) {
      if (ctid == 0) tma_store_wait_read<0>();
    }
  } else {
    run_tile(0, 0u, kWholeTile);
  }
}

}  // namespace sm90
}  // namespace flashop

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
//     fwd_producer.cuh, fwd_consumer.cuh), so one consumer starts tile k+1 while the other stores tile k. With
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
//     sum in a global workspace (flag per CTA; see FwdTileScheduler::walk).
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
// Shared-memory tiles are column blocks: rows of 64 elements (128 bytes) in the TMA/wgmma 128-byte
// swizzle where the tile width D is a multiple of 64, rows of 32 elements (64 bytes) in the 64-byte
// swizzle at D = 96, 160, 224 (fwd_traits.cuh). The true head dimension (a multiple of 8 up to D) is a
// run-time value: the TMA maps zero-fill the columns past it and the stores drop them.
//
// Attention variants (windows, softcap, ALiBi, sinks; csrc/attention_variants.h): a second instantiation
// of the same kernel, Sm90FwdVariants<T> (fwd_traits.cuh), run only for calls that ask for one; the
// window's key-tile range (fwd_scheduler.cuh key_tile_range), masks and score modifiers
// (fwd_consumer.cuh) and sinks (fwd_epilogue.cuh) are compiled into it alone.
//
// Packed batches (cu_seqlens, seqused; csrc/packed_sequences.h) run on the variants instantiation: the
// TMA maps cover all packed rows as one batch, each tile's loads start at its sequence's rows
// (fwd_scheduler.cuh), keys past the sequence's used keys are masked like keys past Sk, rows past its
// used queries are written as zeros with lse = -inf, and the O store never writes past the sequence's
// rows (TMA only for whole 64-row boxes inside it, registers for the rest; fwd_epilogue.cuh). No split
// tail, stream-k or multicast cluster on packed batches (the launcher's plans). A masked key's P is 0,
// and P V adds 0 * v: v rows past seqused_k that share a key tile with used ones must be finite (k and
// q rows there may hold anything).
//
// Files, by role (FlashAttention-3's split): fwd_traits.cuh (the config, the shared-memory layout),
// fwd_scheduler.cuh (which tiles and key tiles a CTA runs, in which order), fwd_producer.cuh (the
// TMA loads and the K/V ring), fwd_consumer.cuh (the wgmma + softmax main loop), fwd_epilogue.cuh
// (O and lse stores, split-tile partials); this file sets up the CTA and hands each warpgroup its role.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../fwd_params.h"
#include "fwd_consumer.cuh"
#include "fwd_producer.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_traits.cuh"
#include "primitives.cuh"

namespace flashop {
namespace sm90 {

// The kernel body, shared by both entry points below. tm_o is used only when
// T::kTmaStore (nullptr otherwise).
template <class T>
__device__ __forceinline__ void fwd_sm90_body(const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                              const CUtensorMap* tm_v, const CUtensorMap* tm_o,
                                              const FwdParams& p) {
#ifdef FLASHOP_SM90_ENABLED
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_addr = smem_u32(smem_raw);
  const FwdSmem<T> smem((raw_addr + 1023u) & ~1023u);
  FwdTileScheduler<T> sched(p);

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  // Multicast pair (T::kMulticast launched with a cluster of two): this CTA's rank and its peer's.
  // A multicast kernel launched without a cluster (or any other kernel) has cluster_ctas == 1.
  const uint32_t cluster_ctas = T::kMulticast ? cluster_num_ctas() : 1u;
  const bool multicast = cluster_ctas > 1;
  const uint32_t cta_rank = multicast ? cluster_cta_rank() : 0u;
  const uint32_t peer_rank = cta_rank ^ 1u;

  if constexpr (!T::kPersistent) {
    sched.set_cta_tile(multicast);
    // Packed batch: a tile of the max_seqlen_q grid past its sequence's rows; the whole CTA leaves
    // before any barrier (packed launches never form clusters).
    if (sched.tile_outside()) return;
  }

  if (tid == 0) {
    tma_prefetch_desc(tm_q);
    tma_prefetch_desc(tm_k);
    tma_prefetch_desc(tm_v);
    if constexpr (T::kTmaStore) tma_prefetch_desc(tm_o);
    for (uint32_t q = 0; q < T::kQPairs; ++q) mbar_init(smem.bar_q_full(q), 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(smem.bar_full_k(s), 1);
      mbar_init(smem.bar_full_v(s), 1);
      // One arrival per consumer warp (of both CTAs when multicast: this CTA's producer writes both).
      mbar_init(smem.bar_empty_k(s), 4 * T::kConsumerWGs * cluster_ctas);
      mbar_init(smem.bar_empty_v(s), 4 * T::kConsumerWGs * cluster_ctas);
    }
    // q_empty: one arrival per consumer warpgroup after its O store has read the staging in Q, or
    // (kSeparateO) one per consumer warp after its last S of the tile, or (kQHalves) one per warp of
    // the half's consumer warpgroup.
    if constexpr (T::kPersistent) {
      for (uint32_t q = 0; q < T::kQPairs; ++q)
        mbar_init(smem.bar_q_empty(q), T::kQHalves ? 4 : T::kSeparateO ? 4 * T::kConsumerWGs : T::kConsumerWGs);
    }
    mbar_init_fence();
  }
  // Multicast: the peer's TMA and its consumers' arrivals reach this CTA's barriers, so both CTAs'
  // inits must be done before either producer starts.
  if constexpr (T::kMulticast) cluster_sync();
  else __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == 0) fwd_producer<T>(smem, sched, tm_q, tm_k, tm_v, p, multicast, cta_rank);
    return;
  }
  setmaxnreg_inc<T::kConsumerRegs>();
  fwd_consumer<T>(smem, sched, tm_o, p, tid, wg, multicast, peer_rank);
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


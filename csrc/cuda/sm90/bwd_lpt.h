// The longest-first block order of the Hopper backward's ".lpt" builds (Sm90BwdLpt<traits>,
// bwd_kernel.cuh): which (key tile, kv head, batch) the CTA of a dispatch index computes. Plain C++17
// (no CUDA headers), so that a host test compiles it as it is (tests/test_sm90_swizzle.py). The kernel
// runs it in 32-bit unsigned arithmetic: a 64-bit division by a run-time value is a called subroutine in
// device code, and its calling convention cost the d128 variants build 44 bytes of spills.
#pragma once

#include <cstdint>

#include "../bwd_config.h"  // kBwdLptGroupWaves, kBwdLptMinKeyTiles (bwd_lpt_group_pairs)

namespace flashop {
namespace sm90 {

struct BwdBlock {
  int n_block;  // key tile
  int hk;       // kv head
  int b;        // batch
};

// Blocks numbered key-tile major within groups of group_pairs (batch, kv head) pairs (pair = b heads_k +
// hk; group g holds pairs g G .. g G + s_g - 1, s_g = min(G, P - g G), so only the last group may be
// short): dispatch index i in 0 .. N P - 1 (N = n_tiles, P = heads_k batch, G = group_pairs >= 1) is in
// group g = floor(floor(i / N) / G) = floor(i / (G N)), and w = i - g G N is key tile w / s_g, pair
// g G + w % s_g. In a causal problem key tile n sees the query tiles from about n B_c on, so each group's
// longest tiles start first and its shortest fill the last wave.
// A bijection of 0 .. N P - 1 onto the (key tile, kv head, batch) triples for every G >= 1: the groups'
// index ranges [g G N, (g G + s_g) N) are consecutive and tile 0 .. N P - 1 (s_g = G up to the last
// group, which ends at P N); on each, w -> (w / s_g, w % s_g) is a bijection of 0 .. s_g N - 1 onto
// 0 .. N - 1 x 0 .. s_g - 1, so i -> (key tile, pair) is one onto 0 .. N - 1 x 0 .. P - 1, and pair ->
// (pair % heads_k, pair / heads_k) one onto kv heads x batches. G = 1 is the plain order (key tile
// fastest, then kv head, then batch). No intermediate exceeds N P - 1 (the group is found without
// forming G N), so I = uint32_t is exact whenever N P < 2^32.
template <class I>
constexpr BwdBlock bwd_lpt_block(I index, I n_tiles, I heads_k, I batch, I group_pairs) {
  const I pairs = heads_k * batch;
  const I first = index / n_tiles / group_pairs * group_pairs;  // the group's first pair
  const I in_group = pairs - first < group_pairs ? pairs - first : group_pairs;
  const I within = index - first * n_tiles;
  const I pair = first + within % in_group;
  return BwdBlock{int(within / in_group), int(pair % heads_k), int(pair / heads_k)};
}

// The group size: bwd_lpt_group_pairs (bwd_config.h, the mma.sync lpt order's policy: about
// kBwdLptGroupWaves waves of blocks, at most as many pairs as 3/8 of the L2 holds the shared rows of, one
// pair below kBwdLptMinKeyTiles key tiles) in 32-bit divisions; the same value whenever
// l2_bytes * 3 / 8 < 2^32 (beyond, the budget is taken as 2^32 - 1). The bytes a pair's blocks share
// through the L2: the Q and dO rows (16-bit) and the fp32 dQ accumulator rows (tile_width wide) of its
// head_ratio query heads; K and V are read once per block, by that block.
inline constexpr uint32_t bwd_lpt_pairs(int sm_count, uint32_t n_tiles, int64_t l2_bytes, int seqlen_q_rounded,
                                        int tile_width, int head_ratio) {
  if (n_tiles < uint32_t(kBwdLptMinKeyTiles)) return 1;
  const uint32_t blocks = sm_count > 0 ? uint32_t(kBwdLptGroupWaves) * uint32_t(sm_count) : 0u;
  uint32_t pairs = (blocks + n_tiles - 1) / n_tiles;
  const int64_t pair_bytes = int64_t(seqlen_q_rounded) * tile_width * head_ratio * 8;
  if (pair_bytes > 0) {
    const int64_t budget = l2_bytes * 3 / 8;
    const uint32_t budget32 = budget < int64_t(0xffffffffu) ? uint32_t(budget < 0 ? 0 : budget) : 0xffffffffu;
    const uint32_t fit = pair_bytes > int64_t(budget32) ? 0u : budget32 / uint32_t(pair_bytes);
    if (pairs > fit) pairs = fit;
  }
  return pairs < 1 ? 1 : pairs;
}

}  // namespace sm90
}  // namespace flashop

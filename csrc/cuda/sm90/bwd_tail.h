// The tail split of the Hopper backward (bwd_kernel.cuh, bwd_launch.cuh). A dense non-causal problem has
// blocks of equal cost (one per key tile, kv head and batch entry); when their count is not a multiple of
// the CTAs one wave holds, the last wave runs a few blocks on an otherwise idle GPU (d128, 32k tokens:
// 4096 blocks on 132 SMs leave 4 alone). If that wave is at most half full and the blocks are long
// (kBwdTailMinSteps), each of its blocks runs instead as `pieces` CTAs, each over a run of the block's
// query steps, in a kernel of their own (Sm90BwdTail) launched after the dense one as its programmatic
// dependent. A piece adds its dK and dV (fp32) into a workspace that a last kernel converts; dQ is added as
// every block adds it.
// Plain C++17 (no CUDA headers), so that a host test compiles it as it is (tests/test_sm90_swizzle.py);
// the kernel runs the index arithmetic in 32 bits (see bwd_lpt.h on 64-bit divisions in device code).
#pragma once

#include <cstdint>

#include "../bwd_params.h"  // BwdTailSplit
#include "bwd_lpt.h"        // BwdBlock

namespace flashop {
namespace sm90 {

// A piece starts on a multiple of this many steps: each of the 2 stages' mbarriers flips its phase once per
// use, so a walk that starts at step 4j meets every stage in the phase a walk from step 0 does, and the
// kernel's stage and phase arithmetic on the absolute step stays as it is.
constexpr int kBwdTailQuantum = 4;

// Blocks of fewer steps are not split: the split's fixed cost (a workspace memset, the pieces' grid, a conversion
// kernel) outweighs what it saves of a short block: d128 bf16 backward, H200, 16 steps (1k) 0.99x against no split.
constexpr int kBwdTailMinSteps = 32;

// The split of `blocks` blocks of `steps` query steps each, `ctas_per_wave` of them resident at once:
// the last wave's blocks are split when that wave is at most half full and follows a full one, into as
// many pieces as fill one wave (at most one per quantum of steps). A split of fewer than 2 pieces is none.
inline constexpr BwdTailSplit bwd_tail_split(int64_t blocks, int ctas_per_wave, int steps) {
  BwdTailSplit none{0, 0, 0};
  if (ctas_per_wave < 2 || blocks <= ctas_per_wave || steps < kBwdTailMinSteps) return none;
  const int64_t rest = blocks % ctas_per_wave;
  if (rest == 0 || 2 * rest > ctas_per_wave) return none;
  const int64_t quanta = (int64_t(steps) + kBwdTailQuantum - 1) / kBwdTailQuantum;
  const int64_t per_wave = ctas_per_wave / rest;
  const int64_t pieces = per_wave < quanta ? per_wave : quanta;
  // A 1-D grid of int, and bwd_tail_steps' products quanta * piece in int.
  if (pieces < 2 || blocks - rest + rest * pieces > int64_t(0x7fffffff) || quanta * pieces > int64_t(0x7fffffff))
    return none;
  return BwdTailSplit{int(blocks - rest), int(rest), int(pieces)};
}

// Block `index` of the plain dispatch order (key tile fastest, then kv head, then batch entry).
template <class I>
inline constexpr BwdBlock bwd_plain_block(I index, I n_tiles, I heads_k) {
  const I pair = index / n_tiles;
  return BwdBlock{int(index - pair * n_tiles), int(pair % heads_k), int(pair / heads_k)};
}

// What CTA `cta` of a split grid computes: its block and, for a piece, which split block (unit) and piece.
struct BwdTailWork {
  BwdBlock block;
  int unit;   // the split block's index in 0 .. split.blocks - 1; -1 for a whole block
  int piece;  // 0 .. split.pieces - 1
};

template <class I>
inline constexpr BwdTailWork bwd_tail_work(I cta, const BwdTailSplit& split, I n_tiles, I heads_k) {
  const I first = I(split.first_block);
  if (cta < first) return BwdTailWork{bwd_plain_block<I>(cta, n_tiles, heads_k), -1, 0};
  const I r = cta - first, pieces = I(split.pieces);
  const I unit = r / pieces;
  return BwdTailWork{bwd_plain_block<I>(first + unit, n_tiles, heads_k), int(unit), int(r - unit * pieces)};
}

// The steps [begin, end) of piece `piece` of `pieces` over a block's `steps`: whole quanta, as even as they
// divide (pieces <= the quanta, so none is empty), the last ending at `steps`. In int: bwd_tail_split keeps
// quanta * pieces below 2^31.
inline constexpr void bwd_tail_steps(int steps, int pieces, int piece, int& begin, int& end) {
  const int quanta = steps / kBwdTailQuantum + (steps % kBwdTailQuantum != 0);
  begin = kBwdTailQuantum * (quanta * piece / pieces);
  const int stop = kBwdTailQuantum * (quanta * (piece + 1) / pieces);
  end = stop < steps ? stop : steps;
}

}  // namespace sm90
}  // namespace flashop

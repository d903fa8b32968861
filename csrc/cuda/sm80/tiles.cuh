// Small typed tiles for the mma.sync kernels (ThunderKittens spirit: a tile is
// a type with a handful of operations, the kernels compose them).
//
//   SmemTile<Rows, Cols, Swizzle>  where each element of a Rows x Cols 16-bit
//                                  tile lives in shared memory (both kernels)
//   load_tile_async                the cooperative cp.async global->shared copy
//                                  (forward; the backward's in namespace bwd)
//   LdsmAddr, *_frag_addr          ldmatrix addressing for the three operand
//                                  roles of the forward (A row-major, B from a
//                                  key-major tile, B^T from a key-major tile),
//                                  also the decode kernels' (csrc/cuda/decode)
//   bwd::lane_base_{a,b,c}         the backward's fragment address bases
#pragma once

#include <cstdint>
#include <type_traits>

#include "ptx.cuh"

namespace flashop {
namespace sm80 {

// ---------------------------------------------------------------------------
// Shared-memory tile layout.
//
// The tile is cut into column blocks of W elements (W = 64, one 128-byte row
// segment, when Cols % 64 == 0; else W = 32, 64 bytes: D = 32 and 96). Each
// block is stored row-major, blocks one after another:
//     [Cols / W blocks][Rows][W]
// so every block row is 128 or 64 bytes and the 16-byte chunks of a row can be
// permuted among themselves without touching other rows.
//
// Why swizzle: ldmatrix reads 8 rows x 16 bytes per 8x8 matrix, all at the same
// column. Unswizzled, those 8 rows sit at a multiple of 128 bytes from each
// other, i.e. in the same 4 banks: an 8-way conflict. XOR-ing the chunk index
// with bits of the row index puts the 8 rows in 8 different 16-byte bank
// groups:
//   128-byte rows: chunk' = chunk ^ (row % 8)          (8 chunks per row)
//   64-byte rows:  chunk' = chunk ^ ((row / 2) % 4)    (two rows share one
//                  128-byte bank line, so rows r and r+1 already differ in
//                  the line half; the XOR separates the 4 pairs)
// The copies write whole block rows of 16-byte chunks (8 consecutive lanes =
// one 128-byte line), which the XOR only permutes inside the line, so the
// cp.async writes stay conflict-free as well. tools/check_sm80_layouts.py
// checks both claims (and every address formula here) exhaustively.
//
// Addressing without running out of registers. A fragment address is
// offset(row, chunk) with row = (lane/warp part) + (compile-time multiple of
// 8) and chunk = (lane/warp part) + (compile-time part), the two chunk parts
// having disjoint bits (the kernel interleaves warps so they do). Then
//   offset(r + R, c + C) = (offset(r, c) ^ ((C % CPB) << 4)) + (C / CPB) * block
//                          + R * row_bytes
// (R multiple of 8 leaves the swizzle bits alone; disjoint bits mean no
// carries). So each operand role keeps one lane base register, and every
// ldmatrix is one LOP3 (XOR with an immediate, often 0) and an immediate
// offset: see at().
template <int kRows_, int kCols_, bool kSwizzle_ = true>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr bool kSwizzle = kSwizzle_;
  static constexpr int kBlockCols = (kCols % 64 == 0) ? 64 : 32;  // W
  static constexpr int kChunksPerBlockRow = kBlockCols / 8;         // 8 or 4
  static constexpr int kCPB = kChunksPerBlockRow;
  static constexpr int kColBlocks = kCols / kBlockCols;
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kElems = kRows * kCols;
  static constexpr uint32_t kRowBytes = uint32_t(kBlockCols) * 2;
  static constexpr uint32_t kBlockBytes = uint32_t(kRows) * kRowBytes;
  static constexpr uint32_t kBytes = uint32_t(kElems) * 2;

  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static_assert(kRows % 8 == 0, "tile height must be a multiple of 8 rows");

  // The chunk bits XOR-ed with a row's chunk index (0 without the swizzle).
  template <typename I>
  FLASHOP_SM80_DEV static I swizzle(I row) {
    return !kSwizzle ? I(0) : kCPB == 8 ? (row & I(7)) : ((row >> 1) & I(3));
  }

  // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of `row`. The forward
  // indexes with int, the backward with uint32_t; the two forms of the sum are equal, but ptxas
  // schedules each kernel differently with the other's, so each keeps its own (identical SASS).
  template <typename I>
  FLASHOP_SM80_DEV static uint32_t offset(I row, I chunk) {
    const I blk = chunk / I(kCPB), c = (chunk % I(kCPB)) ^ swizzle(row);
    if constexpr (std::is_signed<I>::value) {
      return uint32_t(((blk * kRows + row) * kBlockCols + c * 8) * 2);
    } else {
      return blk * kBlockBytes + row * kRowBytes + (c << 4);
    }
  }

  // offset(r + row_c, c + chunk_c) from base = tile + offset(r, c); row_c a
  // multiple of 8, chunk_c with bits disjoint from c's (see above).
  FLASHOP_SM80_DEV static uint32_t at(uint32_t base, int row_c, int chunk_c) {
    return (base ^ ((uint32_t(chunk_c) % kCPB) << 4)) + (uint32_t(chunk_c) / kCPB) * kBlockBytes +
           uint32_t(row_c) * kRowBytes;
  }
};

#ifndef FLASHOP_BWD_EMULATE  // the forward's copy is never compiled for the CPU emulator

// ---------------------------------------------------------------------------
// Global -> shared: rows [row0, row0 + Rows) of a (seqlen, Cols) slice whose
// row r starts at gbase + r * row_stride. Rows at or past row_end (the
// sequence length) and columns at or past col_end (the true head dimension, a
// multiple of 8, at most Cols; checked only when kPartialCols) are zero-filled
// (cp.async with src-size 0); their source is clamped to column 0 of row
// row_end - 1, so no address past the data is ever formed. Zero columns add
// nothing to Q K^T, and give zero O columns that are never stored.
//
// Thread t moves chunk t % (W/8) of block rows t / (W/8) + i * kRowsPerPass:
// consecutive lanes walk a block row left to right, so 8 (or 4) lanes cover one
// whole 128-byte (64-byte) global segment and the shared-memory writes of 8
// consecutive lanes fill one 128-byte bank line. kRowsPerPass is a multiple of
// 8, so a thread's rows all have the same swizzle bits: its destinations are
// one register plus compile-time offsets. Sources: the block-uniform tile
// pointer (64-bit) plus a 32-bit thread offset (FwdParams guarantees row
// strides below 2^24 elements, and a tile has at most 128 rows).
// Only issues the copies; the caller commits the group and later waits.
template <class Tile, int kThreads, bool kPartialCols, typename Elem>
FLASHOP_SM80_DEV void load_tile_async(uint32_t smem_base, const Elem* gbase, int64_t row_stride, int row0,
                                      int row_end, int col_end, int tid) {
  constexpr int kCPB = Tile::kChunksPerBlockRow;
  static_assert(kThreads % kCPB == 0, "threads must cover whole block rows");
  constexpr int kRowsPerPass = kThreads / kCPB;
  static_assert(kRowsPerPass % 8 == 0, "a pass must keep each thread's swizzle bits");
  constexpr int kPasses = (Tile::kRows + kRowsPerPass - 1) / kRowsPerPass;
  const int c = tid % kCPB;
  const int r = tid / kCPB;
  const uint32_t dst = smem_base + Tile::offset(r, c);
  const Elem* gtile = gbase + int64_t(row0) * row_stride;
  const int stride = int(row_stride);
  const int thread_off = r * stride + c * 8;
  const int rows_left = row_end - row0 - r;  // this thread's rows [0, rows_left) are in range
  const int cols_left = col_end - c * 8;     // its chunk of column block blk is in range iff blk * W < cols_left
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (Tile::kRows % kRowsPerPass == 0 || pass * kRowsPerPass + r < Tile::kRows) {
      const bool valid = pass * kRowsPerPass < rows_left;
      // Out of range: read (nothing) from the last row of the sequence instead.
      const int row = min(pass * kRowsPerPass, rows_left - 1);
      const Elem* src = gtile + (thread_off + row * stride);
#pragma unroll
      for (int blk = 0; blk < Tile::kColBlocks; ++blk) {
        const bool col_valid = !kPartialCols || blk * Tile::kBlockCols < cols_left;
        cp_async_16_l2_128b(dst + uint32_t((blk * Tile::kRows + pass * kRowsPerPass) * Tile::kBlockCols * 2),
                            col_valid ? src + blk * Tile::kBlockCols : src - c * 8, valid && col_valid);
      }
    }
  }
}

#endif  // FLASHOP_BWD_EMULATE

// ---------------------------------------------------------------------------
// Fragment loads (see ptx.cuh for the mma fragment layouts).
//
// Every ldmatrix.x4 of the kernel reads a 16 x 16 block: lane l addresses row
// lane_row(l) in [0, 16) and column half lane_half(l) in {0, 1} of the block.
// LdsmAddr holds that lane's swizzled address for the block at (0, 0) and
// derives every other block from it with one XOR and a constant:
//   * a block row offset (multiple of 8 rows) keeps the swizzle bits of the
//     row, so it is a plain add of row * W * 2 bytes;
//   * an even logical chunk c inside a block row flips only chunk bits that the
//     lane's own bits (lane_half ^ swizzle) do not touch at bit 0, so
//     ((c + lane_half) ^ swz) == (c ^ (lane_half ^ swz)): the address is the
//     lane's base XOR (c * 16). Tile bases and row offsets are multiples of
//     128 (64) bytes, so they never carry into the XOR-ed bits.
// Without the swizzle the lane's chunk bits are just lane_half (bit 0), so the
// XOR is an add: the same code serves both layouts.
// This keeps one register per operand instead of one per (block, lane) pair.
template <class Tile>
struct LdsmAddr {
  uint32_t base;

  FLASHOP_SM80_DEV LdsmAddr(uint32_t tile, int lane_row, int lane_half)
      : base(tile + Tile::offset(lane_row, lane_half)) {}

  // Same lane pattern in a tile moved by `bytes` (a multiple of 128: a stage).
  FLASHOP_SM80_DEV LdsmAddr shifted(uint32_t bytes) const {
    LdsmAddr a = *this;
    a.base += bytes;
    return a;
  }

  // Block whose top-left is (row0, 16 * cpair). row0: a multiple of 8.
  FLASHOP_SM80_DEV uint32_t at(int row0, int cpair) const {
    constexpr int kCPB = Tile::kChunksPerBlockRow;
    const int c = 2 * cpair;
    const uint32_t xor_bits = uint32_t((c % kCPB) * 16);
    const uint32_t add = uint32_t(((c / kCPB) * Tile::kRows + row0) * Tile::kBlockCols * 2);
    return (base ^ xor_bits) + add;
  }
};

// A operand (Q), 16 rows x 16 columns: matrices 0 = rows 0-7 / cols 0-7,
// 1 = rows 8-15 / cols 0-7, 2 = rows 0-7 / cols 8-15, 3 = rows 8-15 / cols
// 8-15, i.e. a[0..3] in mma order. Lane l: row l % 16, column half l / 16.
template <class Tile>
FLASHOP_SM80_DEV LdsmAddr<Tile> a_frag_addr(uint32_t tile, int row_base, int lane) {
  return LdsmAddr<Tile>(tile, row_base + (lane & 15), lane >> 4);
}

// B operands of S = Q K^T for two n8 tiles (16 keys x 16 head dims of the
// key-major K tile). K[key][dim] is B[dim][key] stored "col", exactly what the
// non-transposed ldmatrix hands out. Matrices: 0 = keys 0-7 / dims 0-7,
// 1 = keys 0-7 / dims 8-15, 2 = keys 8-15 / dims 0-7, 3 = keys 8-15 / dims
// 8-15, so b[0], b[1] feed the first n8 tile and b[2], b[3] the second.
// Lane l: key 8 * (l / 16) + l % 8, dim half (l / 8) % 2.
template <class Tile>
FLASHOP_SM80_DEV LdsmAddr<Tile> b_frag_addr(uint32_t tile, int lane) {
  return LdsmAddr<Tile>(tile, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
}

// B operands of O += P V for two n8 tiles (16 keys = the mma k dimension x 16
// head dims). V is stored key-major, so the fragment needs two vertically
// adjacent elements per register: ldmatrix .trans. Matrices: 0 = keys 0-7 /
// dims 0-7, 1 = keys 8-15 / dims 0-7, 2 = keys 0-7 / dims 8-15, 3 = keys 8-15 /
// dims 8-15: b[0], b[1] feed the first n8 tile, b[2], b[3] the second.
// Lane l: key l % 16, dim half l / 16.
template <class Tile>
FLASHOP_SM80_DEV LdsmAddr<Tile> bt_frag_addr(uint32_t tile, int lane) {
  return LdsmAddr<Tile>(tile, lane & 15, lane >> 4);
}

// ---------------------------------------------------------------------------
// The backward's tiles. It keeps five of them; which operand of which
// product each one feeds, and therefore which ldmatrix form reads it:
// K, V (B_c x D, key-major), Q, dO (B_r x D, query-major) and dS^T (+ P^T)
// (B_c x B_r, key-major).
//
//   product        A (rows x k)                 B (k x cols)
//   S^T = K Q^T    K [key][d], plain "a"        Q [query][d], plain "b"
//   dP^T = V dO^T  V [key][d], plain "a"        dO [query][d], plain "b"
//   dV += P^T dO   P^T: registers, or           dO [query][d], .trans "a"
//                  [key][query] plain "a"
//   dK += dS^T Q   dS^T: registers, or          Q [query][d], .trans "a"
//                  [key][query] plain "a"
//   dQ = dS K      dS^T [key][query], .trans "b"  K [key][d], .trans "a"
// ("a"/"b": the two lane-to-row maps of ldmatrix.x4, lane_base_a/_b below.)
//
// "plain" B: the mma wants B[k][n] pairs along k; a tile stored [n][k] (rows
// = n) has those pairs side by side in a row, which is what ldmatrix hands a
// lane. ".trans": the tile is stored [k][n] (rows = k), the pairs are
// vertical, ldmatrix.trans turns them. dS for dQ is the transpose of the
// stored dS^T, so its A fragment comes through .trans as well.
namespace bwd {

// ---------------------------------------------------------------------------
// Global -> shared, asynchronously: rows [row0, row0 + Rows) of a sequence
// whose row r starts at gbase + r * row_stride (elements), columns [0, Cols)
// of the tile from columns [0, col_end) of the rows (col_end: the true head
// dimension, a multiple of 8, <= Cols). Rows at or past row_end and 16-byte
// chunks at or past col_end are zero-filled (cp.async src-size 0) with their
// source address clamped to column 0 of row0, which is always inside the
// sequence: no address at or past col_end (or row_end) is formed. Consecutive
// threads take consecutive 16-byte chunks of a row: coalesced global reads,
// conflict-free writes. Issues the copies only; the caller commits and
// waits. enable = false turns every copy into a zero fill (no global read, no
// branch).
template <class Tile, int kThreads, typename Elem>
FLASHOP_SM80_DEV void load_tile_async(uint32_t sbase, const Elem* gbase, int64_t row_stride, int row0,
                                     int row_end, int col_end, int tid, bool enable = true) {
  constexpr int kCPR = Tile::kChunksPerRow;
  const Elem* first = gbase + int64_t(row0) * row_stride;
  // Passes of whole groups of 8 rows: a thread keeps its chunk and its
  // swizzle, only the row advances. Where the rows do not tile the threads
  // (D = 96, 160, 192, 224 at 8 warps) the first kUsed threads (whole warps:
  // kCPR is a multiple of 4) do the copies and the others idle, which keeps
  // the column bound a per-thread select instead of a compare per copy.
  constexpr int kRowsPerPass = kThreads / (8 * kCPR) * 8;
  constexpr int kUsed = kRowsPerPass * kCPR;
  if constexpr (kRowsPerPass >= 8) {
    constexpr int kPasses = (Tile::kRows + kRowsPerPass - 1) / kRowsPerPass;
    const int r = tid / kCPR, chunk = tid % kCPR;
    // This thread's rows i * kRowsPerPass < rows_left are copied; a chunk past
    // col_end is past it in every row: one select folds it in (no rows).
    const int rows_left = (chunk * 8 < col_end ? row_end - row0 : 0) - r;
    const uint32_t dst = sbase + Tile::offset(uint32_t(r), uint32_t(chunk));
    const Elem* src = first + int64_t(r) * row_stride + chunk * 8;
    if (kUsed == kThreads || tid < kUsed) {
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        if (Tile::kRows % kRowsPerPass == 0 || r + i * kRowsPerPass < Tile::kRows) {
          const bool valid = enable && i * kRowsPerPass < rows_left;
          cp_async_16(dst + uint32_t(i * kRowsPerPass) * Tile::kRowBytes,
                      valid ? src + int64_t(i * kRowsPerPass) * row_stride : first, valid);
        }
      }
    }
  } else {
    constexpr int kTotal = Tile::kRows * kCPR;
    constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = i * kThreads + tid;
      if (kTotal % kThreads == 0 || idx < kTotal) {
        const int row = idx / kCPR, chunk = idx % kCPR;
        const bool valid = enable && row0 + row < row_end && chunk * 8 < col_end;
        const Elem* src = valid ? first + int64_t(row) * row_stride + chunk * 8 : first;
        cp_async_16(sbase + Tile::offset(uint32_t(row), uint32_t(chunk)), src, valid);
      }
    }
  }
}

// Shared -> global, 16 bytes per access: rows [0, Rows) of the tile to rows
// [row0, row0 + Rows) of the destination, skipping rows at or past row_end and
// 16-byte chunks at or past col_end (the true head dimension, a multiple of 8).
// The caller brackets it with barriers.
template <class Tile, int kThreads, typename Elem>
FLASHOP_SM80_DEV void store_tile(uint32_t sbase, Elem* gbase, int64_t row_stride, int row0, int row_end,
                                int col_end, int tid) {
  constexpr int kCPR = Tile::kChunksPerRow;
  constexpr int kTotal = Tile::kRows * kCPR;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * kThreads + tid;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int row = idx / kCPR, chunk = idx % kCPR;
      if (row0 + row < row_end && chunk * 8 < col_end) {
        const uint4 v = lds_u128(sbase + Tile::offset(uint32_t(row), uint32_t(chunk)));
        *reinterpret_cast<uint4*>(gbase + int64_t(row0 + row) * row_stride + chunk * 8) = v;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Lane bases of the fragment loads (ldmatrix.x4: lane l addresses row l%8 of
// matrix l/8). row_w is the warp's row (a multiple of 8), chunk_w the warp's
// chunk (even, bits disjoint from the compile-time chunks added by at()).
//
// "a" pattern: lane l -> row row_w + l%16, chunk chunk_w + l/16. Matrices:
// (rows 0-7, chunk 0), (rows 8-15, chunk 0), (rows 0-7, chunk 1), (rows 8-15,
// chunk 1). Plain: the A fragment a[0..3] of rows x k (tile [row][k]).
// .trans: b[0], b[1] = B fragment of n-tile chunk 0 (k = rows 0-15, tile
// [k][n]), b[2], b[3] = n-tile chunk 1.
template <class Tile>
FLASHOP_SM80_DEV uint32_t lane_base_a(uint32_t tile, int row_w, int chunk_w, int lane) {
  return tile + Tile::offset(uint32_t(row_w + (lane & 15)), uint32_t(chunk_w + (lane >> 4)));
}

// "b" pattern: lane l -> row row_w + 8*(l/16) + l%8, chunk chunk_w + (l/8)%2.
// Matrices: (rows 0-7, chunk 0), (rows 0-7, chunk 1), (rows 8-15, chunk 0),
// (rows 8-15, chunk 1). Plain: b[0], b[1] = B fragment (k = chunks 0-1) of
// n-tile rows 0-7 of a tile stored [n][k], b[2], b[3] = n-tile rows 8-15.
// .trans: the A fragment a[0..3] of the transpose of a tile stored [k][m]
// (m = the two chunks, k = the 16 rows): (m 0-7, k 0-7), (m 8-15, k 0-7),
// (m 0-7, k 8-15), (m 8-15, k 8-15).
template <class Tile>
FLASHOP_SM80_DEV uint32_t lane_base_b(uint32_t tile, int row_w, int chunk_w, int lane) {
  return tile + Tile::offset(uint32_t(row_w + ((lane >> 4) << 3) + (lane & 7)),
                             uint32_t(chunk_w + ((lane >> 3) & 1)));
}

// Lane base of the 32-bit stores of an m16n8 accumulator (row g / g+8,
// columns 2t, 2t+1): row row_w + g, chunk chunk_w, byte 4t of the chunk.
template <class Tile>
FLASHOP_SM80_DEV uint32_t lane_base_c(uint32_t tile, int row_w, int chunk_w, int lane) {
  return tile + Tile::offset(uint32_t(row_w + (lane >> 2)), uint32_t(chunk_w)) + uint32_t(lane & 3) * 4;
}

}  // namespace bwd
}  // namespace sm80
}  // namespace flashop

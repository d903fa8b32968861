// Small typed tiles for the mma.sync forward kernel (ThunderKittens spirit: a
// tile is a type with a handful of operations, the kernel composes them).
//
//   SmemTile<Rows, Cols, Swizzle>  where each element of a Rows x Cols 16-bit
//                                  tile lives in shared memory
//   load_tile_async                the cooperative cp.async global->shared copy
//   LdsmAddr, *_frag_addr          ldmatrix addressing for the three operand
//                                  roles of the kernel (A row-major, B from a
//                                  key-major tile, B^T from a key-major tile)
#pragma once

#include <cstdint>

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
template <int kRows_, int kCols_, bool kSwizzle_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr bool kSwizzle = kSwizzle_;
  static constexpr int kBlockCols = (kCols % 64 == 0) ? 64 : 32;  // W
  static constexpr int kChunksPerBlockRow = kBlockCols / 8;         // 8 or 4
  static constexpr int kColBlocks = kCols / kBlockCols;
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kElems = kRows * kCols;
  static constexpr uint32_t kBytes = uint32_t(kElems) * 2;

  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static_assert(kRows % 8 == 0, "tile height must be a multiple of 8 rows");

  __device__ __forceinline__ static int swizzle_bits(int row) {
    return kChunksPerBlockRow == 8 ? (row & 7) : ((row >> 1) & 3);
  }

  // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of `row`.
  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    const int blk = chunk / kChunksPerBlockRow;
    int c = chunk % kChunksPerBlockRow;
    if (kSwizzle) c ^= swizzle_bits(row);
    return uint32_t(((blk * kRows + row) * kBlockCols + c * 8) * 2);
  }
};

// ---------------------------------------------------------------------------
// Global -> shared: rows [row0, row0 + Rows) of a (seqlen, Cols) slice whose
// row r starts at gbase + r * row_stride. Rows at or past row_end (the
// sequence length) are zero-filled (cp.async with src-size 0); their source
// row is clamped to row_end - 1 so no out-of-range address is ever formed.
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
template <class Tile, int kThreads, typename Elem>
__device__ __forceinline__ void load_tile_async(uint32_t smem_base, const Elem* gbase,
                                                int64_t row_stride, int row0, int row_end,
                                                int tid) {
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
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (Tile::kRows % kRowsPerPass == 0 || pass * kRowsPerPass + r < Tile::kRows) {
      const bool valid = pass * kRowsPerPass < rows_left;
      // Out of range: read (nothing) from the last row of the sequence instead.
      const int row = min(pass * kRowsPerPass, rows_left - 1);
      const Elem* src = gtile + (thread_off + row * stride);
#pragma unroll
      for (int blk = 0; blk < Tile::kColBlocks; ++blk) {
        cp_async_16(dst + uint32_t((blk * Tile::kRows + pass * kRowsPerPass) * Tile::kBlockCols * 2),
                    src + blk * Tile::kBlockCols, valid);
      }
    }
  }
}

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

  __device__ __forceinline__ LdsmAddr(uint32_t tile, int lane_row, int lane_half)
      : base(tile + Tile::offset(lane_row, lane_half)) {}

  // Same lane pattern in a tile moved by `bytes` (a multiple of 128: a stage).
  __device__ __forceinline__ LdsmAddr shifted(uint32_t bytes) const {
    LdsmAddr a = *this;
    a.base += bytes;
    return a;
  }

  // Block whose top-left is (row0, 16 * cpair). row0: a multiple of 8.
  __device__ __forceinline__ uint32_t at(int row0, int cpair) const {
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
__device__ __forceinline__ LdsmAddr<Tile> a_frag_addr(uint32_t tile, int row_base, int lane) {
  return LdsmAddr<Tile>(tile, row_base + (lane & 15), lane >> 4);
}

// B operands of S = Q K^T for two n8 tiles (16 keys x 16 head dims of the
// key-major K tile). K[key][dim] is B[dim][key] stored "col", exactly what the
// non-transposed ldmatrix hands out. Matrices: 0 = keys 0-7 / dims 0-7,
// 1 = keys 0-7 / dims 8-15, 2 = keys 8-15 / dims 0-7, 3 = keys 8-15 / dims
// 8-15, so b[0], b[1] feed the first n8 tile and b[2], b[3] the second.
// Lane l: key 8 * (l / 16) + l % 8, dim half (l / 8) % 2.
template <class Tile>
__device__ __forceinline__ LdsmAddr<Tile> b_frag_addr(uint32_t tile, int lane) {
  return LdsmAddr<Tile>(tile, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
}

// B operands of O += P V for two n8 tiles (16 keys = the mma k dimension x 16
// head dims). V is stored key-major, so the fragment needs two vertically
// adjacent elements per register: ldmatrix .trans. Matrices: 0 = keys 0-7 /
// dims 0-7, 1 = keys 8-15 / dims 0-7, 2 = keys 0-7 / dims 8-15, 3 = keys 8-15 /
// dims 8-15: b[0], b[1] feed the first n8 tile, b[2], b[3] the second.
// Lane l: key l % 16, dim half l / 16.
template <class Tile>
__device__ __forceinline__ LdsmAddr<Tile> bt_frag_addr(uint32_t tile, int lane) {
  return LdsmAddr<Tile>(tile, lane & 15, lane >> 4);
}

}  // namespace sm80
}  // namespace flashop

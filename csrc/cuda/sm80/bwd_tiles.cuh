// Shared-memory tiles of the backward kernel and the four ways its warps read
// mma fragments out of them.
//
// Every tile holds 16-bit elements, Rows x Cols, logically row-major. The
// kernel keeps five of them: K, V (B_c x D, key-major), Q, dO (B_r x D,
// query-major) and dS^T (+ P^T) (B_c x B_r, key-major). Which operand of which
// product each one feeds, and therefore which ldmatrix form reads it:
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
#pragma once

#include <cstdint>

#include "bwd_ptx.cuh"

namespace flashop {
namespace sm80 {
namespace bwd {

// ---------------------------------------------------------------------------
// Layout. The tile is cut into column blocks of W elements (W = 64: 128-byte
// rows, when Cols % 64 == 0; else W = 32: 64-byte rows, for D = 32, 96). Each
// block is row-major and the blocks follow each other: [Cols/W][Rows][W].
// Tiles start 128-byte aligned.
//
// Swizzle. ldmatrix reads one 16-byte chunk from each of 8 consecutive rows
// (one 8x8 matrix per phase); unswizzled those 8 chunks sit 128 bytes apart,
// in the same 4 banks (8-way conflict). XOR the chunk index with row bits:
//   128-byte rows: chunk' = chunk ^ (row % 8)
//   64-byte rows:  chunk' = chunk ^ ((row / 2) % 4) (rows r, r+1 share a
//                  128-byte line, already in different halves of it)
// so the 8 rows land in 8 different 16-byte bank groups. The same holds for
// the kernel's 32-bit fragment stores (8 consecutive rows, one chunk each,
// 4 lanes per chunk) and for cp.async (8 consecutive lanes fill one row's
// 128 bytes, which the XOR only permutes).
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
template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kBlockCols = (kCols % 64 == 0) ? 64 : 32;
  static constexpr int kCPB = kBlockCols / 8;  // 16-byte chunks per block row: 8 or 4
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr uint32_t kRowBytes = uint32_t(kBlockCols) * 2;
  static constexpr uint32_t kBlockBytes = uint32_t(kRows) * kRowBytes;
  static constexpr uint32_t kBytes = uint32_t(kRows) * kCols * 2;

  static_assert(kCols % 32 == 0, "tile width must be a multiple of 32 elements");
  static_assert(kRows % 16 == 0, "tile height must be a multiple of 16 rows");

  FLASHOP_BWD_DEV static uint32_t swizzle(uint32_t row) {
    return kCPB == 8 ? (row & 7u) : ((row >> 1) & 3u);
  }

  // Byte offset of the 16-byte chunk holding columns [8*chunk, 8*chunk + 8) of `row`.
  FLASHOP_BWD_DEV static uint32_t offset(uint32_t row, uint32_t chunk) {
    const uint32_t blk = chunk / kCPB, c = (chunk % kCPB) ^ swizzle(row);
    return blk * kBlockBytes + row * kRowBytes + (c << 4);
  }

  // offset(r + row_c, c + chunk_c) from base = tile + offset(r, c); row_c a
  // multiple of 8, chunk_c with bits disjoint from c's (see above).
  FLASHOP_BWD_DEV static uint32_t at(uint32_t base, int row_c, int chunk_c) {
    return (base ^ ((uint32_t(chunk_c) % kCPB) << 4)) + (uint32_t(chunk_c) / kCPB) * kBlockBytes +
           uint32_t(row_c) * kRowBytes;
  }
};

// ---------------------------------------------------------------------------
// Global -> shared, asynchronously: rows [row0, row0 + Rows) of a sequence
// whose row r starts at gbase + r * row_stride (elements). Rows at or past
// row_end are zero-filled (their source address is clamped to row0, which
// is always inside the sequence). Consecutive threads take consecutive
// 16-byte chunks of a row: coalesced global reads, conflict-free writes.
// Issues the copies only; the caller commits and waits. enable = false turns
// every copy into a zero fill (no global read, no branch).
template <class Tile, int kThreads, typename Elem>
FLASHOP_BWD_DEV void load_tile_async(uint32_t sbase, const Elem* gbase, int64_t row_stride, int row0,
                                     int row_end, int tid, bool enable = true) {
  constexpr int kCPR = Tile::kChunksPerRow;
  constexpr int kTotal = Tile::kRows * kCPR;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
  const Elem* first = gbase + int64_t(row0) * row_stride;
  if constexpr (kThreads % kCPR == 0 && (kThreads / kCPR) % 8 == 0) {
    // Every pass moves whole groups of 8 rows: a thread keeps its chunk and
    // its swizzle, only the row advances.
    constexpr int kRowsPerPass = kThreads / kCPR;
    const int r = tid / kCPR, chunk = tid % kCPR;
    const uint32_t dst = sbase + Tile::offset(uint32_t(r), uint32_t(chunk));
    const Elem* src = first + int64_t(r) * row_stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (kTotal % kThreads == 0 || i * kThreads + tid < kTotal) {
        const bool valid = enable && row0 + r + i * kRowsPerPass < row_end;
        cp_async_16(dst + uint32_t(i * kRowsPerPass) * Tile::kRowBytes,
                    valid ? src + int64_t(i * kRowsPerPass) * row_stride : first, valid);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int idx = i * kThreads + tid;
      if (kTotal % kThreads == 0 || idx < kTotal) {
        const int row = idx / kCPR, chunk = idx % kCPR;
        const bool valid = enable && row0 + row < row_end;
        const Elem* src = valid ? first + int64_t(row) * row_stride + chunk * 8 : first;
        cp_async_16(sbase + Tile::offset(uint32_t(row), uint32_t(chunk)), src, valid);
      }
    }
  }
}

// Shared -> global, 16 bytes per access: rows [0, Rows) of the tile to rows
// [row0, row0 + Rows) of the destination, skipping rows at or past row_end.
// The caller brackets it with barriers.
template <class Tile, int kThreads, typename Elem>
FLASHOP_BWD_DEV void store_tile(uint32_t sbase, Elem* gbase, int64_t row_stride, int row0, int row_end,
                                int tid) {
  constexpr int kCPR = Tile::kChunksPerRow;
  constexpr int kTotal = Tile::kRows * kCPR;
  constexpr int kIters = (kTotal + kThreads - 1) / kThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * kThreads + tid;
    if (kTotal % kThreads == 0 || idx < kTotal) {
      const int row = idx / kCPR, chunk = idx % kCPR;
      if (row0 + row < row_end) {
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
FLASHOP_BWD_DEV uint32_t lane_base_a(uint32_t tile, int row_w, int chunk_w, int lane) {
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
FLASHOP_BWD_DEV uint32_t lane_base_b(uint32_t tile, int row_w, int chunk_w, int lane) {
  return tile + Tile::offset(uint32_t(row_w + ((lane >> 4) << 3) + (lane & 7)),
                             uint32_t(chunk_w + ((lane >> 3) & 1)));
}

// Lane base of the 32-bit stores of an m16n8 accumulator (row g / g+8,
// columns 2t, 2t+1): row row_w + g, chunk chunk_w, byte 4t of the chunk.
template <class Tile>
FLASHOP_BWD_DEV uint32_t lane_base_c(uint32_t tile, int row_w, int chunk_w, int lane) {
  return tile + Tile::offset(uint32_t(row_w + (lane >> 2)), uint32_t(chunk_w)) + uint32_t(lane & 3) * 4;
}

}  // namespace bwd
}  // namespace sm80
}  // namespace flashop

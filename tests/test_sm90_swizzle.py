"""CPU check of the Hopper forward kernel's shared-memory address arithmetic (csrc/cuda/sm90): the wgmma
descriptors of S = Q K^T (K-major Q and K) and O = P V (MN-major V) and the O staging stores of the TMA-store
epilogue, for both tile layouts (64-column blocks in the 128-byte swizzle; 32-column blocks in the 64-byte
swizzle, tile widths 96, 160 and 224), against two independent descriptions of the hardware:

- where a TMA load puts element (row, column) of a box, from the PTX ISA's table of swizzling modes (section
  "Swizzling Modes": 16-byte chunk c of 128-byte line L of the box lands at chunk c ^ (L % 8) with the
  128-byte swizzle, c ^ (L % 4) with the 64-byte one, the box starting on a 1024- / 512-byte boundary);
- which shared-memory byte a wgmma reads for element (m or n, k) of a descriptor, from the canonical layouts
  of CUTLASS's make_gmma_desc (cute/atom/mma_traits_sm90_gmma.hpp), in 16-byte units with W = 8 (128B) or
  4 (64B) and the swizzle Swizzle<log2 W, 4, 3> applied to the address:
    K-major:  ((8, m), 2) : ((W, SBO), 1)              element (i, k) of a k16 step
    MN-major: ((W, n), (8, k)) : ((1, LBO), (W, SBO))  element (n, k), 8 16-bit n per unit.

The formulas under test mirror fwd_traits.cuh (kColBlock, kRowBytes, kAtomBytes, block bytes), fwd_consumer.cuh
(issue_s_wgmma, issue_pv_wgmma), primitives.cuh (make_desc_sw, desc_advance) and fwd_epilogue.cuh
(store_o_tma). Pure Python: runs everywhere.
"""

import pytest

BASE = 1 << 16  # a 1024-byte aligned shared-memory address (the kernel aligns its tiles so)


# ---------------------------------------------------------------- the kernel's arithmetic (mirrored)

def geometry(width, block_m=128, block_n=128):
    col_block = 64 if width % 64 == 0 else 32
    row_bytes = 2 * col_block
    return dict(col_block=col_block, row_bytes=row_bytes, atom=8 * row_bytes, blocks=width // col_block,
                q_block=block_m * row_bytes, kv_block=block_n * row_bytes)


def make_desc_sw(row_bytes, addr, lbo, sbo):
    """primitives.cuh make_desc_sw<kRowBytes>."""
    d = (addr & 0x3FFFF) >> 4
    d |= ((lbo >> 4) & 0x3FFF) << 16
    d |= ((sbo >> 4) & 0x3FFF) << 32
    d |= (1 if row_bytes == 128 else 2) << 62
    return d


def desc_advance(desc, nbytes):
    """primitives.cuh desc_advance: a 32-bit add of bytes >> 4 to the low word."""
    lo = ((desc & 0xFFFFFFFF) + (nbytes >> 4)) & 0xFFFFFFFF
    return (desc & 0xFFFFFFFF00000000) | lo


def s_descs(g, width, q_rows, k_stage):
    """fwd_consumer.cuh issue_s_wgmma: (desc_a, desc_b) of each k16 step kk."""
    da0 = make_desc_sw(g["row_bytes"], q_rows, 16, g["atom"])
    db0 = make_desc_sw(g["row_bytes"], k_stage, 16, g["atom"])
    steps = g["col_block"] // 16
    out = []
    for kk in range(width // 16):
        b, t = kk // steps, kk % steps
        out.append((desc_advance(da0, b * g["q_block"] + t * 32), desc_advance(db0, b * g["kv_block"] + t * 32)))
    return out


def pv_descs(g, block_n, v_stage):
    """fwd_consumer.cuh issue_pv_wgmma: desc_b of each k16 step t."""
    db0 = make_desc_sw(g["row_bytes"], v_stage, g["kv_block"], g["atom"])
    return [desc_advance(db0, t * 2 * g["atom"]) for t in range(block_n // 16)]


def staging_addr(g, stage, warp, lane, h, i):
    """fwd_epilogue.cuh store_o_tma: the 4 bytes thread (warp, lane) writes for n8 block i, row half h."""
    chunks = g["col_block"] // 8
    rsw = lane // 4 if g["row_bytes"] == 128 else lane // 8
    r = 16 * warp + lane // 4 + 8 * h
    return stage + (i // chunks) * g["q_block"] + r * g["row_bytes"] + ((((i % chunks) ^ rsw) << 4) | (4 * (lane % 4)))


# ---------------------------------------------------------------- the hardware (independent descriptions)

def tma_byte(box_base, span, row, col):
    """PTX ISA swizzling-mode table: byte of element (row, col) (16-bit) of a box of `span`-byte rows."""
    linear = row * span + 2 * col
    line, chunk, within = linear // 128, (linear % 128) // 16, linear % 16
    assert box_base % (8 * span) == 0, "the table's pattern starts on a 1024 (128B) / 512 (64B) byte boundary"
    xor = line % 8 if span == 128 else line % 4
    return box_base + line * 128 + (chunk ^ xor) * 16 + within


def decode(desc):
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    mode = desc >> 62
    assert (desc >> 49) & 7 == 0, "base offset 0"
    return start, lbo, sbo, {1: 8, 2: 4}[mode]


def swizzle(addr, w):
    """CUTLASS Swizzle<log2 W, 4, 3> on a byte address: bits [4, 4 + log2 W) ^= bits [7, 7 + log2 W)."""
    bits = w.bit_length() - 1
    mask = (1 << bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def wgmma_k_major(desc, i, k):
    """Byte the wgmma reads for element (row i, k) of a K-major k16 operand."""
    start, _, sbo, w = decode(desc)
    unit = (i % 8) * w + (i // 8) * (sbo // 16) + k // 8
    return swizzle(start + unit * 16 + (k % 8) * 2, w)


def wgmma_mn_major(desc, n, k):
    """Byte the wgmma reads for element (n, k) of an MN-major k16 operand."""
    start, lbo, sbo, w = decode(desc)
    unit = (n // 8) % w + (n // (8 * w)) * (lbo // 16) + (k % 8) * w + (k // 8) * (sbo // 16)
    return swizzle(start + unit * 16 + (n % 8) * 2, w)


# ---------------------------------------------------------------- checks

# (tile width, B_c) of every layout the build uses, both swizzles.
SHAPES = [(64, 128), (128, 176), (192, 112), (256, 80), (96, 128), (160, 128), (224, 80)]


def tile_byte(g, base, block_rows, row, col):
    """Where the kernel's TMA loads put element (row, col) of a tile of column blocks of `block_rows` rows."""
    b = col // g["col_block"]
    return tma_byte(base + b * block_rows * g["row_bytes"], g["row_bytes"], row, col % g["col_block"])


@pytest.mark.parametrize("width,block_n", SHAPES)
def test_s_operands(width, block_n):
    g = geometry(width, 128, block_n)
    q_tile, k_stage = BASE, BASE + 4 * 65536 // 8
    for c in (0, 1):  # consumer warpgroup c reads Q rows 64c .. 64c + 63
        for kk, (da, db) in enumerate(s_descs(g, width, q_tile + c * 64 * g["row_bytes"], k_stage)):
            for i in range(64):
                for k in range(16):
                    assert wgmma_k_major(da, i, k) == tile_byte(g, q_tile, 128, 64 * c + i, 16 * kk + k)
            if c == 0:
                for n in range(block_n):
                    for k in range(16):
                        assert wgmma_k_major(db, n, k) == tile_byte(g, k_stage, block_n, n, 16 * kk + k)


@pytest.mark.parametrize("width,block_n", SHAPES)
def test_pv_operand(width, block_n):
    g = geometry(width, 128, block_n)
    v_stage = BASE + 8192
    for t, db in enumerate(pv_descs(g, block_n, v_stage)):
        for n in range(width):
            for k in range(16):
                assert wgmma_mn_major(db, n, k) == tile_byte(g, v_stage, block_n, 16 * t + k, n)


@pytest.mark.parametrize("width,block_n", SHAPES)
def test_o_staging(width, block_n):
    """Every thread's 4 bytes land where the TMA store reads columns 8i + 2(lane % 4) + {0, 1} of its row, and
    a warp's 32 stores of one n8 block hit 32 distinct banks."""
    g = geometry(width, 128, block_n)
    for c in (0, 1):
        stage = BASE + c * 64 * g["row_bytes"]  # rows 64c .. of the Q tile's column blocks
        for i in range(width // 8):
            for warp in range(4):
                banks = set()
                for lane in range(32):
                    for h in (0, 1):
                        a = staging_addr(g, stage, warp, lane, h, i)
                        r = 16 * warp + lane // 4 + 8 * h
                        col = 8 * i + 2 * (lane % 4)
                        assert a == tile_byte(g, BASE, 128, 64 * c + r, col)
                        assert a + 2 == tile_byte(g, BASE, 128, 64 * c + r, col + 1)
                        if h == 0:
                            banks.add((a // 4) % 32)
                assert len(banks) == 32


def test_swizzle_models_agree_with_the_table():
    """The 64-byte swizzle as the brief states it for 64-byte rows: chunk q of row r at q ^ ((r / 2) % 4)."""
    for r in range(16):
        for q in range(4):
            assert tma_byte(0, 64, r, 8 * q) == r * 64 + (q ^ ((r // 2) % 4)) * 16
            assert swizzle(r * 64 + q * 16, 4) == r * 64 + (q ^ ((r // 2) % 4)) * 16
        for q in range(8):
            assert tma_byte(0, 128, r, 8 * q) == r * 128 + (q ^ (r % 8)) * 16

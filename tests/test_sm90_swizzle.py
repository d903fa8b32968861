"""CPU check of the Hopper forward kernel's shared-memory address arithmetic (csrc/cuda/sm90): the wgmma
descriptors of S = Q K^T (K-major Q and K) and O = P V (MN-major V) and the O staging stores of the TMA-store
epilogue, for both tile layouts (64-column blocks in the 128-byte swizzle; 32-column blocks in the 64-byte
swizzle, tile widths 96, 160 and 224), against two independent descriptions of the hardware:

- where a TMA load puts element (row, column) of a box, from the PTX ISA's table of swizzling modes (section
  "Swizzling Modes": 16-byte chunk c of 128-byte line L of the box lands at chunk c ^ (L % 8) with the
  128-byte swizzle, c ^ (L % 4) with the 64-byte one, c ^ (L % 2) with the 32-byte one, the box starting on
  a 1024- / 512- / 256-byte boundary);
- which shared-memory byte a wgmma reads for element (m or n, k) of a descriptor, from the canonical layouts
  of CUTLASS's make_gmma_desc (cute/atom/mma_traits_sm90_gmma.hpp), in 16-byte units with W = 8 (128B),
  4 (64B) or 2 (32B) and the swizzle Swizzle<log2 W, 4, 3> applied to the address:
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


def make_desc_sw32(addr, lbo, sbo):
    """primitives.cuh make_desc_sw32."""
    d = (addr & 0x3FFFF) >> 4
    d |= ((lbo >> 4) & 0x3FFF) << 16
    d |= ((sbo >> 4) & 0x3FFF) << 32
    d |= 3 << 62
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
    assert box_base % (8 * span) == 0, "the table's pattern starts on a 1024 (128B) / 512 (64B) / 256 (32B) byte boundary"
    xor = line % (span // 16)  # 128B: line % 8, 64B: line % 4, 32B: line % 2
    return box_base + line * 128 + (chunk ^ xor) * 16 + within


def decode(desc):
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    mode = desc >> 62
    assert (desc >> 49) & 7 == 0, "base offset 0"
    return start, lbo, sbo, {1: 8, 2: 4, 3: 2}[mode]


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
    """The 64-byte swizzle as the brief states it for 64-byte rows: chunk q of row r at q ^ ((r / 2) % 4); the
    32-byte one for 32-byte rows (CUTLASS Layout_K_SW32_Atom, Swizzle<1,4,3>): q ^ ((r / 4) % 2)."""
    for r in range(16):
        for q in range(4):
            assert tma_byte(0, 64, r, 8 * q) == r * 64 + (q ^ ((r // 2) % 4)) * 16
            assert swizzle(r * 64 + q * 16, 4) == r * 64 + (q ^ ((r // 2) % 4)) * 16
        for q in range(2):
            assert tma_byte(0, 32, r, 8 * q) == r * 32 + (q ^ ((r // 4) % 2)) * 16
            assert swizzle(r * 32 + q * 16, 2) == r * 32 + (q ^ ((r // 4) % 2)) * 16
        for q in range(8):
            assert tma_byte(0, 128, r, 8 * q) == r * 128 + (q ^ (r % 8)) * 16


# ---------------------------------------------------------------- the backward kernel (csrc/cuda/sm90/bwd_kernel.cuh)
#
# Sm90BwdTraits: B_c = 128 keys per CTA (64 per consumer warpgroup c), B_r = 64 queries per step; Q, dO, V in
# the forward's column-block layouts (geometry above with block_m = 64), K in the same except at width 96
# (16-column blocks, 32-byte rows, 32B swizzle); dS as [query][key] in 64-key blocks of 128-byte rows (128B
# swizzle, written by stmatrix.trans) whatever the width. Mirrored: gemm_nt (S^T, dP^T), the dV / dK wgmma_rs,
# the dQ wgmma_ss of both forms (split keys at D = 64, split columns at 96 and 128), the dS stmatrix
# addresses and the fp32 dQ box stores (rows paired, bwd_dq_paired_row).

BWD_WIDTHS = (64, 96, 128)


def _configs():
    """flashop/configs.py by file path (importing the package needs the built extension)."""
    import importlib.util
    import os
    import sys
    name = "flashop_configs_by_path"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flashop", "configs.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
BWD_M, BWD_N = 64, 128


def bwd_traits(width):
    """Sm90BwdTraits' layout constants and offsets (bytes from the 1024-aligned base)."""
    g = geometry(width, BWD_M, BWD_N)
    kv_tile, q_tile, ds_block = g["blocks"] * g["kv_block"], g["blocks"] * g["q_block"], BWD_M * 128
    t = dict(g, kv_tile=kv_tile, q_tile=q_tile, ds_block=ds_block, split_keys=width == 64,
             dq_cols=width if width == 64 else width // 2)
    k_cols = 16 if width == 96 else g["col_block"]  # kKColBlock
    t["kg"] = dict(col_block=k_cols, row_bytes=2 * k_cols, atom=16 * k_cols, blocks=width // k_cols,
                   kv_block=BWD_N * 2 * k_cols)
    assert t["kg"]["blocks"] * t["kg"]["kv_block"] == kv_tile
    t["k"] = 0
    t["v"] = t["k"] + kv_tile
    t["q"] = t["v"] + kv_tile  # stage s at + s * q_tile
    t["do"] = t["q"] + 2 * q_tile
    t["ds"] = t["do"] + 2 * q_tile  # buffer u, key block c at + (2u + c) ds_block
    t["dq"] = t["ds"] + 4 * ds_block  # consumer c's fp32 dQ boxes at + c * BWD_M * dq_cols * 4 (not at D = 96)
    t["lse"] = t["dq"] + (0 if width == 96 else 2 * BWD_M * t["dq_cols"] * 4)
    t["dsum"] = t["lse"] + 2 * BWD_M * 4
    t["bar"] = t["dsum"] + 2 * BWD_M * 4
    t["smem"] = t["bar"] + 8 * 5 + 1024
    return t


def bwd_tile_desc(row_bytes, addr, lbo):
    """bwd_kernel.cuh bwd_tile_desc<kRowBytes>: make_desc_sw128 (= make_desc_sw<128>), make_desc_sw<64> or
    make_desc_sw32, SBO = one atom of 8 rows."""
    if row_bytes == 32:
        return make_desc_sw32(addr, lbo, 8 * row_bytes)
    return make_desc_sw(row_bytes, addr, lbo, 8 * row_bytes)


def bwd_nt_descs(t, width, s_a, s_b, c, a_is_k):
    """gemm_nt: (desc_a, desc_b) of each k16 step, moved from the product's first with desc_advance; A = rows
    64c.. of K (K's blocks) or V, B = Q or dO, both K-major."""
    steps = t["col_block"] // 16
    a = t["kg"] if a_is_k else t
    a_steps = a["col_block"] // 16
    desc_a = bwd_tile_desc(a["row_bytes"], s_a + 64 * c * a["row_bytes"], 16)
    desc_b = bwd_tile_desc(t["row_bytes"], s_b, 16)
    out = []
    for k in range(width // 16):
        aoff = (k // a_steps) * a["kv_block"] + (k % a_steps) * 32
        boff = (k // steps) * t["q_block"] + (k % steps) * 32
        out.append((desc_advance(desc_a, aoff), desc_advance(desc_b, boff)))
    return out


def bwd_dkv_desc(t, s_b, j):
    """dV += P^T dO, dK += dS^T Q: desc_b of k16 step j (queries 16j ..), MN-major, N = D."""
    return desc_advance(bwd_tile_desc(t["row_bytes"], s_b, t["q_block"]), j * 2 * t["atom"])


def bwd_dq_descs(t, s_ds, s_k, c):
    """The dQ wgmma_ss: (desc_a, desc_b) of each k16 step, and the first dQ column of consumer c's accumulator."""
    out = []
    kg = t["kg"]
    if t["split_keys"]:
        desc_ds = make_desc_sw(128, s_ds + c * t["ds_block"], 16, 1024)
        desc_k = make_desc_sw(128, s_k + 64 * c * 128, kg["kv_block"], 1024)
        for k in range(4):
            out.append((desc_advance(desc_ds, k * 32), desc_advance(desc_k, 16 * k * 128)))
        return out, 0
    desc_ds = make_desc_sw(128, s_ds, 16, 1024)
    desc_k = bwd_tile_desc(kg["row_bytes"], s_k + c * (t["dq_cols"] // kg["col_block"]) * kg["kv_block"], kg["kv_block"])
    for k in range(BWD_N // 16):
        out.append((desc_advance(desc_ds, (k // 4) * t["ds_block"] + (k % 4) * 32),
                    desc_advance(desc_k, k * 16 * kg["row_bytes"])))
    return out, t["dq_cols"] * c


def bwd_ds_store(t, s_ds, c, warp, lane, j):
    """The row address lane gives the stmatrix.x4.trans of k step j (consumer c's key block of dS)."""
    mi, r = lane // 8, lane % 8
    chunk = 2 * warp + mi % 2
    q = 16 * j + 8 * (mi // 2) + r
    return s_ds + c * t["ds_block"] + q * 128 + ((chunk ^ (q & 7)) << 4)


def ds_byte(t, s_ds, q, key):
    """Where the dS tile's element (query q, key 0..127 of the CTA) lives: a [query][key] tile of two 64-key
    blocks of 128-byte rows in the 128B swizzle (the layout of a TMA box of 64 columns)."""
    g128 = geometry(128, BWD_M, BWD_N)
    return tile_byte(g128, s_ds, BWD_M, q, key)


@pytest.mark.parametrize("width", BWD_WIDTHS)
def test_bwd_layout(width):
    """Every tile starts on a swizzle atom, the column blocks tile D exactly, and the byte count is
    HopperBackwardConfig.smem_bytes() (which the generated code static_asserts against kSmemBytes)."""
    t = bwd_traits(width)
    assert t["blocks"] * t["col_block"] == width
    assert t["col_block"] == (64 if width in (64, 128) else 32)
    for off in ("v", "q", "do"):
        assert t[off] % t["atom"] == 0
    assert t["kv_block"] % t["atom"] == 0 and t["q_block"] % t["atom"] == 0 and t["ds"] % 1024 == 0
    assert t["dq"] % 1024 == 0  # 128B-swizzled boxes
    assert t["kg"]["kv_block"] % t["kg"]["atom"] == 0
    if not t["split_keys"]:  # each consumer's dQ columns are whole K blocks
        assert t["dq_cols"] % t["kg"]["col_block"] == 0
    assert t["smem"] == _configs().HopperBackwardConfig("bf16", width).smem_bytes() <= 227 * 1024
    assert _configs().HopperBackwardConfig("fp16", width).name in [c.name for c in _configs().HOPPER_BACKWARD_CONFIGS]


@pytest.mark.parametrize("width", BWD_WIDTHS)
def test_bwd_st_dpt_operands(width):
    """S^T = K_c Q^T and dP^T = V_c dO^T: element (key 64c + i, column 16k + kk) of K (V) and (query n, same
    column) of Q (dO), as the TMA loads placed them."""
    t = bwd_traits(width)
    s_q = BASE + t["q"] + t["q_tile"]  # stage 1 of Q
    for a_is_k, s_a, g_a in ((True, BASE + t["k"], t["kg"]), (False, BASE + t["v"], t)):
        for c in (0, 1):
            for k, (da, db) in enumerate(bwd_nt_descs(t, width, s_a, s_q, c, a_is_k)):
                for kk in range(16):
                    col = 16 * k + kk
                    for i in range(64):
                        assert wgmma_k_major(da, i, kk) == tile_byte(g_a, s_a, BWD_N, 64 * c + i, col)
                    for n in range(BWD_M):
                        assert wgmma_k_major(db, n, kk) == tile_byte(t, s_q, BWD_M, n, col)


@pytest.mark.parametrize("width", BWD_WIDTHS)
def test_bwd_dv_dk_operand(width):
    """dV += P^T dO (dK += dS^T Q): B element (column n of D, query 16j + kk) of the dO (Q) stage."""
    t = bwd_traits(width)
    s_do = BASE + t["do"] + t["q_tile"]
    for j in range(BWD_M // 16):
        db = bwd_dkv_desc(t, s_do, j)
        for n in range(width):
            for kk in range(16):
                assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_do, BWD_M, 16 * j + kk, n)


@pytest.mark.parametrize("width", BWD_WIDTHS)
def test_bwd_dq_operands(width):
    """dQ = dS K: A element (query i, key) of dS as stmatrix wrote it, B element (dQ column, key) of K; split
    keys: consumer c's keys 64c .. 64c + 63, all D columns; split columns: all 128 keys, columns 64c .. 64c + 63."""
    t = bwd_traits(width)
    s_ds, s_k = BASE + t["ds"] + 2 * t["ds_block"], BASE + t["k"]  # dS buffer 1
    for c in (0, 1):
        descs, col0 = bwd_dq_descs(t, s_ds, s_k, c)
        assert len(descs) * 16 == (64 if t["split_keys"] else BWD_N)
        for k, (da, db) in enumerate(descs):
            for kk in range(16):
                key = (64 * c if t["split_keys"] else 0) + 16 * k + kk
                for i in range(BWD_M):
                    assert wgmma_k_major(da, i, kk) == ds_byte(t, s_ds, i, key)
                for n in range(t["dq_cols"]):
                    assert wgmma_mn_major(db, n, kk) == tile_byte(t["kg"], s_k, BWD_N, key, col0 + n)


def test_bwd_ds_stmatrix():
    """stmatrix.x4.trans of dS^T fragments: row r of matrix mi (k step j) is query 16j + 8(mi / 2) + r, keys
    16 warp + 8 (mi % 2) .. + 7 of consumer c's block, 16 contiguous bytes where ds_byte puts them."""
    t = bwd_traits(128)
    s_ds = BASE + t["ds"]
    for c in (0, 1):
        for warp in range(4):
            for j in range(BWD_M // 16):
                for lane in range(32):
                    mi, r = lane // 8, lane % 8
                    q, key0 = 16 * j + 8 * (mi // 2) + r, 64 * c + 16 * warp + 8 * (mi % 2)
                    a = bwd_ds_store(t, s_ds, c, warp, lane, j)
                    for e in range(8):
                        assert a + 2 * e == ds_byte(t, s_ds, q, key0 + e)



def bwd_dq_paired_row(r):
    """bwd_params.h bwd_dq_paired_row: the accumulator (and dQ box) row of query offset r."""
    return (r & ~15) | ((r & 7) << 1) | ((r >> 3) & 1)


def bwd_dq_box_store(t, c, warp, lane, i, h):
    """The st.shared.v2.f32 address of dQ fragment (n8 block i, row half h) of consumer c's thread (warp, lane)."""
    g, tq = lane // 4, lane % 4
    s_dq = BASE + t["dq"] + c * (t["dq_cols"] // 32) * BWD_M * 128 + (16 * warp + 2 * g) * 128 + (tq // 2) * 16 \
        + (tq % 2) * 8
    swz = 32 * (g & 3)
    addr = s_dq + (i // 4) * BWD_M * 128 + ((32 * (i % 4)) ^ swz)
    return addr if h == 0 else (addr ^ 16) + 128


@pytest.mark.parametrize("width", (64, 128))
def test_bwd_dq_box_stores(width):
    """dQ fragments into the fp32 boxes the TMA reduce-adds: element (query 16 warp + g + 8h, column 8i + 2t
    (+1)) of the fragment lands where a 128B-swizzled box of 32 columns (128-byte rows) holds it at row
    bwd_dq_paired_row(query), each box element once; a half-warp's 64-bit stores hit 32 different banks."""
    t = bwd_traits(width)
    assert sorted(bwd_dq_paired_row(r) for r in range(64)) == list(range(64))
    for c in (0, 1):
        boxes = BASE + t["dq"] + c * (t["dq_cols"] // 32) * BWD_M * 128
        seen = set()
        for warp in range(4):
            for i in range(t["dq_cols"] // 8):
                for h in (0, 1):
                    for half in (0, 1):
                        banks = set()
                        for lane in range(16 * half, 16 * half + 16):
                            g, tq = lane // 4, lane % 4
                            query, col = 16 * warp + g + 8 * h, 8 * i + 2 * tq
                            a = bwd_dq_box_store(t, c, warp, lane, i, h)
                            box = boxes + (col // 32) * BWD_M * 128
                            for e in (0, 1):
                                assert a + 4 * e == tma_byte(box, 128, bwd_dq_paired_row(query), 2 * ((col + e) % 32))  # 16-bit units
                                seen.add(a + 4 * e)
                                banks.add((a + 4 * e) // 4 % 32)
                        assert len(banks) == 32
        assert len(seen) == BWD_M * t["dq_cols"]

# ---------------------------------------------------------------- the wide backward (bwd_kernel_sm90_wide)
#
# Sm90BwdWideTraits: B_c = 64 keys per CTA, B_r = 64 queries per step; Q, dO, K, V in column blocks of
# 64 (128B swizzle, D = 256), 32 (64B, D = 192) or 16 (32B, D = 160, 224) columns, so that each consumer's
# half of D (its dK, dV, dQ columns) is whole blocks. Consumer c computes S^T, dP^T for all 64 keys x queries
# 32c .. 32c + 31 (m64n32), stores P and dS as [query][key] (one 64-key block of 128-byte rows, 128B
# swizzle) through stmatrix.trans; dV, dK read them MN-major (tnspA), dQ reads dS K-major. Mirrored:
# gemm_nt, store_t, the dV / dK / dQ wgmma_ss descriptors.

WIDE_WIDTHS = (160, 192, 224, 256)
WIDE_N = 64
# A 1024-aligned base low enough that the 226 KiB of D = 256 stay below 2^18 (the descriptor's 14-bit
# start field, address >> 4), as shared-memory addresses do.
WIDE_BASE = 1024


def wide_traits(width):
    """Sm90BwdWideTraits' layout constants and offsets (bytes from the 1024-aligned base)."""
    half = width // 2
    col_block = 64 if half % 64 == 0 else 32 if half % 32 == 0 else 16
    row_bytes = 2 * col_block
    t = dict(col_block=col_block, row_bytes=row_bytes, atom=8 * row_bytes, blocks=width // col_block,
             half=half, half_blocks=half // col_block, q_block=BWD_M * row_bytes, kv_block=WIDE_N * row_bytes,
             p_block=BWD_M * WIDE_N * 2)
    t["kv_tile"], t["q_tile"] = t["blocks"] * t["kv_block"], t["blocks"] * t["q_block"]
    t["k"] = 0
    t["v"] = t["k"] + t["kv_tile"]
    t["q"] = t["v"] + t["kv_tile"]
    t["do"] = t["q"] + 2 * t["q_tile"]
    t["p"] = t["do"] + 2 * t["q_tile"]  # buffer u at + u * p_block
    t["ds"] = t["p"] + 2 * t["p_block"]
    t["lse"] = t["ds"] + 2 * t["p_block"]
    t["dsum"] = t["lse"] + 2 * BWD_M * 4
    t["bar"] = t["dsum"] + 2 * BWD_M * 4
    t["smem"] = t["bar"] + 8 * 5 + 1024
    return t


def wide_nt_descs(t, width, desc_a, s_b, c):
    """gemm_nt: (desc_a, desc_b) of each k16 step, moved from the product's first with desc_advance; A = all 64
    rows of K or V (desc_a: K's descriptor, or K's moved to V, as the kernel builds V's), B = rows 32c .. of Q or
    dO."""
    steps = t["col_block"] // 16
    desc_b = bwd_tile_desc(t["row_bytes"], s_b + 32 * c * t["row_bytes"], 16)
    out = []
    for k in range(width // 16):
        koff = (k % steps) * 32
        out.append((desc_advance(desc_a, (k // steps) * t["kv_block"] + koff),
                    desc_advance(desc_b, (k // steps) * t["q_block"] + koff)))
    return out


def wide_store(s_buf, c, warp, lane, j):
    """store_t: the row address lane gives the stmatrix.x4.trans of k step j."""
    mi, r = lane // 8, lane % 8
    chunk = 2 * warp + mi % 2
    q = 32 * c + 16 * j + 8 * (mi // 2) + r
    return s_buf + q * 128 + ((chunk ^ (q & 7)) << 4)


def wide_score_byte(s_buf, q, key):
    """Element (query q, key) of a [query][key] P or dS buffer: 128-byte rows in the 128B swizzle."""
    return tma_byte(s_buf, 128, q, key)


def wide_dkv_descs(t, s_score, s_b, c, j):
    """dV += P^T dO[:, half c] (dK += dS^T Q[:, half c]), k16 step j: (desc_a MN-major, desc_b MN-major), each the
    step's first descriptor moved by desc_advance."""
    desc_a = make_desc_sw(128, s_score, t["p_block"], 1024)
    desc_b = bwd_tile_desc(t["row_bytes"], s_b + c * t["half_blocks"] * t["q_block"], t["q_block"])
    return desc_advance(desc_a, j * 2048), desc_advance(desc_b, j * 2 * t["atom"])


def wide_dq_descs(t, s_ds, s_k, c):
    """dQ[:, half c] = dS K[:, half c]: (desc_a K-major, desc_b MN-major) of each k16 step over the 64 keys."""
    desc_a = make_desc_sw(128, s_ds, 16, 1024)
    desc_b = bwd_tile_desc(t["row_bytes"], s_k + c * t["half_blocks"] * t["kv_block"], t["kv_block"])
    return [(desc_advance(desc_a, k * 32), desc_advance(desc_b, k * 16 * t["row_bytes"])) for k in range(WIDE_N // 16)]


@pytest.mark.parametrize("width", WIDE_WIDTHS)
def test_wide_layout(width):
    t = wide_traits(width)
    assert t["blocks"] * t["col_block"] == width and t["half_blocks"] * t["col_block"] == t["half"]
    assert t["half"] % 16 == 0
    for off in ("v", "q", "do"):
        assert t[off] % t["atom"] == 0
    assert t["p"] % 1024 == 0 and t["ds"] % 1024 == 0
    cfg = _configs().HopperBackwardConfig("bf16", width, block_n=64)
    assert cfg.wide and t["smem"] == cfg.smem_bytes() <= 227 * 1024
    names = [c.name for c in _configs().HOPPER_BACKWARD_CONFIGS]
    assert f"sm90.bwd.fp16.d{width}.br64.bc64" in names and f"sm90.bwd.bf16.d{width}.br64.bc64" in names


@pytest.mark.parametrize("width", WIDE_WIDTHS)
def test_wide_st_dpt_operands(width):
    """S^T = K Q_c^T, dP^T = V dO_c^T: A element (key i, column) of K (V), B element (query 32c + n, column) of
    Q (dO), as the TMA loads placed them."""
    t = wide_traits(width)
    s_q = WIDE_BASE + t["q"] + t["q_tile"]  # stage 1
    desc_k = bwd_tile_desc(t["row_bytes"], WIDE_BASE + t["k"], 16)
    for s_a, desc_a in ((WIDE_BASE + t["k"], desc_k), (WIDE_BASE + t["v"], desc_advance(desc_k, t["v"] - t["k"]))):
        for c in (0, 1):
            for k, (da, db) in enumerate(wide_nt_descs(t, width, desc_a, s_q, c)):
                for kk in range(16):
                    col = 16 * k + kk
                    if c == 0:
                        for i in range(64):
                            assert wgmma_k_major(da, i, kk) == tile_byte(t, s_a, WIDE_N, i, col)
                    for n in range(32):
                        assert wgmma_k_major(db, n, kk) == tile_byte(t, s_q, BWD_M, 32 * c + n, col)


def test_wide_score_stmatrix():
    """stmatrix.x4.trans of P^T / dS^T fragments: row r of matrix mi (k step j) is query 32c + 16j + 8(mi / 2) + r,
    keys 16 warp + 8 (mi % 2) .. + 7, 16 contiguous bytes where wide_score_byte puts them; the two consumers
    write disjoint rows."""
    s = WIDE_BASE + 8192
    seen = set()
    for c in (0, 1):
        for warp in range(4):
            for j in range(2):
                for lane in range(32):
                    mi, r = lane // 8, lane % 8
                    q, key0 = 32 * c + 16 * j + 8 * (mi // 2) + r, 16 * warp + 8 * (mi % 2)
                    a = wide_store(s, c, warp, lane, j)
                    for e in range(8):
                        assert a + 2 * e == wide_score_byte(s, q, key0 + e)
                    assert a not in seen
                    seen.add(a)
    assert len(seen) == 64 * 64 * 2 // 16  # the whole buffer, once


@pytest.mark.parametrize("width", WIDE_WIDTHS)
def test_wide_dv_dk_operands(width):
    """dV[:, half c] += P^T dO[:, half c]: A element (key m, query 16j + kk) of the P buffer (MN-major), B element
    (column half c + n, query 16j + kk) of the dO stage (MN-major)."""
    t = wide_traits(width)
    s_p, s_do = WIDE_BASE + t["p"] + t["p_block"], WIDE_BASE + t["do"] + t["q_tile"]
    for c in (0, 1):
        for j in range(BWD_M // 16):
            da, db = wide_dkv_descs(t, s_p, s_do, c, j)
            for kk in range(16):
                q = 16 * j + kk
                if c == 0:
                    for m in range(WIDE_N):
                        assert wgmma_mn_major(da, m, kk) == wide_score_byte(s_p, q, m)
                for n in range(t["half"]):
                    assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_do, BWD_M, q, t["half"] * c + n)


@pytest.mark.parametrize("width", WIDE_WIDTHS)
def test_wide_dq_operands(width):
    """dQ[:, half c] = dS K[:, half c]: A element (query i, key) of the dS buffer (K-major), B element (column
    half c + n, key) of K (MN-major)."""
    t = wide_traits(width)
    s_ds, s_k = WIDE_BASE + t["ds"] + t["p_block"], WIDE_BASE + t["k"]
    for c in (0, 1):
        for k, (da, db) in enumerate(wide_dq_descs(t, s_ds, s_k, c)):
            for kk in range(16):
                key = 16 * k + kk
                if c == 0:
                    for i in range(BWD_M):
                        assert wgmma_k_major(da, i, kk) == wide_score_byte(s_ds, i, key)
                for n in range(t["half"]):
                    assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_k, WIDE_N, key, t["half"] * c + n)


# The role split (Sm90BwdRoleSplit, ".rs"): the wide layout; consumer 0 computes S^T = K Q^T, consumer 1 dP^T = V dO^T,
# each m64n64 over all 64 keys and queries; dV += P^T dO and dK += dS^T Q take A from registers and B (dO or Q)
# MN-major over all D columns; dQ[:, half c] in chunks of 64 columns at D = 256 (the whole half elsewhere).

def roles_nt_descs(t, width, s_a, s_b):
    """S^T or dP^T: (desc_a, desc_b) of each k16 step, both K-major, all 64 rows of each."""
    steps = t["col_block"] // 16
    desc_a, desc_b = bwd_tile_desc(t["row_bytes"], s_a, 16), bwd_tile_desc(t["row_bytes"], s_b, 16)
    return [(desc_advance(desc_a, (k // steps) * t["kv_block"] + (k % steps) * 32),
             desc_advance(desc_b, (k // steps) * t["q_block"] + (k % steps) * 32)) for k in range(width // 16)]


def roles_dq_chunks(t, s_ds, s_k, c):
    """dQ[:, half c] chunks: (first column, [(desc_a, desc_b) of each k16 step over the 64 keys])."""
    chunk = 64 if t["half"] % 64 == 0 else t["half"]
    desc_a = make_desc_sw(128, s_ds, 16, 1024)
    out = []
    for h in range(t["half"] // chunk):
        col0 = t["half"] * c + chunk * h
        desc_b = bwd_tile_desc(t["row_bytes"], s_k + (col0 // t["col_block"]) * t["kv_block"], t["kv_block"])
        out.append((col0, chunk, [(desc_advance(desc_a, k * 32), desc_advance(desc_b, k * 16 * t["row_bytes"]))
                                  for k in range(WIDE_N // 16)]))
    return out


@pytest.mark.parametrize("width", WIDE_WIDTHS)
def test_roles_operands(width):
    """S^T / dP^T: A element (key i, column) of K or V, B element (query n, column) of Q or dO; dV / dK: B element
    (column n, query 16j + kk) of dO or Q, MN-major over all D columns; dQ chunks: B element (column, key) of K,
    the chunks of both consumers covering each column once."""
    t = wide_traits(width)
    s_q = WIDE_BASE + t["q"] + t["q_tile"]
    for s_a in (WIDE_BASE + t["k"], WIDE_BASE + t["v"]):
        for k, (da, db) in enumerate(roles_nt_descs(t, width, s_a, s_q)):
            for kk in range(16):
                col = 16 * k + kk
                for i in range(64):
                    assert wgmma_k_major(da, i, kk) == tile_byte(t, s_a, WIDE_N, i, col)
                    assert wgmma_k_major(db, i, kk) == tile_byte(t, s_q, BWD_M, i, col)
    desc_rs = bwd_tile_desc(t["row_bytes"], s_q, t["q_block"])
    for j in range(BWD_M // 16):
        db = desc_advance(desc_rs, j * 2 * t["atom"])
        for kk in range(16):
            for n in range(0, width, 7):
                assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_q, BWD_M, 16 * j + kk, n)
    s_ds, s_k = WIDE_BASE + t["ds"] + t["p_block"], WIDE_BASE + t["k"]
    columns = []
    for c in (0, 1):
        for col0, chunk, descs in roles_dq_chunks(t, s_ds, s_k, c):
            assert chunk % t["col_block"] == 0 and chunk in (64, t["half"])
            columns += range(col0, col0 + chunk)
            for k, (da, db) in enumerate(descs):
                for kk in range(16):
                    for i in range(0, BWD_M, 5):
                        assert wgmma_k_major(da, i, kk) == wide_score_byte(s_ds, i, 16 * k + kk)
                    for n in range(chunk):
                        assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_k, WIDE_N, 16 * k + kk, col0 + n)
    assert sorted(columns) == list(range(width))


# B_c = 96 at D = 192 (Sm90BwdWideTraits<kBf16, 192, 96>, bwd_kernel_sm90_wide_keys): the consumers split the
# keys (48 each); P and dS are [query][key] blocks of 16 keys (32-byte rows, 32B swizzle); dV^T, dK^T take D
# as M (A = dO, Q MN-major), dQ as in the 64-key kernel over 96 keys.
KEYS_N, KEYS_NK, KEYS_S_BLOCK = 96, 48, BWD_M * 16 * 2


def keys_traits():
    t = wide_traits(192)
    t["kv_block"] = KEYS_N * t["row_bytes"]
    t["p_block"] = BWD_M * KEYS_N * 2
    t["kv_tile"] = t["blocks"] * t["kv_block"]
    t["v"] = t["k"] + t["kv_tile"]
    t["q"] = t["v"] + t["kv_tile"]
    t["do"] = t["q"] + 2 * t["q_tile"]
    t["p"] = t["do"] + 2 * t["q_tile"]
    t["ds"] = t["p"] + 2 * t["p_block"]
    t["lse"] = t["ds"] + 2 * t["p_block"]
    t["bar"] = t["lse"] + 4 * BWD_M * 4
    t["smem"] = t["bar"] + 8 * 5 + 1024
    return t


def keys_score_byte(s_buf, q, key):
    """Element (query q, key) of a P or dS buffer: 16-key blocks of 32-byte rows in the 32B swizzle."""
    return tma_byte(s_buf + (key // 16) * KEYS_S_BLOCK, 32, q, key % 16)


def keys_store(s_buf, c, warp, lane, j):
    """store: the row address lane gives the stmatrix.x4 (not transposed) of 16-key block j of consumer c."""
    mi, r = lane // 8, lane % 8
    q = 16 * warp + 8 * (mi % 2) + r
    return s_buf + c * 3 * KEYS_S_BLOCK + j * KEYS_S_BLOCK + q * 32 + (((mi // 2) ^ ((q >> 2) & 1)) << 4)


def test_keys_layout():
    t = keys_traits()
    for off in ("v", "q", "do"):
        assert t[off] % t["atom"] == 0
    assert t["kv_block"] % t["atom"] == 0 and t["p"] % 1024 == 0 and t["ds"] % 1024 == 0
    cfg = _configs().HopperBackwardConfig("bf16", 192, block_n=96)
    assert cfg.wide and not cfg.supports_variants and t["smem"] == cfg.smem_bytes() <= 227 * 1024
    names = [c.name for c in _configs().HOPPER_BACKWARD_CONFIGS]
    for dtype in ("bf16", "fp16"):
        assert names.index(f"sm90.bwd.{dtype}.d192.br64.bc96") < names.index(f"sm90.bwd.{dtype}.d192.br64.bc64")


def test_keys_s_dp_operands():
    """S = Q K_c^T, dP = dO V_c^T: A element (query i, column) of Q (dO), B element (key 48c + n, column) of K (V)."""
    t = keys_traits()
    s_q = WIDE_BASE + t["q"] + t["q_tile"]  # stage 1
    steps = t["col_block"] // 16
    for s_b in (WIDE_BASE + t["k"], WIDE_BASE + t["v"]):
        for c in (0, 1):
            for k in range(192 // 16):
                koff = (k % steps) * 32
                da = bwd_tile_desc(t["row_bytes"], s_q + (k // steps) * t["q_block"] + koff, 16)
                db = bwd_tile_desc(t["row_bytes"], s_b + (k // steps) * t["kv_block"] + KEYS_NK * c * t["row_bytes"]
                                   + koff, 16)
                for kk in range(16):
                    col = 16 * k + kk
                    if c == 0 and s_b == WIDE_BASE + t["k"]:
                        for i in range(BWD_M):
                            assert wgmma_k_major(da, i, kk) == tile_byte(t, s_q, BWD_M, i, col)
                    for n in range(KEYS_NK):
                        assert wgmma_k_major(db, n, kk) == tile_byte(t, s_b, KEYS_N, KEYS_NK * c + n, col)


def test_keys_score_stmatrix():
    """stmatrix.x4 of P / dS fragments: row r of matrix mi (16-key block j of consumer c) is query
    16 warp + 8 (mi % 2) + r, keys 48c + 16j + 8 (mi / 2) .. + 7, 16 contiguous bytes where keys_score_byte
    puts them; together the whole buffer, once."""
    s = WIDE_BASE + 8192
    seen = set()
    for c in (0, 1):
        for warp in range(4):
            for j in range(3):
                for lane in range(32):
                    mi, r = lane // 8, lane % 8
                    q, key0 = 16 * warp + 8 * (mi % 2) + r, KEYS_NK * c + 16 * j + 8 * (mi // 2)
                    a = keys_store(s, c, warp, lane, j)
                    for e in range(8):
                        assert a + 2 * e == keys_score_byte(s, q, key0 + e)
                    assert a not in seen
                    seen.add(a)
    assert len(seen) == BWD_M * KEYS_N * 2 // 16


def test_keys_dv_dk_operands():
    """dV^T[64r .., keys of c] += dO^T P_c: A element (column 64r + m, query 16j + kk) of the dO stage (MN-major),
    B element (key 48c + n, query 16j + kk) of the P buffer (MN-major)."""
    t = keys_traits()
    s_p, s_do = WIDE_BASE + t["p"] + t["p_block"], WIDE_BASE + t["do"] + t["q_tile"]
    for c in (0, 1):
        for r in range(3):
            for j in range(BWD_M // 16):
                da = bwd_tile_desc(t["row_bytes"], s_do + 2 * r * t["q_block"] + j * 2 * t["atom"], t["q_block"])
                db = make_desc_sw32(s_p + c * 3 * KEYS_S_BLOCK + j * 512, KEYS_S_BLOCK, 256)
                for kk in range(16):
                    q = 16 * j + kk
                    for m in range(64):
                        assert wgmma_mn_major(da, m, kk) == tile_byte(t, s_do, BWD_M, q, 64 * r + m)
                    for n in range(KEYS_NK):
                        assert wgmma_mn_major(db, n, kk) == keys_score_byte(s_p, q, KEYS_NK * c + n)


def test_keys_dq_operands():
    """dQ[:, half c] = dS K[:, half c]: A element (query i, key 16k + kk) of the dS buffer (K-major), B element
    (column 96c + n, key) of K (MN-major)."""
    t = keys_traits()
    s_ds, s_k = WIDE_BASE + t["ds"] + t["p_block"], WIDE_BASE + t["k"]
    for c in (0, 1):
        for k in range(KEYS_N // 16):
            da = make_desc_sw32(s_ds + k * KEYS_S_BLOCK, 16, 256)
            db = bwd_tile_desc(t["row_bytes"], s_k + c * t["half_blocks"] * t["kv_block"] + k * 16 * t["row_bytes"],
                               t["kv_block"])
            for kk in range(16):
                key = 16 * k + kk
                for i in range(BWD_M):
                    assert wgmma_k_major(da, i, kk) == keys_score_byte(s_ds, i, key)
                for n in range(t["half"]):
                    assert wgmma_mn_major(db, n, kk) == tile_byte(t, s_k, KEYS_N, key, t["half"] * c + n)


def test_keys_epilogue_stmatrix():
    """write_out: stmatrix.x4.trans of the dK^T / dV^T accumulators (rows: columns of D, n8 blocks of keys) into
    [key][column] rows of 2D + 16 bytes: row lane % 8 of matrix mi (m64 tile r, 16-key step j) is key
    16j + 8 (mi / 2) + lane % 8, columns 64r + 16 warp + 8 (mi % 2) .. +7 (the fragment's rows g of n8 block
    2j + mi / 2, row half mi % 2); a consumer's 48 x 192 elements once each, an stmatrix's eight rows of a
    matrix in distinct 16-byte bank groups."""
    row = 2 * 192 + 16
    seen = set()
    for warp in range(4):
        for r in range(3):
            for j in range(3):
                for lane in range(32):
                    mi = lane // 8
                    key, col = 16 * j + 8 * (mi // 2) + lane % 8, 64 * r + 16 * warp + 8 * (mi % 2)
                    for e in range(8):
                        assert (key, col + e) not in seen
                        seen.add((key, col + e))
                for mi in range(4):
                    groups = {((16 * j + 8 * (mi // 2) + x) * row + (64 * r + 16 * warp + 8 * (mi % 2)) * 2) // 16 % 8
                              for x in range(8)}
                    assert len(groups) == 8
    assert seen == {(k, c) for k in range(48) for c in range(192)}
    assert 48 * row <= BWD_M * 192 * 2  # one Q (dO) stage


# ---------------------------------------------------------------- the backward's longest-first order (".lpt")
#
# csrc/cuda/sm90/bwd_lpt.h: bwd_lpt_block maps the dispatch index of a causal problem's CTA to its (key tile,
# kv head, batch), key-tile major within groups of (batch, kv head) pairs; bwd_lpt_pairs sizes the groups as
# the mma.sync order's bwd_lpt_group_pairs (bwd_config.h) does. The kernel only permutes which CTA computes
# which triple, so it is correct if the map is a bijection. Checked on a Python mirror, and on the header
# itself compiled by the host compiler (needs g++).

LPT_WIDTHS = (128, 160, 192, 224, 256)


def lpt_block(index, n_tiles, heads_k, batch, group_pairs):
    """bwd_lpt_block."""
    pairs = heads_k * batch
    first = index // n_tiles // group_pairs * group_pairs
    in_group = min(pairs - first, group_pairs)
    within = index - first * n_tiles
    pair = first + within % in_group
    return within // in_group, pair % heads_k, pair // heads_k


def lpt_cases():
    for n_tiles in (1, 2, 3, 5, 8, 17):
        for heads_k in (1, 2, 3, 7):
            for batch in (1, 2, 5):
                for group_pairs in sorted({1, 2, 3, 4, 5, 7, heads_k * batch, heads_k * batch + 3}):
                    yield n_tiles, heads_k, batch, group_pairs


def test_bwd_lpt_order_is_a_bijection_key_tile_major_per_group():
    for n_tiles, heads_k, batch, g in lpt_cases():
        order = [lpt_block(i, n_tiles, heads_k, batch, g) for i in range(n_tiles * heads_k * batch)]
        assert sorted(order) == [(n, h, b) for n in range(n_tiles) for h in range(heads_k) for b in range(batch)]
        pairs = [b * heads_k + h for _, h, b in order]
        for i in range(1, len(order)):
            group, prev_group = pairs[i] // g, pairs[i - 1] // g
            assert group >= prev_group  # groups in order
            if group == prev_group:  # key-tile major within a group, pairs ascending within a key tile
                assert (order[i][0], pairs[i]) > (order[i - 1][0], pairs[i - 1])
        if g == 1:  # one pair per group: the plain order (blockIdx.x fastest)
            assert order == [(n, h, b) for b in range(batch) for h in range(heads_k) for n in range(n_tiles)]


def test_bwd_lpt_configs_listed_after_the_plain_ones():
    """Every width of LPT_WIDTHS has its ".lpt" build in both dtypes, named sm90.bwd.<dtype>.d<W>.br64.bc<B_c>.lpt,
    after every plain build (the policy's default is the first listed), with the plain build's shared memory."""
    cfg = _configs()
    names = [c.name for c in cfg.HOPPER_BACKWARD_CONFIGS]
    first_lpt = min(i for i, c in enumerate(cfg.HOPPER_BACKWARD_CONFIGS) if c.longest_first)
    assert not any(c.longest_first for c in cfg.HOPPER_BACKWARD_CONFIGS[:first_lpt])
    assert all(c.longest_first for c in cfg.HOPPER_BACKWARD_CONFIGS[first_lpt:])
    for width in LPT_WIDTHS:
        bc = 64 if width in cfg.HOPPER_BACKWARD_WIDE_WIDTHS else 128
        for dtype in ("bf16", "fp16"):
            name = f"sm90.bwd.{dtype}.d{width}.br64.bc{bc}.lpt"
            assert name in names
            c = cfg.HopperBackwardConfig.parse(name)
            assert c.longest_first and c.name == name and cfg.parse_name(name) == c
            plain = cfg.HopperBackwardConfig.parse(name[: -len(".lpt")])
            assert not plain.longest_first and plain.smem_bytes() == c.smem_bytes() and plain.name in names
    for bad in ("sm90.bwd.bf16.d128.br64.bc128.lpt.lpt", "sm90.bwd.bf16.d128.br64.bc128.pers",
                "sm90.bwd.bf16.d128.br64.lpt.bc128", "sm90.bwd.bf16.d192.br64.bc128.lpt"):
        with pytest.raises(ValueError):
            cfg.HopperBackwardConfig.parse(bad)


def run_host_check(tmp_path, name, source):
    """Compiles the C++ program `source` with g++ (include path csrc/cuda) and runs it; it passes by exiting 0 with
    output starting "OK"."""
    import os
    import shutil
    import subprocess
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src, binary = tmp_path / f"{name}.cpp", str(tmp_path / name)
    src.write_text(source)
    result = subprocess.run(["g++", "-std=c++17", "-O2", f"-I{os.path.join(root, 'csrc', 'cuda')}", str(src), "-o",
                             binary], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    result = subprocess.run([binary], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stdout[-2000:]


_LPT_HOST_CHECK = r"""
#include <cstdio>
#include <vector>
#include "sm90/bwd_lpt.h"
using namespace flashop;
using namespace flashop::sm90;

template <class I>
static bool check_order(int n_tiles, int heads_k, int batch, int group_pairs) {
  const int total = n_tiles * heads_k * batch;
  std::vector<int> seen(total, 0);
  for (int i = 0; i < total; ++i) {
    const BwdBlock blk = bwd_lpt_block<I>(I(i), I(n_tiles), I(heads_k), I(batch), I(group_pairs));
    if (blk.n_block < 0 || blk.n_block >= n_tiles || blk.hk < 0 || blk.hk >= heads_k || blk.b < 0 || blk.b >= batch)
      return false;
    const int slot = (blk.b * heads_k + blk.hk) * n_tiles + blk.n_block;
    if (seen[slot]++) return false;  // two indices on one triple
    // The plain order when a group is one pair.
    if (group_pairs == 1 && slot != i) return false;
  }
  return true;
}

int main() {
  long cases = 0;
  for (int n_tiles = 1; n_tiles <= 40; ++n_tiles)
    for (int heads_k = 1; heads_k <= 9; ++heads_k)
      for (int batch = 1; batch <= 6; ++batch)
        for (int g = 1; g <= heads_k * batch + 2; ++g) {
          if (!check_order<uint32_t>(n_tiles, heads_k, batch, g) || !check_order<int64_t>(n_tiles, heads_k, batch, g)) {
            std::printf("FAIL order n_tiles=%d heads_k=%d batch=%d group_pairs=%d\n", n_tiles, heads_k, batch, g);
            return 1;
          }
          ++cases;
        }
  // The group size equals the mma.sync order's policy (bwd_config.h) while l2_bytes * 3 / 8 < 2^32.
  const int sms[] = {1, 7, 78, 108, 114, 132, 148, 170};
  const int64_t l2s[] = {0, 1 << 20, 40 << 20, 50 << 20, 60 << 20, 126 << 20, int64_t(4) << 30,
                         (int64_t(1) << 35) / 3 - 1};
  const int widths[] = {64, 96, 128, 160, 192, 224, 256};
  for (int sm : sms)
    for (int64_t l2 : l2s)
      for (int n_tiles = 1; n_tiles <= 1100; n_tiles += (n_tiles < 40 ? 1 : 37))
        for (int sq = 128; sq <= (1 << 20); sq *= 2)
          for (int w : widths)
            for (int ratio : {1, 2, 4, 8, 16}) {
              const int64_t want = bwd_lpt_group_pairs(sm, n_tiles, l2, int64_t(sq) * w * ratio * 8);
              const uint32_t got = bwd_lpt_pairs(sm, uint32_t(n_tiles), l2, sq, w, ratio);
              if (int64_t(got) != want || got < 1) {
                std::printf("FAIL pairs sm=%d l2=%lld n_tiles=%d sq=%d w=%d ratio=%d: %u vs %lld\n", sm, (long long)l2,
                            n_tiles, sq, w, ratio, got, (long long)want);
                return 1;
              }
            }
  std::printf("OK %ld orders\n", cases);
  return 0;
}
"""


def test_bwd_lpt_header_on_the_host(tmp_path):
    """csrc/cuda/sm90/bwd_lpt.h compiled by g++: bwd_lpt_block a bijection (uint32_t, as the kernel runs it,
    and int64_t) for every n_tiles <= 40, heads_k <= 9, batch <= 6, group size 1 .. pairs + 2, the plain order
    at group size 1; bwd_lpt_pairs equal to bwd_lpt_group_pairs over device, L2 and problem sizes."""
    run_host_check(tmp_path, "lpt_check", _LPT_HOST_CHECK)


# ---------------------------------------------------------------- the backward's tail split
# csrc/cuda/sm90/bwd_tail.h: a dense non-causal problem whose last wave of blocks is at most half full runs those
# blocks as pieces over runs of their query steps, at the end of a 1-D grid.

_TAIL_HOST_CHECK = r"""
#include <cstdio>
#include <vector>
#include "sm90/bwd_tail.h"
using namespace flashop;
using namespace flashop::sm90;

// Every (block, step) of the problem computed by exactly one CTA of the grid, pieces on quanta, the split made
// exactly when the last wave is at most half full after a full one.
static bool check(int n_tiles, int heads_k, int batch, int wave, int steps) {
  const long blocks = long(n_tiles) * heads_k * batch;
  const BwdTailSplit split = bwd_tail_split(blocks, wave, steps);
  const long rest = blocks % wave;
  const bool want = blocks > wave && rest > 0 && 2 * rest <= wave && steps >= kBwdTailMinSteps;
  if ((split.pieces > 0) != want) return false;
  if (split.pieces == 0) return split.first_block == 0 && split.blocks == 0;
  if (split.first_block != blocks - rest || split.blocks != rest || split.pieces < 2 ||
      long(split.pieces) * rest > wave || split.pieces > (steps + kBwdTailQuantum - 1) / kBwdTailQuantum)
    return false;
  std::vector<int> seen(blocks * steps, 0);
  const long grid = split.first_block + long(split.blocks) * split.pieces;
  for (long cta = 0; cta < grid; ++cta) {
    const BwdTailWork w = bwd_tail_work<uint32_t>(uint32_t(cta), split, uint32_t(n_tiles), uint32_t(heads_k));
    const BwdBlock b = w.block;
    if (b.n_block < 0 || b.n_block >= n_tiles || b.hk < 0 || b.hk >= heads_k || b.b < 0 || b.b >= batch) return false;
    const long slot = (long(b.b) * heads_k + b.hk) * n_tiles + b.n_block;
    int begin = 0, end = steps;
    if (w.unit >= 0) {
      if (w.unit != (cta - split.first_block) / split.pieces || slot != split.first_block + w.unit) return false;
      bwd_tail_steps(steps, split.pieces, w.piece, begin, end);
      if (begin % kBwdTailQuantum != 0 || begin >= end || end > steps) return false;
    } else if (slot != cta) {
      return false;
    }
    for (int s = begin; s < end; ++s)
      if (seen[slot * steps + s]++) return false;
  }
  for (int v : seen)
    if (v != 1) return false;
  return true;
}

int main() {
  long cases = 0, splits = 0;
  const int waves[] = {2, 3, 5, 8, 66, 132, 264};
  for (int wave : waves)
    for (int n_tiles = 1; n_tiles <= 9; ++n_tiles)
      for (int heads_k = 1; heads_k <= 70; heads_k += (heads_k < 12 ? 1 : 7))
        for (int batch = 1; batch <= 5; ++batch)
          for (int steps = 1; steps <= 300; steps += (steps < 56 ? 5 : steps < 80 ? 1 : 23)) {
            if (!check(n_tiles, heads_k, batch, wave, steps)) {
              std::printf("FAIL n_tiles=%d heads_k=%d batch=%d wave=%d steps=%d\n", n_tiles, heads_k, batch, wave,
                          steps);
              return 1;
            }
            ++cases;
            splits += bwd_tail_split(long(n_tiles) * heads_k * batch, wave, steps).pieces > 0;
          }
  // No split whose grid or step arithmetic would leave int.
  if (bwd_tail_split(int64_t(1) << 40, 132, 1000).pieces != 0 || bwd_tail_split(133, 132, 0x7fffffff).pieces != 0)
    return 1;
  std::printf("OK %ld cases, %ld split\n", cases, splits);
  return splits > 0 ? 0 : 1;
}
"""


def test_bwd_tail_split_header_on_the_host(tmp_path):
    """csrc/cuda/sm90/bwd_tail.h compiled by g++: over problems of up to 9 key tiles, 70 kv heads, 5 batch entries
    and 300 steps on waves of 2 .. 264 CTAs, the split is made exactly when the last wave is at most half full after
    a full one, and its grid computes every (block, query step) exactly once, pieces starting on whole quanta."""
    run_host_check(tmp_path, "tail_check", _TAIL_HOST_CHECK)

#!/usr/bin/env python3
"""Exhaustive CPU checks of the sm80 forward kernel's index math.

Re-implements, line for line, the address and index formulas of
csrc/cuda/sm80/tiles.cuh and fwd_kernel.cuh and checks, for every built
config (or all shapes the kernel accepts):

  * the swizzled shared-memory layout is a bijection onto the tile;
  * the cp.async copy covers every 16-byte chunk exactly once and each
    quarter-warp's writes fill 8 distinct bank groups (conflict-free);
  * every ldmatrix.x4 (Q as A, K as B, V as B^T) reads, through LdsmAddr's
    XOR-and-add addressing, exactly the chunk the mma fragment layout needs,
    and each of its four 8-row phases touches 8 distinct bank groups;
  * the epilogue's 4-byte fragment stores and 16-byte reads are conflict-free
    and read back what was written;
  * the mma fragment bookkeeping (C fragment -> A fragment of P, ldmatrix
    matrices -> b registers) computes S = Q K^T and O = P V exactly, on
    random integer matrices, with a bit-level model of ldmatrix and mma;
  * the key-tile range, the "needs a mask" split and the per-element mask
    reproduce causal bottom-right visibility for many (Sq, Sk, B_r, B_c);
  * the head-ratio multiply-high division is exact.

Run: python tools/check_sm80_layouts.py   (a few seconds; exits non-zero on failure)
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_configs():
    spec = importlib.util.spec_from_file_location(
        "_flashop_configs_check", os.path.join(ROOT, "flashop", "configs.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- tiles.cuh
class SmemTile:
    def __init__(self, rows, cols, swizzle=True):
        self.rows, self.cols, self.swizzle = rows, cols, swizzle
        self.block_cols = 64 if cols % 64 == 0 else 32
        self.cpb = self.block_cols // 8
        self.col_blocks = cols // self.block_cols
        self.bytes = rows * cols * 2

    def swizzle_bits(self, row):
        return (row & 7) if self.cpb == 8 else ((row >> 1) & 3)

    def offset(self, row, chunk):
        blk, c = chunk // self.cpb, chunk % self.cpb
        if self.swizzle:
            c ^= self.swizzle_bits(row)
        return ((blk * self.rows + row) * self.block_cols + c * 8) * 2


class LdsmAddr:
    def __init__(self, tile, base_tile, lane_row, lane_half):
        self.t = tile
        self.base = base_tile + tile.offset(lane_row, lane_half)

    def at(self, row0, cpair):
        t = self.t
        c = 2 * cpair
        xor_bits = (c % t.cpb) * 16
        add = ((c // t.cpb) * t.rows + row0) * t.block_cols * 2
        return (self.base ^ xor_bits) + add


def bank_groups_distinct(addrs16):
    """8 addresses of 16-byte accesses: conflict-free iff distinct 16-byte bank groups."""
    return len({(a // 16) % 8 for a in addrs16}) == len(addrs16)


def fail(msg):
    raise AssertionError(msg)


def check_tile_layout(tile):
    offs = {tile.offset(r, c) for r in range(tile.rows) for c in range(tile.cols // 8)}
    if offs != set(range(0, tile.bytes, 16)):
        fail(f"layout {tile.rows}x{tile.cols} swz={tile.swizzle} is not a bijection")


def cp_async_chunks(tile, threads):
    """(tid, row, chunk, dst) of every copy load_tile_async issues, in issue order per thread."""
    cpb = tile.cpb
    assert threads % cpb == 0
    rpp = threads // cpb
    assert rpp % 8 == 0
    passes = (tile.rows + rpp - 1) // rpp
    out = []
    for tid in range(threads):
        c, r = tid % cpb, tid // cpb
        dst = tile.offset(r, c)
        i = 0
        for p in range(passes):
            if tile.rows % rpp == 0 or p * rpp + r < tile.rows:
                for blk in range(tile.col_blocks):
                    d = dst + (blk * tile.rows + p * rpp) * tile.block_cols * 2
                    out.append((tid, i, p * rpp + r, blk * cpb + c, d))
                    i += 1
    return out


def check_cp_async(tile, threads):
    copies = cp_async_chunks(tile, threads)
    seen = {}
    for tid, i, row, chunk, d in copies:
        if d != tile.offset(row, chunk):
            fail(f"cp.async dst mismatch tile {tile.rows}x{tile.cols} tid {tid}")
        if (row, chunk) in seen:
            fail("chunk copied twice")
        seen[(row, chunk)] = tid
    if len(seen) != tile.rows * tile.cols // 8:
        fail("chunks missed by cp.async")
    # Bank conflicts: instruction i of each warp; quarter-warps of 8 lanes.
    by_instr = {}
    for tid, i, row, chunk, d in copies:
        by_instr.setdefault((tid // 32, i), {})[tid % 32] = d
    for (w, i), lanes in by_instr.items():
        for q in range(4):
            addrs = [lanes[l] for l in range(8 * q, 8 * q + 8) if l in lanes]
            if tile.swizzle and not bank_groups_distinct(addrs):
                fail(f"cp.async bank conflict tile {tile.rows}x{tile.cols} warp {w} instr {i}")
    # Global side: 8 (4) consecutive lanes read one contiguous 128 (64)-byte run of a row.
    for (w, i), lanes in by_instr.items():
        pass  # implied by chunk = blk*cpb + tid % cpb, row = tid // cpb (+ pass)


def check_ldmatrix(tile, kind, rows_total, row_base=0):
    """kind: 'a' (Q), 'b' (K), 'bt' (V). Checks addresses and conflicts for all blocks."""
    npairs = tile.cols // 16
    for row0 in range(0, rows_total, 16):
        for cp in range(npairs):
            addrs = []
            for lane in range(32):
                if kind == "a":
                    lr, lh = row_base + (lane & 15), lane >> 4
                    want_row, want_chunk = row_base + row0 + (lane & 15), 2 * cp + (lane >> 4)
                elif kind == "b":
                    lr, lh = ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1
                    want_row = row0 + ((lane >> 4) << 3) + (lane & 7)
                    want_chunk = 2 * cp + ((lane >> 3) & 1)
                else:
                    lr, lh = lane & 15, lane >> 4
                    want_row, want_chunk = row0 + (lane & 15), 2 * cp + (lane >> 4)
                a = LdsmAddr(tile, 0, lr, lh).at(row0, cp)
                if a != tile.offset(want_row, want_chunk):
                    fail(f"LdsmAddr {kind} tile {tile.rows}x{tile.cols} row0 {row0} cp {cp} lane {lane}")
                addrs.append(a)
            for m in range(4):
                if tile.swizzle and not bank_groups_distinct(addrs[8 * m: 8 * m + 8]):
                    fail(f"ldmatrix bank conflict {kind} tile {tile.rows}x{tile.cols}")


def check_epilogue(tile, rows_per_warp):
    for warp_row0 in range(0, tile.rows, rows_per_warp):
        mem = {}
        # 4-byte fragment stores: one instruction per (mt, nt, h)
        for mt in range(rows_per_warp // 16):
            for nt in range(tile.cols // 8):
                for h in range(2):
                    banks = {}
                    for lane in range(32):
                        row = warp_row0 + mt * 16 + (lane >> 2) + 8 * h
                        off = tile.offset(row, nt) + (lane & 3) * 4
                        mem[off] = (row, nt * 8 + 2 * (lane & 3))
                        banks.setdefault((off // 4) % 32, set()).add(off)
                    if tile.swizzle and any(len(v) > 1 for v in banks.values()):
                        fail(f"epilogue STS conflict tile {tile.rows}x{tile.cols}")
        # 16-byte reads
        cpb, rpp = tile.cpb, 32 // tile.cpb
        for blk in range(tile.col_blocks):
            for p in range(rows_per_warp // rpp):
                addrs = []
                for lane in range(32):
                    row = warp_row0 + p * rpp + lane // cpb
                    chunk = blk * cpb + lane % cpb
                    off = tile.offset(row, chunk)
                    for e in range(4):
                        if mem.get(off + 4 * e) != (row, chunk * 8 + 2 * e):
                            fail("epilogue reads back the wrong element")
                    addrs.append(off)
                for q in range(4):
                    if tile.swizzle and not bank_groups_distinct(addrs[8 * q: 8 * q + 8]):
                        fail(f"epilogue LDS.128 conflict tile {tile.rows}x{tile.cols}")


# ------------------------------------------------- fragment algebra (bit model)
def ldmatrix_x4(smem_get, addrs, trans):
    """smem_get(byte_offset) -> element. Returns regs[lane][i] = (lo, hi) element pair."""
    regs = [[None] * 4 for _ in range(32)]
    for m in range(4):
        rows = [[smem_get(addrs[8 * m + r] + 2 * c) for c in range(8)] for r in range(8)]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if not trans:
                regs[lane][m] = (rows[g][2 * t], rows[g][2 * t + 1])
            else:
                regs[lane][m] = (rows[2 * t][g], rows[2 * t + 1][g])
    return regs


def mma_16816(d, a, b0, b1):
    """d[lane] = 4 floats; a[lane] = 4 pairs; b0/b1[lane] = pairs (PTX fragment layouts)."""
    A = [[0] * 16 for _ in range(16)]
    B = [[0] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        (a00, a01), (a10, a11), (a20, a21), (a30, a31) = a[lane]
        A[g][2 * t], A[g][2 * t + 1] = a00, a01
        A[g + 8][2 * t], A[g + 8][2 * t + 1] = a10, a11
        A[g][2 * t + 8], A[g][2 * t + 9] = a20, a21
        A[g + 8][2 * t + 8], A[g + 8][2 * t + 9] = a30, a31
        B[2 * t][g], B[2 * t + 1][g] = b0[lane]
        B[2 * t + 8][g], B[2 * t + 9][g] = b1[lane]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i, (r, c) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            d[lane][i] += sum(A[r][k] * B[k][c] for k in range(16))


def check_fragment_algebra(D, BN, rows_per_warp, swizzle, rng):
    """One warp: S = Q K^T and O = P V through the kernel's exact addressing and packing."""
    MT, ST, OT = rows_per_warp // 16, BN // 8, D // 8
    qt, kt = SmemTile(rows_per_warp, D, swizzle), SmemTile(BN, D, swizzle)
    Q = [[rng.randint(-3, 3) for _ in range(D)] for _ in range(rows_per_warp)]
    K = [[rng.randint(-3, 3) for _ in range(D)] for _ in range(BN)]
    V = [[rng.randint(-3, 3) for _ in range(D)] for _ in range(BN)]

    def store(tile, M):
        mem = {}
        for r in range(tile.rows):
            for c in range(tile.cols):
                mem[tile.offset(r, c // 8) + 2 * (c % 8)] = M[r][c]
        return mem.__getitem__

    sq, sk, sv = store(qt, Q), store(kt, K), store(kt, V)
    q_addr = [LdsmAddr(qt, 0, lane & 15, lane >> 4) for lane in range(32)]
    k_addr = [LdsmAddr(kt, 0, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1) for lane in range(32)]
    v_addr = [LdsmAddr(kt, 0, lane & 15, lane >> 4) for lane in range(32)]

    s = [[[[0] * 4 for _ in range(32)] for _ in range(ST)] for _ in range(MT)]
    for ks in range(D // 16):
        a = [ldmatrix_x4(sq, [q_addr[l].at(mt * 16, ks) for l in range(32)], False) for mt in range(MT)]
        for np_ in range(ST // 2):
            b = ldmatrix_x4(sk, [k_addr[l].at(np_ * 16, ks) for l in range(32)], False)
            for mt in range(MT):
                mma_16816(s[mt][2 * np_], a[mt], [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
                mma_16816(s[mt][2 * np_ + 1], a[mt], [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])
    for mt in range(MT):
        for nt in range(ST):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i, (r, c) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    row, key = mt * 16 + r, nt * 8 + c
                    want = sum(Q[row][d] * K[key][d] for d in range(D))
                    if s[mt][nt][lane][i] != want:
                        fail(f"S fragment wrong (D={D}, BN={BN}, rows={rows_per_warp})")
    # P = S (integers stand in for probabilities); pack as gemm_pv does.
    o = [[[[0] * 4 for _ in range(32)] for _ in range(OT)] for _ in range(MT)]
    for kk in range(BN // 16):
        a = []
        for mt in range(MT):
            a.append([((s[mt][2 * kk][l][0], s[mt][2 * kk][l][1]), (s[mt][2 * kk][l][2], s[mt][2 * kk][l][3]),
                       (s[mt][2 * kk + 1][l][0], s[mt][2 * kk + 1][l][1]),
                       (s[mt][2 * kk + 1][l][2], s[mt][2 * kk + 1][l][3])) for l in range(32)])
        for dp in range(OT // 2):
            b = ldmatrix_x4(sv, [v_addr[l].at(kk * 16, dp) for l in range(32)], True)
            for mt in range(MT):
                mma_16816(o[mt][2 * dp], a[mt], [b[l][0] for l in range(32)], [b[l][1] for l in range(32)])
                mma_16816(o[mt][2 * dp + 1], a[mt], [b[l][2] for l in range(32)], [b[l][3] for l in range(32)])
    for mt in range(MT):
        for nt in range(OT):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for i, (r, c) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    row, dim = mt * 16 + r, nt * 8 + c
                    S_row = [sum(Q[row][d] * K[key][d] for d in range(D)) for key in range(BN)]
                    want = sum(S_row[key] * V[key][dim] for key in range(BN))
                    if o[mt][nt][lane][i] != want:
                        fail(f"O fragment wrong (D={D}, BN={BN}, rows={rows_per_warp})")


# ------------------------------------------------------ causal / tail ranges
def ceil_div(a, b):
    return -(-a // b)


def kernel_plan(Sq, Sk, BM, BN, causal, m_block):
    row0 = m_block * BM
    diag = Sk - Sq
    n_tiles = ceil_div(Sk, BN)
    if causal:
        keys_seen = min(Sq, row0 + BM) + diag
        n_tiles = 0 if keys_seen <= 0 else min(n_tiles, ceil_div(keys_seen, BN))
    visible_end = min(Sk, row0 + diag + 1) if causal else Sk
    n_plain = visible_end // BN if visible_end > 0 else 0
    return row0, diag, n_tiles, n_plain


def check_ranges(Sq, Sk, BM, BN, causal):
    for m_block in range(ceil_div(Sq, BM)):
        row0, diag, n_tiles, n_plain = kernel_plan(Sq, Sk, BM, BN, causal, m_block)
        rows = range(row0, min(row0 + BM, Sq))
        for n in range(ceil_div(Sk, BN)):
            keys = range(n * BN, n * BN + BN)
            for i in rows:
                for j in keys:
                    visible = j < Sk and (not causal or j <= i + diag)
                    if n >= n_tiles:
                        if visible:
                            fail(f"skipped tile has a visible key {Sq},{Sk},{BM},{BN},{causal}")
                        continue
                    masked_by_kernel = False
                    if n >= n_plain:
                        key_end = min(Sk, i + diag + 1) if causal else Sk
                        masked_by_kernel = j >= key_end
                    elif not visible:
                        fail(f"unmasked tile hides a key {Sq},{Sk},{BM},{BN},{causal} row {i} key {j}")
                    if masked_by_kernel == visible:
                        fail(f"mask wrong {Sq},{Sk},{BM},{BN},{causal} row {i} key {j}")


def check_head_ratio_magic():
    for d in list(range(2, 300)) + [1000, 4096, 32767, 65535]:
        m = ((1 << 32) + d - 1) // d
        for n in list(range(0, 2048)) + [65535 - i for i in range(200)]:
            if (n * m) >> 32 != n // d:
                fail(f"head ratio magic wrong for {n} / {d}")


def main():
    cfgmod = load_configs()
    configs = list(cfgmod.FORWARD_CONFIGS)
    rng = random.Random(0)
    done = set()
    for c in configs:
        key = (c.headdim, c.block_m, c.block_n, c.warps, c.swizzle)
        if key in done:
            continue
        done.add(key)
        qt = SmemTile(c.block_m, c.headdim, c.swizzle)
        kt = SmemTile(c.block_n, c.headdim, c.swizzle)
        for t in (qt, kt):
            check_tile_layout(t)
            check_cp_async(t, c.threads)
        for w in range(c.warps):
            check_ldmatrix(qt, "a", c.rows_per_warp, row_base=w * c.rows_per_warp)
        check_ldmatrix(kt, "b", c.block_n)
        check_ldmatrix(kt, "bt", c.block_n)
        check_epilogue(qt, c.rows_per_warp)
    print(f"layouts, copies, ldmatrix, epilogue: {len(done)} tile shapes ok")
    for D in (32, 64, 96, 128):
        for BN in (32, 64):
            for rows in (16, 32):
                for swz in (True, False):
                    check_fragment_algebra(D, BN, rows, swz, rng)
    print("fragment algebra (S = Q K^T, O = P V through ldmatrix/mma models) ok")
    n = 0
    for BM, BN in ((128, 64), (128, 128), (64, 64), (128, 32), (64, 32)):
        for Sq in (1, 2, 7, 63, 64, 65, 127, 128, 129, 200, 257):
            for Sk in (1, 3, 31, 32, 64, 65, 100, 128, 129, 300):
                for causal in (False, True):
                    check_ranges(Sq, Sk, BM, BN, causal)
                    n += 1
    print(f"causal/tail tile ranges and masks: {n} cases ok")
    check_head_ratio_magic()
    print("head ratio multiply-high division ok")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)

"""Kernel configurations: the Python mirror of csrc/cuda/fwd_config.h and bwd_config.h.

A forward kernel is described by a :class:`KernelConfig` whose short string
form names it everywhere (the registry, the ``config=`` argument, the tuner's
cache, ``FLASHOP_KERNELS``)::

    <dtype>.d<headdim>.br<block_m>.bc<block_n>.w<warps>[.<flag>...]
    e.g.  bf16.d128.br128.bc64.w4        fp16.d64.br128.bc128.w4.kv2

Flags (pipeline options), always in this order when present:

    kv2    K/V double-buffered: tile j+1's K and V are fetched during tile j
           (one barrier per key tile, twice the K/V shared memory). Without
           it, one buffer each: V_j streams in under Q K_j^T and K_{j+1}
           under softmax + P V_j (two barriers per key tile).
    qreg   Q's mma fragments stay in registers for the whole key loop instead
           of being re-read from shared memory for every key tile.
    noswz  no XOR swizzle of shared tiles (ldmatrix bank conflicts; in no list
           below, built only when named in FLASHOP_KERNELS).

The lists of configs to build are :data:`FORWARD_CONFIGS` and
:data:`BACKWARD_CONFIGS` (mma.sync, flashop._C) and :data:`HOPPER_FORWARD_CONFIGS`
and :data:`HOPPER_BACKWARD_CONFIGS` (wgmma + TMA, flashop._C_sm90);
tools/codegen.py writes one instantiation file per config and the registry
tables from them.

Building only a subset: ``FLASHOP_KERNELS`` (forward configs, both families)
and ``FLASHOP_BWD_KERNELS`` (backward configs, both families) are
comma-separated lists of fnmatch patterns over config names, e.g.
``FLASHOP_KERNELS='bf16.d128.*,sm90.bf16.d128.*'`` or
``'*.d64.br128.bc128.w4,*.d128.*'``. Unset or empty means every listed config.
A pattern without wildcards that is a valid config name selects that config
even if it is not in the default list. A pattern that selects nothing is an
error (it is almost always a typo). :func:`select` is the one rule for all.

This module imports only the standard library: setup.py loads it by file path
before the extension exists (possibly without registering it in sys.modules,
which is why it avoids ``from __future__ import annotations``: a dataclass
with string annotations looks its module up there).
"""

import fnmatch
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = [
    "DTYPES",
    "HEADDIMS",
    "FLAGS",
    "MAX_SMEM_BYTES",
    "KernelConfig",
    "FORWARD_CONFIGS",
    "BackwardConfig",
    "BACKWARD_CONFIGS",
    "parse_backward",
    "HopperConfig",
    "HOPPER_FORWARD_CONFIGS",
    "HopperBackwardConfig",
    "HOPPER_BACKWARD_CONFIGS",
    "parse_name",
    "select",
    "selected",
]

DTYPES = ("fp16", "bf16")
HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)  # tile widths: a kernel of width W takes every headdim up to W
BLOCK_NS = (32, 64, 128)
WARPS = (2, 4, 8)
# Flag name -> KernelConfig field, in canonical (short-form) order.
FLAGS = ("kv2", "qreg", "noswz")
# Most dynamic shared memory a block can opt into on any sm80+ GPU (H100: 227 KiB).
MAX_SMEM_BYTES = 227 * 1024
ELEMENT_BYTES = 2  # fp16 / bf16
ENV_VAR = "FLASHOP_KERNELS"
BWD_ENV_VAR = "FLASHOP_BWD_KERNELS"


@dataclass(frozen=True)
class KernelConfig:
    """One forward kernel; field for field the C++ ``FwdConfig`` template."""

    dtype: str  # "fp16" | "bf16"
    headdim: int  # D
    block_m: int  # B_r: query rows per thread block
    block_n: int  # B_c: keys per key tile
    warps: int  # warps per block; each owns block_m // warps query rows (16 or 32)
    kv_double_buffer: bool = False  # flag "kv2"
    q_in_regs: bool = False  # flag "qreg"
    swizzle: bool = True  # flag "noswz" when False

    def __post_init__(self) -> None:
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.headdim not in HEADDIMS:
            problems.append(
                f"headdim {self.headdim} is not one of {', '.join(map(str, HEADDIMS))}"
            )
        if self.block_n not in BLOCK_NS:
            problems.append(
                f"block_n (bc) {self.block_n} is not one of {', '.join(map(str, BLOCK_NS))}"
            )
        if self.warps not in WARPS:
            problems.append(f"warps {self.warps} is not one of {', '.join(map(str, WARPS))}")
        elif self.block_m <= 0 or self.block_m % self.warps or self.rows_per_warp not in (16, 32):
            problems.append(
                f"block_m (br) {self.block_m} with {self.warps} warps gives "
                f"{self.block_m / self.warps:g} rows per warp; each warp must own 16 or 32 rows"
            )
        if not problems and self.smem_bytes() > MAX_SMEM_BYTES:
            problems.append(
                f"needs {self.smem_bytes()} bytes of shared memory, more than any "
                f"supported GPU offers ({MAX_SMEM_BYTES})"
            )
        if problems:
            raise ValueError(f"invalid kernel config {self.name!r}: " + "; ".join(problems))

    # -- derived -----------------------------------------------------------------
    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.warps

    @property
    def stages(self) -> int:
        """K/V buffers: 2 with kv2, else 1."""
        return 2 if self.kv_double_buffer else 1

    @property
    def flags(self) -> tuple:
        """Flag names set on this config, in canonical order."""
        on = {"kv2": self.kv_double_buffer, "qreg": self.q_in_regs, "noswz": not self.swizzle}
        return tuple(f for f in FLAGS if on[f])

    @property
    def flag_bits(self) -> int:
        """The C++ ``FwdFlag`` bitmask (kv2 = 1, qreg = 2, noswz = 4)."""
        return sum(1 << i for i, f in enumerate(FLAGS) if f in self.flags)

    @property
    def min_sm(self) -> int:
        """Lowest compute capability (major * 10 + minor) the kernel runs on."""
        return 80

    # Packed batches (cu_seqlens, csrc/packed_sequences.h): run by the variants build with the sequence
    # bounds (fwd_kernel.cuh kPacked).
    supports_packed = True

    @property
    def name(self) -> str:
        parts = [
            str(self.dtype),
            f"d{self.headdim}",
            f"br{self.block_m}",
            f"bc{self.block_n}",
            f"w{self.warps}",
            *self.flags,
        ]
        return ".".join(parts)

    def __str__(self) -> str:
        return self.name

    def smem_bytes(self) -> int:
        """Dynamic shared memory per block: Q tile + stages x (K tile + V tile).

        Must equal ``FwdConfig::kSmemBytes`` (the generated code static_asserts it).
        """
        return ELEMENT_BYTES * self.headdim * (self.block_m + 2 * self.stages * self.block_n)

    # -- parsing ------------------------------------------------------------------
    @classmethod
    def parse(cls, s: str) -> "KernelConfig":
        """Inverse of :attr:`name`; raises ValueError saying what is wrong."""
        if not isinstance(s, str):
            raise ValueError(f"kernel config must be a string, got {type(s).__name__}")
        form = "<dtype>.d<headdim>.br<block_m>.bc<block_n>.w<warps>[.kv2][.qreg][.noswz]"
        parts = s.strip().split(".")
        if len(parts) < 5:
            raise ValueError(f"kernel config {s!r}: expected the form {form}")
        dtype = parts[0]
        if dtype not in DTYPES:
            raise ValueError(
                f"kernel config {s!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}"
            )

        def number(part: str, prefix: str, what: str) -> int:
            if not part.startswith(prefix) or not part[len(prefix):].isdigit():
                raise ValueError(
                    f"kernel config {s!r}: expected {what} as '{prefix}<int>', got {part!r} "
                    f"(form {form})"
                )
            return int(part[len(prefix):])

        headdim = number(parts[1], "d", "the head dimension")
        block_m = number(parts[2], "br", "B_r (query rows per block)")
        block_n = number(parts[3], "bc", "B_c (keys per tile)")
        warps = number(parts[4], "w", "the warp count")
        flags = parts[5:]
        for f in flags:
            if f not in FLAGS:
                raise ValueError(
                    f"kernel config {s!r}: unknown flag {f!r}; known flags: {', '.join(FLAGS)}"
                )
        if len(set(flags)) != len(flags):
            raise ValueError(f"kernel config {s!r}: repeated flag")
        canonical = [f for f in FLAGS if f in flags]
        if flags != canonical:
            raise ValueError(
                f"kernel config {s!r}: flags must appear in the order "
                f"{', '.join(FLAGS)} (write {'.'.join(parts[:5] + canonical)!r})"
            )
        return cls(
            dtype=dtype,
            headdim=headdim,
            block_m=block_m,
            block_n=block_n,
            warps=warps,
            kv_double_buffer="kv2" in flags,
            q_in_regs="qreg" in flags,
            swizzle="noswz" not in flags,
        )


def _cfg(dtype: str, d: int, br: int, bc: int, w: int, *flags: str) -> KernelConfig:
    return KernelConfig(
        dtype=dtype,
        headdim=d,
        block_m=br,
        block_n=bc,
        warps=w,
        kv_double_buffer="kv2" in flags,
        q_in_regs="qreg" in flags,
        swizzle="noswz" not in flags,
    )


# (headdim, block_m, block_n, warps, flags...) built for both dtypes. A few per
# head dimension so the policy and the tuner have choices: the main shape first
# (the FlashAttention-2 shape, or its spill-free neighbour: d64 128x128 leaves
# ptxas 8 bytes of spill), a smaller B_c (less causal waste, fewer registers), a
# B_r = 64 one (more blocks for short or few-head problems), and kv2 variants.
# The C++ glue's config='' fallback takes the first one that fits the device.
_FORWARD_SHAPES = (
    (32, 128, 128, 4),
    (32, 128, 64, 4),
    (32, 64, 64, 4),
    (64, 128, 64, 4),
    (64, 128, 128, 4),
    (64, 64, 64, 4),
    (64, 128, 128, 4, "kv2"),
    (64, 128, 64, 4, "kv2"),
    (64, 64, 64, 4, "qreg"),
    (96, 128, 64, 4),
    (96, 128, 32, 4),
    (96, 64, 64, 4),
    (96, 128, 64, 4, "kv2"),
    (128, 128, 64, 4),
    (128, 128, 32, 4),
    (128, 64, 64, 4),
    (128, 128, 64, 8),
    (128, 128, 64, 4, "kv2"),
    (128, 128, 32, 4, "kv2"),
    (160, 128, 64, 8),
    (160, 64, 64, 4),
    (160, 128, 64, 8, "kv2"),
    (192, 128, 64, 8),
    (192, 64, 64, 4),
    (192, 64, 32, 4),
    (192, 128, 64, 8, "kv2"),
    (224, 128, 64, 8),
    (224, 64, 64, 4),
    (224, 128, 64, 8, "kv2"),
    (256, 128, 64, 8),
    (256, 64, 64, 4),
    (256, 64, 32, 4),
    (256, 128, 64, 8, "kv2"),
    (256, 64, 64, 4, "kv2"),
)

FORWARD_CONFIGS: tuple = tuple(_cfg(dt, *shape) for dt in DTYPES for shape in _FORWARD_SHAPES)


# ---------------------------------------------------------------- backward kernels
#
# Names: bwd.<dtype>.d<D>.br<B_r>.bc<B_c>.w<warps>[.k32][.q1][.dpe][.dqe][.pfs][.hreg][.qup][.lpt]; FLASHOP_BWD_KERNELS
# selects a subset to build. The flags (csrc/cuda/bwd_config.h says more):
#   k32   32 keys per warp (FlashAttention-2's warp tiles; P^T/dS^T staged in shared memory)
#   q1    one Q/dO buffer instead of two
#   dpe   dP^T issued right after S^T, exp2 under its mma, P^T stored after it      (staged path)
#   dqe   dQ and its atomics first after the barrier, issued under the dV/dK mma  (staged path)
#   pfs   next tile's cp.async after the S^T product, branch-free               (staged path, not q1)
#   hreg  dV/dK take the warp's own half of P^T/dS^T from registers            (dpe, two warps per key slice)
#   qup   query tiles walked upward (causal: from the diagonal; else from a start rotated by the key tile),
#         so concurrent key tiles add dQ to different query tiles (not in deterministic mode)
#   lpt   causal: blocks dispatched key-tile major within groups of (batch, kv head) pairs, the longest
#         key tiles first; groups of ~4 waves of blocks, capped by the L2, none below 16 key tiles

# Backward flag names in bwd_config.h's order (bit i = BACKWARD_FLAGS[i]).
BACKWARD_FLAGS = ("k32", "q1", "dpe", "dqe", "pfs", "hreg", "qup", "lpt")


@dataclass(frozen=True)
class BackwardConfig:
    """One backward kernel; field for field the C++ ``BwdConfig`` template (csrc/cuda/bwd_config.h)."""

    dtype: str  # "fp16" | "bf16"
    headdim: int
    block_n: int  # B_c: key rows per thread block
    block_m: int  # B_r: query rows per step
    warps: int
    flags: tuple = ()  # subset of BACKWARD_FLAGS, in BACKWARD_FLAGS order

    # Packed batches: run by the score-mod build with the sequence bounds (bwd_kernel.cuh kPacked).
    supports_packed = True

    @property
    def name(self) -> str:
        parts = ["bwd", self.dtype, f"d{self.headdim}", f"br{self.block_m}", f"bc{self.block_n}", f"w{self.warps}"]
        return ".".join(parts + [f for f in BACKWARD_FLAGS if f in self.flags])

    @property
    def flag_bits(self) -> int:
        return sum(1 << i for i, f in enumerate(BACKWARD_FLAGS) if f in self.flags)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    # Mirrors BwdConfig's derived constants and bwd_smem_bytes_for().
    @property
    def keys_per_warp(self) -> int:
        return 32 if "k32" in self.flags else 16

    @property
    def warps_n(self) -> int:
        return self.block_n // self.keys_per_warp

    @property
    def warps_d(self) -> int:
        return self.warps // self.warps_n if self.warps_n else 0

    def smem_bytes(self) -> int:
        stages = 1 if "q1" in self.flags else 2
        d, n, m = self.headdim, self.block_n, self.block_m
        return (2 * d * n * 2 + stages * 2 * d * m * 2 + 2 * n * m
                + (2 * n * m if self.warps_d > 1 else 0) + stages * 2 * m * 4)

    def validate(self) -> None:
        """The static_asserts of BwdConfig, so a bad entry fails here, not in nvcc."""
        bad = []
        if self.dtype not in DTYPES:
            bad.append(f"dtype {self.dtype!r}")
        if self.headdim not in HEADDIMS:
            bad.append(f"headdim {self.headdim}")
        if self.warps not in (2, 4, 8):
            bad.append(f"warps {self.warps}")
        if self.block_m not in (32, 64, 128):
            bad.append(f"block_m {self.block_m}")
        unknown = [f for f in self.flags if f not in BACKWARD_FLAGS]
        if unknown:
            bad.append(f"flags {unknown}")
        if tuple(f for f in BACKWARD_FLAGS if f in self.flags) != tuple(self.flags):
            bad.append("flags out of order or repeated")
        wn = self.warps_n
        if self.block_n % self.keys_per_warp or wn < 1 or self.warps % wn or self.warps_d not in (1, 2, 4):
            bad.append(f"block_n {self.block_n} / {self.keys_per_warp} keys per warp vs {self.warps} warps")
        elif (self.block_m // self.warps_d) % 16 or (self.headdim // self.warps_d) % 16:
            bad.append("warp tiles must be multiples of 16 (queries and head dims per warp)")
        else:
            staged_only = [f for f in ("dpe", "dqe", "pfs", "hreg") if f in self.flags]
            if staged_only and self.warps_d < 2:
                bad.append(f"flags {', '.join(staged_only)} need warps sharing a key slice (P^T/dS^T staged)")
            if "pfs" in self.flags and "q1" in self.flags:
                bad.append("pfs needs two Q/dO stages (not q1)")
            if "hreg" in self.flags and ("dpe" not in self.flags or self.warps_d != 2):
                bad.append("hreg needs dpe and exactly two warps per key slice")
        if not any(self.block_m % (16 * wm) == 0 and self.headdim % (16 * (self.warps // wm)) == 0
                   for wm in (1, 2, 4, 8) if self.warps % wm == 0):
            bad.append("no dQ warp grid")
        if self.smem_bytes() > MAX_SMEM_BYTES:
            bad.append(f"shared memory {self.smem_bytes()} > {MAX_SMEM_BYTES}")
        if bad:
            raise ValueError(f"backward config {self.name}: " + "; ".join(bad))


def parse_backward(name: str) -> BackwardConfig:
    """The inverse of BwdConfig.name."""
    parts = name.split(".")
    if len(parts) < 6 or parts[0] != "bwd":
        raise ValueError(f"backward config {name!r}: expected bwd.<dtype>.d<D>.br<B_r>.bc<B_c>.w<warps>[.flags]")
    try:
        cfg = BackwardConfig(parts[1], int(parts[2][1:]), int(parts[4][2:]), int(parts[3][2:]), int(parts[5][1:]),
                        tuple(parts[6:]))
    except ValueError:
        raise ValueError(f"backward config {name!r}: malformed field") from None
    if cfg.name != name:
        raise ValueError(f"backward config {name!r}: not in canonical form ({cfg.name})")
    cfg.validate()
    return cfg


def _bwd_cfg(dtype, d, bc, br, w, *flags):
    return BackwardConfig(dtype, d, bc, br, w, tuple(flags))


# (headdim, block_n, block_m, warps, flags...) built for both dtypes. The first
# entry of a head dimension is its default (the glue's pick for config=''), the
# others are alternatives for the policy/autotuner. Shared memory in KiB:
# sm80 (A100) allows 163, sm90 (H100) 227, sm86/89 99.
# "k32" rows are FlashAttention-2's warp shapes (32 keys per warp, P^T/dS^T
# staged in shared memory): ~20% fewer ldmatrix bytes per mma than 16 keys
# per warp, which keeps P^T/dS^T in registers instead.
# "dpe.dqe.pfs[.hreg]" rows: the same kernels with the loop body reordered so
# that exp2, the dQ atomics and the next tile's address arithmetic run under
# mma instead of between barriers, and (hreg) fewer ldmatrix (per warp and
# query tile 144 -> 128 at d64, 144 -> 136 at d128); 0 spills on sm_90 and
# sm_80 (the d128 k32 row spills 8 bytes on sm_90). Listed after the k32
# default until timed on a GPU.
_BACKWARD_SHAPES = [
    (32, 128, 128, 8, "k32"),         # 114 KiB
    (32, 128, 64, 8),                 # 50 KiB
    (64, 128, 128, 8, "k32", "dpe", "dqe", "pfs", "hreg"),  # 162 KiB; 1.10-1.16x the plain k32 on an H200
    (64, 128, 128, 8, "k32", "dpe", "dqe", "pfs", "hreg", "qup"),  # 162 KiB; 0.98-1.0x hreg alone (H200)
    (64, 128, 128, 8, "k32", "dpe", "dqe", "pfs", "hreg", "lpt"),  # 162 KiB; 0.99-1.01x hreg alone (H200)
    (64, 128, 128, 8, "k32", "dpe", "dqe", "pfs"),          # 162 KiB
    (64, 128, 128, 8, "k32"),         # 162 KiB
    (64, 128, 64, 8),                 # 81 KiB (fits sm86/89)
    (96, 128, 64, 8, "k32"),          # 129 KiB
    (96, 128, 64, 8),                 # 113 KiB
    # 161 KiB; qup 1.003-1.016x hreg alone on 17 of 24 d128 shapes, 0.985 at worst (H200)
    (128, 128, 64, 8, "k32", "dpe", "dqe", "pfs", "hreg", "qup"),
    # 161 KiB; 0.98-1.02x qup alone (causal: loses at 1k-2k, wins at 8k; H200)
    (128, 128, 64, 8, "k32", "dpe", "dqe", "pfs", "hreg", "qup", "lpt"),
    (128, 128, 64, 8, "k32", "dpe", "dqe", "pfs", "hreg"),  # 161 KiB; 1.05-1.10x the plain k32 on an H200
    (128, 128, 64, 8, "k32", "dpe", "dqe", "pfs"),          # 161 KiB
    (128, 128, 64, 8, "k32"),         # 161 KiB
    (128, 128, 64, 8),                # 145 KiB
    (128, 64, 64, 4),                 # 105 KiB
    # 137 KiB; the d64/d128 reordering at d160's only warp shape (16 keys per warp: with k32 the four warps
    # of a key slice would hold 40 head dims each, not a multiple of 16); 220 (sm_90) / 198 (sm_80)
    # registers; 1.05x the hreg row and 1.06x the plain one (H100, bf16, 4k, causal or not)
    (160, 64, 64, 8, "dpe", "dqe", "pfs"),
    (160, 64, 64, 8, "dpe", "dqe", "pfs", "hreg"),  # 137 KiB; 232 (sm_90) / 220 (sm_80) registers
    (160, 64, 64, 8),                 # 137 KiB (FlashAttention-2's d160 tiles)
    (160, 64, 64, 8, "q1"),           # 97 KiB (fits sm86/89)
    (192, 64, 64, 8, "k32"),          # 161 KiB
    (192, 64, 64, 8),                 # 161 KiB
    # 185 KiB (sm90 only); 16 keys per warp as at d160 (k32 would give 56 head dims per warp); 250 (sm_90)
    # registers, no spills; the plain row spills 16 B on sm_80
    (224, 64, 64, 8, "dpe", "dqe", "pfs"),
    (224, 64, 64, 8),                 # 185 KiB (sm90 only)
    (224, 64, 64, 8, "q1", "dpe", "dqe"),  # 129 KiB (fits sm80)
    (224, 64, 64, 8, "q1"),           # 129 KiB (fits sm80)
    # 209 KiB (sm90 only); the d64/d128 reordering (no hreg: four warps per key slice), 255 registers and
    # no spills on sm_90; 1.03-1.05x the plain k32 on an H200 (bf16, 1k-16k, causal or not). (At d192 the
    # same spills 4 B on sm_90, 76 on sm_80.)
    (256, 64, 64, 8, "k32", "dpe", "dqe", "pfs"),
    (256, 64, 64, 8, "k32"),          # 209 KiB (sm90 only)
    (256, 64, 64, 8, "k32", "q1"),    # 145 KiB (fits sm80)
    (256, 64, 64, 8),                 # 209 KiB (sm90 only)
]

BACKWARD_CONFIGS = [_bwd_cfg(dt, *row) for row in _BACKWARD_SHAPES for dt in ("bf16", "fp16")]


# ---------------------------------------------------------------- Hopper forward kernels (flashop._C_sm90)
#
# Names: sm90.<dtype>.d<D>.br<B_r>.bc<B_c>[.nopp][.st3][.mc][.tmao|.pers[.lpt|.dyn|.rego]]. wgmma + TMA, one producer and two
# consumer warpgroups; "nopp" drops the ping-pong barriers that let one consumer's softmax run under the other's
# GEMMs (in no list, built only when named in FLASHOP_KERNELS); "st3" gives the K/V ring 3 stages instead of 2;
# "tmao" writes O through shared memory (the dead Q tile) with a TMA store; "pers" is the persistent kernel
# (one CTA per SM walking the tiles; it uses the TMA store, so "pers" implies "tmao", except "pers.rego", which
# stores O from registers and loads and frees Q by halves, one per consumer warpgroup); "pers.lpt" walks
# the tiles longest first over all heads and batches (query tile varying slowest; "lpt" requires "pers");
# "pers.dyn" takes its tiles at run time from a global counter (each CTA's next tile when it is ready for it);
# "mc" (one tile per CTA, TMA store) runs non-causal problems with an even number of query tiles as clusters of
# two CTAs that share each K/V tile through TMA multicast (each loads half), other problems as "tmao" does.
# Built for sm_90a only: they run on compute capability 9.0 exactly.

_HOPPER_SUFFIXES = ("nopp", "st3", "cta3", "mc", "tmao", "pers", "lpt", "dyn", "rego")
# Tile widths (the name's d<W>; the kernel takes any head dimension up to W that is a multiple of 8): multiples of
# 64 in 64-column blocks with the 128-byte swizzle, 96, 160 and 224 in 32-column blocks with the 64-byte swizzle.
_HOPPER_HEADDIMS = (64, 96, 128, 160, 192, 224, 256)
# B_c beyond 64 and 128 per width (Sm90FwdTraits' static_asserts): 176 and 192 at D = 128, 80 at D = 224 and 256
# (FlashAttention-3's d256 tile), 112 at D = 192 (its d192 tile; 128 keys do not fit the shared memory).
_HOPPER_WIDE_BLOCK_N = {128: (176, 192), 192: (112,), 224: (80,), 256: (80,)}


@dataclass(frozen=True)
class HopperConfig:
    dtype: str
    headdim: int
    block_m: int = 128
    block_n: int = 128
    pingpong: bool = True
    tma_store: bool = False
    persistent: bool = False
    longest_first: bool = False  # persistent tile order: query tile slowest ("pers.lpt")
    stages: int = 2  # K/V ring depth ("st3": 3)
    multicast: bool = False  # K/V shared by a cluster of two CTAs ("mc")
    three_ctas: bool = False  # B_r = 64 budgeted for three CTAs per SM instead of two ("cta3")
    dynamic: bool = False  # persistent, tiles taken at run time ("pers.dyn")

    def __post_init__(self):
        if self.persistent and not self.tma_store and (self.longest_first or self.dynamic):
            raise ValueError(f"HopperConfig {self.name!r}: the persistent kernel with O stored from registers "
                             "('pers.rego') walks the tiles in the plain order (no 'lpt', no 'dyn')")
        if self.longest_first and not self.persistent:
            raise ValueError("HopperConfig: longest_first is a tile order of the persistent kernel ('lpt' needs 'pers')")
        if self.dynamic and not (self.persistent and not self.longest_first and self.separate_o):
            raise ValueError(f"HopperConfig {self.name!r}: tiles taken at run time ('dyn') is a tile order of the "
                             "persistent kernel with its own O tile (d64, d128 at B_c = 128), not with 'lpt'")
        if self.multicast and not (self.tma_store and not self.persistent):
            raise ValueError(f"HopperConfig {self.name!r}: multicast ('mc') is a one-tile-per-CTA TMA-store kernel "
                             "('mc.tmao')")
        if self.stages not in (2, 3):
            raise ValueError(f"HopperConfig: stages must be 2 or 3, got {self.stages}")
        if self.dtype not in DTYPES:
            raise ValueError(f"HopperConfig: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        # The static_asserts of Sm90FwdTraits (csrc/cuda/sm90/fwd_traits.cuh): B_c = 176 (wgmma m64n176k16 for S,
        # 11 k-steps of P V) and 192 at D = 128 only, B_c = 80 at D = 224 and 256, 112 at D = 192; B_r = 192 (three
        # consumer warpgroups) at D = 64 without the persistent scheduler; B_r = 64 (one consumer warpgroup, two CTAs
        # per SM) one tile per CTA without multicast.
        if (self.headdim not in _HOPPER_HEADDIMS
                or not (self.block_m == 128 or (self.block_m == 192 and self.headdim == 64 and not self.persistent)
                        or (self.block_m == 64 and not self.persistent and not self.multicast))
                or not (self.block_n in (64, 128) or self.block_n in _HOPPER_WIDE_BLOCK_N.get(self.headdim, ()))):
            raise ValueError(f"HopperConfig {self.name!r}: the kernel takes D in {_HOPPER_HEADDIMS}, B_r = 128 (or "
                             "192 at D = 64, not persistent, or 64, one tile per CTA without multicast), B_c 64 or 128 (or 176 "
                             "or 192 at D = 128, 80 at D = 224 and 256, 112 at D = 192)")
        if self.three_ctas and not (self.block_m == 64 and self.headdim == 64 and self.block_n == 64):
            raise ValueError(f"HopperConfig {self.name!r}: three CTAs per SM ('cta3') is built for D = 64, B_r = 64, "
                             "B_c = 64 (136 registers per consumer thread)")
        if self.block_m == 64 and self.ctas_per_sm * (self.smem_bytes() + 1024) > 228 * 1024:
            raise ValueError(f"HopperConfig {self.name!r}: B_r = 64 runs {self.ctas_per_sm} CTAs per SM, but "
                             f"{self.smem_bytes()} bytes of shared memory each do not fit {self.ctas_per_sm} times")
        if self.smem_bytes() > MAX_SMEM_BYTES:
            raise ValueError(f"HopperConfig {self.name!r}: needs {self.smem_bytes()} bytes of shared memory, "
                             f"more than {MAX_SMEM_BYTES}")

    @property
    def name(self) -> str:
        return (f"sm90.{self.dtype}.d{self.headdim}.br{self.block_m}.bc{self.block_n}"
                + ("" if self.pingpong else ".nopp")
                + ("" if self.stages == 2 else f".st{self.stages}")
                + (".cta3" if self.three_ctas else "")
                + (".mc" if self.multicast else "")
                + (".pers" if self.persistent else ".tmao" if self.tma_store else "")
                + (".lpt" if self.longest_first else "")
                + (".dyn" if self.dynamic else "")
                + (".rego" if self.persistent and not self.tma_store else ""))

    def runs_on(self, capability: tuple) -> bool:
        return tuple(capability) == (9, 0)

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM the kernel is budgeted for (Sm90FwdTraits::kCtasPerSm)."""
        return 1 if self.block_m != 64 else 3 if self.three_ctas else 2

    @property
    def separate_o(self) -> bool:
        """The persistent kernel stages O in a tile of its own where that fits (d64 and d128 at B_c = 128),
        so the next tile's Q loads under the epilogue (Sm90FwdTraits::kSeparateO)."""
        tiles = ELEMENT_BYTES * self.headdim * (2 * self.block_m + 2 * self.stages * self.block_n)
        return self.persistent and self.tma_store and tiles + 8 * (2 + 4 * self.stages) + 1024 <= MAX_SMEM_BYTES

    @property
    def double_q(self) -> bool:
        """With its own O tile, the persistent kernel also keeps two Q buffers where they fit (d64, and d128
        at B_c = 128), so tile k+1's Q loads during tile k (Sm90FwdTraits::kDoubleQ)."""
        tiles = ELEMENT_BYTES * self.headdim * (3 * self.block_m + 2 * self.stages * self.block_n)
        return self.separate_o and tiles + 8 * (4 + 4 * self.stages) + 1024 <= MAX_SMEM_BYTES

    @property
    def q_halves(self) -> bool:
        """The persistent kernel without the TMA store ('pers.rego') loads and frees Q in two halves, one per
        consumer warpgroup, each with its own q_full / q_empty pair (Sm90FwdTraits::kQHalves)."""
        return self.persistent and not self.tma_store

    @property
    def supports_variants(self) -> bool:
        """Built with the attention variants (window, softcap, alibi_slopes, sinks; a second instantiation of
        the kernel, run only when a call asks for one): every Hopper forward config except the one-tile-per-CTA
        kernels at B_c = 192 ('bc192.tmao', 'bc192.mc.tmao'), whose variants build spills in the main loop.
        The others refuse such calls with an error naming the config (Sm90FwdTraits::kSupportsVariants)."""
        return not (self.block_n == 192 and not self.persistent)

    @property
    def supports_packed(self) -> bool:
        """Runs packed batches (cu_seqlens): on the variants build, with per-sequence offsets (fwd_scheduler.cuh)."""
        return self.supports_variants

    @property
    def split_tail(self) -> bool:
        """The persistent kernel in the plain tile order (not longest-first) shares the tiles of the last two
        waves out over all CTAs by key tiles when the tiles leave the last wave at least 1% idle (non-causal;
        Sm90FwdTraits::kStreamK, fwd_launch.cuh stream_k_plan)."""
        return self.persistent and not self.longest_first and not self.dynamic

    @property
    def split_last_wave(self) -> bool:
        """The one-tile-per-CTA TMA-store kernels at one CTA per SM run the tiles that would leave the last
        wave partly idle as pieces of their key range, one CTA per piece, when a model of the schedule says
        it saves at least 1% (non-causal; Sm90FwdTraits::kSplitTail, fwd_launch.cuh split_tail_plan). Not at
        d256, where the build with it measured 1.6-2.7% slower (H100)."""
        return self.tma_store and not self.persistent and self.ctas_per_sm == 1 and self.headdim <= 128

    def smem_bytes(self) -> int:
        """Q tile (two when double_q) + stages x (K + V tiles) (+ the O staging tile when separate_o) + 1024 B
        alignment slack + the mbarriers (csrc/cuda/sm90): q_full and, per stage, full and empty of K and of
        V (9 with 2 stages), one more (q_empty) in the persistent kernel, two more (the second Q buffer's
        q_full and q_empty) when double_q, or (q_halves) the second half's pair.
        Otherwise the TMA-store epilogue reuses the Q tile. K/V column blocks are not padded: B_c * 128
        bytes (64-column blocks) is a multiple of the 1024-byte swizzle atom for every B_c (a multiple of 16),
        B_c * 64 bytes (the 32-column blocks of D = 96, 160, 224) of the 512-byte one; so the bytes are the
        tile sizes alone whatever the block width. d128 B_c = 176: 212 992 + 1024 + 72 (80) = 214 088 (214 096)
        bytes."""
        barriers = 1 + 4 * self.stages + (1 if self.persistent else 0) + (2 if self.double_q or self.q_halves else 0)
        rows = self.block_m * (1 + self.separate_o + self.double_q) + 2 * self.stages * self.block_n
        # + "dyn": the tile number of each Q buffer's tile (two ints).
        return ELEMENT_BYTES * self.headdim * rows + 1024 + 8 * barriers + (8 if self.dynamic else 0)

    @classmethod
    def parse(cls, name: str) -> "HopperConfig":
        parts = name.split(".")
        suffixes = parts[5:]
        if len(parts) < 5 or parts[0] != "sm90" or any(x not in _HOPPER_SUFFIXES for x in suffixes):
            raise ValueError(
                f"Hopper kernel config {name!r}: expected sm90.<dtype>.d<D>.br<B_r>.bc<B_c>[.nopp][.st3][.cta3][.mc]"
                "[.tmao|.pers[.lpt|.dyn|.rego]]")
        try:
            fields = int(parts[2][1:]), int(parts[3][2:]), int(parts[4][2:])
        except ValueError:
            raise ValueError(f"Hopper kernel config {name!r}: malformed field") from None
        persistent = "pers" in suffixes
        tma_store = "tmao" in suffixes or (persistent and "rego" not in suffixes)
        config = cls(parts[1], *fields, "nopp" not in suffixes, tma_store, persistent,
                     "lpt" in suffixes, 3 if "st3" in suffixes else 2, "mc" in suffixes, "cta3" in suffixes,
                     "dyn" in suffixes)
        if config.name != name:
            raise ValueError(f"Hopper kernel config {name!r}: not in canonical form ({config.name})")
        return config


# Shapes and variants, each built for bf16 then fp16, in this order (the registry's; the policy breaks ties
# by it). The policy (flashop/dispatch.py, _hopper_variant) picks among the ping-pong builds by length:
# several CTAs of 64 query rows per SM, the persistent kernel with its own O tile ("pers", causal "pers.dyn"),
# the persistent 192-key kernel storing O from registers ("pers.rego"), or a one-tile-per-CTA TMA-store
# build ("tmao") and its multicast sibling ("mc.tmao"); the plain-store builds are its choice where no
# TMA-store build is built. Every build is a tuner candidate (flashop/autotune.py times all built configs
# that take the problem and fit the device).
_HOPPER_FORWARD_SHAPES = (
    # d128 and d64, 128 x 128 tiles: O stored from registers, O through shared memory and a TMA store,
    # the persistent kernel.
    "d128.br128.bc128", "d64.br128.bc128",
    "d128.br128.bc128.tmao", "d64.br128.bc128.tmao",
    "d128.br128.bc128.pers", "d64.br128.bc128.pers",
    # d256: B_c = 64 (Q 64 KiB + 2 stages x (K + V) 32 KiB each fit the 227 KiB).
    "d256.br128.bc64", "d256.br128.bc64.tmao", "d256.br128.bc64.pers",
    # d128 with B_c = 176 (FlashAttention-3's non-causal d128 tile).
    "d128.br128.bc176.tmao", "d128.br128.bc176.pers",
    # The persistent kernel with the longest-first tile order.
    "d128.br128.bc128.pers.lpt", "d128.br128.bc176.pers.lpt", "d256.br128.bc64.pers.lpt",
    "d64.br128.bc128.pers.lpt",
    # One tile per CTA with a 3-stage K/V ring (fits at B_c = 128 for d64 and d128).
    "d128.br128.bc128.st3.tmao", "d64.br128.bc128.st3.tmao",
    # d256 with B_c = 80 (FlashAttention-3's d256 tile; 230 472 bytes of shared memory).
    "d256.br128.bc80.tmao",
    # d64 with B_r = 192 (three consumer warpgroups; FlashAttention-3's d64 tile).
    "d64.br192.bc128.tmao",
    # K/V multicast to clusters of two CTAs.
    "d128.br128.bc176.mc.tmao", "d128.br128.bc128.mc.tmao", "d256.br128.bc80.mc.tmao", "d64.br192.bc128.mc.tmao",
    # 64 query rows per CTA, two CTAs per SM, then three ("cta3").
    "d64.br64.bc128.tmao", "d128.br64.bc64.tmao", "d64.br64.bc64.tmao", "d64.br64.bc64.cta3.tmao",
    # d128 with B_c = 192 (224 KiB of tiles), and its multicast build.
    "d128.br128.bc192.tmao", "d128.br128.bc192.mc.tmao",
    # Persistent with tiles taken at run time, where the kernel has its own O tile.
    "d128.br128.bc128.pers.dyn", "d64.br128.bc128.pers.dyn",
    # Persistent d128 with B_c = 192, O stored from registers.
    "d128.br128.bc192.pers.rego",
    # The widths between: 192 in 64-column blocks, 96, 160 and 224 in 32-column blocks (64-byte swizzle). One tile
    # per CTA with the TMA store, and the persistent kernel (d96 has room for its own O tile and two Q buffers,
    # hence "pers.dyn" too). Tiles after FlashAttention-3's tile_size_fwd_sm90: d192 128 x 112, d224 128 x 80;
    # d96 and d160 128 x 128.
    "d192.br128.bc112.tmao", "d192.br128.bc112.pers",
    "d96.br128.bc128.tmao", "d96.br128.bc128.pers", "d96.br128.bc128.pers.dyn",
    "d160.br128.bc128.tmao", "d160.br128.bc128.pers",
    "d224.br128.bc80.tmao", "d224.br128.bc80.pers",
)

HOPPER_FORWARD_CONFIGS = tuple(HopperConfig.parse(f"sm90.{dtype}.{shape}")
                               for shape in _HOPPER_FORWARD_SHAPES for dtype in ("bf16", "fp16"))

# ---------------------------------------------------------------- Hopper backward kernels (flashop._C_sm90)
#
# Names: sm90.bwd.<dtype>.d<64|96|128>.br64.bc128[.lpt], sm90.bwd.<dtype>.d64.br64.bc64,
# sm90.bwd.<dtype>.d64.br128.bc128,
# sm90.bwd.<dtype>.d<160|192|224|256>.br64.bc64[.rs][.lpt], sm90.bwd.<dtype>.d192.br64.bc96[.lpt] and
# sm90.bwd.<dtype>.d256.br64.bc80.
# FlashAttention-2's backward on wgmma + TMA: one producer and two consumer warpgroups per key tile of 128 rows
# (csrc/cuda/sm90/bwd_kernel.cuh), of 64 rows at the wide widths (Sm90BwdWideTraits: the consumers split
# dK, dV and dQ by columns, whose accumulators at 128 keys would not fit 240 registers; at B_c = 96,
# bwd_kernel_sm90_wide_keys, the consumers split the keys and compute dK^T, dV^T: a third fewer dQ atomics
# and Q/dO reloads per key, built without the attention variants; at B_c = 80, bwd_kernel_sm90_wide_kv_transposed,
# FlashAttention-3's d256 tile, they compute dK^T, dV^T and split D, with one dO stage). Not
# deterministic (dQ atomics): deterministic=True runs an mma.sync backward config instead.
# d64 with B_c = 64 (Sm90BwdTraits<kBf16, 64, 64>): one consumer warpgroup per CTA and two CTAs per SM, so that
# one CTA's K/V loads and dK/dV stores run under the other's steps. d64 with B_r = 128 (Sm90BwdTraits<kBf16, 64, 128,
# 128>, FlashAttention-3's d64 tile): 128 queries a step, lse and D by shuffles; dense problems only.
# "lpt" (Sm90BwdLpt, csrc/cuda/sm90/bwd_lpt.h): causal problems take the blocks longest first, key-tile
# major within groups of (batch, kv head) pairs (the mma.sync "lpt" grouping); other problems the plain
# order. Built at _HOPPER_BACKWARD_LPT_WIDTHS, listed after the plain builds: a tuner candidate, and the policy's
# pick for long causal problems where dispatch.HOPPER_BACKWARD_LPT_FROM lists the width.
# "rs" (Sm90BwdRoleSplit, wide widths): one consumer computes S^T, P^T and dV, the other dP^T, dS and dK, each
# accumulating all D columns from registers (about a sixth less shared-memory traffic a step at d256); dense
# problems only (no variants or packed build): listed first at _HOPPER_BACKWARD_RS_WIDTHS, so that dense problems
# take it and the others fall back to the plain build; elsewhere built only when named in FLASHOP_BWD_KERNELS.
#
# Tile widths of the Hopper backward kernel (csrc/cuda/sm90/bwd_kernel.cuh Sm90BwdTraits): 64-column blocks
# in the 128-byte swizzle at 64 and 128; at 96 32-column blocks in the 64-byte swizzle (K: 16-column blocks
# in the 32-byte swizzle).
HOPPER_BACKWARD_WIDTHS = (64, 96, 128)
# Sm90BwdWideTraits: B_c = 64; column blocks of 64 (128B swizzle) at 256, 32 (64B) at 192, 16 (32B) at
# 160 and 224, so that each consumer's half of D is whole blocks.
HOPPER_BACKWARD_WIDE_WIDTHS = (160, 192, 224, 256)
# The wide widths also built with B_c = 96 (Sm90BwdWideTraits<kBf16, D, 96>), the policy's default there.
HOPPER_BACKWARD_BC96_WIDTHS = (192,)
# The wide widths also built with B_c = 80 (Sm90BwdWideTraits<kBf16, D, 80>), the policy's default there for dense
# problems.
HOPPER_BACKWARD_BC80_WIDTHS = (256,)
# The narrow widths also built with B_c = 64 (Sm90BwdTraits<kBf16, D, 64>: one consumer, two CTAs per SM).
HOPPER_BACKWARD_BC64_WIDTHS = (64,)
# The narrow widths also built with B_r = 128 (Sm90BwdTraits<kBf16, D, 128, 128>).
HOPPER_BACKWARD_BR128_WIDTHS = (64,)
# Suffixes of a Hopper backward name, in name order.
_HOPPER_BACKWARD_SUFFIXES = ("rs", "lpt")
# The widths whose ".rs" build is listed, ahead of the plain one (d256: 1.003-1.021x the plain build, H200, bf16,
# 1k-16k, causal and not).
_HOPPER_BACKWARD_RS_WIDTHS = (256,)
# The widths whose ".lpt" build is listed (any width takes it when named in FLASHOP_BWD_KERNELS).
_HOPPER_BACKWARD_LPT_WIDTHS = (128, 192, 256, 160, 224)


@dataclass(frozen=True)
class HopperBackwardConfig:
    dtype: str
    headdim: int = 128
    block_n: int = 128  # keys per CTA
    block_m: int = 64  # queries per step
    longest_first: bool = False  # causal blocks longest first ("lpt", Sm90BwdLpt)
    role_split: bool = False  # consumers split by role ("rs", Sm90BwdRoleSplit; wide B_c = 64 only)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"HopperBackwardConfig: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        narrow = self.headdim in HOPPER_BACKWARD_WIDTHS and (self.block_n, self.block_m) == (128, 64)
        narrow_bc64 = self.headdim in HOPPER_BACKWARD_BC64_WIDTHS and (self.block_n, self.block_m) == (64, 64)
        narrow_br128 = self.headdim in HOPPER_BACKWARD_BR128_WIDTHS and (self.block_n, self.block_m) == (128, 128)
        wide = self.headdim in HOPPER_BACKWARD_WIDE_WIDTHS and (self.block_n, self.block_m) == (64, 64)
        keys = self.headdim in HOPPER_BACKWARD_BC96_WIDTHS and (self.block_n, self.block_m) == (96, 64)
        transposed = self.headdim in HOPPER_BACKWARD_BC80_WIDTHS and (self.block_n, self.block_m) == (80, 64)
        if not (narrow or narrow_bc64 or narrow_br128 or wide or keys or transposed):
            raise ValueError(f"HopperBackwardConfig {self.name!r}: the kernel takes D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_WIDTHS))} with B_c = 128, B_r = 64, or D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_BC64_WIDTHS + HOPPER_BACKWARD_WIDE_WIDTHS))} "
                             f"with B_c = 64, B_r = 64, or D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_BR128_WIDTHS))} with B_c = 128, B_r = 128, or D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_BC96_WIDTHS))} with B_c = 96, B_r = 64, or D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_BC80_WIDTHS))} with B_c = 80, B_r = 64")
        if self.role_split and not (wide and self.block_n == 64):
            raise ValueError(f"HopperBackwardConfig {self.name!r}: the role split (rs) takes D = "
                             f"{', '.join(map(str, HOPPER_BACKWARD_WIDE_WIDTHS))} with B_c = 64")

    @property
    def wide(self) -> bool:
        """Sm90BwdWideTraits (bwd_kernel_sm90_wide) rather than Sm90BwdTraits."""
        return self.headdim in HOPPER_BACKWARD_WIDE_WIDTHS

    @property
    def supports_variants(self) -> bool:
        """Built with the attention variants (kSupportsVariants): all but B_c = 96 and 80, B_r = 128 and the role
        split."""
        return self.block_n not in (96, 80) and self.block_m == 64 and not self.role_split

    @property
    def supports_packed(self) -> bool:
        """Runs packed batches (cu_seqlens): on its packed build (Sm90BwdPacked), made where the variants build
        is."""
        return self.supports_variants

    @property
    def name(self) -> str:
        return (f"sm90.bwd.{self.dtype}.d{self.headdim}.br{self.block_m}.bc{self.block_n}"
                + (".rs" if self.role_split else "")
                + (".lpt" if self.longest_first else ""))

    def runs_on(self, capability: tuple) -> bool:
        return tuple(capability) == (9, 0)

    def smem_bytes(self) -> int:
        """Sm90BwdTraits::kSmemBytes: K and V tiles, 2 stages of Q and dO, 2 dS buffers (B_r x B_c), at D = 64
        and 128 the B_c / 64 consumers' fp32 dQ tiles (64 rows x D / 2 each, 64 x D at D = 64), 2 stages of lse and D
        (B_r floats each), 5 mbarriers and 1024 bytes of alignment slack. The column blocks (64, 32 or 16
        columns) tile D exactly, with no padding. Sm90BwdWideTraits::kSmemBytes: the same with 2 buffers each
        of P and dS and no dQ tiles; at B_c = 80 one dO stage and 2 more mbarriers (dO's)."""
        d, n, m = self.headdim, self.block_n, self.block_m
        score_buffers = 4 if self.wide else 2
        dq_tiles = 0 if self.wide or d == 96 else 4 * (n // 64) * 64 * (d if d == 64 else d // 2)
        do_stages, barriers = (1, 7) if self.wide and n == 80 else (2, 5)
        return (ELEMENT_BYTES * (2 * n * d + (2 + do_stages) * m * d + score_buffers * m * n) + dq_tiles + 2 * 2 * m * 4
                + 8 * barriers + 1024)

    @classmethod
    def parse(cls, name: str) -> "HopperBackwardConfig":
        parts = name.split(".")
        suffixes = parts[6:]
        if len(parts) < 6 or parts[:2] != ["sm90", "bwd"] or any(x not in _HOPPER_BACKWARD_SUFFIXES for x in suffixes):
            raise ValueError(f"Hopper backward config {name!r}: expected "
                             "sm90.bwd.<dtype>.d<D>.br<B_r>.bc<B_c>[.rs][.lpt]")
        try:
            config = cls(parts[2], int(parts[3][1:]), int(parts[5][2:]), int(parts[4][2:]), "lpt" in suffixes,
                         "rs" in suffixes)
        except ValueError as e:
            raise ValueError(f"Hopper backward config {name!r}: {e}") from None
        if config.name != name:
            raise ValueError(f"Hopper backward config {name!r}: not in canonical form ({config.name})")
        return config


def _hopper_backward(dtype: str, d: int, longest_first: bool = False, block_n: int = 0,
                     role_split: bool = False, block_m: int = 64) -> HopperBackwardConfig:
    block_n = block_n or (64 if d in HOPPER_BACKWARD_WIDE_WIDTHS else 128)
    return HopperBackwardConfig(dtype, d, block_n, block_m, longest_first, role_split)


# The policy's defaults first: B_c = 96 where built (d192: 1.32-1.37x B_c = 64 on an H100, bf16, 4k, causal and
# not; it has no variants build, so a window, softcap or ALiBi takes B_c = 64), B_c = 80 (d256: 1.08-1.19x the best
# B_c = 64 build, H200, bf16 and fp16, 1k-16k, causal and not; dense only) and "rs" (dense only), the plain
# builds, then "lpt".
HOPPER_BACKWARD_CONFIGS = (
    tuple(_hopper_backward(dtype, d, block_n=96) for d in HOPPER_BACKWARD_BC96_WIDTHS for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d, block_n=80) for d in HOPPER_BACKWARD_BC80_WIDTHS for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d, role_split=True) for d in _HOPPER_BACKWARD_RS_WIDTHS for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d) for d in (128, 64, 96, 192, 256, 160, 224) for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d, block_n=64) for d in HOPPER_BACKWARD_BC64_WIDTHS for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d, block_m=128) for d in HOPPER_BACKWARD_BR128_WIDTHS for dtype in ("bf16", "fp16"))
    + tuple(_hopper_backward(dtype, d, True) for d in _HOPPER_BACKWARD_LPT_WIDTHS for dtype in ("bf16", "fp16")))


# ---------------------------------------------------------------- selecting what to build

def parse_name(name: str):
    """The config a name denotes, by its family's prefix: ``bwd.`` BackwardConfig, ``sm90.bwd.``
    HopperBackwardConfig, ``sm90.`` HopperConfig, else KernelConfig. Raises ValueError."""
    if name.startswith("bwd."):
        return parse_backward(name)
    if name.startswith("sm90.bwd."):
        return HopperBackwardConfig.parse(name)
    if name.startswith("sm90."):
        return HopperConfig.parse(name)
    return KernelConfig.parse(name)


def select(patterns, configs, what: str = ENV_VAR) -> list:
    """The configs to build: those of ``configs`` whose name matches one of ``patterns`` (a comma-separated
    string or an iterable of fnmatch patterns); all of them when there are none. A pattern without wildcards
    that matches none of them but is a valid config name selects that config; a pattern that selects
    nothing is a ValueError naming ``what``. Order follows ``configs``, then extra names in pattern order."""
    if isinstance(patterns, str) or patterns is None:
        patterns = (patterns or "").split(",")
    patterns = [p.strip() for p in patterns if p.strip()]
    pool = list(configs)
    if not patterns:
        return pool
    chosen, seen, unmatched = [], set(), []
    for pattern in patterns:
        hits = [c for c in pool if fnmatch.fnmatchcase(c.name, pattern)]
        if not hits and not any(ch in pattern for ch in "*?["):
            try:
                hits = [parse_name(pattern)]
            except ValueError as e:
                raise ValueError(f"{what}: {pattern!r} matches no listed config and is not a valid config name "
                                 f"either ({e})") from None
        if not hits:
            unmatched.append(pattern)
        for c in hits:
            if c.name not in seen:
                seen.add(c.name)
                chosen.append(c)
    if unmatched:
        raise ValueError(f"{what}: pattern(s) {', '.join(repr(p) for p in unmatched)} match no kernel config; "
                         f"available: {', '.join(c.name for c in pool)}")
    order = {c.name: i for i, c in enumerate(pool)}
    return sorted(chosen, key=lambda c: order.get(c.name, len(order)))


# Build families: (the list, the environment variable that selects from it, the config class). A variable
# selects from the union of its families, so a pattern need only match in one of them.
FAMILIES = {
    "fwd": (FORWARD_CONFIGS, ENV_VAR, KernelConfig),
    "bwd": (tuple(BACKWARD_CONFIGS), BWD_ENV_VAR, BackwardConfig),
    "sm90_fwd": (HOPPER_FORWARD_CONFIGS, ENV_VAR, HopperConfig),
    "sm90_bwd": (HOPPER_BACKWARD_CONFIGS, BWD_ENV_VAR, HopperBackwardConfig),
}


def selected(env: Mapping[str, str] | None = None) -> dict:
    """{family: configs to build} for every family of FAMILIES, from FLASHOP_KERNELS (forward) and
    FLASHOP_BWD_KERNELS (backward) in ``env`` (default os.environ), by :func:`select`."""
    env = os.environ if env is None else env
    out = {}
    for var in (ENV_VAR, BWD_ENV_VAR):
        families = [f for f, (_, v, _) in FAMILIES.items() if v == var]
        chosen = select(env.get(var, ""), [c for f in families for c in FAMILIES[f][0]], var)
        strays = [c.name for c in chosen if not any(type(c) is FAMILIES[f][2] for f in families)]
        if strays:
            raise ValueError(f"{var}: {', '.join(strays)} is not a {'backward' if var == BWD_ENV_VAR else 'forward'} "
                             "kernel config")
        for family in families:
            kind = FAMILIES[family][2]
            out[family] = [c for c in chosen if type(c) is kind]
    return {family: out[family] for family in FAMILIES}

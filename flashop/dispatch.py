"""The config-dispatch policy: which built kernel runs a given problem.

`choose_config(device, problem)` is a plain function of a device description
and the problem, so it is unit-tested on the CPU with described devices. The
CUDA kernels of the ops (csrc/cuda/ops_cuda.cpp) ask `config_for_call` at run
time, inside the op, once per problem: a graph traced by torch.compile keeps
choosing per call.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import tempfile
import warnings

import torch

from .configs import HopperBackwardConfig, HopperConfig, KernelConfig, parse_name

CPU_CONFIG = "cpu"


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the policy needs to know about a GPU."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum for one block

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(index: int) -> "DeviceInfo":
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
        return DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count, smem)


@dataclasses.dataclass(frozen=True)
class Problem:
    dtype: str  # "fp16" | "bf16"
    headdim: int
    seqlen_q: int
    seqlen_k: int
    batch_heads: int  # batch x query heads
    causal: bool
    direction: str = "forward"
    # A local window, softcap, ALiBi or sinks (csrc/attention_variants.h): only configs built with them run it.
    variants: bool = False
    # A packed batch (cu_seqlens): only configs with supports_packed run it. seqlen_q / seqlen_k are then
    # the longest sequences' and batch_heads counts sequences.
    packed: bool = False


_DTYPE_CODES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_code(dtype: torch.dtype) -> str | None:
    return _DTYPE_CODES.get(dtype)


def _native():
    from . import _C

    return _C


def hopper_module():
    """flashop._C_sm90 (wgmma + TMA forward kernels) when this build has it, else None."""
    try:
        from . import _C_sm90
    except ImportError:
        return None
    return _C_sm90


@functools.lru_cache(maxsize=None)
def _built(direction: str) -> tuple[str, ...]:
    native = _native()
    getter = getattr(native, f"built_{direction}_configs", None)
    names = tuple(getter()) if native.WITH_CUDA and getter is not None else ()
    hopper = hopper_module()
    if hopper is None:
        return names
    return names + tuple(getattr(hopper, f"built_{direction}_configs")())


def built_configs(direction: str = "forward") -> list[str]:
    """Names of the CUDA kernel configs compiled into this build."""
    return list(_built(direction))


def dtype_and_headdim(name: str) -> tuple[str, int]:
    """What a built config name says it takes: forward `bf16.d128...`, backward `bwd.bf16.d128...`."""
    config = parse_config(name)
    return config.dtype, config.headdim


@functools.lru_cache(maxsize=None)
def _built_widths(direction: str) -> dict:
    """dtype code -> the widest built kernel's tile width: the per-call check stays a lookup."""
    widest = {}
    for dtype, width in map(dtype_and_headdim, _built(direction)):
        widest[dtype] = max(widest.get(dtype, 0), width)
    return widest


def kernel_headdim(headdim: int) -> int:
    """The head dimension a CUDA kernel runs for `headdim`: the next multiple of 8 (16-byte rows). The
    CUDA ops pad q, k, v (and the backward's out, dout) with zero columns to it when it differs."""
    return -(-headdim // 8) * 8


NO_KERNEL_HINT = "CUDA kernels take float16/bfloat16 with headdim 1 to 256"


def check_config(config: str | None, device: torch.device, dtype: torch.dtype, headdim: int, direction: str,
                 deterministic: bool = False, variants: bool = False, packed: bool = False):
    """The rules for `config=`; the same in eager kernels and fake kernels. With config=None on CUDA,
    some built kernel must take this dtype and headdim. A named wgmma backward config (`sm90.bwd.`)
    cannot be deterministic; a named config built without the attention variants cannot run them
    (`variants`: meta.variants_requested, read off the arguments as given), nor one built without packed
    batches a packed batch (`packed`: cu_seqlens given)."""
    op = f"flashop.{direction}"
    if config is None:
        if device.type == "cuda":
            code = dtype_code(dtype) or str(dtype).removeprefix("torch.")
            if not kernel_headdim(headdim) <= _built_widths(direction).get(code, 0):
                built = built_configs(direction)
                raise RuntimeError(
                    f"{op}: no built CUDA kernel runs {code} headdim {headdim} (built: {', '.join(built) or 'none'}); "
                    f"{NO_KERNEL_HINT}")
        return
    if device.type != "cuda":
        if config != CPU_CONFIG:
            raise RuntimeError(f"{op}: config '{config}' is not a CPU kernel config; the CPU backend has one kernel, "
                               f"config=None or '{CPU_CONFIG}'")
        return
    if deterministic and config.startswith("sm90.bwd."):
        raise RuntimeError(f"{op}: kernel config '{config}' adds dQ with atomics in any order; "
                           "deterministic=True needs an mma.sync backward config (bwd.*) or config=None")
    built = _built(direction)
    if config not in built:
        raise RuntimeError(f"{op}: unknown kernel config '{config}'; built configs: {', '.join(built) or '(none)'}")
    config_dtype, config_headdim = dtype_and_headdim(config)
    if config_dtype != dtype_code(dtype) or config_headdim < kernel_headdim(headdim):
        raise RuntimeError(f"{op}: kernel config '{config}' is for {config_dtype} headdim up to {config_headdim}, "
                           f"but the inputs are {dtype} headdim {headdim}")
    if variants and not runs_variants(parse_config(config)):
        raise RuntimeError(f"{op}: kernel config '{config}' is built without the attention variants (window, "
                           "softcap, alibi_slopes, learnable_sink); name another config or pass config=None")
    if packed and not runs_packed(parse_config(config)):
        raise RuntimeError(f"{op}: kernel config '{config}' does not run packed batches (cu_seqlens); name an "
                           "mma.sync config or pass config=None")


# ---------------------------------------------------------------- the policy

# Heuristic preference for the mma.sync forward, best first, as (block_m, block_n, warps, flags), from
# per-config timings on an H200. Configs not built or not fitting the device are skipped; the first
# that remains wins.
_KV2 = ("kv2",)
_QREG = ("qreg",)


def heuristic_order(problem: "Problem") -> list:
    d, seqlen, causal = problem.headdim, problem.seqlen_k, problem.causal
    if d <= 32:
        return [(128, 128, 4, ()), (128, 64, 4, ()), (64, 64, 4, ())]
    if d <= 64:
        order = [(128, 64, 4, _KV2), (128, 64, 4, ()), (128, 128, 4, _KV2), (128, 128, 4, ()), (64, 64, 4, ())]
        if causal and seqlen <= 512:  # measured: 64-row tiles with Q in registers, 2-3% faster there
            order.insert(0, (64, 64, 4, _QREG))
        return order
    if d <= 96:
        return [(128, 64, 4, _KV2), (128, 64, 4, ()), (128, 32, 4, ()), (64, 64, 4, ())]
    if d <= 128:
        order = [(128, 64, 4, _KV2), (128, 64, 4, ()), (128, 32, 4, _KV2), (128, 32, 4, ()), (128, 64, 8, ()),
                 (64, 64, 4, ())]
        if problem.dtype == "fp16" and causal:  # measured: fp16 causal runs a little faster without kv2
            order[0], order[1] = order[1], order[0]
        return order
    # d192/d256: 128-row tiles need 8 warps and one block per SM; on short (or causal, hence lighter)
    # problems two 64-row blocks per SM win.
    short = seqlen <= (4096 if causal else 2048)
    large = [(128, 64, 8, ()), (128, 64, 8, _KV2)]
    small = [(64, 64, 4, ()), (64, 64, 4, _KV2), (64, 32, 4, ())]
    return small + large if short else large + small


# Seqlen_k (non-causal, causal) from which the larger Hopper tile of a headdim is picked: 192 query rows
# at d64 (three consumer warpgroups), 192 keys at d128, 80 keys at d256. Fewer softmax, rescale and
# barrier rounds per FLOP; a causal query tile sees fewer keys, so the larger tile pays off later.
# d128 192 keys: 1-3% ahead of 176 from 2k non-causal and 2-3% at causal 8k-16k (H100).
LARGE_HOPPER_TILE_FROM = {64: (0, 2048), 128: (2048, 8192), 256: (1024, 1024)}
# Seqlen_k (non-causal, causal) below which the persistent kernel with its own O tile and two Q buffers
# is picked: with few key tiles per query tile, the per-tile prologue and epilogue it overlaps with the
# neighbouring tiles are a large share. Non-causal in the plain order (with its split tail): d128 2k
# 597 vs 571 TFLOP/s for the 192-key multicast build (H100, bf16). Causal with tiles taken at run time
# ("pers.dyn"): d128 causal 2k +8% and 4k +4-5% over the multicast build; from 8k the 192-key one-tile
# kernel is ahead. d256 has no room for the O tile and keeps one tile per CTA.
PERSISTENT_HOPPER_BELOW = {64: (2048, 4096), 128: (4096, 8192)}
# Seqlen_k (non-causal, causal) below which several CTAs per SM of 64 query rows each (one consumer
# warpgroup) are picked, ahead of the persistent kernel: one CTA's prologue and epilogue run under the
# others' GEMMs. Three per SM where built ("cta3", d64): causal 1k 0.90-0.94x cuDNN against 0.87x for
# two (H100); from 2k causal the persistent kernel and the 192-row tile are as fast or faster. None at
# d128: its short causal problems run tiles taken at run time (causal 512: 334 vs 295 TFLOP/s for two
# CTAs per SM).
MULTI_CTA_HOPPER_BELOW = {64: (0, 2048), 128: (0, 0)}
# Seqlen_k from which non-causal problems run the K/V multicast build ("mc": clusters of two CTAs sharing
# each K/V tile) of the one-tile-per-CTA pick: the fastest build at d256 from 4k (the one-tile kernel
# 0.96-0.98), d128 from 8k, d64 at 16k (1-2%; H200 tuner). At d128 it applies only to problems with fewer
# query tiles than SMs (PERSISTENT_REGISTER_O_FROM takes the rest).
MULTICAST_HOPPER_FROM = {64: 16384, 128: 8192, 256: 4096}
# Causal seqlen_k range [from, to) in which the multicast build of the pick runs instead of its "tmao"
# sibling. Causal problems launch it without clusters, so it runs the same algorithm, yet it measured 1-6%
# faster (d256 causal 1k-16k, d128 B_c = 128 causal 2k-8k; H200); the cause is not identified (the builds
# differ only in code the causal launch does not execute). d128 causal below 8k runs tiles taken at run
# time (PERSISTENT_HOPPER_BELOW), so the d128 range applies only to builds without them.
MULTICAST_BUILD_CAUSAL = {128: (2048, 8192), 256: (1024, 1 << 62)}
# Seqlen_k from which non-causal problems with at least one query tile per SM run the persistent 192-key
# kernel that stores O from registers ("pers.rego": the next tile's Q loads by halves under this tile's
# end, one warpgroup starts the next tile while the other finishes this one, and the split tail evens out
# the last waves), ahead of the one-tile-per-CTA picks: 3-6% faster at d128 4k-16k in both dtypes (H100,
# bf16 8k 686 vs 655 TFLOP/s); at 2k the persistent 128-key kernel stays 2% ahead, at 1k 10%. With fewer
# tiles than SMs it would leave SMs idle (nothing to split), where the one-tile kernel's split last wave
# shares each tile's keys out over pieces.
PERSISTENT_REGISTER_O_FROM = {128: 4096}
# Tile widths whose backward default on compute capability 9.0 is the wgmma kernel (sm90.bwd.*) rather
# than the first listed mma.sync config: 1.15-1.28x the fastest mma.sync backward at d128 (H200, bf16,
# 1k-16k, causal or not); 0.86-0.91x cuDNN at d64 against the mma.sync default's 0.67-0.73x (H200, 1k-16k,
# causal or not); 1.30-1.34x at d96 and 1.13-1.37x at d160-256 (H100, bf16, 4k, causal or not). A problem an mma.sync tile narrower than the
# wgmma kernel's holds (d32) keeps the mma.sync kernel: the wgmma one would compute twice its columns.
HOPPER_BACKWARD_HEADDIMS = (64, 96, 128, 160, 192, 224, 256)
# Seqlen_k (non-causal, causal) below which the wgmma backward runs its B_c = 64 build (one consumer warpgroup,
# two CTAs per SM: one CTA's K/V loads and dK/dV stores run under the other's steps) instead of B_c = 128:
# d64 1k 1.08x (causal 1.15x), from 8k 0.95-0.97x with each key tile loading its own Q and dO (H200).
HOPPER_BACKWARD_BC64_BELOW = {64: (2048, 8192)}
# Seqlen_k (non-causal, causal) from which dense problems run the wgmma backward's B_r = 128 build (128 queries a
# step: twice the tensor work per step's fixed costs) ahead of both: d64 1.01x the best B_r = 64 build at 1k,
# 1.05-1.10x from 2k, causal 1.06-1.10x from 8k where B_c = 64 leads below (H200, bf16 and fp16).
HOPPER_BACKWARD_BR128_FROM = {64: (1024, 8192)}
# Seqlen_k from which causal problems run the wgmma backward's longest-first build (".lpt": the longest key tiles
# start first, the short ones fill the last wave): d128 1.00-1.03x the plain build at 4k, 1.01-1.04x at 8k and 16k,
# 0.96-0.99x at 2k (H200, bf16 and fp16, two tuner runs).
HOPPER_BACKWARD_LPT_FROM = {128: 4096}


def mma_sync_backward_config(q: torch.Tensor, k: torch.Tensor, causal: bool, variants: bool = False,
                             packed: tuple[int, int, int] | None = None) -> str:
    """The policy's backward pick among the mma.sync configs only: deterministic=True needs one (the
    wgmma backward adds dQ with atomics in any order)."""
    device = DeviceInfo.of(q.device.index if q.device.index is not None else torch.cuda.current_device())
    problem = problem_of(q, k, causal, "backward", variants, packed)
    built = [n for n in built_configs("backward") if not n.startswith("sm90.bwd.")]
    return choose_config(device, problem, built, tuned_entries(device.name))[0]


def _hopper_variant(hopper: list, problem: "Problem", sm_count: int) -> tuple[str, str]:
    """Among the built Hopper ping-pong configs: below the length in MULTI_CTA_HOPPER_BELOW the 64-row
    tiles run three (or two) CTAs per SM; else below the length in PERSISTENT_HOPPER_BELOW the
    persistent kernel with a separate O staging tile (causal: tiles taken at run time); otherwise
    one tile per CTA with the TMA-store epilogue, which measured the fastest of all built configs on
    nearly every longer shape: the hardware block scheduler balances unequal causal tiles better than
    a static stride. Of its tile sizes, the largest from the
    length in LARGE_HOPPER_TILE_FROM (fewer softmax, rescale and barrier rounds per FLOP), else the
    smallest (more CTAs, a narrower causal diagonal); non-causal from the length in MULTICAST_HOPPER_FROM,
    its K/V multicast build where there is one. Long non-causal problems with a query tile per SM or more
    run the persistent kernel that stores O from registers instead, from the length in
    PERSISTENT_REGISTER_O_FROM."""
    area = lambda c: c.block_m * c.block_n  # noqa: E731
    multi_non_causal, multi_causal = MULTI_CTA_HOPPER_BELOW.get(problem.headdim, (0, 0))
    multi_cta = [c for c in hopper if c.block_m == 64 and c.stages == 2]
    if multi_cta and problem.seqlen_k < (multi_causal if problem.causal else multi_non_causal):
        pick = max(multi_cta, key=lambda c: (c.ctas_per_sm, area(c)))
        return pick.name, f"heuristic: the Hopper wgmma + TMA kernel on compute capability 9.0, " \
                          f"{pick.ctas_per_sm} CTAs per SM, {pick.block_m} x {pick.block_n} tiles"
    below_non_causal, below_causal = PERSISTENT_HOPPER_BELOW.get(problem.headdim, (0, 0))
    # Causal: tiles taken at run time ("dyn"), else longest first; non-causal: the plain order (with its split tail).
    persistent = [c for c in hopper if c.persistent and c.separate_o and c.stages == 2
                  and (c.dynamic or c.longest_first) == problem.causal]
    if persistent and problem.seqlen_k < (below_causal if problem.causal else below_non_causal):
        pick = min(persistent, key=lambda c: (area(c), not c.dynamic))
        order = ", tiles taken at run time" if pick.dynamic else ", longest first" if pick.longest_first else ""
        return pick.name, f"heuristic: the Hopper wgmma + TMA kernel on compute capability 9.0, persistent{order}, " \
                          f"{pick.block_m} x {pick.block_n} tiles"
    register_o = max((c for c in hopper if c.persistent and not c.tma_store), key=area, default=None)
    if (register_o is not None and not problem.causal
            and problem.seqlen_k >= PERSISTENT_REGISTER_O_FROM.get(problem.headdim, 1 << 62)
            and -(-problem.seqlen_q // register_o.block_m) * problem.batch_heads >= sm_count):
        pick = register_o
        return pick.name, f"heuristic: the Hopper wgmma + TMA kernel on compute capability 9.0, persistent, " \
                          f"O stored from registers, {pick.block_m} x {pick.block_n} tiles"
    per_tile = ([c for c in hopper if c.tma_store and not c.persistent and c.stages == 2 and not c.multicast
                 and c.block_m >= 128]
                or [c for c in hopper if not c.persistent] or hopper)
    from_non_causal, from_causal = LARGE_HOPPER_TILE_FROM.get(problem.headdim, (1 << 62, 1 << 62))
    large = problem.seqlen_k >= (from_causal if problem.causal else from_non_causal)
    pick = max(per_tile, key=area) if large else min(per_tile, key=area)
    walk = "persistent" if pick.persistent else "one tile per CTA"
    causal_from, causal_to = MULTICAST_BUILD_CAUSAL.get(problem.headdim, (1 << 62, 0))
    if (problem.seqlen_k >= MULTICAST_HOPPER_FROM.get(problem.headdim, 1 << 62) if not problem.causal
            else causal_from <= problem.seqlen_k < causal_to):
        multicast = [c for c in hopper if c.multicast and c.name == pick.name.replace(".tmao", ".mc.tmao")]
        if multicast:
            pick = multicast[0]
            walk = "the multicast build without clusters" if problem.causal else \
                "clusters of two CTAs sharing K/V (multicast)"
    return pick.name, f"heuristic: the Hopper wgmma + TMA kernel on compute capability 9.0, {walk}, " \
                      f"{pick.block_m} x {pick.block_n} tiles"


def _shape_of(config: KernelConfig):
    return (config.block_m, config.block_n, config.warps, config.flags)


# The config a name denotes, by its family's prefix (one parser for the generator, the policy and the tests).
parse_config = parse_name


def runs_on(config, capability: tuple[int, int]) -> bool:
    if isinstance(config, (HopperConfig, HopperBackwardConfig)):
        return config.runs_on(capability)  # sm_90a code runs on compute capability 9.0 only
    return capability[0] * 10 + capability[1] >= getattr(config, "min_sm", 80)


def runs_variants(config) -> bool:
    """Whether a config's kernel is built with the attention variants (every mma.sync config is)."""
    return getattr(config, "supports_variants", True)


def runs_packed(config) -> bool:
    """Whether a config's kernel runs packed batches (cu_seqlens; configs.py supports_packed)."""
    return getattr(config, "supports_packed", False)


def candidates(device: DeviceInfo, problem: Problem, built: list[str]) -> list:
    """Built configs that run this problem on this device: the dtype matches, shared memory fits and,
    in each kernel family, the tile width is the narrowest built one that holds the head dimension
    (wider tiles only add zero columns to every product). A Hopper backward ".lpt" build only for causal
    problems (it runs the others in its plain sibling's order)."""
    fitting = []
    for name in built:
        config = parse_config(name)
        if isinstance(config, HopperBackwardConfig) and config.longest_first and not problem.causal:
            continue
        if (config.dtype == problem.dtype and config.headdim >= kernel_headdim(problem.headdim)
                and config.smem_bytes() <= device.smem_per_block and runs_on(config, device.capability)
                and (not problem.variants or runs_variants(config))
                and (not problem.packed or runs_packed(config))):
            fitting.append(config)
    narrowest = {}
    for config in fitting:
        narrowest[type(config)] = min(narrowest.get(type(config), 1 << 30), config.headdim)
    return [c for c in fitting if c.headdim == narrowest[type(c)]]


def choose_config(device: DeviceInfo, problem: Problem, built: list[str], tuned: dict | None = None):
    """The policy: (config name, reason). Tuned-cache hit for this device and problem bucket, else the
    heuristic table; only built configs that fit the device. Raises RuntimeError when none can run."""
    pool = candidates(device, problem, built)
    if not pool:
        raise RuntimeError(
            f"flashop.{problem.direction}: no built CUDA kernel runs {problem.dtype} headdim {problem.headdim} on "
            f"{device.name} (built: {', '.join(built) or 'none'}); {NO_KERNEL_HINT}")
    name, reason = _choose(device, problem, pool, tuned)
    width = parse_config(name).headdim
    if width != problem.headdim:
        padded = kernel_headdim(problem.headdim)
        how = "" if padded == problem.headdim else f" (padded to {padded})"
        reason += f"; headdim {problem.headdim}{how} on the narrowest built tile width that holds it, {width}"
    return name, reason


def _choose(device: DeviceInfo, problem: Problem, pool: list, tuned: dict | None):
    names = {c.name: c for c in pool}
    key = bucket_key(problem)
    if tuned and tuned.get(key) in names:
        return tuned[key], f"tuned cache entry {key}"
    if problem.direction == "backward":
        hopper_bwd = [c for c in pool if isinstance(c, HopperBackwardConfig)]
        mma_sync_width = min((c.headdim for c in pool if not isinstance(c, HopperBackwardConfig)), default=1 << 30)
        if hopper_bwd and hopper_bwd[0].headdim in HOPPER_BACKWARD_HEADDIMS and hopper_bwd[0].headdim <= mma_sync_width:
            width = hopper_bwd[0].headdim
            tall = [c for c in hopper_bwd if c.block_m == 128]  # built for dense problems only
            start = HOPPER_BACKWARD_BR128_FROM.get(width, (1 << 62, 1 << 62))[problem.causal]
            if problem.seqlen_k >= start and tall:
                return tall[0].name, (f"backward on compute capability 9.0, seqlen_k {problem.seqlen_k} >= {start}: "
                                      "the wgmma kernel with 128 queries a step")
            below = HOPPER_BACKWARD_BC64_BELOW.get(width, (0, 0))[problem.causal]
            short = [c for c in hopper_bwd if c.block_n == 64 and not c.longest_first]
            if problem.seqlen_k < below and short:
                return short[0].name, (f"backward on compute capability 9.0, seqlen_k {problem.seqlen_k} < {below}: "
                                       "the wgmma kernel at two CTAs per SM")
            lpt = [c for c in hopper_bwd if c.longest_first and c.name == hopper_bwd[0].name + ".lpt"]
            lpt_from = HOPPER_BACKWARD_LPT_FROM.get(width, 1 << 62)
            if problem.causal and problem.seqlen_k >= lpt_from and lpt:
                return lpt[0].name, (f"backward on compute capability 9.0, causal, seqlen_k {problem.seqlen_k} >= "
                                     f"{lpt_from}: the wgmma kernel, longest key tiles first")
            return hopper_bwd[0].name, "backward default on compute capability 9.0: the wgmma kernel"
        # Backward configs are listed best first per headdim (flashop/configs.py, BACKWARD_CONFIGS).
        pool = [c for c in pool if not isinstance(c, HopperBackwardConfig)] or pool
        return pool[0].name, "backward default: first listed config that is built and fits"
    hopper = [c for c in pool if isinstance(c, HopperConfig) and c.pingpong]
    if hopper:
        return _hopper_variant(hopper, dataclasses.replace(problem, headdim=hopper[0].headdim), device.sm_count)
    pool = [c for c in pool if isinstance(c, KernelConfig)]
    order = heuristic_order(dataclasses.replace(problem, headdim=pool[0].headdim))
    rank = {shape: i for i, shape in enumerate(order)}
    ranked = sorted(pool, key=lambda c: (rank.get(_shape_of(c), len(order)), -c.block_m, -c.block_n))
    best = ranked[0]
    # Too few query tiles to fill the GPU: smaller query tiles give more blocks.
    tiles = -(-problem.seqlen_q // best.block_m) * problem.batch_heads
    if tiles < device.sm_count:
        smaller = [c for c in ranked if c.block_m < best.block_m]
        if smaller:
            return smaller[0].name, (f"heuristic: {tiles} query tiles of {best.block_m} rows would not fill "
                                     f"{device.sm_count} SMs; B_r={smaller[0].block_m}")
    return best.name, "heuristic table" + ("" if _shape_of(best) in rank else " (fallback: largest tiles)")


def problem_of(q: torch.Tensor, k: torch.Tensor, causal: bool, direction: str, variants: bool = False,
               packed: tuple[int, int, int] | None = None) -> Problem:
    """packed: (sequences, max_seqlen_q, max_seqlen_k) of a packed batch, q (total_q, Hq, D)."""
    dtype = dtype_code(q.dtype) or str(q.dtype).removeprefix("torch.")
    if packed is not None:
        batch, seqlen_q, seqlen_k = packed
        return Problem(dtype, q.size(-1), seqlen_q, seqlen_k, batch * q.size(1), bool(causal), direction,
                       bool(variants), True)
    return Problem(dtype, q.size(-1), q.size(1), k.size(1), q.size(0) * q.size(2), bool(causal), direction,
                   bool(variants))


def config_for(q: torch.Tensor, k: torch.Tensor, causal: bool, direction: str, variants: bool = False,
               packed: tuple[int, int, int] | None = None) -> str:
    """The policy's pick for the problem of q and k on q's device."""
    device = DeviceInfo.of(q.device.index if q.device.index is not None else torch.cuda.current_device())
    return _choose_cached(device, problem_of(q, k, causal, direction, variants, packed))


def config_for_call(direction: str, q: torch.Tensor, k: torch.Tensor, causal: bool, variants: bool, requested: bool,
                    packed: tuple[int, int, int] | None, deterministic: bool, config: str | None) -> str:
    """The kernel config a CUDA call of the op runs: the rules of check_config, then the named config or the
    policy's pick (for a deterministic backward, among the mma.sync configs). csrc/cuda/ops_cuda.cpp asks this
    once per problem and keeps the answer until clear_caches(). causal and variants: after the window is
    normalised (csrc/checks.cpp check_variants); requested: the arguments as given (meta.variants_requested);
    packed: (sequences, max_seqlen_q, max_seqlen_k) of a packed batch."""
    check_config(config, q.device, q.dtype, q.size(-1), direction, deterministic, variants=requested,
                 packed=packed is not None)
    if config is not None:
        return config
    config = config_for(q, k, causal, direction, variants, packed)
    if direction == "backward" and deterministic and config.startswith("sm90.bwd."):
        config = mma_sync_backward_config(q, k, causal, variants, packed)  # no ordered wgmma mode
    return config


def clear_caches():
    """Forget every pick made so far (the tuned cache is read again on the next call): after the tuned cache
    or the policy's tables change."""
    _loaded_cache.clear()
    _choose_cached.cache_clear()
    native = _native()
    if native.WITH_CUDA:
        native._clear_config_picks()


@functools.lru_cache(maxsize=4096)
def _choose_cached(device: DeviceInfo, problem: Problem) -> str:
    return choose_config(device, problem, built_configs(problem.direction), tuned_entries(device.name))[0]


# ---------------------------------------------------------------- the tuned cache

CACHE_FORMAT = "flashop-tuned-configs"
CACHE_VERSION = 1


def cache_path() -> str:
    root = os.environ.get("FLASHOP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flashop")
    return os.path.join(root, f"tuned_v{CACHE_VERSION}.json")


def _pow2_bucket(n: int, lo: int, hi: int) -> int:
    """Round up to a power of two, clamped: problems in one bucket share a tuned config."""
    n = max(lo, min(hi, n))
    return 1 << (n - 1).bit_length()


def bucket_key(problem: Problem) -> str:
    return "|".join([
        problem.direction,
        problem.dtype,
        f"d{problem.headdim}",
        "causal" if problem.causal else "full",
        f"q{_pow2_bucket(problem.seqlen_q, 64, 65536)}",
        f"k{_pow2_bucket(problem.seqlen_k, 64, 65536)}",
        f"bh{_pow2_bucket(problem.batch_heads, 1, 4096)}",
    ])


_warned_paths: set[str] = set()


def _warn_once(path: str, why: str):
    if path not in _warned_paths:
        _warned_paths.add(path)
        warnings.warn(f"flashop: ignoring the tuned-config cache {path}: {why}", RuntimeWarning, stacklevel=3)


def read_cache(path: str | None = None) -> dict:
    """{device name: {bucket key: config name}}; a missing file is empty, a corrupt, partial or
    foreign-version file is ignored with one warning."""
    path = path or cache_path()
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        _warn_once(path, f"unreadable ({err.__class__.__name__}: {err})")
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        _warn_once(path, "not a flashop cache file")
        return {}
    if data.get("version") != CACHE_VERSION:
        _warn_once(path, f"version {data.get('version')!r}, this flashop reads version {CACHE_VERSION}")
        return {}
    entries = data.get("devices")
    if not isinstance(entries, dict) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in entries.values()):
        _warn_once(path, "malformed entries")
        return {}
    return entries


def write_cache(updates: dict, path: str | None = None) -> str:
    """Merge {device name: {bucket key: config name}} into the cache file. Concurrent writers are
    serialised by a lock file; each write lands atomically (temporary file + rename), so a reader
    never sees a partial file."""
    path = path or cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        devices = read_cache(path)
        for device, entries in updates.items():
            devices.setdefault(device, {}).update(entries)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuned-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": CACHE_FORMAT, "version": CACHE_VERSION, "devices": devices}, f, indent=1,
                      sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    clear_caches()
    return path


_loaded_cache: dict = {}


def tuned_entries(device_name: str) -> dict:
    """This process's view of the cache for one device, read once."""
    if "devices" not in _loaded_cache:
        _loaded_cache["devices"] = read_cache()
    return _loaded_cache["devices"].get(device_name, {})

"""The config-dispatch policy on described devices, and the tuned-config cache. CPU only: the policy
is a plain function of a device description and the problem."""
import dataclasses
import json
import multiprocessing
import warnings

import pytest
import torch

from flashop import dispatch
from flashop.configs import (BACKWARD_CONFIGS, FORWARD_CONFIGS, HOPPER_BACKWARD_CONFIGS, HOPPER_FORWARD_CONFIGS,
                             KernelConfig, parse_backward)
from flashop.dispatch import DeviceInfo, Problem

ALL_BUILT = [c.name for c in FORWARD_CONFIGS] + [c.name for c in HOPPER_FORWARD_CONFIGS]
DEVICES = {
    "A100": DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912),
    "H100": DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448),
    "RTX4090": DeviceInfo("NVIDIA GeForce RTX 4090", (8, 9), 128, 101376),
    "sm120": DeviceInfo("Some future part", (12, 0), 188, 101376),
}
PROBLEMS = [
    Problem(dtype, d, s, s + extra, bh, causal)
    for dtype in ("fp16", "bf16")
    for d in (1, 8, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
    for s, extra, bh in ((1, 4095, 32), (512, 0, 2048), (4096, 0, 128), (16384, 0, 32), (1000, 3, 5))
    for causal in (False, True)
]


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
def test_policy_returns_a_built_config_that_fits(device):
    for problem in PROBLEMS:
        name, reason = dispatch.choose_config(device, problem, ALL_BUILT)
        config = dispatch.parse_config(name)
        assert name in ALL_BUILT, (problem, name)
        # The Hopper family where it runs (9.0), at every headdim and length; the mma.sync family elsewhere.
        hopper_takes = device.capability == (9, 0)
        assert name.startswith("sm90.") == hopper_takes, (device, problem, name)
        hopper_candidates = any(c.name.startswith("sm90.") for c in dispatch.candidates(device, problem, ALL_BUILT))
        assert hopper_candidates == hopper_takes, (device, problem)
        assert config.dtype == problem.dtype, (problem, name)
        assert config.headdim == narrowest_width(device, problem, ALL_BUILT, type(config)), (problem, name)
        assert config.smem_bytes() <= device.smem_per_block, (device, problem, name)
        assert reason


def narrowest_width(device, problem, built, family):
    """The narrowest tile width of a kernel family that holds the problem's headdim (rounded up to a
    multiple of 8) and fits the device: the width the policy must run it at."""
    configs = [dispatch.parse_config(n) for n in built]
    return min(c.headdim for c in configs if type(c) is family and c.dtype == problem.dtype
               and c.headdim >= -(-problem.headdim // 8) * 8 and c.smem_bytes() <= device.smem_per_block
               and dispatch.runs_on(c, device.capability))


def test_policy_uses_small_query_tiles_when_the_gpu_would_idle():
    h100 = dataclasses.replace(DEVICES["H100"], capability=(8, 0))  # the mma.sync family's rule
    few = Problem("bf16", 128, 512, 512, 4, False)  # 4 tiles of 128 rows for 132 SMs
    many = Problem("bf16", 128, 8192, 8192, 64, False)
    assert KernelConfig.parse(dispatch.choose_config(h100, few, ALL_BUILT)[0]).block_m == 64
    assert KernelConfig.parse(dispatch.choose_config(h100, many, ALL_BUILT)[0]).block_m == 128


def test_hopper_variant_by_length():
    h100 = DEVICES["H100"]
    pick = lambda s, causal, d=128: dispatch.choose_config(h100, Problem("fp16", d, s, s, 64, causal), ALL_BUILT)[0]  # noqa: E731
    # Short causal: three (d64) or two (d128) CTAs of 64 query rows per SM; short non-causal: the
    # persistent kernel with its own O staging tile.
    assert pick(512, True, 64) == pick(1024, True, 64) == "sm90.fp16.d64.br64.bc64.cta3.tmao"
    # d128 causal below 8k and d64 causal 2k: the persistent kernel with tiles taken at run time.
    assert pick(512, True) == pick(1024, True) == pick(2048, True) == pick(4096, True) == \
        "sm90.fp16.d128.br128.bc128.pers.dyn"
    assert pick(2048, True, 64) == "sm90.fp16.d64.br128.bc128.pers.dyn"
    # Without the three-CTA build, two CTAs per SM.
    no_cta3 = [n for n in ALL_BUILT if ".cta3." not in n]
    assert dispatch.choose_config(h100, Problem("fp16", 64, 512, 512, 64, True), no_cta3)[0] == \
        "sm90.fp16.d64.br64.bc128.tmao"
    assert pick(512, False, 64) == pick(1024, False, 64) == "sm90.fp16.d64.br128.bc128.pers"
    assert pick(512, False) == pick(1024, False) == pick(2048, False) == "sm90.fp16.d128.br128.bc128.pers"
    # Longer: one tile per CTA, the wider tiles from LARGE_HOPPER_TILE_FROM.
    assert pick(8192, True) == pick(16384, True) == "sm90.fp16.d128.br128.bc192.tmao"  # wide key tiles
    assert pick(2048, False, 64) == pick(4096, True, 64) == "sm90.fp16.d64.br192.bc128.tmao"  # 3 consumer WGs
    assert pick(512, False, 256) == pick(512, True, 256) == "sm90.fp16.d256.br128.bc64.tmao"
    assert pick(1024, False, 256) == "sm90.fp16.d256.br128.bc80.tmao"
    # Long non-causal d128 with a query tile per SM or more: the persistent kernel storing O from registers;
    # with fewer tiles (it has no split for them), the K/V multicast build of the one-tile pick.
    assert pick(4096, False) == pick(8192, False) == pick(16384, False) == "sm90.fp16.d128.br128.bc192.pers.rego"
    few_tiles = lambda s, bh: dispatch.choose_config(h100, Problem("fp16", 128, s, s, bh, False), ALL_BUILT)[0]  # noqa: E731
    assert few_tiles(8192, 3) == "sm90.fp16.d128.br128.bc192.pers.rego"  # 192 tiles
    assert few_tiles(8192, 2) == "sm90.fp16.d128.br128.bc192.mc.tmao"  # 128 tiles for 132 SMs
    assert few_tiles(4096, 4) == "sm90.fp16.d128.br128.bc192.tmao"
    assert pick(4096, False, 256) == "sm90.fp16.d256.br128.bc80.mc.tmao"
    assert pick(16384, False, 64) == "sm90.fp16.d64.br192.bc128.mc.tmao"
    assert pick(8192, False, 64) == "sm90.fp16.d64.br192.bc128.tmao"
    # Causal: the multicast build (launched without clusters) where it measured faster than its sibling;
    # at d128 (2k-4k) only without the persistent causal builds (run-time tiles, longest first).
    no_persistent_causal = [n for n in ALL_BUILT if not n.endswith((".dyn", ".lpt"))]
    for s in (2048, 4096):
        assert dispatch.choose_config(h100, Problem("fp16", 128, s, s, 64, True), no_persistent_causal)[0] == \
            "sm90.fp16.d128.br128.bc128.mc.tmao"
    assert pick(1024, True, 256) == pick(16384, True, 256) == "sm90.fp16.d256.br128.bc80.mc.tmao"
    for s in (1024, 4096, 16384):
        assert ".mc." not in pick(s, True, 64)
    # Without the multicast, 64-row, 192-key and run-time-tile builds the policy picks as before them.
    older = [n for n in ALL_BUILT if ".mc." not in n and ".br64." not in n and ".bc192." not in n
             and not n.endswith(".dyn")]
    assert dispatch.choose_config(h100, Problem("fp16", 128, 16384, 16384, 64, False), older)[0] == \
        "sm90.fp16.d128.br128.bc176.tmao"
    assert dispatch.choose_config(h100, Problem("fp16", 64, 512, 512, 64, True), older)[0] == \
        "sm90.fp16.d64.br128.bc128.pers.lpt"
    # Persistent picks only where the O tile has room of its own (not d256, not 176-key tiles), or O is
    # stored from registers.
    for s in (512, 1024, 4096, 16384):
        for causal in (False, True):
            for d in (64, 128, 256):
                config = dispatch.parse_config(pick(s, causal, d))
                assert not config.persistent or config.separate_o or not config.tma_store
    # Without the persistent and TMA-store builds the plain Hopper kernel still serves.
    plain = [n for n in ALL_BUILT if not n.endswith((".pers", ".tmao", ".lpt"))]
    assert dispatch.choose_config(h100, Problem("fp16", 128, 1024, 1024, 64, False), plain)[0] == "sm90.fp16.d128.br128.bc128"


def test_policy_prefers_a_tuned_entry_and_ignores_bad_ones():
    h100, problem = DEVICES["H100"], Problem("bf16", 128, 4096, 4096, 128, True)
    key = dispatch.bucket_key(problem)
    assert dispatch.choose_config(h100, problem, ALL_BUILT)[0] == "sm90.bf16.d128.br128.bc128.pers.dyn"
    assert dispatch.choose_config(h100, problem, ALL_BUILT, {key: "bf16.d128.br128.bc32.w4"}) == (
        "bf16.d128.br128.bc32.w4", f"tuned cache entry {key}")
    default = dispatch.choose_config(h100, problem, ALL_BUILT)[0]
    for bad in ("bf16.d128.br256.bc64.w8",  # not built
                "fp16.d128.br128.bc32.w4",  # wrong dtype
                "bf16.d64.br128.bc64.w4"):  # wrong headdim
        assert dispatch.choose_config(h100, problem, ALL_BUILT, {key: bad})[0] == default
    # Built, but does not fit a 99 KB device: never chosen there, whatever the cache says.
    problem = Problem("bf16", 256, 4096, 4096, 128, True)
    big = "bf16.d256.br128.bc64.w8.kv2"
    assert KernelConfig.parse(big).smem_bytes() > DEVICES["RTX4090"].smem_per_block
    key = dispatch.bucket_key(problem)
    assert dispatch.choose_config(DEVICES["RTX4090"], problem, ALL_BUILT, {key: big})[0] != big


def test_short_causal_headdim_64_takes_64_row_tiles_with_q_in_registers():
    pick = lambda s, causal: dispatch.choose_config(DEVICES["A100"], Problem("bf16", 64, s, s, 2048, causal), ALL_BUILT)[0]  # noqa: E731
    assert pick(512, True) == "bf16.d64.br64.bc64.w4.qreg"
    assert pick(1024, True) == pick(512, False) == "bf16.d64.br128.bc64.w4.kv2"


def test_policy_with_a_partial_build():
    built = ["bf16.d128.br64.bc64.w4"]
    problem = Problem("bf16", 128, 8192, 8192, 64, False)
    assert dispatch.choose_config(DEVICES["H100"], problem, built)[0] == "bf16.d128.br64.bc64.w4"
    with pytest.raises(RuntimeError, match="no built CUDA kernel runs fp16 headdim 128"):
        dispatch.choose_config(DEVICES["H100"], Problem("fp16", 128, 64, 64, 1, False), built)
    with pytest.raises(RuntimeError, match="no built CUDA kernel runs bf16 headdim 130"):
        dispatch.choose_config(DEVICES["H100"], Problem("bf16", 130, 64, 64, 1, False), built)
    # Any headdim runs at the narrowest built width that holds it.
    assert dispatch.choose_config(DEVICES["H100"], Problem("bf16", 72, 64, 64, 1, False), built)[0] == built[0]


def test_bucket_key():
    assert dispatch.bucket_key(Problem("bf16", 128, 3000, 3000, 100, True)) == "forward|bf16|d128|causal|q4096|k4096|bh128"
    assert dispatch.bucket_key(Problem("fp16", 64, 1, 70000, 1, False)) == "forward|fp16|d64|full|q64|k65536|bh1"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOP_CACHE_DIR", str(tmp_path))
    dispatch._warned_paths.clear()
    return tmp_path


def test_cache_round_trip(cache_dir):
    assert dispatch.read_cache() == {}
    path = dispatch.write_cache({"GPU A": {"k1": "bf16.d128.br128.bc64.w4"}})
    dispatch.write_cache({"GPU A": {"k2": "bf16.d64.br128.bc128.w4"}, "GPU B": {"k1": "fp16.d64.br64.bc64.w4"}})
    assert path.startswith(str(cache_dir))
    assert dispatch.read_cache() == {"GPU A": {"k1": "bf16.d128.br128.bc64.w4", "k2": "bf16.d64.br128.bc128.w4"},
                                     "GPU B": {"k1": "fp16.d64.br64.bc64.w4"}}
    assert dispatch.tuned_entries("GPU B") == {"k1": "fp16.d64.br64.bc64.w4"}


@pytest.mark.parametrize("content", ["{not json", '{"format": "flashop-tuned-configs", "version": 1, "dev',
                                     "[1, 2, 3]", '{"format": "other", "version": 1, "devices": {}}',
                                     '{"format": "flashop-tuned-configs", "version": 1, "devices": {"x": {"k": 3}}}'],
                         ids=["garbage", "truncated", "list", "foreign", "malformed"])
def test_cache_corrupt_file_is_ignored_with_one_warning(cache_dir, content):
    with open(dispatch.cache_path(), "w") as f:
        f.write(content)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-config cache"):
        assert dispatch.read_cache() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.read_cache() == {}  # once per file, not per call
    dispatch.write_cache({"GPU": {"k": "bf16.d128.br128.bc64.w4"}})  # a write replaces the bad file
    assert dispatch.read_cache() == {"GPU": {"k": "bf16.d128.br128.bc64.w4"}}


def test_cache_version_mismatch(cache_dir):
    with open(dispatch.cache_path(), "w") as f:
        json.dump({"format": dispatch.CACHE_FORMAT, "version": dispatch.CACHE_VERSION + 1,
                   "devices": {"GPU": {"k": "bf16.d128.br128.bc64.w4"}}}, f)
    with pytest.warns(RuntimeWarning, match="version"):
        assert dispatch.read_cache() == {}


def _writer(args):
    cache, worker = args
    import os

    os.environ["FLASHOP_CACHE_DIR"] = cache
    from flashop import dispatch as d

    for i in range(10):
        d.write_cache({"GPU": {f"w{worker}-{i}": "bf16.d128.br128.bc64.w4"}})


def test_cache_concurrent_writers(cache_dir):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(cache_dir), w) for w in range(4)])
    entries = dispatch.read_cache()["GPU"]
    assert sorted(entries) == sorted(f"w{w}-{i}" for w in range(4) for i in range(10))


ALL_BUILT_BACKWARD = [c.name for c in BACKWARD_CONFIGS] + [c.name for c in HOPPER_BACKWARD_CONFIGS]


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
def test_backward_policy_returns_a_built_config_that_fits(device):
    for forward_problem in PROBLEMS:
        problem = dataclasses.replace(forward_problem, direction="backward")
        fitting = [c for c in BACKWARD_CONFIGS if c.dtype == problem.dtype
                   and c.headdim >= -(-problem.headdim // 8) * 8 and c.smem_bytes() <= device.smem_per_block]
        if not fitting:  # e.g. d256 backward needs more shared memory than a 99 KB part has
            with pytest.raises(RuntimeError, match="no built CUDA kernel runs"):
                dispatch.choose_config(device, problem, ALL_BUILT_BACKWARD)
            continue
        width = min(c.headdim for c in fitting)
        fitting = [c for c in fitting if c.headdim == width]
        name, _ = dispatch.choose_config(device, problem, ALL_BUILT_BACKWARD)
        hopper = [c for c in HOPPER_BACKWARD_CONFIGS if c.dtype == problem.dtype
                  and c.headdim >= -(-problem.headdim // 8) * 8]
        if device.capability == (9, 0) and hopper:
            narrowest = min(hopper, key=lambda c: c.headdim)
            if narrowest.headdim in dispatch.HOPPER_BACKWARD_HEADDIMS and narrowest.headdim <= width:
                # The wgmma kernel of that width (which build: test_backward_d64_policy_by_seqlen).
                assert name.startswith("sm90.bwd.") and dispatch.parse_config(name).headdim == narrowest.headdim, name
                continue
        assert name == fitting[0].name  # the first listed mma.sync config that fits
        assert parse_backward(name).smem_bytes() <= device.smem_per_block


def test_backward_wgmma_kernel_only_on_compute_capability_9_0():
    problem = dispatch.Problem("bf16", 128, 4096, 4096, 16, False, "backward")
    assert dispatch.choose_config(DEVICES["H100"], problem, ALL_BUILT_BACKWARD)[0] == "sm90.bwd.bf16.d128.br64.bc128"
    assert dispatch.choose_config(DEVICES["A100"], problem, ALL_BUILT_BACKWARD)[0].startswith("bwd.")
    d64 = dataclasses.replace(problem, headdim=64, seqlen_q=16384, seqlen_k=16384)
    assert dispatch.choose_config(DEVICES["H100"], d64, ALL_BUILT_BACKWARD)[0] == "sm90.bwd.bf16.d64.br128.bc128"
    # A problem a narrower mma.sync tile holds keeps it: the wgmma kernel's narrowest width is 64.
    d32 = dataclasses.replace(problem, headdim=32)
    assert dispatch.choose_config(DEVICES["H100"], d32, ALL_BUILT_BACKWARD)[0].startswith("bwd.bf16.d32.")


def test_backward_d64_policy_by_seqlen():
    """d64 dense problems from HOPPER_BACKWARD_BR128_FROM (non-causal, causal) run the B_r = 128 build; below it,
    and for windows and packed batches (which B_r = 128 is built without), the B_c = 64 build below
    HOPPER_BACKWARD_BC64_BELOW and B_c = 128 from there. Without a build the next rule applies; other widths keep
    B_c = 128."""
    h100 = DEVICES["H100"]
    for dtype in ("bf16", "fp16"):
        short, default = f"sm90.bwd.{dtype}.d64.br64.bc64", f"sm90.bwd.{dtype}.d64.br64.bc128"
        tall = f"sm90.bwd.{dtype}.d64.br128.bc128"
        for causal in (False, True):
            below = dispatch.HOPPER_BACKWARD_BC64_BELOW[64][causal]
            start = dispatch.HOPPER_BACKWARD_BR128_FROM[64][causal]
            assert start <= below, "the B_r = 128 build takes over from B_c = 64 for dense problems"
            for seqlen in sorted({start // 2, start - 1, start, below - 1, below, 4 * below}):
                problem = dispatch.Problem(dtype, 64, seqlen, seqlen, 16, causal, "backward")
                short_or_default = short if seqlen < below else default
                expected = tall if seqlen >= start else short_or_default
                assert dispatch.choose_config(h100, problem, ALL_BUILT_BACKWARD)[0] == expected, (problem, expected)
                for p in (dataclasses.replace(problem, variants=True), dataclasses.replace(problem, packed=True)):
                    assert dispatch.choose_config(h100, p, ALL_BUILT_BACKWARD)[0] == short_or_default, p
                without_tall = [n for n in ALL_BUILT_BACKWARD if n != tall]
                assert dispatch.choose_config(h100, problem, without_tall)[0] == short_or_default, problem
                without_either = [n for n in without_tall if n != short]
                assert dispatch.choose_config(h100, problem, without_either)[0] == default, problem
    d128 = dispatch.Problem("bf16", 128, 1024, 1024, 16, True, "backward")
    assert dispatch.choose_config(h100, d128, ALL_BUILT_BACKWARD)[0] == "sm90.bwd.bf16.d128.br64.bc128"


def test_backward_causal_long_problems_take_the_lpt_build():
    """Causal problems from HOPPER_BACKWARD_LPT_FROM run the width's ".lpt" build (dense, variants and packed alike:
    it has both); below it, non-causal problems and widths not listed keep the plain build, as does a tree without
    the lpt build."""
    h100 = DEVICES["H100"]
    for width, start in dispatch.HOPPER_BACKWARD_LPT_FROM.items():
        for dtype in ("bf16", "fp16"):
            plain = f"sm90.bwd.{dtype}.d{width}.br64.bc128"
            for seqlen, causal, expected in ((start, True, plain + ".lpt"), (4 * start, True, plain + ".lpt"),
                                             (start - 1, True, plain), (start, False, plain)):
                problem = dispatch.Problem(dtype, width, seqlen, seqlen, 16, causal, "backward")
                for p in (problem, dataclasses.replace(problem, variants=True), dataclasses.replace(problem, packed=True)):
                    assert dispatch.choose_config(h100, p, ALL_BUILT_BACKWARD)[0] == expected, (p, expected)
            problem = dispatch.Problem(dtype, width, 4 * start, 4 * start, 16, True, "backward")
            without = [n for n in ALL_BUILT_BACKWARD if not n.endswith(".lpt")]
            assert dispatch.choose_config(h100, problem, without)[0] == plain
    for width in (160, 192, 224, 256):
        assert width not in dispatch.HOPPER_BACKWARD_LPT_FROM
        problem = dispatch.Problem("bf16", width, 16384, 16384, 16, True, "backward")
        assert not dispatch.choose_config(h100, problem, ALL_BUILT_BACKWARD)[0].endswith(".lpt")


def test_backward_lpt_builds_are_causal_tuner_candidates_not_defaults():
    """The Hopper backward ".lpt" builds are candidates (what flashop.tune times) for causal problems at their
    widths, not for the others (where they run the plain order); at 2k (below HOPPER_BACKWARD_LPT_FROM) the
    policy's pick stays the plain build."""
    h100 = DEVICES["H100"]
    for width in (128, 160, 192, 224, 256):
        for dtype in ("bf16", "fp16"):
            default = next(c.name for c in HOPPER_BACKWARD_CONFIGS
                           if c.dtype == dtype and c.headdim == width and not c.longest_first)
            plain = next(c.name for c in HOPPER_BACKWARD_CONFIGS  # the build that has an lpt build and the variants
                         if c.dtype == dtype and c.headdim == width and not c.longest_first
                         and c.block_n not in (96, 80) and not c.role_split)
            for causal in (True, False):
                problem = dispatch.Problem(dtype, width, 2048, 2048, 16, causal, "backward")
                names = [c.name for c in dispatch.candidates(h100, problem, ALL_BUILT_BACKWARD)]
                assert (plain + ".lpt" in names) == causal and plain in names and default in names
                assert dispatch.choose_config(h100, problem, ALL_BUILT_BACKWARD)[0] == default
                # A window or a packed batch takes a build with the variants (B_c = 96 at d192, B_c = 80 and the
                # role split at d256 have none).
                for other in (dataclasses.replace(problem, variants=True), dataclasses.replace(problem, packed=True)):
                    assert dispatch.choose_config(h100, other, ALL_BUILT_BACKWARD)[0] == plain
            if width == 256:  # dense problems: B_c = 80 (FlashAttention-3's tile), else the role split
                assert default == f"sm90.bwd.{dtype}.d256.br64.bc80"
                problem = dispatch.Problem(dtype, width, 8192, 8192, 16, False, "backward")
                without = [n for n in ALL_BUILT_BACKWARD if not n.endswith(".bc80")]
                assert dispatch.choose_config(h100, problem, without)[0] == f"sm90.bwd.{dtype}.d256.br64.bc64.rs"


def test_policy_report_lists_every_family_and_both_picks():
    """python -m flashop.policy: built configs of both directions (mma.sync, Hopper forward and
    backward names) with their shared memory, and the policy's pick per direction for a shape."""
    from flashop import policy
    built = {"forward": [c.name for c in FORWARD_CONFIGS] + [c.name for c in HOPPER_FORWARD_CONFIGS],
             "backward": ALL_BUILT_BACKWARD}
    lines = policy.describe(built, DEVICES["H100"], (4, 8192, 8192, 16, 128), "bf16", True)
    text = "\n".join(lines)
    assert f"built forward configs ({len(built['forward'])})" in text
    assert f"built backward configs ({len(ALL_BUILT_BACKWARD)})" in text
    assert "sm90.bwd.bf16.d128.br64.bc128" in text and "sm90.bf16.d128.br128.bc176.tmao" in text
    fwd = next(line for line in lines if line.lstrip().startswith("forward ("))
    bwd = next(line for line in lines if line.lstrip().startswith("backward ("))
    forward_problem = dispatch.Problem("bf16", 128, 8192, 8192, 64, True)
    assert dispatch.choose_config(DEVICES["H100"], forward_problem, built["forward"])[0] in fwd
    assert "sm90.bwd.bf16.d128.br64.bc128" in bwd
    # A part that cannot run a headdim says so instead of failing.
    lines = policy.describe(built, DEVICES["RTX4090"], (1, 1024, 1024, 8, 256), "bf16", False)
    assert any("backward: " in line and "no built CUDA kernel runs" in line for line in lines)


def test_named_wgmma_backward_cannot_be_deterministic():
    """The rule the CUDA kernel and the fake kernel share (eager and trace time): a named sm90.bwd config
    has no ordered dQ mode."""
    with pytest.raises(RuntimeError, match="deterministic=True needs an mma.sync backward config"):
        dispatch.check_config("sm90.bwd.bf16.d128.br64.bc128", torch.device("cuda"), torch.bfloat16, 128, "backward",
                              deterministic=True)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_variant_problems_get_configs_built_with_the_variants(direction, monkeypatch):
    """A window, softcap, ALiBi or sinks rules out the kernels built without them (supports_variants), in the
    policy's pick and for a named config alike."""
    built = ALL_BUILT if direction == "forward" else ALL_BUILT_BACKWARD
    for seqlen in (1024, 4096, 16384):
        for causal in (False, True):
            problem = dispatch.Problem("bf16", 128, seqlen, seqlen, 64, causal, direction, variants=True)
            name, _ = dispatch.choose_config(DEVICES["H100"], problem, built)
            assert dispatch.runs_variants(dispatch.parse_config(name)), name
    refusing = [n for n in built if not dispatch.runs_variants(dispatch.parse_config(n))
                and dispatch.dtype_and_headdim(n)[0] == "bf16"]
    if direction == "forward":
        assert refusing, "the B_c = 192 one-tile Hopper forward kernels are built without the variants"
    monkeypatch.setattr(dispatch, "_built", lambda _direction: built)
    for name in refusing:
        width = dispatch.dtype_and_headdim(name)[1]
        with pytest.raises(RuntimeError, match=f"'{name}' is built without the attention variants"):
            dispatch.check_config(name, torch.device("cuda"), torch.bfloat16, width, direction, variants=True)
        dispatch.check_config(name, torch.device("cuda"), torch.bfloat16, width, direction)  # dense: fine

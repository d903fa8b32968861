"""Hopper (sm_90a) forward kernels of flashop._C_sm90 against a float64 reference.

Skipped unless a GPU of compute capability 9.0 is present and the module is built.
"""

import math

import pytest
import torch

import flashop
from conftest import capture_cuda_graph
from reference import assert_close_to_reference, attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a compute capability 9.0 GPU")

if HOPPER:
    try:
        import flashop._C_sm90 as sm90
    except ImportError as e:  # pragma: no cover
        pytestmark = pytest.mark.skip(reason=f"flashop._C_sm90 not built: {e}")
        sm90 = None
else:
    sm90 = None


def built():
    return list(sm90.built_forward_configs()) if sm90 is not None else []


def parse(name):
    # "sm90.bf16.d128.br128.bc128"
    parts = name.split(".")
    dtype = torch.bfloat16 if parts[1] == "bf16" else torch.float16
    return dtype, int(parts[2][1:]), int(parts[3][2:]), int(parts[4][2:])


# Every Hopper forward config of the build list (flashop/configs.py); those not built are skipped.
CONFIGS = [c.name for c in flashop.configs.HOPPER_FORWARD_CONFIGS]
TMA_STORE_CONFIGS = [n for n in CONFIGS if n.endswith((".tmao", ".pers", ".pers.lpt", ".pers.dyn"))]
REGISTER_O_PERSISTENT_CONFIGS = [n for n in CONFIGS if n.endswith(".pers.rego")]


def reference(q, k, v, scale, causal, dtype=torch.float64):
    """Plain softmax attention in `dtype`; q (B,Sq,Hq,D), k/v (B,Sk,Hk,D). Returns out, lse."""
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (B,H,S,D)
    if Hq != Hk:
        kf = kf.repeat_interleave(Hq // Hk, dim=1)
        vf = vf.repeat_interleave(Hq // Hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see nothing
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.matmul(p, vf).transpose(1, 2)  # (B,Sq,Hq,D)
    return out, lse.float()


def check(name, q, k, v, causal, scale=None, atol=None):
    """Runs config `name` and checks out and lse against the float64 reference (check_output)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = sm90.forward(q, k, v, scale, causal, name)
    torch.cuda.synchronize()
    check_output(name, out, lse, q, k, v, causal, scale, atol)


def check_output(name, out, lse, q, k, v, causal, scale, atol=None):
    """out, lse of attention(q, k, v) against the float64 reference. atol: a fixed bound on |out - ref|
    instead of twice PyTorch's own low-precision error."""
    ref_out, ref_lse = reference(q, k, v, scale, causal)
    # PyTorch's own error: the same math in the low-precision dtype.
    lp_out, _ = reference(q, k, v, scale, causal, dtype=q.dtype)
    torch_err = (lp_out.double() - ref_out).abs().max().item()
    err = (out.double() - ref_out).abs().max().item()
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in out"
    bound = 2 * torch_err + 1e-3 if atol is None else atol
    assert err <= bound, f"{name}: max |out - ref| = {err} > {bound} (PyTorch's low-precision error {torch_err})"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead), "lse -inf rows differ"
    assert (out.transpose(1, 2)[dead] == 0).all(), "rows that see no key must be 0"
    if (~dead).any():
        lerr = (lse[~dead] - ref_lse[~dead]).abs().max().item()
        assert lerr <= 1e-3 + 1e-3 * ref_lse[~dead].abs().max().item(), f"lse error {lerr}"


def rand(B, S, H, D, dtype):
    return torch.randn(B, S, H, D, device="cuda", dtype=dtype)


def test_built_configs():
    names = built()
    assert names, "no sm90 config built"
    for n in names:
        assert n.startswith("sm90.")
        # The policy's fit check (flashop/configs.py) and the kernel's launch agree on shared memory.
        assert flashop.configs.HopperConfig.parse(n).smem_bytes() == sm90.forward_config_smem(n), n


# The ".mc" configs run non-causal shapes with an even number of query tiles as clusters of two CTAs (here
# (2, 256, 256), (1, 200, 129), (1, 400, 150), (1, 1024, 1024), and in test_many_tiles those with 1000 and 1500
# queries), the rest as the plain "tmao" kernel.
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "B,Sq,Sk,Hq,Hk",
    [
        (1, 128, 128, 1, 1),
        (2, 256, 256, 2, 2),
        (1, 1, 1, 1, 1),
        (1, 1, 300, 2, 2),      # Sq = 1
        (1, 77, 45, 2, 2),      # Sk < B_c, Sq not a tile multiple
        (1, 300, 333, 3, 3),    # ragged tails
        (2, 513, 1000, 2, 2),
        (1, 200, 129, 8, 2),    # GQA 8:2
        (1, 400, 150, 2, 1),    # causal Sq > Sk: zero rows
        (1, 1024, 1024, 4, 4),
        (1, 352, 352, 2, 2),    # Sk = 2 x 176: no partial key tile at B_c = 176
        (1, 300, 177, 2, 2),    # one key past a 176-key tile: a second tile with a single live key
        (1, 704, 704, 2, 2),    # 3 x 192 + 128: a narrow last key tile of exactly 128 keys (P V in 8
                                # k-steps); causal: each warpgroup's own last-tile width
    ],
)
def test_forward(name, causal, B, Sq, Sk, Hq, Hk):
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    check(name, rand(B, Sq, Hq, D, dtype), rand(B, Sk, Hk, D, dtype), rand(B, Sk, Hk, D, dtype),
          causal)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_qkv(name, causal):
    """q, k, v sliced from one packed (B, S, 3, H, D) tensor: row stride 3*H*D."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    B, S, H = 2, 321, 3
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=dtype)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check(name, q, k, v, causal)


@pytest.mark.parametrize("name", CONFIGS)
def test_causal_zero_rows(name):
    """Causal bottom-right with Sq > Sk: the first Sq - Sk rows see no key."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    q, k, v = rand(1, 260, 2, D, dtype), rand(1, 5, 2, D, dtype), rand(1, 5, 2, D, dtype)
    out, lse = sm90.forward(q, k, v, 1.0 / math.sqrt(D), True, name)
    torch.cuda.synchronize()
    assert torch.isneginf(lse[:, :, : 260 - 5]).all()
    assert (out[:, : 260 - 5] == 0).all()
    assert torch.isfinite(lse[:, :, 260 - 5 :]).all()
    check(name, q, k, v, True)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rate", [0.25, 3.0])
def test_scores_that_grow_along_keys(name, causal, rate):
    """Raw scores ~ rate * key index (+ noise): the row max grows on every key tile, so O and l are
    rescaled on every tile, at 3.0 by factors far below 2^-8 (old keys' weight vanishes), at 0.25 by
    factors near 1; against a float64 reference. Fixed bounds: scores of ~2000 make PyTorch's own low-precision
    reference (scores rounded to 16 bits) too coarse to bound the error; the kernel's own error is P and
    out rounded to 16 bits (|out| <= ~4: 4 x 2^-9 for bf16, 4 x 2^-11 for fp16, plus P's share)."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    B, S, H = 1, 700, 2
    q = 1.0 + 0.5 * torch.randn(B, S, H, D, device="cuda")  # q . ones / D ~ 1
    growth = rate * torch.arange(S, device="cuda", dtype=torch.float32)
    k = growth[None, :, None, None] / D + 0.3 * torch.randn(B, S, H, D, device="cuda")
    v = torch.randn(B, S, H, D, device="cuda")
    check(name, q.to(dtype), k.to(dtype), v.to(dtype), causal, atol=3e-2 if dtype == torch.bfloat16 else 6e-3)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("key", [10, 50])
def test_nan_key_poisons_its_head(name, key):
    """A NaN in one key makes every output row of its head NaN, as in the reference (the running max
    skips NaN, so it must come through the exponential and the row sum); keys in two different n8 column
    blocks of the score tile. The other head is unaffected."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    q, k, v = rand(1, 300, 2, D, dtype), rand(1, 300, 2, D, dtype), rand(1, 300, 2, D, dtype)
    k[0, key, 0, 3] = float("nan")
    out, lse = sm90.forward(q, k, v, 1.0 / math.sqrt(D), False, name)
    torch.cuda.synchronize()
    assert torch.isnan(out[0, :, 0]).all(), "rows that see a NaN score must be NaN"
    check_output(name, out[:, :, 1:], lse[:, 1:], *(t[:, :, 1:] for t in (q, k, v)), False, 1.0 / math.sqrt(D))


@pytest.mark.parametrize("name", TMA_STORE_CONFIGS + REGISTER_O_PERSISTENT_CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "B,Sq,Sk,Hq,Hk",
    [
        (2, 1000, 1000, 24, 8),  # 384 tiles: every persistent CTA walks ~3 (132 SMs), GQA 3:1
        (1, 1000, 100, 40, 40),  # causal: 7 of each head's 8 query tiles see no key, so key-less and
                                 # keyed tiles alternate inside a CTA (the q_full/q_empty hand-shake;
                                 # .pers.lpt: the 40 keyed tiles first, then key-less ones only)
        (3, 130, 70, 64, 64),    # 2 query tiles; the second has 2 rows: box clipped at Sq, 2nd box not issued
        (1, 1, 2000, 300, 300),  # Sq = 1: 300 tiles of 16 key tiles; the K/V ring phases run across tiles
        (3, 1500, 1500, 7, 1),   # 12 x 21 = 252 tiles, Hq * B = 21 (not a power of 2, B > 1), GQA 7:1: the
                                 # .pers.lpt walk (q_tile from t / (Hq * B), head and batch from t % (Hq * B))
    ],
)
def test_many_tiles(name, causal, B, Sq, Sk, Hq, Hk):
    """More tiles than SMs: the persistent kernel's tile walk, K/V ring and Q/O-staging hand-over across tiles
    (".pers.rego": the Q halves' hand-over; (3, 130, ...): the second half of the last query tile not loaded)."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    check(name, rand(B, Sq, Hq, D, dtype), rand(B, Sk, Hk, D, dtype), rand(B, Sk, Hk, D, dtype), causal)


def split_tail_expected(name, tiles, Sk, causal):
    """Whether the persistent kernel shares out its last waves' key tiles (fwd_launch.cuh, stream_k_plan):
    a config with the split (HopperConfig.split_tail), non-causal, more tiles than SMs leaving the last wave
    at least 1% idle, and two key tiles or more per tile."""
    cfg = flashop.configs.HopperConfig.parse(name)
    grid = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count)
    waves, rest = divmod(tiles, grid)
    return (cfg.split_tail and not causal and tiles > grid and rest != 0 and -(-Sk // cfg.block_n) >= 2
            and (grid - rest) * 100 >= grid * (waves + 1))


PERSISTENT_CONFIGS = [n for n in CONFIGS if n.endswith((".pers", ".pers.rego"))]
SPLIT_TAIL_CASES = {  # name: (query heads as a function of the SM count, Sk); 200 queries = 2 query tiles
    "one wave and one tile": (lambda sms: (sms + 2) // 2, 1000),  # every tile shared out, most of them cut
    "two waves and a sixth": (lambda sms: sms + sms // 6, 300),   # whole tiles first, then the split part
    "whole waves": (lambda sms: sms, 1000),                       # no idle SM: no split
    "one key tile": (lambda sms: (sms + 2) // 2, 100),            # nothing to cut: no split
}


@pytest.mark.parametrize("name", PERSISTENT_CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(SPLIT_TAIL_CASES))
def test_split_tail(name, causal, case):
    """The persistent kernel's split tail: whether it runs (forward_config_workspace > 0) as its rule says, and the
    values of tiles finished from two CTAs' parts (MQA, a ragged last key tile, a short last query tile)."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    heads, Sk = SPLIT_TAIL_CASES[case]
    Hq = heads(torch.cuda.get_device_properties(0).multi_processor_count)
    split = split_tail_expected(name, 2 * Hq, Sk, causal)
    assert (sm90.forward_config_workspace(name, 1, 200, Sk, Hq, causal) > 0) == split
    if case in ("one wave and one tile", "two waves and a sixth") and not causal:
        assert split == flashop.configs.HopperConfig.parse(name).split_tail
    check(name, rand(1, 200, Hq, D, dtype), rand(1, Sk, 1, D, dtype), rand(1, Sk, 1, D, dtype), causal)


def assert_graph_replays_match_eager(name, q, k, v):
    """Capture one non-causal launch of config `name` in a CUDA graph, then three times: new random q, k, v
    (in place), replay, and assert the same bits as an eager launch on the same inputs."""
    D = q.shape[-1]
    graph, (out, lse) = capture_cuda_graph(lambda: sm90.forward(q, k, v, D ** -0.5, False, name))
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        ref_out, ref_lse = sm90.forward(q, k, v, D ** -0.5, False, name)
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


SPLIT_LAST_WAVE_CONFIGS = [n for n in TMA_STORE_CONFIGS if flashop.configs.HopperConfig.parse(n).split_last_wave]
SPLIT_LAST_WAVE_CASES = {  # name: (query heads from the SM count, Sq, Sk, whether the split runs)
    # 2 query tiles per head (3 at B_r = 192 would not pair up: 200 rows are 2 tiles there too); the SMs
    # plus 4 tiles: the last 4 (2 multicast pairs) run in pieces
    "a few tiles past whole rounds": (lambda sms: sms // 2 + 2, 200, 2000, True),
    "fewer tiles than SMs": (lambda sms: 3, 200, 3000, True),      # the whole grid in pieces
    "odd query tiles": (lambda sms: sms // 3 + 2, 300, 1500, True),  # 3 tiles a head: no multicast pairs
    "whole rounds": (lambda sms: sms // 2, 200, 2000, False),       # no idle SM: no split
    "one key tile": (lambda sms: 3, 200, 60, False),                # nothing to cut
}


@pytest.mark.parametrize("name", SPLIT_LAST_WAVE_CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(SPLIT_LAST_WAVE_CASES))
def test_split_last_wave(name, causal, case):
    """The one-tile-per-CTA kernels' split last wave: whether it runs (forward_config_workspace > 0; never causal)
    and the values of tiles merged from several pieces (MQA, a ragged last key tile, short last query tiles)."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    heads, Sq, Sk, split = SPLIT_LAST_WAVE_CASES[case]
    Hq = heads(torch.cuda.get_device_properties(0).multi_processor_count)
    if "br192" in name and case == "odd query tiles":
        Sq = 500  # 3 tiles of 192 rows
    assert (sm90.forward_config_workspace(name, 1, Sq, Sk, Hq, causal) > 0) == (split and not causal)
    check(name, rand(1, Sq, Hq, D, dtype), rand(1, Sk, 1, D, dtype), rand(1, Sk, 1, D, dtype), causal)


@pytest.mark.parametrize("name", [n for n in TMA_STORE_CONFIGS if ".pers" not in n and n not in SPLIT_LAST_WAVE_CONFIGS])
def test_no_split_last_wave_where_not_declared(name):
    """The one-tile-per-CTA kernels without the split (d256, several CTAs per SM) take no workspace on a
    shape the others would split: configs.py's split_last_wave says what the kernels do."""
    if name not in built():
        pytest.skip(f"{name} not built")
    assert sm90.forward_config_workspace(name, 1, 200, 3000, 3, False) == 0


@pytest.mark.parametrize("name", [n for n in SPLIT_LAST_WAVE_CONFIGS if n.startswith("sm90.bf16.")])
def test_split_last_wave_in_cuda_graph(name):
    """Replays of a captured launch: the arrival counters are zeroed on every replay (a count left over would
    let a piece merge before the others have stored their parts, or let no piece write the rows); the result
    is the same bits as an eager launch's, and right."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    Hq = 3
    assert sm90.forward_config_workspace(name, 2, 200, 3000, Hq, False) > 0
    q, k, v = rand(2, 200, Hq, D, dtype), rand(2, 3000, Hq, D, dtype), rand(2, 3000, Hq, D, dtype)
    # Bitwise: the pieces are merged in a fixed order, whichever finishes last.
    assert_graph_replays_match_eager(name, q, k, v)
    check(name, q, k, v, False)


@pytest.mark.parametrize("name", [n for n in PERSISTENT_CONFIGS if flashop.configs.HopperConfig.parse(n).split_tail])
def test_split_tail_in_cuda_graph(name):
    """Replays of a captured launch: the workspace flags are cleared on every replay (a flag left set would let
    a CTA read its neighbour's part before it is written)."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, D, _, _ = parse(name)
    Hq = torch.cuda.get_device_properties(0).multi_processor_count // 2 + 1
    assert sm90.forward_config_workspace(name, 1, 200, 1000, Hq, False) > 0
    q, k, v = rand(1, 200, Hq, D, dtype), rand(1, 1000, 1, D, dtype), rand(1, 1000, 1, D, dtype)
    assert_graph_replays_match_eager(name, q, k, v)


def tma_store_reference(name):
    """The config test_tma_store_matches_plain_store compares `name` with: the plain-store config of the same
    shape (the name minus its last suffix) where it is in CONFIGS; else, for a ".pers" config, the ".tmao" one
    of the same shape (B_c = 176 has no plain-store build; the persistent kernel's tile walk, Q/O-staging
    hand-over and K/V ring phases across tiles are then what differs); a ".pers.lpt" or ".pers.dyn" config:
    its ".pers" sibling (only the tile order differs); a ".tmao" config without a plain-store build of its shape
    (B_c = 192): the ".pers.rego" one (the persistent walk, the Q halves and the store from registers differ);
    a ".st3" config: its 2-stage sibling (only the K/V ring depth
    differs); a ".cta3" config: its two-CTA sibling (only the register budget differs); a ".mc" config: the same kernel without multicast (only where K/V come from differs). None:
    nothing to compare with."""
    if ".mc." in name:
        sibling = name.replace(".mc.", ".")
        return sibling if sibling in CONFIGS else None
    for suffix in (".st3.", ".cta3."):
        if suffix in name:
            sibling = name.replace(suffix, ".")
            return sibling if sibling in CONFIGS else None
    if name.endswith((".pers.lpt", ".pers.dyn")):
        sibling = name[: -len(".lpt")]
        return sibling if sibling in CONFIGS else None
    plain = name.rsplit(".", 1)[0]
    if plain in CONFIGS:
        return plain
    if name.endswith(".pers") and plain + ".tmao" in CONFIGS:
        return plain + ".tmao"
    if name.endswith(".tmao") and plain + ".pers.rego" in CONFIGS:
        return plain + ".pers.rego"
    return None


@pytest.mark.parametrize("name", TMA_STORE_CONFIGS)
def test_tma_store_matches_plain_store(name):
    """The TMA-store epilogue writes what the plain-store kernel writes (same main loop, so equal up to
    rounding of fused operations: a swizzle or row mistake would be far off); see tma_store_reference.
    ".pers.lpt" and ".pers.dyn" against ".pers" and ".mc" against its sibling: the same code per tile (in another tile
    order; with K/V loaded by two CTAs), so bit for bit equal."""
    if name not in built():
        pytest.skip(f"{name} not built")
    plain = tma_store_reference(name)
    if plain is None:
        pytest.skip(f"{name}: no plain-store config of this shape")
    if plain not in built():
        pytest.skip(f"{plain} not built")
    dtype, D, _, _ = parse(name)
    # ".mc": 700 queries are an even number of query tiles at B_r 128 and 192 (non-causal: clusters of two).
    shapes = [(False, 333), (True, 333)] + ([(False, 700)] if ".mc." in name else [])
    for causal, Sq in shapes:
        q, k, v = rand(2, Sq, 6, D, dtype), rand(2, 290, 3, D, dtype), rand(2, 290, 3, D, dtype)
        out, lse = sm90.forward(q, k, v, D ** -0.5, causal, name)
        ref_out, ref_lse = sm90.forward(q, k, v, D ** -0.5, causal, plain)
        torch.cuda.synchronize()
        if name.endswith((".lpt", ".dyn")) or ".mc." in name:
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"{name} vs {plain} (causal={causal})"
            continue
        eps = torch.finfo(dtype).eps
        # A split last wave or split tail (a workspace; the shape has fewer tiles than SMs) merges a tile's key
        # pieces, each of which rounded P to 16 bits against its own running max: then the two agree to a couple
        # of ulps of the output's scale, not of each value (still far below what a swizzle or row mistake gives).
        split = any(sm90.forward_config_workspace(n, 2, Sq, 290, 6, causal) > 0 for n in (name, plain))
        atol = 2 * eps * ref_out.abs().max().item() if split else 1e-5
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2 * eps, atol=atol,
                                   msg=lambda m: f"{name} vs {plain} (causal={causal}, split={split}): out: {m}")
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5 if split else 1e-6, atol=1e-6,
                                   msg=lambda m: f"{name} vs {plain} (causal={causal}, split={split}): lse: {m}")


def test_unknown_config():
    q = rand(1, 8, 1, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="unknown kernel config 'nope'; built configs: "):
        sm90.forward(q, q, q, 0.1, False, "nope")


def test_wrong_headdim():
    """A config of width W takes head dimensions up to W that are multiples of 8, no others."""
    names = [n for n in built() if parse(n)[1] == 128 and parse(n)[0] == torch.bfloat16]
    if not names:
        pytest.skip("no bf16 d128 config")
    for D, match in ((136, "head dimensions up to 128"), (60, "multiples of 8")):
        q = rand(1, 8, 1, D, torch.bfloat16)
        with pytest.raises(RuntimeError, match=match):
            sm90.forward(q, q, q, 0.1, False, names[0])


# ---------------------------------------------------------------- head dimensions below the tile width
# The kernels take the true head dimension D (a multiple of 8, up to the config's width W) at run time: the TMA
# maps' column extent is D (loads zero-fill columns >= D, stores drop them), the register stores are predicated.
# Per width, head dimensions that end inside a column block (64 columns at W = 64, 128, 192, 256; 32 at 96, 160,
# 224) and ones that leave whole column blocks past D (W = 256 at D = 120: blocks 2 and 3; W = 224 at D = 136: 5 and
# 6 of the 32-column blocks).
HEADDIMS_BELOW = {64: (8, 40), 96: (40, 80), 128: (72, 120), 160: (136, 152), 192: (136, 176),
                  224: (136, 216), 256: (120, 200, 248)}
BELOW_CASES = [(n, D) for n in CONFIGS for D in HEADDIMS_BELOW.get(parse(n)[1], ())]


def padded(B, S, H, W, D, dtype, fill=float("nan")):
    """A (B, S, H, D) view into a (B, S, H, W) buffer whose columns D .. W-1 hold `fill` (NaN: any read past
    the head dimension poisons the result), columns 0 .. D-1 random."""
    buf = torch.full((B, S, H, W), fill, device="cuda", dtype=dtype)
    buf[..., :D] = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
    return buf[..., :D]


def forward_into_nan_blocks(q, k, v, causal, name):
    """sm90.forward with NaN left in the caching allocator's free blocks of the outputs' sizes, so the fresh
    out and lse are allocated from memory that held NaN: an element the kernel does not write shows."""
    blocks = [torch.full(q.shape, float("nan"), device="cuda", dtype=q.dtype),
              torch.full((q.size(0), q.size(2), q.size(1)), float("nan"), device="cuda")]
    del blocks
    out, lse = sm90.forward(q, k, v, 1.0 / math.sqrt(q.shape[-1]), causal, name)
    torch.cuda.synchronize()
    return out, lse


def check_against_reference(name, q, k, v, causal, out, lse):
    """out and lse against tests/reference.py's float64 attention (out: FlashAttention's 2x criterion)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref_out, ref_lse = attention_reference(q, k, v, scale, causal)
    lp_out, _ = attention_reference(q, k, v, scale, causal, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert not torch.isnan(out).any(), f"{name}: NaN in out (a read past the head dimension, or an unwritten element)"
    assert_close_to_reference(out, ref_out, lp_out, name)
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), dead), "lse -inf rows differ"
    if (~dead).any():
        lerr = (lse[~dead] - ref_lse[~dead]).abs().max().item()
        assert lerr <= 1e-3 + 1e-3 * ref_lse[~dead].abs().max().item(), f"{name}: lse error {lerr}"


@pytest.mark.parametrize("name,D", BELOW_CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Sq,Sk,Hq,Hk", [(2, 300, 333, 4, 2), (1, 1000, 1100, 2, 2)])
def test_headdim_below_width(name, D, causal, B, Sq, Sk, Hq, Hk):
    """q, k, v of head dimension D < W, each a view into a buffer of width W whose columns past D are NaN."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, W, _, _ = parse(name)
    q, k, v = padded(B, Sq, Hq, W, D, dtype), padded(B, Sk, Hk, W, D, dtype), padded(B, Sk, Hk, W, D, dtype)
    assert not q.is_contiguous()
    out, lse = forward_into_nan_blocks(q, k, v, causal, name)
    check_against_reference(name, q, k, v, causal, out, lse)


@pytest.mark.parametrize("name,D", BELOW_CASES)
def test_headdim_below_width_packed_qkv(name, D):
    """q, k, v sliced from one packed (B, S, 3, H, W) buffer, NaN past column D: row stride 3 H W, D < W."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, W, _, _ = parse(name)
    B, S, H = 2, 321, 3
    qkv = torch.full((B, S, 3, H, W), float("nan"), device="cuda", dtype=dtype)
    qkv[..., :D] = torch.randn(B, S, 3, H, D, device="cuda", dtype=dtype)
    q, k, v = qkv[..., :D].unbind(2)
    out, lse = forward_into_nan_blocks(q, k, v, True, name)
    check_against_reference(name, q, k, v, True, out, lse)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("sm90.bf16.")])
def test_headdim_equal_width_ignores_padding(name):
    """D = W from a wider buffer (W + 64 columns, NaN past W): the kernel reads exactly W columns."""
    if name not in built():
        pytest.skip(f"{name} not built")
    dtype, W, _, _ = parse(name)
    q, k, v = (padded(1, 257, 2, W + 64, W, dtype) for _ in range(3))
    out, lse = forward_into_nan_blocks(q, k, v, False, name)
    check_against_reference(name, q, k, v, False, out, lse)


@pytest.mark.parametrize("case", ["rank", "batch", "heads", "headdim", "scale"])
def test_op_errors_on_the_hopper_path(case):
    """Bad inputs of shapes the policy routes to the Hopper kernels raise the messages of the CPU path."""
    q, k, v = (rand(2, 300, 4, 128, torch.bfloat16) for _ in range(3))
    assert flashop.dispatch.config_for(q, k, False, "forward").startswith("sm90.")
    scale = None
    if case == "rank":
        q = q[0]
    elif case == "batch":
        k, v = k[:1], v[:1]
    elif case == "heads":
        k, v = k[:, :, :3], v[:, :, :3]
    elif case == "headdim":
        k, v = k[..., :64], v[..., :64]
    else:
        scale = float("nan")
    with pytest.raises(RuntimeError) as on_cpu:
        torch.ops.flashop.forward(q.cpu(), k.cpu(), v.cpu(), scale)
    with pytest.raises(RuntimeError) as on_gpu:
        torch.ops.flashop.forward(q, k, v, scale)
    assert str(on_gpu.value).splitlines()[0] == str(on_cpu.value).splitlines()[0]

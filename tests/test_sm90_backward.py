"""The Hopper (sm_90a) backward kernels of flashop._C_sm90 (sm90.bwd.*), named explicitly, against the
float64 reference with FlashAttention's criterion; their routing (deterministic=True runs an mma.sync
config). Skipped unless a GPU of compute capability 9.0 is present and the module has them."""
import pytest
import torch

import flashop
from conftest import capture_cuda_graph
from flashop import dispatch
from flashop.configs import HopperBackwardConfig
from reference import assert_grad_close_to_reference, attention_reference
from test_forward import make_qkv

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
NAMES = [n for n in dispatch.built_configs("backward") if n.startswith("sm90.bwd.")] if HOPPER else []
pytestmark = pytest.mark.skipif(not NAMES, reason="needs a compute capability 9.0 GPU and sm90 backward kernels")
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (batch, seqlen_q, seqlen_k, heads_q, heads_k): one element; ragged tails of both tiles; GQA 8:2 with
# Sq > Sk (causal: the first query rows see no key); rows without keys; MQA over several key tiles;
# a long walk (both dS buffers and ring stages wrap many times); Sk >> Sq.
SHAPES = [(1, 1, 1, 1, 1), (2, 113, 257, 4, 4), (1, 257, 113, 8, 2), (1, 40, 16, 2, 2), (2, 300, 300, 4, 1),
          (1, 1000, 1000, 2, 2), (1, 64, 640, 2, 2)]


def _grads(name, q, k, v, dout, causal, deterministic=False):
    out, lse = torch.ops.flashop.forward(q, k, v, None, causal, None)
    return torch.ops.flashop.backward(dout, q, k, v, out, lse, None, causal, name, deterministic)


def _reference_grads(q, k, v, dout, causal, upcast):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, causal=causal, upcast=upcast)[0]
    return torch.autograd.grad(out, (q, k, v), dout.double() if upcast else dout)


def check(name, q, k, v, causal, dout=None):
    dout = torch.randn_like(q) if dout is None else dout
    ours = _grads(name, q, k, v, dout, causal)
    ref = _reference_grads(q, k, v, dout, causal, True)
    lowp = _reference_grads(q, k, v, dout, causal, False)
    for label, ours_g, ref_g, lowp_g, inp in zip(("dq", "dk", "dv"), ours, ref, lowp, (q, k, v)):
        assert ours_g.shape == inp.shape and ours_g.dtype == inp.dtype
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, label)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_sm90_backward_matches_reference(name, shape, causal):
    config = HopperBackwardConfig.parse(name)
    check(name, *make_qkv((*shape, config.headdim), _DTYPES[config.dtype], "cuda"), causal)


@pytest.mark.parametrize("name", NAMES)
def test_sm90_backward_strided_inputs_and_dout(name):
    config = HopperBackwardConfig.parse(name)
    dtype = _DTYPES[config.dtype]
    q, k, v = make_qkv((2, 77, 300, 4, 2, config.headdim), dtype, "cuda", layout="strided")
    dout = torch.randn(2, 4, 77, config.headdim, dtype=dtype, device="cuda").transpose(1, 2)
    check(name, q, k, v, True, dout)


@pytest.mark.parametrize("name", NAMES)
def test_sm90_backward_smem_matches_python(name):
    assert HopperBackwardConfig.parse(name).smem_bytes() == dispatch.hopper_module().backward_config_smem(name)


@pytest.mark.parametrize("name", NAMES)
def test_sm90_backward_refuses_deterministic(name):
    config = HopperBackwardConfig.parse(name)
    q, k, v = make_qkv((1, 64, 64, 2, 2, config.headdim), _DTYPES[config.dtype], "cuda")
    with pytest.raises(RuntimeError, match="deterministic=True needs an mma.sync backward config"):
        _grads(name, q, k, v, torch.randn_like(q), False, deterministic=True)


def test_deterministic_policy_pick_is_mma_sync(monkeypatch):
    """With the wgmma kernel as the policy's backward default, deterministic=True still gives
    bit-identical gradients (an mma.sync config with the ordered dQ adds)."""
    monkeypatch.setattr(dispatch, "HOPPER_BACKWARD_HEADDIMS", (128,))
    dispatch.clear_caches()
    try:
        q, k, v = make_qkv((2, 300, 300, 4, 2, 128), torch.bfloat16, "cuda")
        assert dispatch.config_for(q, k, True, "backward").startswith("sm90.bwd.")
        assert not dispatch.mma_sync_backward_config(q, k, True).startswith("sm90.")
        dout = torch.randn_like(q)
        runs = [_det_grads(q, k, v, dout) for _ in range(2)]
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    finally:
        dispatch.clear_caches()


def _det_grads(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flashop.flash_attn_func(q, k, v, causal=True, deterministic=True)
    return torch.autograd.grad(out, (q, k, v), dout)


# Each width at head dimensions below it (multiples of 8): the kernel reads nothing at or past
# headdim (TMA zero fill), writes nothing past it, and adds only zeros into its dQ accumulator's padding.
# Called through flashop._C_sm90 directly, with O and lse of the float64 reference.
# Wide widths (B_c = 64, each consumer owns half of D): headdims inside the first half (the second consumer
# stores and adds nothing), just past it, and inside the second half.
_SHORT_HEADDIMS = {64: (8, 40, 56), 96: (40, 72, 88), 128: (8, 64, 72, 120), 160: (72, 88, 152),
                   192: (8, 88, 136, 184), 224: (104, 120, 216), 256: (8, 136, 200, 248)}
_SHORT_SHAPES = [(2, 113, 257, 4, 4), (1, 257, 113, 8, 2), (1, 1, 1, 1, 1)]


def _direct_grads(name, q, k, v, dout, causal):
    """flashop._C_sm90.backward on O and lse of the float64 reference, softmax scale 1/sqrt(headdim)."""
    out, lse = attention_reference(q, k, v, causal=causal)
    return dispatch.hopper_module().backward(dout, q, k, v, out.to(q.dtype), lse, q.size(-1) ** -0.5, causal, False,
                                             name)


def check_direct(name, q, k, v, causal, dout):
    assert_grads_match_reference(_direct_grads(name, q, k, v, dout, causal), q, k, v, causal, dout)


def assert_grads_match_reference(ours, q, k, v, causal, dout):
    ref = _reference_grads(q, k, v, dout, causal, True)
    lowp = _reference_grads(q, k, v, dout, causal, False)
    for label, ours_g, ref_g, lowp_g, inp in zip(("dq", "dk", "dv"), ours, ref, lowp, (q, k, v)):
        assert ours_g.shape == inp.shape and ours_g.dtype == inp.dtype
        assert torch.isfinite(ours_g).all(), f"{label}: non-finite values (a read past the head dimension?)"
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, label)


def _short_cases():
    for name in NAMES:
        width = HopperBackwardConfig.parse(name).headdim
        for d in _SHORT_HEADDIMS.get(width, ()):
            yield name, d


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", _SHORT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name,headdim", list(_short_cases()), ids=lambda x: str(x))
def test_sm90_backward_headdim_below_width(name, headdim, shape, causal):
    dtype = _DTYPES[HopperBackwardConfig.parse(name).dtype]
    q, k, v = make_qkv((*shape, headdim), dtype, "cuda")
    check_direct(name, q, k, v, causal, torch.randn_like(q))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name,headdim", list(_short_cases()), ids=lambda x: str(x))
def test_sm90_backward_headdim_below_width_poisoned(name, headdim, causal):
    """q, k, v, out and dout are views [..., :headdim] of buffers wider than the tile whose other columns
    are NaN: a read at or past headdim poisons the gradients."""
    width = HopperBackwardConfig.parse(name).headdim
    dtype = _DTYPES[HopperBackwardConfig.parse(name).dtype]
    b, sq, sk, hq, hk = 2, 150, 200, 4, 2

    def poisoned(s, h, values):
        buf = torch.full((b, s, h, width + 8), float("nan"), dtype=dtype, device="cuda")
        buf[..., :headdim] = values
        return buf[..., :headdim]

    q0, k0, v0 = make_qkv((b, sq, sk, hq, hk, headdim), dtype, "cuda")
    dout0 = torch.randn_like(q0)
    out0, lse = attention_reference(q0, k0, v0, causal=causal)
    q, k, v = poisoned(sq, hq, q0), poisoned(sk, hk, k0), poisoned(sk, hk, v0)
    out, dout = poisoned(sq, hq, out0.to(dtype)), poisoned(sq, hq, dout0)
    ours = dispatch.hopper_module().backward(dout, q, k, v, out, lse, headdim ** -0.5, causal, False, name)
    ref = _reference_grads(q0, k0, v0, dout0, causal, True)
    lowp = _reference_grads(q0, k0, v0, dout0, causal, False)
    for label, ours_g, ref_g, lowp_g in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert torch.isfinite(ours_g).all(), f"{label}: NaN from a column at or past headdim {headdim}"
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, label)


@pytest.mark.parametrize("name", NAMES)
def test_sm90_backward_refuses_headdims_it_cannot_take(name):
    config = HopperBackwardConfig.parse(name)
    dtype = _DTYPES[config.dtype]
    cases = [(36, "multiples of 8")]
    if config.headdim < 256:  # past 256 the op's own headdim check speaks first
        cases.append((config.headdim + 8, "head dimensions up to"))
    for d, match in cases:
        q, k, v = make_qkv((1, 64, 64, 2, 2, d), dtype, "cuda")
        with pytest.raises(RuntimeError, match=match):
            _direct_grads(name, q, k, v, torch.randn_like(q), False)


# The ".lpt" builds on causal problems with enough key tiles for groups of several (batch, kv head) pairs,
# the last group short (csrc/cuda/sm90/bwd_lpt.h; the shapes above have fewer than 16 key tiles, where the
# order is the plain one): the plain build's CTAs in another order, so dK and dV (each written by one CTA
# from its own accumulators) equal the plain build's bit for bit, and dQ (fp32 atomics, added in another
# order) agrees to rounding. With softcap: the variants build (the wide kernel's takes the order too).
LPT_NAMES = [n for n in NAMES if n.endswith(".lpt")]


def _lpt_group_pairs(n_tiles, seqlen_q, width, head_ratio):
    """bwd_lpt_pairs (csrc/cuda/sm90/bwd_lpt.h) on this device."""
    props = torch.cuda.get_device_properties(0)
    if n_tiles < 16:
        return 1
    pairs = -(-4 * props.multi_processor_count // n_tiles)
    pair_bytes = -(-seqlen_q // 128) * 128 * width * head_ratio * 8
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    return max(1, min(pairs, l2 * 3 // 8 // pair_bytes))


@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["dense", "softcap"])
@pytest.mark.parametrize("head_ratio", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", LPT_NAMES)
def test_sm90_backward_lpt_order_matches_the_plain_build(name, head_ratio, softcap):
    config = HopperBackwardConfig.parse(name)
    dtype = _DTYPES[config.dtype]
    seqlen = 17 * config.block_n - 37  # 17 key tiles, the last ragged
    group = _lpt_group_pairs(17, seqlen, config.headdim, head_ratio)
    heads_k = 2 * group + 1  # one batch: three groups, the last of one pair
    q, k, v = make_qkv((1, seqlen, seqlen, heads_k * head_ratio, heads_k, config.headdim), dtype, "cuda")
    dout = torch.randn_like(q)
    out, lse = torch.ops.flashop.forward(q, k, v, None, True, None)
    hopper, scale = dispatch.hopper_module(), config.headdim ** -0.5
    lpt = hopper.backward(dout, q, k, v, out, lse, scale, True, False, name, softcap=softcap)
    plain = hopper.backward(dout, q, k, v, out, lse, scale, True, False, name[: -len(".lpt")], softcap=softcap)
    assert torch.equal(lpt[1], plain[1]) and torch.equal(lpt[2], plain[2])
    dq, dq_plain = lpt[0].float(), plain[0].float()
    assert torch.isfinite(dq).all() and (dq - dq_plain).abs().max() <= 1e-2 * dq_plain.abs().max()


# The tail split (csrc/cuda/sm90/bwd_tail.h): a dense non-causal problem whose last wave holds a few blocks after a
# full one runs them as pieces over their query steps, whose dK and dV meet in a workspace. Each shape here makes
# the split on this device: key tiles x kv heads = one wave of blocks + 1 .. 3, ragged key and query tiles, GQA
# (a piece's steps cross query heads), a headdim below the tile width.
TAIL_NAMES = [n for n in NAMES if not n.endswith(".lpt") and HopperBackwardConfig.parse(n).headdim <= 128]


def _tail_shape(config, head_ratio, query_tiles=64):
    ctas_per_sm = 2 if config.block_n == 64 else 1
    wave = torch.cuda.get_device_properties(0).multi_processor_count * ctas_per_sm
    n_tiles = 3
    heads_k = wave // n_tiles + 1  # n_tiles * heads_k = wave + 1 .. wave + 3
    seqlen_k = n_tiles * config.block_n - 37
    seqlen_q = query_tiles * config.block_m - 21  # at least kBwdTailMinSteps steps
    return 1, seqlen_q, seqlen_k, heads_k * head_ratio, heads_k


@pytest.mark.parametrize("query_tiles", [32, 64])  # from kBwdTailMinSteps steps
@pytest.mark.parametrize("head_ratio", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", TAIL_NAMES)
def test_sm90_backward_tail_split(name, head_ratio, query_tiles):
    config = HopperBackwardConfig.parse(name)
    shape = _tail_shape(config, head_ratio, query_tiles)
    first, blocks, pieces = dispatch.hopper_module().backward_config_tail_split(name, *shape, False)
    assert pieces >= 2 and 1 <= blocks <= 3 and first == 3 * shape[4] - blocks, (first, blocks, pieces)
    assert dispatch.hopper_module().backward_config_tail_split(name, *shape, True)[2] == 0  # causal: none
    headdim = config.headdim - 8 if config.headdim > 64 else config.headdim
    q, k, v = make_qkv((*shape, headdim), _DTYPES[config.dtype], "cuda")
    check_direct(name, q, k, v, False, torch.randn_like(q))


@pytest.mark.parametrize("name", TAIL_NAMES)
def test_sm90_backward_tail_split_in_cuda_graph(name):
    """The split's launches captured in a CUDA graph (the workspace memset, the dense grid, the pieces as its
    programmatic dependent, the conversions) and replayed on new inputs: each replay's gradients match the float64
    reference (the workspace is zeroed again on every replay)."""
    config = HopperBackwardConfig.parse(name)
    shape = _tail_shape(config, 1)
    assert dispatch.hopper_module().backward_config_tail_split(name, *shape, False)[2] >= 2
    q, k, v = make_qkv((*shape, config.headdim), _DTYPES[config.dtype], "cuda")
    dout = torch.randn_like(q)
    out, lse = attention_reference(q, k, v, causal=False)
    out = out.to(q.dtype)
    scale = q.size(-1) ** -0.5

    def backward():
        return dispatch.hopper_module().backward(dout, q, k, v, out, lse, scale, False, False, name)

    graph, grads = capture_cuda_graph(backward)
    for _ in range(2):
        for t in (q, k, v, dout):
            t.copy_(torch.randn_like(t))
        ref_out, ref_lse = attention_reference(q, k, v, causal=False)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        graph.replay()
        torch.cuda.synchronize()
        assert_grads_match_reference(grads, q, k, v, False, dout)

"""Forward values against the float64 reference, FlashAttention's accuracy criterion."""
import pytest
import torch

import flashop

from conftest import DEVICES, assert_cuda_refuses, cuda_cannot_run
from reference import assert_close_to_reference, attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch, seqlen_q, seqlen_k, heads_q, heads_k, headdim)
SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 113, 257, 4, 4, 64),
    (1, 257, 113, 8, 2, 128),  # GQA 8:2, more queries than keys
    (3, 1, 1023, 8, 1, 32),  # MQA 8:1, decoding-like
    (1, 128, 128, 2, 2, 96),
    (2, 65, 65, 2, 1, 256),
    (1, 200, 300, 3, 3, 40),
]


def make_qkv(shape, dtype, device, layout="contiguous"):
    b, sq, sk, hq, hk, d = shape
    if layout == "contiguous":
        return (torch.randn(b, sq, hq, d, dtype=dtype, device=device),
                torch.randn(b, sk, hk, d, dtype=dtype, device=device),
                torch.randn(b, sk, hk, d, dtype=dtype, device=device))
    # Strided: heads-major storage viewed as (B, S, H, D), and K/V interleaved in one buffer.
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device).transpose(1, 2)
    kv = torch.randn(b, sk, hk, 2, d + 8, dtype=dtype, device=device)[..., :d]
    return q, kv[:, :, :, 0], kv[:, :, :, 1]


def check_forward(q, k, v, causal, softmax_scale=None, config=None):
    out, lse = torch.ops.flashop.forward(q, k, v, softmax_scale, causal, config)
    ref_out, ref_lse = attention_reference(q, k, v, softmax_scale, causal)
    lowp_out, _ = attention_reference(q, k, v, softmax_scale, causal, upcast=False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (q.size(0), q.size(2), q.size(1)) and lse.dtype == torch.float32
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    empty_rows = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty_rows), "rows with no visible key must have lse = -inf"
    torch.testing.assert_close(lse[~empty_rows], ref_lse[~empty_rows], atol=1e-3, rtol=1e-3)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(device, dtype, causal, shape):
    inputs = make_qkv(shape, dtype, device)
    if cuda_cannot_run(device, dtype, shape[-1]):
        return assert_cuda_refuses(lambda: check_forward(*inputs, causal))
    check_forward(*inputs, causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_strided_inputs(device, dtype, causal):
    q, k, v = make_qkv((2, 77, 130, 4, 2, 64), dtype, device, layout="strided")
    assert not q.is_contiguous() and not k.is_contiguous()
    if cuda_cannot_run(device, dtype, 64):
        return assert_cuda_refuses(lambda: check_forward(q, k, v, causal))
    check_forward(q, k, v, causal)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_explicit_scale(device):
    check_forward(*make_qkv((1, 50, 70, 2, 2, 64), torch.bfloat16, device), causal=True, softmax_scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_rows_without_keys(device):
    """Causal with more queries than keys: the first Sq - Sk rows see nothing."""
    q, k, v = make_qkv((1, 40, 16, 2, 2, 64), torch.float16, device)
    out, lse = check_forward(q, k, v, causal=True)
    assert torch.all(out[:, :24] == 0) and torch.all(torch.isneginf(lse[:, :, :24]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", [(0, 5, 5), (2, 0, 5), (2, 5, 0)], ids=["batch0", "seqq0", "seqk0"])
def test_forward_empty(device, sizes):
    b, sq, sk = sizes
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(b, sq, 2, 64, device=device, dtype=dtype)
    k = torch.randn(b, sk, 2, 64, device=device, dtype=dtype)
    out, lse = torch.ops.flashop.forward(q, k, k, None, False, None)
    assert out.shape == q.shape and lse.shape == (b, 2, sq)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))  # no keys: zero output, -inf LSE


@pytest.mark.parametrize("device", [d for d in DEVICES if not isinstance(d, str)])  # the CUDA param only
def test_forward_writes_every_element(device):
    """Poison the blocks the outputs will be allocated from (the CUDA caching allocator hands a freed
    block of the same size straight back) so an unwritten element shows up as NaN. The CPU allocator
    returns fresh pages, so there this would prove nothing; the CPU outputs are checked element by
    element against the reference above."""
    q, k, v = make_qkv((2, 131, 67, 4, 4, 64), torch.bfloat16, device)
    poison = [torch.full_like(q, float("nan")), torch.full((2, 4, 131), float("nan"), device=device)]
    del poison
    out, lse = torch.ops.flashop.forward(q, k, v, None, True, None)
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a GPU of compute capability 9.0 (H100/H200)")
@pytest.mark.parametrize("headdim", [40, 64, 96, 128, 200, 256])
def test_hopper_family_runs_by_default_on_sm90(headdim):
    """On H100/H200 the policy sends every headdim to the wgmma + TMA kernels (tests/test_sm90.py runs
    every Hopper config over the semantic cases)."""
    from flashop import dispatch

    q, k, v = make_qkv((2, 300, 277, 4, 2, headdim), torch.bfloat16, "cuda")
    assert dispatch.config_for(q, k, True, "forward").startswith("sm90.")
    check_forward(q, k, v, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_q", [1, 70])  # the decode kernels (CUDA) and the tiled ones
def test_preallocated_out(device, seqlen_q):
    """flash_attn_func(out=) and flash_attn_varlen_func(out=): the given tensor comes back holding the output of
    the call without it (a strided view too, nothing around it touched); gradients flow through it; a wrong
    shape or dtype is named, under torch.compile too."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv((2, seqlen_q, 90, 4, 2, 64), dtype, device)
    expected = flashop.flash_attn_func(q, k, v, causal=True)
    storage = torch.full((2, seqlen_q, 4, 80), float("nan"), dtype=dtype, device=device)
    out = storage[..., :64]
    assert flashop.flash_attn_func(q, k, v, causal=True, out=out) is out
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert torch.isnan(storage[..., 64:]).all()

    cu_q = torch.tensor([0, seqlen_q, 2 * seqlen_q], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32, device=device)
    packed_args = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, seqlen_q, 90)
    packed = flashop.flash_attn_varlen_func(*packed_args, causal=True, out=torch.empty_like(q).flatten(0, 1))
    torch.testing.assert_close(packed, flashop.flash_attn_varlen_func(*packed_args, causal=True), atol=0, rtol=0)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    flashop.flash_attn_func(*leaves, causal=True, out=torch.empty_like(q)).backward(grad)
    want = torch.autograd.grad(flashop.flash_attn_func(*leaves, causal=True), leaves, grad)
    for got, ref in zip((t.grad for t in leaves), want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)

    with pytest.raises(RuntimeError, match="out must have the shape of q"):
        flashop.flash_attn_func(q, k, v, out=out[:1])
    compiled = torch.compile(flashop.flash_attn_func, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, causal=True, out=torch.empty_like(q)), expected, atol=0, rtol=0)
    with pytest.raises(Exception, match="out must have the dtype of q"):
        compiled(q, k, v, out=out.double())

"""Local windows, softcap, ALiBi and learnable sinks: values and gradients (the sinks' too) against the
float64 reference, alone and combined, with causal, GQA, Sq != Sk, odd headdims and deterministic
backward; their argument errors in eager mode and at trace time; compile and the module APIs."""
import pytest
import torch

import flashop
from conftest import DEVICES, assert_cuda_refuses, cuda_cannot_run
from reference import (assert_close_to_reference, assert_grad_close_to_reference, attention_reference,
                       sink_grad_from_output)
from test_forward import DTYPES, make_qkv

# (name, causal, window_size, softcap, alibi: None / "head" / "batch", sink)
VARIANTS = [
    ("window-left", False, (16, -1), 0.0, None, False),
    ("window-right", False, (-1, 9), 0.0, None, False),
    ("window-both", False, (20, 7), 0.0, None, False),
    ("window-causal", True, (33, -1), 0.0, None, False),
    ("window-zero", False, (0, 0), 0.0, None, False),
    ("softcap", False, (-1, -1), 5.0, None, False),
    ("softcap-causal", True, (-1, -1), 30.0, None, False),
    ("alibi-head", False, (-1, -1), 0.0, "head", False),
    ("alibi-batch-causal", True, (-1, -1), 0.0, "batch", False),
    ("sink", False, (-1, -1), 0.0, None, True),
    ("sink-causal", True, (-1, -1), 0.0, None, True),
    ("all", True, (40, -1), 20.0, "head", True),
    ("window-softcap-alibi", False, (25, 3), 10.0, "batch", False),
]
# (batch, seqlen_q, seqlen_k, heads_q, heads_k, headdim): tails, GQA, Sq > Sk (rows without keys), odd headdims
SHAPES = [
    (2, 113, 257, 4, 2, 64),
    (1, 200, 90, 4, 1, 40),
    (1, 77, 77, 2, 2, 59),
]


def variant_args(variant, batch, heads, device):
    name, causal, window, softcap, alibi, sink = variant
    slopes = None
    if alibi == "head":
        slopes = torch.rand(heads, device=device) * 0.5
    elif alibi == "batch":
        slopes = torch.rand(batch, heads, device=device) * 0.5
    sinks = torch.randn(heads, device=device) if sink else None
    return dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, learnable_sink=sinks)


def _forward(q, k, v, args):
    return torch.ops.flashop.forward(q, k, v, None, args["causal"], None, False, *args["window_size"],
                                     args["softcap"], args["alibi_slopes"], args["learnable_sink"])


def _reference_args(args):
    return dict(causal=args["causal"], window_size=args["window_size"], softcap=args["softcap"],
                alibi_slopes=args["alibi_slopes"], learnable_sink=args["learnable_sink"])


def check_variant(q, k, v, args, deterministic=False):
    """Output, lse and the gradients of q, k, v (and the sinks) against the float64 reference."""
    out, lse = _forward(q, k, v, args)
    ref_out, ref_lse = attention_reference(q, k, v, **_reference_args(args))
    lowp_out, _ = attention_reference(q, k, v, upcast=False, **_reference_args(args))
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    empty_rows = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty_rows), "rows with no visible key must have lse = -inf"
    torch.testing.assert_close(lse[~empty_rows], ref_lse[~empty_rows], atol=1e-3, rtol=1e-3)

    dout = torch.randn_like(q)
    sink = args["learnable_sink"]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([sink.detach().requires_grad_()] if sink is not None
                                                               else [])

    def run(fn, leaves, grad_out):
        vals = dict(args, learnable_sink=leaves[3] if sink is not None else None)
        return torch.autograd.grad(fn(*leaves[:3], vals), leaves, grad_out)

    ours = run(lambda q, k, v, a: flashop.flash_attn_func(q, k, v, deterministic=deterministic, **a), leaves, dout)
    ref = run(lambda q, k, v, a: attention_reference(q, k, v, **_reference_args(a))[0], leaves, dout.double())
    lowp = run(lambda q, k, v, a: attention_reference(q, k, v, upcast=False, **_reference_args(a))[0], leaves, dout)
    for name, ours_g, ref_g, lowp_g in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, name)
    if sink is not None:
        if q.dtype == torch.float32:
            assert_grad_close_to_reference(ours[3], ref[3], lowp[3], "dsink")
        else:
            torch.testing.assert_close(ours[3].double(), sink_grad_from_output(dout, out, ref_lse, sink),
                                       rtol=1e-3, atol=1e-5)
    return ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0])
def test_variant_matches_reference(device, dtype, shape, variant):
    q, k, v = make_qkv(shape, dtype, device)
    args = variant_args(variant, shape[0], shape[3], device)
    if cuda_cannot_run(device, dtype, shape[-1]):
        return assert_cuda_refuses(lambda: _forward(q, k, v, args))
    check_variant(q, k, v, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS[3:4] + VARIANTS[-2:], ids=lambda v: v[0])
def test_variant_strided_inputs_and_deterministic_backward(device, variant):
    # 300 keys: several key tiles per query tile on CUDA, so the ordered dQ sums meet windows that skip tiles.
    q, k, v = make_qkv((2, 190, 300, 4, 2, 64), torch.bfloat16, device, layout="strided")
    args = variant_args(variant, 2, 4, device)
    seed = torch.randint(1 << 30, ()).item()
    torch.manual_seed(seed)  # the same dout twice
    first = check_variant(q, k, v, args, deterministic=True)
    torch.manual_seed(seed)
    again = check_variant(q, k, v, args, deterministic=True)
    for a, b in zip(first, again):
        assert torch.equal(a, b), "deterministic=True must give bit-identical gradients"


def test_window_rows_without_keys_and_sink_only_rows():
    q, k, v = make_qkv((1, 50, 20, 2, 2, 32), torch.float32, "cpu")
    # Sq > Sk, causal: the first 30 rows see no key.
    sink = torch.randn(2)
    out, lse = _forward(q, k, v, dict(causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                      learnable_sink=sink))
    assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30]))
    torch.testing.assert_close(lse[:, :, :30], sink.view(1, 2, 1).expand(1, 2, 30))


def test_normalised_windows_equal_their_plain_forms():
    """A window that excludes nothing is dense attention; (-1, 0) is causal; causal overrides the right
    bound (FlashAttention's rules)."""
    q, k, v = make_qkv((1, 60, 90, 2, 2, 32), torch.float32, "cpu")
    dense = torch.ops.flashop.forward(q, k, v)[0]
    causal = torch.ops.flashop.forward(q, k, v, None, True)[0]
    for left, right in ((89, -1), (500, 59), (-1, 1000)):
        assert torch.equal(torch.ops.flashop.forward(q, k, v, None, False, None, False, left, right)[0], dense)
    assert torch.equal(torch.ops.flashop.forward(q, k, v, None, False, None, False, -1, 0)[0], causal)
    assert torch.equal(torch.ops.flashop.forward(q, k, v, None, True, None, False, -1, 7)[0], causal)


BAD_VARIANTS = [
    (dict(window_size_left=-2), "window_size_left must be -1 \\(unbounded\\) or >= 0, got -2"),
    (dict(window_size_right=-5), "window_size_right must be -1 \\(unbounded\\) or >= 0, got -5"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0 \\(0 is off\\), got -1"),
    (dict(softcap=float("nan")), "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number >= 0"),
    (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must have shape \\(nheads,\\) = \\(4,\\) or \\(batch, nheads\\) = "
                                       "\\(2, 4\\), got \\[3\\]"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), "alibi_slopes must have dtype torch.float32, got "
                                                            "torch.float64"),
    (dict(alibi_slopes=torch.ones(4, 2)), "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(2, 8)[:, ::2]), "alibi_slopes must be contiguous"),
    (dict(learnable_sink=torch.ones(2, 4)), "learnable_sink must have shape \\(nheads,\\) = \\(4,\\), got \\[2, 4\\]"),
    (dict(learnable_sink=torch.ones(4, dtype=torch.bfloat16)), "learnable_sink must have dtype torch.float32"),
]


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("kwargs,message", BAD_VARIANTS, ids=[f"bad{i}" for i in range(len(BAD_VARIANTS))])
def test_bad_variant_arguments_are_named(mode, kwargs, message):
    q, k, v = make_qkv((2, 16, 16, 4, 2, 32), torch.float32, "cpu")

    def call(q, k, v):
        return torch.ops.flashop.forward(q, k, v, **kwargs)

    fn = call if mode == "eager" else torch.compile(call, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=message):
        fn(q, k, v)


def test_backward_checks_its_variant_arguments():
    q, k, v = make_qkv((2, 16, 16, 4, 2, 32), torch.float32, "cpu")
    out, lse = torch.ops.flashop.forward(q, k, v)
    with pytest.raises(RuntimeError, match="window_size_left must be -1"):
        torch.ops.flashop.backward(out, q, k, v, out, lse, window_size_left=-3)
    with pytest.raises(RuntimeError, match="alibi_slopes must have shape"):
        torch.ops.flashop.backward(out, q, k, v, out, lse, alibi_slopes=torch.ones(5))


@pytest.mark.parametrize("variant", VARIANTS[2:3] + VARIANTS[6:7] + VARIANTS[8:9] + VARIANTS[-2:-1],
                         ids=lambda v: v[0])
def test_compile_fullgraph_with_variants_no_recompile_across_seqlens(variant):
    torch._dynamo.config.cache_size_limit = 8
    counts = torch._dynamo.utils.counters
    counts.clear()
    args = variant_args(variant, 2, 4, "cpu")

    def step(q, k, v, sink):
        out = flashop.flash_attn_func(q, k, v, causal=args["causal"], window_size=args["window_size"],
                                      softcap=args["softcap"], alibi_slopes=args["alibi_slopes"],
                                      learnable_sink=sink)
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for seqlen in (40, 64, 97):
        q, k, v = (t.requires_grad_() for t in make_qkv((2, seqlen, seqlen, 4, 2, 32), torch.float32, "cpu"))
        sink = args["learnable_sink"].clone().requires_grad_() if args["learnable_sink"] is not None else None
        loss = compiled(q, k, v, sink)
        loss.backward()
        ref = step(*(t.detach().requires_grad_() for t in (q, k, v)), sink.detach() if sink is not None else None)
        torch.testing.assert_close(loss, ref)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


def test_opcheck_with_every_variant():
    q, k, v = make_qkv((2, 33, 47, 4, 2, 32), torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_()
    sink = torch.randn(4, requires_grad=True)
    slopes = torch.rand(2, 4)
    args = (q, k, v, None, True, None, False, 12, -1, 15.0, slopes, sink)
    torch.library.opcheck(torch.ops.flashop.forward.default, args)
    out, lse = torch.ops.flashop.forward(*args)
    torch.library.opcheck(torch.ops.flashop.backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, True,
                           None, False, 12, -1, 15.0, slopes))


def test_modules_take_the_variants():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 64)
    mha = flashop.modules.MHA(64, 4, num_heads_kv=2, causal=True, use_alibi=True, window_size=(16, -1),
                              softcap=20.0, use_sinks=True)
    assert mha.sinks.shape == (4,) and mha.sinks.requires_grad
    y = mha(x)
    # The same layer by hand, through the reference.
    qkv = mha.Wqkv(x)
    q = qkv[..., :64].unflatten(-1, (4, 16))
    kv = qkv[..., 64:].unflatten(-1, (2, 2, 16))
    ref, _ = attention_reference(q, kv[:, :, 0], kv[:, :, 1], causal=True, window_size=(16, -1), softcap=20.0,
                                 alibi_slopes=mha.inner_cross_attn.alibi_slopes, learnable_sink=mha.sinks)
    torch.testing.assert_close(y, mha.out_proj(ref.float().flatten(-2)), atol=1e-4, rtol=1e-4)
    y.sum().backward()
    assert mha.sinks.grad is not None and torch.isfinite(mha.sinks.grad).all()

    slopes = flashop.modules.alibi_slopes(4)
    attn = flashop.modules.FlashSelfAttention(causal=False, window_size=(8, 8), alibi_slopes=slopes, softcap=5.0)
    qkv = torch.randn(2, 30, 3, 4, 16)
    ref, _ = attention_reference(*qkv.unbind(2), window_size=(8, 8), alibi_slopes=slopes, softcap=5.0)
    torch.testing.assert_close(attn(qkv), ref.float(), atol=1e-5, rtol=1e-5)


def test_alibi_slopes_of_the_alibi_paper():
    """2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise the closest power's slopes then every
    other slope of the next power's."""
    torch.testing.assert_close(flashop.modules.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    twelve = flashop.modules.alibi_slopes(12)
    torch.testing.assert_close(twelve[:8], flashop.modules.alibi_slopes(8))
    torch.testing.assert_close(twelve[8:], flashop.modules.alibi_slopes(16)[0::2][:4])

"""Gradients against the float64 reference, FlashAttention's accuracy criterion."""
import pytest
import torch

import flashop
from conftest import DEVICES, assert_cuda_refuses, cuda_cannot_run
from reference import assert_grad_close_to_reference, attention_reference
from test_forward import DTYPES, make_qkv

SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 113, 257, 4, 4, 64),
    (1, 257, 113, 8, 2, 128),
    (1, 3, 200, 8, 1, 32),
    (2, 65, 65, 2, 1, 256),
    (1, 90, 70, 2, 2, 24),
]


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_backward(q, k, v, causal, dout=None):
    dout = torch.randn_like(q) if dout is None else dout
    ours = grads(lambda *t: flashop.flash_attn_func(*t, causal=causal), q, k, v, dout)
    ref = grads(lambda *t: attention_reference(*t, causal=causal)[0], q, k, v, dout.double())
    lowp = grads(lambda *t: attention_reference(*t, causal=causal, upcast=False)[0], q, k, v, dout)
    for name, ours_g, ref_g, lowp_g, inp in zip(("dq", "dk", "dv"), ours, ref, lowp, (q, k, v)):
        assert ours_g.shape == inp.shape and ours_g.dtype == inp.dtype
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_reference(device, dtype, causal, shape):
    inputs = make_qkv(shape, dtype, device)
    if cuda_cannot_run(device, dtype, shape[-1]):
        return assert_cuda_refuses(lambda: check_backward(*inputs, causal))
    check_backward(*inputs, causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_strided_inputs_and_dout(device, dtype):
    q, k, v = make_qkv((2, 77, 130, 4, 2, 64), dtype, device, layout="strided")
    dout = torch.randn(2, 4, 77, 64, dtype=dtype, device=device).transpose(1, 2)
    if cuda_cannot_run(device, dtype, 64):
        return assert_cuda_refuses(lambda: check_backward(q, k, v, causal=True, dout=dout))
    check_backward(q, k, v, causal=True, dout=dout)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_rows_without_keys(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    check_backward(*make_qkv((1, 40, 16, 2, 2, 64), dtype, device), causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_lse_is_not_differentiable(device):
    q, k, v = (t.requires_grad_() for t in make_qkv((1, 8, 8, 1, 1, 32), torch.float16, device))
    out, lse, _ = flashop.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_backward_runs_no_op_for_the_lse(device):
    # The LSE output takes no gradient: the backward is flashop.backward alone, with no zeros materialised for it.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (t.requires_grad_() for t in make_qkv((1, 16, 16, 2, 2, 64), dtype, device))
    out = flashop.flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    with Ops() as ops:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert "flashop.backward.default" in ops.names
    assert [n for n in ops.names if "zero" in n or "fill" in n or "empty" in n] == [], ops.names
    ref = grads(lambda *t: attention_reference(*t)[0], q, k, v, dout.double())
    lowp = grads(lambda *t: attention_reference(*t, upcast=False)[0], q, k, v, dout)
    for name, ours_g, ref_g, lowp_g in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, lowp):
        assert_grad_close_to_reference(ours_g, ref_g, lowp_g, name)

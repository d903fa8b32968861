"""torch.compile(fullgraph=True, dynamic=True) and torch.export over the ops, the public functions and
the modules: same values as eager, no graph breaks, no recompilation when the sequence length changes."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flashop
from flashop.modules import MHA, FlashCrossAttention, FlashSelfAttention
from conftest import DEVICES

H, D = 4, 32


def dtype_for(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def op_forward(q, k, v):
    out, lse = torch.ops.flashop.forward(q, k, v, None, True, None)
    return out * 2 + lse.sum()


def api_func(q, k, v):
    return flashop.flash_attn_func(q, k, v, causal=True)


def api_qkvpacked(q, k, v):
    return flashop.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), causal=False)


def api_kvpacked(q, k, v):
    return flashop.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), softmax_scale=0.1)


def api_sdpa(q, k, v):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return flashop.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


FUNCTIONS = [op_forward, api_func, api_qkvpacked, api_kvpacked, api_sdpa]


def run_fwd_bwd(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.square().sum().backward()
    return [out.detach()] + [t.grad for t in inputs]


def assert_same(eager, compiled):
    """Same kernels in both, so only reduction order (fused projections, dQ atomics) may differ."""
    for a, b in zip(eager, compiled):
        tol = 2e-5 if a.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_compiled_function(device, fn):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seqlen in (48, 80, 131):
        inputs = [torch.randn(2, seqlen, H, D, device=device, dtype=dtype_for(device)) for _ in range(3)]
        assert_same(run_fwd_bwd(fn, inputs), run_fwd_bwd(compiled, inputs))
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled for new sequence lengths: frames {frames}"


def make_module(name, device):
    if name == "FlashSelfAttention":
        module, make = FlashSelfAttention(causal=True), lambda s: (torch.randn(2, s, 3, H, D),)
    elif name == "FlashCrossAttention":
        module, make = FlashCrossAttention(), lambda s: (torch.randn(2, s, H, D), torch.randn(2, s + 7, 2, 2, D))
    elif name == "MHA-GQA":
        module, make = MHA(H * D, H, num_heads_kv=2, causal=True), lambda s: (torch.randn(2, s, H * D),)
    else:
        module, make = MHA(H * D, H), lambda s: (torch.randn(2, s, H * D),)
    dtype = dtype_for(device)
    return module.to(device, dtype), lambda s: [t.to(device, dtype) for t in make(s)]


MODULES = ["FlashSelfAttention", "FlashCrossAttention", "MHA", "MHA-GQA"]


def module_fwd_bwd(module, inputs):
    module.zero_grad()
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = module(*inputs)
    out.square().sum().backward()
    return [out.detach()] + [t.grad for t in inputs] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODULES)
def test_compiled_module(device, name):
    module, make = make_module(name, device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seqlen in (40, 72, 99):
        inputs = make(seqlen)
        assert_same(module_fwd_bwd(module, inputs), module_fwd_bwd(compiled, inputs))
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled for new sequence lengths: frames {frames}"


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_mha_training_step(device):
    """The default backend (inductor) end to end: forward and backward of MHA."""
    module, make = make_module("MHA", device)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for seqlen in (64, 96):
        inputs = make(seqlen)
        assert_same(module_fwd_bwd(module, inputs), module_fwd_bwd(compiled, inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_export_module(device):
    module, make = make_module("MHA-GQA", device)
    (x,) = make(64)
    seq = torch.export.Dim("seq", min=2, max=4096)
    program = torch.export.export(module, (x,), dynamic_shapes={"x": {1: seq}})
    assert any(node.target == torch.ops.flashop.forward.default for node in program.graph.nodes)
    for seqlen in (64, 33):
        (x,) = make(seqlen)
        assert_same([module(x)], [program.module()(x)])

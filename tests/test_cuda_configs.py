"""Every built mma.sync forward config and every built backward config, named explicitly, against the
float64 reference (FlashAttention's criterion). The policy's picks are covered by the rest of the suite;
these are the tuner's other candidates, which a tuned cache can route any call to. The Hopper forward
configs have their own file (test_sm90.py). Skipped without a CUDA build."""
import pytest
import torch

from flashop import dispatch
from reference import assert_close_to_reference, assert_grad_close_to_reference, attention_reference

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (batch, seqlen_q, seqlen_k, heads_q, heads_k): several query and key tiles, ragged tails, GQA 4:2;
# the last has 18 key tiles of 128, where the backward lpt order groups (batch, kv head) pairs.
SHAPES = [(2, 300, 270, 4, 2), (1, 270, 333, 2, 2), (3, 80, 2200, 4, 2)]
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _runnable(direction):
    if not CUDA:
        return []
    device = dispatch.DeviceInfo.of(torch.cuda.current_device())
    names = []
    for name in dispatch.built_configs(direction):
        config = dispatch.parse_config(name)
        if (name.startswith("sm90.") or not dispatch.runs_on(config, device.capability)
                or config.smem_bytes() > device.smem_per_block):
            continue
        names.append(name)
    return names


def _inputs(name, shape):
    dtype, headdim = dispatch.dtype_and_headdim(name)
    b, sq, sk, hq, hk = shape
    make = lambda s, h: torch.randn(b, s, h, headdim, dtype=_DTYPES[dtype], device="cuda")  # noqa: E731
    return make(sq, hq), make(sk, hk), make(sk, hk)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", _runnable("forward"))
def test_every_forward_config(name, causal):
    for shape in SHAPES:
        q, k, v = _inputs(name, shape)
        out, lse = torch.ops.flashop.forward(q, k, v, None, causal, name)
        ref_out, ref_lse = attention_reference(q, k, v, None, causal)
        lowp_out, _ = attention_reference(q, k, v, None, causal, upcast=False)
        assert_close_to_reference(out, ref_out, lowp_out, f"{name} out {shape}")
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def _reference_grads(q, k, v, dout, causal, upcast):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention_reference(q, k, v, None, causal, upcast=upcast)[0]
    return torch.autograd.grad(out, (q, k, v), dout.to(out.dtype))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", _runnable("backward"))
def test_every_backward_config(name, causal, deterministic):
    for shape in SHAPES:
        q, k, v = _inputs(name, shape)
        dout = torch.randn_like(q)
        out, lse = torch.ops.flashop.forward(q, k, v, None, causal)
        grads = torch.ops.flashop.backward(dout, q, k, v, out, lse, None, causal, name, deterministic)
        ref = _reference_grads(q, k, v, dout, causal, upcast=True)
        lowp = _reference_grads(q, k, v, dout, causal, upcast=False)
        for label, ours, ref_g, lowp_g in zip(("dq", "dk", "dv"), grads, ref, lowp):
            assert_grad_close_to_reference(ours, ref_g, lowp_g, f"{name} {label} {shape}")

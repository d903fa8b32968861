"""Every head dimension from 1 to 256, forward and backward, against the float64 reference: through the
policy on every device, and on CUDA through every built kernel width that holds the head dimension
(a kernel of tile width W takes every head dimension up to W; other ones are padded to a multiple of 8).
Inputs read in place are views into NaN-filled wider buffers, so a kernel that reads past the head
dimension poisons its result; outputs come from blocks that held NaN, so an unwritten element shows."""
import pytest
import torch

from conftest import DEVICES
from flashop import dispatch
from reference import (assert_close_to_reference, assert_grad_close_to_reference, attention_reference,
                       stored_output_slack)

HEADDIMS = (1, 8, 40, 59, 72, 80, 111, 160, 224)
CUDA = [d for d in DEVICES if not isinstance(d, str)]  # the CUDA param only


def poisoned(shape, dtype, device, extra=24):
    """Random values in a view [..., :D] of a buffer with `extra` NaN columns after every row."""
    *lead, d = shape
    buffer = torch.full((*lead, d + extra), float("nan"), dtype=dtype, device=device)
    view = buffer[..., :d]
    view.copy_(torch.randn(shape, dtype=dtype, device=device))
    return view


def make_inputs(b, sq, sk, hq, hk, d, dtype, device):
    return (poisoned((b, sq, hq, d), dtype, device), poisoned((b, sk, hk, d), dtype, device),
            poisoned((b, sk, hk, d), dtype, device), poisoned((b, sq, hq, d), dtype, device))


def poison_allocator(*shapes, device):
    """Leave NaN in the caching allocator's free blocks of these sizes: the next outputs of these sizes
    are allocated from them (CUDA only; the CPU allocator hands out fresh pages)."""
    blocks = [torch.full(s, float("nan"), device=device) for s in shapes]
    del blocks


def run(q, k, v, dout, causal, fwd_config=None, bwd_config=None, deterministic=False):
    poison_allocator(q.shape, (q.size(0), q.size(2), q.size(1)), device=q.device)
    out, lse = torch.ops.flashop.forward(q, k, v, None, causal, fwd_config, deterministic)
    # out as the backward reads it: in place, with NaN past the head dimension.
    out_view = poisoned(out.shape, out.dtype, out.device)
    out_view.copy_(out)
    poison_allocator(q.shape, k.shape, v.shape, device=q.device)
    grads = torch.ops.flashop.backward(dout, q, k, v, out_view, lse, None, causal, bwd_config, deterministic)
    return out, lse, grads


def check(q, k, v, dout, causal, **configs):
    out, lse, grads = run(q, k, v, dout, causal, **configs)
    ref_out, ref_lse = attention_reference(q, k, v, None, causal)
    lowp_out, _ = attention_reference(q, k, v, None, causal, upcast=False)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    seen = ~torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=1e-3, rtol=1e-3)

    def reference_grads(upcast):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, _ = attention_reference(*leaves, None, causal, upcast=upcast)
        return torch.autograd.grad(o, leaves, dout.to(o.dtype))

    ref, lowp = reference_grads(True), reference_grads(False)
    # dQ carries the rounding of the stored output in D = rowsum(dO o O) on top (at headdim 1 each row's dS is
    # P dO (v - O), where that rounding is most of the error). dK's bound sums it over every query row of a KV
    # head, far looser than dK's own error here, so dK keeps the plain criterion.
    dq_slack, _ = stored_output_slack(q, k, out, ref_out, dout)
    for name, ours, r, low, inp, slack in zip(("dq", "dk", "dv"), grads, ref, lowp, (q, k, v), (dq_slack, 0.0, 0.0)):
        assert ours.shape == inp.shape and ours.dtype == inp.dtype
        assert_grad_close_to_reference(ours, r, low, name, slack)
    return out, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_every_headdim_matches_reference(device, dtype, causal, headdim):
    # GQA 4:2, more keys than queries (causal aligned bottom-right), ragged tiles.
    check(*make_inputs(2, 97, 131, 4, 2, headdim, dtype, device), causal)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("headdim", [59, 224])
def test_every_headdim_more_queries_than_keys(device, headdim):
    """Causal with Sq > Sk: the first rows see no key (0 and -inf), at an odd and a wide head dimension."""
    check(*make_inputs(1, 150, 40, 2, 1, headdim, torch.bfloat16, device), True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("headdim", [40, 111])
def test_deterministic_backward_at_any_headdim(device, headdim):
    q, k, v, dout = make_inputs(2, 200, 200, 4, 1, headdim, torch.bfloat16, device)
    _, first = check(q, k, v, dout, True, deterministic=True)
    _, _, second = run(q, k, v, dout, True, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _widths(direction):
    """The first built config of each (kernel family, tile width), bf16: the configs every width test runs."""
    first = {}
    for name in dispatch.built_configs(direction):
        config = dispatch.parse_config(name)
        if config.dtype == "bf16":
            first.setdefault((type(config).__name__, config.headdim), name)
    return sorted(first.values())


def _usable(name):
    device = dispatch.DeviceInfo.of(torch.cuda.current_device())
    config = dispatch.parse_config(name)
    return config.smem_bytes() <= device.smem_per_block and dispatch.runs_on(config, device.capability)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_built_width_takes_narrower_headdims(device, direction):
    """Each built kernel width W, named explicitly, at head dimensions W - 8 and W - 27 (padded to W - 24)
    and the narrowest it could see (8), against the reference: the column predicates of every kernel."""
    names = [n for n in _widths(direction) if _usable(n)]
    assert names, f"no built {direction} config runs on this device"
    for name in names:
        width = dispatch.parse_config(name).headdim
        for d in sorted({width - 8, max(1, width - 27), 8} - {0}):
            configs = {"fwd_config" if direction == "forward" else "bwd_config": name}
            try:
                check(*make_inputs(1, 77, 143, 2, 1, d, torch.bfloat16, device), True, **configs)
            except AssertionError as e:
                raise AssertionError(f"{name} at headdim {d}: {e}") from None


@pytest.mark.parametrize("device", CUDA)
def test_named_config_narrower_than_headdim_is_refused(device):
    name = next(n for n in dispatch.built_configs("forward") if dispatch.parse_config(n).headdim < 256
                and dispatch.parse_config(n).dtype == "bf16")
    width = dispatch.parse_config(name).headdim
    q = torch.randn(1, 8, 1, width + 1, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match=f"is for bf16 headdim up to {width}, but the inputs are"):
        torch.ops.flashop.forward(q, q, q, None, False, name)

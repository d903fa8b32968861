"""torch.library.opcheck: schema, fake kernels, autograd registration and AOT dispatch of both ops."""
import pytest
import torch

from conftest import DEVICES
from test_forward import make_qkv

# (dtype, causal, (batch, seqlen_q, seqlen_k, heads_q, heads_k, headdim), layout): a covering matrix of
# dtypes, causal, Sq != Sk (1 and odd lengths), GQA 8:2, MQA 8:1, headdims 32..256, batch 1..3, strides.
CASES = [
    (torch.float32, False, (1, 1, 113, 8, 2, 32), "contiguous"),
    (torch.float32, True, (3, 257, 113, 8, 1, 64), "strided"),
    (torch.float16, True, (2, 113, 1023, 8, 2, 96), "contiguous"),
    (torch.float16, False, (1, 257, 257, 8, 1, 128), "strided"),
    (torch.bfloat16, True, (1, 113, 1, 8, 8, 256), "contiguous"),
    (torch.bfloat16, False, (2, 64, 257, 8, 2, 128), "strided"),
    (torch.bfloat16, True, (3, 1, 257, 2, 1, 64), "contiguous"),
    (torch.float32, True, (2, 31, 17, 4, 4, 256), "strided"),
]


def case_id(case):
    dtype, causal, shape, layout = case
    return f"{str(dtype).split('.')[-1]}-{'causal' if causal else 'full'}-{'x'.join(map(str, shape))}-{layout}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_opcheck_forward_and_backward(device, case):
    dtype, causal, shape, layout = case
    if device == "cuda" and dtype == torch.float32:
        dtype = torch.bfloat16  # the CUDA kernels take 16-bit inputs
    q, k, v = (t.requires_grad_() for t in make_qkv(shape, dtype, device, layout))
    torch.library.opcheck(torch.ops.flashop.forward.default, (q, k, v, None, causal, None))
    with torch.no_grad():
        out, lse = torch.ops.flashop.forward(q, k, v, None, causal, None)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashop.backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, 0.2, causal, None))
    torch.library.opcheck(torch.ops.flashop.forward.with_out, (q.detach(), k.detach(), v.detach(), None, causal, None),
                          {"out": torch.empty_like(out)})

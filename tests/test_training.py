"""Training with flashop: deterministic gradients, and a compiled transformer block that trains like
the same block on torch's SDPA."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashop
from flashop.modules import FlashSelfAttention
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_gradients_are_bit_identical(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(2, 333, 8, 64, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 333, 2, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    runs = [torch.autograd.grad(flashop.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


class Block(nn.Module):
    """Pre-norm transformer block; `attention` is FlashSelfAttention or the SDPA equivalent."""

    def __init__(self, dim, heads, use_flashop):
        super().__init__()
        self.heads, self.use_flashop = heads, use_flashop
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn = FlashSelfAttention(causal=True)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads)
        if self.use_flashop:
            context = self.attn(qkv)
        else:
            q, k, v = qkv.unbind(2)
            context = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     is_causal=True).transpose(1, 2)
        x = x + self.proj(context.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_matches_sdpa(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ours = Block(128, 4, use_flashop=True).to(device, dtype)
    theirs = copy.deepcopy(ours).to(device, dtype)
    theirs.use_flashop = False
    backend = "aot_eager" if device == "cpu" else "inductor"  # inductor's CPU codegen is slow on CI
    step = torch.compile(ours, fullgraph=True, backend=backend)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for _ in range(4):
        x = torch.randn(2, 200, 128, device=device, dtype=dtype)
        target = torch.randn_like(x)
        losses = []
        for model, opt in ((step, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), target.float())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= tol * abs(losses[1]), losses

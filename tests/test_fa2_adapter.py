"""The helpers of tools/fa2_suite's `flash_attn` stand-in that FlashAttention-2's tests use for their
references: packing and unpacking padded batches, and rotary embeddings. Checked on the CPU against
direct computations."""
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(relpath):
    name = "_fa2_suite_" + relpath.replace("/", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", "fa2_suite", relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_unpad_then_pad_keeps_the_masked_rows():
    padding = load("flash_attn/bert_padding.py")
    batch, seqlen = 3, 7
    x = torch.randn(batch, seqlen, 2, 5)
    lengths = torch.tensor([7, 0, 4])
    mask = torch.arange(seqlen)[None, :] < lengths[:, None]
    rows, indices, cu_seqlens, max_seqlen, seqused = padding.unpad_input(x, mask)
    assert torch.equal(rows, torch.cat([x[b, :lengths[b]] for b in range(batch)]))
    assert cu_seqlens.tolist() == [0, 7, 7, 11] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 7 and seqused.tolist() == [7, 0, 4]
    back = padding.pad_input(rows, indices, batch, seqlen)
    assert torch.equal(back, torch.where(mask[..., None, None], x, torch.zeros(())))


def test_unused_rows_are_kept_but_not_counted():
    padding = load("flash_attn/bert_padding.py")
    x = torch.randn(2, 4, 3)
    used = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    rows, _, cu_seqlens, max_seqlen, seqused = padding.unpad_input(x, used, unused)
    assert rows.shape[0] == 6 and cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3
    assert seqused.tolist() == [2, 1]


def rotary_reference(x, cos, sin, offsets, interleaved):
    """Each rotated feature pair as a complex number times e^(i theta), in float64."""
    batch, seqlen, _, _ = x.shape
    rotary_dim = 2 * cos.shape[-1]
    out = x.double().clone()
    for b in range(batch):
        for s in range(seqlen):
            p = s + offsets[b]
            angle = torch.complex(cos[p].double(), sin[p].double())
            rot = x[b, s, :, :rotary_dim].double()
            if interleaved:
                z = torch.complex(rot[:, 0::2], rot[:, 1::2]) * angle
                out[b, s, :, :rotary_dim] = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
            else:
                half = rotary_dim // 2
                z = torch.complex(rot[:, :half], rot[:, half:]) * angle
                out[b, s, :, :rotary_dim] = torch.cat((z.real, z.imag), dim=-1)
    return out


def test_rotary_matches_complex_rotation():
    rotary = load("flash_attn/layers/rotary.py")
    batch, seqlen, heads, headdim, rotary_dim = 2, 5, 3, 16, 8
    theta = torch.rand(12, rotary_dim // 2) * 6.28
    cos, sin = theta.cos(), theta.sin()
    x = torch.randn(batch, seqlen, heads, headdim)
    offsets = torch.tensor([0, 4])
    for interleaved in (False, True):
        got = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        # got is float32: compared at float32's tolerances (a pair can cancel to a small value).
        torch.testing.assert_close(got, rotary_reference(x, cos, sin, offsets.tolist(), interleaved).float())
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_varlen_block_table_passes_through():
    """FlashAttention-2's paged varlen call (its test_flash_attn_varlen_causal with paged_kv_block_size): the
    stand-in's flash_attn_varlen_func takes block_table and runs flashop's, no skip."""
    import flashop
    stand_in = load("flash_attn/__init__.py")
    lens_q, lens_k, page_size = [5, 3], [40, 17], 16
    k_pages, v_pages = torch.randn(6, page_size, 2, 32), torch.randn(6, page_size, 2, 32)
    table = torch.randperm(6)[:6].view(2, 3).to(torch.int32)
    q = torch.randn(sum(lens_q), 4, 32)
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lens_q, lens_k))
    args = (q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k), 0.0)
    out = stand_in.flash_attn_varlen_func(*args, causal=True, block_table=table)
    assert torch.equal(out, flashop.flash_attn_varlen_func(*args, causal=True, block_table=table))
    first = k_pages[table[0].long()].flatten(0, 1)[:40], v_pages[table[0].long()].flatten(0, 1)[:40]
    torch.testing.assert_close(out[:5], flashop.flash_attn_func(q[None, :5], first[0][None], first[1][None],
                                                                causal=True)[0])

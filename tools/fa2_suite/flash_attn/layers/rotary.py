"""apply_rotary_emb, as the KV-cache tests call it: x (batch, seqlen, nheads, headdim), cos and sin
(seqlen_ro, rotary_dim / 2); the first rotary_dim features rotate, the rest pass through. `interleaved`
rotates pairs (0, 1), (2, 3), ...; otherwise the two halves of the rotary features. `seqlen_offsets` (int
or (batch,) tensor) shifts each sequence's positions."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb stand-in: cu_seqlens")
    batch, seqlen = x.shape[:2]
    rotary_dim = 2 * cos.shape[-1]
    positions = torch.arange(seqlen, device=x.device).unsqueeze(0) + torch.as_tensor(
        seqlen_offsets, device=x.device).reshape(-1, 1)
    cos_p = cos[positions].unsqueeze(2).float()  # (batch, seqlen, 1, rotary_dim / 2)
    sin_p = sin[positions].unsqueeze(2).float()
    rot = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos_p - x2 * sin_p, x1 * sin_p + x2 * cos_p), dim=-1)
    out = torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out

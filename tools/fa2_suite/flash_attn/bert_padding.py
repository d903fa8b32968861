"""pad_input / unpad_input with flash_attn.bert_padding's signatures: packing the rows of a padded batch
(batch, seqlen, ...) that a mask keeps into (total, ...) and back."""
import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Rows where attention_mask (or unused_mask: kept but not counted as used) is set. Returns
    (rows, indices into the flattened (batch * seqlen) rows, cu_seqlens int32 (batch + 1,), max_seqlen,
    seqused int32 (batch,): the attention_mask rows of each sequence)."""
    kept = attention_mask.bool() | unused_mask.bool() if unused_mask is not None else attention_mask.bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu_seqlens, int(seqlens.max().item()), seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: (total, ...) rows back to (batch, seqlen, ...), zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])

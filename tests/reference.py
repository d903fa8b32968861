"""Plain PyTorch attention, the reference every kernel is checked against."""
import torch


def attention_reference(q, k, v, softmax_scale=None, causal=False, upcast=True, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, learnable_sink=None):
    """softmax(q k^T * scale) v for (B, S, H, D) inputs, GQA by repeating K/V heads, causal
    aligned bottom-right. Rows that see no key give 0 output and -inf LSE.

    The variants, written from their definitions (FlashAttention's): with off = Sk - Sq, query i sees
    key j iff i + off - left <= j <= i + off + right (-1 unbounded; causal is right = 0); softcap > 0
    maps each score to softcap * tanh(score / softcap); ALiBi subtracts slope * |i + off - j|;
    learnable_sink adds one logit per head to every row's softmax denominator (a row without keys
    then has lse = sink). Differentiable in q, k, v and learnable_sink.

    upcast=True computes in float64 (the reference); upcast=False computes in the inputs' own
    dtype, which is "PyTorch's own error" in FlashAttention's accuracy criterion.
    """
    dtype = torch.float64 if upcast else q.dtype
    q, k, v = (t.to(dtype) for t in (q, k, v))
    scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
    group = q.size(2) // k.size(2)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    seqlen_q, seqlen_k = q.size(1), k.size(1)
    rows = torch.arange(seqlen_q, device=q.device).view(-1, 1)
    cols = torch.arange(seqlen_k, device=q.device).view(1, -1)
    diagonal = rows + seqlen_k - seqlen_q
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).view(-1, q.size(2), 1, 1)  # (1 or B, H, 1, 1)
        scores = scores - slopes * (diagonal - cols).abs().to(dtype)
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones_like(cols > rows)
    if left >= 0:
        visible = visible & (cols >= diagonal - left)
    if right >= 0:
        visible = visible & (cols <= diagonal + right)
    scores = scores.masked_fill(~visible, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: all -inf -> NaN -> 0
    if learnable_sink is not None:
        probs = probs[..., :-1]
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.float()


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_to_reference(ours, reference, torch_lowp, name, atol_floor=1e-5, factor=2, slack=0.0):
    """FlashAttention's criterion: our error against the float64 reference is at most `factor` times
    PyTorch's own error in the same dtype, plus a small epsilon.

    The bound is never below the dtype's epsilon times the largest reference value (one to two units
    in the last place there): storing the result alone costs up to half a unit, and on tiny problems
    (a handful of terms per sum) PyTorch's own error can by chance be far below that (an fp16 dV one
    unit off at its largest values once failed a 2x bound of 2.05e-3 with an error of 3.9e-3). slack: an error
    the algorithm carries by design on top (stored_output_slack)."""
    err = max_error(ours, reference)
    largest = reference.abs().max().item() if reference.numel() else 0.0
    one_ulp = torch.finfo(ours.dtype).eps * largest if ours.dtype.is_floating_point else 0.0
    bound = max(factor * max_error(torch_lowp, reference) + atol_floor, one_ulp) + slack
    assert err <= bound, (f"{name}: max error {err:.3e} exceeds max({factor}x PyTorch's error + eps, dtype eps x largest "
                          f"value) = {bound:.3e}")


def assert_grad_close_to_reference(ours, reference, torch_lowp, name, slack=0.0):
    """Gradients: FlashAttention-2's own tests allow three times PyTorch's error (twice for the output).
    dQ, dK and dV sum products of rounded P and dS, so their error grows with one more rounding than O's."""
    assert_close_to_reference(ours, reference, torch_lowp, name, atol_floor=1e-4, factor=3, slack=slack)


def stored_output_slack(q, k, out, reference_out, dout, softmax_scale=None):
    """Bounds on the dQ and dK error that FlashAttention's backward carries by design: it takes D = rowsum(dO o O)
    from the stored (rounded) output, so each row's dS = P (dP - D) is off by P dO . (out - O). Where dP and D
    nearly cancel (one key and a sink that takes little weight: dS = P (1 - P) dO . v) that is most of dS, and
    PyTorch's own error, which never rounds O first, does not cover it. |dQ_i error| <= scale |dD_i| max|k|
    (the row's P sums to at most 1); |dK_j error| <= scale max|dD| max|q| times the query rows of a KV head."""
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    d_err = (dout.double() * (out.double() - reference_out.double())).sum(-1).abs().max().item()
    rows_per_kv = q.size(1) * (q.size(2) // k.size(2))
    return (scale * d_err * k.double().abs().max().item(),
            scale * d_err * q.double().abs().max().item() * rows_per_kv)


def sink_grad_from_output(dout, out, lse, learnable_sink):
    """d loss / d sink in float64 from a given output: -sum over rows of exp(sink - lse) * rowsum(dO * O).
    dout/out (B, S, H, D) with lse (B, H, S), or packed (T, H, D) with lse (H, T); rows with lse = -inf take
    no part. In 16-bit dtypes the sinks' gradient is dominated by the rounding of O before this sum (the
    kernels form rowsum(dO * O) from the stored O, as FlashAttention does), so tests compare it with this sum
    over the op's own O; in float32 against autograd of the reference."""
    d_rows = (dout.double() * out.double()).sum(-1).transpose(-1, -2)
    lse = lse.double()
    p_sink = torch.where(torch.isneginf(lse), 0.0, torch.exp(learnable_sink.double()[:, None] - lse))
    per_head = (p_sink * d_rows).sum(-1)
    return -(per_head.sum(0) if per_head.dim() == 2 else per_head)

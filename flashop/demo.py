"""The main job in one screen: flashop against torch's scaled_dot_product_attention on the available
device (CUDA when present, else CPU), forward and backward, with max errors and median timings.

    python3 -m flashop.demo
"""
import torch
import torch.nn.functional as F

import flashop
from flashop.bench import median_ms


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    batch, seqlen, heads, headdim = (4, 2048, 16, 128) if device == "cuda" else (2, 1024, 8, 64)
    print(f"flashop {flashop.__version__} on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}: "
          f"q, k, v ({batch}, {seqlen}, {heads}, {headdim}) {dtype}, causal")
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def ours():
        return flashop.flash_attn_func(q, k, v, causal=True)

    def theirs():
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)

    # Accuracy: both against a float32 computation of the same attention.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q32, k32, v32)), is_causal=True).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    for name, fn in (("flashop", ours), ("torch sdpa", theirs)):
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        errs = [(out.float() - ref).abs().max().item()] + [(g.float() - r).abs().max().item()
                                                           for g, r in zip(grads, ref_grads)]
        print(f"{name:>10}: max error out {errs[0]:.2e}, dq {errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e}")

    for mode in ("forward", "forward+backward"):
        times = {}
        for name, fn in (("flashop", ours), ("torch sdpa", theirs)):
            if mode == "forward":
                def run(fn=fn):
                    with torch.no_grad():
                        fn()
            else:
                def run(fn=fn):
                    torch.autograd.grad(fn(), (q, k, v), dout)
            run()
            times[name] = median_ms(run, device)
        print(f"{mode:>17}: flashop {times['flashop']:.2f} ms, torch sdpa {times['torch sdpa']:.2f} ms, "
              f"speed ratio {times['torch sdpa'] / times['flashop']:.2f}x")


if __name__ == "__main__":
    main()

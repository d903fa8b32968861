"""Time one Hopper forward config against torch's cuDNN and FLASH backends (same process, CUDA events).

    python3 tools/sm90_probe.py sm90.bf16.d128.br128.bc128 [--seqlen 4096]
"""
import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashop._C_sm90 as sm90


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--seqlen", type=int, default=4096)
    args = p.parse_args()
    _, dtype, d = args.config.split(".")[:3]
    dtype, d = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], int(d[1:])
    s, heads = args.seqlen, 2048 // d
    b = max(1, 32768 // s)
    q, k, v = (torch.randn(b, s, heads, d, device="cuda", dtype=dtype) for _ in range(3))
    for causal in (False, True):
        flops = 4 * b * heads * s * s * d / (2 if causal else 1)
        out, _ = sm90.forward(q, k, v, d ** -0.5, causal, args.config)
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        line = [f"{args.config} causal={causal} b{b} s{s} h{heads}: max err {(out - ref).abs().max().item():.2e}"]
        runs = {"flashop-sm90": lambda: sm90.forward(q, k, v, d ** -0.5, causal, args.config)}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
            runs[name] = run
        for name, fn in runs.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            line.append(f"{name} {flops / ms / 1e9:.0f} TFLOP/s")
        print(", ".join(line), flush=True)


if __name__ == "__main__":
    main()

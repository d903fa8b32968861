"""One attention problem run a few times, for Nsight Compute (tools/gpu_check.sh profile).

    ncu -k regex:fwd_kernel_sm90 -s 2 -c 1 python3 tools/probes/profile_case.py --config NAME --seqlen 8192

Same shapes as the benchmark: batch x seqlen = 32768 tokens, 2048 / headdim query heads.
"""
import argparse

import torch

import flashop


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="config name (default: the policy's pick)")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batch, heads = max(1, 32768 // args.seqlen), 2048 // args.headdim
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.headdim, device="cuda", dtype=dtype) for _ in range(3))
    forward_config = args.config if args.direction == "forward" else None
    out, lse = torch.ops.flashop.forward(q, k, v, None, args.causal, forward_config)
    dout = torch.randn_like(out)
    for _ in range(args.repeats):
        if args.direction == "forward":
            torch.ops.flashop.forward(q, k, v, None, args.causal, forward_config)
        else:
            torch.ops.flashop.backward(dout, q, k, v, out, lse, None, args.causal, args.config, False)
    torch.cuda.synchronize()
    print(f"profiled {args.direction} {args.config or '(policy)'} {args.dtype} d{args.headdim} "
          f"seqlen {args.seqlen} causal={args.causal}")


if __name__ == "__main__":
    main()

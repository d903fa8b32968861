"""What is built and what the policy would pick:

    python -m flashop.policy                                   # the built kernel configs
    python -m flashop.policy --shape 4 8192 8192 16 128 --causal  # B Sq Sk Hq D: the policy's pick and why
"""
import argparse

import torch

from . import dispatch
from .configs import DTYPES, KernelConfig


def main(argv=None) -> int:
    """python -m flashop.policy [--shape B S_q S_k H_q D] [--dtype bf16] [--causal] [--device N]

    Lists the built kernel configs and, given a shape, what the policy picks on this GPU and why."""
    p = argparse.ArgumentParser(prog="python -m flashop.policy", description=main.__doc__)
    p.add_argument("--shape", nargs=5, type=int, metavar=("B", "SQ", "SK", "HQ", "D"))
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    built = dispatch.built_configs("forward")
    print(f"built forward configs ({len(built)}):")
    for name in built:
        print(f"  {name:32s} smem {KernelConfig.parse(name).smem_bytes() // 1024:4d} KiB")
    if args.shape:
        if not torch.cuda.is_available():
            print("no CUDA device: the policy needs one to describe")
            return 1
        b, sq, sk, hq, d = args.shape
        device = dispatch.DeviceInfo.of(args.device)
        problem = dispatch.Problem(args.dtype, d, sq, sk, b * hq, args.causal)
        name, reason = dispatch.choose_config(device, problem, built, dispatch.tuned_entries(device.name))
        print(f"\n{device.name} ({device.sm_count} SMs, {device.smem_per_block // 1024} KiB smem/block), "
              f"bucket {dispatch.bucket_key(problem)}:\n  policy picks {name}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

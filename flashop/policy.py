"""What is built and what the policy would pick:

    python -m flashop.policy                                   # the built kernel configs
    python -m flashop.policy --shape 4 8192 8192 16 128 --causal  # B Sq Sk Hq D: the policy's picks and why
"""
import argparse

import torch

from . import dispatch
from .configs import DTYPES

DIRECTIONS = ("forward", "backward")


def describe(built: dict, device=None, shape=None, dtype="bf16", causal=False, tuned=None) -> list:
    """Lines of the report: the built configs of each direction (built: direction -> names) with their
    shared memory and, given a device description and a shape (B, Sq, Sk, Hq, D), the policy's pick per
    direction and why."""
    lines = []
    for direction in DIRECTIONS:
        names = built.get(direction, [])
        lines.append(f"built {direction} configs ({len(names)}):")
        lines += [f"  {n:40s} smem {dispatch.parse_config(n).smem_bytes() // 1024:4d} KiB" for n in names]
    if device is not None and shape is not None:
        b, sq, sk, hq, d = shape
        lines.append(f"\n{device.name} ({device.sm_count} SMs, {device.smem_per_block // 1024} KiB smem/block):")
        for direction in DIRECTIONS:
            problem = dispatch.Problem(dtype, d, sq, sk, b * hq, causal, direction)
            try:
                name, reason = dispatch.choose_config(device, problem, built.get(direction, []), tuned)
                lines.append(f"  {direction} (bucket {dispatch.bucket_key(problem)}): {name}: {reason}")
            except RuntimeError as e:
                lines.append(f"  {direction}: {e}")
    return lines


def main(argv=None) -> int:
    """python -m flashop.policy [--shape B S_q S_k H_q D] [--dtype bf16] [--causal] [--device N]

    Lists the built kernel configs and, given a shape, what the policy picks on this GPU and why."""
    p = argparse.ArgumentParser(prog="python -m flashop.policy", description=main.__doc__)
    p.add_argument("--shape", nargs=5, type=int, metavar=("B", "SQ", "SK", "HQ", "D"))
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    built = {direction: dispatch.built_configs(direction) for direction in DIRECTIONS}
    device = tuned = None
    if args.shape:
        if not torch.cuda.is_available():
            print("no CUDA device: the policy needs one to describe")
            return 1
        device = dispatch.DeviceInfo.of(args.device)
        tuned = dispatch.tuned_entries(device.name)
    print("\n".join(describe(built, device, args.shape, args.dtype, args.causal, tuned)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

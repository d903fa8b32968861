"""The config-dispatch policy: which built kernel runs a given problem.

`choose_config(device, problem)` is a plain function of a device description
and the problem, so it is unit-tested on the CPU with described devices. The
CUDA kernel registered in flashop/ops.py calls it at run time, inside the op:
a graph traced by torch.compile keeps choosing per call.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .configs import KernelConfig

CPU_CONFIG = "cpu"


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the policy needs to know about a GPU."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum for one block

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(index: int) -> "DeviceInfo":
        props = torch.cuda.get_device_properties(index)
        smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
        return DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count, smem)


@dataclasses.dataclass(frozen=True)
class Problem:
    dtype: str  # "fp16" | "bf16"
    headdim: int
    seqlen_q: int
    seqlen_k: int
    batch_heads: int  # batch x query heads
    causal: bool
    direction: str = "forward"


_DTYPE_CODES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_code(dtype: torch.dtype) -> str | None:
    return _DTYPE_CODES.get(dtype)


def _native():
    from . import _C

    return _C


def built_configs(direction: str = "forward") -> list[str]:
    """Names of the CUDA kernel configs compiled into this build."""
    native = _native()
    if not native.WITH_CUDA or direction != "forward":
        return []
    return list(native.built_forward_configs())


def check_config(config: str | None, device: torch.device, dtype: torch.dtype, headdim: int, direction: str):
    """The rules for an explicit `config=`; the same in eager kernels and fake kernels."""
    if config is None:
        return
    op = f"flashop.{direction}"
    if device.type != "cuda":
        if config != CPU_CONFIG:
            raise RuntimeError(f"{op}: config '{config}' is not a CPU kernel config; the CPU backend has one kernel, "
                               f"config=None or '{CPU_CONFIG}'")
        return
    built = built_configs(direction)
    if config not in built:
        raise RuntimeError(f"{op}: unknown kernel config '{config}'; built configs: {', '.join(built) or '(none)'}")
    parsed = KernelConfig.parse(config)
    if parsed.dtype != dtype_code(dtype) or parsed.headdim != headdim:
        raise RuntimeError(f"{op}: kernel config '{config}' is for {parsed.dtype} headdim {parsed.headdim}, "
                           f"but the inputs are {dtype} headdim {headdim}")

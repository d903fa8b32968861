"""flashop: FlashAttention as a PyTorch operator.

Importing the package loads the native extension, which registers
torch.ops.flashop.forward / backward with CPU (and, in CUDA builds, CUDA)
kernels, their fake kernels and autograd.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the operators)
from ._C import cpu_isa  # the instruction set of the CPU kernels that run
from . import meta  # noqa: F401  (fake kernels)
from . import configs, dispatch, kvcache, modules, ops, paged
from .ops import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    scaled_dot_product_attention,
)
from .kvcache import flash_attn_with_kvcache
from .autotune import forward_timed, tune

__all__ = [
    "configs",
    "cpu_isa",
    "dispatch",
    "kvcache",
    "modules",
    "ops",
    "paged",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "forward_timed",
    "tune",
]
__version__ = "0.1.0"

"""The names tests/test_flash_attn.py takes from flash_attn.flash_attn_interface."""
import pytest

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    # Only the dropout-mask decoding of the tests asks for it; flashop has no dropout yet.
    pytest.skip("flashop lacks: dropout (no dropout mask layout)")


class _RawExtension:
    """flash_attn_gpu, FlashAttention's own C++ extension: its tests of raw entry points are not about flashop."""

    def __getattr__(self, name):
        pytest.skip(f"flashop lacks: FlashAttention's raw C++ extension (flash_attn_gpu.{name})")


flash_attn_gpu = _RawExtension()


def _flash_attn_varlen_forward(*args, **kwargs):
    # FlashAttention's private wrapper of its C++ extension (with its num_splits knob): not flashop's API.
    pytest.skip("flashop lacks: FlashAttention's private _flash_attn_varlen_forward (a wrapper of its C++ extension)")

"""The two names tests/test_flash_attn.py takes from flash_attn.flash_attn_interface."""
import pytest

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    # Only the dropout-mask decoding of the tests asks for it; flashop has no dropout yet.
    pytest.skip("flashop lacks: dropout (no dropout mask layout)")

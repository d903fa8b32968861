"""A `flash_attn` stand-in that runs FlashAttention-2's own tests (tests/test_flash_attn.py) against flashop.

Each public function calls flashop's function of the same name. What flashop does not have yet raises
NotImplementedError in flashop; here it becomes a pytest skip whose reason starts with "flashop lacks", so a
run reports unsupported cases apart from failures. Used by tools/fa2_suite/run.sh only, never installed.
"""
import functools

import pytest

import flashop


def _skip_unsupported(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as err:
            pytest.skip(f"flashop lacks: {err}")
    return call


def _missing(name):
    def call(*args, **kwargs):
        pytest.skip(f"flashop lacks: {name}")
    call.__name__ = name
    return call


_NAMES = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
          "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")
for _name in _NAMES:
    globals()[_name] = _skip_unsupported(getattr(flashop, _name)) if hasattr(flashop, _name) else _missing(_name)

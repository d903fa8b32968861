"""Kernel-config names: a bad one gets an error that says what is wrong (inline expectations)."""
import pytest

from flashop.configs import KernelConfig

expecttest = pytest.importorskip("expecttest")


class TestConfigErrors(expecttest.TestCase):
    def check(self, text, expected):
        with self.assertRaises(ValueError) as caught:
            KernelConfig.parse(text)
        self.assertExpectedInline(str(caught.exception), expected, skip=1)

    def test_bad_names(self):
        self.check("bf16.d128", """kernel config 'bf16.d128': expected the form <dtype>.d<headdim>.br<block_m>.bc<block_n>.w<warps>[.kv2][.qreg][.noswz]""")
        self.check("fp32.d128.br128.bc64.w4", """kernel config 'fp32.d128.br128.bc64.w4': dtype 'fp32' is not one of fp16, bf16""")
        self.check("bf16.d100.br128.bc64.w4", """invalid kernel config 'bf16.d100.br128.bc64.w4': headdim 100 is not one of 32, 64, 96, 128, 192, 256""")
        self.check("bf16.d128.br128.bc64.w4.fast", """kernel config 'bf16.d128.br128.bc64.w4.fast': unknown flag 'fast'; known flags: kv2, qreg, noswz""")
        self.check("bf16.d128.br96.bc64.w4", """invalid kernel config 'bf16.d128.br96.bc64.w4': block_m (br) 96 with 4 warps gives 24 rows per warp; each warp must own 16 or 32 rows""")

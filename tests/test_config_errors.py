"""Kernel-config names: a bad one gets an error that says what is wrong (inline expectations)."""
import pytest

from flashop.configs import HopperConfig, KernelConfig

expecttest = pytest.importorskip("expecttest")


class ParseErrors(expecttest.TestCase):
    """check(name, expected): parsing `name` raises ValueError with exactly `expected`."""
    parse = None

    def check(self, text, expected):
        with self.assertRaises(ValueError) as caught:
            type(self).parse(text)
        self.assertExpectedInline(str(caught.exception), expected, skip=1)


class TestConfigErrors(ParseErrors):
    parse = staticmethod(KernelConfig.parse)

    def test_bad_names(self):
        self.check("bf16.d128", """kernel config 'bf16.d128': expected the form <dtype>.d<headdim>.br<block_m>.bc<block_n>.w<warps>[.kv2][.qreg][.noswz]""")
        self.check("fp32.d128.br128.bc64.w4", """kernel config 'fp32.d128.br128.bc64.w4': dtype 'fp32' is not one of fp16, bf16""")
        self.check("bf16.d100.br128.bc64.w4", """invalid kernel config 'bf16.d100.br128.bc64.w4': headdim 100 is not one of 32, 64, 96, 128, 160, 192, 224, 256""")
        self.check("bf16.d128.br128.bc64.w4.fast", """kernel config 'bf16.d128.br128.bc64.w4.fast': unknown flag 'fast'; known flags: kv2, qreg, noswz""")
        self.check("bf16.d128.br96.bc64.w4", """invalid kernel config 'bf16.d128.br96.bc64.w4': block_m (br) 96 with 4 warps gives 24 rows per warp; each warp must own 16 or 32 rows""")


class TestHopperConfigErrors(ParseErrors):
    parse = staticmethod(HopperConfig.parse)

    def test_multicast_and_two_ctas_per_sm(self):
        self.check("sm90.bf16.d128.br128.bc176.mc.pers", """HopperConfig 'sm90.bf16.d128.br128.bc176.mc.pers': multicast ('mc') is a one-tile-per-CTA TMA-store kernel ('mc.tmao')""")
        self.check("sm90.bf16.d64.br64.bc128.mc.tmao", """HopperConfig 'sm90.bf16.d64.br64.bc128.mc.tmao': the kernel takes D in (64, 96, 128, 160, 192, 224, 256), B_r = 128 (or 192 at D = 64, not persistent, or 64, one tile per CTA without multicast), B_c 64 or 128 (or 176 or 192 at D = 128, 80 at D = 224 and 256, 112 at D = 192)""")
        self.check("sm90.bf16.d128.br64.bc128.tmao", """HopperConfig 'sm90.bf16.d128.br64.bc128.tmao': B_r = 64 runs 2 CTAs per SM, but 148552 bytes of shared memory each do not fit 2 times""")
        self.check("sm90.bf16.d64.br64.bc128.cta3.tmao", """HopperConfig 'sm90.bf16.d64.br64.bc128.cta3.tmao': three CTAs per SM ('cta3') is built for D = 64, B_r = 64, B_c = 64 (136 registers per consumer thread)""")
        self.check("sm90.bf16.d128.br128.bc176.tmao.mc", """Hopper kernel config 'sm90.bf16.d128.br128.bc176.tmao.mc': not in canonical form (sm90.bf16.d128.br128.bc176.mc.tmao)""")

    def test_multicast_and_two_ctas_per_sm_parse(self):
        config = HopperConfig.parse("sm90.fp16.d256.br128.bc80.mc.tmao")
        self.assertTrue(config.multicast and config.tma_store and not config.persistent)
        # Two CTAs per SM: each CTA's shared memory (Q + 2 stages of K and V + barriers + 1 KiB slack) fits twice.
        self.assertEqual(HopperConfig.parse("sm90.bf16.d64.br64.bc128.tmao").smem_bytes(), 74824)
        self.assertEqual(HopperConfig.parse("sm90.bf16.d128.br64.bc64.tmao").smem_bytes(), 83016)

"""The copies of the CPU kernels, one per instruction set (csrc/cpu/isa.h): every copy this CPU runs, forced
with FLASHOP_CPU_ISA in a subprocess, against the float64 reference and against the other copies; the
variable's errors; and, in the built module, that no copy reaches code compiled for a newer ISA than its own
(a wheel built on an AVX-512 machine must run on an AVX2 one)."""
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

import flashop
from reference import assert_close_to_reference, assert_grad_close_to_reference, attention_reference

BUILT = flashop._C.cpu_isas()
SUPPORTED = flashop._C.cpu_isas_supported()

# (name, (batch, seqlen_q, seqlen_k, heads_q, heads_k, headdim), flash_attn_func's variant arguments); headdim
# 64 takes the 16-bit brgemm path where the CPU has one, 40 the widened one; lengths leave vector tails.
CASES = [
    ("causal-gqa", (2, 150, 150, 8, 2, 64), dict(causal=True)),
    ("window-softcap-alibi", (2, 97, 170, 4, 4, 40), dict(window_size=(48, 8), softcap=15.0, alibi=True)),
    # Several query and key tiles of every copy's backward, tiles outside the window skipped.
    ("window-tiles", (1, 300, 700, 2, 1, 64), dict(window_size=(150, 30))),
]
DTYPES = [torch.float32, torch.bfloat16]

# Runs in a subprocess with FLASHOP_CPU_ISA set: the forward (out, lse) and the gradients of each case.
CHILD = r"""
import sys
import torch
import flashop

results = {"isa": flashop.cpu_isa(), "cases": []}
for case in torch.load(sys.argv[1]):
    q, k, v = (case[n].requires_grad_() for n in "qkv")
    out, lse, _ = flashop.flash_attn_func(q, k, v, return_attn_probs=True, **case["args"])
    grads = torch.autograd.grad(out, (q, k, v), case["dout"])
    results["cases"].append({"out": out.detach(), "lse": lse, "grads": grads})
torch.save(results, sys.argv[2])
"""


def child_env(isa):
    # The subprocess imports the flashop this process imported, whether from the tree or installed.
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashop.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, FLASHOP_CPU_ISA=isa, PYTHONPATH=path)


def run_child(code, isa, *args):
    return subprocess.run([sys.executable, "-c", code, *args], env=child_env(isa), capture_output=True, text=True,
                          timeout=300)


def make_cases(generator):
    cases = []
    for dtype in DTYPES:
        for name, (b, sq, sk, hq, hk, d), variant in CASES:
            def randn(*shape):
                return torch.randn(*shape, generator=generator).to(dtype)
            args = {key: value for key, value in variant.items() if key != "alibi"}
            if variant.get("alibi"):
                args["alibi_slopes"] = torch.rand(b, hq, generator=generator) * 0.5
            cases.append({"name": f"{name}-{str(dtype).split('.')[-1]}", "q": randn(b, sq, hq, d),
                          "k": randn(b, sk, hk, d), "v": randn(b, sk, hk, d), "dout": randn(b, sq, hq, d),
                          "args": args})
    return cases


def reference(case, upcast):
    """(out, lse, (dq, dk, dv)) of the reference: float64 with upcast, else in the inputs' dtype."""
    q, k, v = (case[n].detach().requires_grad_() for n in "qkv")
    args = dict(case["args"])
    out, lse = attention_reference(q, k, v, upcast=upcast, **args)
    dout = case["dout"].to(out.dtype)
    return out.detach(), lse, torch.autograd.grad(out, (q, k, v), dout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The inputs, and each supported copy's results on them (one subprocess per copy)."""
    seed = int(os.environ.get("FLASHOP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"FLASHOP_TEST_SEED={seed}")
    cases = make_cases(torch.Generator().manual_seed(seed))
    tmp = tmp_path_factory.mktemp("cpu_isa")
    torch.save(cases, tmp / "inputs.pt")
    results = {}
    for isa in SUPPORTED:
        proc = run_child(CHILD, isa, str(tmp / "inputs.pt"), str(tmp / f"{isa}.pt"))
        assert proc.returncode == 0, f"FLASHOP_CPU_ISA={isa}:\n{proc.stdout}\n{proc.stderr}"
        results[isa] = torch.load(tmp / f"{isa}.pt")
    return cases, results


def test_lists_of_instruction_sets():
    assert BUILT[0] == "default" and "default" in SUPPORTED
    assert SUPPORTED == [isa for isa in BUILT if isa in SUPPORTED], "supported copies keep the build's order"
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert BUILT == ["default", "avx2", "avx512"]
    forced = os.environ.get("FLASHOP_CPU_ISA", "").lower()
    assert flashop.cpu_isa() == (forced or SUPPORTED[-1])


@pytest.mark.parametrize("isa", SUPPORTED)
def test_forced_copy_matches_reference(runs, isa):
    cases, results = runs
    assert results[isa]["isa"] == isa, "flashop.cpu_isa() reports the copy FLASHOP_CPU_ISA forces"
    for case, ours in zip(cases, results[isa]["cases"]):
        ref_out, ref_lse, ref_grads = reference(case, upcast=True)
        lowp_out, _, lowp_grads = reference(case, upcast=False)
        assert_close_to_reference(ours["out"], ref_out, lowp_out, f"{case['name']} out")
        torch.testing.assert_close(ours["lse"], ref_lse, atol=1e-3, rtol=1e-3)
        for name, g, ref_g, lowp_g in zip(("dq", "dk", "dv"), ours["grads"], ref_grads, lowp_grads):
            assert_grad_close_to_reference(g, ref_g, lowp_g, f"{case['name']} {name}")


def test_copies_agree(runs):
    """Every copy computes the same thing: they differ in the exponential's approximation and the order of
    sums, so by about fp32 rounding (a unit in the last place after rounding to 16 bits)."""
    cases, results = runs
    first = results[SUPPORTED[0]]["cases"]
    for isa in SUPPORTED[1:]:
        for case, a, b in zip(cases, first, results[isa]["cases"]):
            pairs = [("out", a["out"], b["out"]), ("lse", a["lse"], b["lse"])]
            pairs += list(zip(("dq", "dk", "dv"), a["grads"], b["grads"]))
            for name, x, y in pairs:
                scale = x.abs().max().item()
                rtol, atol = (1e-4, 1e-5 * scale) if x.dtype == torch.float32 else (2e-2, 1e-2 * scale)
                torch.testing.assert_close(y, x, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{case['name']} {name}: {isa} vs {SUPPORTED[0]}: {m}")


ERRORS = r"""
import torch
import flashop

try:
    flashop.cpu_isa()
except RuntimeError as e:
    print("cpu_isa:", e)
try:
    q = torch.randn(1, 8, 1, 16)
    flashop.flash_attn_func(q, q, q)
except RuntimeError as e:
    print("forward:", e)
"""


def test_unknown_value_is_a_clear_error():
    proc = run_child(ERRORS, "avx9000")
    assert proc.returncode == 0, proc.stderr  # importing flashop works; the first use raises
    for where in ("cpu_isa", "forward"):
        line = next(line for line in proc.stdout.splitlines() if line.startswith(where + ":"))
        assert "FLASHOP_CPU_ISA=avx9000: unknown instruction set" in line
        assert f"this CPU supports {', '.join(SUPPORTED)}" in line


@pytest.mark.skipif(len(BUILT) == 1, reason="a build with the generic copy alone: every CPU runs it")
def test_unsupported_value_is_a_clear_error():
    # The rule for a CPU without the build's best copy, then the real thing for the copies this CPU lacks.
    with pytest.raises(RuntimeError, match=f"FLASHOP_CPU_ISA={BUILT[-1]}: this CPU does not support {BUILT[-1]}; "
                                           f"it supports {', '.join(BUILT[:-1])}"):
        flashop._C._select_cpu_isa(BUILT[-1], BUILT[:-1])
    assert flashop._C._select_cpu_isa("", BUILT[:-1]) == BUILT[-2], "unset: the best supported copy"
    assert flashop._C._select_cpu_isa(BUILT[0].upper(), BUILT) == BUILT[0], "names are case-insensitive"
    for isa in (isa for isa in BUILT if isa not in SUPPORTED):
        proc = run_child(ERRORS, isa)
        assert f"FLASHOP_CPU_ISA={isa}: this CPU does not support {isa}" in proc.stdout, proc.stdout + proc.stderr


# The encodings a copy may execute: generic x86-64 code has neither VEX (AVX, AVX2, FMA, F16C) nor EVEX
# (AVX-512) instructions; the AVX2 copy no EVEX. The last one listed is one its own code must use.
ENCODINGS = {"default": ["legacy"], "avx2": ["legacy", "vex"], "avx512": ["legacy", "vex", "evex"]}


def disassemble(path):
    """{function symbol: (the encodings of its instructions, the symbols it references)} of a module's code."""
    text = subprocess.run(["objdump", "-d", "--insn-width=16", path], capture_output=True, text=True,
                          check=True).stdout
    functions, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            current = functions.setdefault(head.group(1), (set(), set()))
            continue
        insn = re.match(r"^\s*[0-9a-f]+:\t([0-9a-f ]+)\t(.*)$", line)
        if not insn or current is None:
            continue
        raw = insn.group(1).split()
        while raw and raw[0] in ("26", "2e", "36", "3e", "64", "65", "67"):  # prefixes VEX and EVEX may follow
            raw = raw[1:]
        # In 64-bit code c4/c5 always start a VEX instruction and 62 an EVEX one.
        current[0].add({"c4": "vex", "c5": "vex", "62": "evex"}.get(raw[0] if raw else "", "legacy"))
        # Calls, jumps and address loads (function pointers: OpenMP regions, std::function).
        current[1].update(re.findall(r"<([^>+]+)(?:\+0x[0-9a-f]+)?>", insn.group(2)))
    return functions


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instruction encodings")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_no_copy_reaches_newer_instructions():
    """Every function a copy can reach in flashop._C (its own, and the inline functions of c10 and the standard
    library the linker kept one copy of) uses only its ISA's encodings."""
    functions = disassemble(flashop._C.__file__)
    for isa in BUILT:
        namespace = f"N7flashop3cpu{len('isa_' + isa)}isa_{isa}"  # mangled flashop::cpu::isa_<name>
        todo = [name for name in functions if namespace in name]
        assert todo, f"no code of the {isa} copy in {flashop._C.__file__}"
        reached = set()
        while todo:
            name = todo.pop()
            if name in reached or name not in functions:
                continue
            reached.add(name)
            todo += functions[name][1]
        used = {}
        for name in reached:
            for encoding in functions[name][0]:
                used.setdefault(encoding, []).append(name)
        beyond = {enc: names[:5] for enc, names in used.items() if enc not in ENCODINGS[isa]}
        assert not beyond, f"the {isa} copy reaches instructions beyond its ISA: {beyond}"
        assert ENCODINGS[isa][-1] in used, f"the {isa} copy has no {ENCODINGS[isa][-1]} instruction: built without its flags?"

"""Opcode counts per kernel of a `cuobjdump -sass` listing, for the kernels whose (mangled) name contains
every given substring: what a change did to the instructions (fences, barriers, HGMMA, TMA).

    cuobjdump -sass flashop/_C_sm90*.so | python3 tools/probes/sass_ops.py Li176ELb1ELb1ELb0ELb0ELi2ELb1E [--ops MEMBAR SYNCS]

--order prints the selected opcodes in program order instead (runs of one opcode as "OP xN"), e.g. where
the spill loads and stores (LDL, STL) sit between the HGMMAs and barriers of the main loop.
--main-loop keeps only the forward kernels' main loop: the shortest backward branch whose body issues both
an S wgmma (shared-memory A) and a P V wgmma (register A, ".tnspB" B), e.g. to count its local loads (LDL)
and uniform-register moves (R2UR) per key tile.
cuobjdump and nvdisasm also come as wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), for a machine
whose toolkit lacks them.
"""
import argparse
import collections
import itertools
import re
import sys

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*);")


def kernels(listing: str):
    """(mangled name, [(address, opcode with modifiers, instruction text)]) per function of the listing."""
    for chunk in re.split(r"\n\s*Function : ", listing)[1:]:
        name, body = chunk.split("\n", 1)
        yield name.strip(), [(int(a, 16), op, text) for a, text, op in _INSTRUCTION.findall(body)]


def main_loop(instructions):
    """The instructions of the shortest loop (backward branch target .. branch) that issues both kinds of
    the forward's wgmma; [] if there is none."""
    best = []
    for address, op, text in instructions:
        target = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", text)
        if not op.startswith("BRA") or target is None or int(target.group(1), 16) >= address:
            continue
        body = [i for i in instructions if int(target.group(1), 16) <= i[0] <= address]
        wgmmas = [text for _, body_op, text in body if body_op.startswith("HGMMA")]
        if any("tnspB" in t for t in wgmmas) and any("tnspB" not in t for t in wgmmas):
            if not best or len(body) < len(best):
                best = body
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="+", help="substrings of the mangled kernel name")
    parser.add_argument("--ops", nargs="*", default=None, help="opcode prefixes to show (default: all)")
    parser.add_argument("--order", action="store_true", help="the selected opcodes in program order")
    parser.add_argument("--main-loop", action="store_true", help="only the instructions of the main loop")
    args = parser.parse_args()
    for name, instructions in kernels(sys.stdin.read()):
        if not all(p in name for p in args.patterns):
            continue
        if args.main_loop:
            instructions = main_loop(instructions)
        ops = [op for _, op, _ in instructions]
        selected = [op for op in ops if args.ops is None or any(op.startswith(prefix) for prefix in args.ops)]
        where = "main loop: " if args.main_loop else ""
        print(f"{name[:160]}: {where}{len(ops)} instructions")
        if args.order:
            runs = [(op, len(list(group))) for op, group in itertools.groupby(selected)]
            print("  " + ", ".join(op if n == 1 else f"{op} x{n}" for op, n in runs))
            continue
        shown = dict(sorted(collections.Counter(selected).items()))
        print("  " + ", ".join(f"{op} {n}" for op, n in shown.items()))


if __name__ == "__main__":
    main()

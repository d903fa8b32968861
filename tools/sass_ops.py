"""Opcode counts per kernel of a `cuobjdump -sass` listing, for the kernels whose (mangled) name contains
every given substring: what a change did to the instructions (fences, barriers, HGMMA, TMA).

    cuobjdump -sass flashop/_C_sm90*.so | python3 tools/sass_ops.py Li176ELb1ELb1ELb0ELb0ELi2ELb1E [--ops MEMBAR SYNCS]

--order prints the selected opcodes in program order instead (runs of one opcode as "OP xN"), e.g. where
the spill loads and stores (LDL, STL) sit between the HGMMAs and barriers of the main loop.
"""
import argparse
import collections
import itertools
import re
import sys


def kernels(listing: str):
    """(mangled name, [opcodes with modifiers]) per function of the listing."""
    for chunk in re.split(r"\n\s*Function : ", listing)[1:]:
        name, body = chunk.split("\n", 1)
        yield name.strip(), re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", body)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="+", help="substrings of the mangled kernel name")
    parser.add_argument("--ops", nargs="*", default=None, help="opcode prefixes to show (default: all)")
    parser.add_argument("--order", action="store_true", help="the selected opcodes in program order")
    args = parser.parse_args()
    for name, ops in kernels(sys.stdin.read()):
        if not all(p in name for p in args.patterns):
            continue
        selected = [op for op in ops if args.ops is None or any(op.startswith(prefix) for prefix in args.ops)]
        if args.order:
            runs = [(op, len(list(group))) for op, group in itertools.groupby(selected)]
            print(f"{name[:160]}: {len(ops)} instructions")
            print("  " + ", ".join(op if n == 1 else f"{op} x{n}" for op, n in runs))
            continue
        shown = dict(sorted(collections.Counter(selected).items()))
        print(f"{name[:160]}: {len(ops)} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in shown.items()))


if __name__ == "__main__":
    main()

"""Per-instruction warp-stall listing from an Nsight Compute source page (tools/gpu_check.sh profile).

    ncu --import profile.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/probes/ncu_sass_listing.py sass.csv > profile_sass.txt

Prints the stall reasons summed over the kernel, the instructions with the most warp samples, then every
instruction: address (last 5 hex digits), samples, times executed, SASS, its top two stall reasons.
"""
import collections
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top=40):
    rows = list(csv.reader(open(path, errors="replace")))
    header_at = next(i for i, row in enumerate(rows) if "Address" in row and "Source" in row)
    header, body = rows[header_at], [row for row in rows[header_at + 1:] if len(row) == len(rows[header_at])]
    address, source = header.index("Address"), header.index("Source")
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    stalls = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]

    def top_stalls(row, k=2):
        ranked = sorted(((header[i][len("stall_"):], number(row[i])) for i in stalls), key=lambda t: -t[1])
        return " ".join(f"{name}:{int(count)}" for name, count in ranked[:k] if count > 0)

    total = sum(number(row[samples]) for row in body) or 1.0
    totals = collections.Counter({header[i]: sum(number(row[i]) for row in body) for i in stalls})
    print(f"{int(total)} warp samples; stall reasons:")
    for name, count in totals.most_common():
        if count:
            print(f"  {name[len('stall_'):]:<20} {100 * count / total:5.1f}%")
    print(f"\ntop {top} instructions by samples:")
    for row in sorted(body, key=lambda r: -number(r[samples]))[:top]:
        print(f"  {row[address][-5:]} {100 * number(row[samples]) / total:5.1f}%  {row[source].strip()[:70]}  "
              f"{top_stalls(row)}")
    print("\nall instructions:")
    for row in body:
        print(f"{row[address][-5:]} {int(number(row[samples])):7d} {int(number(row[executed])):10d}  "
              f"{row[source].strip()[:80]}  {top_stalls(row)}")


if __name__ == "__main__":
    main(sys.argv[1])

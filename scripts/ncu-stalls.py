#!/usr/bin/env python3
"""Where a kernel's warps wait: the warp-state samples of an Nsight Compute source page, summed
by reason and listed per SASS instruction.

    ncu --clock-control none --set full --import-source yes -k regex:fa3_forward -c 1 -o rep <program>
    ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/ncu-stalls.py source.csv [N]

prints the total samples and the 12 largest stall reasons, then the N (default 40) instructions with the most
samples and their three largest reasons (docs/perf-notes.md reads these listings).
"""
import collections
import csv
import sys


def main() -> None:
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    col = {name: i for i, name in enumerate(header)}
    reasons = [k for k in header if k.startswith("stall_") and "(Not" not in k]
    total, items = collections.Counter(), []
    for r in data:
        per = {k: int(r[col[k]] or 0) for k in reasons}
        total.update(per)
        samples = int(r[col["Warp Stall Sampling (All Samples)"]] or 0)
        items.append((samples, r[0], r[1].strip(), per))
    all_samples = sum(s for s, *_ in items)
    print("total samples", all_samples)
    for k, v in total.most_common(12):
        print(f"  {k:28s}{v:8d} {100 * v / max(all_samples, 1):5.1f} %")
    print("top instructions (samples, address, SASS, top reasons):")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    for samples, addr, sass, per in sorted(items, key=lambda x: -x[0])[:n]:
        top = ", ".join(f"{k[6:]} {v}" for k, v in sorted(per.items(), key=lambda x: -x[1])[:3] if v)
        print(f"{samples:6d} {addr[-5:]} {sass[:60]:60s} {top}")


if __name__ == "__main__":
    main()

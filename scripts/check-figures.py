#!/usr/bin/env python3
"""Checks that the figures the book, the READMEs and the notebooks quote from a committed lease
are the figures in its CSV files.

A quoted figure carries its source in an HTML comment right after it (invisible in the book and
in Jupyter), naming the results folder and the row:

    607<!-- docs/results/current fa3 fwd fp16 d128 none n16384 --> TFLOP/s
    0.91×<!-- docs/results/current fa3/sdpa-cudnn bwd fp16 d128 none n16384 -->
    2.62 TB/s<!-- docs/results/current/decode flash-decoding b1 h32/8 L8192 new1 -->

A prefill row is `IMPL DIRECTION DTYPE dD MASK nN` (MASK `none` or `causal`; square problems, no
window, the default layout); `IMPL/OTHER` quotes the ratio of two rows. A decoding row is
`IMPL bB hQ/KV LLEN newT` (contiguous cache; `/pP` after IMPL for pages of P tokens), and its
figure is TB/s. The number is the last one before the comment on its line, and it must equal the
CSV's value rounded to as many decimals as the quote shows. Rows come from the folder's bench.csv
and peers.csv.

    python3 scripts/check-figures.py          # every tracked Markdown file and notebook source

Exit status 1 on a quote that does not match, names a row that is not there, or cannot be read.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"<!--\s*(docs/results/\S+)\s+([^>]*?)\s*-->")
NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?)")


def rows_of(folder: Path, cache: dict) -> list[dict]:
    if folder not in cache:
        rows = []
        for name in ("bench.csv", "peers.csv"):
            path = folder / name
            if path.exists():
                with path.open() as f:
                    rows.extend(csv.DictReader(f))
        cache[folder] = rows
    return cache[folder]


def value(rows: list[dict], impl: str, key: list[str]) -> float:
    """The figure of one row: TFLOP/s of a prefill row, TB/s of a decoding row."""
    if key and re.fullmatch(r"b\d+", key[0]):  # decoding: bB hQ/KV LLEN newT
        batch, heads, length, new = key
        hq, hkv = heads[1:].split("/")
        impl, _, page = impl.partition("/p")
        want = {"impl": impl, "direction": "decode", "batch": batch[1:], "heads_q": hq,
                "heads_kv": hkv, "n_kv": length[1:], "n_q": new[3:], "page_size": page}
        field = "tbps"
    else:  # prefill: DIRECTION DTYPE dD MASK nN
        direction, dtype, d, mask, n = key
        want = {"impl": impl, "direction": direction, "dtype": dtype, "d": d[1:],
                "causal": {"none": "false", "causal": "true"}[mask], "n_q": n[1:], "n_kv": n[1:],
                "window": "", "layout": ""}
        field = "tflops"
    found = [r for r in rows if all((r.get(k) or "") == v for k, v in want.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows match {want}")
    return float(found[0][field])


def check(path: Path, cache: dict) -> list[str]:
    errors = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for tag in TAG.finditer(line):
            folder, spec = tag.group(1), tag.group(2).split()
            where = f"{path.relative_to(ROOT)}:{lineno}"
            numbers = list(NUMBER.finditer(line[: tag.start()]))
            if not numbers:
                errors.append(f"{where}: no number before the tag {tag.group(0)}")
                continue
            quoted = numbers[-1].group(1).replace(",", "")
            decimals = len(quoted.split(".")[1]) if "." in quoted else 0
            try:
                rows = rows_of(ROOT / folder, cache)
                if not rows:
                    raise LookupError(f"no bench.csv or peers.csv in {folder}")
                impl, key = spec[0], spec[1:]
                if "/" in impl and not impl.startswith("flash-decoding"):
                    a, b = impl.split("/")
                    actual = value(rows, a, key) / value(rows, b, key)
                else:
                    actual = value(rows, impl, key)
            except (LookupError, ValueError, KeyError) as e:
                errors.append(f"{where}: {tag.group(0)}: {e}")
                continue
            if f"{actual:.{decimals}f}" != f"{float(quoted):.{decimals}f}":
                errors.append(f"{where}: quotes {quoted}, {folder} has {actual:.{decimals + 2}f} "
                              f"({' '.join(spec)})")
    return errors


def main() -> int:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    cache: dict = {}
    errors, quotes = [], 0
    for name in listed:
        path = ROOT / name
        if path.exists():
            quotes += len(TAG.findall(path.read_text(encoding="utf-8")))
            errors.extend(check(path, cache))
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"check-figures: {len(errors)} of {quotes} quoted figures do not match their CSVs",
              file=sys.stderr)
        return 1
    print(f"check-figures: {quotes} quoted figures match their CSVs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

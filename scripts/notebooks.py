#!/usr/bin/env python3
"""Builds, executes and checks the teaching notebooks.

The source of each notebook is a Markdown file, notebooks/src/NN-name.md: its prose becomes
Markdown cells and each ```rust fence becomes a code cell. A fence may carry words after `rust`:

    ```rust exercise          the learner's cell: executed with notebooks/solutions/NN-name.rs in
                              its place, committed with the stub (and no output)
    ```rust exercise=PART     a second exercise of the same notebook: its solution is
                              notebooks/solutions/NN-name-PART.rs
    ```rust figure=NAME       its SVG outputs are also written to docs/figures/NN-NAME.svg
                              (NN-NAME-2.svg, ... for more than one), for the book
    ```rust book              its printed text, HTML tables and figures also go to
                              docs/figures/NN-name.md, which a book chapter includes

Commands (NN selects notebooks by number; none means all):

    build [NN...]             write notebooks/NN-name.ipynb from the sources, without outputs
    execute [NN...] [--out DIR]
                              execute with the reference solutions substituted, failing on the
                              first cell error; with --out, write the executed notebooks there
                              (CI), else refresh notebooks/*.ipynb and the book's figures
    check-sync                fail if a committed notebook's cells differ from its source, or
                              one shows a stray `()` output

The Rust kernel is evcxr's (`scripts/setup-notebooks` installs it). Set EVCXR_TMPDIR to one folder
to let the notebooks share their compiled dependencies (they run one after another).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
SOLUTIONS = NOTEBOOKS / "solutions"
FIGURES = ROOT / "docs" / "figures"

FENCE = re.compile(r"^```rust((?:\s+\S+)*)\s*$")

KERNEL = {"display_name": "Rust", "language": "rust", "name": "rust"}
LANGUAGE = {
    "codemirror_mode": "rust",
    "file_extension": ".rs",
    "mimetype": "text/rust",
    "name": "Rust",
    "pygment_lexer": "rust",
    "version": "",
}


def sources(ids: list[str]) -> list[Path]:
    found = sorted(SOURCES.glob("[0-9][0-9]-*.md"))
    if not ids:
        return found
    chosen = [p for p in found if any(p.name.startswith(i.zfill(2)) for i in ids)]
    missing = [i for i in ids if not any(p.name.startswith(i.zfill(2)) for p in found)]
    if missing:
        sys.exit(f"notebooks: no source notebooks/src/{missing[0]}-*.md")
    return chosen


def markdown_cell(lines: list[str]) -> dict | None:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    if not lines:
        return None
    return {"cell_type": "markdown", "metadata": {}, "source": "\n".join(lines)}


def parse(path: Path) -> dict:
    """The notebook (nbformat 4 JSON) of one source file, without outputs."""
    cells: list[dict] = []
    prose: list[str] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        cell = markdown_cell(prose)
        if cell:
            cells.append(cell)
        prose = []
        words = m.group(1).split()
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            sys.exit(f"{path}: unclosed ```rust fence")
        i += 1
        meta: dict = {}
        tags = []
        for w in words:
            if w == "exercise" or w.startswith("exercise="):
                tags.append("exercise")
                part = w.partition("=")[2]
                meta["solution"] = f"solutions/{path.stem}{'-' + part if part else ''}.rs"
            elif w == "book":
                tags.append("book")
            elif w.startswith("figure="):
                meta["figure"] = w.split("=", 1)[1]
            else:
                sys.exit(f"{path}: unknown fence word {w!r}")
        metadata: dict = {}
        if tags:
            metadata["tags"] = tags
        if meta:
            metadata["ladder"] = meta
        cells.append(
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": metadata,
                "outputs": [],
                "source": "\n".join(body),
            }
        )
    cell = markdown_cell(prose)
    if cell:
        cells.append(cell)
    return {
        "cells": cells,
        "metadata": {"kernelspec": KERNEL, "language_info": LANGUAGE},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def with_ids(nb: dict, stem: str) -> dict:
    """Stable cell ids (nbformat 4.5 wants one per cell)."""
    for n, cell in enumerate(nb["cells"]):
        cell["id"] = f"{stem[:2]}-{n:03d}"
    return nb


def target(src: Path) -> Path:
    return NOTEBOOKS / f"{src.stem}.ipynb"


def write(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def is_exercise(cell: dict) -> bool:
    return "exercise" in cell.get("metadata", {}).get("tags", [])


def html_elements(cell: dict, tag: str) -> list[str]:
    """The `<tag>…</tag>` elements in the HTML a cell displayed."""
    found = []
    for out in cell.get("outputs", []):
        html = out.get("data", {}).get("text/html")
        if html is None:
            continue
        html = "".join(html) if isinstance(html, list) else html
        found += re.findall(rf"<{tag}.*?</{tag}>", html, flags=re.S)
    return found


def svgs(cell: dict) -> list[str]:
    return html_elements(cell, "svg")


def tables(cell: dict) -> list[str]:
    """The HTML tables a cell displayed (a `book` cell's tables go to the book as they are)."""
    return html_elements(cell, "table")


def text_of(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream" and out.get("name") == "stdout":
            t = out.get("text", "")
            parts.append("".join(t) if isinstance(t, list) else t)
    return "".join(parts).strip()


def merge_streams(nb: dict) -> None:
    """One output per run of printed lines (evcxr sends each line as its own message)."""
    for cell in nb["cells"]:
        merged: list[dict] = []
        for out in cell.get("outputs", []):
            prev = merged[-1] if merged else None
            if (
                prev is not None
                and out.get("output_type") == "stream"
                and prev.get("output_type") == "stream"
                and prev.get("name") == out.get("name")
            ):
                text = lambda t: "".join(t) if isinstance(t, list) else t
                prev["text"] = text(prev["text"]) + text(out["text"])
            else:
                merged.append(out)
        if "outputs" in cell:
            cell["outputs"] = merged


def export_figures(nb: dict, stem: str) -> list[Path]:
    """Writes the figures of `figure=` cells and the fragment of `book` cells for the book."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    for old in FIGURES.glob(f"{stem[:2]}-*"):
        old.unlink()
    written = []
    fragment = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        meta = cell.get("metadata", {})
        name = meta.get("ladder", {}).get("figure")
        found = svgs(cell)
        files = []
        if name:
            for k, svg in enumerate(found):
                suffix = "" if k == 0 else f"-{k + 1}"
                path = FIGURES / f"{stem[:2]}-{name}{suffix}.svg"
                path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n")
                files.append(path)
        written += files
        if "book" in meta.get("tags", []):
            text = text_of(cell)
            if text:
                fragment.append(text)
            fragment += tables(cell)
            fragment += [f"![{p.stem}](figures/{p.name})" for p in files]
    if fragment:
        path = FIGURES / f"{stem}.md"
        header = (
            f"<!-- Generated by scripts/refresh-notebooks {stem[:2]} from the outputs of "
            f"notebooks/{stem}.ipynb. Do not edit. -->\n\n"
        )
        path.write_text(header + "\n\n".join(fragment) + "\n")
        written.append(path)
    return written


def execute(src: Path, out_dir: Path | None) -> float:
    import nbclient
    import nbformat

    stem = src.stem
    nb_json = with_ids(parse(src), stem)
    stubs = {}
    for n, cell in enumerate(nb_json["cells"]):
        if is_exercise(cell):
            solution = NOTEBOOKS / cell["metadata"]["ladder"]["solution"]
            if not solution.exists():
                sys.exit(f"{src}: the exercise needs its solution {solution}")
            stubs[n] = cell["source"]
            cell["source"] = solution.read_text().rstrip("\n")
    nb = nbformat.from_dict(nb_json)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="rust",
        timeout=1200,
        startup_timeout=120,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    def fail(message: str) -> None:
        print(f"\n{src.name}: {message}", file=sys.stderr)
        # What the kernel said (evcxr reports compile errors on stderr and in error outputs).
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    print("\n".join([out.get("ename", ""), out.get("evalue", "")] + out.get("traceback", [])), file=sys.stderr)
                elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                    print(out.get("text", ""), file=sys.stderr)
        failed = (out_dir or ROOT / "target" / "notebooks-failed")
        failed.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(failed / f"{stem}.failed.ipynb"))
        print(f"the partly executed notebook is in {failed / (stem + '.failed.ipynb')}", file=sys.stderr)
        raise SystemExit(1)

    start = time.monotonic()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        fail(f"a cell failed\n{e}")
    # A cell whose `?` returns an error (a check that does not pass) is not an execution error
    # for evcxr: it prints the error on stderr and carries on. No cell of ours writes to stderr
    # otherwise, so any stderr output is a failure.
    for n, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "stream" and o.get("name") == "stderr" for o in cell.get("outputs", [])):
            first = "".join(cell["source"]).strip().splitlines()[0]
            fail(f"a cell returned an error (printed on stderr); it begins: {first}")
    elapsed = time.monotonic() - start
    executed = json.loads(nbformat.writes(nb))
    merge_streams(executed)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write(executed, out_dir / f"{stem}.ipynb")
        return elapsed
    # Committed form: the learner's stub, not the solution, in the exercise cell.
    for n, stub in stubs.items():
        cell = executed["cells"][n]
        cell["source"] = stub
        cell["outputs"] = []
        cell["execution_count"] = None
    for cell in executed["cells"]:
        cell.get("metadata", {}).pop("execution", None)
    executed["metadata"] = {"kernelspec": KERNEL, "language_info": LANGUAGE}
    write(executed, target(src))
    for path in export_figures(executed, stem):
        print(f"  wrote {path.relative_to(ROOT)}")
    return elapsed


def check_sync() -> int:
    bad = 0
    for src in sources([]):
        path = target(src)
        if not path.exists():
            print(f"missing {path.relative_to(ROOT)}: run scripts/refresh-notebooks {src.stem[:2]}")
            bad += 1
            continue
        want = [(c["cell_type"], c["source"]) for c in parse(src)["cells"]]
        have = [
            (c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in json.loads(path.read_text())["cells"]
        ]
        if want != have:
            print(
                f"{path.relative_to(ROOT)} differs from {src.relative_to(ROOT)}: "
                f"run scripts/refresh-notebooks {src.stem[:2]}"
            )
            bad += 1
        # A cell whose last expression is `()` (a loop, a `println!` without `;`) shows "()" as
        # its value: noise to a reader. End such a cell with `;`.
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for out in cell.get("outputs", []):
                plain = out.get("data", {}).get("text/plain")
                if ("".join(plain) if isinstance(plain, list) else plain) == "()":
                    print(f"{path.relative_to(ROOT)}: cell {i} shows a stray `()` output")
                    bad += 1
    if bad == 0:
        print("notebooks: every committed notebook matches its source, none shows a stray `()`")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("ids", nargs="*")
    e = sub.add_parser("execute")
    e.add_argument("ids", nargs="*")
    e.add_argument("--out", type=Path)
    sub.add_parser("check-sync")
    args = parser.parse_args()

    if args.command == "check-sync":
        return check_sync()
    if args.command == "build":
        for src in sources(args.ids):
            write(with_ids(parse(src), src.stem), target(src))
            print(f"built {target(src).relative_to(ROOT)}")
        return 0
    total = 0.0
    for src in sources(args.ids):
        print(f"executing {src.stem} ...", flush=True)
        elapsed = execute(src, args.out)
        total += elapsed
        print(f"  {src.stem}: {elapsed:.0f} s", flush=True)
    print(f"notebooks: all executed in {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared output of the benchmarks: aligned tables and the sections of ``benchmarks/RESULTS.md``.

Each benchmark prints its table with :func:`table` and, when asked, replaces its own section of
RESULTS.md with :func:`write_section` (between ``<!-- name -->`` and ``<!-- /name -->`` markers),
so a re-run updates its figures and leaves the other benchmarks' sections as they are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def table(headers: list[str], rows: list[list]) -> str:
    """A markdown table whose columns are padded to line up in a terminal too."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *map(line, cells[1:])])


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.1f}"
    return str(value)


def environment(device: str) -> str:
    """One line: device, torch version and date, for a results section."""
    return f"{device}, torch {torch.__version__}, {datetime.date.today().isoformat()}"


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def write_section(name: str, text: str, path: str = RESULTS_MD) -> None:
    """Put ``text`` into RESULTS.md as section ``name``, replacing an earlier one."""
    block = f"<!-- {name} -->\n{text.strip()}\n<!-- /{name} -->"
    old = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def output_arguments(parser: argparse.ArgumentParser) -> None:
    """--out, --results-md and --report, for a benchmark that publishes through :func:`publish`."""
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--results-md", action="store_true", help="write the table into benchmarks/RESULTS.md")
    parser.add_argument("--report", metavar="JSON", help="only write the RESULTS.md section from a results file")


def publish(section: str, title: str, markdown, result: dict, args: argparse.Namespace) -> None:
    """Save ``result`` (``--out``), put ``markdown(result)`` into RESULTS.md (``--results-md``, or
    ``--report``, whose file ``result`` came from) and print it."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    text = markdown(result)
    if args.results_md or args.report:
        write_section(section, f"## {title}\n\n{text}")
    print(text)

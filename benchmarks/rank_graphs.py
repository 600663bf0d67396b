"""What differs between the ranks' compiled graphs of one job: reads the structured traces that
``simplefsdp-train --trace-dir DIR`` (or ``TORCH_TRACE=DIR``) wrote, one log per rank, and prints
for each graph (Dynamo's output, AOTAutograd's joint, forward and backward graphs) how many of its
lines differ from rank 0's, and how many are left once the collectives' group names are blanked.

Why it matters: Inductor's FX graph cache and AOTAutograd's cache key on the graph, so ranks can
share compiled artifacts only where their graphs are equal (RESULTS.md, "Ranks compile the same
graph under other group names")::

    simplefsdp-train --config configs/debug_moe.toml --training.steps 1 --trace-dir /tmp/trace
    python benchmarks/rank_graphs.py /tmp/trace
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import os
import re

KINDS = ("dynamo_output_graph", "aot_joint_graph", "aot_forward_graph", "aot_backward_graph")
GROUP_ARG = re.compile(r"'[^']*'\)")  # a functional collective's last argument: its group's name


def graphs(path: str) -> dict[str, list[str]]:
    """Each graph kind's payloads in the order the log holds them (a payload follows its header
    line, tab-indented)."""
    out: dict[str, list[str]] = {}
    kind, lines = None, []
    for line in open(path):
        if line.startswith("\t"):
            lines.append(line)
            continue
        if kind is not None:
            out.setdefault(kind, []).append("".join(lines))
        kind, lines = None, []
        if "{" in line:
            try:
                header = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            kind = next((k for k in KINDS if k in header), None)
    if kind is not None:
        out.setdefault(kind, []).append("".join(lines))
    return out


def differing_lines(first: str, other: str) -> tuple[int, int]:
    """Lines of ``other`` that differ from ``first``: all, and those left once each collective's
    group name is blanked."""
    def count(a: list[str], b: list[str]) -> int:
        return sum(1 for line in difflib.unified_diff(a, b, lineterm="", n=0)
                   if line[:1] == "+" and line[:3] != "+++")

    a, b = first.splitlines(), other.splitlines()
    return count(a, b), count([GROUP_ARG.sub("')", line) for line in a], [GROUP_ARG.sub("')", line) for line in b])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    args = parser.parse_args()
    logs = sorted(glob.glob(os.path.join(args.trace_dir, "*rank_*.log")),
                  key=lambda p: int(re.search(r"rank_(\d+)", p).group(1)))
    if len(logs) < 2:
        raise SystemExit(f"{args.trace_dir}: needs the logs of 2 or more ranks, found {len(logs)}")
    per_rank = [graphs(p) for p in logs]
    print(f"{'graph':<22} {'rank':>4} {'lines':>6} {'differ from rank 0':>18} {'group names aside':>17}")
    for kind in KINDS:
        for rank, ours in enumerate(per_rank[1:], start=1):
            for first, other in zip(per_rank[0].get(kind, []), ours.get(kind, [])):
                changed, aside = differing_lines(first, other)
                print(f"{kind:<22} {rank:>4} {len(other.splitlines()):>6} {changed:>18} {aside:>17}")


if __name__ == "__main__":
    main()

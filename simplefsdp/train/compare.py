"""``simplefsdp-compare RUN_A RUN_B ...``: the loss of each step of training runs, side by side.

Each RUN is a run directory (``metrics.out_dir`` of ``simplefsdp-train``) or its
``metrics.jsonl``. Prints one row per step with every run's loss, ``exact`` (all runs' losses are
bit-for-bit equal at that step) and the largest difference from the first run, then a summary
line; saves the loss curves as a PNG (``--plot``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys

from simplefsdp.train.metrics import read_records


def _label(path: str) -> str:
    path = os.path.normpath(path)
    return os.path.basename(os.path.dirname(path)) if path.endswith(".jsonl") else os.path.basename(path)


def loss_table(runs: dict[str, dict[int, float]]) -> list[str]:
    """The table's lines: step, each run's loss, exact, max |diff| from the first run."""
    names = list(runs)
    width = max(12, *(len(n) for n in names))
    steps = sorted(set().union(*(r.keys() for r in runs.values())))
    lines = [f"{'step':>6}  " + "  ".join(f"{n:>{width}}" for n in names) + f"  {'exact':>5}  {'max |diff|':>10}"]
    exact_steps = 0
    for step in steps:
        losses = [runs[n].get(step) for n in names]
        present = [x for x in losses if x is not None]
        complete = len(present) == len(losses)
        exact = complete and all(x == present[0] for x in present)
        exact_steps += exact
        diff = max(abs(x - losses[0]) for x in present) if losses[0] is not None else float("nan")
        cells = "  ".join(f"{x:>{width}.6f}" if x is not None else f"{'-':>{width}}" for x in losses)
        lines.append(f"{step:>6}  {cells}  {'yes' if exact else 'no':>5}  {diff:>10.3g}")
    lines.append(f"{exact_steps}/{len(steps)} steps bit-for-bit equal across {len(names)} runs")
    return lines


def plot(runs: dict[str, dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in runs.items():
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _losses(parser: argparse.ArgumentParser, path: str) -> dict[int, float]:
    """Step -> loss of one run; a parser error naming the file and line for anything else."""
    try:
        records = read_records(path)
    except OSError as e:
        parser.error(f"{path}: no metrics ({e.strerror})")
    except ValueError as e:
        parser.error(f"{path}: {e}")
    losses = {}
    for i, record in enumerate(records, 1):
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or not isinstance(record.get("loss"), (int, float)):
            parser.error(f"{path}: record {i} has no integer 'step' and numeric 'loss'")
        losses[record["step"]] = record["loss"]
    if not losses:
        parser.error(f"{path}: no records")
    return losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="simplefsdp-compare", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory or metrics.jsonl")
    p.add_argument("--plot", default="loss_compare.png", help="PNG of the loss curves ('' for none)")
    args = p.parse_args(argv)
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        p.error(f"--plot: no folder {os.path.dirname(args.plot)!r} to write {os.path.basename(args.plot)!r} into")
    runs = {}
    for path in args.runs:
        name, n = _label(path), 2
        while name in runs:
            name, n = f"{_label(path)}#{n}", n + 1
        runs[name] = _losses(p, path)
    print("\n".join(loss_table(runs)))
    if not args.plot:
        return
    try:
        plot(runs, args.plot)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

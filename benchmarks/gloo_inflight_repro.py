"""Reproduce the gloo crash that ``passes/gloo_one_in_flight.py`` works around: functional
collectives with several in flight corrupt the heap (torch 2.13, CPU, 2 gloo ranks).

    python benchmarks/gloo_inflight_repro.py --in-flight 1,2,4 --runs 4 --iters 3000

Each run spawns 2 gloo ranks that, ``iters`` times, start ``in_flight`` all-gathers of mixed
shapes, do some matmuls, then wait for all of them. Prints, per (API, in-flight count), how many
runs crashed ("malloc(): unaligned tcache chunk detected", a segfault, or a peer's lost
connection), and writes ``benchmarks/results/gloo_inflight_repro.json``. ``--api c10d`` runs the
same gathers through ``dist.all_gather_into_tensor(..., async_op=True)``.

Seen on 2 ranks, 3000 iterations: 2 of 4 runs crashed at 2 in flight and most runs at 3 or more;
1 in flight never crashed, nor did the c10d async API. Before the guard, compiled CPU runs with
prefetch crashed in about one launch in eight (5 of 8 long runs); with the guard, long runs (300
steps, 2 ranks) crashed once in 8 with prefetch still on and never in 8 with it off, which is why
prefetch and the all-to-all overlap leave gloo graphs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simplefsdp.train.launch import run_ranks  # noqa: E402

SHAPES = [(49, 48), (48,), (48, 48), (24, 48), (45, 48), (24, 90)]


def _gathers(in_flight: int, iters: int, api: str) -> str:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    inputs = [torch.randn(s) for s in SHAPES]
    for _ in range(iters):
        pending = []
        for i in range(in_flight):
            x = inputs[i % len(inputs)]
            if api == "functional":
                pending.append(torch.ops._c10d_functional.all_gather_into_tensor.default(x, 2, group))
            else:
                out = x.new_empty((2 * x.shape[0], *x.shape[1:]))
                pending.append((out, dist.all_gather_into_tensor(out, x, async_op=True)))
        torch.randn(64, 64) @ torch.randn(64, 64)
        for p in pending:
            torch.ops._c10d_functional.wait_tensor.default(p) if api == "functional" else p[1].wait()
    return "ok"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-flight", default="1,2,4")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--api", default="functional,c10d")
    args = p.parse_args()
    rows = []
    for api in args.api.split(","):
        for n in map(int, args.in_flight.split(",")):
            crashed = 0
            for _ in range(args.runs):
                try:
                    run_ranks(_gathers, 2, n, args.iters, api, timeout=600)
                except (RuntimeError, TimeoutError):
                    crashed += 1
            rows.append({"api": api, "in_flight": n, "runs": args.runs, "crashed": crashed, "iters": args.iters})
    print(f"\ntorch {torch.__version__}, 2 gloo ranks, {args.iters} iterations a run")
    print(f"{'api':<12}{'in flight':>10}{'crashed':>10}")
    for r in rows:
        print(f"{r['api']:<12}{r['in_flight']:>10}{r['crashed']:>6}/{r['runs']}")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gloo_inflight_repro.json")
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

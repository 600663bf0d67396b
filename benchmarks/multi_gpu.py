"""Multi-GPU runs on one host (issue 7): NCCL bandwidth, then SimpleFSDP against FSDP2 per layout.

Launched with torchrun on every GPU of the host, in one go:

1. an NCCL bandwidth sweep (all-gather, reduce-scatter, all-to-all in bf16, 1 MB to 1 GB) over
   all ranks: bus bandwidth ``bytes * (n-1)/n / seconds``, the figure ``comm_model.py``'s
   ``--intra-gbps`` takes;
2. for each layout of ``comm_model.LAYOUTS`` that fits the world size, the MoE config
   (``configs/gpu_moe.toml``) under SimpleFSDP compiled with and without passes, FSDP2 eager and
   FSDP2 compiled per block, through :func:`step_time.measure` (tokens/s, peak memory, and with
   ``--profile`` NCCL time and exposed NCCL time from the profiler);
3. a ``--loss-steps`` run of SimpleFSDP compiled and FSDP2 eager at ``--loss-layout``, their
   losses side by side with an exact-match column.

Rank 0 writes the results JSON after every run. With ``--report`` it writes the RESULTS.md
section, the cost model's prediction (``benchmarks/results/comm_model.json``, same world size and
layout) beside each measurement.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu.py --profile --out benchmarks/results/multi_gpu_h200x8.json
    python benchmarks/multi_gpu.py --report benchmarks/results/multi_gpu_h200x8.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from simplefsdp.train.compare import loss_table

import step_time
from comm_model import LAYOUTS
from report import table, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMM_MODEL = os.path.join(ROOT, "benchmarks", "results", "comm_model.json")
MODES = ("SimpleFSDP compiled", "SimpleFSDP compiled (no passes)", "FSDP2 eager", "FSDP2 compiled per block")
SWEEP = ("all_gather", "reduce_scatter", "all_to_all")


def bus_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    """NCCL-tests' bus bandwidth of an all-gather, reduce-scatter or all-to-all of ``nbytes`` (the
    gathered output, the scattered input, the exchanged buffer)."""
    return nbytes * (ranks - 1) / ranks / seconds / 1e9


def _collective(op: str, nbytes: int, device: torch.device):
    world = dist.get_world_size()
    numel = nbytes // 2 // world * world
    big = torch.empty(numel, dtype=torch.bfloat16, device=device)
    small = torch.empty(numel // world, dtype=torch.bfloat16, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(big, small)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(small, big)
    out = torch.empty_like(big)
    return lambda: dist.all_to_all_single(out, big)


def nccl_sweep(device: torch.device, sizes_mb: list[float], iters: int) -> list[dict]:
    rows = []
    for op in SWEEP:
        for mb in sizes_mb:
            nbytes = int(mb * 2**20)
            call = _collective(op, nbytes, device)
            for _ in range(3):
                call()
            timer = step_time.StepTimer(device)
            dist.barrier()
            with timer:
                for _ in range(iters):
                    call()
            seconds = torch.tensor([timer.seconds / iters], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rows.append(dict(op=op, mb=mb, seconds=seconds.item(),
                             bus_gbps=bus_gbps(nbytes, seconds.item(), dist.get_world_size())))
    return rows


def fitting_layouts(world: int) -> list[str]:
    """The layouts of ``comm_model.LAYOUTS`` that ``world`` ranks (two or more) can take."""
    return [key for key, layout in LAYOUTS.items() if world > 1 and layout.fits(world)]


def cost_model() -> dict:
    """``comm_model.py``'s results, if they have been made."""
    return json.load(open(COMM_MODEL)) if os.path.exists(COMM_MODEL) else {}


def _prediction(model: dict, world: int, name: str, passes: str) -> float | None:
    """The cost model's step ms for a layout (its 'achieved' rate, else its first)."""
    for r in model.get("rows", []):
        if (r["world"], r["layout"], r["passes"]) == (world, name, passes):
            sim = r["simulated"].get("achieved") or next(iter(r["simulated"].values()))
            return 1e3 * sim["step_s"]
    return None


def markdown(result: dict, model: dict) -> str:
    world = result["world"]
    out = [f"**{result['environment']}**: `{result['command']}`.\n", "NCCL bus bandwidth, GB/s:\n"]
    sizes = sorted({r["mb"] for r in result["sweep"]})
    bw = {(r["op"], r["mb"]): r["bus_gbps"] for r in result["sweep"]}
    out.append(table(["op"] + [f"{mb:g} MB" for mb in sizes], [[op] + [bw.get((op, mb)) for mb in sizes] for op in SWEEP]))
    out.append("\nStep time per layout (the cost model's step time beside it):\n")
    rows = []
    for r in result["rows"]:
        if "error" in r:
            rows.append([r["layout"], r["mode"], "failed: " + r["error"]] + [None] * 6)
            continue
        p = r.get("profile", {})
        passes = "on" if r["mode"] == "SimpleFSDP compiled" else "off" if r["mode"].startswith("SimpleFSDP") else None
        predicted = _prediction(model, world, LAYOUTS[r["layout"]].name(world), passes) if passes else None
        rows.append([r["layout"], r["mode"], r["tokens_per_s"], r.get("ratio"), r["step_ms"], predicted,
                     r.get("peak_allocated_gib"), r.get("memory_ratio"),
                     None if not p else f"{100 * p['exposed_fraction']:.1f}"])
    out.append(table(["layout", "run", "tokens/s", "× FSDP2 eager", "step ms", "cost model step ms",
                      "peak alloc GiB", "× FSDP2 mem", "exposed NCCL % of step"], rows))
    if result.get("losses"):
        out.append(f"\nLosses, {result['loss_layout']} ({len(next(iter(result['losses'].values())))} steps):\n")
        runs = {mode: dict(enumerate(losses, 1)) for mode, losses in result["losses"].items()}
        out.append("```\n" + "\n".join(loss_table(runs)) + "\n```")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", help=f"comma-separated, from {list(LAYOUTS)}; default: those that fit")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--sizes-mb", default="1,4,16,64,256,1024")
    p.add_argument("--sweep-iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", type=int, nargs="?", const=3, default=0)
    p.add_argument("--loss-layout", default="fsdp_ep2")
    p.add_argument("--loss-steps", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--report", metavar="JSON", help="write the RESULTS.md section from a results file")
    args = p.parse_args()
    if args.report:
        result = json.load(open(args.report))
        write_section(f"multi_gpu_{result['world']}", f"## {result['world']} GPUs\n\n" + markdown(result, cost_model()))
        return

    device = step_time.start_ranks()
    world = dist.get_world_size()
    torch._inductor.config.force_disable_caches = True
    result = step_time.new_result(args, world=world, loss_layout=args.loss_layout, sweep=[], losses={})
    result["sweep"] = nccl_sweep(device, [float(x) for x in args.sizes_mb.split(",")], args.sweep_iters)
    overrides = [kv.split("=", 1) for kv in args.set]
    for key in (args.layouts.split(",") if args.layouts else fitting_layouts(world)):
        for mode in args.modes.split(","):
            step_time.measure(result, args.out, "moe", mode, "none", tags=dict(layout=key), warmup=args.warmup,
                              steps=args.steps, device=device, profile=args.profile,
                              overrides=overrides + LAYOUTS[key].overrides(world))
    if args.loss_steps:
        for mode in ("SimpleFSDP compiled", "FSDP2 eager"):
            scratch = dict(rows=[])
            row = step_time.measure(scratch, None, "moe", mode, "none", warmup=0, steps=args.loss_steps,
                                    device=device, profile=0,
                                    overrides=overrides + LAYOUTS[args.loss_layout].overrides(world))
            result["losses"][mode] = row.get("losses", [])
    if dist.get_rank() == 0:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        print(markdown(result, cost_model()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Parameter bytes each rank stores after ``simple_fsdp``, against the ideal total / N (CPU only).

Builds a model on the meta device, wraps it on chosen ranks of a fake process group of N ranks
(meta parameters are initialized one module at a time and sharded), and adds up the bytes of
storage behind every parameter's local shard (``to_local().untyped_storage().nbytes()``). A
shard that is a view of the full tensor counts the full tensor's bytes, which is what it keeps
alive. Two references: ``total / N``, and the layout's own ideal, each parameter's bytes over the
number of ranks that split it (HSDP replicates over dp_replicate; a TP plan replicates norms and
some projections over tp). The ratio is the largest rank's bytes over the layout's ideal: 1.00 is
perfect; uneven shards (dims that a degree does not divide) put it slightly above 1.

Nothing is communicated (the fake group moves no data), so this measures layout, not speed.

    python benchmarks/param_memory.py --config debug --worlds 8
    python benchmarks/param_memory.py --config gpu --worlds 8,64 --out benchmarks/results/param_memory.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simplefsdp import simple_fsdp  # noqa: E402
from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer  # noqa: E402
from simplefsdp.models.tp_plan import apply_tensor_parallel  # noqa: E402

from report import command_line, environment, output_arguments, publish, table  # noqa: E402

# name -> (mesh dims as {name: size or -1 for the ranks left}, ep)
LAYOUTS = {
    "FSDP": ({"dp_shard": -1}, 1),
    "HSDP 2 x N/2": ({"dp_replicate": 2, "dp_shard": -1}, 1),
    "FSDP x EP2": ({"dp_shard": -1}, 2),
    "FSDP x TP2": ({"dp_shard": -1, "tp": 2}, 1),
    "FSDP x TP2 x EP2": ({"dp_shard": -1, "tp": 2}, 2),
}


def _mesh_shape(dims: dict[str, int], world: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    known = 1
    for size in dims.values():
        known *= max(size, 1)
    return tuple(world // known if s == -1 else s for s in dims.values()), tuple(dims)


def rank_bytes(config: str, world: int, rank: int, dims: dict[str, int], ep: int) -> tuple[int, int, float]:
    """(bytes this rank stores, bytes of the whole model, the layout's ideal bytes per rank)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        shape, names = _mesh_shape(dims, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        with torch.device("meta"):
            model = moe_transformer(MOE_CONFIGS[config])
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        if "tp" in names:
            model.to_empty(device="cpu")  # TP plans distribute real tensors
            apply_tensor_parallel(model, mesh["tp"])
        simple_fsdp(model, mesh, ep=ep)
        stored = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        ideal = sum(p.numel() * p.element_size() / _split_degree(p) for p in model.parameters())
        return stored, total, ideal
    finally:
        dist.destroy_process_group()


def _split_degree(param) -> int:
    degree = 1
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, (Shard, _StridedShard)):  # not subclasses of each other on torch 2.13
            degree *= param.device_mesh.size(dim)
    return degree


def measure(config: str, worlds: list[int]) -> dict:
    rows = []
    for world in worlds:
        for name, (dims, ep) in LAYOUTS.items():
            per_rank = [rank_bytes(config, world, r, dims, ep) for r in (0, world - 1)]
            _, total, ideal = per_rank[0]
            largest = max(b for b, _, _ in per_rank)
            rows.append({"world": world, "layout": name, "largest_rank_mib": largest / 2**20,
                         "total_over_n_mib": total / world / 2**20, "ideal_mib": ideal / 2**20,
                         "ratio": largest / ideal})
            print(f"{world} ranks, {name}: {rows[-1]['ratio']:.3f} x the layout's ideal", flush=True)
    return {"config": config, "command": command_line(), "environment": environment("CPU, fake process group"),
            "note": "ranks measured: the first and the last", "rows": rows}


def markdown(result: dict) -> str:
    rows = [
        [r["world"], r["layout"], r["largest_rank_mib"], r["total_over_n_mib"], r["ideal_mib"], f"{r['ratio']:.3f}"]
        for r in result["rows"]
    ]
    return "\n".join([
        f"### Parameter bytes per rank, `{result['config']}` config ({result['environment']})",
        "",
        f"`{result['command']}`. Storage behind each rank's shards (first and last rank, the larger), "
        "against the model's bytes / N and against the layout's ideal (each parameter's bytes over the "
        "ranks that split it); the ratio is to the ideal. The fake process group moves no data.",
        "",
        table(["ranks", "layout", "largest rank (MiB)", "total / N (MiB)", "layout ideal (MiB)", "ratio"], rows),
        "",
        "A ratio above 1 comes from a dim smaller than the degree that shards it: `Shard(0)` gives "
        "`ceil(size / N)` rows to the first ranks and none to the rest (FSDP2 cuts the same way). "
        "With ep = 1 the routed experts are dense parameters, whose dim 0 holds the experts.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="debug", choices=sorted(MOE_CONFIGS))
    parser.add_argument("--worlds", default="8", help="comma-separated rank counts")
    output_arguments(parser)
    args = parser.parse_args()
    if args.report:
        import json

        publish("param_memory", "Parameter memory per rank", markdown, json.load(open(args.report)), args)
        return
    result = measure(args.config, [int(w) for w in args.worlds.split(",")])
    publish("param_memory", "Parameter memory per rank", markdown, result, args)


if __name__ == "__main__":
    main()

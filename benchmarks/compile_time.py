"""Cold compile time against depth, whole-model compile against blocks compiled once.

One process per measurement (fresh Inductor caches: ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``):
the debug MoE model (one dense block, the rest MoE) with ``--layers`` blocks, wrapped by
``simple_fsdp`` on a fake 8-rank process group (rank 0), compiled with the default passes, and one
forward and backward timed (the fake group moves no data, so this is compile time). Prints a table
and writes ``--out``.

Layouts: ``fsdp8`` (ep 1, no resharding), ``fsdp8-reshard`` (ep 1, resharding after forward) and
``fsdp8xep2`` (FSDP8 x EP2 with resharding; blocks compiled once then keep the routed experts in
the outer graph), each whole model and blocks compiled once. Under the fake group every
router score ties and the counts exchange moves no data, so for ep a router bias on one expert
per ep rank sends rows to both ep ranks (as the graph tests do).

    python benchmarks/compile_time.py --layers 2,8 --out benchmarks/results/compile_time_cpu.json
    python benchmarks/compile_time.py --layers 2,8 --layout fsdp8-reshard --out benchmarks/results/compile_time_cpu_reshard.json
    python benchmarks/compile_time.py --layers 2,8 --layout fsdp8xep2 --out benchmarks/results/compile_time_cpu_ep2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# layout -> (ep, reshard_after_forward)
LAYOUTS = {"fsdp8": (1, False), "fsdp8-reshard": (1, True), "fsdp8xep2": (2, True)}
MODES = ("whole", "blocks once")


def measure(layers: int, mode: str, layout: str) -> float:
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from simplefsdp import compile_blocks_once, compile_options, simple_fsdp
    from simplefsdp.models.llama import cross_entropy_loss
    from simplefsdp.models.moe import MOE_CONFIGS, MoE, moe_transformer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    cfg = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=layers)
    torch.manual_seed(0)
    ep, reshard = LAYOUTS[layout]
    model = moe_transformer(cfg)
    if ep > 1:
        for module in model.modules():
            if isinstance(module, MoE):
                module.router.expert_bias[:: cfg.num_experts // ep] = 1.0
    model = simple_fsdp(model, mesh, ep=ep, reshard_after_forward=reshard)
    if mode == "blocks once":
        compile_blocks_once(model)
    compiled = torch.compile(model, fullgraph=True, options=compile_options(blocks_once=mode == "blocks once"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    begin = time.perf_counter()
    cross_entropy_loss(compiled(tokens), tokens).backward()
    return time.perf_counter() - begin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="2,8")
    p.add_argument("--layout", default="fsdp8", choices=sorted(LAYOUTS))
    p.add_argument("--out", default=None)
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # (layers, mode): measure in this process
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1], args.layout)))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "PYTHONPATH": ROOT}
    rows = []
    for layers in map(int, args.layers.split(",")):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", str(layers), mode, "--layout", args.layout], env=env,
                                 capture_output=True, text=True, check=True).stdout
            rows.append(dict(layers=layers, mode=mode, compile_s=json.loads(out.strip().splitlines()[-1])))
    import torch

    first = {r["mode"]: r["compile_s"] for r in rows if r["layers"] == rows[0]["layers"]}
    print(f"torch {torch.__version__}, fake world 8, debug MoE, {args.layout}, first forward+backward")
    print("| layers | mode | compile s | × fewest layers |\n|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["compile_s"] / first[r["mode"]]
        print(f"| {r['layers']} | {r['mode']} | {r['compile_s']:.1f} | {r['ratio']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, layout=args.layout, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

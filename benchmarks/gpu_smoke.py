"""One-GPU smoke run: dense and MoE models under SimpleFSDP, eager and compiled, bf16.

Checks that the frontend, the MoE model (``torch._grouped_mm`` path) and compilation run on the
GPU's torch (2.11 on the lent H200), and prints one line per run: final loss, median step time.
Not a benchmark of record (see the benchmarks issue); a compatibility check with figures.

    python benchmarks/gpu_smoke.py [--models dense,moe,moe_gpu] [--steps N] [--out results.json]

``moe_gpu`` is ``MOE_CONFIGS["gpu"]`` (about 1.7B parameters), ``dense``/``moe`` smaller models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, simple_fsdp
from simplefsdp.models.llama import Transformer, TransformerConfig
from simplefsdp.models.moe import MOE_CONFIGS, MoEConfig, moe_transformer
from simplefsdp.train.data import SyntheticTokens
from simplefsdp.train.cli import train_steps

DENSE = TransformerConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=2816)
MOE = MoEConfig(
    vocab_size=32000, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=2816,
    n_dense_layers=1, num_experts=8, top_k=2, expert_dim=1408,
)
MODELS = {"dense": (Transformer, DENSE), "moe": (moe_transformer, MOE), "moe_gpu": (moe_transformer, MOE_CONFIGS["gpu"])}


def run(name, build, cfg, compiled, steps):
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = simple_fsdp(build(cfg).cuda(), mesh, mp_policy=mp)
    runner = torch.compile(model, fullgraph=True) if compiled else model
    data = [(t.cuda(), l.cuda()) for t, l in map(SyntheticTokens(cfg.vocab_size, 8, 1024).batch, range(steps))]
    times = []
    last = time.perf_counter()

    def tick(step, loss):
        nonlocal last
        torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now

    losses = train_steps(runner, data, lr=3e-4, on_step=tick)
    step_s = statistics.median(times[2:])
    row = dict(run=name, compiled=compiled, first_loss=losses[0], last_loss=losses[-1],
               first_step_s=times[0], median_step_s=step_s, tokens_per_s=8 * 1024 / step_s,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="dense,moe", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = []
    for name in args.models.split(","):
        build, cfg = MODELS[name]
        for compiled in (False, True):
            rows.append(run(name, build, cfg, compiled, args.steps))
            print(rows[-1], flush=True)
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'run':8} {'mode':9} {'loss0':>7} {'lossN':>7} {'step1 s':>8} {'step ms':>8} {'tok/s':>9} {'peak GiB':>8}")
    for r in rows:
        print(f"{r['run']:8} {'compiled' if r['compiled'] else 'eager':9} {r['first_loss']:7.3f} {r['last_loss']:7.3f} "
              f"{r['first_step_s']:8.1f} {1e3 * r['median_step_s']:8.1f} {r['tokens_per_s']:9.0f} {r['peak_gib']:8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

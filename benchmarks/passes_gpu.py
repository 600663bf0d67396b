"""The Inductor passes on one GPU, at world size 8 under the fake process group.

One GPU cannot run 8 ranks, but the fake process group lets Inductor compile (and run) the
8-rank graphs on it: collectives move no data, every other kernel is the real GPU kernel, and
runs are deterministic. For a small MoE transformer (bf16 parameters, fp32 reduction, experts on
``torch._grouped_mm``) at FSDP8 and FSDP4 x EP2, this compiles forward and backward with the
passes off, at their defaults and with all-gather buckets too, and reports:

* collectives per step in the generated code, per kind;
* compile time of the first step, and the median time of later steps (collectives cost nothing
  here: this measures compute and launch overhead only);
* whether the loss equals, bit for bit, that of the run without passes (only where the fake
  group's collectives write their outputs: its reduce-scatter and its out= all-gather, which
  all-gather buckets use, leave them unwritten; the gloo tests compare everything);
* the generated order of all-to-alls, grouped matmuls and their waits in the MoE block.

On CUDA the fake group leaves the all-to-all's token counts unwritten, so at ep > 1 the compiled
forward is generated (and reported) but cannot run; there is no backward graph or timing then.

    python benchmarks/passes_gpu.py [--steps 6] [--out benchmarks/results/passes_gpu_h200.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor.graph import GraphLowering
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, compile_options, simple_fsdp
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoE, MoEConfig, moe_transformer

CFG = MoEConfig(
    vocab_size=32000, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=2816,
    n_dense_layers=1, num_experts=8, top_k=2, expert_dim=1408,
)
PASSES = {
    "off": dict(bucketing="none", a2a_overlap=False),
    "default": {},
    "all_gather_buckets": dict(bucketing="all"),
}
CONFIGS = {"fsdp8": 1, "fsdp4xep2": 2}  # name -> ep, on 8 fake ranks
_OP = re.compile(r"torch\.ops\.(?:_c10d_functional|aten)\.(\w+)\.default\((\w+)")
_OUT = re.compile(r"^\s*(\w+) = |out=(\w+)")
_EXTERN = re.compile(r"extern_kernels\.(\w+)\(")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SHOWN = ("all_to_all_single", "_grouped_mm", "wait_tensor")


def code_events(code: str) -> list[str]:
    """Collectives, waits (named by what they wait for) and matmuls of one generated module."""
    events, made_by = [], {}
    for line in code[code.index("def call("):].splitlines():
        if op := _OP.search(line):
            name, first_arg = op.groups()
            if name == "wait_tensor":
                events.append(f"wait_tensor({made_by.get(first_arg, '?')})")
                continue
            events.append(name)
            for out in _OUT.findall(line):
                made_by.update({buf: name for buf in out if buf})
        elif extern := _EXTERN.search(line):
            events.append(extern.group(1))
    return events


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(cfg: MoEConfig, device: str, ep: int, options: dict, steps: int, seq: int):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = moe_transformer(cfg)
    for module in model.modules():  # under the fake group all scores tie: send tokens to both ep ranks
        if isinstance(module, MoE):
            module.router.expert_bias[:: cfg.num_experts // 2] = 1.0
    mesh = init_device_mesh(device, (8,), mesh_dim_names=("dp_shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = simple_fsdp(model.to(device), mesh, mp_policy=mp, ep=ep)
    compiled = torch.compile(model, fullgraph=True, options=compile_options(**options))
    tokens = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        loss = cross_entropy_loss(compiled(tokens), tokens)
        loss.backward()
        return loss.detach()

    codes = []  # what run_and_get_code collects, kept also when the run fails after compiling
    start = time.perf_counter()
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        try:
            loss = step().float().item()
        except (RuntimeError, torch.OutOfMemoryError) as e:  # the fake group leaves a2a counts unwritten on CUDA
            print(f"ep={ep}: compiled, but the fake group cannot run the dispatch: {str(e).splitlines()[0]}")
            loss = None
    sync()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(steps if loss is not None else 0):
        model.zero_grad()
        sync()
        t0 = time.perf_counter()
        try:
            step()
        except (RuntimeError, torch.OutOfMemoryError):  # a later step drew unusable counts
            times = []
            break
        sync()
        times.append(time.perf_counter() - t0)
    events = [code_events(c) for c in codes if "def call(" in c]
    return loss, compile_s, statistics.median(times) if times else float("nan"), events


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=None)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--device", default="cuda", help="cpu: a quick check of the script itself, tiny model")
    args = p.parse_args()
    cfg, seq = (CFG, 2048) if args.device == "cuda" else (dataclasses.replace(CFG, vocab_size=256, dim=64, ffn_dim=128, expert_dim=32, n_heads=4, n_kv_heads=2), 16)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    rows, orders = [], {}
    run(cfg, args.device, 1, PASSES["off"], 0, seq)  # warm-up, not reported: the first compile pays for imports
    for config in args.configs.split(","):
        ep, ref = CONFIGS[config], None
        for name, options in PASSES.items():
            loss, compile_s, step_s, events = run(cfg, args.device, ep, options, args.steps, seq)
            ref = loss if name == "off" else ref
            comparable = loss is not None and options.get("bucketing") != "all"
            counts = collections.Counter(e for graph in events for e in graph if e.startswith(COLLECTIVES))
            rows.append(dict(config=config, passes=name, loss=loss, loss_bitwise_equal_to_off=loss == ref if comparable else None, compile_s=compile_s,
                             step_ms=1e3 * step_s, collectives=dict(counts)))
            orders[f"{config}/{name}"] = [[e for e in graph if e.startswith(SHOWN)] for graph in events]
            print(rows[-1], flush=True)
    for key, graphs in orders.items():
        if key.startswith("fsdp4xep2"):
            for kind, graph in zip(("forward", "backward"), graphs):
                print(f"\n{key} {kind}: " + " ".join(graph))
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\ntorch {torch.__version__}, {device}, fake world 8, {cfg.n_layers} blocks (1 MoE), 2x{seq} tokens")
    print(f"{'config':10} {'passes':19} {'loss ==':>7} {'compile s':>9} {'step ms':>8}  collectives per step")
    for r in rows:
        print(f"{r['config']:10} {r['passes']:19} {str(r['loss_bitwise_equal_to_off']):>7} {r['compile_s']:9.1f} "
              f"{r['step_ms']:8.1f}  {r['collectives']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, device=device, rows=rows, orders=orders), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

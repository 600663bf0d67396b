"""Training entry point: ``python -m simplefsdp.train`` (console script ``simplefsdp-train``).

Trains the dense debug transformer with SimpleFSDP on a synthetic token stream and prints the
loss of every step. Under ``torchrun`` it uses the launcher's ranks (nccl on GPUs, gloo on CPU);
started plainly, it spawns ``--ranks`` CPU processes itself, so one command runs on a laptop.

The global batch is the same for every layout (each data-parallel rank trains on its slice), so
runs with different parallel layouts are comparable step by step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from simplefsdp.frontend import simple_fsdp
from simplefsdp.models.llama import Transformer, TransformerConfig, cross_entropy_loss
from simplefsdp.tracing import trace

MODES = ("fully_shard", "replicate", "hybrid_shard")


def synthetic_batches(vocab_size: int, global_batch: int, seq_len: int, steps: int, seed: int = 1234):
    """(tokens, labels) batches of arithmetic sequences with random starts: learnable, deterministic."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (global_batch, 1), generator=g)
        stride = torch.randint(1, 4, (global_batch, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def train_steps(model, data, *, lr: float, dp_rank: int = 0, dp_size: int = 1, on_step=None) -> list[float]:
    """AdamW over ``data``; each rank trains on its slice of every global batch. Global losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses = []
    for step, (tokens, labels) in enumerate(data):
        rows = tokens.shape[0] // dp_size
        rank_rows = slice(dp_rank * rows, (dp_rank + 1) * rows)
        loss = cross_entropy_loss(model(tokens[rank_rows]), labels[rank_rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        if dp_size > 1:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def dp_mesh(mode: str, world: int, device_type: str):
    """The data-parallel mesh for ``mode`` over all ranks (hybrid: 2 replicas when world allows)."""
    from torch.distributed.device_mesh import init_device_mesh

    if mode == "hybrid_shard":
        replicas = 2 if world % 2 == 0 and world > 1 else 1
        return init_device_mesh(device_type, (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
    name = "dp_shard" if mode == "fully_shard" else "dp_replicate"
    return init_device_mesh(device_type, (world,), mesh_dim_names=(name,))


def _train(args) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    cfg = TransformerConfig(n_layers=args.layers, dim=args.dim)
    torch.manual_seed(args.seed)
    model = simple_fsdp(Transformer(cfg), dp_mesh(args.mode, world, device_type), mode=args.mode)
    runner = torch.compile(model) if args.compile else model
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    data = [(t.to(device), l.to(device)) for t, l in synthetic_batches(cfg.vocab_size, args.batch, args.seq, args.steps, args.seed)]
    start = time.perf_counter()

    def log(step, loss):
        if rank == 0:
            print(f"step {step + 1:4d}/{args.steps}  loss {loss:8.4f}  {time.perf_counter() - start:7.1f}s", flush=True)

    if args.trace_dir is None:
        return train_steps(runner, data, lr=args.lr, dp_rank=rank, dp_size=world, on_step=log)
    with trace(args.trace_dir) as t:
        losses = train_steps(runner, data, lr=args.lr, dp_rank=rank, dp_size=world, on_step=log)
    if rank == 0:
        print(f"trace: {args.trace_dir}" + (f", tlparse report: {t.report}" if t.report else " (tlparse not installed)"))
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="simplefsdp-train", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks to spawn when not under torchrun")
    p.add_argument("--mode", choices=MODES, default="fully_shard")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--trace-dir", default=None, help="dump the compile trace here and render it with tlparse")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.batch % args.ranks:
        p.error(f"--batch {args.batch} must divide evenly over --ranks {args.ranks}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            _train(args)
        finally:
            dist.destroy_process_group()
        return
    from simplefsdp.launch import run_ranks

    run_ranks(_train, args.ranks, args, timeout=3600)


if __name__ == "__main__":
    main()

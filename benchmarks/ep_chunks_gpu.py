"""What token chunks cost in compute: FSDP8 x EP8 on one GPU, at world 8 under the fake group.

Chunking a MoE layer's tokens (``simple_fsdp(..., ep_chunks=N)``) lets one chunk's routed experts
run under another chunk's all-to-all, but each grouped matmul gets ``1/N`` of the rows and every
chunk launches its own permutes and all-to-alls. One GPU cannot show the overlap; it can show that
cost, which bounds what chunking can gain. The fake process group lets the 8-rank graphs compile
and run here: collectives move no data and cost nothing, every other kernel is real.

Two stand-ins make the dispatch runnable and the comparison fair (the fake group writes no
all-to-all output on CUDA, so token counts would be garbage):

* routing is balanced and fixed: slot ``j`` of token ``t`` goes to expert ``(t * top_k + j) % E``
  (the gate matmul still runs);
* the counts exchange is a loopback: each rank receives from rank ``i`` what it sends to rank
  ``i`` (so it computes as many rows as it routes, as with balanced routing).

Reported per chunk count: compile time of the first step, median (and fastest) forward+backward
time of later steps (no optimizer), and the all-to-alls per step in the generated code. Config: ``configs/gpu_moe.toml``'s model
with ``--layers`` blocks (one dense), ``--seqs`` sequences of 2048 tokens per rank, bf16 with fp32
gradient reduction, the default passes.

    python benchmarks/ep_chunks_gpu.py [--chunks 1,2,4] [--out benchmarks/results/ep_chunks_h200.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch._inductor.graph import GraphLowering
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, simple_fsdp
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoEConfig, Router, moe_transformer
from simplefsdp.moe.token_dispatch import TokenDispatcher
from simplefsdp.train.config import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def balanced_route(self: Router, x: torch.Tensor):
    """``Router.forward`` whose top-k picks experts ``(t * top_k + j) % E`` for token ``t``: a fixed
    pattern dominates the scores, and the gate's scores (garbage here: the fake group's gathers
    write nothing) only break ties."""
    slots = torch.arange(x.shape[0] * self.top_k, device=x.device).view(-1, self.top_k) % self.num_experts
    pattern = torch.zeros(x.shape[0], self.num_experts, device=x.device).scatter(1, slots, 1.0)
    scores = pattern + 1e-3 * self.gate(x).float().sigmoid().nan_to_num(0.5)
    experts = torch.topk(scores, self.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    return weights / weights.sum(-1, keepdim=True), experts


def loopback_counts(self: TokenDispatcher, counts: list[torch.Tensor]):
    """``TokenDispatcher._exchange_counts`` with rank ``i``'s counts for this rank taken to be
    this rank's for rank ``i``; the received counts are a tensor of their own, read to the host on
    their own, as after the real exchange."""
    send = torch.stack(counts).view(len(counts), self.degree, self.local_experts)
    recv = _exchanged(send)
    return list(recv.unbind(0)), send.sum(2).tolist(), recv.sum(2).tolist()


@torch.library.custom_op("simplefsdp_bench::exchanged", mutates_args=())
def _exchanged(counts: torch.Tensor) -> torch.Tensor:
    """A copy the compiler cannot see through, like the exchange's result: Inductor's partitioner
    would otherwise recompute the received split sizes in backward, which it cannot compile."""
    return counts.clone()


@_exchanged.register_fake
def _(counts: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(counts)


def run(cfg: MoEConfig, chunks: int, steps: int, seqs: int, seq_len: int):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("dp_shard",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = simple_fsdp(moe_transformer(cfg).cuda(), mesh, mp_policy=mp, ep=8, ep_chunks=chunks)
    compiled = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, cfg.vocab_size, (seqs, seq_len), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        cross_entropy_loss(compiled(tokens), tokens).backward()

    codes = []
    start = time.perf_counter()
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        model.zero_grad()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    a2a = sum(code.count("all_to_all_single.default(") for code in codes if "def call(" in code)
    return dict(chunks=chunks, compile_s=compile_s, step_ms=1e3 * statistics.median(times),
                step_ms_min=1e3 * min(times), all_to_all_calls=a2a)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="1,2,4")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()
    job = load(os.path.join(ROOT, "configs/gpu_moe.toml"))
    cfg = dataclasses.replace(job.model_config(), n_layers=args.layers)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    torch.cuda.set_device(0)
    rows = []
    with mock.patch.object(Router, "forward", balanced_route), \
            mock.patch.object(TokenDispatcher, "_exchange_counts", loopback_counts):
        for chunks in map(int, args.chunks.split(",")):
            rows.append(run(cfg, chunks, args.steps, args.seqs, job.training.seq_len))
            print(rows[-1], flush=True)
    base = rows[0]["step_ms"]
    device = torch.cuda.get_device_name()
    print(f"\ntorch {torch.__version__}, {device}, fake world 8, FSDP8 x EP8, {cfg.n_layers} blocks "
          f"({cfg.n_layers - cfg.n_dense_layers} MoE), {args.seqs}x{job.training.seq_len} tokens per rank, balanced routing")
    print(f"{'chunks':>6} {'compile s':>9} {'step ms':>8} {'min ms':>7} {'vs 1':>6} {'all_to_all':>10}")
    for r in rows:
        print(f"{r['chunks']:6d} {r['compile_s']:9.1f} {r['step_ms']:8.1f} {r['step_ms_min']:7.1f} "
              f"{r['step_ms'] / base:6.3f} {r['all_to_all_calls']:10d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(torch=torch.__version__, device=device, layers=cfg.n_layers, seqs_per_rank=args.seqs,
                           command="python benchmarks/ep_chunks_gpu.py " + " ".join(
                               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
                           rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Kernel rates of the MoE block on one GPU: ``torch._grouped_mm`` against the dense bf16 matmul.

At the shapes of ``configs/gpu_moe.toml`` (global batch x seq_len tokens, top_k routed rows
each, ``num_experts`` groups aligned to 16 rows as :mod:`simplefsdp.moe.token_permute` pads them), it
times with CUDA events:

* the dense bf16 matmul ceiling: an 8192^3 ``torch.mm``, the rate the other rows are compared to;
* a dense ``torch.mm`` of the routed experts' total shape (all rows through one expert's weight);
* the routed experts' grouped matmuls, forward (gate/up ``[rows, dim] @ [E, dim, hidden]`` and
  down ``[rows, hidden] @ [E, hidden, dim]``) and forward + backward (input and weight
  gradients, three times the forward's FLOPs), with balanced groups and with the group sizes a
  random top-k router draws;
* the shared expert's one-group grouped matmul, and the same product as a dense ``torch.mm``.

    python benchmarks/moe_kernels.py [--out benchmarks/results/moe_kernels_h200.json] [--results-md]
    python benchmarks/moe_kernels.py --report benchmarks/results/moe_kernels_h200.json   # RESULTS.md section
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from simplefsdp.train.config import load
from simplefsdp.moe.token_permute import ALIGNMENT

from report import command_line, environment, output_arguments, publish, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_op(fn, iters: int = 20, warmup: int = 5) -> float:
    """Mean seconds per call of ``fn`` on the GPU."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """int32 cumulative group ends, each group padded to ALIGNMENT rows."""
    padded = (counts + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
    return torch.cumsum(padded, 0).to(torch.int32)


def routed_counts(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert from a random router: top_k of softmax(gaussian logits) per token."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randn(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=experts)


def timed_rows(name: str, shape: str, op, x: torch.Tensor, w: torch.Tensor, flops: int) -> list[dict]:
    """``op(x, w)`` timed forward, and forward + backward (input and weight gradients, three
    times the forward's FLOPs)."""
    grad = torch.randn_like(op(x, w))
    fwd = time_op(lambda: op(x, w))
    both = time_op(lambda: torch.autograd.grad(op(x, w), (x, w), grad))
    return [dict(kernel=f"{name} forward", shape=shape, seconds=fwd, tflops=flops / fwd / 1e12),
            dict(kernel=f"{name} forward + backward", shape=shape, seconds=both, tflops=3 * flops / both / 1e12)]


def grouped_rows(name: str, rows: int, k: int, n: int, offs: torch.Tensor, groups: int) -> list[dict]:
    dev = "cuda"
    x = torch.randn(int(offs[-1]), k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(groups, k, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    offs = offs.to(dev)
    flops = 2 * rows * k * n  # padding rows are not useful work
    return timed_rows(name, f"[{rows}, {k}] @ [{groups}, {k}, {n}]", lambda a, b: torch._grouped_mm(a, b, offs=offs),
                      x, w, flops)


def mm_rows(name: str, m: int, k: int, n: int) -> list[dict]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return timed_rows(name, f"[{m}, {k}] @ [{k}, {n}]", torch.mm, x, w, 2 * m * k * n)


def dense_row(name: str, m: int, k: int, n: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    seconds = time_op(lambda: torch.mm(a, b))
    return dict(kernel=name, shape=f"[{m}, {k}] @ [{k}, {n}]", seconds=seconds, tflops=2 * m * k * n / seconds / 1e12)


def measure(config: str) -> list[dict]:
    cfg = load(os.path.join(ROOT, config))
    m, t = cfg.model_config(), cfg.training
    tokens = t.global_batch * t.seq_len
    rows = tokens * m.top_k
    balanced = torch.full((m.num_experts,), rows // m.num_experts)
    routed = routed_counts(tokens, m.num_experts, m.top_k)
    out = [dense_row("dense mm 8192^3 (ceiling)", 8192, 8192, 8192),
           dense_row("dense mm, routed experts' total shape", rows, m.dim, m.expert_dim)]
    for label, counts in (("balanced", balanced), ("routed", routed)):
        offs = offsets(counts)
        out += grouped_rows(f"gate/up, {label}", rows, m.dim, m.expert_dim, offs, m.num_experts)
        out += grouped_rows(f"down, {label}", rows, m.expert_dim, m.dim, offs, m.num_experts)
    shared = m.expert_dim * m.num_shared_experts
    out += grouped_rows("shared gate/up", tokens, m.dim, shared, torch.tensor([tokens]).int(), 1)
    out += mm_rows("shared gate/up as a dense mm", tokens, m.dim, shared)
    ceiling = out[0]["tflops"]
    for r in out:
        r["of_ceiling"] = r["tflops"] / ceiling
    return out


def markdown(result: dict) -> str:
    return (f"**{result['environment']}**: `{result['command']}`; shapes of `{result['config']}`.\n\n"
            + table(["kernel", "shape", "µs", "TFLOP/s", "% of dense ceiling"],
                    [[r["kernel"], r["shape"], 1e6 * r["seconds"], r["tflops"], f"{100 * r['of_ceiling']:.0f}"]
                     for r in result["rows"]]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpu_moe.toml")
    output_arguments(p)
    args = p.parse_args()
    if args.report:
        return publish("moe_kernels", "MoE kernels on one GPU", markdown, json.load(open(args.report)), args)
    result = dict(environment=environment(torch.cuda.get_device_name()), command=command_line(),
                  config=args.config, rows=measure(args.config))
    publish("moe_kernels", "MoE kernels on one GPU", markdown, result, args)


if __name__ == "__main__":
    main()

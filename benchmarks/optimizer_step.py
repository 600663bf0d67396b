"""Optimizer and gradient clipping per step, against the fp32 AdamW memory-traffic floor.

Builds a config's model as the training entry point does (``build``, one GPU, SimpleFSDP eager),
runs one forward and backward for real gradients, then times on the same parameters and
gradients, with CUDA events around ``--steps`` calls queued back to back (median of 5 such runs):

* the grouped gradient norm alone, and clipping by it (a read and a write of every gradient);
* AdamW: torch's fused kernel over the grouped parameters (the previous default), alone and with
  the clip divisor as its ``grad_scale``, against this project's multi-tensor Triton kernel
  (:class:`simplefsdp.train.adamw.AdamW`), alone and with clipping folded in as a training step
  runs it (:func:`simplefsdp.train.optimizer.clipped_step`: the norm, then the step);
* ``--sweep``: the Triton kernel's block size, chunk length and warps;
* a device-to-device copy as large as the parameters (read 4 B, write 4 B per parameter), the
  bandwidth this GPU reaches in practice, so the kernel's share of it can be told from its share
  of the HBM peak.

The floor is the bytes fp32 AdamW must move per step (read parameter, gradient and both moments,
write parameter and both moments: 28 bytes per parameter) over the GPU's memory bandwidth; the
norm reads every gradient once more (4 bytes per parameter). At world 1 there is no communication;
the clipping norm's all-reduce is a local no-op.

    python benchmarks/optimizer_step.py --config configs/gpu_moe.toml --sweep --out benchmarks/results/optimizer_step_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from step_time import start_ranks  # noqa: E402

from simplefsdp.models.llama import cross_entropy_loss  # noqa: E402
from simplefsdp.train.cli import build  # noqa: E402
from simplefsdp.train.config import load  # noqa: E402
from simplefsdp.train import adamw  # noqa: E402
from simplefsdp.train.grad_norm import clip_divisor, clip_grads_, grad_norm  # noqa: E402
from simplefsdp.train.optimizer import clipped_step, make_optimizer, param_groups  # noqa: E402

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, HBM peak


def median_ms(fn, warmup: int, steps: int, repeats: int = 5) -> float:
    """GPU milliseconds per call: ``steps`` calls back to back between two CUDA events (the host
    queues ahead, as in a training step, so its own work per call is hidden unless it is the
    longer), the median over ``repeats`` such runs after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_moe.toml"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel's block, chunk and warp choices")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = start_ranks()
    cfg = load(args.config, [("training.compile", "False")])
    model, runner, _ = build(cfg, 1, device.type)
    tokens = torch.randint(0, cfg.model_config().vocab_size, (2, cfg.training.seq_len), device=device)
    cross_entropy_loss(runner(tokens), tokens).backward()
    params = [q for q in model.parameters() if q.grad is not None]
    n = sum(q.numel() for q in params)
    lr = cfg.training.lr
    rows = {
        "clip: grouped norm only": median_ms(lambda: grad_norm(params), args.warmup, args.steps),
        "clip: norm, then scale every gradient": median_ms(lambda: clip_grads_(params, 1.0), args.warmup, args.steps),
    }
    fused = torch.optim.AdamW([{"params": g} for g in param_groups(params)], lr=lr, fused=True)
    rows["AdamW torch fused, grouped (previous default)"] = median_ms(fused.step, args.warmup, args.steps)

    def fused_clipped():
        fused.grad_scale = clip_divisor(grad_norm(params), 1.0)
        fused.step()
        del fused.grad_scale

    rows["norm + torch fused step with grad_scale (previous training step)"] = median_ms(fused_clipped, args.warmup, args.steps)
    del fused
    torch.cuda.empty_cache()
    optimizer = make_optimizer(model, lr)
    rows["AdamW Triton multi-tensor (new default)"] = median_ms(optimizer.step, args.warmup, args.steps)
    rows["norm + Triton step with the clip divisor (training step)"] = median_ms(
        lambda: clipped_step(optimizer, params, 1.0), args.warmup, args.steps)
    sweep = {}
    if args.sweep:
        default = (adamw.BLOCK, adamw.CHUNK_BLOCKS, adamw.NUM_WARPS)
        for block, chunk_blocks, warps in ((1024, 8, 4), (1024, 16, 4), (2048, 4, 8), (2048, 8, 8), (2048, 16, 8),
                                           (4096, 4, 8), (4096, 8, 16), (8192, 2, 16), (8192, 4, 16), (16384, 1, 32)):
            adamw.BLOCK, adamw.CHUNK_BLOCKS, adamw.NUM_WARPS = block, chunk_blocks, warps
            sweep[f"BLOCK={block} CHUNK_BLOCKS={chunk_blocks} warps={warps}"] = median_ms(optimizer.step, args.warmup, args.steps)
        adamw.BLOCK, adamw.CHUNK_BLOCKS, adamw.NUM_WARPS = default
    del optimizer
    source = torch.empty(n, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    copy_ms = median_ms(lambda: target.copy_(source), args.warmup, args.steps)
    del source, target
    gpu = next((k for k in BANDWIDTH if k in torch.cuda.get_device_name()), None)
    floor_ms = 28 * n / BANDWIDTH[gpu] * 1e3 if gpu else None
    result = dict(config=os.path.basename(args.config), parameters=n, gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, floor_ms=floor_ms, ms=rows, sweep_ms=sweep,
                  copy_tb_per_s=8 * n / copy_ms / 1e9)
    print(f"\n{result['config']}: {n / 1e9:.2f}B parameters on {result['gpu']}, torch {torch.__version__}")
    print("| step part | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} |")
    if floor_ms:
        print(f"| fp32 AdamW traffic floor (28 B/param at HBM peak) | {floor_ms:.2f} |")
        print(f"| floor with the norm's read (32 B/param) | {floor_ms * 32 / 28:.2f} |")
    print(f"| device-to-device copy, 8 B/param | {copy_ms:.2f} ({result['copy_tb_per_s']:.2f} TB/s) |")
    for name, ms in sweep.items():
        print(f"| Triton AdamW, {name} | {ms:.2f} |" + (f" {floor_ms / ms:.0%} of floor" if floor_ms else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

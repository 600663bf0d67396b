"""Optimizer and gradient clipping per step, against the fp32 AdamW memory-traffic floor.

Builds a config's model as the training entry point does (``build``, one GPU, SimpleFSDP eager),
runs one forward and backward for real gradients, then times on the same parameters and
gradients, with CUDA events (median of ``--steps`` after ``--warmup``):

* gradient clipping: the old per-parameter norm (two kernels per gradient) against the grouped
  multi-tensor one (:func:`simplefsdp.train.grad_norm.clip_grads_`);
* AdamW: ``foreach=False`` (the old default) against ``foreach=True`` and the grouped fused
  optimizer (:func:`simplefsdp.train.optimizer.make_optimizer`);
* what a training step runs: the grouped norm, then the fused step dividing each gradient by the
  clip divisor as it reads it (:func:`simplefsdp.train.optimizer.clipped_step`), and the norm alone.

The floor is the bytes fp32 AdamW must move per step (read parameter, gradient and both moments,
write parameter and both moments: 28 bytes per parameter) over the GPU's memory bandwidth.
At world 1 there is no communication; the clipping norm's all-reduce is a local no-op.

    python benchmarks/optimizer_step.py --config configs/gpu_moe.toml --out benchmarks/results/optimizer_step_h200.json
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
from simplefsdp.train.grad_norm import clip_grads_, grad_norm  # noqa: E402
from simplefsdp.train.optimizer import clipped_step, make_optimizer, param_groups  # noqa: E402

BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s, HBM peak


def per_parameter_clip_(params, max_norm: float) -> torch.Tensor:
    """The old clipping: each gradient's squared sum on its own, then one scale per gradient."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return norm


def median_ms(fn, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_moe.toml"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
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
        "clip: per parameter (old)": median_ms(lambda: per_parameter_clip_(params, 1.0), args.warmup, args.steps),
        "clip: grouped foreach (new)": median_ms(lambda: clip_grads_(params, 1.0), args.warmup, args.steps),
    }
    for name, make in (
        ("AdamW foreach=False (old)", lambda: torch.optim.AdamW(params, lr=lr, foreach=False)),
        ("AdamW foreach=True, grouped", lambda: torch.optim.AdamW([{"params": g} for g in param_groups(params)], lr=lr, foreach=True)),
        ("AdamW fused, grouped (new)", lambda: make_optimizer(model, lr)),
    ):
        optimizer = make()
        rows[name] = median_ms(optimizer.step, args.warmup, args.steps)
        del optimizer
        torch.cuda.empty_cache()
    # what a training step runs: the grouped norm, then the fused step dividing by the clip divisor
    optimizer = make_optimizer(model, lr)
    rows["clip folded into AdamW fused, grouped (training default): norm + step"] = median_ms(
        lambda: clipped_step(optimizer, params, 1.0), args.warmup, args.steps)
    rows["clip: grouped norm only"] = median_ms(lambda: grad_norm(params), args.warmup, args.steps)
    del optimizer
    gpu = next((k for k in BANDWIDTH if k in torch.cuda.get_device_name()), None)
    floor_ms = 28 * n / BANDWIDTH[gpu] * 1e3 if gpu else None
    result = dict(config=os.path.basename(args.config), parameters=n, gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, floor_ms=floor_ms, ms=rows)
    print(f"\n{result['config']}: {n / 1e9:.2f}B parameters on {result['gpu']}, torch {torch.__version__}")
    print("| step part | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} |")
    if floor_ms:
        print(f"| fp32 AdamW traffic floor (28 B/param at HBM peak) | {floor_ms:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

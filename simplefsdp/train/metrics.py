"""Per-step training metrics: one aligned line on stdout, one JSON record in ``metrics.jsonl``, and
TensorBoard scalars when asked for.

A record holds ``step``, ``loss`` (the global batch's mean loss), ``grad_norm`` (before clipping),
``tokens_per_s`` (global tokens over the step's time, below), ``step_ms``, ``peak_mem_gib`` (the
device's peak allocated memory on a GPU, the process's peak resident size on the CPU) and ``mfu``
(model FLOPs utilization, GPUs only: FLOPs per token from the config, over the device's peak).

On a GPU the training loop logs a step once the next one is queued: :class:`StepReadout` copies a
step's loss and norm to the host behind that step's kernels, and reading it waits for that copy
alone, so the GPU has the next step's kernels to run while the host waits and logs. A step's time
is the time between two readouts, which on a GPU that is never idle is its time on the GPU.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import asdict, dataclass

import torch

from simplefsdp.models.llama import TransformerConfig

# dense bf16 peaks (FLOP/s) of known GPUs, matched by name; metrics.peak_tflops overrides
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 per active matmul weight,
    plus causal-agnostic attention scores and values, 12 * layers * dim * seq_len (PaLM's count).

    Active weights: attention and output projections, dense MLPs, and for MoE blocks the router,
    the shared experts and ``top_k`` of the routed experts. Embedding lookups are not matmuls.
    A transformers config is counted by :func:`simplefsdp.models.hf.hf_flops_per_token`.
    """
    if not isinstance(cfg, TransformerConfig):
        from simplefsdp.models.hf import hf_flops_per_token

        return hf_flops_per_token(cfg, seq_len)
    d = cfg.dim
    attention = d * cfg.n_heads * cfg.head_dim * 2 + d * cfg.n_kv_heads * cfg.head_dim * 2
    dense_mlp = 3 * d * cfg.ffn_dim
    n_moe = cfg.n_layers - cfg.n_dense_layers if hasattr(cfg, "num_experts") else 0
    moe_mlp = 0
    if n_moe:
        moe_mlp = d * cfg.num_experts + 3 * d * cfg.expert_dim * (cfg.top_k + cfg.num_shared_experts)
    weights = cfg.n_layers * attention + (cfg.n_layers - n_moe) * dense_mlp + n_moe * moe_mlp + d * cfg.vocab_size
    return 6 * weights + 12 * cfg.n_layers * d * seq_len


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """The device's peak FLOP/s for MFU, or None (CPUs, unknown GPUs without an override)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepReadout:
    """A step's loss and gradient norm on their way to the host. On a GPU the copy goes to pinned
    memory behind the step's kernels, and :meth:`read` waits for it, not for kernels queued later."""

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor):
        values = torch.stack([loss.detach().float(), norm.detach().float().to(loss.device)])
        self.done = None
        if values.is_cuda:
            self.host = torch.empty(values.shape, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = values

    def read(self) -> tuple[float, float]:
        """(loss, norm) as Python floats."""
        if self.done is not None:
            self.done.synchronize()
        loss, norm = self.host.tolist()
        return loss, norm


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    tokens_per_s: float
    step_ms: float
    peak_mem_gib: float
    mfu: float | None


def _progress(step: int, steps: int, width: int = 20) -> str:
    done = width * step // steps
    return "[" + "#" * done + "-" * (width - done) + "]"


def format_line(m: StepMetrics, steps: int) -> str:
    digits = len(str(steps))
    mfu = f"  mfu {100 * m.mfu:5.1f}%" if m.mfu is not None else ""
    return (
        f"step {m.step:{digits}d}/{steps} {_progress(m.step, steps)}  loss {m.loss:8.4f}  "
        f"gnorm {m.grad_norm:8.4f}  {m.tokens_per_s:10.1f} tok/s  {m.step_ms:8.1f} ms  "
        f"mem {m.peak_mem_gib:6.2f} GiB{mfu}"
    )


def read_records(path: str) -> list[dict]:
    """The step records of a ``metrics.jsonl`` (or of the one in run directory ``path``);
    ValueError naming the first line that is not JSON."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"line {number} is not a JSON record (a truncated or non-JSONL file?)") from None
    return records


class MetricsLog:
    """Writes each step's metrics (call on every rank; only ``enabled`` ranks write)."""

    def __init__(self, out_dir: str, steps: int, *, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.steps, self.enabled = steps, enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.writer = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        # a resumed run rewrites the steps after its checkpoint; a new run starts a new file
        kept = [r for r in read_records(self.path) if r["step"] <= resume_step] if resume_step and os.path.exists(self.path) else []
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def log(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        print(format_line(m, self.steps), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(m)) + "\n")
        if self.writer is not None:
            for key, value in asdict(m).items():
                if key != "step" and value is not None:
                    self.writer.add_scalar(key, value, m.step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        sys.stdout.flush()

"""AdamW as one multi-tensor Triton kernel that moves each byte once, with gradient clipping folded in.

fp32 AdamW must read the parameter, the gradient and both moments and write the parameter and both
moments back: 28 bytes per parameter, the traffic floor of the step. torch's fused AdamW reaches
about 60% of it on an H200, and with a ``grad_scale`` (the hook clipping can use) it also writes
every gradient back. This optimizer runs one Triton kernel per param group over every tensor of
the group at once:

* a table on the device holds, per tensor, the addresses of its parameter, gradient and moments,
  its element count and its two step coefficients (``lr / (1 - beta1^step)`` and
  ``sqrt(1 - beta2^step)``, computed on the host in double precision as torch does);
* the tensors are cut into chunks of ``BLOCK * CHUNK_BLOCKS`` elements; program ``i`` updates
  chunk ``i``, found through two cached arrays (which tensor, which offset), so one launch covers
  the group however many tensors it has and however their sizes differ (the table and the arrays:
  :mod:`simplefsdp.train.tensor_chunks`);
* the clip divisor ``max(1, (norm + 1e-6) / max_norm)`` stays a tensor on the device; each program
  loads it and divides the gradient in registers. The gradient is only read: after the step it
  still holds the unclipped values (torch's ``clip_grad_norm_`` overwrites them).

The update is torch's (``param -= lr * wd * param``, moments, ``param -= step_size * m / (sqrt(v) /
sqrt(bc2) + eps)``) with correctly rounded square roots and divisions; it may differ from torch's
fused kernel in the last bit (operation order).

The kernel takes contiguous float32 or bfloat16 tensors on CUDA (or on the CPU under Triton's
interpreter, ``TRITON_INTERPRET=1``, which the tests use), computing in fp32 as torch's fused kernel
does; one launch per (device, dtype) of a group. Every other tensor (CPU training, fp16) steps
through torch's multi-tensor AdamW (``foreach``), given the gradients already divided (a copy, so
there too the gradients are left as they were). State is kept as torch's AdamW keeps it
(``step`` a CPU scalar, ``exp_avg``, ``exp_avg_sq`` shaped and placed like the parameter, DTensors
for DTensor parameters), so checkpoints move between the two.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as torch_adamw

from simplefsdp.train.tensor_chunks import address_table, chunk_map, kernel_runs_on, to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch build without triton: the foreach path runs everywhere
    triton = None

# elements a program handles per loop iteration, iterations per program (a chunk is BLOCK *
# CHUNK_BLOCKS elements) and warps: the fastest of benchmarks/optimizer_step.py's sweep in two runs
# on H100s (2-3% faster than 2048 x 8 x 8 warps)
BLOCK = 8192
CHUNK_BLOCKS = 2
NUM_WARPS = 16


if triton is not None:

    @triton.jit
    def _adamw_kernel(table_ptr, coef_ptr, chunk_tensor_ptr, chunk_start_ptr, divisor_ptr, n_tensors,
                      lr, beta1, beta2, eps, weight_decay,
                      DTYPE: tl.constexpr, HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr,
                      CHUNK_BLOCKS: tl.constexpr):
        chunk = tl.program_id(0)
        t = tl.load(chunk_tensor_ptr + chunk)
        start = tl.load(chunk_start_ptr + chunk)
        # every address is 16-byte aligned (the host checks): 128-bit loads and stores
        param = tl.multiple_of(tl.load(table_ptr + t).to(tl.pointer_type(DTYPE)), 16)
        grad = tl.multiple_of(tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(DTYPE)), 16)
        exp_avg = tl.multiple_of(tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(DTYPE)), 16)
        exp_avg_sq = tl.multiple_of(tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(DTYPE)), 16)
        numel = tl.load(table_ptr + 4 * n_tensors + t)
        step_size = tl.load(coef_ptr + t)
        bias_correction2_sqrt = tl.load(coef_ptr + n_tensors + t)
        if HAS_DIVISOR:
            divisor = tl.load(divisor_ptr)
        for i in range(CHUNK_BLOCKS):
            first = start + i * BLOCK
            offs = tl.max_contiguous(tl.multiple_of(first + tl.arange(0, BLOCK), BLOCK), BLOCK)
            if first + BLOCK <= numel:  # a whole block: no mask, so 128-bit loads and stores
                _adamw_block(param, grad, exp_avg, exp_avg_sq, offs, None, divisor if HAS_DIVISOR else None,
                             lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt)
            elif first < numel:  # the tensor's last, partial block
                _adamw_block(param, grad, exp_avg, exp_avg_sq, offs, offs < numel, divisor if HAS_DIVISOR else None,
                             lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt)

    @triton.jit
    def _adamw_block(param, grad, exp_avg, exp_avg_sq, offs, mask, divisor,
                     lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt):
        # math in fp32 (torch's fused kernel: opmath), stored in the tensors' dtype
        p = tl.load(param + offs, mask=mask).to(tl.float32)
        g = tl.load(grad + offs, mask=mask).to(tl.float32)
        m = tl.load(exp_avg + offs, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq + offs, mask=mask).to(tl.float32)
        if divisor is not None:
            g = tl.div_rn(g, divisor)
        p = p - lr * weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(param + offs, p.to(param.dtype.element_ty), mask=mask)
        tl.store(exp_avg + offs, m.to(exp_avg.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq + offs, v.to(exp_avg_sq.dtype.element_ty), mask=mask)


_KERNEL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16} if triton is not None else {}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _kernel_takes(tensors: list[torch.Tensor]) -> bool:
    """Parameter, gradient and moments: contiguous, 16-byte aligned, of one dtype the kernel has."""
    if triton is None:
        return False
    return all(t.dtype == tensors[0].dtype in _KERNEL_DTYPES and t.is_contiguous() and t.data_ptr() % 16 == 0
               and kernel_runs_on(t.device) for t in tensors)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, param groups and state) stepped by one Triton kernel
    per param group (module docstring). ``step(grad_divisor=d)`` divides every gradient by the
    scalar tensor ``d`` as it reads it, which is how :func:`simplefsdp.train.optimizer.clipped_step`
    clips. amsgrad, maximize, capturable, differentiable and fused (in the constructor or in a
    param group) are refused with a ValueError, before any group steps."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 **unsupported):
        if unsupported:
            raise ValueError(f"simplefsdp AdamW does not take {sorted(unsupported)} (only lr, betas, eps, weight_decay)")
        if isinstance(lr, torch.Tensor):
            raise ValueError("simplefsdp AdamW takes lr as a float, not a tensor")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)

    @torch.no_grad()
    def step(self, closure=None, *, grad_divisor: torch.Tensor | Callable[[], torch.Tensor] | None = None):
        """One AdamW step of every param group. ``grad_divisor``: a scalar tensor each gradient is
        divided by as it is read, or a function returning one, called once after every group's
        host-side preparation (state, step counts, tensor tables and their copies to the device)
        and before any group's update runs. A divisor that waits for the GPU (a norm that reads a
        value to the host) then waits while the preparation is already done, not before it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):  # all refused before any group steps
            for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
                if group.get(key):
                    raise ValueError(f"simplefsdp AdamW: param group {i} sets {key}=True, which it does not implement")
        updates = []  # each group's update, prepared on the host, run once the divisor is known
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            kernel, other = [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # a checkpoint of torch's fused AdamW
                    state["step"] = state["step"].cpu()
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                (kernel if _kernel_takes(tensors) else other).append((p, tensors))
            for device, dtype in {(tensors[0].device, tensors[0].dtype) for _, tensors in kernel}:
                same = [e for e in kernel if (e[1][0].device, e[1][0].dtype) == (device, dtype)]
                updates.append(self._kernel_update(group, same))
            if other:
                updates.append(functools.partial(self._foreach_step, group, other))
        divisor = grad_divisor() if callable(grad_divisor) else grad_divisor
        for update in updates:
            update(divisor)
        return loss

    def _foreach_step(self, group, entries, grad_divisor) -> None:
        params, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*(tensors for _, tensors in entries)))
        if grad_divisor is not None:
            grads = torch._foreach_div(grads, grad_divisor.to(grads[0].device))
        beta1, beta2 = group["betas"]
        torch_adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], [self.state[p]["step"] for p, _ in entries],
            foreach=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _kernel_update(self, group, entries) -> Callable[[torch.Tensor | None], None]:
        """Prepare one kernel launch over ``entries`` (one device and dtype): the step counts, the
        device tables; returns the launch, which takes the divisor."""
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        columns = list(zip(*(tensors for _, tensors in entries)))
        numels = tuple(t.numel() for t in columns[0])
        steps = []
        for p, _ in entries:
            self.state[p]["step"] += 1
            steps.append(self.state[p]["step"].item())
        device = columns[0][0].device
        table = address_table(columns, device)
        coefs = to_device(torch.tensor([lr / (1 - beta1**s) for s in steps] + [math.sqrt(1 - beta2**s) for s in steps],
                                       dtype=torch.float32), device)
        tensor_index, start = chunk_map(device, numels, BLOCK * CHUNK_BLOCKS)

        def launch(grad_divisor: torch.Tensor | None) -> None:
            if not len(tensor_index):  # every shard of the group is empty on this rank
                return
            divisor = grad_divisor.to(device=device, dtype=torch.float32) if grad_divisor is not None else coefs
            _adamw_kernel[(len(tensor_index),)](
                table, coefs, tensor_index, start, divisor, len(numels),
                lr, beta1, beta2, group["eps"], group["weight_decay"],
                DTYPE=_KERNEL_DTYPES[columns[0][0].dtype], HAS_DIVISOR=grad_divisor is not None, BLOCK=BLOCK,
                CHUNK_BLOCKS=CHUNK_BLOCKS, num_warps=NUM_WARPS)

        return launch

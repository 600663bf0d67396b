"""The sum of squares of many tensors, read only where a flag on the device says it is needed.

Clipping takes each group's sum of squared gradients from the backward
(:mod:`simplefsdp.grad_squares`) where the group counted one gradient per parameter, and must read
the gradients where it did not. The count is on the device. Deciding on the host would copy it
there, and the host would wait for the backward's last kernel in the middle of every step, with the
GPU then idle while the host queues the optimizer. :func:`square_sum_unless` decides on the device:
one multi-tensor Triton kernel (:mod:`simplefsdp.train.tensor_chunks`) whose programs each load the
flag first and read their chunk only when it is false. When the squares are right it is a launch
of programs that each load one flag and store one zero; when they are not, it reads every tensor
once. Each program writes its chunk's sum, and torch sums those in a fixed order, so the result is
the same in every run.

Tensors the kernel does not take (not on a device it runs on, not contiguous, another dtype) are
read with torch's ops every time, and their sum is dropped when the flag is true.
"""

from __future__ import annotations

import torch

from simplefsdp.train.tensor_chunks import address_table, chunk_map, kernel_runs_on, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _square_sum_kernel(table_ptr, chunk_tensor_ptr, chunk_start_ptr, skip_ptr, out_ptr, n_tensors,
                           DTYPE: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCKS: tl.constexpr):
        chunk = tl.program_id(0)
        if tl.load(skip_ptr) != 0:
            tl.store(out_ptr + chunk, 0.0)
        else:
            t = tl.load(chunk_tensor_ptr + chunk)
            start = tl.load(chunk_start_ptr + chunk)
            x_ptr = tl.load(table_ptr + t).to(tl.pointer_type(DTYPE))
            numel = tl.load(table_ptr + n_tensors + t)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(CHUNK_BLOCKS):
                offs = start + i * BLOCK + tl.arange(0, BLOCK)
                x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
                acc += x * x
            tl.store(out_ptr + chunk, tl.sum(acc, axis=0))

    _KERNEL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
else:
    _KERNEL_DTYPES = {}

# a chunk is BLOCK * CHUNK_BLOCKS elements: large, so that a skipped launch has few programs
BLOCK = 4096
CHUNK_BLOCKS = 16


def _kernel_takes(t: torch.Tensor) -> bool:
    return t.dtype in _KERNEL_DTYPES and t.is_contiguous() and kernel_runs_on(t.device)


def square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of the squares of every element of ``tensors``, always read: one
    multi-tensor kernel, as ``torch.nn.utils.get_total_norm`` does."""
    return torch.stack(torch._foreach_norm([t.float() for t in tensors])).pow(2).sum()


def square_sum_unless(tensors: list[torch.Tensor], skip: torch.Tensor) -> torch.Tensor:
    """The float32 sum of the squares of every element of ``tensors``, or 0 where the boolean
    scalar ``skip`` (on their device) is true; the host never reads ``skip`` (module docstring)."""
    device = skip.device
    sums = []
    taken = [t for t in tensors if _kernel_takes(t)]
    skip_flag = skip.to(torch.int32) if taken else None  # what the kernel loads, made once for every launch
    for dtype in dict.fromkeys(t.dtype for t in taken):  # one launch per dtype, in first-seen order
        same = [t for t in taken if t.dtype == dtype]
        tensor_index, start = chunk_map(device, tuple(t.numel() for t in same), BLOCK * CHUNK_BLOCKS)
        out = torch.empty(len(tensor_index), dtype=torch.float32, device=device)
        if len(tensor_index):
            _square_sum_kernel[(len(tensor_index),)](
                address_table([same], device), tensor_index, start, skip_flag, out, len(same),
                DTYPE=_KERNEL_DTYPES[dtype], BLOCK=BLOCK, CHUNK_BLOCKS=CHUNK_BLOCKS)
        sums.append(out.sum())
    others = [t for t in tensors if not _kernel_takes(t)]
    if others:
        read = square_sum(others).to(device)
        sums.append(torch.where(skip, torch.zeros_like(read), read))
    return torch.stack(sums).sum() if sums else torch.zeros((), device=device)

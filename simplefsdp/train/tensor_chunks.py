"""The work list of a multi-tensor Triton kernel: one launch over many tensors of any sizes.

A launch gets a table on the device holding, per tensor, the address of each of its columns
(parameter, gradient, moments: whatever the kernel reads) followed by the tensors' element counts,
and two arrays mapping each program to its chunk: which tensor, and the chunk's first element.
Every tensor is cut into chunks of ``chunk`` elements, so the tensor's last chunk may be partial
and the kernel masks it. Used by :mod:`simplefsdp.train.adamw` and :mod:`simplefsdp.train.square_sum`.

A kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
which the tests use); :func:`kernel_runs_on` says which.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
except ImportError:  # a torch build without triton: callers keep to torch's ops
    triton = None


def kernel_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on ``device`` here."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


@functools.lru_cache(maxsize=64)
def chunk_map(device: torch.device, numels: tuple[int, ...], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index int32, first element int64) of every chunk, on ``device``; cached, as a
    model's tensor sizes do not change between steps."""
    counts = torch.tensor([math.ceil(n / chunk) for n in numels], dtype=torch.int64)
    tensor_index = torch.repeat_interleave(torch.arange(len(numels)), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    start = (torch.arange(len(tensor_index)) - first_chunk[tensor_index]) * chunk
    return tensor_index.to(device, torch.int32), start.to(device, torch.int64)


def address_table(columns: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """int64 on ``device``: each column's tensor addresses in turn, then the element counts (of the
    first column's tensors; every column's tensors have the same). On CUDA it is copied from pinned
    memory without waiting, since a copy from pageable memory waits for every kernel queued before it."""
    numels = [t.numel() for t in columns[0]]
    table = torch.tensor([t.data_ptr() for column in columns for t in column] + numels, dtype=torch.int64)
    return to_device(table, device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; through pinned memory, not waiting, on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

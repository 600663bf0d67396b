"""Grouped matmul for experts: ``out[rows of group g] = x[rows of group g] @ w[g]``.

Rows of ``x`` are sorted by group; ``offs`` (int32) holds the cumulative end row of each group.
On CUDA in bf16 this is ``torch._grouped_mm`` (one kernel for all groups). Elsewhere (CPU, fp32,
or a torch without it) a reference runs instead: each row is multiplied by its own group's
weight as one batched matmul, so every row's result is independent of how rows are grouped,
which keeps expert-parallel runs comparable with one process.
"""

from __future__ import annotations

import torch


def native_rows(x: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``torch._grouped_mm`` for rows ``x`` and bf16 weights."""
    return hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16


def native_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``torch._grouped_mm`` for these operands."""
    return native_rows(x) and w.dtype == torch.bfloat16


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The group index of each of ``rows`` rows, from cumulative group ends ``offs``."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x: [rows, k], w: [groups, k, n], offs: [groups] int32 -> [rows, n].

    Every row belongs to a group (``offs[-1] == rows``).
    """
    if native_available(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    ids = group_ids(offs, x.shape[0]).clamp_(max=w.shape[0] - 1)
    return torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1)

"""Pad the token groups of a grouped matmul to an aligned row count, and take the padding off again.

``torch._grouped_mm`` reads rows sorted by group, with each group ending at ``offs[g]``; its
kernels run best when every group starts on a multiple of ``ALIGNMENT`` rows (and low-precision
variants require it). :func:`aligned_groups` runs a grouped computation on such a padded copy:

    rows sorted by group (counts 3, 0, 5)       padded (alignment 4), zero rows marked .
    a a a b b b b b                      ->     a a a . b b b b b . . .   (+ spare zero rows)

The padded buffer has a static size (``rows + groups * (ALIGNMENT - 1)``), so it traces under
torch.compile without data-dependent shapes. Moving rows in and out is :func:`permute_rows`, a
row gather that writes zeros where the index is -1: a Triton kernel on CUDA (or under Triton's
interpreter), plain indexing elsewhere; both give the same bits. Its backward is the same gather
with the inverse index.
"""

from __future__ import annotations

import math
import os

import torch

from simplefsdp.moe.token_slots import rows_or_zeros

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch build without triton: the torch path runs everywhere
    triton = None

ALIGNMENT = 16


def _triton_usable(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _permute_rows_kernel(x_ptr, index_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        src = tl.load(index_ptr + row)
        in_row = cols < n_cols
        values = tl.load(x_ptr + src * n_cols + cols, mask=in_row & (src >= 0), other=0.0)
        tl.store(out_ptr + row * n_cols + cols, values, mask=in_row)


@torch.library.triton_op("simplefsdp::permute_rows", mutates_args=())
def _permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    if not _triton_usable(x):
        return rows_or_zeros(x, index, padded=True)
    x = x.contiguous()
    out = x.new_empty((index.shape[0], *x.shape[1:]))
    cols = math.prod(x.shape[1:])  # not x[0].numel(): the row count may be unbacked (ep dispatch)
    block = min(1024, triton.next_power_of_2(cols))
    grid = (index.shape[0], triton.cdiv(cols, block))
    # wrap_triton lets torch.compile trace the launch; torch 2.11 refuses the interpreter's
    # functions, and the interpreter only runs eagerly on the CPU, so that launch is direct
    kernel = torch.library.wrap_triton(_permute_rows_kernel) if x.is_cuda else _permute_rows_kernel
    kernel[grid](x, index, out, cols, BLOCK=block)
    return out


def _setup_context(ctx, inputs, output):
    _, index, inverse = inputs
    ctx.save_for_backward(index, inverse)


def _backward(ctx, grad):
    index, inverse = ctx.saved_tensors
    return _permute_rows(grad, inverse, index), None, None


_permute_rows.register_autograd(_backward, setup_context=_setup_context)


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[i] = x[index[i]]``, or zeros where ``index[i] == -1``.

    ``inverse`` maps each row of ``x`` to the row of ``out`` that holds it (-1 if none): every
    row appears at most once, so the gradient is the same gather with the two indices swapped.
    """
    return _permute_rows(x, index, inverse)


def aligned_layout(counts: torch.Tensor, rows: int, alignment: int = ALIGNMENT):
    """Where ``rows`` rows sorted by group (``counts[g]`` in group g) go when each group is padded
    to a multiple of ``alignment`` rows: ``(padded_counts, dest, source)``, ``dest[r]`` the padded
    row of row ``r`` and ``source[p]`` the row in padded row ``p`` (-1: padding). The padded row
    count is static: ``rows + groups * (alignment - 1)``."""
    groups = counts.shape[0]
    padded_counts = (counts + alignment - 1) // alignment * alignment
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    group_of_row = torch.repeat_interleave(
        torch.arange(groups, device=counts.device), counts, output_size=rows
    )
    dest = torch.arange(rows, device=counts.device) + (padded_starts - starts)[group_of_row]
    source = torch.full((rows + groups * (alignment - 1),), -1, dtype=torch.long, device=counts.device)
    source = source.scatter(0, dest, torch.arange(rows, device=counts.device))
    return padded_counts, dest, source


def aligned_groups(fn, x: torch.Tensor, counts: torch.Tensor, alignment: int = ALIGNMENT) -> torch.Tensor:
    """``fn(x, counts)`` computed on a copy of ``x`` whose groups are padded to ``alignment`` rows."""
    padded_counts, dest, source = aligned_layout(counts, x.shape[0], alignment)
    out = fn(permute_rows(x, source, dest), padded_counts)
    return permute_rows(out, dest, source)

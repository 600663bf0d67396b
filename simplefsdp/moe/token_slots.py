"""Token slots to rows grouped by expert and back, with gathers in both directions.

With top-k routing a MoE layer has ``tokens * k`` slots: slot ``t*k + j`` is token ``t``'s
``j``-th expert. Sorting the slots by expert gives ``order``, and the experts read the rows
``x[order // k]``; their outputs go back to slot order before each token's k outputs are weighted
and summed.

Written as plain indexing, autograd turns each gather into an accumulating scatter into zeros
(``index_put`` with ``accumulate=True``): Inductor runs it with atomic adds, whose order, and so
whose float sums, change from call to call, after a pass that zeroes the buffer. Both functions
here are gathers whose gradient is a gather too:

* :func:`permuted_rows` ``(x, index, inverse)``: ``x[index]`` for a permutation ``index``; its
  gradient is the gradient gathered by ``inverse``. Under torch.compile the gather fuses into the
  kernel that reads its output (the weighted sum of the slots, say), so nothing is written in
  between.
* :func:`repeated_rows` ``(x, order, inverse, k)``: ``x[order // k]``, each token's row k times;
  its gradient gathers each token's k row gradients in increasing row order and adds them one
  after another. That is the order in which the accumulating scatter adds them on one thread
  (CPU autograd), so eager results are the same bits, and under torch.compile the adds fuse into
  one kernel that writes each token's gradient once, the same in every call.

Both take padding: rows of the grouped layout that no slot fills (``-1`` in ``order``, or in
``inverse`` for :func:`permuted_rows`) read as zeros, and their gradient is never read. So the
rows reach the experts already padded to the grouped matmul's alignment
(:func:`simplefsdp.moe.token_permute.aligned_layout`) and come back from it in one gather each,
without a padded copy in between.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse[order[i]] = i``."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def rows_or_zeros(x: torch.Tensor, index: torch.Tensor, padded: bool) -> torch.Tensor:
    """``x[index]``, with zeros where ``index`` is -1 if ``padded`` (a static fact: the
    caller's shapes say it; ``padded=False`` is plain indexing)."""
    if not padded:
        return x[index]
    if guard_or_false(x.shape[0] == 0):  # an empty chunk: padding only (unknown for rows received by all-to-all)
        return x.new_zeros((index.shape[0], *x.shape[1:]))
    rows = x[index.clamp(min=0)]
    return torch.where((index >= 0).view(-1, *[1] * (x.dim() - 1)), rows, torch.zeros_like(rows))


class _PermutedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        # padding has static sizes; rows received by all-to-all (unbacked sizes) never have any
        return rows_or_zeros(grad, inverse, padded=guard_or_false(inverse.shape[0] != grad.shape[0])), None, None


def permuted_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[index]``, ``index`` a permutation of ``x``'s rows and ``inverse`` its inverse; or ``x``
    padded: ``index`` then names fewer rows, and ``inverse`` is -1 at the others."""
    return _PermutedRows.apply(x, index, inverse)


class _RepeatedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return rows_or_zeros(x, order // top_k, padded=order.shape[0] != inverse.shape[0])  # -1 // k is -1

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        rows_of_token = inverse.view(-1, ctx.top_k).sort(dim=1).values
        total = grad[rows_of_token[:, 0]]
        for j in range(1, ctx.top_k):
            total = total + grad[rows_of_token[:, j]]
        return total, None, None, None


def repeated_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x[order // top_k]``: ``x`` is ``[tokens, ...]``, ``order`` a permutation of the
    ``tokens * top_k`` slots and ``inverse`` its inverse; or ``order`` padded with -1 (zero rows)
    and ``inverse`` each slot's row in it."""
    return _RepeatedRows.apply(x, order, inverse, top_k)

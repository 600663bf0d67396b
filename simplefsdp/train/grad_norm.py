"""The global gradient norm over parameters on different meshes, and clipping by it.

Gradients of a SimpleFSDP (or FSDP2) model are DTensors: dense ones on the dp mesh, routed
experts' on the ``[edp, ep]`` mesh, tensor-parallel ones with a ``tp`` dim too. Each gradient's
local squared norm is added up per (mesh, placements), one multi-tensor kernel per group; that
sum is then all-reduced over exactly
the mesh dims where the gradient is sharded (a replicated dim holds the same values on every
rank and is counted once). One all-reduce per distinct sharded group, not one per parameter.
Where the model tracks its gradients' squares (:mod:`simplefsdp.grad_squares`), a group's local
sum comes from the backward instead, and its gradients are read for the norm only where the
backward's count says the sum is not theirs; that choice is made on the device
(:mod:`simplefsdp.train.square_sum`), so the norm never waits for the backward on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from simplefsdp.grad_squares import GradSquares, Taken, group_key
from simplefsdp.train.square_sum import square_sum, square_sum_unless
from simplefsdp.train.tensor_chunks import kernel_runs_on


def total_norm(groups: dict[tuple | None, list[torch.Tensor]], squares: dict[tuple, Taken] | None = None) -> torch.Tensor:
    """The 2-norm of all gradients together, as a float32 scalar on their device, equal on all ranks;
    ``groups``: the gradients (DTensors or their local tensors) by (mesh, placements), as
    :func:`group_by_mesh` gives them; ``squares``: what the backward computed for some of those
    groups (:meth:`GradSquares.take`), whose tensors are then read only where its count is off."""
    squares = squares or {}
    total = None
    for key, grads in groups.items():
        s = _group_square_sum(grads, squares.get(key))
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if isinstance(placement, (Shard, _StridedShard)):
                    dist.all_reduce(s, group=mesh.get_group(dim))
                elif not isinstance(placement, Replicate):
                    raise ValueError(f"gradient placement {placement} on mesh dim {dim}: expected Shard or Replicate")
        total = s if total is None else total + s.to(total.device)
    if total is None:
        return torch.zeros(())
    return total.sqrt()


def _group_square_sum(grads: list[torch.Tensor], taken: Taken | None) -> torch.Tensor:
    """The local sum of squares of one group's gradients: from the backward where it counted right,
    else read. On a device that runs Triton kernels the choice is made there
    (:func:`square_sum_unless`); elsewhere (the CPU) reading the flag costs the host nothing, and
    a group counted right takes no local tensor."""
    if taken is None:
        return square_sum(_locals(grads))
    if kernel_runs_on(taken.sum.device):
        unless = square_sum_unless(_locals(grads), taken.counted_right)
        return torch.where(taken.counted_right, taken.sum, unless)
    return taken.sum.clone() if bool(taken.counted_right) else square_sum(_locals(grads))


def group_by_mesh(tensors) -> dict[tuple | None, list[torch.Tensor]]:
    """``tensors`` grouped by (mesh, placements), in first-seen order; plain tensors under None."""
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(group_key(t), []).append(t)
    return groups


def _locals(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(g.to_local() if isinstance(g, DTensor) else g).detach() for g in grads]


def _by_mesh(grads: list[torch.Tensor]) -> dict[tuple | None, list[torch.Tensor]]:
    """The local tensors of ``grads``, grouped by (mesh, placements)."""
    return {key: _locals(group) for key, group in group_by_mesh(grads).items()}


@torch.no_grad()
def grad_norm(params, squares: GradSquares | None = None) -> torch.Tensor:
    """The total gradient norm of ``params`` (every rank gets the same value). With ``squares``
    (the model's :func:`simplefsdp.grad_squares.track_grad_squares`), each group whose squares the
    backward computed is read only where their count is off (:func:`_group_square_sum`)."""
    params = list(params)
    groups = group_by_mesh([p.grad for p in params if p.grad is not None])
    return total_norm(groups, squares.take(params) if squares is not None else None)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to ``max_norm`` divides every gradient by: ``(norm + 1e-6) / max_norm``, at
    least 1 (torch's ``clip_grad_norm_`` multiplies by the reciprocal)."""
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


@torch.no_grad()
def clip_grads_(params, max_norm: float, squares: GradSquares | None = None) -> torch.Tensor:
    """The total gradient norm of ``params``; gradients scaled down to ``max_norm`` when it is > 0.
    ``squares`` as for :func:`grad_norm`."""
    params = list(params)
    groups = _by_mesh([p.grad for p in params if p.grad is not None])
    norm = total_norm(groups, squares.take(params) if squares is not None else None)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for locals_ in groups.values():
            torch._foreach_mul_(locals_, scale.to(locals_[0].device))
    return norm

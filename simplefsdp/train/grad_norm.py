"""The global gradient norm over parameters on different meshes, and clipping by it.

Gradients of a SimpleFSDP (or FSDP2) model are DTensors: dense ones on the dp mesh, routed
experts' on the ``[edp, ep]`` mesh, tensor-parallel ones with a ``tp`` dim too. Each gradient's
local squared norm is added up per (mesh, placements), one multi-tensor kernel per group; that
sum is then all-reduced over exactly
the mesh dims where the gradient is sharded (a replicated dim holds the same values on every
rank and is counted once). One all-reduce per distinct sharded group, not one per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def total_norm(groups: dict[tuple | None, list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of all gradients together, as a float32 scalar on their device, equal on all ranks;
    ``groups``: their local tensors by (mesh, placements), as :func:`_by_mesh` gives them."""
    total = None
    for key, locals_ in groups.items():
        # one multi-tensor kernel per group, as torch.nn.utils.get_total_norm does
        s = torch.stack(torch._foreach_norm([t.float() for t in locals_])).pow(2).sum()
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


def group_by_mesh(tensors) -> dict[tuple | None, list[torch.Tensor]]:
    """``tensors`` grouped by (mesh, placements), in first-seen order; plain tensors under None."""
    groups: dict[tuple | None, list[torch.Tensor]] = {}
    for t in tensors:
        key = (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    return groups


def _by_mesh(grads: list[torch.Tensor]) -> dict[tuple | None, list[torch.Tensor]]:
    """The local tensors of ``grads``, grouped by (mesh, placements)."""
    return {
        key: [(g.to_local() if isinstance(g, DTensor) else g).detach() for g in group]
        for key, group in group_by_mesh(grads).items()
    }


@torch.no_grad()
def grad_norm(params) -> torch.Tensor:
    """The total gradient norm of ``params`` (every rank gets the same value)."""
    return total_norm(_by_mesh([p.grad for p in params if p.grad is not None]))


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clipping to ``max_norm`` divides every gradient by: ``(norm + 1e-6) / max_norm``, at
    least 1 (torch's ``clip_grad_norm_`` multiplies by the reciprocal)."""
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


@torch.no_grad()
def clip_grads_(params, max_norm: float) -> torch.Tensor:
    """The total gradient norm of ``params``; gradients scaled down to ``max_norm`` when it is > 0."""
    groups = _by_mesh([p.grad for p in params if p.grad is not None])
    norm = total_norm(groups)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for locals_ in groups.values():
            torch._foreach_mul_(locals_, scale.to(locals_[0].device))
    return norm

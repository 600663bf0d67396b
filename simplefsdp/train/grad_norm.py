"""The global gradient norm over parameters on different meshes, and clipping by it.

Gradients of a SimpleFSDP (or FSDP2) model are DTensors: dense ones on the dp mesh, routed
experts' on the ``[edp, ep]`` mesh, tensor-parallel ones with a ``tp`` dim too. Each gradient's
local squared sum is added up per (mesh, placements); that sum is then all-reduced over exactly
the mesh dims where the gradient is sharded (a replicated dim holds the same values on every
rank and is counted once). One all-reduce per distinct sharded group, not one per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together, as a float32 scalar on their device, equal on all ranks."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            key, local = (g.device_mesh, tuple(g.placements)), g.to_local()
        else:
            key, local = None, g
        groups.setdefault(key, []).append(local.detach().float().pow(2).sum())
    total = None
    for key, squares in groups.items():
        s = torch.stack(squares).sum()
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


@torch.no_grad()
def clip_grads_(params, max_norm: float) -> torch.Tensor:
    """The total gradient norm of ``params``; gradients scaled down to ``max_norm`` when it is > 0."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(scale.to(g.device))
    return norm

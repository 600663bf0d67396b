"""The one place a full parameter is split into the local shard each rank stores.

Every shard is cut from the full tensor where it lies (the host, or the device it was built on)
with the same chunk arithmetic as DTensor's ``Shard`` (``torch.chunk``: shards of
``ceil(size / n)`` rows, the last ones shorter or empty), then copied into a tensor of its own on
the mesh's device. So a shard owns exactly its bytes (a view would keep the whole source tensor
alive) and the full parameter is never put on the device.

Three kinds of parameter are stored:

* dense parameters: ``Shard(0)`` over ``dp_shard``, ``Replicate`` over ``dp_replicate``;
* tensor-parallel DTensors: the tp-local tensor sharded again over the dp dims, re-homed on the
  whole mesh (a strided shard when tp already splits dim 0);
* routed experts: split over ``ep`` by expert, then FSDP-sharded over ``edp`` on dim 0 (a strided
  shard of the full tensor) or dim 1.

Replicas must start equal, as DDP and FSDP2 make them: each shard is broadcast from the first
rank of every mesh dim it is replicated over as it is stored (one broadcast per parameter and
replicate dim, in the model's parameter order on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from simplefsdp.mesh_layout import DataParallelLayout, ExpertLayout


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` of ``parts``, as ``torch.chunk`` and DTensor's ``Shard`` cut."""
    step = -(-size // parts)
    offset = min(index * step, size)
    return offset, min(step, size - offset)


def local_chunk(tensor: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's chunk of ``tensor`` along ``dim`` over the 1-D ``mesh`` (possibly empty)."""
    offset, length = chunk_bounds(tensor.shape[dim], mesh.size(), mesh.get_local_rank())
    return tensor.narrow(dim, offset, length)


def _owned(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy of ``local`` on ``device`` that owns exactly its bytes."""
    return torch.empty(local.shape, dtype=local.dtype, device=device).copy_(local)


def _parameter(local, mesh, placements, like: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """``local`` as this rank's shard of a DTensor parameter shaped like ``like``; replicas synced."""
    _sync_replicas(local, mesh, placements)
    dtensor = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    return nn.Parameter(dtensor, requires_grad=requires_grad)


def _sync_replicas(local: torch.Tensor, mesh: DeviceMesh, placements) -> None:
    """Broadcast ``local`` from the first rank of every mesh dim it is replicated on, as DDP does.

    ``mesh`` is the caller's: a DTensor's ``device_mesh`` may be an equal mesh of earlier process
    groups (torch caches DTensor specs by mesh equality).
    """
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) and mesh.size(dim) > 1:
            dist.broadcast(local, group=mesh.get_group(dim), group_src=0)


def shard_dense(param: torch.Tensor, layout: DataParallelLayout, device: torch.device) -> nn.Parameter:
    """A plain parameter stored on the dp mesh: ``Shard(0)`` on dp_shard, whole on dp_replicate."""
    full = param.detach()
    local = full
    for mesh, placement in zip(layout.dim_meshes, layout.shard):
        if isinstance(placement, Shard):
            local = local_chunk(local, placement.dim, mesh)
    return _parameter(_owned(local, device), layout.dp_mesh, layout.shard, full, param.requires_grad)


def shard_tp(param: DTensor, layout: DataParallelLayout) -> nn.Parameter:
    """A TP DTensor re-homed on ``[dp..., tp]``: dp shards dim 0 of the tp-local tensor.

    When tp already shards dim 0, dp's shard of it is a strided shard of the full tensor.
    """
    tp_placement = param.placements[0]
    local = param.to_local().detach()
    for mesh, placement in zip(layout.dim_meshes, layout.shard):
        if isinstance(placement, Shard):
            local = local_chunk(local, 0, mesh)
    dp = tuple(
        _StridedShard(0, split_factor=layout.tp_mesh.size()) if isinstance(p, Shard) and tp_placement.is_shard(0) else p
        for p in layout.shard
    )
    return _parameter(_owned(local, local.device), layout.mesh, dp + (tp_placement,), param, param.requires_grad)


def local_experts(param: torch.Tensor, ep_mesh: DeviceMesh) -> torch.Tensor:
    """This ep rank's experts of a stacked expert parameter (dim 0), as a tensor of its own."""
    return _owned(local_chunk(param.detach(), 0, ep_mesh), param.device)


def shard_experts(
    param: torch.Tensor, experts: ExpertLayout, fsdp_dim: int, device: torch.device
) -> nn.Parameter:
    """A routed-expert parameter on ``[dp_replicate,] edp, ep``: split over ep, then FSDP over edp."""
    full = param.detach()
    local = local_chunk(local_chunk(full, 0, experts.ep_mesh), fsdp_dim, experts.edp_mesh)
    edp = _StridedShard(0, split_factor=experts.ep) if fsdp_dim == 0 else Shard(fsdp_dim)
    placements = (Replicate(),) * (experts.mesh.ndim - 2) + (edp, Shard(0))
    return _parameter(_owned(local, device), experts.mesh, placements, full, param.requires_grad)

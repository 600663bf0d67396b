"""The one place a full parameter is split into the local shard each rank stores.

Every shard is cut from the full tensor where it lies (the host, or the device it was built on)
with the same chunk arithmetic as DTensor's ``Shard`` (``torch.chunk``: shards of
``ceil(size / n)`` rows, the last ones shorter or empty), then copied into a tensor of its own on
the mesh's device. So a shard owns exactly its bytes (a view would keep the whole source tensor
alive) and the full parameter is never put on the device.

Three kinds of parameter are stored, each by its sharding (``store`` makes the parameter;
``part`` cuts this rank's part of a full tensor, which ``gathered(writeback=True)`` also uses):

* :class:`DenseSharding`: ``Shard(0)`` over ``dp_shard``, ``Replicate`` over ``dp_replicate``;
* :class:`TensorParallelSharding`: the tp-local tensor sharded again over the dp dims, re-homed
  on the whole mesh (a strided shard when tp already splits dim 0);
* :class:`ExpertSharding`: routed experts split over ``ep`` by expert, then FSDP-sharded over
  ``edp`` on dim 0 (a strided shard of the full tensor) or dim 1.

Replicas must start equal, as DDP and FSDP2 make them: each shard is broadcast from the first
rank of every mesh dim it is replicated over as it is stored (for routed experts under tp, whose
``[edp, ep]`` mesh leaves ``dp_replicate`` out, over that dim too) (one broadcast per parameter and
replicate dim, in the model's parameter order on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from simplefsdp.mesh_layout import DataParallelLayout, ExpertLayout


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments); older torch may lack the new name
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def _parameter(local, mesh, placements, like: torch.Tensor, requires_grad: bool, replicated_over=()) -> nn.Parameter:
    """``local`` as this rank's shard of a DTensor parameter shaped like ``like``; replicas synced
    over ``mesh``'s replicate dims and the 1-D meshes ``replicated_over`` (replicas outside ``mesh``)."""
    _sync_replicas(local, mesh, placements)
    for replicas in replicated_over:
        if replicas.size() > 1:
            dist.broadcast(local, group=replicas.get_group(), group_src=0)
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


def _cut(tensor: torch.Tensor, cuts) -> torch.Tensor:
    """This rank's chunk of ``tensor`` after each (1-D mesh, dim) cut in turn (a view)."""
    return tensor[_box(tensor.shape, cuts)]


def _box(shape, cuts) -> tuple[slice, ...]:
    """Where this rank's chunk lies in a ``shape``-d tensor after each (1-D mesh, dim) cut in turn."""
    return _box_of(shape, [(mesh.size(), mesh.get_local_rank(), dim) for mesh, dim in cuts])


def _box_of(shape, cuts) -> tuple[slice, ...]:
    """Where chunk ``index`` of each (parts, index, dim) cut in turn lies in a ``shape``-d tensor."""
    start, size = [0] * len(shape), list(shape)
    for parts, index, dim in cuts:
        offset, size[dim] = chunk_bounds(size[dim], parts, index)
        start[dim] += offset
    return tuple(slice(a, a + n) for a, n in zip(start, size))


def _dp_cuts(layout: DataParallelLayout) -> list[tuple[DeviceMesh, int]]:
    """The dp dims that shard (``Shard(0)`` on dp_shard; dp_replicate keeps the whole tensor)."""
    return [(m, p.dim) for m, p in zip(layout.dim_meshes, layout.shard) if isinstance(p, Shard)]


class _Sharding:
    """How a full parameter is cut into this rank's part: ``cuts()``, (1-D mesh, dim) in order."""

    def cuts(self) -> list[tuple[DeviceMesh, int]]:
        raise NotImplementedError

    def part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter (a view)."""
        return _cut(full, self.cuts())

    def box(self, shape) -> tuple[slice, ...]:
        """Where this rank's part lies in the full ``shape``-d parameter, one slice per dim."""
        return _box(shape, self.cuts())

    def full(self, part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The whole ``shape``-d parameter from every rank's ``part`` (all-gathers, last cut first).

        Built on the caller's 1-D meshes: a DTensor parameter's own ``device_mesh`` may be an equal
        mesh of earlier process groups (torch caches DTensor specs by mesh equality).
        """
        cuts, shapes = self.cuts(), [torch.Size(shape)]
        for mesh, dim in cuts:
            size = list(shapes[-1])
            size[dim] = chunk_bounds(size[dim], mesh.size(), mesh.get_local_rank())[1]
            shapes.append(torch.Size(size))
        for (mesh, dim), whole in zip(reversed(cuts), reversed(shapes[:-1])):
            stride = torch.empty(whole, device="meta").stride()
            part = DTensor.from_local(part, mesh, (Shard(dim),), run_check=False, shape=whole, stride=stride)
            part = part.full_tensor()
        return part


@dataclass(frozen=True)
class DenseSharding(_Sharding):
    """A plain parameter stored on the dp mesh: ``Shard(0)`` on dp_shard, whole on dp_replicate."""

    layout: DataParallelLayout
    device: torch.device

    def cuts(self):
        return _dp_cuts(self.layout)

    def store(self, param: torch.Tensor) -> nn.Parameter:
        local = _owned(self.part(param.detach()), self.device)
        return _parameter(local, self.layout.dp_mesh, self.layout.shard, param, param.requires_grad)


@dataclass(frozen=True)
class TensorParallelSharding(_Sharding):
    """A TP DTensor re-homed on ``[dp..., tp]``: dp shards dim 0 of the tp-local tensor.

    When tp already shards dim 0, dp's shard of it is a strided shard of the full tensor.
    """

    layout: DataParallelLayout
    tp_placement: Placement

    def cuts(self):
        tp = [(self.layout.tp_mesh, self.tp_placement.dim)] if isinstance(self.tp_placement, Shard) else []
        return tp + _dp_cuts(self.layout)

    def store(self, param: DTensor) -> nn.Parameter:
        local = _cut(param.to_local().detach(), _dp_cuts(self.layout))  # tp already cut its part
        split_dim0 = self.tp_placement.is_shard(0)
        dp = tuple(
            _StridedShard(0, split_factor=self.layout.tp_mesh.size()) if isinstance(p, Shard) and split_dim0 else p
            for p in self.layout.shard
        )
        return _parameter(_owned(local, local.device), self.layout.mesh, dp + (self.tp_placement,), param, param.requires_grad)


def local_experts(param: torch.Tensor, ep_mesh: DeviceMesh) -> torch.Tensor:
    """This ep rank's experts of a stacked expert parameter (dim 0), as a tensor of its own."""
    return _owned(local_chunk(param.detach(), 0, ep_mesh), param.device)


@dataclass(frozen=True)
class ExpertSharding(_Sharding):
    """A routed-expert parameter on ``[dp_replicate,] edp, ep``: split over ep, then FSDP over edp."""

    experts: ExpertLayout
    fsdp_dim: int
    device: torch.device

    def cuts(self):
        return [(self.experts.ep_mesh, 0), (self.experts.edp_mesh, self.fsdp_dim)]

    def full(self, part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The whole parameter from one all-gather over the ``edp x ep`` ranks.

        DTensor's ``full_tensor`` of the stored placements (a strided shard on edp, then ``Shard``
        on ep) runs two, and warns that it cannot merge them. Parts of uneven shards are padded to
        the largest for the collective, then each is copied into its box.
        """
        ep, edp, flat = self.experts.ep, self.experts.edp, self.experts.flat_mesh
        boxes = [_box_of(shape, [(ep, r % ep, 0), (edp, r // ep, self.fsdp_dim)]) for r in range(flat.size())]
        sizes = [[s.stop - s.start for s in box] for box in boxes]
        numel = max(math.prod(size) for size in sizes)
        sent = part.new_zeros(numel)
        sent[: part.numel()] = part.reshape(-1)
        received = part.new_empty(numel * len(boxes))
        _all_gather_into(received, sent, group=flat.get_group())
        whole = part.new_empty(shape)
        for r, (box, size) in enumerate(zip(boxes, sizes)):
            whole[box] = received[r * numel : r * numel + math.prod(size)].view(size)
        return whole

    def store(self, param: torch.Tensor) -> nn.Parameter:
        experts = self.experts
        edp = _StridedShard(0, split_factor=experts.ep) if self.fsdp_dim == 0 else Shard(self.fsdp_dim)
        placements = (Replicate(),) * (experts.mesh.ndim - 2) + (edp, Shard(0))
        local = _owned(self.part(param.detach()), self.device)
        # with tp the experts' mesh is [edp, ep] (ep borrows tp ranks): dp_replicate lies outside it
        outside = (experts.replicate_mesh,) if experts.tp_mesh is not None and experts.replicate_mesh is not None else ()
        return _parameter(local, experts.mesh, placements, param, param.requires_grad, outside)

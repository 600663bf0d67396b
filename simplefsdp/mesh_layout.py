"""Resolve a user's DeviceMesh and ``mode`` into the data-parallel layout of a parameter.

``simple_fsdp`` accepts a 1-D mesh (fully sharded over it) or a mesh whose dims are named
``dp_replicate``, ``dp_shard`` and ``tp``. This module checks those names and the mode, and
answers, for the data-parallel dims only, three placement lists:

``shard`` says how a parameter is stored (``Shard(0)`` on ``dp_shard``, ``Replicate()`` on
``dp_replicate``), and ``gather_steps`` the 1-D meshes that compute gathers over, one step per
dp dim: replicate dims first, so that backward reduce-scatters over ``dp_shard`` before it
all-reduces the (smaller) shard over ``dp_replicate``, in FSDP2's order.

Gradients are averaged over data-parallel ranks, as FSDP2's ``fully_shard`` does by default.

With expert parallelism (``ep > 1``) the ``dp_shard`` dim is split into ``edp x ep``: routed
experts are sharded over ``ep`` by expert and FSDP-sharded over ``edp`` (the data-parallel ranks
left over), in :class:`ExpertLayout`; everything else stays on the dense dp mesh.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
TP = "tp"
KNOWN_DIMS = (DP_REPLICATE, DP_SHARD, TP)

# mode -> the data-parallel dims it needs, in mesh order
MODE_DIMS = {
    "fully_shard": (DP_SHARD,),
    "replicate": (DP_REPLICATE,),
    "hybrid_shard": (DP_REPLICATE, DP_SHARD),
}


@dataclass(frozen=True)
class ExpertLayout:
    """The sparse mesh of routed experts: ``[dp_replicate,] edp, ep``.

    Without tp, ``mesh`` holds all three dims. With tp, ``edp x ep`` splits the ranks of
    ``dp_shard x tp`` (ep borrows tp ranks), ``mesh`` is that 2-D ``edp, ep`` mesh, and
    ``tp_mesh`` is set: ranks of one tp group hold the same tokens and split them for dispatch.
    """

    mesh: DeviceMesh
    replicate_mesh: DeviceMesh | None
    edp_mesh: DeviceMesh
    ep_mesh: DeviceMesh
    # the same edp x ep ranks as one 1-D mesh (``dp_shard``, with tp ``dp_shard_tp``), rank
    # ``edp_index * ep + ep_index``: one collective can reach every part of an expert parameter
    flat_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None = None

    @property
    def ep(self) -> int:
        return self.ep_mesh.size()

    @property
    def edp(self) -> int:
        return self.edp_mesh.size()

    def fsdp_dim(self, num_experts: int) -> int:
        """FSDP shards the expert dim over edp when edp divides each ep rank's experts, else dim 1.

        Dim 0 is a strided shard of the full tensor and must split evenly; dim 1 is a plain
        ``Shard(1)``, which DTensor cuts unevenly where it has to.
        """
        return 0 if (num_experts // self.ep) % self.edp == 0 else 1


@dataclass(frozen=True)
class DataParallelLayout:
    """The data-parallel part of a mesh and the placements a parameter takes on it.

    ``experts``, the sparse mesh of ``ep > 1``, is built on first use: building it creates process
    groups, which must wait until every check has passed.
    """

    mode: str
    mesh: DeviceMesh  # the whole mesh given to simple_fsdp
    dp_mesh: DeviceMesh
    dp_dims: tuple[str, ...]
    dim_meshes: tuple[DeviceMesh, ...]  # the 1-D mesh of each dp dim
    tp_mesh: DeviceMesh | None
    dim_names: tuple[str, ...] = ()  # every mesh dim's role, tp included
    ep: int = 1

    @functools.cached_property
    def experts(self) -> ExpertLayout | None:
        return _expert_layout(self.mesh, self.dim_names, self.ep) if self.ep > 1 else None

    @property
    def shard(self) -> tuple[Placement, ...]:
        return tuple(_placement(d) for d in self.dp_dims)

    @property
    def gather_steps(self) -> tuple[tuple[DeviceMesh, Placement], ...]:
        steps = [(m, _placement(d)) for d, m in zip(self.dp_dims, self.dim_meshes)]
        return _nontrivial(sorted(steps, key=lambda step: isinstance(step[1], Shard)))

    def experts_gather_steps(self, fsdp_dim: int) -> tuple[tuple[DeviceMesh, Placement], ...]:
        """Routed experts gather over edp only (replicated over dp_replicate); ep stays split."""
        experts = self.experts
        steps = [(experts.edp_mesh, Shard(fsdp_dim))]
        if experts.replicate_mesh is not None:
            steps.insert(0, (experts.replicate_mesh, Replicate()))
        return _nontrivial(steps)

    @property
    def dp_degree(self) -> int:
        return self.dp_mesh.size()

    def ep_rank_groups(self) -> list[list[int]] | None:
        """The ranks of every ep group, where the mesh spans the world (None where it does not).

        ep takes the inner ranks of ``dp_shard`` (of ``dp_shard x tp`` with tp), so moving those
        dims last and cutting rows of ``ep`` ranks lists every group.
        """
        if self.experts is None or self.mesh.mesh.numel() != dist.get_world_size():
            return None
        names = list(self.mesh.mesh_dim_names or (DP_SHARD,))
        inner = [DP_SHARD] + ([TP] if self.experts.tp_mesh is not None else [])
        order = [i for i, n in enumerate(names) if n not in inner] + [names.index(n) for n in inner]
        return self.mesh.mesh.permute(order).reshape(-1, self.experts.ep).tolist()

    def group_names(self) -> set[str]:
        """The process groups of every mesh dim a parameter or token of this layout moves over."""
        meshes = [*self.dim_meshes, self.tp_mesh]
        if self.experts is not None:
            meshes += [self.experts.replicate_mesh, self.experts.edp_mesh, self.experts.ep_mesh]
        return {m.get_group().group_name for m in meshes if m is not None}


def _nontrivial(steps) -> tuple[tuple[DeviceMesh, Placement], ...]:
    """Drop steps over one rank: they would be collectives that move nothing."""
    return tuple((m, p) for m, p in steps if m.size() > 1)


def _placement(dim: str) -> Placement:
    return Shard(0) if dim == DP_SHARD else Replicate()


def _dim_names(mesh: DeviceMesh, mode: str | None) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"a {mesh.ndim}-D mesh needs mesh_dim_names from {KNOWN_DIMS}; got none"
            )
        # an unnamed 1-D mesh plays the single dp role its mode needs
        dims = MODE_DIMS[mode or "fully_shard"]
        if len(dims) != 1:
            raise ValueError(
                f"mode {mode!r} needs a mesh with dims {dims}; got an unnamed 1-D mesh"
            )
        return dims
    for name in names:
        if name not in KNOWN_DIMS:
            raise ValueError(
                f"mesh dim {name!r} is not one of {KNOWN_DIMS}; name the mesh dims "
                "with init_device_mesh(..., mesh_dim_names=...)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"mesh dim names repeat: {names}")
    order = [KNOWN_DIMS.index(n) for n in names]
    if order != sorted(order):
        raise ValueError(f"mesh dims must be ordered as {KNOWN_DIMS}; got {names}")
    return tuple(names)


def _unflatten(mesh: DeviceMesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with ``dim`` split into ``sizes`` (inner-most fastest), named ``names``."""
    all_names = list(mesh.mesh_dim_names or ("dp_shard",))
    if hasattr(mesh, "_unflatten"):
        return mesh._unflatten(dim, sizes, names)
    shape = list(mesh.mesh.shape)
    shape[dim : dim + 1] = sizes
    all_names[dim : dim + 1] = names
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=tuple(all_names))


def _split_dims(mesh: DeviceMesh, dims: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The dims that ``edp x ep`` splits (``dp_shard``, with tp ``dp_shard, tp``) and their degree."""
    split = (DP_SHARD, TP) if TP in dims else (DP_SHARD,)
    degree = 1
    for d in split:
        degree *= mesh.size(dims.index(d))
    return split, degree


def _check_expert_room(mesh: DeviceMesh, dims: tuple[str, ...], ep: int) -> None:
    """ValueError unless ``ep`` splits the ``dp_shard`` (``x tp``) degree; creates no process group."""
    if DP_SHARD not in dims:
        raise ValueError(f"ep={ep} needs a {DP_SHARD!r} mesh dim to split into edp x ep; the mesh has {dims}")
    split, degree = _split_dims(mesh, dims)
    what = " x ".join(split)
    if ep > degree:
        raise ValueError(f"the mesh has no room for ep={ep}: the {what} degree is {degree}")
    if degree % ep:
        raise ValueError(f"ep={ep} does not divide the {what} degree {degree}")


def _expert_layout(mesh: DeviceMesh, dims: tuple[str, ...], ep: int) -> ExpertLayout:
    split, degree = _split_dims(mesh, dims)
    replicate = mesh[DP_REPLICATE] if DP_REPLICATE in dims else None
    if TP not in dims:
        sparse = _unflatten(mesh, dims.index(DP_SHARD), (degree // ep, ep), ("edp", "ep"))
        return ExpertLayout(sparse, replicate, sparse["edp"], sparse["ep"], mesh[DP_SHARD])
    flat = mesh[split]._flatten("dp_shard_tp")
    sparse = _unflatten(flat, 0, (degree // ep, ep), ("edp", "ep"))
    return ExpertLayout(sparse, replicate, sparse["edp"], sparse["ep"], flat, mesh[TP])


def resolve_layout(mesh: DeviceMesh, mode: str | None, ep: int = 1) -> DataParallelLayout:
    """Check ``mesh``, ``mode`` and ``ep``; return the data-parallel layout (ValueError if they
    don't fit). Creates no process group: the expert mesh is built when ``experts`` is first read."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh; got {type(mesh).__name__}")
    if mode is not None and mode not in MODE_DIMS:
        raise ValueError(f"unknown mode {mode!r}; expected one of {tuple(MODE_DIMS)}")
    names = _dim_names(mesh, mode)
    dp_dims = tuple(n for n in names if n != TP)
    if mode is None:
        mode = next((m for m, dims in MODE_DIMS.items() if dims == dp_dims), None)
        if mode is None:
            raise ValueError(
                f"mesh dims {names} name no data-parallel dim; add {DP_SHARD!r} or {DP_REPLICATE!r}"
            )
    elif MODE_DIMS[mode] != dp_dims:
        raise ValueError(
            f"mode {mode!r} needs data-parallel mesh dims {MODE_DIMS[mode]}; the mesh has {dp_dims}"
        )
    if ep > 1:
        _check_expert_room(mesh, names, ep)
    if mesh.mesh_dim_names is None:
        return DataParallelLayout(mode, mesh, mesh, dp_dims, (mesh,), None, names, ep)
    dp_mesh = mesh[dp_dims] if len(dp_dims) > 1 else mesh[dp_dims[0]]
    tp_mesh = mesh[TP] if TP in names else None
    return DataParallelLayout(mode, mesh, dp_mesh, dp_dims, tuple(mesh[d] for d in dp_dims), tp_mesh, names, ep)

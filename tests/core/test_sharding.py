"""Every stored shard owns exactly its bytes and lies where DTensor says it lies, on every rank.

Each layout is built once per rank of a fake process group (rank 0 to the last), so the
rank-dependent chunking of uneven shards runs on every rank, not only rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from simplefsdp import simple_fsdp
from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer
from simplefsdp.models.tp_plan import apply_tensor_parallel
from simplefsdp.param_access import WRAPPED_ATTR, is_wrapped
from simplefsdp.sharding import chunk_bounds

DEBUG = MOE_CONFIGS["debug"]  # 8 experts
# name: (world, mesh shape, mesh dim names, ep, num_experts)
LAYOUTS = {
    "FSDP8": (8, (8,), ("dp_shard",), 1, 8),
    "HSDP 2x4": (8, (2, 4), ("dp_replicate", "dp_shard"), 1, 8),
    "replicate 8": (8, (8,), ("dp_replicate",), 1, 8),
    "FSDP8 x EP2": (8, (8,), ("dp_shard",), 2, 8),
    "FSDP8 x EP2, dim-1 experts": (8, (8,), ("dp_shard",), 2, 4),
    "FSDP6 x EP2, uneven": (6, (6,), ("dp_shard",), 2, 8),
    "HSDP 2x4 x EP2": (8, (2, 4), ("dp_replicate", "dp_shard"), 2, 8),
    "FSDP4 x TP2": (8, (4, 2), ("dp_shard", "tp"), 1, 8),
    "FSDP4 x TP2 x EP2": (8, (4, 2), ("dp_shard", "tp"), 2, 8),
    "HSDP 2x2 x TP2 x EP2": (8, (2, 2, 2), ("dp_replicate", "dp_shard", "tp"), 2, 8),
}


@contextlib.contextmanager
def _wrapped(rank, world, shape, names, ep, num_experts):
    """The debug MoE wrapped on ``rank`` of a fake world, and an unwrapped copy of it."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = moe_transformer(dataclasses.replace(DEBUG, num_experts=num_experts))
        reference = copy.deepcopy(model)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if "tp" in names:
            apply_tensor_parallel(model, mesh["tp"])
        yield simple_fsdp(model, mesh, ep=ep), reference
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_shard_owns_its_bytes_on_every_rank(layout):
    world, shape, names, ep, num_experts = LAYOUTS[layout]
    tp = "tp" in names
    for rank in range(world):
        with _wrapped(rank, world, shape, names, ep, num_experts) as (model, reference):
            full = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                assert isinstance(param, DTensor), name
                local = param.to_local()
                assert local.is_contiguous(), (rank, name)
                assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), (rank, name)
                # DTensor's own arithmetic at this rank's coordinate (read from the rank grid: the
                # DTensor's mesh object can be an equal mesh cached from an earlier rank's group)
                grid = param.device_mesh.mesh
                coordinate = [int(c) for c in (grid == dist.get_rank()).nonzero()[0]]
                local_shape, offset = _compute_local_shape_and_global_offset(
                    param.shape, grid.shape, coordinate, param.placements
                )
                assert tuple(local.shape) == tuple(local_shape), (rank, name)
                if not tp:  # TP's own distribute_tensor moves no data under the fake group
                    where = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
                    assert torch.equal(local, full[name].detach()[where]), (rank, name)


@pytest.mark.parametrize("layout", [name for name, (*_, ep, _) in LAYOUTS.items() if ep > 1])
def test_a_whole_expert_parameter_is_one_all_gather(layout):
    """``gathered(writeback=True)`` and the HF save read routed experts through ``full``: one
    all-gather over the edp x ep ranks, where DTensor's ``full_tensor`` of the stored placements
    runs one per mesh dim (and warns). Whether the gathered values land in place is checked on
    gloo ranks (``test_gathered_with_writeback_gives_every_parameter_whole``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from simplefsdp.sharding import ExpertSharding

    world, shape, names, ep, num_experts = LAYOUTS[layout]
    for rank in (0, world - 1):
        with _wrapped(rank, world, shape, names, ep, num_experts) as (model, _):
            experts = []
            for m in model.modules():
                shardings = getattr(m, WRAPPED_ATTR).shardings if is_wrapped(m) else {}
                experts += [(s, m._parameters[n]) for n, s in shardings.items() if isinstance(s, ExpertSharding)]
            assert experts, layout
            for sharding, param in experts:
                with CommDebugMode() as comm:
                    whole = sharding.full(param.to_local(), param.shape)
                assert whole.shape == param.shape
                assert {str(op): n for op, n in comm.get_comm_counts().items()} == {"c10d._allgather_base_": 1}, (rank, layout)


def test_chunk_bounds_follow_torch_chunk():
    for size in range(0, 10):
        for parts in range(1, 9):
            chunks = torch.arange(size).chunk(parts)
            for i in range(parts):
                offset, length = chunk_bounds(size, parts, i)
                expected = chunks[i].tolist() if i < len(chunks) else []
                assert list(range(offset, offset + length)) == expected, (size, parts, i)


def test_a_later_world_gathers_as_its_own_rank():
    """Gathers are shared per configuration, process groups and this rank's place in the mesh: a
    model wrapped as rank 7 after one wrapped as rank 0, in one process (equal meshes, group names
    restarted), gathers with rank 7's mesh. It got rank 0's, whose shard shapes it then traced."""
    for rank in (0, 7):
        with _wrapped(rank, 8, (8,), ("dp_shard",), 2, 8) as (model, _):
            meshes = [mesh for m in model.modules() if is_wrapped(m)
                      for gather in getattr(m, WRAPPED_ATTR).gathers.values() for mesh, _ in gather.steps]
            # this rank's place, read from each mesh's rank grid
            assert meshes and all(
                list(mesh.get_coordinate()) == (mesh.mesh == rank).nonzero()[0].tolist() for mesh in meshes
            ), rank


def test_shared_gathers_die_with_their_model(fake_world):
    """The process-wide cache of shared gathers holds them weakly: once the model is gone, none of
    its gathers, nor the meshes and process groups they name, stay alive through it."""
    import gc

    from simplefsdp import param_gather

    before = len(param_gather._GATHERS)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = simple_fsdp(moe_transformer(MOE_CONFIGS["debug"]), mesh)
    assert len(param_gather._GATHERS) > before
    del model
    gc.collect()
    assert len(param_gather._GATHERS) == before

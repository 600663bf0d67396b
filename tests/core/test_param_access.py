"""FSDP2 parameter semantics, eagerly, on a fake 8-rank group: a parameter reads as its shard outside
forward (no collective), as the gathered tensor inside (once per forward, tied weights once), and
in-place edits after wrapping reach the shards. Compiled graphs are in test_graphs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from simplefsdp import gathered, simple_fsdp
from simplefsdp.models.llama import FeedForward
from simplefsdp.param_access import WRAPPED_ATTR


class TiedLoop(nn.Module):
    """A tied embedding and head, and a layer whose weight is read three times per forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for _ in range(3):
            h = h @ self.mix.weight.t()
        return self.head(h)


def _mesh():
    return init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))


def _gathers(comm: CommDebugMode) -> int:
    return comm.get_comm_counts()[torch.ops.c10d_functional.all_gather_into_tensor]


def test_outside_forward_a_parameter_is_its_shard(fake_world):
    model = simple_fsdp(FeedForward(16, 32), _mesh())
    with CommDebugMode() as comm:
        reads = {name: model.get_submodule(name.rpartition(".")[0]).weight for name, _ in model.named_parameters()}
    assert comm.get_total_counts() == 0
    for name, read in reads.items():
        assert read is model.get_parameter(name) and isinstance(read, DTensor)


def test_inside_forward_each_parameter_is_gathered_once(fake_world):
    model = simple_fsdp(TiedLoop(), _mesh())
    assert len(list(model.parameters())) == 2  # embed/head tied, mix
    with CommDebugMode() as comm:
        model(torch.randint(0, 16, (2, 4)))
    assert _gathers(comm) == 2
    assert model.mix.weight is model.get_parameter("mix.weight")  # released after forward


def test_in_place_edits_after_wrapping_reach_the_shards(fake_world):
    model = simple_fsdp(FeedForward(16, 32), _mesh())
    model.apply(lambda m: nn.init.constant_(m.weight, 0.5) if isinstance(m, nn.Linear) else None)
    with torch.no_grad():
        model.w2.weight.mul_(2)
    model.w3.weight.requires_grad_(False)
    assert all((p.to_local() == (1.0 if "w2" in n else 0.5)).all() for n, p in model.named_parameters())
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["w3.weight"]
    with gathered(model):
        assert torch.equal(model.w1.weight, torch.full((32, 16), 0.5))


def test_gathered_gathers_each_parameter_once_then_frees(fake_world):
    model = simple_fsdp(TiedLoop(), _mesh())
    with CommDebugMode() as comm, gathered(model):
        full = [model.embed.weight, model.head.weight, model.mix.weight, model.mix.weight]
        assert _gathers(comm) == 2
    assert full[0] is full[1] and full[2] is full[3]
    assert [tuple(t.shape) for t in full] == [(16, 8), (16, 8), (8, 8), (8, 8)] and not isinstance(full[0], DTensor)
    assert model.mix.weight is model.get_parameter("mix.weight")


def test_a_forward_that_raises_leaves_nothing_gathered(fake_world):
    model = simple_fsdp(TiedLoop(), _mesh())
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))  # out of the embedding's range, raised inside a child forward
    assert model.embed.weight is model.get_parameter("embed.weight")
    with CommDebugMode() as comm:
        model(torch.randint(0, 16, (2, 4)))
    assert _gathers(comm) == 2


def test_gathered_needs_a_wrapped_model(fake_world):
    with pytest.raises(ValueError, match="needs a model wrapped by simple_fsdp"):
        with gathered(nn.Linear(2, 2)):
            pass


def test_eager_checkpointing_leaves_nothing_gathered_after_backward(fake_world):
    """Checkpointing stops a recompute early by raising out of the block's last module; what that
    re-run gathered is released when backward ends, and the next step gathers fresh values."""
    from simplefsdp.activation_checkpoint import apply_activation_checkpointing
    from simplefsdp.param_access import STATE_ATTR

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = simple_fsdp(apply_activation_checkpointing(Blocks(), "full"), _mesh())
    state = getattr(model.layers[0]._checkpoint_wrapped_module[0], STATE_ATTR)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        assert state.frames == [] and state.gathered == {}
        last = model.layers[1]._checkpoint_wrapped_module[2]
        assert last.weight is last._parameters["weight"]


def test_a_model_on_a_rebuilt_mesh_gathers_over_its_own_process_groups(fake_world):
    """Two equal meshes (same ranks and dim names) over different process groups: DeviceMesh
    equality ignores the groups, so a gather cache keyed on it would hand the second model the
    first mesh's groups."""
    meshes = [init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard")) for _ in range(2)]
    assert meshes[0] == meshes[1]
    for mesh in meshes:
        model = simple_fsdp(FeedForward(16, 32), mesh)
        gather = getattr(model.w1, WRAPPED_ATTR).gathers["weight"]
        used = {m.get_group().group_name for m, _ in gather.steps}
        assert used == {mesh.get_group(d).group_name for d in range(2)}

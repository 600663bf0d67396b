"""Activation checkpointing: errors, state_dict names, communication never replayed, and compiling
checkpointed blocks.

Parity of checkpointed FSDP x EP blocks (eager and compiled) is in ``test_moe.py``, their graphs
in ``test_moe_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from simplefsdp import simple_fsdp
from simplefsdp.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.models.llama import Transformer, TransformerConfig, cross_entropy_loss


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"activation checkpointing mode must be one of .*; got 'some'"):
        apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1)), "some")


def test_state_dict_names_unchanged(fake_world):
    plain = Transformer(TransformerConfig(n_layers=1)).state_dict().keys()
    model = apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1)), "full")
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    assert model.state_dict().keys() == plain


class _Exchange(nn.Module):
    """Rows through an all-to-all (equal splits) between two linear layers, as tokens reach experts:
    the second layer's backward needs the exchanged rows, so a recompute would redo the exchange."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.outer(funcol.all_to_all_single_autograd(self.inner(x), None, None, dist.group.WORLD))


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Exchange(), _Exchange()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _all_to_alls(comm: CommDebugMode) -> int:
    return sum(n for op, n in comm.get_comm_counts().items() if "all_to_all" in str(op))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_communication_is_never_replayed(fake_world, mode):
    """Backward recomputes a checkpointed block's math but not its all-to-all: per block, one
    all-to-all forward and one for its gradient, as without checkpointing."""
    plain, checkpointed = _Layers(), apply_activation_checkpointing(_Layers(), mode)
    counts = []
    for model in (plain, checkpointed):
        with CommDebugMode() as comm:
            model(torch.randn(16, 8, requires_grad=True)).sum().backward()
        counts.append(_all_to_alls(comm))
    assert counts == [4, 4]
    assert all(p.grad is not None for p in checkpointed.parameters())


def test_compiled_checkpointed_blocks(fake_world):
    """Attention in a checkpointed block of DTensor parameters: on torch 2.13 replaying its RNG
    state put the DeviceMesh among the saved tensors (AssertionError at the first step)."""
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    model = simple_fsdp(apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1))), mesh)
    tokens = torch.randint(0, 256, (2, 8))
    cross_entropy_loss(torch.compile(model, fullgraph=True, backend="aot_eager")(tokens), tokens).backward()
    for name, param in model.named_parameters():  # backward ran through the checkpointed block
        assert param.grad is not None and param.grad.shape == param.shape, name


def test_checkpointed_graphs_are_cacheable(fake_world):
    """Each mode's region names its own stable hash, so AOTAutograd can cache the graph (torch
    2.13 bypasses its cache for a region whose context_fn has none)."""
    from torch._functorch._aot_autograd import autograd_cache

    collect = getattr(autograd_cache, "_collect_context_fn_hashes", None)
    if collect is None:
        pytest.skip("this torch keys no SAC context_fn")
    hashes = {}
    for m in ("full", "selective"):
        graphs = []
        torch._dynamo.reset()
        model = apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1)), m)
        torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm, fullgraph=True)(torch.randint(0, 256, (2, 8)))
        hashes[m] = set(collect(graphs[0]))
    assert all(len(h) == 1 for h in hashes.values()) and hashes["full"] != hashes["selective"]

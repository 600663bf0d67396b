"""Activation checkpointing: errors, state_dict names, the policy, and compiling checkpointed blocks.

Parity of checkpointed FSDP x EP blocks (eager and compiled) is in ``test_moe.py``, their graphs
in ``test_moe_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.activation_checkpoint import _context_fn, apply_activation_checkpointing
from simplefsdp.models.llama import Transformer, TransformerConfig, cross_entropy_loss
from torch.utils.checkpoint import CheckpointPolicy


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"activation checkpointing mode must be one of .*; got 'some'"):
        apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1)), "some")


def test_state_dict_names_unchanged(fake_world):
    plain = Transformer(TransformerConfig(n_layers=1)).state_dict().keys()
    model = apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1)), "full")
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    assert model.state_dict().keys() == plain


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_policy_saves_communication_and_random_ops(mode):
    policy = _context_fn(mode)[0].policy_fn
    aten = torch.ops.aten
    for op in (
        torch.ops._c10d_functional.all_to_all_single.default,
        aten.native_dropout.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
    ):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    expected_mm = CheckpointPolicy.MUST_SAVE if mode == "selective" else CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.mm.default) == expected_mm
    assert policy(None, aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_compiled_checkpointed_blocks(fake_world):
    """Attention in a checkpointed block of DTensor parameters: on torch 2.13 replaying its RNG
    state put the DeviceMesh among the saved tensors (AssertionError at the first step)."""
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    model = simple_fsdp(apply_activation_checkpointing(Transformer(TransformerConfig(n_layers=1))), mesh)
    tokens = torch.randint(0, 256, (2, 8))
    cross_entropy_loss(torch.compile(model, fullgraph=True, backend="aot_eager")(tokens), tokens).backward()

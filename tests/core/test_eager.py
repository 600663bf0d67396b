"""Eager-mode behaviour in one process (fake 8-rank group): resharding, meta init, state_dict."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from simplefsdp import simple_fsdp
from simplefsdp.models.llama import FeedForward, Transformer, TransformerConfig

@pytest.fixture
def mesh(fake_world):
    return init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))


def _gathers_per_pass(model) -> tuple[int, int]:
    """All-gathers counted in forward and in backward of one step.

    The input requires grad so that every matmul saves its weight for backward.
    """
    x = torch.randn(4, 16, requires_grad=True)
    with CommDebugMode() as fwd:
        y = model(x)
    with CommDebugMode() as bwd:
        y.sum().backward()
    ag = torch.ops.c10d_functional.all_gather_into_tensor  # CommDebugMode's key
    return fwd.get_comm_counts()[ag], bwd.get_comm_counts()[ag]


@pytest.mark.parametrize("reshard, backward_gathers", [(True, 3), (False, 0)])
def test_eager_reshard_after_forward_regathers_in_backward(mesh, reshard, backward_gathers):
    """A backward all-gather happens only when the saved weight was swapped for a re-gather recipe."""
    model = simple_fsdp(FeedForward(16, 32), mesh, reshard_after_forward=reshard)
    assert _gathers_per_pass(model) == (3, backward_gathers)


def test_state_dict_holds_shards_without_collectives(mesh):
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=1)), mesh)
    with CommDebugMode() as comm:
        state = model.state_dict()
    assert comm.get_total_counts() == 0
    assert "layers.0.attention.wq.weight" in state  # names as before wrapping
    assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in state.values())


def test_meta_init_matches_eager_init(mesh):
    cfg = TransformerConfig(n_layers=2, vocab_size=97)  # 97 rows: uneven over 8 ranks
    torch.manual_seed(0)
    reference = Transformer(cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    torch.manual_seed(0)
    simple_fsdp(model, mesh)
    for name, param in model.named_parameters():
        expected = reference.get_parameter(name).chunk(8)[0]
        assert torch.equal(param.to_local(), expected), name


def test_single_rank_mesh_still_casts_to_param_dtype(fake_world):
    """A mesh dim of one rank gathers nothing, but compute still gets param_dtype weights."""
    from simplefsdp import MixedPrecisionPolicy, gathered

    mesh = init_device_mesh("cpu", (8, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    for m in (mesh, mesh["dp_shard"]):
        model = simple_fsdp(FeedForward(16, 32), m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        with gathered(model):
            assert model.w1.weight.dtype == torch.bfloat16


def test_gpu_moe_config_has_one_to_two_billion_parameters():
    from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer

    with torch.device("meta"):
        model = moe_transformer(MOE_CONFIGS["gpu"])
    assert 1e9 < sum(p.numel() for p in model.parameters()) < 2e9

"""Initialization after wrapping: the model's own init run on the full tensors inside
``gathered(model, writeback=True)`` leaves each rank's shards equal to initializing before wrapping.

Runs on fake 8-rank groups as rank 0 and rank 7 (uneven shards are empty or short there): the
gathers move no data, so the values that reach the shards come from the init alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, gathered, simple_fsdp
from simplefsdp.models.moe import MoEConfig
from simplefsdp.models.tp_plan import apply_tensor_parallel
from tests import training as T
from tests.conftest import FAKE_RANKS, fake_world_at

MOE = MoEConfig(**dataclasses.asdict(T.CFG), num_experts=8, top_k=2, expert_dim=32)
LAYOUTS = {  # name -> (config, mesh shape, dim names, ep)
    "fsdp8": (T.CFG, (8,), ("dp_shard",), 1),
    "hsdp2x4": (T.CFG, (2, 4), ("dp_replicate", "dp_shard"), 1),
    "replicate8": (T.CFG, (8,), ("dp_replicate",), 1),
    "fsdp8xep2": (MOE, (8,), ("dp_shard",), 2),  # 4 experts per ep rank over edp=4: dim 0
    "fsdp8xep2/dim1": (dataclasses.replace(MOE, num_experts=2, top_k=1), (8,), ("dp_shard",), 2),
    "hsdp2x4xep2": (MOE, (2, 4), ("dp_replicate", "dp_shard"), 2),
    "fsdp4xtp2": (T.CFG, (4, 2), ("dp_shard", "tp"), 1),
    "hsdp2x2xtp2xep2": (MOE, (2, 2, 2), ("dp_replicate", "dp_shard", "tp"), 2),
}
INIT_SEED = 1234


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


def _init(model: nn.Module) -> None:
    """The model's own initialization, module by module."""
    torch.manual_seed(INIT_SEED)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().clone() for name, p in model.named_parameters()}


def _wrap(model, shape, names, ep, **kwargs):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        model = apply_tensor_parallel(model, mesh["tp"], src_data_rank=None)  # the fake group moves no data
    return simple_fsdp(model, mesh, ep=ep, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_inside_gathered_writeback_equals_init_before_wrapping(fake_world, layout):
    cfg, shape, names, ep = LAYOUTS[layout]
    before = T.build_model(cfg)
    _init(before)
    expected = _shards(_wrap(before, shape, names, ep))

    after = _wrap(T.build_model(cfg), shape, names, ep)
    assert any(not torch.equal(v, expected[k]) for k, v in _shards(after).items())  # not equal yet
    with gathered(after, writeback=True):
        _init(after)
    got = _shards(after)
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []


def test_meta_build_then_init_equals_init_before_wrapping(fake_world):
    """Build on meta, wrap (shards materialize), then initialize: the usual flow for big models."""
    expected_model = T.build_model()
    _init(expected_model)
    expected = _shards(_wrap(expected_model, (8,), ("dp_shard",), 1))
    with torch.device("meta"):
        model = T.build_model()
    model = _wrap(model, (8,), ("dp_shard",), 1)
    with gathered(model, writeback=True):
        _init(model)
    got = _shards(model)
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []


def test_writeback_keeps_full_precision_under_mixed_precision(fake_world):
    """Inside the block the tensors are in the stored dtype (fp32), not param_dtype (bf16)."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = _wrap(T.build_model(), (8,), ("dp_shard",), 1, mp_policy=bf16)
    with gathered(model, writeback=True):
        assert model.output.weight.dtype == torch.float32
        nn.init.constant_(model.output.weight, 1 + 2**-20)  # not representable in bf16
    assert (model.output.weight.to_local() == 1 + 2**-20).all()


def test_without_writeback_or_after_an_error_the_shards_are_unchanged(fake_world):
    model = _wrap(T.build_model(), (8,), ("dp_shard",), 1)
    before = _shards(model)
    with torch.no_grad(), gathered(model):
        model.output.weight.fill_(3.0)
    with pytest.raises(RuntimeError, match="init failed"), gathered(model, writeback=True):
        model.output.weight.fill_(3.0)
        raise RuntimeError("init failed")
    assert all(torch.equal(v, before[k]) for k, v in _shards(model).items())
    with pytest.raises(ValueError, match="writeback must be True or False; got 1"):
        with gathered(model, writeback=1):
            pass


def test_a_meta_model_is_allocated_and_sharded_one_module_at_a_time(fake_world):
    """When a module's parameters are allocated and initialized, every earlier module's are already
    shards: a rank never holds the whole model, only one module of it at full size."""
    from torch.distributed.tensor import DTensor

    sharded_when_initialized = []

    class Recording(nn.Linear):
        def reset_parameters(self):
            super().reset_parameters()
            if not self.weight.is_meta:  # not the call in nn.Linear's constructor
                sharded_when_initialized.append([isinstance(m.weight, DTensor) for m in model])

    with torch.device("meta"):
        model = nn.Sequential(*(Recording(8, 8) for _ in range(3)))
    _wrap(model, (8,), ("dp_shard",), 1)
    assert sharded_when_initialized == [[False, False, False], [True, False, False], [True, True, False]]

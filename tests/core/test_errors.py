"""Bad input to simple_fsdp raises a ValueError that names what is wrong, before any collective,
and leaves the model as it was: the same classes, the same parameter objects, the same values;
and no process group created (the expert mesh's groups come after every check)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, is_simple_fsdp, simple_fsdp
from simplefsdp.models.llama import FeedForward


def _mesh(shape=(8,), names=("dp_shard",)):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _state(model):
    return [
        (name, type(m), {n: (p, p.device, p.clone() if not p.is_meta else None) for n, p in m._parameters.items() if p is not None})
        for name, m in model.named_modules()
    ]


def _process_groups() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def expect_error(match, model=None, mesh=None, **kwargs):
    """``simple_fsdp(model, mesh, **kwargs)`` raises a ValueError matching ``match`` and changes nothing."""
    model = model if model is not None else FeedForward(16, 32)
    mesh = mesh if mesh is not None else _mesh()
    before, groups = _state(model), _process_groups()
    with pytest.raises(ValueError, match=match):
        simple_fsdp(model, mesh, **kwargs)
    assert _process_groups() == groups
    assert not is_simple_fsdp(model)
    for (name, cls, params), (_, cls_after, params_after) in zip(before, _state(model), strict=True):
        assert cls is cls_after, name
        for n, (p, device, value) in params.items():
            p_after, device_after, value_after = params_after[n]
            assert p is p_after and device == device_after, f"{name}.{n}"
            assert value is None or torch.equal(value, value_after), f"{name}.{n}"


def test_unknown_mode(fake_world):
    expect_error(r"unknown mode 'zero3'", mode="zero3")


def test_mode_that_does_not_fit_the_mesh(fake_world):
    expect_error(r"mode 'hybrid_shard' needs a mesh with dims", mode="hybrid_shard", mesh=init_device_mesh("cpu", (8,)))
    expect_error(r"mode 'replicate' needs data-parallel mesh dims \('dp_replicate',\)", mode="replicate")
    expect_error(
        r"mode 'fully_shard' needs data-parallel mesh dims \('dp_shard',\); the mesh has \('dp_replicate', 'dp_shard'\)",
        mode="fully_shard",
        mesh=_mesh((2, 4), ("dp_replicate", "dp_shard")),
    )


def test_mesh_dims_not_named_as_expected(fake_world):
    expect_error(r"mesh dim 'data' is not one of", mesh=_mesh((8,), ("data",)))
    expect_error(r"a 2-D mesh needs mesh_dim_names", mesh=init_device_mesh("cpu", (2, 4)))
    expect_error(r"ordered as", mesh=_mesh((4, 2), ("dp_shard", "dp_replicate")))
    expect_error(r"name no data-parallel dim", mesh=_mesh((8,), ("tp",)))


def test_not_a_mesh(fake_world):
    expect_error(r"mesh must be a DeviceMesh; got tuple", mesh=(8,))


def test_already_wrapped(fake_world):
    model = simple_fsdp(FeedForward(16, 32), _mesh())
    with pytest.raises(ValueError, match=r"module 'w1' is already wrapped by simple_fsdp"):
        simple_fsdp(model, _mesh())


def test_already_wrapped_by_fully_shard(fake_world):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(FeedForward(16, 32))
    fully_shard(model[0], mesh=_mesh())
    expect_error(r"module '0' is already wrapped by fully_shard", model=model)


def test_meta_parameter_without_init_path(fake_world):
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4, device="meta"))

    model = nn.Sequential(nn.Linear(4, 4), NoInit())
    expect_error(r"parameter '1.scale' is on the meta device and NoInit has no reset_parameters", model=model)


def test_bad_mixed_precision_policy(fake_world):
    expect_error(r"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy", mp_policy={"param_dtype": torch.bfloat16})
    for dtype in (torch.int8, torch.float8_e4m3fn):
        expect_error(
            rf"mp_policy.param_dtype must be one of .*float8 needs scaled matmuls.*got {dtype}",
            mp_policy=MixedPrecisionPolicy(param_dtype=dtype),
        )
    expect_error(r"mp_policy.reduce_dtype must be one of", mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int32))


def test_bad_ep_degree(fake_world):
    expect_error(r"ep must be a positive int; got 0", ep=0)
    expect_error(r"ep must be a positive int; got True", ep=True)


def test_bad_ep_chunks(fake_world):
    expect_error(r"ep_chunks must be a positive int \(1: no chunking\); got 0", ep=2, ep_chunks=0)
    expect_error(r"ep_chunks must be a positive int \(1: no chunking\); got 2.0", ep=2, ep_chunks=2.0)
    expect_error(r"ep_chunks=2 needs ep > 1: without expert parallelism there is no all-to-all", ep_chunks=2)


def test_reshard_after_forward_must_be_a_bool(fake_world):
    for value in (2, "yes", None):
        expect_error(rf"reshard_after_forward must be True or False .*got {value!r}", reshard_after_forward=value)


def test_zero_dim_parameter_on_a_sharded_mesh(fake_world):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.tensor(2.0))

    expect_error(r"parameter 'scale' is 0-dim and fully_shard shards dim 0; store it with shape \[1\]", model=Scale())


def test_meta_check_runs_before_any_module_is_materialized(fake_world):
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4, device="meta"))

    model = nn.Sequential(nn.Linear(4, 4, device="meta"), NoInit())
    expect_error(r"parameter '1.scale' is on the meta device", model=model)
    assert model[0].weight.is_meta


def test_tp_plan_that_tp_does_not_divide(fake_world):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = _mesh((4, 2), ("dp_shard", "tp"))
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    expect_error(r"parameter '0.weight': tp=2 does not divide dim 0 of shape \(5, 4\)", model=model, mesh=mesh)


def test_global_state_changes_only_as_documented(fake_world):
    """ep=1 leaves Dynamo's config alone; ep>1 turns on capture_scalar_outputs (README: Global state)."""
    from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer

    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        simple_fsdp(moe_transformer(MOE_CONFIGS["debug"]), _mesh())
        assert torch._dynamo.config.capture_scalar_outputs is False
        simple_fsdp(moe_transformer(MOE_CONFIGS["debug"]), _mesh(), ep=2)
        assert torch._dynamo.config.capture_scalar_outputs is True

"""Bad input to simple_fsdp raises a ValueError that names what is wrong, before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, is_simple_fsdp, simple_fsdp
from simplefsdp.models.llama import FeedForward


def _mesh(shape=(8,), names=("dp_shard",)):
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _expect_error(match, model=None, mesh=None, **kwargs):
    model = model if model is not None else FeedForward(16, 32)
    with pytest.raises(ValueError, match=match):
        simple_fsdp(model, mesh if mesh is not None else _mesh(), **kwargs)
    assert not is_simple_fsdp(model)


def test_unknown_mode(fake_world):
    _expect_error(r"unknown mode 'zero3'", mode="zero3")


def test_mode_that_does_not_fit_the_mesh(fake_world):
    _expect_error(r"mode 'hybrid_shard' needs a mesh with dims", mode="hybrid_shard", mesh=init_device_mesh("cpu", (8,)))
    _expect_error(r"mode 'replicate' needs data-parallel mesh dims \('dp_replicate',\)", mode="replicate")
    _expect_error(
        r"mode 'fully_shard' needs data-parallel mesh dims \('dp_shard',\); the mesh has \('dp_replicate', 'dp_shard'\)",
        mode="fully_shard",
        mesh=_mesh((2, 4), ("dp_replicate", "dp_shard")),
    )


def test_mesh_dims_not_named_as_expected(fake_world):
    _expect_error(r"mesh dim 'data' is not one of", mesh=_mesh((8,), ("data",)))
    _expect_error(r"a 2-D mesh needs mesh_dim_names", mesh=init_device_mesh("cpu", (2, 4)))
    _expect_error(r"ordered as", mesh=_mesh((4, 2), ("dp_shard", "dp_replicate")))
    _expect_error(r"name no data-parallel dim", mesh=_mesh((8,), ("tp",)))


def test_not_a_mesh(fake_world):
    _expect_error(r"mesh must be a DeviceMesh; got tuple", mesh=(8,))


def test_already_wrapped(fake_world):
    model = simple_fsdp(FeedForward(16, 32), _mesh())
    with pytest.raises(ValueError, match=r"module 'w1' is already wrapped by simple_fsdp"):
        simple_fsdp(model, _mesh())


def test_already_wrapped_by_fully_shard(fake_world):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(FeedForward(16, 32))
    fully_shard(model[0], mesh=_mesh())
    _expect_error(r"module '0' is already wrapped by fully_shard", model=model)


def test_meta_parameter_without_init_path(fake_world):
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(4, device="meta"))

    model = nn.Sequential(nn.Linear(4, 4), NoInit())
    _expect_error(r"parameter '1.scale' is on the meta device and NoInit has no reset_parameters", model=model)


def test_bad_mixed_precision_policy(fake_world):
    _expect_error(r"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy", mp_policy={"param_dtype": torch.bfloat16})
    _expect_error(r"mp_policy.param_dtype must be a floating-point", mp_policy=MixedPrecisionPolicy(param_dtype=torch.int8))


def test_bad_ep_degree(fake_world):
    _expect_error(r"ep must be a positive int; got 0", ep=0)

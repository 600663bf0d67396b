"""FSDP x TP: tensor-parallel blocks whose DTensor parameters SimpleFSDP shards on the dp dims.

Parity on 4 gloo ranks (``dp_shard=2 x tp=2``) against one process, eager and compiled, and the
compiled graph's collectives per mesh dim (fake 8-rank group).
"""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.models.llama import FeedForward
from simplefsdp.models.tp_plan import apply_tensor_parallel
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tests import training as T
from tests.graphs import captured_graphs

LOSS_ATOL, PARAM_ATOL = 1e-5, 5e-5


def _run(compiled):
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = simple_fsdp(apply_tensor_parallel(T.build_model(), mesh["tp"]), mesh)
    runner = torch.compile(model, fullgraph=True) if compiled else model
    dp = mesh["dp_shard"]
    losses = T.train(runner, T.batches(), dp_rank=dp.get_local_rank(), dp_size=dp.size())
    return losses, T.full_state(model)


def _body():
    return {"eager": _run(False), "compiled": _run(True)}


# one 4-rank launch runs both (55 s on 2 cores): in the slow run; the default suite checks FSDP x TP
# eagerly at the gradient level (tests/core/test_gradients.py) and its compiled graph below
@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.parametrize("run", ["eager", "compiled"])
def test_fsdp_tp_matches_single_process(run):
    model = T.build_model()
    ref_losses, ref_state = T.train(model, T.batches()), T.full_state(model)
    losses, state = T.launch_once(_body, 4)[run]
    loss_diff, param_diff = T.report(f"fsdp2xtp2/{run}", losses, ref_losses, state, ref_state)
    assert loss_diff < LOSS_ATOL and param_diff < PARAM_ATOL


def test_fsdp_tp_graph_gathers_on_dp_and_reduces_on_tp(fake_world):
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    torch._dynamo.reset()
    mlp = FeedForward(16, 32)
    parallelize_module(mlp, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})
    model = simple_fsdp(mlp, mesh)
    with captured_graphs(mesh) as graphs:
        torch.compile(model, fullgraph=True)(torch.randn(4, 16, requires_grad=True)).sum().backward()
    forward, backward = ("\n".join(line for line in g if "[" in line and not line.startswith("wait")) for g in graphs[-2:])
    tc = expecttest.TestCase()
    tc.assertExpectedInline(forward, """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_reduce[tp] sum float32""")
    tc.assertExpectedInline(backward, """\
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[tp] sum float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[tp] sum float32""")

"""Gradient-level parity on 4 gloo ranks: every composition's first-step gradients, global gradient
norm and a few SGD steps against one process on the same global batch; and replica sync.

Gradients are compared directly (``p.grad.full_tensor()``), not through AdamW, which hides their
scale: a gradient off by a factor of 2 moves AdamW's parameters almost as the right one does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from simplefsdp import gathered, simple_fsdp
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MoEConfig
from simplefsdp.train.data import rank_slice
from simplefsdp.train.grad_norm import clip_grads_
from tests import training as T

MOE = MoEConfig(**dataclasses.asdict(T.CFG), num_experts=8, top_k=2, expert_dim=32)
MOE_DIM1 = dataclasses.replace(MOE, num_experts=2, top_k=1, score_func="softmax")  # experts Shard(1) on edp
CONFIGS = {"moe": MOE, "moe_dim1": MOE_DIM1}
SGD_STEPS, SGD_LR = 3, 0.5
GRAD_RTOL = 1e-5  # largest |difference| over the largest |reference gradient|, per parameter
PARAM_ATOL = 1e-5

# name -> (config, mesh shape, dim names, ep, compiled)
RUNS = {
    "fsdp4": ("moe", (4,), ("dp_shard",), 1, False),
    "hsdp2x2": ("moe", (2, 2), ("dp_replicate", "dp_shard"), 1, False),
    "replicate4": ("moe", (4,), ("dp_replicate",), 1, False),
    "fsdp4xep2": ("moe", (4,), ("dp_shard",), 2, False),
    "fsdp4xep2/dim1_experts": ("moe_dim1", (4,), ("dp_shard",), 2, False),
    "hsdp2x2xep2": ("moe", (2, 2), ("dp_replicate", "dp_shard"), 2, False),
    "fsdp2xtp2": ("moe", (2, 2), ("dp_shard", "tp"), 1, False),
    "fsdp2xtp2xep2": ("moe", (2, 2), ("dp_shard", "tp"), 2, False),
    "hsdp2x1xtp2xep2": ("moe", (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), 2, False),
    "fsdp4xep2/compiled": ("moe", (4,), ("dp_shard",), 2, True),
    "fsdp2xtp2xep2/compiled": ("moe", (2, 2), ("dp_shard", "tp"), 2, True),
    "hsdp2x2/compiled": ("moe", (2, 2), ("dp_replicate", "dp_shard"), 1, True),
}
GROUPS = {"eager": [r for r in RUNS if not RUNS[r][4]], "compiled": [r for r in RUNS if RUNS[r][4]]}


def _first_grads_and_sgd(model, runner, cfg, dp_rank, dp_size):
    """First-step gradients (full tensors), the global gradient norm, then the parameters after SGD."""
    data = T.batches(cfg)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=SGD_LR, foreach=False)
    grads = norm = None
    for step in range(SGD_STEPS):
        tokens, labels = rank_slice(data[step], dp_rank, dp_size)
        cross_entropy_loss(runner(tokens), labels).backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters()}
            norm = clip_grads_(params, 0.0).item()
        optimizer.step()
        optimizer.zero_grad()
    return grads, norm, T.full_state(model)


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _body(group: str):
    out = {}
    for name in GROUPS[group]:
        cfg, shape, names, ep, compiled = RUNS[name]
        model, runner, dp_rank, dp_size = T.wrapped_run(CONFIGS[cfg], shape, names, ep, compiled=compiled)
        if not compiled:
            out[f"{name}/gathered"] = _gathered_in_full(model)
        out[name] = _first_grads_and_sgd(model, runner, CONFIGS[cfg], dp_rank, dp_size)
    if group == "eager":
        out["replica_sync"] = _replica_sync()
    return out


def _gathered_in_full(model):
    """Every parameter as ``gathered(model, writeback=True)`` gives it (whole: all experts, no tp split)."""
    with gathered(model, writeback=True):
        return {n: getattr(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]).clone() for n, _ in model.named_parameters()}


REPLICA_LAYOUTS = {  # every layout with dp_replicate > 1: name -> (mesh shape, dim names, ep)
    "replicate4": ((4,), ("dp_replicate",), 1),
    "hsdp2x2": ((2, 2), ("dp_replicate", "dp_shard"), 1),
    "hsdp2x2xep2": ((2, 2), ("dp_replicate", "dp_shard"), 2),
    "replicate2xtp2": ((2, 2), ("dp_replicate", "tp"), 1),
    "hsdp2x1xtp2": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), 1),
    "hsdp2x1xtp2xep2": ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), 2),
}


def _replica_sync():
    """Each rank builds the model from its own seed; after wrapping, the names of the parameters
    whose local shards differ across the ``dp_replicate`` ranks (routed experts under tp too, whose
    own mesh is ``[edp, ep]`` without that dim)."""
    from simplefsdp.models.moe import moe_transformer
    from simplefsdp.models.tp_plan import apply_tensor_parallel

    out = {}
    for name, (shape, names, ep) in REPLICA_LAYOUTS.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(100 + dist.get_rank())
        model = moe_transformer(MOE)
        if "tp" in names:
            model = apply_tensor_parallel(model, mesh["tp"])
        model = simple_fsdp(model, mesh, ep=ep)
        group = mesh["dp_replicate"].get_group()
        unequal = []
        for pname, p in model.named_parameters():
            local = p.to_local().detach().contiguous()
            peers = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(peers, local, group=group)
            if not all(torch.equal(peers[0], q) for q in peers):
                unequal.append(pname)
        out[name] = unequal
    return out


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, cfg in CONFIGS.items():
        model = T.build_model(cfg)
        out[name] = _first_grads_and_sgd(model, model, cfg, 0, 1)
    return out


def _param(run):
    return pytest.param(run, marks=pytest.mark.slow) if RUNS[run][4] else run


@pytest.mark.ranks
@pytest.mark.parametrize("run", [_param(r) for r in RUNS])
def test_gradients_match_single_process(run, references):
    grads, norm, state = T.launch_once(_body, 4, "compiled" if RUNS[run][4] else "eager")[run]
    ref_grads, ref_norm, ref_state = references[RUNS[run][0]]
    assert grads.keys() == ref_grads.keys()
    worst = max(((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()).item() for k in grads)
    print(f"{run}: max relative gradient difference {worst:.3g}")
    assert worst < GRAD_RTOL
    expected_norm = torch.nn.utils.get_total_norm(list(ref_grads.values())).item()
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    assert T.max_abs_diff(state, ref_state) < PARAM_ATOL


@pytest.mark.ranks
@pytest.mark.parametrize("run", [r for r in RUNS if not RUNS[r][4]])
def test_gathered_with_writeback_gives_every_parameter_whole(run):
    full = T.launch_once(_body, 4, "eager")[f"{run}/gathered"]
    expected = {n: p.detach() for n, p in T.build_model(CONFIGS[RUNS[run][0]]).named_parameters()}
    assert full.keys() == expected.keys()
    assert [n for n in full if not torch.equal(full[n], expected[n])] == []


@pytest.mark.ranks
def test_replicas_start_equal_whatever_each_rank_built():
    unequal = T.launch_once(_body, 4, "eager")["replica_sync"]
    assert unequal == {name: [] for name in REPLICA_LAYOUTS}

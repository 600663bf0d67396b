"""Inductor passes: per-mesh FSDP bucketing.

Graph structure in one process with the fake 8-rank process group (collectives only, waits left
out), and bitwise neutrality on gloo ranks: training compiled with the passes gives exactly the
losses and parameters of training compiled without them. That holds for reduce-scatter buckets;
all-gather buckets are not yet bitwise neutral on CPU (a strict xfail records it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp.passes as passes
from simplefsdp import simple_fsdp
from simplefsdp.models.llama import Transformer, TransformerConfig, cross_entropy_loss
from simplefsdp.models.moe import MOE_CONFIGS, MoE, moe_transformer
from simplefsdp.passes.fsdp_bucketing import FSDPBucketing, block_of, plan_buckets
from tests import training as T
from tests.graphs import captured_graphs


def _collectives(graph: list[str]) -> str:
    return "\n".join(line for line in graph if "[" in line)


def _graphs(model, tokens, graph_passes):
    with captured_graphs(model, passes=graph_passes) as graphs:
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    return graphs


def test_block_of():
    assert block_of("layers.3.attention.wq") == "layers.3"
    assert block_of("layers.11.feed_forward.experts") == "layers.11"
    assert block_of("encoder.layers.0.mlp") == "encoder.layers.0"
    assert block_of("tok_embeddings") == "root"
    assert block_of("") == "root"


def test_compile_options():
    assert passes.compile_options()["post_grad_custom_post_pass"].kinds == ("all_gather", "reduce_scatter")
    assert passes.compile_options(bucketing="reduce_scatter")["post_grad_custom_post_pass"].kinds == ("reduce_scatter",)
    assert passes.compile_options(bucketing="none") == {}
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive; got 0"):
        passes.compile_options(bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"bucketing must be one of \('all', 'reduce_scatter', 'none'\); got True"):
        passes.compile_options(bucketing=True)


def test_dense_blocks_get_one_bucket_each(tc):
    """FSDP8, 2 blocks: 21 all-gathers become 3 in forward (root, layers.0, layers.1), the 20
    backward re-gathers 3 and the 21 reduce-scatters 3."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=2)), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    tokens = torch.randint(0, 256, (2, 8))
    forward, backward = _graphs(model, tokens, [FSDPBucketing()])
    tc.assertExpectedInline(_collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32""")
    tc.assertExpectedInline(_collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32""")


def test_moe_block_gets_a_dense_and_an_expert_bucket(tc):
    """FSDP4 x EP2 on 8 ranks: the MoE block's dense parameters (attention, norms, router, shared
    experts) form one dp_shard bucket and its routed experts one edp bucket; the ep all-to-alls
    are untouched. All-gathers per forward: root + layers.0 (dense) + layers.1 (dense, experts)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, n_dense_layers=1)
    model = moe_transformer(cfg)
    for module in model.modules():  # the fake group's ties in routing: see test_moe_graphs.py
        if isinstance(module, MoE):
            module.router.expert_bias[:: cfg.num_experts // 2] = 1.0
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), ep=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    forward, backward = _graphs(model, tokens, [FSDPBucketing()])
    count = lambda graph, prefix: sum(line.startswith(prefix) for line in graph)
    assert count(forward, "all_gather_into_tensor") == 4
    tc.assertExpectedInline(_collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_to_all_single[ep] int32
all_to_all_single[ep] float32
all_gather_into_tensor[edp] float32
all_to_all_single[ep] float32""")
    tc.assertExpectedInline(_collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
all_to_all_single[ep] float32
reduce_scatter_tensor[edp] sum float32
all_to_all_single[ep] float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32""")


@pytest.mark.slow
def test_bucket_cap_splits_buckets(fake_world):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=1)), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    tokens = torch.randint(0, 256, (2, 8))
    plans = []
    cap_mb = 0.1  # a block gathers 0.165 MiB, the root (embedding, norm, output) 0.125 MiB
    forward, _ = _graphs(model, tokens, [lambda g: plans.append(plan_buckets(g, cap_mb)), FSDPBucketing(cap_mb)])
    # root: embedding + final norm, the output projection alone (not a bucket); the block in two
    assert [(b.block, len(b.params)) for b in plans[0]] == [("root", 2), ("layers.0", 7), ("layers.0", 2)]
    assert all(b.bytes <= cap_mb * 2**20 for b in plans[0])
    assert sum(line.startswith("all_gather_into_tensor") for line in forward) == 4


RUNS = {  # name -> (model config, world size, mesh dim names, ep)
    "fsdp2": (T.CFG, 2, ("dp_shard",), 1),
}


def _neutrality_body(run: str, bucketing: str):
    cfg, world, names, ep = RUNS[run]
    import torch.distributed as dist

    out = {}
    for name, options in (("plain", {}), ("passes", passes.compile_options(bucketing=bucketing))):
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=names)
        model = simple_fsdp(T.build_model(cfg), mesh, ep=ep)
        runner = torch.compile(model, fullgraph=True, options=options)
        losses = T.train(runner, T.batches(cfg), dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
        out[name] = losses, T.full_state(model)
    return out


def _assert_bitwise(run: str, bucketing: str):
    out = T.launch_once(_neutrality_body, RUNS[run][1], run, bucketing)
    (losses, state), (ref_losses, ref_state) = out["passes"], out["plain"]
    T.report(f"{run} bucketing={bucketing} vs none", losses, ref_losses, state, ref_state)
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


@pytest.mark.parametrize("run", RUNS)
def test_reduce_scatter_bucketing_changes_no_bit(run):
    _assert_bitwise(run, "reduce_scatter")


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="all-gather buckets move the same bytes, but Inductor re-fuses the copies out of the "
    "bucket with neighbouring kernels and the CPU kernels then round differently",
)
@pytest.mark.parametrize("run", RUNS)
def test_all_gather_bucketing_changes_no_bit(run):
    _assert_bitwise(run, "all")

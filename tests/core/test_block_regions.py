"""Blocks compiled once (:func:`simplefsdp.block_regions.compile_blocks_once`).

Parity on 2 gloo ranks against the whole-model compile (first-step gradients, then losses and
parameters over training; both without resharding, which regions need), the graph structure at
fake world 8 (one region body for the repeated blocks, every FSDP collective in the outer graph,
prefetch across regions), and the refusals.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import init_device_mesh

import tests.training as T
from simplefsdp import compile_blocks_once, simple_fsdp
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MOE_CONFIGS
from simplefsdp.param_access import REGION_SLOTS_ATTR
from simplefsdp.train.data import rank_slice
from simplefsdp.passes import SimpleFSDPPasses
from simplefsdp.passes.fx_utils import op_name
from simplefsdp.passes.ops import COLLECTIVES
from tests.conftest import FAKE_RANKS, fake_world_at

# one dense block, then three MoE blocks (two distinct block graphs); vocab 97 and ffn 90 give
# uneven shards
MOE = dataclasses.replace(MOE_CONFIGS["debug"], vocab_size=97, ffn_dim=90, n_layers=4)


def _first_grads_then_train(cfg, regions: bool):
    model, runner, dp_rank, dp_size = T.wrapped_run(
        cfg, (2,), ("dp_shard",), compiled=True, blocks_once=regions, reshard_after_forward=False
    )
    data = T.batches(cfg)
    tokens, labels = rank_slice(data[0], dp_rank, dp_size)
    cross_entropy_loss(runner(tokens), labels).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, T.train(runner, data, dp_rank=dp_rank, dp_size=dp_size), T.full_state(model)


def _parity_body(model: str):
    cfg = MOE if model == "moe" else T.CFG
    return {regions: _first_grads_then_train(cfg, regions) for regions in (False, True)}


@pytest.mark.ranks
@pytest.mark.parametrize("model", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_blocks_compiled_once_train_bitwise_like_the_whole_model_compile(model):
    results = T.launch_once(_parity_body, 2, model)
    grads, losses, state = results[True]
    ref_grads, ref_losses, ref_state = results[False]
    assert T.max_abs_diff(grads, ref_grads) == 0.0
    assert losses == ref_losses
    assert T.max_abs_diff(state, ref_state) == 0.0


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


class _Outline(CustomGraphPass):
    """Records each lowered graph as its region calls and collectives, in order."""

    def __init__(self):
        self.graphs: list[list[str]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        lines = []
        for node in graph.nodes:
            if node.target is torch.ops.higher_order.invoke_subgraph:
                lines.append(f"region {node.args[1]}")
            elif node.op == "call_function" and op_name(node) in COLLECTIVES:
                lines.append(op_name(node).rstrip("_"))
        self.graphs.append(lines)

    def uuid(self):
        return None


def _outlines(model, **options):
    outline = _Outline()
    chain = SimpleFSDPPasses(user_pass=outline)
    tokens = torch.randint(0, MOE.vocab_size, (2, 16))
    with torch._inductor.config.patch(post_grad_custom_post_pass=chain):
        out = torch.compile(model, fullgraph=True, options=options)(tokens)
        cross_entropy_loss(out, tokens).backward()
    return outline.graphs


def _wrapped(cfg=MOE, **kwargs):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    return simple_fsdp(T.build_model(cfg), mesh, **kwargs)


@pytest.mark.slow_on_last_rank
def test_regions_hold_the_block_math_and_the_outer_graph_every_fsdp_collective(fake_world):
    torch._dynamo.reset()
    model = compile_blocks_once(_wrapped(reshard_after_forward=False))
    graphs = _outlines(model, allow_buffer_reuse=False)
    outer = [g for g in graphs if any(line.startswith("region") for line in g)]
    bodies = [g for g in graphs if g not in outer]
    assert len(outer) == 2  # forward, backward
    # the three MoE blocks call one body each way (the dense block's single call is inlined)
    for graph, kind in zip(outer, ("fw", "bw")):
        regions = [line for line in graph if line.startswith("region")]
        assert len(regions) == 3 and len(set(regions)) == 1 and f"_{kind}_" in regions[0], graph
    assert len(bodies) == 2 and bodies == [[], []]  # no collective inside a region
    forward, backward = outer
    # buckets (root, block 0..3), and prefetch: block k+1's all-gather is issued before block k runs
    regions_at = [i for i, line in enumerate(forward) if line.startswith("region")]
    gathers_at = [i for i, line in enumerate(forward) if line.startswith("all_gather")]
    assert len(gathers_at) == 5
    for k, at in enumerate(regions_at):  # region k runs MoE block k + 1
        assert sum(g < at for g in gathers_at) == min(k + 4, 5), forward
    # backward: each block's gradients are reduce-scattered once, right after its region
    for at in (i for i, line in enumerate(backward) if line.startswith("region")):
        assert backward[at + 1].startswith("reduce_scatter"), backward
    assert sum(line.startswith("reduce_scatter") for line in backward) == 5


def test_buffer_reuse_must_be_off(fake_world):
    torch._dynamo.reset()
    model = compile_blocks_once(_wrapped(reshard_after_forward=False))
    with pytest.raises(Exception, match="need Inductor's buffer reuse off"):  # raised inside Inductor
        _outlines(model)


def _unchanged(model) -> tuple:
    return [type(m) for m in model.modules()], [sorted(vars(m)) for m in model.modules()]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "layers.0.attention_norm was wrapped with reshard_after_forward=True"),
        (dict(reshard_after_forward=False, ep=2), "block 'layers.1' holds routed experts under expert parallelism"),
    ],
    ids=["reshard", "ep"],
)
def test_refusals_change_nothing(fake_world, kwargs, message):
    model = _wrapped(**kwargs)
    before = _unchanged(model)
    with pytest.raises(ValueError, match=message):
        compile_blocks_once(model)
    assert _unchanged(model) == before


def test_refuses_a_model_not_wrapped_and_a_second_call(fake_world):
    with pytest.raises(ValueError, match="needs a model wrapped by simple_fsdp"):
        compile_blocks_once(T.build_model(MOE))
    model = compile_blocks_once(_wrapped(reshard_after_forward=False))
    with pytest.raises(ValueError, match="block 'layers.0' already compiles once"):
        compile_blocks_once(model)


def test_eager_forward_is_unchanged(fake_world):
    model = _wrapped(reshard_after_forward=False)
    tokens = torch.randint(0, MOE.vocab_size, (2, 16))
    before = model(tokens)
    compile_blocks_once(model)
    assert torch.equal(model(tokens), before)
    assert getattr(model.layers[2].attention.wq, REGION_SLOTS_ATTR) == {"weight": 1}

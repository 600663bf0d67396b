"""Blocks compiled once (:func:`simplefsdp.block_regions.compile_blocks_once`).

Parity on 2 gloo ranks against the whole-model compile (first-step gradients, then losses and
parameters over training; with resharding after forward and without, with activation
checkpointing and without), the graph structure at fake world 8 (one region body for the
repeated blocks, every FSDP collective in the outer graph, prefetch across regions, resharded
parameters gathered again in backward), and the refusals.
"""

from __future__ import annotations

import collections
import dataclasses
import operator

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import init_device_mesh

import tests.training as T
from simplefsdp import compile_blocks_once, simple_fsdp
from simplefsdp.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.hf import hf_config
from simplefsdp.models.moe import MOE_CONFIGS
from simplefsdp.param_access import REGION_SLOTS_ATTR
from simplefsdp.train.data import rank_slice
from simplefsdp.passes import SimpleFSDPPasses
from simplefsdp.passes.block_region_check import check_block_regions
from simplefsdp.passes.region_saves import RegionSaves
from simplefsdp.passes.fx_utils import op_name
from simplefsdp.passes.ops import COLLECTIVES
from tests.conftest import FAKE_RANKS, fake_world_at
from tests.graphs import post_grad_only, spread_routing
from tests.moe.hf_families import FAMILIES

# one dense block, then three MoE blocks (two distinct block graphs); vocab 97 and ffn 90 give
# uneven shards
MOE = dataclasses.replace(MOE_CONFIGS["debug"], vocab_size=97, ffn_dim=90, n_layers=4)


# model -> (config, simple_fsdp's expert parallelism: ep 2 on the 2 ranks, in 2 token chunks);
# "hf-ep" is an unmodified Hugging Face Qwen3-MoE (T.build_model), its decoder layers the blocks.
# The MoE models have one dense block and two MoE blocks: two blocks share a region body, as
# three would, with less to compile (the EP case alone: 88 s with three MoE blocks, 73 s with two).
MOE_3 = dataclasses.replace(MOE, n_layers=3)
_MODELS = {"dense": (T.CFG, {}), "moe": (MOE_3, {}), "moe-ep": (MOE_3, dict(ep=2, ep_chunks=2)),
           "hf-ep": (hf_config("qwen3_moe", **FAMILIES["qwen3_moe"]), dict(ep=2, ep_chunks=2))}


def _first_grads_then_train(model: str, regions: bool, reshard: bool, ac: str | None):
    cfg, ep = _MODELS[model]
    model, runner, dp_rank, dp_size = T.wrapped_run(
        cfg, (2,), ("dp_shard",), compiled=True, blocks_once=regions, reshard_after_forward=reshard, ac=ac, **ep
    )
    data = T.batches(cfg)
    tokens, labels = rank_slice(data[0], dp_rank, dp_size)
    out = runner(tokens)
    cross_entropy_loss(getattr(out, "logits", out), labels).backward()  # an HF model returns a ModelOutput
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, T.train(runner, data, dp_rank=dp_rank, dp_size=dp_size), T.full_state(model)


def _parity_body(model: str, reshard: bool, ac: str | None):
    return {regions: _first_grads_then_train(model, regions, reshard, ac) for regions in (False, True)}


@pytest.mark.ranks
@pytest.mark.parametrize(
    "model, reshard, ac",
    [
        ("dense", True, None),
        pytest.param("dense", True, "full", marks=pytest.mark.slow),
        pytest.param("dense", False, None, marks=pytest.mark.slow),
        pytest.param("moe", True, "selective", marks=pytest.mark.slow),
        pytest.param("moe", False, None, marks=pytest.mark.slow),
        pytest.param("moe-ep", True, "full", marks=pytest.mark.slow),
        pytest.param("hf-ep", True, "full", marks=pytest.mark.slow),
    ],
    ids=["dense-reshard", "dense-reshard-ac", "dense-keep", "moe-reshard-ac", "moe-keep", "moe-ep2-chunks-reshard-ac",
         "hf-qwen3-moe-ep2-chunks-reshard-ac"],
)
def test_blocks_compiled_once_train_bitwise_like_the_whole_model_compile(model, reshard, ac):
    results = T.launch_once(_parity_body, 2, model, reshard, ac)
    grads, losses, state = results[True]
    ref_grads, ref_losses, ref_state = results[False]
    assert T.max_abs_diff(grads, ref_grads) == 0.0
    assert losses == ref_losses
    assert T.max_abs_diff(state, ref_state) == 0.0


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


def _source_op(node) -> str | None:
    """The op that computed ``node``, looking through views, splits, getitems and waits."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
        node.target is operator.getitem or getattr(node.target, "is_view", False)
        or op_name(node) in ("wait_tensor", "split_with_sizes")
    ):
        node = node.args[0]
    return op_name(node) if isinstance(node, torch.fx.Node) else None


class _Outline(CustomGraphPass):
    """Records each lowered graph as its region calls and collectives, in order, and the ops
    that computed its outputs (a forward graph's outputs are what it saves for backward)."""

    def __init__(self):
        self.graphs: list[list[str]] = []
        self.outputs_from: list[set[str | None]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        lines = []
        for node in graph.nodes:
            if node.target is torch.ops.higher_order.invoke_subgraph:
                lines.append(f"region {node.args[1]}")
            elif node.op == "call_function" and op_name(node) in COLLECTIVES:
                lines.append(op_name(node).rstrip("_"))
        self.graphs.append(lines)
        self.outputs_from.append({_source_op(n) for n in graph.output_node().args[0]})

    def uuid(self):
        return None


def _outlines(model, **options):
    outline = _Outline()
    chain = SimpleFSDPPasses(user_pass=outline)
    tokens = torch.randint(0, MOE.vocab_size, (2, 16))
    with torch._inductor.config.patch(post_grad_custom_post_pass=chain), post_grad_only():
        out = torch.compile(model, fullgraph=True, options=options)(tokens)
        cross_entropy_loss(out, tokens).backward()
    return outline


# compile_options(blocks_once=True) without its post-grad chain (the tests set their own)
_BLOCKS_ONCE = dict(allow_buffer_reuse=False, joint_custom_pre_pass=RegionSaves())


def _wrapped(cfg=MOE, **kwargs):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    return simple_fsdp(T.build_model(cfg), mesh, **kwargs)


def _moe_regions(graph: list[str], kind: str) -> list[int]:
    """Where the three MoE blocks call their one shared body (the dense block calls its own)."""
    calls = collections.Counter(line for line in graph if line.startswith("region"))
    assert sorted(calls.values()) == [1, 3] and all(f"_{kind}_" in body for body in calls), graph
    return [i for i, line in enumerate(graph) if calls[line] == 3]


@pytest.mark.slow_on_last_rank
@pytest.mark.parametrize("ac", [pytest.param(None, marks=pytest.mark.slow), "full"])
def test_regions_hold_the_block_math_and_the_outer_graph_every_fsdp_collective(fake_world, ac):
    """With activation checkpointing too: the dense block's region is called once, and torch
    2.13's Dynamo would inline it, its gathers then feeding its checkpoint from outside."""
    torch._dynamo.reset()
    model = T.build_model(MOE)
    if ac:
        apply_activation_checkpointing(model, ac)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = compile_blocks_once(simple_fsdp(model, mesh))  # resharding after forward (the default)
    inline = getattr(torch._dynamo.config, "inline_single_use_invoke_subgraph", None)
    outline = _outlines(model, **_BLOCKS_ONCE)
    assert getattr(torch._dynamo.config, "inline_single_use_invoke_subgraph", None) == inline  # put back
    graphs = outline.graphs
    outer = [i for i, g in enumerate(graphs) if any(line.startswith("region") for line in g)]
    assert len(outer) == 2  # forward, backward
    forward, backward = (graphs[i] for i in outer)
    bodies = [g for i, g in enumerate(graphs) if i not in outer]
    assert bodies == [[], [], [], []]  # no collective inside a region (dense and MoE, fw and bw)
    # buckets (root, block 0..3), and prefetch: block k+1's all-gather is issued before block k runs
    regions_at = _moe_regions(forward, "fw")
    _moe_regions(backward, "bw")
    gathers_at = [i for i, line in enumerate(forward) if line.startswith("all_gather")]
    assert len(gathers_at) == 5
    for k, at in enumerate(regions_at):  # region k runs MoE block k + 1
        assert sum(g < at for g in gathers_at) == min(k + 4, 5), forward
    # resharded: the forward saves no gathered parameter for backward, and the backward gathers
    # each block's parameters again right before its region, and reduce-scatters its gradients
    # right after it
    assert not any(op and op.startswith("all_gather") for op in outline.outputs_from[outer[0]])
    for at in (i for i, line in enumerate(backward) if line.startswith("region")):
        assert backward[at - 1].startswith("all_gather") and backward[at + 1].startswith("reduce_scatter"), backward
    assert sum(line.startswith("reduce_scatter") for line in backward) == 5


@pytest.mark.slow  # 30-110 s of compiling; the structure test below guards the feature in the default suite
def test_routed_experts_under_ep_stay_in_the_outer_graph_between_shared_regions(fake_world):
    """FSDP8 x EP2 with resharding: an MoE block is cut into regions at its attention, router and
    shared experts, shared across blocks; its routed experts' all-to-alls run in the outer graph,
    between its router's region and its shared experts' region."""
    torch._dynamo.reset()
    model = T.build_model(MOE_3)
    spread_routing(model, 2)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    outline = _outlines(compile_blocks_once(simple_fsdp(model, mesh, ep=2)), **_BLOCKS_ONCE)
    outer = [i for i, g in enumerate(outline.graphs) if any(line.startswith("region") for line in g)]
    assert len(outer) == 2  # forward, backward
    forward, backward = (outline.graphs[i] for i in outer)
    assert [g for i, g in enumerate(outline.graphs) if i not in outer] == [[]] * 8  # 4 bodies, fw and bw
    calls = collections.Counter(line for line in forward if line.startswith("region"))
    # the dense block; the MoE blocks' attention, router and shared experts (their norms: inline)
    assert sorted(calls.values()) == [1, 2, 2, 2], forward
    runs = _runs(forward, "all_to_all")
    assert len(runs) == 2 and len({end - start for start, end in runs}) == 1, forward  # the same exchange per block
    router, shared = forward[runs[0][0] - 1], forward[runs[0][1]]
    assert router != shared and all(forward[s - 1] == router and forward[e] == shared for s, e in runs), forward
    assert calls[router] == calls[shared] == 2
    # resharded: the forward saves no gathered parameter; the backward gathers again
    assert not any(op and op.startswith("all_gather") for op in outline.outputs_from[outer[0]])
    assert sum(line.startswith("all_gather") for line in backward) == 4, backward
    assert sum(line.startswith("all_to_all") for line in backward) == 8, backward


def _runs(lines: list[str], prefix: str) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of lines starting with ``prefix``."""
    runs, start = [], None
    for i, line in enumerate([*lines, ""]):
        if line.startswith(prefix) and start is None:
            start = i
        elif not line.startswith(prefix) and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_buffer_reuse_must_be_off(fake_world):
    torch._dynamo.reset()
    model = compile_blocks_once(_wrapped(reshard_after_forward=False))
    with pytest.raises(Exception, match="need Inductor's buffer reuse off"):  # raised inside Inductor
        _outlines(model)


def test_the_joint_graph_pass_must_be_set():
    """Without it a region's backward would read the gathered parameters saved from forward,
    dropping ``reshard_after_forward`` without a word."""
    graph = torch.fx.Graph()
    region = graph.call_function(torch.ops.higher_order.invoke_subgraph, (None, "fw", ))
    region.meta["stack_trace"] = 'File "simplefsdp/block_regions.py", line 60, in _region_forward'
    with torch._inductor.config.patch(allow_buffer_reuse=False):
        with pytest.raises(ValueError, match="need the joint-graph pass that re-gathers their parameters"):
            check_block_regions(graph)
        with torch._inductor.config.patch(joint_custom_pre_pass=RegionSaves()):
            check_block_regions(graph)


def _unchanged(model) -> tuple:
    return [type(m) for m in model.modules()], [sorted(vars(m)) for m in model.modules()]


def test_refusals_change_nothing(fake_world):
    """The last block's attention is the second's: found after the first blocks passed."""
    model = T.build_model(MOE)
    model.layers[3].attention = model.layers[1].attention
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), ep=2)
    before = _unchanged(model)
    with pytest.raises(ValueError, match="module 'layers.3.attention.wq' belongs to regions 'layers.1.attention' and "
                                         "'layers.3.attention'"):
        compile_blocks_once(model)
    assert _unchanged(model) == before


def test_refuses_tensor_parallelism(fake_world):
    """A TP model is refused before anything changes (its compile failed deep in DTensor)."""
    from simplefsdp.models.tp_plan import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp_shard", "tp"))
    model = simple_fsdp(apply_tensor_parallel(T.build_model(MOE), mesh["tp"]), mesh)
    before = _unchanged(model)
    with pytest.raises(ValueError, match="parameter 'layers.0.attention.wq.weight' is tensor-parallel .mesh dim 'tp'."):
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


def test_a_block_with_routed_experts_under_ep_becomes_regions_at_its_other_submodules(fake_world):
    """The dense block is one region; an MoE block's attention, router and shared experts are
    regions of their own, numbering their parameters from 0; its routed experts and norms are
    not (the slow graph test above shows what that compiles to)."""
    model = compile_blocks_once(_wrapped(ep=2))
    region = lambda m: type(m).__name__.startswith("CompiledOnce")
    dense, moe = model.layers[0], model.layers[1]
    assert region(dense) and not any(region(m) for m in list(dense.modules())[1:])
    assert [n for n, m in moe.named_modules() if region(m)] == ["attention", "feed_forward.router", "feed_forward.shared_experts"]
    assert getattr(moe.attention.wq, REGION_SLOTS_ATTR) == {"weight": 0}
    assert getattr(moe.feed_forward.shared_experts, REGION_SLOTS_ATTR) == {"w1": 0, "w3": 1, "w2": 2}
    assert not hasattr(moe.feed_forward.experts, REGION_SLOTS_ATTR) and not hasattr(moe.ffn_norm, REGION_SLOTS_ATTR)


def test_a_hugging_face_decoder_layer_under_ep_becomes_regions_at_its_attention_and_router(fake_world):
    """An unmodified HF Qwen3-MoE: each decoder layer's ``self_attn`` (its q and k norms inside)
    and ``mlp.gate`` are regions; the routed experts and the layer norms stay in the outer graph
    (its region parity test is slow, above)."""
    model = compile_blocks_once(_wrapped(_MODELS["hf-ep"][0], ep=2))
    for layer in model.model.layers:
        assert [n for n, m in layer.named_modules() if type(m).__name__.startswith("CompiledOnce")] == ["self_attn", "mlp.gate"]
        assert getattr(layer.self_attn.q_norm, REGION_SLOTS_ATTR) == {"weight": 4}  # after q, k, v and o_proj
        assert not hasattr(layer.mlp.experts, REGION_SLOTS_ATTR) and not hasattr(layer.input_layernorm, REGION_SLOTS_ATTR)


_data_dependent_rows = torch.compiler.nested_compile_region(lambda rows, w: torch.nn.functional.silu(rows @ w))


@pytest.mark.xfail(strict=True, reason="torch 2.11 traces one region body per data-dependent size; 2.13 fails "
                                       "to guard on Eq(u1, u0) when it tries to reuse the trace")
def test_torch_shares_a_region_body_across_data_dependent_row_counts():
    """Why routed experts under ep > 1 are refused (besides the all-to-all's sizes, which a region
    loses): their rows arrive in a number known only at run time, a different unbacked size per
    chunk and block, and torch compiles one body per size, so nothing would compile once. When
    this passes, the expert math can move into a region shared by every block."""
    bodies = []

    def record(gm, example_inputs):
        bodies.extend(n.args[1] for n in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
        return gm.forward

    def two_chunks(x, counts, w):
        first, second = counts.tolist()
        torch._check(first <= x.shape[0])
        torch._check(second <= x.shape[0])
        return _data_dependent_rows(x[:first], w).sum() + _data_dependent_rows(x[:second], w).sum()

    x, w = torch.randn(16, 8), torch.randn(8, 8)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        out = torch.compile(two_chunks, backend=record, fullgraph=True)(x, torch.tensor([3, 5]), w)
    assert torch.allclose(out, two_chunks(x, torch.tensor([3, 5]), w))
    assert len(bodies) == 2 and len(set(bodies)) == 1, bodies

"""Graph structure of a compiled MoE layer at world size 8, in one process (fake process group).

For each composition the forward and backward post-grad graphs' collective sequences (with their
mesh dims) are the contract, snapshotted; where the matmuls sit is asserted as a property (routed
experts between the dispatch and the combine all-to-all). Experts here run
the CPU grouped-matmul reference (``bmm`` of each row with its expert's weight); on CUDA in bf16
they are ``_grouped_mm``. The reference's backward reads the per-row weights saved in forward,
so without checkpointing the backward graphs show no re-gather of expert weights here.

The fake process group moves no data: an all-gather repeats the local shard, so every router
score ties, and an all-to-all repeats the first rows it is given. A router bias on one expert
per ep rank sends tokens to both ep ranks, so every all-to-all has rows to move.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.activation_checkpoint import apply_activation_checkpointing
from simplefsdp.models.moe import MOE_CONFIGS, MoE, moe_transformer
from simplefsdp.models.llama import cross_entropy_loss
from tests.conftest import FAKE_RANKS, fake_world_at
from simplefsdp.passes.fx_utils import module_path, op_name, pinned_call
from tests.graphs import captured_graphs, collectives, positions, spread_routing


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


CFG = MOE_CONFIGS["debug"]  # 8 experts


def _moe_layer_graphs(shape, names, ep, passes=(), ep_chunks=None) -> tuple[list[str], list[str]]:
    """Forward and backward lines of one compiled MoE layer, after ``passes``."""
    if "tp" in names and dist.get_rank() == dist.get_world_size() - 1:
        # the fake group's counts exchange returns made-up counts; with tp, the last rank's share
        # of the rows is then empty while its receive splits are not, which the eager all-to-all
        # refuses ("inputBuffer is empty but outputSplitSizes[1] > 0")
        pytest.skip("the fake group cannot run the tp share of the dispatch on the last rank")
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    moe = MoE(CFG)
    spread_routing(moe, max(ep, 2))
    model = simple_fsdp(moe, mesh, ep=ep, ep_chunks=ep_chunks)
    x = torch.randn(2, 16, CFG.dim, requires_grad=True)
    with captured_graphs(model, passes) as graphs:
        torch.compile(model, fullgraph=True)(x).sum().backward()
    forward, backward = graphs
    chunks = model.experts.chunks if ep > 1 else 1
    _assert_experts_run_between_dispatch_and_combine(forward, chunks)
    return forward, backward


def _assert_experts_run_between_dispatch_and_combine(forward: list[str], chunks: int) -> None:
    """Three routed-expert grouped matmuls per chunk (w1, w3, w2); dense ones for the router and
    the three shared-expert weights. With ep, each chunk's run after its dispatch all-to-all and
    before its combine starts."""
    experts = positions(forward, ("bmm ", "_grouped_mm "))
    assert len(experts) == 3 * chunks, forward
    assert len(positions(forward, "mm ")) == 1 + 3, forward
    if chunks > 1 or "all_to_all_single[tokens] float32" in forward:
        all_to_alls = positions(forward, "all_to_all_single[tokens] float32")
        dispatches, combines = all_to_alls[:chunks], all_to_alls[chunks:]
        for chunk in range(chunks):
            routed = experts[3 * chunk : 3 * chunk + 3]
            assert all(dispatches[chunk] < i < combines[chunk] for i in routed), forward


@pytest.mark.slow
def test_fsdp8(tc):
    """No ep: the experts are FSDP-sharded on dp_shard like every other parameter."""
    forward, backward = _moe_layer_graphs((8,), ("dp_shard",), 1)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32""")


def test_fsdp4_ep2(tc):
    forward, backward = _moe_layer_graphs((8,), ("dp_shard",), 2)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_to_all_single[tokens] int32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
reduce_scatter_tensor[edp] sum float32
reduce_scatter_tensor[edp] sum float32
reduce_scatter_tensor[edp] sum float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32""")


@pytest.mark.slow
def test_fsdp2_tp2_ep2(tc):
    """ep borrows tp ranks: each tp rank dispatches its share of the rows, then tp all-gathers them."""
    forward, backward = _moe_layer_graphs((4, 2), ("dp_shard", "tp"), 2)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_to_all_single[tokens] int32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[tp] float32
reduce_scatter_tensor[edp] sum float32
reduce_scatter_tensor[edp] sum float32
reduce_scatter_tensor[edp] sum float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32""")


def test_hsdp2x2_tp2_ep2(tc):
    """Gradients reduce-scatter within a replica, then all-reduce across dp_replicate."""
    forward, backward = _moe_layer_graphs((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), 2)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_gather_into_tensor[edp] float32
all_to_all_single[tokens] int32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32
all_gather_into_tensor[dp_shard] float32""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[dp_replicate] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[dp_replicate] avg float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[dp_replicate] avg float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_to_all_single[tokens] float32
all_gather_into_tensor[tp] float32
all_gather_into_tensor[tp] float32
reduce_scatter_tensor[edp] sum float32
all_reduce[dp_replicate] sum float32
reduce_scatter_tensor[edp] sum float32
all_reduce[dp_replicate] sum float32
reduce_scatter_tensor[edp] sum float32
all_reduce[dp_replicate] sum float32
all_gather_into_tensor[dp_shard] float32
reduce_scatter_tensor[dp_shard] avg float32
all_reduce[dp_replicate] avg float32""")


@pytest.mark.slow_on_last_rank  # 35 s per rank on 2 cores
@pytest.mark.parametrize("ac", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_checkpointed_moe_block_regathers_and_exchanges_counts_once(fake_world, ac):
    """A checkpointed attention + MoE block compiles as one graph; backward re-gathers the
    parameters (reshard_after_forward) and replays the token all-to-alls' gradients, never the
    counts exchange."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    cfg = dataclasses.replace(CFG, n_layers=1, n_dense_layers=0)
    model = moe_transformer(cfg)
    spread_routing(model, 2)
    model = simple_fsdp(apply_activation_checkpointing(model, ac), mesh, ep=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with captured_graphs(model) as graphs:
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    forward, backward = graphs
    count = lambda graph, prefix: sum(line.startswith(prefix) for line in graph)
    assert count(forward, "all_to_all_single[tokens] int32") == 1  # one for both chunks
    assert count(backward, "all_to_all_single[tokens] int32") == 0
    assert count(forward, "all_to_all_single[tokens] float32") == 4  # dispatch and combine of 2 chunks
    assert count(backward, "all_to_all_single[tokens] float32") == 4  # their gradients
    n_params = len(list(model.parameters()))
    assert count(forward, "all_gather_into_tensor") == n_params
    assert count(backward, "reduce_scatter_tensor") == n_params
    assert count(backward, "all_gather_into_tensor[edp]") == 3  # routed experts w1, w3, w2


_ACCUMULATING = {"index_put", "index_put_", "_unsafe_index_put", "index_add", "scatter_add", "scatter_reduce"}


@pytest.mark.parametrize("ep", [1, 2])
def test_token_rows_move_by_gathers_without_accumulating_scatters(fake_world, ep):
    """Sorting token slots by expert, the ep rank's reorder by local expert and the way back are
    gathers in both directions (:mod:`simplefsdp.moe.token_slots`): no scatter that accumulates
    into a ``[rows, dim]`` buffer in either graph (plain indexing's backward is one, run with atomic
    adds). The grouped-matmul reference's scatters into ``[experts, ...]`` weight gradients stay."""
    found = []

    def spy(graph):
        for node in graph.nodes:
            val = node.meta.get("val")
            if _op(node) in _ACCUMULATING and isinstance(val, torch.Tensor) and val.dim() == 2 and val.shape[-1] == CFG.dim:
                found.append(str(node))

    _moe_layer_graphs((8,), ("dp_shard",), ep, passes=(spy,))
    assert found == []


def _op(node: torch.fx.Node):
    """The op a node calls, looking through a ``control_deps`` pin to the op it wraps."""
    return op_name(pinned_call(node))


def _data_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """A node's data inputs: a ``control_deps`` pin's order-only deps (its first arg) are not."""
    if getattr(node.target, "__name__", "") == "control_deps":
        return [n for n in node.all_input_nodes if n not in node.args[0] and n is not node.args[1]]
    return node.all_input_nodes


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), list(_data_inputs(node))
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(_data_inputs(n))
    return seen


def _chunk_schedule(graph: torch.fx.Graph):
    """Per token chunk, in the order its routed experts run: its incoming all-to-all (dispatch,
    or the combine's gradient), its outgoing one, and its routed-expert matmuls, all as graph
    positions; an all-to-all as (start, wait). Also the groups of the all-to-alls and of FSDP's
    collectives. Chunks are read from data flow alone: an all-to-all with no other one among its
    ancestors is incoming; a matmul of the routed experts belongs to the one incoming all-to-all
    it depends on."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if _op(n) == "all_to_all_single" and n.meta["val"].dtype.is_floating_point]
    ancestors = {n: _ancestors(n) for n in nodes if _op(n) in ("all_to_all_single", "bmm", "_grouped_mm", "wait_tensor")}
    waits = {}
    for n in nodes:
        if _op(n) == "wait_tensor":
            for start in starts:
                if start in _data_inputs(n):
                    waits[start] = position[n]
    incoming = [a for a in starts if not any(b in ancestors[a] for b in starts if b is not a)]
    chunks = []
    for a in incoming:
        outgoing = next(b for b in starts if a in ancestors[b])
        matmuls = [
            position[m] for m in nodes
            if _op(m) in ("bmm", "_grouped_mm")
            and module_path(m).split(".")[-1] == "experts"
            and [b for b in incoming if b in ancestors[m]] == [a]
            and outgoing not in ancestors[m]
        ]
        chunks.append({"in": (position[a], waits[a]), "out": (position[outgoing], waits[outgoing]), "experts": matmuls})
    fsdp_groups = {str(n.args[2]) for n in nodes if (_op(n) or "").startswith(("all_gather", "reduce_scatter"))}
    return chunks, {str(a.args[3]) for a in starts}, fsdp_groups


class _ScheduleCapture(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.schedules = []

    def __call__(self, graph):
        from simplefsdp.passes import SimpleFSDPPasses

        for graph_pass in SimpleFSDPPasses().passes[:-1]:  # the default passes, less the gloo guard
            graph_pass(graph)
        self.schedules.append(_chunk_schedule(graph))

    def uuid(self):
        return None


def _chunked_schedules(shape, names, ep, ep_chunks):
    if "tp" in names and dist.get_rank() == dist.get_world_size() - 1:
        pytest.skip("the fake group cannot run the tp share of the dispatch on the last rank")
    from simplefsdp.passes import SimpleFSDPPasses

    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    moe = MoE(CFG)
    spread_routing(moe, 2)  # expert 0 in every chunk: the fake group's all-to-alls repeat rank 0's rows
    model = simple_fsdp(moe, mesh, ep=ep, ep_chunks=ep_chunks)
    capture = _ScheduleCapture()
    chain = SimpleFSDPPasses(user_pass=capture)
    chain.passes = []
    x = torch.randn(2, 16, CFG.dim, requires_grad=True)
    with torch._inductor.config.patch(post_grad_custom_post_pass=chain):
        torch.compile(model, fullgraph=True)(x).sum().backward()
    return capture.schedules


@pytest.mark.slow_on_last_rank
@pytest.mark.parametrize(
    "shape,names,ep,ep_chunks",
    [
        ((8,), ("dp_shard",), 8, 2),
        pytest.param((8,), ("dp_shard",), 8, 3, marks=pytest.mark.slow),
        pytest.param((4, 2), ("dp_shard", "tp"), 2, 2, marks=pytest.mark.slow),
    ],
    ids=["fsdp8xep8", "fsdp8xep8-3chunks", "fsdp4xtp2xep2"],
)
def test_chunked_experts_run_under_the_neighbouring_chunks_all_to_alls(fake_world, shape, names, ep, ep_chunks):
    """With the default passes, forward and backward: chunk i's routed-expert matmuls run after
    chunk i+1's incoming all-to-all starts and before its wait, and chunk i+1's after chunk i's
    outgoing one starts and before its wait. The all-to-alls run on a group no FSDP collective uses."""
    for chunks, a2a_groups, fsdp_groups in _chunked_schedules(shape, names, ep, ep_chunks):
        assert len(chunks) == ep_chunks
        assert len(a2a_groups) == 1 and not a2a_groups & fsdp_groups
        for a, b in zip(chunks, chunks[1:]):
            assert len(a["experts"]) == len(b["experts"]) > 0
            start, wait = b["in"]
            assert all(start < m < wait for m in a["experts"]), (a, b)
            start, wait = a["out"]
            assert all(start < m < wait for m in b["experts"]), (a, b)

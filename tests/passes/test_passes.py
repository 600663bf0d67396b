"""Inductor passes: per-mesh FSDP bucketing, all-to-all overlap, their wiring.

Graph structure in one process with the fake 8-rank process group, and bitwise neutrality on
gloo ranks: training compiled with the default passes gives exactly the losses and parameters of
training compiled without them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import simplefsdp.passes as passes
from simplefsdp import simple_fsdp
from simplefsdp.models.llama import FeedForward, Transformer, TransformerConfig, cross_entropy_loss
from simplefsdp.models.moe import MOE_CONFIGS, MoE, moe_transformer
from simplefsdp.passes.a2a_overlap import AllToAllOverlap
from simplefsdp.passes.fsdp_bucketing import FSDPBucketing, plan_buckets
from simplefsdp.passes.region_saves import RegionSaves
from simplefsdp.passes.fx_utils import block_of, node_block, op_name, reorder, waits_of
from simplefsdp.passes.ops import COLLECTIVES
from tests import training as T
from tests.graphs import captured_graphs, post_grad_only


def _collectives(graph: list[str]) -> str:
    """The graph's collective and wait lines; a run of equal lines (the waits on one coalesced
    bucket's outputs) shows once, as ``line xN``."""
    out: list[list] = []
    for line in (line for line in graph if "[" in line):
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    return "\n".join(line if n == 1 else f"{line} x{n}" for line, n in out)


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
    lists = ("stages.0.blocks", "stages.1.blocks")
    assert block_of("stages.1.blocks.0.w1", lists) == "stages.1.blocks.0"
    assert block_of("stages['1'].blocks['0'].w1", lists) == "stages.1.blocks.0"
    assert block_of("stages.0.norm", lists) == "root"


class _Stages(nn.Module):
    """Blocks two lists deep: ``stages.S.blocks.B``, with a norm per stage."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(16), "blocks": nn.ModuleList(FeedForward(16, 32) for _ in range(2))})
            for _ in range(2)
        )

    def forward(self, x):
        for stage in self.stages:
            x = stage["norm"](x)
            for block in stage["blocks"]:
                x = x + block(x)
        return x


def test_an_explicit_block_list_gives_each_of_its_entries_a_bucket(fake_world):
    """Without it, a parameter's block is its path up to the first list index: one bucket per
    stage. Naming the block lists gives one per block, and the stages' norms join the root's bucket."""
    def forward_gathers(**options):
        torch._dynamo.reset()
        model = simple_fsdp(_Stages(), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
        plans = []
        chain = passes.compile_options(**options)["post_grad_custom_post_pass"]
        bucketing = chain.passes[0]
        graph_pass = lambda g: plans.append(plan_buckets(g, kinds=("all_gather",), blocks=bucketing.blocks))
        with captured_graphs(model, passes=[graph_pass]), torch.no_grad():  # the forward graph is enough
            torch.compile(model, fullgraph=True)(torch.randn(4, 16))
        return [(b.block, len(b.params)) for b in plans[0]]

    assert forward_gathers() == [("stages.0", 8), ("stages.1", 8)]
    lists = ["stages.0.blocks", "stages.1.blocks"]
    assert forward_gathers(blocks=lists) == [("root", 4), ("stages.0.blocks.0", 3), ("stages.0.blocks.1", 3),
                                             ("stages.1.blocks.0", 3), ("stages.1.blocks.1", 3)]


def _kinds(options) -> list:
    chain = options["post_grad_custom_post_pass"]
    return [getattr(p, "kinds", type(p).__name__) for p in chain.passes]


def test_compile_options():
    guard = "GlooOneInFlight"  # always last: see passes/gloo_one_in_flight.py
    assert _kinds(passes.compile_options()) == [("all_gather", "reduce_scatter"), "AllToAllOverlap", "FSDPPrefetch", guard]
    assert _kinds(passes.compile_options(bucketing="reduce_scatter", prefetch=0)) == [("reduce_scatter",), "AllToAllOverlap", guard]
    assert _kinds(passes.compile_options(bucketing="none", a2a_overlap=False)) == ["FSDPPrefetch", guard]
    assert passes.compile_options(prefetch=2)["post_grad_custom_post_pass"].passes[-2].in_flight == 2
    assert _kinds(passes.compile_options(bucketing="none", a2a_overlap=False, prefetch=0)) == [guard]
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive; got 0"):
        passes.compile_options(bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number of MB or None; got '64'"):
        passes.compile_options(bucket_cap_mb="64")
    with pytest.raises(ValueError, match=r"bucketing must be one of \('all', 'reduce_scatter', 'none'\); got True"):
        passes.compile_options(bucketing=True)
    with pytest.raises(ValueError, match="a2a_overlap must be True or False; got 'yes'"):
        passes.compile_options(a2a_overlap="yes")
    with pytest.raises(ValueError, match=r"prefetch must be an int >= 0 \(blocks in flight; 0: off\); got -1"):
        passes.compile_options(prefetch=-1)
    with pytest.raises(ValueError, match=r"blocks must be a non-empty list of module-list paths .*; got 'model.layers'"):
        passes.compile_options(blocks="model.layers")
    chain = passes.compile_options(blocks=["model.layers"])["post_grad_custom_post_pass"]
    assert chain.passes[0].blocks == chain.passes[-2].blocks == ("model.layers",)
    assert chain.uuid() != passes.compile_options()["post_grad_custom_post_pass"].uuid()


class _UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return b"user"


class _Recorder:
    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, is_inference=None):
        self.graphs += 1
        self.is_inference = is_inference


class _InferenceAwareUserPass(_UserPass):
    def __call__(self, graph, is_inference):
        self.calls += 1
        self.is_inference = is_inference


def test_the_chain_keeps_the_users_pass_in_every_form():
    """A user's pass runs after ours whatever its form: callable, CustomGraphPass, list, inference-aware."""
    user, function = _UserPass(), _Recorder()
    for form, expected in ((user, (user,)), (function, (function,)), ([user, function], (user, function)), (None, ())):
        with torch._inductor.config.patch(post_grad_custom_post_pass=form):
            passes.install({"a-group"})
            passes.install({"a-group"})  # once: the chain does not wrap itself
            chain = torch._inductor.config.post_grad_custom_post_pass
            assert isinstance(chain, passes.SimpleFSDPPasses) and chain.user_passes == expected
            assert passes.compile_options()["post_grad_custom_post_pass"].user_passes == expected
    passes.SimpleFSDPPasses(user_pass=[user, function])(torch.fx.Graph())
    assert user.calls == 1 and function.graphs == 1
    assert passes.SimpleFSDPPasses(user_pass=user).uuid() != passes.SimpleFSDPPasses().uuid()  # in the cache key
    assert passes.SimpleFSDPPasses(user_pass=function).uuid() is None  # a function: no caching
    # blocks compiled once: the joint-graph pass keeps the user's joint pass the same way
    assert "joint_custom_pre_pass" not in passes.compile_options()
    with torch._inductor.config.patch(joint_custom_pre_pass=user):
        options = passes.compile_options(blocks_once=True)
    joint = options["joint_custom_pre_pass"]
    assert isinstance(joint, RegionSaves) and joint.user_passes == (user,) and options["allow_buffer_reuse"] is False
    joint(torch.fx.Graph())
    assert user.calls == 2
    assert joint.uuid() != RegionSaves().uuid() and RegionSaves(user_pass=function).uuid() is None
    aware_base = getattr(torch._inductor.custom_graph_pass, "CustomInferenceAwareGraphPass", None)
    if aware_base is not None:  # torch 2.13
        aware = type("Aware", (_InferenceAwareUserPass, aware_base), {})()
        passes.SimpleFSDPPasses(user_pass=[aware])(torch.fx.Graph(), is_inference=True)
        assert aware.calls == 1 and aware.is_inference is True


def test_the_cache_key_names_this_ranks_process_groups(monkeypatch):
    """Rank 0 (ep group "1") and rank 2 (ep group "2") of one layout must not share compiled artifacts."""
    keys = {}
    for rank, groups in ((0, {"0", "1", "3"}), (2, {"0", "2", "3"}), (4, {"0", "1", "3"})):
        monkeypatch.setattr(passes, "_GROUPS", groups)
        keys[rank] = passes.SimpleFSDPPasses().uuid()
    assert keys[0] != keys[2] and keys[0] == keys[4]


def test_passes_touch_only_wrapped_models_and_keep_a_pass_set_later(fake_world):
    """Compiles of other models run the user's pass alone; a pass set after simple_fsdp joins the chain."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=None, force_disable_caches=True):
        model = simple_fsdp(FeedForward(16, 32), init_device_mesh("cpu", (8,)))
        ours = _Recorder()
        torch._inductor.config.post_grad_custom_post_pass.passes = [ours]
        later = _Recorder()
        torch._inductor.config.post_grad_custom_post_pass = later  # replaces the chain in config
        torch.compile(nn.Linear(4, 4))(torch.randn(2, 4, requires_grad=True)).sum().backward()
        chain = torch._inductor.config.post_grad_custom_post_pass
        assert isinstance(chain, passes.SimpleFSDPPasses) and chain.user_passes == (later,)
        assert (ours.graphs, later.graphs) == (0, 2)  # an unrelated model: forward and backward
        chain.passes = [ours]
        torch.compile(model)(torch.randn(4, 16)).sum().backward()
        assert (ours.graphs, later.graphs) == (2, 4)


def test_reorder_never_breaks_a_dependency():
    def f(x):
        a = x + 1
        b = a * 2
        c = x - 1
        return b + c

    gm = torch.fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    reorder(gm.graph, {nodes["mul"]: (-1,), nodes["sub"]: (-2,)})  # mul wants to go before its input
    assert [n.name for n in gm.graph.nodes] == ["x", "sub", "add", "mul", "add_1", "output"]
    gm.recompile()
    assert torch.equal(gm(torch.arange(3.0)), f(torch.arange(3.0)))


def test_dense_blocks_get_one_bucket_each(tc):
    """FSDP8, 2 blocks: 21 all-gathers become 3 in forward (root, layers.0, layers.1), the 20
    backward re-gathers 3 and the 21 reduce-scatters 3."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=2)), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    tokens = torch.randint(0, 256, (2, 8))
    forward, backward = _graphs(model, tokens, [FSDPBucketing()])
    tc.assertExpectedInline(_collectives(forward), """\
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard]
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x9
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x11""")
    tc.assertExpectedInline(_collectives(backward), """\
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x2
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x9
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x9
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]""")


@pytest.mark.skipif(
    not hasattr(torch._inductor.config, "aten_distributed_optimizations"), reason="torch 2.11 has no global bucket mode"
)
def test_bucketing_ignores_torchs_global_bucket_mode(fake_world):
    """torch 2.13's reduce-scatter merge follows a global bucket mode unless given one: ours passes
    its own, so a user's "coalesced" setting does not change what the pass emits."""
    torch._dynamo.reset()
    model = simple_fsdp(FeedForward(16, 32), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    patch = {"aten_distributed_optimizations.bucket_mode": "coalesced"}
    with torch._inductor.config.patch(patch), captured_graphs(model, [FSDPBucketing()]) as graphs:
        torch.compile(model, fullgraph=True)(torch.randn(4, 16)).sum().backward()
    forward, backward = (_collectives(g).splitlines() for g in graphs)
    assert forward == ["all_gather_into_tensor_coalesced[dp_shard] float32", "wait all_gather_into_tensor_coalesced[dp_shard] x3"]
    assert backward[-2:] == ["reduce_scatter_tensor[dp_shard] avg float32", "wait reduce_scatter_tensor[dp_shard]"]


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
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard]
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x9
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x7
all_gather_into_tensor_coalesced[edp] float32
wait all_gather_into_tensor_coalesced[edp] x3
all_to_all_single[tokens] int32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
wait all_gather_into_tensor_coalesced[dp_shard] x5""")
    tc.assertExpectedInline(_collectives(backward), """\
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x2
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x3
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
all_to_all_single[tokens] float32
wait all_to_all_single[tokens]
reduce_scatter_tensor[edp] sum float32
wait reduce_scatter_tensor[edp]
wait all_gather_into_tensor_coalesced[dp_shard] x7
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
all_gather_into_tensor_coalesced[dp_shard] float32
wait all_gather_into_tensor_coalesced[dp_shard] x9
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]""")


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


MOE = MOE_CONFIGS["debug"]
RUNS = {  # name -> (model config, mesh shape, mesh dim names, ep)
    "fsdp2": (T.CFG, (2,), ("dp_shard",), 1),
    "fsdp2xep2": (MOE, (2,), ("dp_shard",), 2),
    "fsdp2xtp2xep2": (MOE, (2, 2), ("dp_shard", "tp"), 2),
}


def _neutrality_body(run: str, bucketing: str):
    """Rank 0's losses and parameters compiled without our passes, then with them."""
    cfg, shape, names, ep = RUNS[run]
    out = {}
    for name, options in (
        ("plain", passes.compile_options(bucketing="none", a2a_overlap=False, prefetch=0)),
        ("passes", passes.compile_options(bucketing=bucketing)),
    ):
        model, runner, dp_rank, dp_size = T.wrapped_run(cfg, shape, names, ep, compile_options=options)
        losses = T.train(runner, T.batches(cfg), dp_rank=dp_rank, dp_size=dp_size)
        out[name] = losses, T.full_state(model)
    return out


def _assert_bitwise(run: str, bucketing: str):
    world = torch.Size(RUNS[run][1]).numel()
    out = T.launch_once(_neutrality_body, world, run, bucketing)
    (losses, state), (ref_losses, ref_state) = out["passes"], out["plain"]
    T.report(f"{run} passes (bucketing={bucketing}) vs none", losses, ref_losses, state, ref_state)
    assert losses == ref_losses
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


@pytest.mark.ranks
@pytest.mark.parametrize("run", ["fsdp2", *(pytest.param(r, marks=pytest.mark.slow) for r in ("fsdp2xep2", "fsdp2xtp2xep2"))])
def test_default_passes_change_no_bit(run):
    """All-gather and reduce-scatter buckets and the all-to-all overlap: every loss and parameter is unchanged."""
    _assert_bitwise(run, passes.DEFAULT_BUCKETING)


def test_a2a_overlap_moe_layer(tc):
    """FSDP4 x EP2, one token chunk: the shared experts' first two all-gathers and matmuls run between the dispatch
    all-to-all and its wait, their last between the combine and its wait; in backward the shared
    experts' gradient matmuls (with their weights' re-gathers and reduce-scatters) sit under the
    two gradient all-to-alls. Before the pass every all-to-all is waited on at once (see test_moe_graphs)."""
    from tests.moe.test_moe_graphs import _moe_layer_graphs

    forward, backward = (
        "\n".join(g) for g in _moe_layer_graphs((8,), ("dp_shard",), 2, passes=[AllToAllOverlap()], ep_chunks=1)
    )
    tc.assertExpectedInline(forward, """\
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
all_gather_into_tensor[edp] float32
wait all_gather_into_tensor[edp]
all_gather_into_tensor[edp] float32
wait all_gather_into_tensor[edp]
all_gather_into_tensor[edp] float32
wait all_gather_into_tensor[edp]
all_to_all_single[tokens] int32
wait all_to_all_single[tokens]
wait ?
all_to_all_single[tokens] float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
wait all_to_all_single[tokens]
bmm float32
bmm float32
bmm float32
all_to_all_single[tokens] float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
wait all_to_all_single[tokens]""")
    tc.assertExpectedInline(backward, """\
all_to_all_single[tokens] float32
mm float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
mm float32
wait all_to_all_single[tokens]
bmm float32
bmm float32
bmm float32
all_to_all_single[tokens] float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
mm float32
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
mm float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
addmm float32
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]
wait all_to_all_single[tokens]
reduce_scatter_tensor[edp] sum float32
wait reduce_scatter_tensor[edp]
reduce_scatter_tensor[edp] sum float32
wait reduce_scatter_tensor[edp]
reduce_scatter_tensor[edp] sum float32
wait reduce_scatter_tensor[edp]
mm float32
all_gather_into_tensor[dp_shard] float32
wait all_gather_into_tensor[dp_shard]
addmm float32
reduce_scatter_tensor[dp_shard] avg float32
wait reduce_scatter_tensor[dp_shard]""")


def _a2a_windows(lines: list[str]) -> list[list[str]]:
    """For each float all-to-all (dispatch or combine, or their gradients), the lines between it
    and its wait."""
    windows = []
    for i, line in enumerate(lines):
        if line.startswith("all_to_all_single") and line.endswith("float32"):
            name = line.split()[0]
            end = lines.index(f"wait {name}", i + 1)
            windows.append(lines[i + 1 : end])
    return windows


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,names", [((4, 2), ("dp_shard", "tp")), ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))], ids=["fsdp", "hsdp"]
)
def test_a2a_overlap_moe_layer_with_tp(fake_world, shape, names):
    """One token chunk, with TP: the combined rows are all-gathered over tp after the combine; a
    shared-expert matmul still runs under every float all-to-all, forward and backward. (Chunks
    with TP: test_moe_graphs.py's chunk schedule test.)"""
    from tests.moe.test_moe_graphs import _moe_layer_graphs

    graphs = ["\n".join(g) for g in _moe_layer_graphs(shape, names, 2, passes=[AllToAllOverlap()], ep_chunks=1)]
    for graph in graphs:
        windows = _a2a_windows(graph.splitlines())
        assert len(windows) == 2, graph
        assert all(any(line.split()[0] in ("mm", "bmm") for line in w) for w in windows), graph
    forward = graphs[0].splitlines()
    combine_wait = max(i for i, line in enumerate(forward) if line == "wait all_to_all_single[tokens]")
    assert forward[combine_wait + 1 :] == ["all_gather_into_tensor[tp] float32", "wait all_gather_into_tensor[tp]"]


@pytest.mark.slow  # about 40 s (tlparse renders the trace); tests/core/test_tracing.py covers the trace itself
def test_trace_records_the_pass_plans(fake_world, tmp_path):
    """simplefsdp.trace writes the structured trace with both passes' plans; tlparse renders them."""
    import shutil

    import simplefsdp

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = dataclasses.replace(MOE, n_layers=2, n_dense_layers=1)
    model = moe_transformer(cfg)
    for module in model.modules():  # the fake group's ties in routing: see test_moe_graphs.py
        if isinstance(module, MoE):
            module.router.expert_bias[:: cfg.num_experts // 2] = 1.0
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), ep=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with simplefsdp.trace(tmp_path) as t, post_grad_only():  # the plans are written by post-grad passes
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    (log,) = t.logs()
    text = open(log).read()
    assert text.count('"name": "simplefsdp_fsdp_buckets"') == 2  # forward and backward graphs
    assert text.count('"name": "simplefsdp_a2a_overlap"') == 2
    if shutil.which("tlparse") is None:
        pytest.skip("tlparse is not installed: the trace was written but not rendered")
    rendered = [p.name for p in (tmp_path / "tlparse").rglob("*") if p.is_file()]
    assert t.report == str(tmp_path / "tlparse" / "index.html")
    assert sum(name.startswith("simplefsdp_fsdp_buckets") for name in rendered) == 2, rendered
    assert sum(name.startswith("simplefsdp_a2a_overlap") for name in rendered) == 2, rendered


class _BucketEvents:
    """A post-grad pass that records, per graph, each collective's start and its first wait, named
    by kind and block (``all_gather layers.0``, ``wait reduce_scatter root``), in graph order."""

    def __init__(self):
        self.graphs: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        position = {n: i for i, n in enumerate(graph.nodes)}
        events = []
        for node in graph.nodes:
            collective = COLLECTIVES.get(op_name(node) or "")
            if collective is None:
                continue
            name = f"{collective.kind} {node_block(node)}"
            events += [(position[node], name), (min(position[w] for w in waits_of(node)), f"wait {name}")]
        self.graphs.append("\n".join(name for _, name in sorted(events)))


def test_prefetch_dense_blocks(tc):
    """FSDP8, 2 blocks, all-gathers bucketed per block: each block's gather is issued before the
    previous block's first wait, and each reduce-scatter is waited on one block later."""
    from simplefsdp.passes.fsdp_prefetch import FSDPPrefetch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=2)), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    tokens = torch.randint(0, 256, (2, 8))
    events = _BucketEvents()
    _graphs(model, tokens, [FSDPBucketing(), FSDPPrefetch(), events])
    forward, backward = events.graphs
    tc.assertExpectedInline(forward, """\
all_gather root
all_gather layers.0
wait all_gather root
all_gather layers.1
wait all_gather layers.0
wait all_gather layers.1""")
    tc.assertExpectedInline(backward, """\
all_gather root
all_gather layers.1
wait all_gather root
wait all_gather layers.1
reduce_scatter layers.1
all_gather layers.0
wait all_gather layers.0
wait reduce_scatter layers.1
reduce_scatter layers.0
wait reduce_scatter layers.0
reduce_scatter root
wait reduce_scatter root""")


def _gloo_guard_body():
    """On a 1-rank gloo group: two all-gathers in flight around a matmul, before and after the guard."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch.distributed as dist
    from simplefsdp.passes.fsdp_prefetch import FSDPPrefetch
    from simplefsdp.passes.gloo_one_in_flight import GlooOneInFlight
    from tests.graphs import describe

    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional

    def step(w0, w1, x):
        a0 = c10d.all_gather_into_tensor(w0, 1, group)
        a1 = c10d.all_gather_into_tensor(w1, 1, group)
        y = torch.mm(x, x)
        return torch.mm(y, c10d.wait_tensor(a0)) + torch.mm(y, c10d.wait_tensor(a1))

    def coalesced_step(w0, w1, w2, x):  # a coalesced bucket, then another gather
        a01 = c10d.all_gather_into_tensor_coalesced([w0, w1], 1, group)
        a2 = c10d.all_gather_into_tensor(w2, 1, group)
        y = torch.mm(x, x)
        return sum(torch.mm(y, c10d.wait_tensor(a)) for a in (a01[0], a01[1], a2))

    graph = make_fx(step)(torch.ones(4, 4), torch.ones(4, 4), torch.ones(4, 4)).graph
    names = {group: "world"}
    before = describe(graph, names)
    FSDPPrefetch(1)(graph)  # leaves gloo graphs alone
    after_prefetch = describe(graph, names)
    GlooOneInFlight()(graph)
    graph.lint()
    coalesced = make_fx(coalesced_step)(*[torch.ones(4, 4)] * 4).graph
    GlooOneInFlight()(coalesced)
    coalesced.lint()
    return before, after_prefetch, describe(graph, names), describe(coalesced, names)


@pytest.mark.ranks
def test_gloo_guard_keeps_one_collective_in_flight():
    from simplefsdp.train.launch import run_ranks

    before, after_prefetch, after, coalesced = run_ranks(_gloo_guard_body, 1, timeout=120)[0]
    assert before == [
        "all_gather_into_tensor[world] float32", "all_gather_into_tensor[world] float32", "mm float32",
        "wait all_gather_into_tensor[world]", "mm float32", "wait all_gather_into_tensor[world]", "mm float32",
    ]
    assert after_prefetch == before
    assert after == [
        "all_gather_into_tensor[world] float32", "wait all_gather_into_tensor[world]",
        "all_gather_into_tensor[world] float32", "mm float32",
        "mm float32", "wait all_gather_into_tensor[world]", "mm float32",
    ]
    # both outputs of a coalesced gather are waited on before the next gather starts
    assert coalesced[:4] == [
        "all_gather_into_tensor_coalesced[world] float32", "wait all_gather_into_tensor_coalesced[world]",
        "wait all_gather_into_tensor_coalesced[world]", "all_gather_into_tensor[world] float32",
    ]


def test_importing_simplefsdp_changes_no_global_state():
    """A fresh interpreter: importing simplefsdp (and its passes) leaves torch's loggers, Inductor's
    post-grad pass and Dynamo's scalar capture as they were; ``simple_fsdp`` is what sets them."""
    import subprocess
    import sys

    code = (
        "import logging, torch, torch._inductor.config as ic\n"
        "before = (ic.post_grad_custom_post_pass, torch._dynamo.config.capture_scalar_outputs)\n"
        "import simplefsdp, simplefsdp.passes\n"
        "assert logging.getLogger('torch._higher_order_ops.wrap').filters == []\n"
        "assert (ic.post_grad_custom_post_pass, torch._dynamo.config.capture_scalar_outputs) == before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

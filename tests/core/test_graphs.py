"""Graph structure of compiled SimpleFSDP: which collectives and matmuls Inductor gets, in order.

One process with the fake 8-rank process group. A SwiGLU MLP (three weights) keeps the expected
sequences short; the whole transformer is checked by counts.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import MixedPrecisionPolicy, simple_fsdp
from simplefsdp.models.llama import FeedForward, Transformer, TransformerConfig, cross_entropy_loss
from tests.conftest import FAKE_RANKS, fake_world_at
from tests.graphs import MATMUL_PREFIXES, assert_each_weight_gathered_before_use, captured_graphs, collectives, positions


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mlp_graphs(mesh, **kwargs) -> tuple[list[str], list[str]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = simple_fsdp(FeedForward(16, 32), mesh, **kwargs)
    compiled = torch.compile(model, fullgraph=True)
    with captured_graphs(mesh) as graphs:
        compiled(torch.randn(4, 16)).sum().backward()
    forward, backward = graphs[-2:]  # a cast of the inputs (mp_policy) compiles as its own graph
    if positions(forward, "all_gather"):
        assert_each_weight_gathered_before_use(forward)
    assert len(positions(forward, MATMUL_PREFIXES)) == 3  # one per weight
    return forward, backward


def test_fully_shard_mixed_precision_regathers_in_backward(tc):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    forward, backward = _mlp_graphs(mesh, mp_policy=BF16_FP32)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] bfloat16
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32""")


def test_keep_unsharded_has_no_all_gather_in_backward(tc):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    forward, backward = _mlp_graphs(mesh, mp_policy=BF16_FP32, reshard_after_forward=False)
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16""")
    tc.assertExpectedInline(collectives(backward), """\
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32
reduce_scatter_tensor[dp_shard] avg float32""")


def test_hybrid_reduce_scatters_then_all_reduces_in_param_dtype(tc):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    # reduce_dtype unset: gradients are reduced in param_dtype, as in FSDP2
    forward, backward = _mlp_graphs(mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    tc.assertExpectedInline(collectives(forward), """\
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16
all_gather_into_tensor[dp_shard] bfloat16""")
    tc.assertExpectedInline(collectives(backward), """\
all_gather_into_tensor[dp_shard] bfloat16
reduce_scatter_tensor[dp_shard] avg bfloat16
all_reduce[dp_replicate] avg bfloat16
reduce_scatter_tensor[dp_shard] avg bfloat16
all_reduce[dp_replicate] avg bfloat16
reduce_scatter_tensor[dp_shard] avg bfloat16
all_reduce[dp_replicate] avg bfloat16""")


def test_hybrid_reduces_in_reduce_dtype(fake_world):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "dp_shard"))
    forward, backward = _mlp_graphs(mesh, mp_policy=BF16_FP32)
    reductions = [line for line in backward if "avg" in line]
    assert reductions == ["reduce_scatter_tensor[dp_shard] avg float32", "all_reduce[dp_replicate] avg float32"] * 3


def test_replicate_all_reduces_gradients_only(tc):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_replicate",))
    forward, backward = _mlp_graphs(mesh)
    tc.assertExpectedInline(collectives(forward), """""")
    tc.assertExpectedInline(collectives(backward), """\
all_reduce[dp_replicate] avg float32
all_reduce[dp_replicate] avg float32
all_reduce[dp_replicate] avg float32""")


def test_transformer_gathers_every_parameter_once_per_pass(fake_world):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=2)), mesh)
    n_params = len(list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True)
    tokens = torch.randint(0, 256, (2, 8))
    with captured_graphs(mesh) as graphs:
        cross_entropy_loss(compiled(tokens), tokens).backward()
    forward, backward = graphs
    count = lambda graph, op: sum(line.startswith(op) for line in graph)
    assert count(forward, "all_gather_into_tensor") == n_params == 21
    assert count(backward, "reduce_scatter_tensor") == n_params
    # the embedding's backward needs only the token ids: every other weight is gathered again
    assert count(backward, "all_gather_into_tensor") == n_params - 1


def test_tied_weights_are_gathered_once_compiled(fake_world):
    """FSDP2 semantics under torch.compile: a weight tied between embedding and output projection
    is gathered once per forward (the root gathers it) and its gradient reduce-scattered once."""
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    model = Transformer(TransformerConfig(n_layers=2))
    model.output.weight = model.tok_embeddings.weight
    model = simple_fsdp(model, mesh)
    n_params = len(list(model.parameters()))
    tokens = torch.randint(0, 256, (2, 8))
    with captured_graphs(mesh) as graphs:
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    # the root's pre-forward hook compiles as its own graph: it gathers the tied weight first, and
    # its backward reduce-scatters that weight's summed gradient last (as FSDP2's root unit does)
    hook_forward, forward, backward, hook_backward = graphs
    forward, backward = hook_forward + forward, backward + hook_backward
    count = lambda graph, op: sum(line.startswith(op) for line in graph)
    assert count(hook_forward, "all_gather_into_tensor") == count(hook_backward, "reduce_scatter_tensor") == 1
    assert count(forward, "all_gather_into_tensor") == n_params == 20
    assert count(backward, "reduce_scatter_tensor") == n_params


def test_one_compiled_graph_serves_every_block(fake_world):
    """Blocks share one generated class, so compiling each block separately compiles once."""
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    torch._dynamo.reset()
    counters.clear()
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=3)), mesh)
    h = torch.randn(2, 8, 64, requires_grad=True)
    cos, sin = model.rotary(8)
    for block in model.layers:
        h = torch.compile(block, backend="eager")(h, cos, sin)
    assert counters["stats"]["unique_graphs"] == 1
    assert len({type(block.attention.wq) for block in model.layers}) == 1


def test_gather_regions_let_aotautograd_cache_the_graph(fake_world):
    """A selective-checkpoint region without a stable context_fn hash makes AOTAutograd bypass its
    cache for the whole graph (torch 2.13), so every compile would be cold."""
    from torch._functorch._aot_autograd import autograd_cache

    collect = getattr(autograd_cache, "_collect_context_fn_hashes", None)
    if collect is None:
        pytest.skip("this torch keys no SAC context_fn")
    hashes = []

    def backend(gm, example_inputs):
        hashes.extend(collect(gm))  # raises BypassAOTAutogradCache for a region without one
        return gm

    torch._dynamo.reset()
    model = simple_fsdp(FeedForward(16, 32), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 16))
    assert len(hashes) == 3 and len(set(hashes)) == 1  # one region per weight, all one policy


class _SavedForBackward:
    """A post-grad pass that keeps the (dtype, shape) of the tensors the first graph it sees,
    forward, computes and hands to backward (graph inputs passed through are left out)."""

    def __init__(self):
        self.saved = None

    def __call__(self, graph):
        if self.saved is None:
            outputs = [n for n in graph.output_node().args[0] if isinstance(n, torch.fx.Node) and n.op != "placeholder"]
            self.saved = {(n.meta["val"].dtype, tuple(n.meta["val"].shape)) for n in outputs if isinstance(n.meta.get("val"), torch.Tensor)}


@pytest.mark.slow_on_last_rank
@pytest.mark.parametrize("reshard", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_bf16_parameter_copies_outlive_forward_only_without_reshard(fake_world, reshard):
    """Replicate over 8 ranks gathers nothing, yet reading a parameter makes its bf16 copy. With
    reshard_after_forward that copy is recomputed in backward, as FSDP2 frees its unsharded
    parameters after forward at any world size; the partitioner saved it otherwise (at world 1
    about 0.3 GiB per gpu_moe layer). Without reshard_after_forward it is kept."""
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_replicate",))
    model = simple_fsdp(Transformer(TransformerConfig(n_layers=1)), mesh, mp_policy=BF16_FP32, reshard_after_forward=reshard)
    copies = {(torch.bfloat16, tuple(p.shape)) for p in model.parameters()}
    forward = _SavedForBackward()
    tokens = torch.randint(0, 256, (2, 8))
    with captured_graphs(model, passes=[forward]):
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    assert bool(forward.saved & copies) == (not reshard)

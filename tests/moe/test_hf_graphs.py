"""The default passes on compiled, unmodified Hugging Face MoE models at world size 8 (fake group).

* Bucketing finds HF's blocks (``model.layers.N``): a tiny DeepSeek-V3 (a dense first layer, then
  MoE layers with shared experts) gets the same collectives per process group, forward and
  backward, as this project's MoE transformer of the same structure.
* The all-to-all overlap knows HF's shared-expert forms: ``shared_experts`` (DeepSeek-V3) and
  ``shared_expert`` with its sigmoid ``shared_expert_gate`` (Qwen2-MoE). Their matmuls run inside
  the first dispatch's and the last combine's windows.

The fake group's all-gathers repeat the local shard, so every router score ties; a hook on each
router sends each token's k slots to experts on different ep ranks, so every all-to-all moves rows.
Experts run HF's ``batched_mm`` (its fp32 ``grouped_mm`` does not compile on CPU).
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("transformers")

from simplefsdp import simple_fsdp
from simplefsdp.models.hf import hf_causal_lm, hf_config
from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer
from simplefsdp.passes import SimpleFSDPPasses
from simplefsdp.passes.a2a_overlap import SHARED_EXPERTS
from simplefsdp.passes.fx_utils import module_path, op_name, pinned_call
from simplefsdp.passes.ops import MATMULS
from tests.conftest import FAKE_RANKS, fake_world_at
from tests.moe.hf_families import FAMILIES
from tests.graphs import post_grad_only

EP = 2
VOCAB = 97  # uneven over 8 ranks: rank 7 holds 6 rows (and the gate's [1, 32] weight nothing)


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


def _spread(router, args, output):
    """Slot j of every token goes to an expert of ep rank j % ep."""
    logits, weights, experts = output
    per_rank = router.num_experts // EP
    ranks = torch.arange(experts.shape[-1], device=experts.device) % EP
    return logits, weights, experts % per_rank + ranks * per_rank


def _hf_model(family: str, **fields):
    torch.manual_seed(0)
    fields = {**FAMILIES[family], "vocab_size": VOCAB, **fields}
    model = hf_causal_lm(hf_config(family, **fields), experts_implementation="batched_mm")
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(_spread)
    return model


class _Capture(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Runs the default passes (less the gloo guard) on each graph and keeps it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        for graph_pass in SimpleFSDPPasses().passes[:-1]:
            graph_pass(graph)
        self.graphs.append(graph)

    def uuid(self):
        return None


def _compiled_graphs(model, tokens) -> list[torch.fx.Graph]:
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = simple_fsdp(model, mesh, ep=EP)
    capture = _Capture()
    chain = SimpleFSDPPasses(user_pass=capture)
    chain.passes = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=chain), post_grad_only():
        out = torch.compile(model, fullgraph=True)(tokens)
        getattr(out, "logits", out).sum().backward()
    return capture.graphs


def _collective_counts(graph: torch.fx.Graph) -> collections.Counter:
    """(op, group size, dtype) -> count: groups by size, since the two models' groups are different objects."""
    counts = collections.Counter()
    for node in graph.nodes:
        name = op_name(node)
        if name and name.startswith(("all_gather", "reduce_scatter", "all_to_all")):
            group = dist.distributed_c10d._resolve_process_group(node.args[-1])
            counts[name, group.size(), str(node.meta["val"][0].dtype if isinstance(node.meta["val"], list) else node.meta["val"].dtype)] += 1
    return counts


@pytest.mark.slow  # about 100 s a rank on 2 cores
def test_hf_blocks_are_bucketed_like_ours(fake_world):
    cfg = dataclasses.replace(MOE_CONFIGS["debug"], vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=4,
                              n_dense_layers=1, num_experts=8, top_k=2, expert_dim=16, ffn_dim=48)
    tokens = torch.randint(0, VOCAB, (2, 16))
    ours = moe_transformer(cfg)
    for layer in ours.layers[1:]:
        layer.feed_forward.router.register_forward_hook(lambda r, a, out: _spread(r, a, (None, *out))[1:])
    hf = _compiled_graphs(_hf_model("deepseek_v3", num_hidden_layers=2), tokens)
    own = _compiled_graphs(ours, tokens)
    assert [_collective_counts(g) for g in hf] == [_collective_counts(g) for g in own]


def _windows_and_shared(graph: torch.fx.Graph, layer: str):
    """The (start, wait) positions of a MoE layer's first and last float all-to-all, and the
    positions of its shared-expert matmuls."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if op_name(n) == "all_to_all_single" and n.meta["val"].dtype.is_floating_point
              and module_path(n).startswith(layer)]
    wait = lambda a: next(u for u in a.users if op_name(pinned_call(u)) == "wait_tensor")  # pinned or not
    windows = [(position[a], position[wait(a)]) for a in (starts[0], starts[-1])]
    shared = [position[n] for n in nodes if op_name(pinned_call(n)) in MATMULS and module_path(n).startswith(layer)
              and set(module_path(n).split(".")) & set(SHARED_EXPERTS)]
    return windows, shared


@pytest.mark.slow  # about 60 s a rank on 2 cores
def test_gated_shared_expert_fills_the_all_to_all_windows(fake_world):
    """Qwen2-MoE: ``shared_expert`` and ``shared_expert_gate`` run while the first dispatch or the
    last combine is in flight (HF computes them before the router, outside both, as traced)."""
    tokens = torch.randint(0, VOCAB, (2, 16))
    forward = _compiled_graphs(_hf_model("qwen2_moe", num_hidden_layers=1), tokens)[0]
    windows, shared = _windows_and_shared(forward, "model.layers.0.mlp")
    assert len(shared) == 4  # gate_proj, up_proj, down_proj and the gate
    assert all(any(start < p < wait for start, wait in windows) for p in shared), (windows, shared)

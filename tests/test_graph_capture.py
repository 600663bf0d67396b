"""``tests/graphs.py``'s shortcut for graph tests: stopping Inductor after its post-grad passes
leaves those passes the graphs a full compile gives them."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import compile_options, simple_fsdp
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.models.moe import MOE_CONFIGS, moe_transformer
from tests.conftest import FAKE_RANKS, fake_world_at
from tests.graphs import captured_graphs, group_names, spread_routing


@pytest.fixture(**FAKE_RANKS)
def fake_world(request):
    yield from fake_world_at(request.param)


def _post_grad_graphs(mesh, lower: bool) -> tuple[list[str], list[list[str]]]:
    """The whole text of each graph after SimpleFSDP's default passes, and its description, for a
    dense and an MoE block under FSDP8 x EP2 (forward, backward). Each wrap makes its own token
    all-to-all group, so the text names groups by their mesh dim (as the descriptions do)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2, n_dense_layers=1)
    model = moe_transformer(cfg)
    spread_routing(model, 2)
    model = simple_fsdp(model, mesh, ep=2)
    texts = []
    default_passes = compile_options()["post_grad_custom_post_pass"].passes
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with captured_graphs(model, passes=[*default_passes, lambda graph: texts.append(str(graph))], lower=lower) as graphs:
        cross_entropy_loss(torch.compile(model, fullgraph=True)(tokens), tokens).backward()
    names = group_names(model)
    group_arg = re.compile(r"(_c10d_functional\.\w+\.default\]\(args = \(.*, )(\w+)(\), kwargs = \{\}\))$", re.M)
    return [group_arg.sub(lambda m: m[1] + names[m[2]] + m[3], text) for text in texts], graphs


@pytest.mark.slow_on_last_rank
def test_graphs_are_those_of_a_full_compile(fake_world):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    texts, graphs = _post_grad_graphs(mesh, lower=False)
    assert len(texts) == 2 and any(line.startswith("all_to_all_single[tokens]") for line in graphs[0])
    assert (texts, graphs) == _post_grad_graphs(mesh, lower=True)

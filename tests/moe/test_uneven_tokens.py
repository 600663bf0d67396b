"""Expert parallelism with a different number of tokens on each rank: none, one, many.

``generate`` with one-token steps, unequal evaluation batches and an empty last batch all give
ranks different token counts. Every rank must still issue the same collectives: the counts
exchange has one size on every rank, and there are ``ep_chunks`` dispatch and combine all-to-alls
on every rank, empty chunks included. On 2 gloo ranks (FSDP2 x EP2, 2 token chunks) one MoE layer
runs each rank's tokens, eager and compiled, and its input and weight gradients equal one process
running all the tokens (whose loss is the ranks' losses averaged, as data parallelism averages
gradients).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.models.moe import MOE_CONFIGS, MoE
from simplefsdp.moe.token_dispatch import token_chunks
from tests import training as T

CFG = MOE_CONFIGS["debug"]
# tokens on rank 0, rank 1: one token against several, none against several, several against none
COUNTS = [(1, 4), (0, 7), (5, 0)]


def _inputs(counts) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of every rank, and the weights of the loss (a weighted sum of the outputs)."""
    generator = torch.Generator().manual_seed(sum(counts))
    total = sum(counts)
    return torch.randn(total, CFG.dim, generator=generator), torch.randn(total, CFG.dim, generator=generator)


def _layer() -> MoE:
    torch.manual_seed(0)
    return MoE(CFG)


def _grads(layer, x, weights, scale: float, runner=None) -> dict[str, torch.Tensor]:
    """The gradients of ``scale * sum(layer(x) * weights)``, ``layer`` run as ``runner`` (compiled,
    say): the input's, and each parameter's in full."""
    x = x.clone().requires_grad_(True)
    ((layer if runner is None else runner)(x) * weights).sum().mul(scale).backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g
    return {"input": x.grad, **{n: full(p.grad) for n, p in layer.named_parameters()}}


def _body(compiled: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for counts in COUNTS:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        layer = simple_fsdp(_layer(), mesh, ep=2, ep_chunks=2)
        runner = torch.compile(layer, fullgraph=True) if compiled else layer
        x, weights = _inputs(counts)
        mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
        grads = _grads(layer, x[mine], weights[mine], 1.0, runner)
        inputs = [None] * dist.get_world_size()
        dist.all_gather_object(inputs, grads.pop("input"))
        out[counts] = {"input": torch.cat(inputs), **grads}
    return out


def test_token_chunks_are_always_as_many_as_asked():
    assert token_chunks(0, 2) == [(0, 0), (0, 0)]
    assert token_chunks(1, 3) == [(0, 0), (0, 0), (0, 1)]
    assert token_chunks(5, 2) == [(0, 2), (2, 5)]


@pytest.mark.ranks
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: f"{c[0]}and{c[1]}tokens")
def test_ranks_with_different_token_counts_match_one_process(counts, compiled):
    ranks = T.launch_once(_body, 2, compiled)
    layer = _layer()
    x, weights = _inputs(counts)
    # the 2 ranks' weight gradients are averaged; each input's gradient is its own rank's
    reference = _grads(layer, x, weights, 0.5)
    reference["input"] = reference["input"] * 2
    got = ranks[counts]
    assert got.keys() == reference.keys()
    for name in reference:  # expert weight gradients sum the tokens in another order
        torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)

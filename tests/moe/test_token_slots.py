"""Token slots to expert rows and back (:mod:`simplefsdp.moe.token_slots`): the same bits as plain
indexing eagerly, and under torch.compile a backward of gathers, without the atomic adds of an
accumulating scatter."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from simplefsdp.moe.token_slots import inverse_permutation, permuted_rows, repeated_rows


def _route(tokens: int, top_k: int, experts: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(top_k, -1).indices


def _ours(x, experts, w):
    k = experts.shape[1]
    order = torch.argsort(experts.flatten(), stable=True)
    inverse = inverse_permutation(order)
    rows = repeated_rows(x, order, inverse, k)
    slots = permuted_rows(rows.sin(), inverse, order)
    return (slots.view(-1, k, x.shape[1]) * w.unsqueeze(-1)).sum(1)


def _plain(x, experts, w):
    k = experts.shape[1]
    order = torch.argsort(experts.flatten(), stable=True)
    rows = x[order // k]
    slots = rows.new_empty(rows.shape).index_copy(0, order, rows.sin())
    return (slots.view(-1, k, x.shape[1]) * w.unsqueeze(-1)).sum(1)


def _out_and_grads(fn, x, experts, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, experts, w)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out, x.grad, w.grad


def test_inverse_permutation():
    order = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(11)) and torch.equal(inverse[order], torch.arange(11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 5])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_same_bits_as_plain_indexing(tokens, top_k, dtype):
    """Output and gradients equal those of ``x[order // k]`` and an index copy back, bit for bit:
    with top-5, each token's five row gradients are summed in the scatter's order."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 16, generator=g).to(dtype)
    w = torch.rand(tokens, top_k, generator=g).to(dtype)
    experts = _route(tokens, top_k)
    for ours, plain in zip(_out_and_grads(_ours, x, experts, w), _out_and_grads(_plain, x, experts, w)):
        assert torch.equal(ours, plain)


def _compiled_backward_code(fn, x, experts, w):
    """Compiled output and gradients (as :func:`_out_and_grads`) and the backward's generated code."""
    torch._dynamo.reset()
    (out, *grads), codes = run_and_get_code(_out_and_grads, torch.compile(fn, fullgraph=True), x, experts, w)
    return out, grads, codes[-1]


def test_compiled_backward_gathers_without_atomic_adds():
    """The compiled backward has no atomic add (plain indexing's has one: the scatter into zeros),
    and its values are eager's, within the rounding of the sums Inductor fuses."""
    g = torch.Generator().manual_seed(2)
    x, w, experts = torch.randn(64, 32, generator=g), torch.rand(64, 4, generator=g), _route(64, 4)
    out, grads, code = _compiled_backward_code(_ours, x, experts, w)
    assert "atomic_add" not in code
    _, _, plain_code = _compiled_backward_code(_plain, x, experts, w)
    assert "atomic_add" in plain_code
    eager_out, *eager_grads = _out_and_grads(_ours, x, experts, w)
    torch.testing.assert_close(out, eager_out)  # fp32's tolerances: the weighted sums fuse
    for grad, eager in zip(grads, eager_grads):
        torch.testing.assert_close(grad, eager)

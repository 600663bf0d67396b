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


def _grouped_experts_out_and_grads(x, experts, w, w1, pad_as_gathered: bool):
    """A MoE layer's routed path at ep 1: ``by_expert`` into a grouped SwiGLU whose expert groups
    are padded to 16 rows, either as ``by_expert`` gathers the rows or by ``aligned_groups``
    after it (two more row permutations each way, the layout before)."""
    from simplefsdp.models.moe import grouped_swiglu
    from simplefsdp.moe.token_dispatch import by_expert, token_chunks
    from simplefsdp.moe.token_permute import aligned_groups

    x, w, w1 = (t.clone().requires_grad_() for t in (x, w, w1))
    swiglu = lambda rows, counts: grouped_swiglu(rows, w1, w1.transpose(1, 2), w1, counts)
    seen = []
    if pad_as_gathered:

        def run(rows, counts):
            seen.extend((r.shape[0], c) for r, c in zip(rows, counts))
            return [swiglu(r, c) for r, c in zip(rows, counts)]

    else:
        run = lambda rows, counts: [aligned_groups(swiglu, r, c, alignment=16) for r, c in zip(rows, counts)]
    k = experts.shape[1]
    slots = by_expert(run, x, experts, w1.shape[0], chunks=2, alignment=16 if pad_as_gathered else 1)
    out = (slots.view(-1, k, x.shape[1]) * w.unsqueeze(-1)).sum(1)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    if pad_as_gathered:  # the rows came padded: each group a multiple of 16, 15 spare rows a group
        chunk_rows = [(end - start) * k + 15 * w1.shape[0] for start, end in token_chunks(x.shape[0], 2)]
        assert [rows for rows, _ in seen] == chunk_rows and all((c % 16 == 0).all() for _, c in seen)
    return out, x.grad, w.grad, w1.grad


@pytest.mark.parametrize("tokens, top_k", [(37, 2), (5, 5), (1, 1)])
def test_rows_padded_as_they_are_gathered_give_the_same_bits(tokens, top_k):
    """Rows padded to the grouped matmul's alignment as they are gathered (zero rows the experts'
    groups end on, left out on the way back) give the output and every gradient bit for bit as
    padding a sorted copy and taking the padding off again (``aligned_groups``); two token chunks."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(tokens, 8, generator=g), torch.rand(tokens, top_k, generator=g)
    w1 = torch.randn(6, 8, 8, generator=g)
    experts = _route(tokens, top_k, experts=6)
    padded = _grouped_experts_out_and_grads(x, experts, w, w1, pad_as_gathered=True)
    before = _grouped_experts_out_and_grads(x, experts, w, w1, pad_as_gathered=False)
    for ours, theirs in zip(padded, before, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_rows_padded_as_they_are_gathered_give_the_same_bits():
    """The same in bf16 on CUDA, where ``torch._grouped_mm`` and the Triton row permutation run."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(301, 64, generator=g, device="cuda").bfloat16()
    w = torch.rand(301, 2, generator=g, device="cuda").bfloat16()
    w1 = torch.randn(6, 64, 64, generator=g, device="cuda").bfloat16()
    experts = torch.rand(301, 6, generator=g, device="cuda").topk(2, -1).indices
    padded = _grouped_experts_out_and_grads(x, experts, w, w1, pad_as_gathered=True)
    before = _grouped_experts_out_and_grads(x, experts, w, w1, pad_as_gathered=False)
    for ours, theirs in zip(padded, before, strict=True):
        assert torch.equal(ours, theirs)

"""Hugging Face experts under ``simple_fsdp`` with ``ep=1``: HF's ``grouped_mm`` math without its
sentinel masks and inverse permutation (:mod:`simplefsdp.moe.hf_experts`), bitwise HF's own.

Each family's experts module, in fp32 on the CPU, computes the same outputs and the same
gradients (inputs, routing weights, every expert weight and bias) with its class swapped as with
HF's own ``grouped_mm`` forward; ``simple_fsdp`` swaps it at ``ep=1`` and leaves ``batched_mm``
and ``eager`` to HF.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("transformers")

from simplefsdp import simple_fsdp
from simplefsdp.models.hf import hf_causal_lm, hf_config
from simplefsdp.moe.hf_experts import expert_parallel_class, is_hf_experts, make_expert_parallel
from tests.moe.hf_families import FAMILIES


def _experts(family: str, impl: str = "grouped_mm"):
    torch.manual_seed(0)
    model = hf_causal_lm(hf_config(family, **FAMILIES[family]), experts_implementation=impl)
    return model, next(m for m in model.modules() if is_hf_experts(m))


def _step(experts, hidden, index, weights):
    """Output and the gradients of inputs and parameters for one backward of a fixed cotangent."""
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(hidden, index, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {"hidden": hidden.grad, "weights": weights.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters()})
    return out, grads


@pytest.mark.parametrize("top_k", [2, 5])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ep1_grouped_mm_is_bitwise_hfs_own(family, top_k):
    """Forward and every gradient equal HF's ``grouped_mm`` bit for bit (top-5: sums of five slots
    per token, whose order matters in fp32); one expert receives no token."""
    _, hf = _experts(family)
    ours = copy.deepcopy(hf)
    make_expert_parallel(ours, None)
    torch.manual_seed(1)
    tokens = 29
    hidden = torch.randn(tokens, FAMILIES[family]["hidden_size"])
    scores = torch.randn(tokens, hf.num_experts)
    scores[:, 3] = -float("inf")  # expert 3 gets no token
    weights, index = torch.softmax(scores, -1).topk(top_k, -1)
    hf_out, hf_grads = _step(hf, hidden, index, weights)
    our_out, our_grads = _step(ours, hidden, index, weights)
    assert type(ours).__name__ == f"ExpertParallel{type(hf).__name__}"
    assert torch.equal(our_out, hf_out)
    assert hf_grads.keys() == our_grads.keys()
    for name in hf_grads:
        assert torch.equal(our_grads[name], hf_grads[name]), name
    assert our_grads[next(n for n in hf_grads if n.endswith("proj"))][3].abs().sum() == 0  # no token, no gradient


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_simple_fsdp_runs_hf_grouped_mm_without_its_sort_and_keeps_other_implementations(impl, ep, fake_world, monkeypatch):
    """At ep 1 the swapped class runs HF's grouped matmuls on its own sorted rows; at ep 2 the ep
    ranks run them on the rows they receive, grouped by expert, without HF's forward sorting them
    again."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model, experts = _experts("qwen3_moe", impl)
    hf_class = type(experts)
    simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), ep=ep)
    assert isinstance(experts, expert_parallel_class(hf_class)) and (experts.expert_parallel is None) == (ep == 1)
    if ep > 1:  # the fake world's all-to-alls return made-up counts: keep every row on this rank
        monkeypatch.setattr(experts, "expert_parallel", _NoExchange(experts.expert_parallel))
    called = []
    hf_impl = ALL_EXPERTS_FUNCTIONS[impl]
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, impl, lambda *a: called.append(1) or hf_impl(*a))
    torch.manual_seed(1)
    # the fake world gathers no data: this checks which forward runs, not values
    experts(torch.randn(5, 32), torch.randint(0, 4, (5, 2)), torch.rand(5, 2))
    assert bool(called) == (impl != "grouped_mm")  # one call per token chunk at ep 2


class _NoExchange:
    """An ep dispatcher that hands each chunk's rows, all for this rank's experts, to the local
    experts without an all-to-all."""

    def __init__(self, dispatcher):
        self.num_experts, self.local_experts, self.chunks = dispatcher.num_experts, dispatcher.local_experts, dispatcher.chunks

    def __call__(self, local_experts, xs, counts):
        assert all(c[self.local_experts:].sum() == 0 for c in counts)
        return [local_experts(x, c[: self.local_experts]) for x, c in zip(xs, counts)]


def test_compiled_in_bf16_like_hfs_own_compiled():
    """fullgraph under torch.compile (bf16: HF's grouped_mm compiles there). Output, routing-weight
    and expert-weight gradients are bitwise HF's compiled ones. HF's input gradient is a scatter-add
    Inductor runs with atomics, which differs between two calls of HF's own compiled module; ours
    gathers each token's rows and adds them in one kernel, without an atomic add."""
    _, hf = _experts("qwen3_moe")
    hf = hf.to(torch.bfloat16)
    ours = copy.deepcopy(hf)
    make_expert_parallel(ours, None)
    torch.manual_seed(1)
    hidden = torch.randn(64, FAMILIES["qwen3_moe"]["hidden_size"], dtype=torch.bfloat16)
    weights, index = torch.softmax(torch.randn(64, hf.num_experts), -1).topk(4, -1)
    inputs = hidden, index, weights.to(torch.bfloat16)
    hf_out, hf_grads = _step(torch.compile(hf, fullgraph=True), *inputs)
    (our_out, our_grads), codes = run_and_get_code(_step, torch.compile(ours, fullgraph=True), *inputs)
    assert "atomic_add" not in codes[-1]  # the backward's
    assert torch.equal(our_out, hf_out)
    for name in hf_grads:
        if name == "hidden":
            torch.testing.assert_close(our_grads[name], hf_grads[name], rtol=0, atol=1e-4)
        else:
            assert torch.equal(our_grads[name], hf_grads[name]), name

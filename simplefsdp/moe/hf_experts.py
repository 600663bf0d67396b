"""Hugging Face transformers MoE experts under expert parallelism, without changing the model.

In transformers 5.x most MoE families (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss, ...)
share one experts contract: the experts module owns its weights stacked in dim 0
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; gpt-oss stores them transposed with
interleaved gate/up and stacked biases), holds the global count in ``num_experts``, and is called
as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, applying the
routing weights inside. Its class is decorated with ``@use_experts_implementation``, which sets
``has_gate``, ``has_bias``, ``is_transposed``, ``is_concatenated`` and ``config`` on every
instance and dispatches ``forward`` to ``config._experts_implementation`` (``grouped_mm``,
``batched_mm``, ``eager``, ...). That is how :func:`is_hf_experts` recognises one; ``num_experts``
alone would not do (the root model and every router carry it too).

:func:`make_expert_parallel` swaps such a module's class for a subclass (one per HF class) whose
forward routes tokens through the module's :class:`~simplefsdp.moe.token_dispatch.TokenDispatcher`
(``module.expert_parallel``, set by ``simple_fsdp``):

1. split the tokens into the dispatcher's chunks and sort each chunk's token slots by expert
   (:func:`~simplefsdp.moe.token_dispatch.by_expert`);
2. the dispatcher sends the rows to the ranks holding their experts, where they arrive grouped by
   local expert: under ``grouped_mm`` HF's grouped matmuls run on them as they are (below);
   under other implementations each row carries its local expert id, and HF's own forward runs
   on them with the ep rank's experts, ``num_experts`` set to their count, top-1 and a routing
   weight of one;
3. back home, each slot's output is weighted and the k slots of a token summed, as HF's
   ``grouped_mm`` implementation does it (in the routing weights' dtype, then cast back).

The experts' weights are read once per forward for all chunks, and HF's forward reads them from a
view (:class:`_LocalExperts`) that holds those tensors: under torch.compile every read of a
parameter traces a gather, and a read per chunk would gather, and reduce-scatter, each weight once
per chunk.

**HF's ``grouped_mm`` math without its sort.** HF's ``grouped_mm`` forward sorts the token slots by
expert, gathers their rows, zeroes "sentinel" rows (ids past ``num_experts``, which only its own
expert parallelism makes) before and after each grouped matmul, weights the rows, and un-sorts them
with a scatter of an inverse permutation and a gather. Rows that arrive grouped by expert need only
its grouped matmuls and gate (:func:`_grouped_mm_rows`, HF's own ``_grouped_linear`` and
``_apply_gate``). ``simple_fsdp`` with ``ep=1`` swaps the class too (``dispatcher=None``): its
forward (:func:`_grouped_mm_forward`) sorts with HF's own ``torch.sort``, so every row meets the
same kernels in the same order, and moves rows with :mod:`simplefsdp.moe.token_slots`, gathers
whose gradients are gathers: the token rows, whose gradient adds each token's rows in the order
HF's accumulating scatter does, and the outputs back to slot order, a gather that torch.compile
fuses into the weighted sum. Same values, same order of every sum: forward and gradients are
bitwise HF's own in eager (``tests/moe/test_hf_experts.py``); what goes is the masks (three full
passes over the rows, forward and backward), the un-sort's two permutations, and, compiled, the
atomic adds of the accumulating scatters. Other implementations (``batched_mm``, ``eager``) run as
HF wrote them.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from simplefsdp.generated_classes import generated_class
from simplefsdp.moe.token_dispatch import TokenDispatcher, by_expert, tokens_per_expert
from simplefsdp.moe.token_slots import inverse_permutation, permuted_rows, repeated_rows

# what @use_experts_implementation sets on every instance of a decorated experts class
_DECORATOR_ATTRS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "config")
_EP_CLASSES: dict[type, type] = {}


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module: decorated with ``@use_experts_implementation``, with ``num_experts``."""
    return hasattr(module, "num_experts") and all(hasattr(module, a) for a in _DECORATOR_ATTRS)


class _LocalExperts:
    """What HF's experts forward reads as ``self`` on an ep rank: the weights read once (this ep
    rank's experts), ``num_experts`` = their count, everything else from the module."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], num_experts: int):
        self.__dict__.update(weights)
        self.num_experts = num_experts
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


# implementations whose autograd graph has the same shape on every rank, whatever the routing
_STATIC_GRAPH_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


class _OneAutogradNode(torch.autograd.Function):
    """``run(rows, weights)`` as one autograd node, recomputed in backward.

    HF's ``eager`` implementation loops over the experts that received rows: its autograd graph,
    and so the order and number of backward collectives (re-gathers of saved weight slices,
    reduce-scatters, the all-to-alls on another group), would differ between ranks and hang. As
    one node it saves the rows and the whole weights once, and returns a gradient for every
    weight (zeros for an expert no row reached), on every rank alike.
    """

    @staticmethod
    def forward(ctx, run, names, rows, *weights):
        ctx.run, ctx.names = run, names
        ctx.save_for_backward(rows, *weights)
        return run(rows, dict(zip(names, weights)))

    @staticmethod
    def backward(ctx, grad):
        rows, *weights = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        inputs = [rows, *weights]
        with torch.enable_grad():
            out = ctx.run(rows, dict(zip(ctx.names, weights)))
        wanted = [t for t in inputs if t.requires_grad]
        # with no rows, the eager loop returns zeros that depend on nothing
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if out.requires_grad else [None] * len(wanted))
        full = [next(grads) if t.requires_grad else None for t in inputs]
        full = [torch.zeros_like(t) if g is None and t.requires_grad else g for g, t in zip(full, inputs)]
        return None, None, *full


def _hf_grouped_linear():
    """transformers' ``_grouped_linear`` (5.x), which :func:`_grouped_mm_rows` calls as HF's
    ``grouped_mm`` forward does, or None (then HF's own forward runs). Looked up when the class is
    made: torch 2.11's Dynamo refuses the import inside a traced forward ("Bad import result":
    transformers' modules are lazy)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "_grouped_linear", None)


def _grouped_mm_rows(grouped_linear, experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The expert outputs of ``rows`` grouped by expert (``counts[e]`` rows for expert ``e``, in
    order): the grouped matmuls, biases and gate of HF's ``grouped_mm_experts_forward``, called as
    it calls them. ``experts`` is the module or a :class:`_LocalExperts` view of it."""
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    expert_of_row = None
    if experts.has_bias:
        expert_of_row = torch.repeat_interleave(
            torch.arange(counts.shape[0], device=rows.device), counts, output_size=rows.shape[0]
        )
    bias = lambda name: getattr(experts, name)[expert_of_row] if experts.has_bias else None
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    out = grouped_linear(rows, getattr(experts, up), offsets, bias=bias(f"{up}_bias"), is_transposed=experts.is_transposed)
    out = experts._apply_gate(out) if experts.has_gate else experts.act_fn(out)
    return grouped_linear(out, experts.down_proj, offsets, bias=bias("down_proj_bias"), is_transposed=experts.is_transposed)


def _grouped_mm_forward(grouped_linear, experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's ``grouped_mm`` experts forward on one rank, without its sentinel masks and inverse
    permutation (module docstring): the same sort, rows, kernels and sums."""
    top_k = top_k_index.shape[-1]
    _, order = torch.sort(top_k_index.reshape(-1))  # HF's sort: its order within an expert, too
    inverse = inverse_permutation(order)
    rows = repeated_rows(hidden, order, inverse, top_k)
    out = _grouped_mm_rows(grouped_linear, experts, rows, tokens_per_expert(top_k_index, experts.num_experts))
    slots = permuted_rows(out, inverse, order)
    weighted = slots.view(*top_k_index.shape, hidden.shape[-1]) * top_k_weights.unsqueeze(-1)
    return weighted.sum(1).to(hidden.dtype)


def _routing_arguments(names: tuple[str, str, str], args, kwargs):
    """(hidden states, expert ids, routing weights) from a call of HF's forward, whatever it names them."""
    values = dict(zip(names, args), **kwargs)
    return tuple(values[n] for n in names)


def expert_parallel_class(hf_class: type) -> type:
    """The subclass of ``hf_class`` whose forward dispatches tokens (one per class; it pickles as
    this call, :mod:`simplefsdp.generated_classes`)."""
    if hf_class not in _EP_CLASSES:
        _EP_CLASSES[hf_class] = _make_expert_parallel_class(hf_class)
    return _EP_CLASSES[hf_class]


def _make_expert_parallel_class(hf_class: type) -> type:
    hf_forward = hf_class.forward
    grouped_linear = _hf_grouped_linear()
    # parameter names after self: (hidden_states, top_k_index, top_k_weights) in most families,
    # (hidden_states, router_indices, routing_weights) in gpt-oss
    names = tuple(inspect.signature(hf_forward).parameters)[1:4]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        hidden, top_k_index, top_k_weights = _routing_arguments(names, args, kwargs)
        dispatcher: TokenDispatcher | None = self.expert_parallel
        grouped_rows = grouped_linear is not None and self.config._experts_implementation == "grouped_mm"
        if dispatcher is None:  # ep 1
            if not grouped_rows:
                return hf_forward(self, *args, **kwargs)
            return _grouped_mm_forward(grouped_linear, self, hidden, top_k_index, top_k_weights)
        weights = {n: getattr(self, n) for n in self._parameters}  # read (gathered) once for all chunks
        one_node = self.config._experts_implementation not in _STATIC_GRAPH_IMPLEMENTATIONS

        def local_experts(rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
            if grouped_rows:
                return _grouped_mm_rows(grouped_linear, _LocalExperts(self, weights, dispatcher.local_experts), rows, group_counts)
            n = rows.shape[0]
            ids = torch.repeat_interleave(
                torch.arange(dispatcher.local_experts, device=rows.device), group_counts, output_size=n
            ).unsqueeze(1)
            ones = torch.ones(n, 1, dtype=top_k_weights.dtype, device=rows.device)
            run = lambda r, w: hf_forward(_LocalExperts(self, w, dispatcher.local_experts), r, ids, ones)
            if one_node and not torch.compiler.is_compiling():
                return _OneAutogradNode.apply(run, tuple(weights), rows, *weights.values())
            return run(rows, weights)

        slots = by_expert(
            lambda xs, counts: dispatcher(local_experts, xs, counts),
            hidden, top_k_index, dispatcher.num_experts, dispatcher.chunks,
        )
        weighted = slots.view(*top_k_index.shape, hidden.shape[-1]) * top_k_weights.unsqueeze(-1)
        return weighted.sum(1).to(hidden.dtype)

    return generated_class((expert_parallel_class, (hf_class,)), f"ExpertParallel{hf_class.__name__}", hf_class, {"forward": forward})


def make_expert_parallel(module: nn.Module, dispatcher: TokenDispatcher | None) -> None:
    """Route ``module``'s tokens through ``dispatcher``, or with None (ep 1) run HF's
    ``grouped_mm`` without its sort (class swap; the weights stay as they are)."""
    module.expert_parallel = dispatcher
    module.__class__ = expert_parallel_class(type(module))

"""Let a compiled-once block's backward read its parameters from the model's graph, so that
``reshard_after_forward`` re-gathers them there.

Inside a block compiled once (:mod:`simplefsdp.block_regions`) AOTAutograd partitions the region
on its own: the forward body returns what the backward body needs, the gathered parameters it
was handed included (as themselves, or as views such as a transposed weight). In the model's
joint graph the backward region then reads forward *outputs* of the region, not the gathers that
produced its inputs, so the partitioner cannot re-gather them: every gathered parameter would
live from forward to backward, as if ``reshard_after_forward`` were off.

This joint-graph pass (Inductor's ``joint_custom_pre_pass``, run before the model's graph is
partitioned and after the region bodies are) finds each saved forward output of our regions
that is an input of the body, or a chain of views of one, and hands the backward region that
input instead, replaying the views in the model's graph. The partitioner then re-gathers a
resharded parameter in backward (its gather is ``MUST_RECOMPUTE``), as it does outside regions.
Values are unchanged: a view replayed on the same tensor is the same tensor, so gradients stay
bitwise equal. Saved values the body computed (activations, per-token copies of expert weights)
stay as they are.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.node import map_arg

from simplefsdp.passes.chain import PassChain

REGION_CALL = "_region_forward"  # the frame in simplefsdp/block_regions.py that calls the region
_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def is_block_region(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls the region of a block compiled once."""
    return node.target is _INVOKE_SUBGRAPH and REGION_CALL in (node.meta.get("stack_trace") or "")


def _views_of_input(value: torch.fx.Node, inputs: list[torch.fx.Node]):
    """(input index, views from it to ``value``) when ``value`` is a body input or views of one."""
    views = []
    while value not in inputs:
        if value.op != "call_function" or not getattr(value.target, "is_view", False):
            return None
        rest = (value.args[1:], value.kwargs)
        if any(isinstance(a, torch.fx.Node) for a in _flatten(rest)):
            return None  # a view sized by a value of the body
        views.append(value)
        value = value.args[0]
    return inputs.index(value), views[::-1]


def _flatten(args) -> list:
    found = []
    map_arg(args, found.append)
    return found


def _replay(graph: torch.fx.Graph, source: torch.fx.Node, views: list[torch.fx.Node]) -> torch.fx.Node:
    """``views`` applied to ``source`` in ``graph``, right after it."""
    value = source
    for view in views:
        with graph.inserting_after(value):
            node = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
        example = value.meta["val"]
        with example.fake_mode:
            node.meta["val"] = view.target(example, *view.args[1:], **view.kwargs)
        value = node
    return value


def read_region_inputs_from_outer_graph(graph: torch.fx.Graph) -> None:
    """Rewire each backward region to read the forward region's inputs (module docstring)."""
    module = graph.owning_module
    for forward in list(graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)):
        if not is_block_region(forward):
            continue
        body = getattr(module, forward.args[0].target)
        inputs = list(body.graph.find_nodes(op="placeholder"))
        outputs = body.graph.output_node().args[0]
        for saved in [u for u in forward.users if u.target is operator.getitem]:
            backward = [u for u in saved.users if u.target is _INVOKE_SUBGRAPH]
            found = _views_of_input(outputs[saved.args[1]], inputs) if backward else None
            if found is None:
                continue
            index, views = found
            replacement = _replay(graph, forward.args[2 + index], views)
            for user in backward:
                user.replace_input_with(saved, replacement)


class RegionSaves(PassChain):
    """:func:`read_region_inputs_from_outer_graph`, then the user's joint-graph pass."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        read_region_inputs_from_outer_graph(graph)
        self.run_user_passes(graph)

    def uuid(self):
        return self.chain_uuid(__file__, ())

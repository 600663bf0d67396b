"""FX helpers shared by the passes: what a node is (op, process group, module), and reordering.

The scheduling passes say *where* nodes should go by giving them keys; :func:`reorder` turns keys
into a valid order: a topological sort that always takes, among the ready nodes, the one with the
smallest key. A node keyed ahead of one of its inputs simply waits for it, so no key assignment
can produce an invalid graph. A collective also waits for the previous collective of its process
group: moving a collective past one of another group is fine (every rank runs the same pass on
the same graph), but each group's own sequence never changes, and :func:`reorder` checks that
on its result. :func:`record_plan` writes a pass's decisions to the structured trace.
"""

from __future__ import annotations

import heapq
import json
import operator
import re
from collections import defaultdict

import torch
from torch._logging import trace_structured

from simplefsdp.passes.ops import COLLECTIVES

_LIST_INDEX = re.compile(r"^(.*?(?:\.\d+|\['\d+'\]))(?:\.|\[|$)")
_INDEX = re.compile(r"\['([^']*)'\]|\[(\d+)\]")  # layers['3'] / layers[3] in Dynamo's paths
_DYNAMO_PREFIX = re.compile(r"^L\['self'\]\.?|^L\['[^']*'\]\.?")

def op_name(node: torch.fx.Node) -> str | None:
    """The aten/c10d op name of a call (``bmm``, ``wait_tensor``, ...), else None."""
    if node.op != "call_function":
        return None
    return getattr(node.target, "_opname", None)


def module_path(node: torch.fx.Node) -> str:
    """The path of the module whose parameter this collective moves ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _DYNAMO_PREFIX.sub("", path)


def block_of(path: str, lists: tuple[str, ...] = ()) -> str:
    """``layers.3.attention.wq`` -> ``layers.3`` (the path up to its first list index); a path
    with no list index -> ``root``.

    ``lists`` names the block lists instead (dotted paths such as ``stages.0.blocks``): a path
    under one of them -> its entry there (``stages.0.blocks.1``); any other path -> ``root``.
    """
    if lists:
        dotted = _INDEX.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), path)
        for prefix in lists:
            if dotted.startswith(prefix + "."):
                return f"{prefix}.{dotted[len(prefix) + 1:].split('.', 1)[0]}"
        return "root"
    match = _LIST_INDEX.match(path)
    return match.group(1) if match else "root"


BLOCK_META = "simplefsdp_block"  # set on nodes a pass creates (merged buckets), which have no module path


def node_block(node: torch.fx.Node, lists: tuple[str, ...] = ()) -> str:
    """The block of the parameter a collective moves: :func:`block_of` its module path."""
    return node.meta.get(BLOCK_META) or block_of(module_path(node), lists)


def input_closure(collectives: list[torch.fx.Node]) -> set[torch.fx.Node] | None:
    """Every non-placeholder node the collectives' inputs are computed from; None if one is a collective.

    For FSDP gathers these are casts, pads and views of the shards (graph inputs); a gather of
    activations (the tp gather after an expert combine) depends on other collectives.
    """
    needed: set[torch.fx.Node] = set()
    stack = [i for n in collectives for i in n.all_input_nodes]  # a coalesced op has a list of inputs
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node.op == "placeholder" or node in needed:
            continue
        if collective_group(node) is not None or op_name(node) == "wait_tensor":
            return None
        needed.add(node)
        stack.extend(node.all_input_nodes)
    return needed


def waits_of(start: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``wait_tensor`` nodes on a collective's results: one on its result, or for a coalesced
    collective one per output (``collective -> getitem[i] -> wait``)."""
    outputs = [u for u in start.users if u.op == "call_function" and u.target is operator.getitem] or [start]
    return [u for out in outputs for u in out.users if op_name(u) == "wait_tensor"]


def pinned_call(node: torch.fx.Node) -> torch.fx.Node:
    """The node itself, or for a node :func:`pin_after` wrapped in ``control_deps`` (args
    ``(deps, subgraph, inputs...)``), the call it wraps (a node of the subgraph)."""
    if getattr(node.target, "__name__", "") == "control_deps":
        subgraph = getattr(node.graph.owning_module, node.args[1].target).graph
        return next(n for n in subgraph.nodes if n.op == "call_function")
    return node


def waited_collective(wait: torch.fx.Node, call: torch.fx.Node) -> torch.fx.Node:
    """The collective a ``wait_tensor`` node waits for. ``call`` is the wait op itself, or for a
    wait a pass pinned with ``control_deps`` (args ``(deps, subgraph, input)``) the op it wraps;
    the wait on one output of a coalesced collective reads it through ``getitem``."""
    waited = wait.args[2] if call is not wait else wait.args[0]
    return waited.args[0] if waited.op == "call_function" and waited.target is operator.getitem else waited


def collective_group(node: torch.fx.Node) -> str | None:
    """The process-group name a functional collective runs on, None for other nodes."""
    collective = COLLECTIVES.get(op_name(node) or "")
    return None if collective is None else str(node.args[collective.group_arg])


def is_gloo(group_name: str) -> bool:
    """Whether a process group name resolves, in this process, to a gloo group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).name() == "gloo"
    except (RuntimeError, ValueError):  # not a registered group here
        return False


def runs_on_gloo(graph: torch.fx.Graph) -> bool:
    """Whether any collective of ``graph`` runs on a gloo group (see :mod:`.gloo_one_in_flight`)."""
    return any(is_gloo(group) for group in collective_sequences(graph))


def collective_sequences(graph: torch.fx.Graph) -> dict[str, list[str]]:
    """Per process group, the names of its collectives in graph order."""
    out: dict[str, list[str]] = defaultdict(list)
    for node in graph.nodes:
        group = collective_group(node)
        if group is not None:
            out[group].append(node.name)
    return dict(out)


def reorder(graph: torch.fx.Graph, keys: dict[torch.fx.Node, tuple]) -> None:
    """Re-sort the graph's nodes: smallest key first among those ready; default key: position.

    A node is ready when its inputs are placed and, for a collective, when the previous
    collective of its process group is placed, so each group's sequence stays as it was.
    Placeholders stay first and the output last. Keys are compared as tuples; a node without
    one gets ``(its position,)``.
    """
    before = collective_sequences(graph)
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(graph.nodes)}
    key = lambda n: keys.get(n, (position[n],)) + (position[n],)
    after: dict[torch.fx.Node, list[torch.fx.Node]] = {n: list(n.users) for n in nodes}
    body = set(nodes)
    missing = {n: sum(1 for i in n.all_input_nodes if i in body) for n in nodes}
    last_of_group: dict[str, torch.fx.Node] = {}
    for n in nodes:
        group = collective_group(n)
        if group is not None:
            if group in last_of_group:
                after[last_of_group[group]].append(n)
                missing[n] += 1
            last_of_group[group] = n
    ready = [(key(n), n) for n in nodes if missing[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in after[node]:
            if user in missing:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, (key(user), user))
    assert len(order) == len(nodes), "the graph has a cycle"
    output = graph.output_node()
    for node in order:  # each moves to the end, just before the output
        output.prepend(node)
    if collective_sequences(graph) != before:
        raise AssertionError("reorder changed the order of a process group's collectives")


def pin_after(graph: torch.fx.Graph, after: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """Make Inductor schedule each key node after the listed nodes (FX order alone is a hint).

    Uses Inductor's control dependencies (``control_deps``, wrapping the node) where this torch
    has them; elsewhere the FX order stands. A key node may be listed after an earlier key node:
    the earlier is wrapped first (dict order) and the later refers to its wrapped form.
    """
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:
        return
    if after:
        preserve_node_ordering(graph, {node: OrderedSet(deps) for node, deps in after.items()})


def record_plan(artifact: str, plan: list) -> None:
    """Write a pass's plan (JSON-able) to the structured trace as ``artifact``; tlparse shows it."""
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": artifact, "encoding": "json"},
        payload_fn=lambda: json.dumps(plan),
    )
